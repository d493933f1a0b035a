#!/usr/bin/env python
r"""Benchmark lm-eval's tasks loaded once per process against loaded on every call: a benchmark, not a test.

:func:`fisherkron.run_lm_eval` used to hand lm-eval's ``simple_evaluate`` a fresh task manager, which
loads every task again on each call (for MMLU: 57 subjects, each a dataset read and indexed). It now
keeps one loaded copy per task list and shot count for the life of the process
(:class:`fisherkron.hf.evaluate._ReusedTasks`). This script scores the embedded SmolLM2 the way the
decoder studies do (MMLU 5-shot with one question per subject; the six zero-shot tasks) ``--calls``
times each way, in one process:

* ``every call``: the process's task managers are dropped before each call (the old behaviour);
* ``once``: they are kept, so only the first call loads the tasks.

Each call's scores must equal the first ``every call`` scores (same outputs); the table gives the mean
seconds per call after the first, the saving and the share of the cores other processes used
(:class:`fisherkron.env.OtherLoad`), and is written to ``<out>/bench_lm_eval_tasks.{csv,md,tex}``
with its provenance record (``make bench-lm-eval``).
"""
from __future__ import annotations

import argparse
import sys
import time

import pandas as pd


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="figures/bench", help="folder for the table (default: figures/bench)")
    ap.add_argument("--calls", type=int, default=3, help="calls per suite and way (default: 3)")
    ap.add_argument("--zero-shot-limit", type=int, default=20, help="examples per zero-shot task (default: 20)")
    args = ap.parse_args(argv)

    import fisherkron as fk
    from fisherkron.env import OtherLoad
    from fisherkron.hf import evaluate as ev
    from fisherkron.hf.lm_eval_tasks import ZERO_SHOT_TASKS
    from fisherkron.repro.figures import save_table

    started = time.perf_counter()
    model, tok = fk.load_model("smollm2")
    suites = {"MMLU, 5-shot, 1 question per subject": (["mmlu"], 5, 1),
              f"zero-shot, {args.zero_shot_limit} per task": (list(ZERO_SHOT_TASKS), 0, args.zero_shot_limit)}
    rows = []
    for suite, (tasks, shots, limit) in suites.items():
        reference = None
        for way in ("every call", "once"):
            ev._TASK_MANAGERS.clear()
            seconds, same = [], True
            with OtherLoad() as load:
                for _ in range(args.calls):
                    if way == "every call":
                        ev._TASK_MANAGERS.clear()
                    t = time.perf_counter()
                    res = ev.run_lm_eval(model, tok, tasks, num_fewshot=shots, limit=limit, bootstrap_iters=0)
                    seconds.append(time.perf_counter() - t)
                    reference = res if reference is None else reference
                    same &= res == reference
            later = seconds[1:] or seconds
            rows.append({"suite": suite, "tasks loaded": way, "calls": args.calls,
                         "first call s": seconds[0], "later calls s": sum(later) / len(later),
                         "same scores": same, "other load": load.share})
            print(f"[bench-lm-eval] {suite} / {way}: " + ", ".join(f"{s:.1f}" for s in seconds)
                  + f" s; same scores: {same}", flush=True)
    df = pd.DataFrame(rows)
    every = df[df["tasks loaded"] == "every call"].set_index("suite")["later calls s"]
    df["saved per call s"] = [every[s] - v if w == "once" else 0.0
                              for s, w, v in zip(df["suite"], df["tasks loaded"], df["later calls s"])]
    save_table(df, "bench_lm_eval_tasks", args.out, vars(args), started=started, floatfmt=".3g",
               caption="Seconds per lm-eval call on SmolLM2, tasks loaded on every call or once per process.",
               tolerances={c: "timing" for c in ("first call s", "later calls s", "saved per call s", "other load")})
    print(df.to_string(index=False))
    return 0 if df["same scores"].all() else 1


if __name__ == "__main__":
    sys.exit(main())
