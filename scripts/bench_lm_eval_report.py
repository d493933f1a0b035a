#!/usr/bin/env python
r"""Benchmark lm-eval's environment report left out of each call: a benchmark, not a test.

lm-eval's ``simple_evaluate`` ends by adding a report of the environment to its results (torch's ``collect_env``,
which starts subprocesses and imports what it finds); :func:`fisherkron.run_lm_eval` reads nothing of it and now
leaves it out (:func:`fisherkron.hf.evaluate._without_environment_report`). This script scores the embedded
SmolLM2 on ``--limit`` ARC-Easy questions ``--calls`` times each way, in one process (the report first, as its
first call costs more):

* ``with the report``: lm-eval's own ``simple_evaluate`` (the old behaviour);
* ``without``: as :func:`~fisherkron.run_lm_eval` calls it now.

Each call's scores must equal the first call's (same outputs). The table gives the first call and the mean of
the later ones, the saving per later call and the share of the cores other processes used
(:class:`fisherkron.env.OtherLoad`): ``<out>/bench_lm_eval_report.{csv,md,tex}`` with its provenance record
(``make bench-lm-eval-report``).
"""
from __future__ import annotations

import argparse
import contextlib
import sys
import time

import pandas as pd


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="figures/bench", help="folder for the table (default: figures/bench)")
    ap.add_argument("--calls", type=int, default=4, help="calls per way (default: 4)")
    ap.add_argument("--limit", type=int, default=5, help="ARC-Easy questions per call (default: 5)")
    args = ap.parse_args(argv)

    import fisherkron as fk
    from fisherkron.env import OtherLoad
    from fisherkron.hf import evaluate as ev
    from fisherkron.repro.figures import save_table

    started = time.perf_counter()
    model, tok = fk.load_model("smollm2")
    without = ev._without_environment_report
    rows, reference = [], None
    for way, context in (("with the report", contextlib.nullcontext), ("without", without)):
        ev._without_environment_report = context
        seconds, same = [], True
        try:
            with OtherLoad() as load:
                for _ in range(args.calls):
                    t = time.perf_counter()
                    res = ev.run_lm_eval(model, tok, ["arc_easy"], num_fewshot=0, limit=args.limit,
                                         bootstrap_iters=0)
                    seconds.append(time.perf_counter() - t)
                    reference = res if reference is None else reference
                    same &= res == reference
        finally:
            ev._without_environment_report = without
        later = seconds[1:] or seconds
        rows.append({"environment report": way, "calls": args.calls, "questions": args.limit,
                     "first call s": seconds[0], "later calls s": sum(later) / len(later), "same scores": same,
                     "other load": round(load.share, 3)})
        print(f"[bench-lm-eval-report] {way}: " + ", ".join(f"{s:.2f}" for s in seconds) + f" s; same: {same}",
              flush=True)
    df = pd.DataFrame(rows)
    df["saved per call s"] = df["later calls s"].iloc[0] - df["later calls s"]
    save_table(df, "bench_lm_eval_report", args.out, vars(args), started=started, floatfmt=".3g",
               caption="Seconds per lm-eval call on SmolLM2 (ARC-Easy), with and without lm-eval's environment "
                       "report.",
               tolerances={c: "timing" for c in ("first call s", "later calls s", "saved per call s", "other load")})
    print(df.to_string(index=False))
    return 0 if df["same scores"].all() else 1


if __name__ == "__main__":
    sys.exit(main())
