"""Calibration + MFF of SmolLM2 on 1 and on 2 CPU processes (torchrun, gloo): time and peak memory per process.

Run (the measurement of the README's "Distributed (torchrun)" section; not yet timed at full
scale: it calibrates and factorises all 210 layers twice, writing 2 x 1.6 GB of gradients to a
temporary folder that is removed at the end):

    .venv/bin/python scripts/distributed_smollm2.py

A quick check of the script itself (one block's MLP, k = 2; 2.5 min on a busy 2-core machine):

    .venv/bin/python scripts/distributed_smollm2.py --layers 'model\\.layers\\.0\\.mlp\\..*' --k 2

For each world size it starts ``python -m torch.distributed.run --nproc_per_node=W`` on this
script with ``--worker``; every process loads the embedded SmolLM2, draws the same C4 batches
(k batches of 2 x 256 tokens, seed 0), runs :func:`fisherkron.collect_calibration` (batch i on
rank i % W) and :func:`fisherkron.precompute_kronecker` (MFF of every layer, data-parallel by
default) into a fresh cache folder, and reports its wall times and peak resident memory. Each
process gets ``cpus // W`` threads. The table is printed as Markdown, followed by the largest
relative difference between the ``A (x) B`` of the two runs over all layers.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worlds", default="1,2", help="world sizes to measure, comma-separated (default 1,2)")
    p.add_argument("--k", type=int, default=4, help="calibration batches (default 4)")
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--layers", default=None, help="regex of the nn.Linear layers (default: all 210 of the blocks)")
    p.add_argument("--mff-parallel", choices=("batches", "layers"), default="batches")
    p.add_argument("--cache-root", default=None, help="where the fresh calibration folders go (default: a temporary folder)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--cache-dir", help=argparse.SUPPRESS)
    p.add_argument("--report", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def worker(args) -> None:
    """One process of a torchrun launch: calibration and MFF of all layers, timed; a JSON line per rank."""
    import resource

    import torch

    import fisherkron as fk
    from fisherkron.hf.distributed import Launch, torchrun_world

    rank, world = torchrun_world()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    launch = Launch(rank, world, None)
    if world > 1:
        launch.join()
    t0 = time.perf_counter()
    model, tok = fk.load_model("smollm2")
    batches = fk.lm_batches(tok, fk.c4_documents(), k=args.k, batch_size=args.batch_size, seq_len=args.seq_len, seed=0)
    t_load = time.perf_counter() - t0
    t0 = time.perf_counter()
    stats = fk.collect_calibration(model, batches, args.layers, methods=["gfwsvd"], seed=0, cache_dir=args.cache_dir,
                                   group="auto")
    t_cal = time.perf_counter() - t0
    t0 = time.perf_counter()
    done = fk.precompute_kronecker(stats, group="auto", parallel=args.mff_parallel)
    t_mff = time.perf_counter() - t0
    row = {"world": world, "rank": rank, "threads": torch.get_num_threads(), "load_s": t_load,
           "calibration_s": t_cal, "mff_s": t_mff, "layers": len(stats.layers), "layers_here": len(done),
           "matvecs": sum(d["matvecs"] for d in done.values()),
           "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "dir": str(stats.dir)}
    with open(f"{args.report}.rank{rank}.json", "w") as fh:
        json.dump(row, fh)
    launch.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(args, world: int, root: Path) -> list[dict]:
    cache, report = root / f"world{world}", root / f"world{world}"
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={world}", f"--master_port={_free_port()}",
           __file__, "--worker", "--cache-dir", str(cache), "--report", str(report), "--k", str(args.k),
           "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len), "--mff-parallel", args.mff_parallel]
    if args.layers:
        cmd += ["--layers", args.layers]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // world))})
    wall = time.perf_counter() - t0
    rows = [json.loads(Path(f"{report}.rank{r}.json").read_text()) for r in range(world)]
    for r in rows:
        r["wall_s"] = wall
    return rows


def _kron_difference(dir_a: Path, dir_b: Path) -> float:
    """Largest ``||a b^T - c d^T|| / ||c d^T||`` (``a, b = vec A, vec B``) over the layers' cached MFF factors."""
    import torch

    worst = 0.0
    for f in sorted((dir_b / "mff").glob("*.pt")):
        x, y = torch.load(dir_a / "mff" / f.name), torch.load(f)
        a, b, c, d = (t.double().reshape(-1) for t in (x["A"], x["B"], y["A"], y["B"]))
        num = (a @ a) * (b @ b) + (c @ c) * (d @ d) - 2 * (a @ c) * (b @ d)
        worst = max(worst, float(num.clamp_min(0).sqrt() / ((c @ c) * (d @ d)).sqrt()))
    return worst


def main(argv=None) -> None:
    args = _args(argv)
    if args.worker:
        return worker(args)
    worlds = [int(w) for w in args.worlds.split(",")]
    with tempfile.TemporaryDirectory(prefix="fisherkron-distributed-", dir=args.cache_root) as tmp:
        rows = {w: _launch(args, w, Path(tmp)) for w in worlds}
        what = f"k = {args.k} batches of {args.batch_size} x {args.seq_len} C4 tokens, layers: {args.layers or 'all'}, " \
               f"MFF parallel over {args.mff_parallel}"
        print(f"SmolLM2 calibration + MFF on {os.cpu_count()} CPU cores ({what})\n")
        print("| processes | rank | threads | calibration (s) | MFF, all layers (s) | calibration + MFF (s) "
              "| peak RSS (MiB) | layers | products |")
        print("|---|---|---|---|---|---|---|---|---|")
        for w, rs in rows.items():
            for r in rs:
                print(f"| {w} | {r['rank']} | {r['threads']} | {r['calibration_s']:.1f} | {r['mff_s']:.1f} | "
                      f"{r['calibration_s'] + r['mff_s']:.1f} | {r['peak_rss_mib']:.0f} | {r['layers_here']} of "
                      f"{r['layers']} | {r['matvecs']} |")
        if len(worlds) > 1:
            base = Path(rows[worlds[0]][0]["dir"])
            for w in worlds[1:]:
                diff = _kron_difference(Path(rows[w][0]["dir"]), base)
                print(f"\nlargest relative difference of A (x) B, {w} processes against {worlds[0]}: {diff:.1e}")


if __name__ == "__main__":
    main()
