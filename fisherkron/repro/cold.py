"""A cold ``make all``: every notebook of the default profile from empty caches, resumable across sessions.

``make all`` decides what to run from file times, which a fresh clone sets arbitrarily, and reads the
caches in ``data/cache``; neither is a cold run. This driver runs each notebook by name
(``make -W notebooks/<name>.py <name>``: the notebook is treated as changed, nothing else is) with
``FISHERKRON_DATA`` set to a data root of its own (``build/cold/data`` by default) that starts empty
but for the embedded models (linked, as ``make verify``'s fresh mode does), so every calibration,
sweep, score and fine-tuned encoder is computed. The outputs go where ``make all`` writes them
(``figures/``, ``notebooks/executed/``), each with its provenance record (wall time and its
phases).

It resumes: a notebook that finished is recorded in ``<data>/cold.json`` and skipped by the next
call, and one that was interrupted runs again from the caches its interrupted run filled (each
study resumes at its first missing case). Every run, interrupted ones included, is in the data
root's runs log (:mod:`fisherkron.repro.ledger`); ``--save`` copies its finished scores and sweeps
and that log into ``data/ledger/cold/`` (to commit, so a cold run survives a change of machine), and
``status`` adds up what each notebook cost over all its runs: the cold run's total.

Command line::

    python -m fisherkron.repro.cold run [--nb NAME ...] [--data DIR] [--dry-run]
    python -m fisherkron.repro.cold status [--data DIR]
    python -m fisherkron.repro.cold save [--data DIR]      # its scores, sweeps and runs log -> data/ledger/cold
    python -m fisherkron.repro.cold restore [--data DIR]   # data/ledger/cold -> its caches, where missing
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from ..core.errors import FisherkronError
from ..env import REPO_ROOT, atomic_write, data_root, models_root
from . import ledger

__all__ = ["ORDER", "EXCLUDED", "cold_data", "read_state", "plan", "run", "costs", "status"]

#: the notebooks of the cold run, in the order they run: the minutes-long ones first, then the decoder studies
#: that share SmolLM2's calibration, sweeps and scores (whichever runs first computes them), then the rest
ORDER = ("kronecker_fisher_from_scratch", "fig_synthetic_correlations", "fig_time_algo", "tab_throughput",
         "fig_singular_values", "tab_llm_compression_main", "tab_llm_compression_mmlu", "tab_ablation_diag",
         "fig_allocation_cost", "fig_rank_allocation", "fig_calibration", "tab_extra_compression_results",
         "tab_glue_results")
#: notebooks with a budget of their own, reported beside the cold run
EXCLUDED = ("fig_scale",)
#: the wall time a cold run of :data:`ORDER` should take on 2 cores, in hours
TARGET_HOURS = 6.0
STATE = "cold.json"


def cold_data(data: str | os.PathLike | None = None) -> Path:
    """The cold run's data root (default ``build/cold/data``), made with the embedded models linked in."""
    root = Path(data) if data is not None else REPO_ROOT / "build" / "cold" / "data"
    root.mkdir(parents=True, exist_ok=True)
    link = root / "models"
    if not link.exists() and models_root().is_dir():
        link.symlink_to(models_root().resolve())
    if data_root().resolve() == root.resolve():
        raise FisherkronError(f"the cold run's data root {root} is the data root in use; unset FISHERKRON_DATA "
                              f"or give another --data")
    return root


def read_state(root: Path) -> dict:
    path = root / STATE
    if not path.is_file():
        return {"done": {}}
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
    except ValueError:
        raise FisherkronError(f"{path} is damaged; remove it (the finished notebooks then run again from their "
                              f"caches)") from None
    return state if isinstance(state.get("done"), dict) else {"done": {}}


def _write_state(root: Path, state: dict) -> None:
    atomic_write(root / STATE, lambda t: Path(t).write_text(json.dumps(state, indent=1, sort_keys=True),
                                                            encoding="utf-8"))


