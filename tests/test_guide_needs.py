"""The user guide's statement of what the Llama-2-7B torchrun command needs is what calibration_needs computes."""
import re
from pathlib import Path

from fisherkron.hf.budget import calibration_needs

GUIDE = Path(__file__).resolve().parents[1] / "book" / "guide.md"


def _llama2_7b_shapes() -> dict[str, tuple[int, int]]:
    """Llama-2-7B's block linears (out x in): 32 blocks of q, k, v, o (4096 x 4096), gate and up
    (11008 x 4096) and down (4096 x 11008)."""
    shapes = {f"{i}.{p}": (4096, 4096) for i in range(32) for p in "qkvo"}
    shapes.update({f"{i}.{p}": (11008, 4096) for i in range(32) for p in ("gate", "up")})
    shapes.update({f"{i}.down": (4096, 11008) for i in range(32)})
    return shapes


def test_the_guide_states_the_computed_needs_of_its_llama_command():
    text = GUIDE.read_text(encoding="utf-8")
    command = re.search(r"torchrun --nproc_per_node=8 .*?--out", text, re.S).group(0)
    opts = dict(re.findall(r"--(k|batch-size|seq-len|grad-dtype|max-disk) (\S+)", command))
    kw = dict(k=int(opts["k"]), batch_size=int(opts["batch-size"]), seq_len=int(opts["seq-len"]),
              grad_dtype=opts["grad-dtype"], params=6_738_415_616, param_bytes=2)
    free = calibration_needs(_llama2_7b_shapes(), **kw)
    bound = calibration_needs(_llama2_7b_shapes(), max_disk=opts["max-disk"], **kw)
    said = text.split("**What it needs**", 1)[1].split("\n\n", 1)[0].replace("\n", " ")
    gb = lambda b: f"{b / 1e9:,.0f} GB"  # noqa: E731
    expected = [f"take {gb(free['gradient_bytes'])} of disk", f"({gb(free['disk_bytes'])} with MFF's factors)",
                f"in {free['passes']} forward + backward passes", f"in {bound['groups']} groups",
                f"at most {gb(bound['disk_bytes_bounded'])} on disk", f"in {bound['passes']} passes",
                f"works is {gb(free['min_max_disk'])}", f"Llama-2-7B's {free['layers']} layers"]
    for phrase in expected:
        assert phrase in said, f"the guide should say {phrase!r}: {said}"
