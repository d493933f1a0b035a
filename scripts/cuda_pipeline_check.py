"""The Hugging Face pipeline on a CUDA device against the same pipeline on the CPU (a tiny random Llama).

    python scripts/cuda_pipeline_check.py            # on a machine with a GPU (scripts/gpu_check.sh runs it)
    python scripts/cuda_pipeline_check.py --device cpu   # the script itself, CPU against CPU

For one seeded tiny Llama (``tests/tiny_models.py``, 2 blocks, every linear layer) and seeded
token batches: :func:`fisherkron.collect_calibration` with the model on ``--device`` (batches
moved there by the collector) into its own cache folder, then :func:`fisherkron.compress` of
a copy of the model on that device by every method at rank 3 (MFF in float64), and the logits
of held-out batches. Each is compared with the CPU run: the statistics (gradients, diagonal
Fisher, K-FAC factors, ``X Xᵀ``) and the compressed models' logits must agree to the tolerances
of float32 arithmetic summed in another order (``fisherkron.testing``). Prints one line per check
and exits non-zero if any fails.
"""
from __future__ import annotations

import argparse
import copy
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))  # the tiny models the test suite uses

import fisherkron as fk  # noqa: E402
from fisherkron.core.methods import METHODS  # noqa: E402
from fisherkron.testing import MODEL_F32_REL, rel_error  # noqa: E402

#: float32 statistics computed on two devices: relative Frobenius error
STATS_REL = 1e-4


def run(device: str, folder: Path):
    """Calibration and every method's compression of the tiny Llama on ``device``: (stats, {method: logits})."""
    from tiny_models import tiny_llama, token_batches

    base = tiny_llama().to(device)
    stats = fk.collect_calibration(base, token_batches(k=5, seed=0), None, cache_dir=folder)
    held_out = {key: v.to(device) for key, v in token_batches(k=1, seed=9)[0].items()}
    logits = {}
    for method in METHODS:
        model = copy.deepcopy(base)
        fk.compress(model, method, stats, rank=3, mff_options={"dtype": torch.float64, "tol": 1e-12})
        with torch.no_grad():
            logits[method] = model(**held_out).logits.float().cpu()
    with torch.no_grad():
        logits["dense"] = base(**held_out).logits.float().cpu()
    return stats, logits


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", help="the device to check against the CPU (default cuda)")
    a = p.parse_args(argv)
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        print("cuda_pipeline_check: torch sees no CUDA device; pass --device cpu to check the script", file=sys.stderr)
        return 2
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        ref_stats, ref = run("cpu", Path(tmp) / "cpu")
        stats, got = run(a.device, Path(tmp) / "device")
        for name in ref_stats.layers:
            errs = {"grads": rel_error(stats.grads(name), ref_stats.grads(name))}
            kf, kf0 = stats.kfac(name), ref_stats.kfac(name)
            errs["kfac A"], errs["kfac B"] = rel_error(kf.A, kf0.A), rel_error(kf.B, kf0.B)
            worst = max(errs, key=errs.get)
            results.append((f"statistics of {name}", errs[worst] <= STATS_REL, f"worst {worst}: {errs[worst]:.1e}"))
        for method, logits in ref.items():
            err = float((got[method] - logits).abs().max() / logits.abs().max())
            results.append((f"logits after {method}", err <= MODEL_F32_REL, f"{err:.1e} (tolerance {MODEL_F32_REL:g})"))
    for name, ok, detail in results:
        print(f"[cuda_pipeline_check] {'ok  ' if ok else 'FAIL'} {name} ({detail})", flush=True)
    failed = sum(not ok for _, ok, _ in results)
    where = torch.cuda.get_device_name() if a.device.startswith("cuda") else a.device
    print(f"[cuda_pipeline_check] {a.device} ({where}) against cpu, torch {torch.__version__}: "
          f"{len(results) - failed} of {len(results)} checks passed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
