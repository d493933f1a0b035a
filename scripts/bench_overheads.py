#!/usr/bin/env python
r"""Benchmark three fixed costs that notebooks and tests pay: a benchmark, not a test.

* **The code part of cache keys.** A calibration entry, a sensitivity sweep and a decoder-study case are keyed
  by a hash of what their source files compute (:func:`fisherkron.env.code_digest`), which parses each file
  and dumps its syntax tree without docstrings (:func:`fisherkron.env.code_text`). Every key computed the
  hash afresh; :func:`~fisherkron.env.code_text` now keeps its answer for each source text for the life of the
  process. Each hash is timed ``--calls`` times both ways, the kept answers dropped before every call for
  ``parsed on every call``; the keys must be equal.
* **The training documents' check against the evaluation texts**
  (:func:`fisherkron.hf.recovery.check_disjoint`, run by every study that trains on C4): the embedded C4
  documents against every evaluation text, seconds and overlaps found (none), ``--calls`` times.
* **The GEMM peak** (:func:`fisherkron.experiments.benchmark.gemm_peak`), measured at the start of the
  runtime notebook: square sizes 4096 (the old CPU default) and 2048 (the new), each with the smoke run's
  0.2 s budget and the default run's 3 s, on this process's threads: the seconds the call took and the
  GFLOP/s it reports.

Tables ``<out>/bench_code_hashes``, ``<out>/bench_disjoint`` and ``<out>/bench_gemm_peak`` (``.csv``, ``.md``,
``.tex``, provenance), with the share of the cores other processes used (``make bench-overheads``; ``--quick``
checks that it runs).
"""
from __future__ import annotations

import argparse
import sys
import time

import pandas as pd


def code_hashes(calls: int):
    from fisherkron import env
    from fisherkron.experiments import llm_compression as lc
    from fisherkron.hf import sensitivity
    from fisherkron.hf.calibration import keys

    hashes = {"calibration code (code_version)": keys.code_version,
              "decoder study sources (sources_hash)": lc.sources_hash,
              "sensitivity sweep code": sensitivity._code_version}
    rows = []
    for what, fn in hashes.items():
        env._code_text.cache_clear()
        reference = fn()
        with env.OtherLoad() as load:  # over both ways: a call kept in memory is too short to measure it alone
            for way in ("parsed on every call", "parsed once per process"):
                seconds, same = [], True
                for _ in range(calls):
                    if way == "parsed on every call":
                        env._code_text.cache_clear()
                    t = time.perf_counter()
                    same &= fn() == reference
                    seconds.append(time.perf_counter() - t)
                rows.append({"code hashed": what, "sources": way, "calls": calls,
                             "seconds per call": sum(seconds) / len(seconds), "same key": same})
        for row in rows[-2:]:
            row["other load"] = round(load.share, 3)
            print(f"[bench-overheads] {what} / {row['sources']}: {row['seconds per call']:.4f} s per call; "
                  f"same key: {row['same key']}", flush=True)
    return pd.DataFrame(rows)


def disjointness(calls: int, quick: bool = False):
    from fisherkron.env import OtherLoad
    from fisherkron.hf.data import c4_documents
    from fisherkron.hf.recovery import check_disjoint, evaluation_texts

    documents, evaluation = c4_documents(), evaluation_texts()
    if quick:  # a slice of each
        documents, evaluation = documents[:50], dict(list(evaluation.items())[:2])
    letters = sum(map(len, documents)) + sum(len(t) for v in evaluation.values()
                                             for t in ([v] if isinstance(v, str) else v))
    seconds = []
    with OtherLoad() as load:
        for _ in range(calls):
            t = time.perf_counter()
            found = check_disjoint(documents, evaluation)
            seconds.append(time.perf_counter() - t)
    print(f"[bench-overheads] check_disjoint: {min(seconds):.2f} s, {len(found)} overlaps", flush=True)
    return pd.DataFrame([{"documents": len(documents), "evaluation sources": len(evaluation),
                          "characters": letters, "calls": calls, "best s": min(seconds),
                          "mean s": sum(seconds) / len(seconds), "overlaps": len(found),
                          "other load": round(load.share, 3)}])


def gemm_peaks(budgets, sizes):
    import torch

    from fisherkron.env import OtherLoad
    from fisherkron.experiments.benchmark import gemm_peak

    rows = []
    for seconds in budgets:
        for size in sizes:
            with OtherLoad() as load:
                t = time.perf_counter()
                rate = gemm_peak("cpu", seconds=seconds, size=size)
                took = time.perf_counter() - t
            rows.append({"budget s": seconds, "size": size, "threads": torch.get_num_threads(), "call s": took,
                         "GFLOP/s": rate, "other load": round(load.share, 3)})
            print(f"[bench-overheads] GEMM peak, size {size}, budget {seconds} s: {rate:.1f} GFLOP/s in {took:.2f} s",
                  flush=True)
    return pd.DataFrame(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="figures/bench", help="folder for the tables (default: figures/bench)")
    ap.add_argument("--calls", type=int, default=5, help="calls per code hash and way (default: 5)")
    ap.add_argument("--quick", action="store_true",
                    help="two calls, a slice of the texts, tiny GEMMs, a 0.05 s budget (checks that it runs)")
    args = ap.parse_args(argv)
    if args.quick:
        args.calls = 2

    from fisherkron.repro.figures import save_table  # fisherkron first: it sets OpenMP's wait policy before torch

    started = time.perf_counter()
    hashes = code_hashes(args.calls)
    save_table(hashes, "bench_code_hashes", args.out, vars(args), started=started, floatfmt=".3g",
               caption="Seconds per code hash of a cache key, the sources parsed on every call or once per process.",
               tolerances={c: "timing" for c in ("seconds per call", "other load")})
    disjoint = disjointness(1 if args.quick else 3, quick=args.quick)
    save_table(disjoint, "bench_disjoint", args.out, vars(args), started=started, floatfmt=".3g",
               caption="Seconds to check the C4 training documents against every evaluation text.",
               tolerances={c: "timing" for c in ("best s", "mean s", "other load")})
    peaks = gemm_peaks((0.05,), (256, 128)) if args.quick else gemm_peaks((0.2, 3.0), (4096, 2048))
    save_table(peaks, "bench_gemm_peak", args.out, vars(args), started=started, floatfmt=".3g",
               caption="The GEMM peak measurement: seconds per call and GFLOP/s reported, by size and time budget.",
               tolerances={c: "timing" for c in ("call s", "GFLOP/s", "other load")})
    print(hashes.to_string(index=False))
    print(disjoint.to_string(index=False))
    print(peaks.to_string(index=False))
    return 0 if hashes["same key"].all() else 1


if __name__ == "__main__":
    sys.exit(main())
