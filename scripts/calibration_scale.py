"""Calibration at scale on SmolLM2 (issue "calibration at the paper's scale"): throughput, disk, peak RAM.

Three measurements, each in a fresh process so that its peak resident memory is its own:

* ``collect``: :func:`fisherkron.collect_calibration` of all linear layers for each ``k`` and
  gradient encoding: seconds, tokens/s, bytes on disk, peak RSS;
* ``error``: MFF's ``A (x) B`` from 16-bit gradients against float32 gradients of the same
  batches (relative Frobenius error, per layer), for the layers of ``--error-layers``;
* ``end2end``: calibration, MFF of every layer (K-FAC warm start, or the identity start
  without collecting K-FAC) and GFWSVD compression at ``--ratio``: seconds per step, peak RSS,
  disk. The issue's target: k = 32 in at most 15 minutes, 12 GB RAM and 8 GB of disk.

Every run writes into a temporary cache folder (removed afterwards) and prints one JSON line;
the parent prints Markdown tables. A quick check of the script itself:

    .venv/bin/python scripts/calibration_scale.py --ks 2 --encodings float32,bfloat16 \\
        --layers 'model\\.layers\\.0\\.mlp\\..*' --error-layers 'model\\.layers\\.0\\.mlp\\.up_proj' --end2end-k 2

The full measurement (about an hour on 2 cores; up to 14 GB of disk at k = 64 in bfloat16):

    .venv/bin/python scripts/calibration_scale.py
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ks", default="4,16,32,64", help="calibration sizes of the collect measurement")
    p.add_argument("--encodings", default="float32,bfloat16", help="gradient encodings of the collect measurement")
    p.add_argument("--max-gb", type=float, default=16.0, help="skip a collect run whose gradients exceed this")
    p.add_argument("--layers", default=None, help="regex of the layers (default: all 210 of the blocks)")
    p.add_argument("--error-layers", default=r"model\.layers\.(0|15|29)\..*",
                   help="layers of the 16-bit error measurement")
    p.add_argument("--error-k", type=int, default=16)
    p.add_argument("--end2end-k", type=int, default=32)
    p.add_argument("--ratio", type=float, default=0.2)
    p.add_argument("--skip", default="", help="comma-separated measurements to skip: collect,error,end2end")
    p.add_argument("--child", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _batches(tok, k: int):
    from fisherkron import hf

    return hf.lm_batches(tok, hf.c4_documents(), k, batch_size=2, seq_len=256, seed=0)


def _disk(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def _peak_gb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def child(spec: dict) -> dict:
    """One measurement in this process; returns its JSON record."""
    import torch

    from fisherkron import hf
    from fisherkron.hf.surgery import compress

    model, tok = hf.load_model("smollm2")
    root = Path(spec["cache"])
    layers = spec.get("layers")
    what = spec["what"]
    if what == "collect":
        batches = _batches(tok, spec["k"])
        t = time.perf_counter()
        st = hf.collect_calibration(model, batches, layers, cache_dir=root, grad_dtype=spec["encoding"],
                                    methods=("gfwsvd",))
        sec = time.perf_counter() - t
        tokens = sum(int(b["attention_mask"].sum()) for b in batches)
        return {"k": spec["k"], "encoding": spec["encoding"], "seconds": sec, "tokens_per_s": tokens / sec,
                "disk_gb": _disk(st.dir) / 1e9, "peak_gb": _peak_gb(), "layers": len(st.layers)}
    if what == "error":
        from fisherkron.core.factorization import mff

        batches = _batches(tok, spec["k"])
        out = {}
        for enc in ("float32", "bfloat16", "float16"):
            st = hf.collect_calibration(model, batches, layers, cache_dir=root / enc, grad_dtype=enc,
                                        stats=("grads",))
            out[enc] = {n: mff(st.gradients(n), name=n) for n in st.layers}
        rows = []
        for n, ref in out["float32"].items():
            for enc in ("bfloat16", "float16"):
                got = out[enc][n]
                rows.append({"layer": n, "encoding": enc, "rel_error": _kron_rel_error(got.A, got.B, ref.A, ref.B),
                             "mff_tol_scale": 1e-5})
        return {"rows": rows, "k": spec["k"]}
    if what == "end2end":
        batches = _batches(tok, spec["k"])
        warm = spec["init"] == "kfac"
        times = {}
        t = time.perf_counter()
        st = hf.collect_calibration(model, batches, layers, cache_dir=root, grad_dtype=spec["encoding"],
                                    stats=("grads", "kfac") if warm else ("grads",))
        times["calibration"] = time.perf_counter() - t
        t = time.perf_counter()
        matvecs = 0
        for n in st.layers:
            matvecs += st.kronecker(n, init="kfac" if warm else "identity")["matvecs"]
        times["mff"] = time.perf_counter() - t
        t = time.perf_counter()
        rep = compress(model, "gfwsvd", st, ratio=spec["ratio"])
        times["compress"] = time.perf_counter() - t
        return {"k": spec["k"], "init": spec["init"], "encoding": spec["encoding"], **times,
                "total": sum(times.values()), "matvecs": matvecs, "ratio": rep.ratio,
                "disk_gb": _disk(st.dir) / 1e9, "peak_gb": _peak_gb(), "threads": torch.get_num_threads()}
    raise SystemExit(f"unknown measurement {what}")


def _kron_rel_error(A, B, A0, B0) -> float:
    """``||A (x) B - A0 (x) B0||_F / ||A0 (x) B0||_F`` from traces (no Kronecker product formed)."""
    A, B, A0, B0 = (x.double() for x in (A, B, A0, B0))
    aa, bb = float((A * A).sum()), float((B * B).sum())
    a0, b0 = float((A0 * A0).sum()), float((B0 * B0).sum())
    cross = float((A * A0).sum()) * float((B * B0).sum())
    return max(aa * bb + a0 * b0 - 2 * cross, 0.0) ** 0.5 / (a0 * b0) ** 0.5


def _run(spec: dict) -> dict:
    with tempfile.TemporaryDirectory(prefix="fisherkron-scale-") as tmp:
        spec = {**spec, "cache": tmp}
        proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], capture_output=True, text=True)
        if proc.returncode != 0:
            sys.stderr.write(proc.stderr[-3000:])
            raise SystemExit(f"measurement {spec['what']} failed")
        return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    args = _args(argv)
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return 0
    skip = set(filter(None, args.skip.split(",")))
    started = time.perf_counter()
    print(f"# Calibration at scale: SmolLM2, C4 batches of 2 x 256 tokens, {os.cpu_count()} CPUs\n")
    if "collect" not in skip:
        per_grad_gb = {"float32": 0.42, "bfloat16": 0.21, "float16": 0.21}  # all 210 layers, one gradient
        print("| k | encoding | seconds | tokens/s | disk (GB) | peak RSS (GB) |\n|---|---|---|---|---|---|")
        for k in map(int, args.ks.split(",")):
            for enc in args.encodings.split(","):
                if args.layers is None and k * per_grad_gb[enc] > args.max_gb:
                    print(f"| {k} | {enc} | skipped: about {k * per_grad_gb[enc]:.0f} GB > --max-gb | | | |")
                    continue
                r = _run({"what": "collect", "k": k, "encoding": enc, "layers": args.layers})
                print(f"| {k} | {enc} | {r['seconds']:.0f} | {r['tokens_per_s']:.0f} | {r['disk_gb']:.2f} | "
                      f"{r['peak_gb']:.2f} |", flush=True)
        print()
    if "error" not in skip:
        r = _run({"what": "error", "k": args.error_k, "layers": args.error_layers})
        print(f"16-bit gradients against float32, k = {r['k']}: relative Frobenius error of MFF's A (x) B "
              f"(MFF's own tolerance is 1e-5)\n\n| layer | encoding | error |\n|---|---|---|")
        for row in r["rows"]:
            print(f"| {row['layer']} | {row['encoding']} | {row['rel_error']:.2e} |")
        print()
    if "end2end" not in skip:
        print(f"End to end at k = {args.end2end_k} (calibration, MFF of every layer, GFWSVD at "
              f"{args.ratio:.0%}):\n\n| start | encoding | calibration s | MFF s | compress s | total s | "
              f"matvecs | disk (GB) | peak RSS (GB) |\n|---|---|---|---|---|---|---|---|---|")
        for init in ("kfac", "identity"):
            r = _run({"what": "end2end", "k": args.end2end_k, "init": init, "encoding": "bfloat16",
                      "layers": args.layers, "ratio": args.ratio})
            print(f"| {init} | {r['encoding']} | {r['calibration']:.0f} | {r['mff']:.0f} | {r['compress']:.0f} | "
                  f"{r['total']:.0f} | {r['matvecs']} | {r['disk_gb']:.2f} | {r['peak_gb']:.2f} |", flush=True)
    print(f"\n(measured in {time.perf_counter() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
