#!/usr/bin/env python
"""Which MKL code branch gives float32 GEMMs identical bits on Intel Xeon and AMD EPYC: a check, not a test.

Float32 results differ in their last bits between the two CPU models this project runs on, and
trained rows (learned truncation, LoRA) amplify those bits into differences ``make verify`` sees.
torch's CPU GEMMs are MKL's, whose code branch depends on the processor; MKL's Conditional
Numerical Reproducibility (``MKL_CBWR``) pins one. For each branch this script runs a few seeded
GEMMs of the shapes a SmolLM2 layer sees, in a fresh process (the branch is read at MKL's first
call), and appends one JSON line per branch to ``scripts/mkl_branches.log``: the CPU model, the
branch, a digest of the results' bits and the GFLOP/s of a 2048-square product. Run it on each
CPU model; a branch whose digest is the same on both is one that makes float32 GEMMs reproducible
across them, at the speed the log gives.
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

BRANCHES = ["AUTO", "COMPATIBLE", "SSE4_2", "AVX", "AVX2", "AVX512"]
LOG = Path(__file__).with_name("mkl_branches.log")

_CHILD = r"""
import hashlib, json, time, torch
torch.manual_seed(0)
h = hashlib.sha256()
for n, m, t in [(576, 576, 512), (1536, 576, 512), (576, 1536, 512), (49152, 576, 64)]:
    w, x = torch.randn(n, m), torch.randn(t, m)
    h.update((x @ w.T).numpy().tobytes())
a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
a @ b
t0 = time.perf_counter()
for _ in range(5):
    a @ b
gflops = 5 * 2 * 2048 ** 3 / (time.perf_counter() - t0) / 1e9
print(json.dumps({"digest": h.hexdigest()[:16], "gflops": round(gflops, 1), "threads": torch.get_num_threads()}))
"""


def main() -> int:
    from fisherkron.repro.figures import machine_info

    cpu, rows = machine_info()["cpu"], []
    for branch in BRANCHES:
        env = dict(os.environ, MKL_CBWR=branch)
        out = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, check=True)
        row = {"cpu": cpu, "branch": branch, **json.loads(out.stdout.strip().splitlines()[-1]),
               "load_average": os.getloadavg()[0]}
        print(json.dumps(row), flush=True)
        rows.append(row)
    with LOG.open("a", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
