"""``make verify``: re-execute notebooks into a scratch folder and compare their tables with the committed ones.

For each notebook the driver

1. executes it as ``make`` does (jupytext to ``.ipynb``, papermill with
   ``notebooks/params/<name>.default.yaml``), but with ``output_dir`` and the executed notebook
   in a scratch folder (``build/verify/figures``, ``build/verify/notebooks``): ``figures/`` and
   the committed executed notebooks are never written. With ``--data fresh`` (the default) the
   notebook also gets empty caches (``FISHERKRON_DATA=build/verify/data``; only the dequantised
   SmolLM2 folder ``data/models`` is linked in, it is a conversion of a packaged file, not a
   result), so nothing in ``data/cache`` is read or written. ``--data statistics`` links in only the
   expensive inputs (:data:`STATISTICS_CACHES`: calibration statistics, sensitivity sweeps, task files,
   and the calibration cost measurements of the studies' result files, :data:`MEASUREMENT_RECORDS`),
   so every compression and every score is recomputed in minutes rather than hours;
2. compares every value of every table it wrote (``<name>.csv``) with the committed
   ``figures/<name>.csv``, column by column, within the column's tolerance
   (:mod:`fisherkron.repro.tolerance`): the one declared in the table's provenance record
   (``save_table(..., tolerances=...)``), else the one in
   :data:`fisherkron.repro.verify_tolerances.TOLERANCES`, else a conservative default that
   the report names. Timing columns are shown as the median ratio new / committed and never fail;
3. prints one line per table (columns compared, worst margin = ``|new - committed| / tolerance``,
   at most 1 to pass) and every value outside its tolerance, writes ``report.json`` in the
   scratch folder (the results with the commit the run started from, its data mode -- a resumed
   ``scratch`` run says what it resumes -- the machine, and when it started and finished), and
   exits 1 if any value is outside (2 if a notebook failed to run);
4. with ``--record DIR`` (``make verify`` passes ``data/verify``), keeps one committed record per
   notebook and CPU model, ``DIR/<cpu>/<notebook>.json`` (:func:`notebook_record`, :func:`cpu_folder`: a run
   on an Intel Xeon never replaces what an AMD EPYC showed, nor the other way round): its result, tables,
   worst margins, every value outside tolerance, wall and CPU time, the share of the cores other processes
   used meanwhile (:class:`fisherkron.env.OtherLoad`), the data mode, commit and machine, and a checksum of
   each committed table it was compared with, so the book's reproduction page
   (:mod:`fisherkron.repro.book.generated`) can say which committed tables a run vouches for and
   which changed since. ``--record-from REPORT`` files an earlier run's ``report.json``.

A committed table of the notebook that the run did not write, a table with other rows or
columns, and a table the committed folder lacks are reported too (the first two fail).

Every file is read through :func:`fisherkron.repro.figures.read_table` /
:func:`~fisherkron.repro.figures.read_provenance` (records: :func:`read_record`), and the committed
tables and records of the notebooks asked for are all read before anything runs or is written: a damaged
one (empty, binary, cut short, hand-edited) stops the run at once with one line naming the file and what to
do, exit status 2.

Command line: ``python -m fisherkron.repro.verify [--nb NAME ...] [--data fresh|scratch|statistics|shared]
[--no-run] [--record DIR] [--stale] [--list] [--record-from REPORT]``; ``make verify [NB=name]``,
``make verify-quick`` and ``make verify-stale`` (mk/verify.mk) call it. ``--stale`` keeps, of the notebooks asked
for, those whose record from this CPU model (:func:`stale_notebooks`) is missing, did not pass or was compared
with a table committed since; ``--list`` names the notebooks it would run and stops.
The comparison is :mod:`fisherkron.repro.compare`; its :func:`~fisherkron.repro.compare.compare_frames` is also
what ``tests/test_determinism.py`` uses, with every non-timing column exact.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import time
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ..core.errors import FisherkronError
from ..env import REPO_ROOT, OtherLoad, atomic_write, file_checksum, json_object, read_committed
from .compare import (Failure, TableReport, check_committed, compare_frames, compare_notebook, compare_table,
                      declared_tolerances, tables_of)
from .execute import execute
from .execute import rel as _rel

__all__ = ["Failure", "TableReport", "compare_frames", "compare_table", "compare_notebook", "tables_of",
           "declared_tolerances", "notebook_record", "write_records", "read_record", "read_records", "cpu_folder",
           "main"]


# -- the committed record of each verification ---------------------------------------------------
#: the version of a record's layout (data/verify/<cpu>/<notebook>.json)
RECORD_VERSION = 1
#: the kinds of a record's fields (:func:`notebook_record`): those the book reads are required
RECORD_FIELDS = {"result": "text", "values": "integer", "worst": "number", "failures": "list", "tables": "list"}
RECORD_OPTIONAL = {"version": "integer", "notebook": "text", "seconds": "number|null", "cpu_seconds": "number|null",
                   "others_cpu_share": "number|null", "data": "text|null", "git": "object|null",
                   "machine": "object|null", "started": "text|null", "finished": "text|null"}


def _record_check(rec: dict) -> None:
    if not all(isinstance(f, str) for f in rec["failures"]):
        raise ValueError("field 'failures' holds something other than text lines")
    for i, t in enumerate(rec["tables"], 1):
        if not (isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("sha"), (str, type(None)))):
            raise ValueError(f"table {i} of field 'tables' is not an object with a 'name' and a 'sha'")


def cpu_folder(machine: Mapping[str, Any] | None = None) -> str:
    """The folder of ``data/verify/`` that keeps the records made on ``machine`` (a record's ``machine``; this
    machine where None): its CPU model, lower case, hyphenated. Float32 results differ in their last bits between
    CPU models, so each keeps its own record of a notebook.

    >>> cpu_folder({"cpu": "Intel(R) Xeon(R) Processor"}), cpu_folder({"cpu": "AMD EPYC"}), cpu_folder({})
    ('intel-xeon', 'amd-epyc', 'unknown')
    """
    from .figures import cpu_model, cpu_name

    name = cpu_model(cpu_name() if machine is None else machine.get("cpu"))
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "unknown"


def read_record(path: str | Path) -> dict[str, Any]:
    """The ``make verify`` record at ``path`` (``data/verify/<cpu>/<notebook>.json``); a damaged one (cut short,
    hand-edited to other kinds of fields) is one :class:`FisherkronError` naming it and what to do."""
    path = Path(path)
    return read_committed(path, json_object(RECORD_FIELDS, RECORD_OPTIONAL, _record_check),
                          what="a `make verify` record (JSON)", remake=f"re-run `make verify NB={path.stem}`")


def read_records(folder: str | Path) -> dict[tuple[str, str], dict[str, Any]]:
    """Every record under ``folder`` (``data/verify``), by (notebook, CPU model folder), sorted so; a damaged
    one is the one-line error of :func:`read_record`."""
    paths = sorted(Path(folder).glob("*/*.json"), key=lambda p: (p.stem, p.parent.name))
    return {(p.stem, p.parent.name): read_record(p) for p in paths}


def notebook_record(notebook: str, report: Mapping[str, Any], ref: Path) -> dict[str, Any]:
    """What one ``report.json`` (or the run just made) says of ``notebook``: the record ``--record`` keeps.

    ``report`` holds the run-wide fields ``main`` writes (``git``, ``data``, ``machine``,
    ``finished``, ``seconds``, ``cpu_seconds``, ``others_cpu_share``, ``failed_to_run``) and
    ``tables``, each an ``asdict(TableReport)``; a field an older report lacks is None. ``ref``:
    the committed tables, whose checksums the record keeps.

    >>> r = notebook_record("nb", {"tables": [{"name": "t", "notebook": "notebooks/nb.py", "status": "PASS",
    ...     "columns": 2, "values": 6, "worst": 0.25, "failures": []}], "seconds": {"nb": 9.0}}, Path("/no"))
    >>> r["result"], r["values"], r["worst"], r["seconds"], r["git"], r["tables"][0]["sha"]
    ('PASS', 6, 0.25, 9.0, None, None)
    """
    tables = [t for t in report.get("tables", []) if t.get("notebook") == f"notebooks/{notebook}.py"]
    failures = [Failure(**f).line() for t in tables for f in t.get("failures", [])]
    failed = notebook in report.get("failed_to_run", [])
    bad = failures or any(t["status"] not in ("PASS", "NEW") for t in tables)
    result = "FAILED TO RUN" if failed else "FAIL" if bad else "PASS" if tables else "NO TABLE"
    sha = {t["name"]: file_checksum(ref / f"{t['name']}.csv") if (ref / f"{t['name']}.csv").is_file() else None
           for t in tables}
    per = {k: (report.get(k) or {}).get(notebook) for k in ("seconds", "cpu_seconds", "others_cpu_share")}
    return {"version": RECORD_VERSION, "notebook": notebook, "result": result,
            "values": sum(int(t.get("values", 0)) for t in tables),
            "worst": max((float(t.get("worst", 0.0)) for t in tables), default=0.0), "failures": failures,
            "tables": [{k: t.get(k) for k in ("name", "status", "columns", "values", "worst", "source", "notes")}
                       | {"sha": sha[t["name"]]} for t in tables],
            **per, **{k: report.get(k) for k in ("data", "git", "machine", "started", "finished")}}


def write_records(folder: Path, report: Mapping[str, Any], ref: Path) -> list[Path]:
    """``folder/<cpu>/<notebook>.json`` for every notebook of ``report`` (written atomically; ``<cpu>``: the
    :func:`cpu_folder` of the report's machine); their paths.

    Every record is made before the first is written, so a report that cannot be read writes none.
    """
    folder = Path(folder) / cpu_folder(report.get("machine") or {})
    recs = [notebook_record(n, report, ref) for n in report.get("notebooks", [])]
    folder.mkdir(parents=True, exist_ok=True)
    return [atomic_write(folder / f"{rec['notebook']}.json",
                         lambda t, rec=rec: Path(t).write_text(json.dumps(rec, indent=1, default=str) + "\n",
                                                               encoding="utf-8"))
            for rec in recs]


# -- running ---------------------------------------------------------------------------------
#: what ``--data statistics`` links in from data/: the expensive inputs that every score is computed
#: from (calibration statistics, ASVD's sensitivity sweeps, the packaged lm-eval task files, and the
#: GLUE study's fine-tuned encoders, its models before compression), so that a notebook whose inputs
#: take hours recomputes every compression and every score in minutes. A miss in these caches writes
#: into data/; the score caches (``cache/studies``) start empty but for :data:`MEASUREMENT_RECORDS`.
STATISTICS_CACHES = ("hf_home", "cache/calibration", "cache/allocation", "cache/lm_eval_tasks", "cache/finetune")
#: the records ``--data statistics`` also carries over from data/'s study result files
#: (``cache/studies/<study>-<key>.json``, keys starting so): a calibration setting's cost measured in a fresh
#: process (collection time, throughput, disk, peak memory). They are inputs of the same kind as the
#: statistics: timings, which are never compared, and re-measuring them collects the largest settings again in
#: temporary folders (fig_calibration's k = 64: about 16 GB). Every other record of the file (the scores)
#: starts empty and is recomputed.
MEASUREMENT_RECORDS = "cost|"


def changed_tables(rec: Mapping[str, Any], ref: Path) -> list[str]:
    """The tables of the record ``rec`` whose committed ``ref/<table>.csv`` is no longer the one it was compared
    with (or is gone): what the record no longer vouches for."""
    return [t["name"] for t in rec["tables"]
            if t.get("sha") is None or not (ref / f"{t['name']}.csv").is_file()
            or file_checksum(ref / f"{t['name']}.csv") != t["sha"]]


def stale_notebooks(names: list[str], folder: Path, ref: Path, cpu: str | None = None) -> dict[str, str]:
    """Of ``names``, the notebooks whose record from CPU model ``cpu`` (a :func:`cpu_folder`; this machine's where
    None) in ``folder`` does not vouch for the committed tables in ``ref``, each with the reason: no record, a
    record that did not pass, or tables changed since it (a damaged record is one :class:`FisherkronError`)."""
    cpu = cpu or cpu_folder()
    stale = {}
    for n in names:
        path = Path(folder) / cpu / f"{n}.json"
        if not path.is_file():
            stale[n] = f"no record from {cpu}"
            continue
        rec = read_record(path)
        why = [f"its record says {rec['result']}"] if rec["result"] not in ("PASS", "NO TABLE") else []
        changed = changed_tables(rec, ref)
        why += ["changed since its record: " + ", ".join(changed)] if changed else []
        if why:
            stale[n] = "; ".join(why)
    return stale


def _utc(t: float | None = None) -> str:
    """``2026-11-25T14:16:17Z``: a report's times (now, or the epoch seconds ``t``)."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


def _resumes_statistics(scratch: Path) -> bool:
    """Whether ``scratch`` holds a ``statistics`` run (its calibration cache is still a link to data/)."""
    return (scratch / "data" / "cache" / "calibration").is_symlink()


def _seed_measurements(src: Path, dst: Path) -> int:
    """Copy the :data:`MEASUREMENT_RECORDS` of every study result file in ``src`` into a file of the same name
    in ``dst`` (nothing else of it); the number of records copied."""
    n = 0
    for f in sorted(src.glob("*.json")) if src.is_dir() else []:
        try:
            records = json.loads(f.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue  # not a result file, or a damaged one: the run measures again
        if not isinstance(records, dict):
            continue
        keep = {k: v for k, v in records.items() if k.startswith(MEASUREMENT_RECORDS)}
        if keep:
            dst.mkdir(parents=True, exist_ok=True)
            atomic_write(dst / f.name, lambda t, keep=keep: Path(t).write_text(json.dumps(keep, indent=1),
                                                                               encoding="utf-8"))
            n += len(keep)
    return n


def _data_env(mode: str, scratch: Path) -> tuple[dict[str, str], str]:
    env = dict(os.environ)
    if mode == "shared":
        return env, "shared caches (data/)"
    data = scratch / "data"
    if mode in ("fresh", "statistics") and data.exists():
        shutil.rmtree(data)
    data.mkdir(parents=True, exist_ok=True)
    from ..env import data_root, models_root

    models = models_root()
    env.pop("FISHERKRON_MODELS", None)
    # ``scratch`` after a ``statistics`` run resumes it as one (its calibration link is still there)
    statistics = mode == "statistics" or (mode == "scratch" and _resumes_statistics(scratch))
    if statistics:  # the model from its own path, which the calibration keys hash (env.models_root)
        env["FISHERKRON_MODELS"] = str(models)
    linked = STATISTICS_CACHES if statistics else ("models",)
    for sub in linked:
        src = models if sub == "models" else data_root() / sub
        if src.is_dir() and not (data / sub).exists():
            (data / sub).parent.mkdir(parents=True, exist_ok=True)
            (data / sub).symlink_to(src.resolve())
    seeded = _seed_measurements(data_root() / "cache" / "studies", data / "cache" / "studies") \
        if mode == "statistics" else 0
    env["FISHERKRON_DATA"] = str(data.resolve())
    what = {"fresh": "empty caches",
            "scratch": "the scratch caches of the last run",
            "statistics": "data/'s calibration statistics, sweeps, task files and fine-tuned encoders linked in"
                          + (f", {seeded} cost measurement(s) of its studies copied" if seeded else "")
                          + ", every score recomputed"}[mode]
    if statistics and mode == "scratch":
        what += " (a statistics run resumed: data/'s statistics still linked)"
    return env, what + f" ({_rel(data, REPO_ROOT)})"


def _all_notebooks(root: Path, profile: str) -> list[str]:
    return sorted(p.stem for p in (root / "notebooks").glob("*.py")
                  if (root / "notebooks" / "params" / f"{p.stem}.{profile}.yaml").is_file())


def main(argv: list[str] | None = None) -> int:
    """The command line (see the module's docstring); a missing or damaged input is one line on stderr, exit 2."""
    try:
        return _main(argv)
    except FisherkronError as exc:
        print(f"[verify] error: {exc}", file=sys.stderr)
        return 2


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m fisherkron.repro.verify", description=__doc__.split("\n")[0])
    ap.add_argument("--nb", action="append", default=[],
                    help="notebook(s) to check (space- or comma-separated, repeatable; default: every notebook)")
    ap.add_argument("--ref", default="figures", help="the committed tables (default figures/)")
    ap.add_argument("--scratch", default="build/verify", help="where the runs write (default build/verify/)")
    ap.add_argument("--data", choices=("fresh", "scratch", "statistics", "shared"), default="fresh",
                    help="caches: fresh = empty (default), scratch = those the last verify run left, "
                         "statistics = data/'s calibration statistics and sweeps, every score recomputed, "
                         "shared = data/ (reads and may add cache entries)")
    ap.add_argument("--no-run", action="store_true", help="compare what the scratch folder holds; run nothing")
    ap.add_argument("--budget", type=float, default=None, help="warn when the runs take longer (seconds)")
    ap.add_argument("--record", default=None, metavar="DIR",
                    help="keep each notebook's result in DIR/<cpu>/<notebook>.json (make verify: data/verify)")
    ap.add_argument("--stale", action="store_true",
                    help="only the notebooks (of --nb, or all) whose record from this CPU model in --record's "
                         "folder is missing, did not pass, or predates a committed table")
    ap.add_argument("--list", action="store_true", help="print the notebooks it would run and stop")
    ap.add_argument("--record-from", default=None, metavar="REPORT",
                    help="file the results of an earlier run's report.json into --record's folder; run nothing")
    return ap


def _file_report(a: argparse.Namespace, root: Path, ref: Path) -> int:
    """``--record-from REPORT``: file an earlier run's ``report.json`` into ``--record``'s folder."""
    report = read_committed(a.record_from, json_object({"notebooks": "list", "tables": "list"}),
                            what="a `make verify` report (JSON)", committed=False,
                            remake="pass the report.json that a finished `make verify` run wrote")
    if not report.get("finished"):  # a report from before it said: the time it was written
        report["finished"] = _utc(Path(a.record_from).stat().st_mtime)
    try:
        written = write_records(root / a.record, report, ref)  # an absolute DIR stays itself
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise FisherkronError(f"{a.record_from} is not a `make verify` report ({type(exc).__name__}: {exc}): "
                              f"pass the report.json that a finished `make verify` run wrote") from None
    for p in written:
        print(f"[verify] recorded {_rel(p, root)}")
    return 0


def _main(argv: list[str] | None) -> int:
    ap = _parser()
    a = ap.parse_args(argv)
    root = REPO_ROOT
    ref = (root / a.ref) if not Path(a.ref).is_absolute() else Path(a.ref)
    if a.record_from:
        if not a.record:
            ap.error("--record-from needs --record DIR (where the records go)")
        return _file_report(a, root, ref)
    names = [n for arg in a.nb for n in re.split(r"[\s,]+", arg) if n] or _all_notebooks(root, "default")
    unknown = [n for n in names if not (root / "notebooks" / f"{n}.py").is_file()]
    if unknown:
        print(f"[verify] no notebook {', '.join(unknown)} in notebooks/", file=sys.stderr)
        return 2
    if a.stale:
        if not a.record:
            ap.error("--stale needs --record DIR (the records it reads)")
        stale = stale_notebooks(names, root / a.record, ref)
        for n, why in stale.items():
            print(f"[verify] {n}: {why}")
        if not stale:
            print(f"[verify] every record of this CPU model in {a.record}/{cpu_folder()} vouches for the committed "
                  "tables of its notebook")
            return 0
        names = list(stale)
    if a.list:
        print(" ".join(names))
        return 0
    check_committed(ref, names)  # a damaged committed table or record: one line, before anything runs or is written
    scratch = (root / a.scratch) if not Path(a.scratch).is_absolute() else Path(a.scratch)
    figdir, nb_build, logs = scratch / "figures", scratch / "notebooks", scratch / "logs"
    from .figures import git_commit, machine_info

    git_start = git_commit(root)  # the code the notebooks run: a commit landing meanwhile does not change it
    started = _utc()
    broken, runs, cpus, others, t_all = [], {}, {}, {}, time.perf_counter()
    data_mode = None if a.no_run else a.data
    if not a.no_run:
        for d in (figdir, nb_build, logs):
            shutil.rmtree(d, ignore_errors=True)
            d.mkdir(parents=True)
        env, what = _data_env(a.data, scratch)
        if a.data == "scratch":  # what the resumed run is: its links say
            data_mode = "statistics, resumed" if _resumes_statistics(scratch) else "scratch (resumed)"
        print(f"[verify] {len(names)} notebook(s) into {_rel(scratch, root)}/ with {what}; committed tables: "
              f"{_rel(ref, root)}/", flush=True)
        for n in names:
            with OtherLoad() as load:
                ok, sec, cpu = execute(n, figdir, nb_build, env=env, root=root, log=logs / f"{n}.log")
            runs[n] = round(sec, 1)
            cpus[n] = round(cpu, 1)
            others[n] = None if load.share is None else round(load.share, 3)
            busy = "" if load.share is None else f", other processes {load.share:.0%} of the cores"
            print(f"[verify] {n}: {'ran' if ok else 'FAILED'} in {sec:.0f} s (CPU {cpu:.0f} s{busy})"
                  + ("" if ok else f" (log {_rel(logs / (n + '.log'), root)}, notebook "
                                   f"{_rel(nb_build / (n + '.failed.ipynb'), root)})"), flush=True)
            if not ok:
                broken.append(n)
    reports = []
    for n in names:
        if n in broken:
            continue
        tabs = compare_notebook(n, ref, figdir)
        reports += tabs
        print(f"[verify] {n}: " + (f"{len(tabs)} table(s)" if tabs else
                                   "writes no table" + (" (ran without error)" if n in runs else "")))
        for r in tabs:
            print("  " + r.line())
            if r.defaults:
                print("      undeclared, default used: " + "; ".join(f"{c!r} {d}" for c, d in r.defaults.items()))
            for note in r.notes if r.status not in ("MISSING", "NEW") else []:
                print(f"      note: {note}")
    failures = [f for r in reports for f in r.failures]
    total = time.perf_counter() - t_all
    if failures:
        print(f"[verify] {len(failures)} value(s) outside tolerance:")
        for f in failures:
            print("  " + f.line())
    status = 2 if broken else (1 if failures else 0)
    print(f"[verify] {'FAILED' if status else 'OK'}: {len(reports)} table(s) of {len(names)} notebook(s), "
          f"{len(failures)} value(s) outside tolerance"
          + (f", {len(broken)} notebook(s) failed to run" if broken else "")
          + (f"; {total:.0f} s wall, {sum(cpus.values()):.0f} s CPU on {os.cpu_count()} cores" if runs else ""))
    if a.budget and runs and total > a.budget:
        print(f"[verify] WARNING: took {total:.0f} s, over the {a.budget:.0f} s budget", file=sys.stderr)
    scratch.mkdir(parents=True, exist_ok=True)
    # what a reader of the report needs to know what was checked: the code, the caches, the machine, when
    run = {"git": git_start, "data": data_mode, "ref": _rel(ref, root),
           "machine": {k: v for k, v in machine_info().items()
                       if k in ("cpu", "cpu_isa", "cpu_count", "torch", "kernels", "platform")},
           "started": started, "finished": _utc()}
    report = {"notebooks": names, **run, "seconds": runs, "cpu_seconds": cpus, "others_cpu_share": others,
              "total_seconds": round(total, 1), "failed_to_run": broken,
              "tables": [{**asdict(r), "failures": [asdict(f) for f in r.failures]} for r in reports]}
    (scratch / "report.json").write_text(json.dumps(report, indent=1, default=str) + "\n", encoding="utf-8")
    if a.record and runs:  # a run, not a --no-run comparison: what it vouches for is kept
        for p in write_records(root / a.record, report, ref):
            print(f"[verify] recorded {_rel(p, root)}")
    return status


if __name__ == "__main__":
    sys.exit(main())
