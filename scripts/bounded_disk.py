"""Calibration under a disk bound on SmolLM2-135M: unbounded against max_disk, and the models they compress to.

GFWSVD's calibration (k = 8 batches of 2 x 256 C4 tokens, gradients in bfloat16, the 210 layers of the
30 blocks) is collected twice into fresh cache folders: without a bound, and with max_disk = 2.6 GB, the
finished entry (MFF's float64 factors, manifest) and room for about a tenth of the unbounded gradients.
Each is followed by compression at ratio 0.2 (uniform), which runs MFF on the unbounded entry and reads
the factors the bounded one kept. Printed as one JSON line: wall times, forward + backward passes,
the peak bytes under each cache folder (measured after every gradient file's reservation, every
np.save and before every atomic rename), the dry-run estimates against the files, the largest
logit difference of the two compressed models and their PTB perplexity (first 4,096 tokens).

Run: nice -n 10 .venv/bin/python scripts/bounded_disk.py > scripts/bounded_disk.log (16 min on 2 shared cores).
"""
import copy
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import fisherkron as fk  # before torch: its OpenMP threads then wait passively

import numpy as np
import torch

from fisherkron.hf.budget import calibration_needs
from fisherkron.hf.calibration import collect as collect_module
from fisherkron.hf.calibration import parse_size
from fisherkron.hf.calibration.bounded import folder_bytes

K, BATCH, SEQ, GRAD_DTYPE, RATIO = 8, 2, 256, "bfloat16", 0.2
#: the finished entry (2.44 GB, nearly all MFF's float64 factors) and room for about a tenth of the 1.70 GB of
#: unbounded gradients beside it: the smallest bound that works is 2.47 GB
MAX_DISK = "2.6GB"
PPL = dict(seq_len=512, max_tokens=4096)

peak = {"root": None, "bytes": 0}


def _record():
    if peak["root"] is not None and peak["root"].exists():
        peak["bytes"] = max(peak["bytes"], folder_bytes(peak["root"]))


def _after(fn):
    def wrapped(*a, **kw):
        out = fn(*a, **kw)
        _record()
        return out
    return wrapped


def _before(fn):
    def wrapped(*a, **kw):
        _record()
        return fn(*a, **kw)
    return wrapped


collect_module.preallocate = _after(collect_module.preallocate)
np.save = _after(np.save)
os.replace = _before(os.replace)


def run(model, batches, folder: Path, **bound) -> dict:
    """Collect (with ``bound``), then compress a copy of ``model``; times, passes and the peak under ``folder``."""
    peak.update(root=folder, bytes=0)
    t0 = time.perf_counter()
    stats = fk.collect_calibration(model, batches, methods=["gfwsvd"], grad_dtype=GRAD_DTYPE, cache_dir=folder,
                                   **bound)
    t1 = time.perf_counter()
    small = copy.deepcopy(model)
    fk.compress(small, "gfwsvd", stats, ratio=RATIO)
    t2 = time.perf_counter()
    _record()
    man = json.loads((stats.dir / "manifest.json").read_text())
    out = {"collect_s": round(t1 - t0, 1), "compress_s": round(t2 - t1, 1), "total_s": round(t2 - t0, 1),
           "groups": len(man.get("groups", [stats.layers])), "passes": man.get("passes", K),
           "peak_bytes": peak["bytes"], "entry_bytes": folder_bytes(stats.dir),
           "gradient_file_bytes": sum(f.stat().st_size for f in stats.dir.glob("*.grads.npy"))}
    peak["root"] = None
    return out, small


def main():
    t_start = time.perf_counter()
    load = os.getloadavg()
    torch.manual_seed(0)
    model, tok = fk.load_model("smollm2")
    batches = fk.lm_batches(tok, fk.c4_documents(), k=K, batch_size=BATCH, seq_len=SEQ, seed=0)
    need = calibration_needs(model, methods=["gfwsvd"], k=K, batch_size=BATCH, seq_len=SEQ, grad_dtype=GRAD_DTYPE)
    max_disk = parse_size(MAX_DISK)
    under = calibration_needs(model, methods=["gfwsvd"], k=K, batch_size=BATCH, seq_len=SEQ, grad_dtype=GRAD_DTYPE,
                              max_disk=max_disk)
    root = Path(tempfile.mkdtemp(prefix="bounded-disk-"))
    try:
        whole, a = run(model, batches, root / "unbounded")
        part, b = run(model, batches, root / "bounded", max_disk=max_disk)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    ids = torch.cat([x["input_ids"] for x in batches[:2]])
    with torch.no_grad():
        diff = (a(input_ids=ids).logits - b(input_ids=ids).logits).abs().max().item()
    ptb = fk.ptb("test")
    ppl = {"unbounded": fk.perplexity(a, tok, ptb, **PPL).ppl, "bounded": fk.perplexity(b, tok, ptb, **PPL).ppl}
    same = all(torch.equal(p, q) for p, q in zip(a.state_dict().values(), b.state_dict().values()))
    print(json.dumps({
        "model": "smollm2", "method": "gfwsvd", "ratio": RATIO, "k": K, "batch_size": BATCH, "seq_len": SEQ,
        "grad_dtype": GRAD_DTYPE, "layers": need["layers"], "threads": torch.get_num_threads(),
        "load_average_at_start": [round(x, 2) for x in load],
        "max_disk": max_disk, "unbounded": whole, "bounded": part,
        "estimate": {"gradient_bytes": need["gradient_bytes"], "factor_bytes": need["factor_bytes"],
                     "disk_bytes": need["disk_bytes"], "min_max_disk": need["min_max_disk"],
                     "disk_bytes_bounded": under["disk_bytes_bounded"], "groups": under["groups"],
                     "passes": under["passes"], "memory_bytes": need["memory_bytes"],
                     "memory_bytes_bounded": under["memory_bytes"]},
        "gradient_estimate_error": abs(need["gradient_bytes"] - whole["gradient_file_bytes"])
        / whole["gradient_file_bytes"],
        "weights_identical": same, "logits_max_abs_diff": diff,
        "ptb_ppl": {key: round(v, 4) for key, v in ppl.items()},
        "wall_s": round(time.perf_counter() - t_start, 1)}))


if __name__ == "__main__":
    main()