def plan(state: dict, notebooks=ORDER) -> list[str]:
    """The notebooks still to run, in order."""
    unknown = [n for n in notebooks if not (REPO_ROOT / "notebooks" / f"{n}.py").is_file()]
    if unknown:
        raise FisherkronError(f"no notebook named {unknown[0]}; the cold run knows {', '.join(ORDER)}")
    return [n for n in notebooks if n not in state["done"]]


def _commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def run(notebooks=ORDER, data=None, make: str = "make", dry_run: bool = False) -> int:
    """Run the notebooks not yet finished (see the module's text); stops at the first failure (its exit code)."""
    root = cold_data(data)
    state = read_state(root)
    todo = plan(state, notebooks)
    env = {**os.environ, "FISHERKRON_DATA": str(root.resolve())}
    env.pop("FISHERKRON_MODELS", None)
    for name in todo:
        cmd = [make, "-W", f"notebooks/{name}.py", name]
        free = shutil.disk_usage(root).free / 1e9
        print(f"[cold] {name}: {' '.join(cmd)} (FISHERKRON_DATA={os.path.relpath(root, REPO_ROOT)}, "
              f"{free:.0f} GB free there)", flush=True)
        if dry_run:
            continue
        t = time.time()
        rc = subprocess.call(cmd, cwd=REPO_ROOT, env=env)
        if rc != 0:
            print(f"[cold] {name} failed (exit {rc}); the next call resumes it from its caches", file=sys.stderr)
            return rc
        state = read_state(root)  # another call may have finished a notebook meanwhile
        state["done"][name] = {"seconds": round(time.time() - t, 1), "finished": time.strftime(
            "%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "commit": _commit()}
        _write_state(root, state)
    return 0


def costs(book: Path, done=None) -> list[dict]:
    """Per notebook of :data:`ORDER`, from the runs log of ``book``: ``{"notebook", "finished", "runs", "seconds"}``
    (its runs and their wall seconds in all); ``finished`` from ``done`` (names) when given, else from the log."""
    got = ledger.run_costs(book)
    rows = []
    for n in ORDER:
        c = got.get(n, {"runs": 0, "seconds": 0.0, "finished": False})
        rows.append({"notebook": n, "finished": n in done if done is not None else c["finished"], "runs": c["runs"],
                     "seconds": c["seconds"]})
    return rows


def status(data=None, book: Path | None = None) -> list[dict]:
    """Per notebook of :data:`ORDER`: finished or not, and its wall seconds over all its runs. Saves first (as
    ``save``), so that the runs log of ``book`` (default ``data/ledger/cold``) holds the data root's runs, a run
    still going counted up to now."""
    root = cold_data(data)
    state = read_state(root)
    book = Path(book or data_root() / "ledger" / "cold")
    ledger.save(root / "cache", book)
    return costs(book, state["done"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fisherkron.repro.cold", description=__doc__.split("\n")[0])
    ap.add_argument("action", choices=("run", "status", "save", "restore"))
    ap.add_argument("--nb", nargs="+", default=list(ORDER), help="notebooks (default: all of the cold run)")
    ap.add_argument("--data", default=None, help="the cold run's data root (default: build/cold/data)")
    ap.add_argument("--dry-run", action="store_true", help="run: print the commands only")
    args = ap.parse_args(argv)
    try:
        if args.action == "run":
            return run(args.nb, args.data, dry_run=args.dry_run)
        root, book = cold_data(args.data), data_root() / "ledger" / "cold"
        if args.action == "save":
            print(f"[cold] save: {len(ledger.save(root / 'cache', book))} file(s) into {book}")
        elif args.action == "restore":
            print(f"[cold] restore: {len(ledger.restore(root / 'cache', book))} file(s) from {book}")
        else:
            rows = status(args.data, book)
            for r in rows:
                print(f"{r['notebook']:32s} {'finished' if r['finished'] else 'not finished':13s} "
                      f"{r['runs']} run(s) {r['seconds'] / 3600:6.2f} h")
            print(f"{'total':32s} {sum(r['finished'] for r in rows)} of {len(rows)} finished, "
                  f"{sum(r['seconds'] for r in rows) / 3600:.2f} h")
    except FisherkronError as exc:
        print(f"[cold] error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
