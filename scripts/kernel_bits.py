#!/usr/bin/env python
"""Which CPU kernel settings give float32 training identical bits on Intel Xeon and AMD EPYC: a check, not a test.

Float32 results differ in their last bits between the two CPU models this project runs on, and trained rows
(learned truncation, LoRA) amplify those bits into differences ``make verify`` sees. Three libraries choose their
code by processor: MKL (torch's CPU GEMMs), whose branch ``MKL_CBWR`` pins; ATen's vectorised kernels (softmax,
norms, reductions, element-wise), whose width ``ATEN_CPU_CAPABILITY`` can lower; and oneDNN, for the operations
torch hands it, bounded by ``ONEDNN_MAX_CPU_ISA``. For each setting of :data:`SETTINGS` this script runs, in a
fresh process (each variable is read once, at start):

* ``gemm``: seeded GEMMs of the shapes a SmolLM2 layer sees;
* ``aten``: softmax, RMS norm, SiLU and a long sum on seeded inputs;
* ``train``: three AdamW steps of SmolLM2-135M in float32 on fixed tokens, and the loss of each step;

and appends one JSON line per setting to ``scripts/kernel_bits.log``: the CPU model, the setting, a digest of the
bits of each part, the losses, the GFLOP/s of a 2048-square product and the training steps' seconds. Run it on
each CPU model (``python scripts/kernel_bits.py [--only SETTING]``, about 4 minutes on 2 cores): a setting whose
``train`` digest is the same on both makes CPU training reproducible bit for bit across them (same thread count),
at the speed the log gives; where none is, the trained rows' reproducibility rests on their seeds' spread. The
last setting is what ``make KERNELS=avx2`` exports.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

#: (name, environment): the CPU's own kernels, each library pinned alone and both, and the narrowest
SETTINGS = [
    ("auto", {}),
    ("mkl avx2", {"MKL_CBWR": "AVX2"}),
    ("aten avx2", {"ATEN_CPU_CAPABILITY": "avx2"}),
    ("aten avx2, mkl avx2", {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2"}),
    ("aten default, mkl compatible", {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE"}),
    ("make KERNELS=avx2", {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}),
]
#: the variables a setting may pin (none leaks in from the caller's environment)
PINS = ("MKL_CBWR", "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")
LOG = Path(__file__).with_name("kernel_bits.log")

_CHILD = r"""
import hashlib, json, time, torch
import torch.nn.functional as F

def digest(tensors):
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]

g = torch.Generator().manual_seed(0)
gemm = []
for n, m, t in [(576, 576, 512), (1536, 576, 512), (576, 1536, 512), (49152, 576, 64)]:
    w, x = torch.randn(n, m, generator=g), torch.randn(t, m, generator=g)
    gemm.append(x @ w.T)
x = torch.randn(512, 576, generator=g)
aten = [F.softmax(x, -1), x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5), F.silu(x), x.sum(0), x.sum()]
a, b = torch.randn(2048, 2048, generator=g), torch.randn(2048, 2048, generator=g)
a @ b
t0 = time.perf_counter()
for _ in range(5):
    a @ b
gflops = 5 * 2 * 2048 ** 3 / (time.perf_counter() - t0) / 1e9

from fisherkron.hf.registry import load_model
model, _ = load_model("smollm2")
model.train()
ids = torch.randint(0, model.config.vocab_size, (2, 256), generator=g)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
t0, losses = time.perf_counter(), []
for _ in range(3):
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    losses.append(loss.item())
print(json.dumps({"gemm": digest(gemm), "aten": digest(aten), "train": digest(model.parameters()),
                  "losses": [float.hex(v) for v in losses], "gflops": round(gflops, 1),
                  "train_seconds": round(time.perf_counter() - t0, 1), "threads": torch.get_num_threads(),
                  "aten_capability": torch.backends.cpu.get_cpu_capability()}))
"""


def main(argv=None) -> int:
    import argparse

    from fisherkron.repro.figures import machine_info

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", choices=[name for name, _ in SETTINGS], help="run one setting (default: all)")
    only = ap.parse_args(argv).only

    info, rows = machine_info(), []
    clean = {k: v for k, v in os.environ.items() if k not in PINS}
    for name, pins in [s for s in SETTINGS if only is None or s[0] == only]:
        out = subprocess.run([sys.executable, "-c", _CHILD], env={**clean, **pins}, capture_output=True, text=True)
        if out.returncode:
            print(f"[kernel_bits] {name}: failed\n{out.stderr[-2000:]}", file=sys.stderr)
            return 1
        row = {"cpu": info["cpu"], "cpu_isa": info["cpu_isa"], "torch": info["torch"], "setting": name, **pins,
               **json.loads(out.stdout.strip().splitlines()[-1]), "load_average": round(os.getloadavg()[0], 2)}
        print(json.dumps(row), flush=True)
        rows.append(row)
    with LOG.open("a", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
