#!/usr/bin/env python
r"""Benchmark weighted SVDs read from disk against computed: a benchmark, not a test.

Every decoder notebook on SmolLM2 factorises each layer once per method (Eq. (7): ``L_B^T W L_A =
U S V^T``, kept as :class:`fisherkron.core.wsvd.Decomposition`); the notebooks share one calibration,
so each computed the same decompositions again. :class:`fisherkron.hf.decompositions.Decompositions`
now keeps them on disk for the next process. For each method this script, in one process:

* ``computed``: every layer of SmolLM2 factorised with an in-memory cache only (what each notebook did);
* ``computed and written``: the same with a disk folder (what the first notebook now does);
* ``read``: a new cache on that folder, as the next notebook (every layer read back).

The decompositions read must equal the computed ones bit for bit (``same``). The calibration is the
scale study's protocol on SmolLM2 (``notebooks/params/fig_scale.default.yaml``; collected first if not
cached, not timed). Written to ``<out>/bench_decompositions.{csv,md,tex}`` with provenance
(``make bench-decompositions``).
"""
from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import fisherkron  # noqa: F401  (before torch: its OpenMP threads wait passively)
import pandas as pd
import torch
import yaml

METHODS = ("gfwsvd", "svd_llm", "fwsvd")


def _all(cache, model, method, stats, names, mff_options):
    t = time.perf_counter()
    out = {n: cache.get(model.get_submodule(n), method, stats, n, mff_options=mff_options)[0] for n in names}
    return out, time.perf_counter() - t


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="figures/bench", help="folder for the table (default: figures/bench)")
    ap.add_argument("--methods", nargs="+", default=list(METHODS))
    ap.add_argument("--scratch", default=None, help="folder for the decompositions written (default: a temporary one)")
    args = ap.parse_args(argv)

    from fisherkron.env import OtherLoad
    from fisherkron.experiments import llm_compression as lc
    from fisherkron.hf.decompositions import Decompositions
    from fisherkron.repro.figures import save_table

    started = time.perf_counter()
    params = yaml.safe_load(Path("notebooks/params/fig_scale.default.yaml").read_text())
    study = lc.prepare(lc.Protocol.from_params({**params, "model_name": "smollm2"}), target="bench-decompositions",
                       progress=False)
    names, opts = study.names, study.mff_options
    scratch = Path(args.scratch or tempfile.mkdtemp(prefix="bench-decompositions-"))
    rows = []
    try:
        for method in args.methods:
            folder = scratch / method
            with OtherLoad() as load:
                computed, t_mem = _all(Decompositions(), study.model, method, study.stats, names, opts)
                written, t_write = _all(Decompositions(folder, max_bytes="1TB"), study.model, method, study.stats,
                                        names, opts)
                reader = Decompositions(folder, max_bytes="1TB")
                read, t_read = _all(reader, study.model, method, study.stats, names, opts)
            same = reader.disk_hits == len(names) and all(
                torch.equal(read[n].P, computed[n].P) and torch.equal(read[n].S, computed[n].S)
                and torch.equal(read[n].Q, computed[n].Q) for n in names)
            disk = sum(p.stat().st_size for p in folder.glob("*.pt"))
            rows.append({"method": method, "layers": len(names), "computed s": t_mem, "computed and written s": t_write,
                         "read s": t_read, "speed-up": t_mem / t_read, "disk GB": disk / 1e9, "same": same,
                         "other load": load.share})
            print(f"[bench-decompositions] {method}: computed {t_mem:.1f} s, computed and written {t_write:.1f} s, "
                  f"read {t_read:.1f} s, {disk / 1e9:.2f} GB, same: {same}", flush=True)
            del computed, written, read
            shutil.rmtree(folder, ignore_errors=True)
    finally:
        if args.scratch is None:
            shutil.rmtree(scratch, ignore_errors=True)
    df = pd.DataFrame(rows)
    save_table(df, "bench_decompositions", args.out, vars(args), started=started, floatfmt=".3g",
               caption="Seconds to obtain every SmolLM2 layer's weighted SVD: computed, or read back from disk by "
                       "the next process.",
               tolerances={c: "timing" for c in ("computed s", "computed and written s", "read s", "speed-up",
                                                 "other load")})
    print(df.to_string(index=False))
    return 0 if df["same"].all() else 1


if __name__ == "__main__":
    sys.exit(main())
