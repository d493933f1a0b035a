"""The ledger: finished results of the long studies, kept in the repository so a study resumes on another machine.

A study of several hours (the scale study, a cold ``make all``) outlives the machine it started on, and its
caches under ``data/cache/`` are not committed. The ledger keeps the small, final pieces of those caches in
``data/ledger/`` with the same relative paths:

* ``studies/**.json``: one score of one case (held-out loss, perplexity windows, lm-eval results), named by the
  hash of everything it depends on (``experiments.cases.case_config``: the model's fingerprint, the
  calibration's key, the library sources, the evaluation settings);
* ``allocation/sensitivity-*.json``: the one-point and sensitivity sweeps, named by their own key
  (``hf.sensitivity.sweep_key``), written layer by layer.

Calibration statistics (gigabytes of gradients) are never kept: a resumed study calibrates again and reads the
scores and sweeps it finds. Every file is named by its key, so a ledger entry is read only where the code and data
that made it are the same; a changed source gives new keys and the entries are simply not found.

``restore`` copies ledger files into the cache where the cache lacks them (never over a file there); ``save``
copies cache files into the ledger where they are new or changed (a sweep that grew). A cold run is one without
``restore``: ``make all`` and ``make verify`` never read the ledger.

**What a run split over machines cost.** Every notebook executed by ``make`` (:mod:`fisherkron.repro.execute`)
appends a ``start`` and an ``end`` line to ``data/cache/runs.jsonl``, and an ``alive`` line every five minutes
between them (:func:`heartbeat`); ``save`` merges them into the ledger's ``runs.jsonl``, closing each run that has
no end: a run whose process is gone ends at the last write of its progress log (``lost``) unless a later run of the
notebook has written that log since, one still running is counted up to the save (``alive``; a later save of the
same machine counts it further; a machine that cannot see the run any more leaves its last count). A run's largest
count stands: a progress log may go quiet well before its run is stopped. Time a run spent stopped
(:func:`run_paused`) is left out. :func:`run_costs` adds up, per notebook, the wall seconds of every run of it,
interrupted ones included: what a study that resumed from the ledger cost in all; :func:`paused_within` says how
long a notebook was stopped within a stretch, so a committed run's wall time can leave its pauses out too.

Command line::

    python -m fisherkron.repro.ledger save     # data/cache -> data/ledger
    python -m fisherkron.repro.ledger restore  # data/ledger -> data/cache
    python -m fisherkron.repro.ledger runs     # the wall time of every notebook's runs, in all
    python -m fisherkron.repro.ledger paused RUN SECONDS  # run RUN was stopped (SIGSTOP) that long
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import socket
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ..core.errors import FisherkronError
from ..env import _pid_alive, atomic_write, data_root
from .figures import cpu_isa, cpu_name, machine_label

__all__ = ["KEPT", "RUNS", "ledger_root", "kept_files", "save", "restore", "run_started", "run_ended", "run_paused",
           "run_machines", "run_costs", "paused_within", "main"]

#: the cache files the ledger keeps: (folder under ``data/cache``, file pattern searched recursively)
KEPT = (("studies", "*.json"), ("allocation", "sensitivity-*.json"))
#: the log of notebook runs, in ``data/cache`` and in the ledger
RUNS = "runs.jsonl"


def ledger_root() -> Path:
    """``data/ledger`` (under ``$FISHERKRON_DATA`` when set)."""
    return data_root() / "ledger"


def kept_files(root: Path) -> dict[str, Path]:
    """``{relative path: file}`` of the files under ``root`` that the ledger keeps, readable as JSON."""
    out = {}
    for folder, pattern in KEPT:
        for path in sorted((root / folder).rglob(pattern)):
            try:
                json.loads(path.read_text())
            except (OSError, ValueError):
                continue  # a file being written, or broken: not kept
            out[str(path.relative_to(root))] = path
    return out


def _copy(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(dst, lambda t: shutil.copyfile(src, t))


def save(cache: Path | None = None, ledger: Path | None = None) -> list[str]:
    """Copy the kept cache files that are new or changed into the ledger, and merge the runs log (see the module
    docstring); returns the relative paths written."""
    cache, ledger = Path(cache or data_root() / "cache"), Path(ledger or ledger_root())
    done = []
    for rel, src in kept_files(cache).items():
        dst = ledger / rel
        if not dst.is_file() or dst.read_bytes() != src.read_bytes():
            _copy(src, dst)
            done.append(rel)
    if _merge_runs(cache / RUNS, ledger / RUNS):
        done.append(RUNS)
    return done


# -- the runs log
def _utc(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


def _read_runs(path: Path) -> list[dict]:
    out = []
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue  # a line cut short by a crash
    return out


def _append(path: Path, event: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(event, sort_keys=True) + "\n")


def run_started(notebook: str, profile: str, progress: Path | None = None, cache: Path | None = None) -> str:
    """Log the start of a notebook run in ``data/cache/runs.jsonl``; returns the run's id."""
    run = uuid.uuid4().hex[:12]
    now = time.time()
    _append(Path(cache or data_root() / "cache") / RUNS,
            {"event": "start", "run": run, "notebook": notebook, "profile": profile, "t": now, "time": _utc(now),
             "host": socket.gethostname(), "cpu": cpu_name(), "isa": cpu_isa(),
             "cores": len(os.sched_getaffinity(0)), "pid": os.getpid(),
             "progress": str(progress) if progress else None})
    return run


def run_ended(run: str, ok: bool, seconds: float, cpu_seconds: float | None = None, cache: Path | None = None) -> None:
    """Log the end of run ``run`` (its wall and CPU seconds)."""
    now = time.time()
    _append(Path(cache or data_root() / "cache") / RUNS,
            {"event": "end", "run": run, "ok": bool(ok), "seconds": round(float(seconds), 1), "t": now,
             "time": _utc(now), "cpu_seconds": None if cpu_seconds is None else round(float(cpu_seconds), 1)})


@contextmanager
def heartbeat(run: str, every: float = 300.0, cache: Path | None = None) -> Iterator[None]:
    """While the block runs, log that run ``run`` is alive every ``every`` seconds (its seconds since the block
    began), so a run that dies with its machine or session is counted up to its last heartbeat, not only up to
    the last save that saw it."""
    import threading

    path, t0, stop = Path(cache or data_root() / "cache") / RUNS, time.time(), threading.Event()

    def beat() -> None:
        while not stop.wait(every):
            now = time.time()
            _append(path, {"event": "alive", "run": run, "seconds": round(now - t0, 1), "t": now, "time": _utc(now)})

    thread = threading.Thread(target=beat, name=f"heartbeat-{run}", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def run_paused(run: str, seconds: float, cache: Path | None = None) -> None:
    """Log that run ``run`` was stopped (``SIGSTOP``) for ``seconds``, e.g. while the machine measured something
    else: :func:`run_costs` leaves those seconds out. Stop every process of the run by pid (``kill -STOP``), the
    notebook's kernel included: papermill starts the kernel in a session of its own, so a signal to the ``make``
    process group leaves it computing, and the seconds logged would not have been a pause.

    Refused in one line, with nothing logged, for a run the log does not know or a pause that is negative, not a
    number, or longer than the run has existed (a shell variable left empty makes ``now - start`` a timestamp)."""
    now = time.time()
    path = Path(cache or data_root() / "cache") / RUNS
    start = next((e for e in _read_runs(path) if e.get("event") == "start" and e.get("run") == run), None)
    if start is None:
        raise FisherkronError(f"run {run!r} has no start in {path}; give the id `python -m fisherkron.repro.ledger "
                              f"runs` or the log's last start names")
    try:
        seconds = float(seconds)
    except (TypeError, ValueError):
        raise FisherkronError(f"a pause is a number of seconds; got {seconds!r}") from None
    if not 0.0 <= seconds <= now - float(start["t"]):
        raise FisherkronError(f"a pause of {seconds!r} s does not fit run {run}, which started "
                              f"{now - float(start['t']):.0f} s ago; give the seconds it was stopped")
    _append(path,
            {"event": "paused", "run": run, "seconds": round(seconds, 1), "t": now, "time": _utc(now)})


def _booted() -> float:
    """When this machine started (seconds since the epoch; 0 where ``/proc/stat`` does not tell)."""
    try:
        for line in Path("/proc/stat").read_text().splitlines():
            if line.startswith("btime "):
                return float(line.split()[1])
    except OSError:
        pass
    return 0.0


def _close(start: dict, now: float, events: list[dict] = ()) -> dict | None:
    """The closing event of a run that logged no end: ``alive`` (its process still runs here: counted up to
    ``now``), ``lost`` (gone: it ended at its progress log's last write), or ``None`` when this machine cannot
    tell (another machine's run, its log gone with it, or rewritten by a later run of the notebook in
    ``events``); then its last count stands (:func:`heartbeat`'s, or an earlier save's)."""
    same_host = start.get("host") == socket.gethostname() and _booted() <= start["t"]  # not a later machine of that name
    if same_host and _pid_alive(int(start.get("pid") or 0), since=start["t"]):
        end, event = now, "alive"
    else:
        log = Path(start["progress"]) if start.get("progress") else None
        if not same_host or log is None or not log.is_file():
            return None
        # from the next start of a run of the notebook on, the log (the same file) is that run's
        nxt = min((float(e["t"]) for e in events if e.get("event") == "start"
                   and e.get("progress") == start["progress"] and float(e["t"]) > float(start["t"])), default=math.inf)
        end, event = log.stat().st_mtime, "lost"  # a quiet stretch before the end is not seen: the alive counts
        # of earlier saves and heartbeats bound it from below (run_costs takes the largest count)
        if not start["t"] <= end < nxt:
            return None
    return {"event": event, "run": start["run"], "seconds": round(end - start["t"], 1), "t": end, "time": _utc(end)}


def _merge_runs(src: Path, dst: Path) -> bool:
    """Merge the runs log ``src`` into ``dst`` (lines new to it), closing the runs without an end; whether ``dst``
    changed."""
    have = _read_runs(dst)
    seen = {json.dumps(e, sort_keys=True) for e in have}
    new = [e for e in _read_runs(src) if json.dumps(e, sort_keys=True) not in seen]
    events = have + new
    ended = {e["run"] for e in events if e.get("event") == "end"}
    now = time.time()
    for e in [e for e in events if e.get("event") == "start" and e["run"] not in ended]:
        closing = _close(e, now, events)
        lost = any(x.get("run") == e["run"] and x.get("event") == "lost" for x in events)
        if closing is not None and not lost:  # else the last count stands (a run that cannot be seen any more)
            new.append(closing)
    if not new:
        return False
    dst.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(dst, lambda t: Path(t).write_text("".join(json.dumps(e, sort_keys=True) + "\n"
                                                           for e in have + new)))
    return True


def run_costs(ledger: Path | None = None, profile: str = "default") -> dict[str, dict]:
    """Per notebook run at ``profile``, from the ledger's runs log: ``{"runs", "seconds", "finished"}``: how many
    runs, their wall seconds in all (an interrupted run up to its last sign of life), and whether one finished."""
    events = _read_runs(Path(ledger or ledger_root()) / RUNS)
    last: dict[str, dict] = {}
    paused: dict[str, float] = {}
    for e in events:
        if e.get("event") == "paused":
            paused[e["run"]] = paused.get(e["run"], 0.0) + float(e.get("seconds") or 0.0)
        elif e.get("event") != "start":
            prev = last.get(e["run"])
            # an end is final; else the largest count (a lost run's log may have gone quiet before it ended)
            if prev is None or e.get("event") == "end" or (
                    prev.get("event") != "end" and float(e.get("seconds") or 0) > float(prev.get("seconds") or 0)):
                last[e["run"]] = e
    out: dict[str, dict] = {}
    for e in events:
        if e.get("event") == "start" and e.get("profile") == profile:
            c = out.setdefault(e["notebook"], {"runs": 0, "seconds": 0.0, "finished": False})
            close = last.get(e["run"], {})
            c["runs"] += 1
            c["seconds"] += max(float(close.get("seconds") or 0.0) - paused.get(e["run"], 0.0), 0.0)
            c["finished"] |= bool(close.get("event") == "end" and close.get("ok"))
    return out


def paused_within(notebook: str, start: float, end: float, ledgers) -> float:
    """Seconds that runs of ``notebook`` were stopped (:func:`run_paused`) between ``start`` and ``end`` (seconds
    since the epoch), from the runs logs of the folders ``ledgers``: what a wall time measured over that stretch
    (a provenance record's ``wall_seconds``) overstates. A pause is logged when it ends, so it covers
    ``[t - seconds, t]``; only its overlap with ``[start, end]`` counts, and a pause kept in two logs counts once."""
    events = {json.dumps(e, sort_keys=True): e for folder in ledgers for e in _read_runs(Path(folder) / RUNS)}
    runs = {e["run"] for e in events.values() if e.get("event") == "start" and e.get("notebook") == notebook}
    total = 0.0
    for e in events.values():
        if e.get("event") == "paused" and e.get("run") in runs:
            t, s = float(e["t"]), float(e.get("seconds") or 0.0)
            total += max(min(t, end) - max(t - s, start), 0.0)
    return total


def run_machines(ledger: Path | None = None, profile: str = "default") -> list[str]:
    """The machines (``"<cores>-core <CPU model> (<extensions>)"``, the extensions where logged) that the runs at
    ``profile`` in the ledger's log started on."""
    starts = [e for e in _read_runs(Path(ledger or ledger_root()) / RUNS)
              if e.get("event") == "start" and e.get("profile") == profile]
    return sorted({machine_label(e.get("cores"), e.get("cpu"), e.get("isa")) for e in starts})


def restore(cache: Path | None = None, ledger: Path | None = None) -> list[str]:
    """Copy the ledger's files that the cache lacks into the cache; returns their relative paths."""
    cache, ledger = Path(cache or data_root() / "cache"), Path(ledger or ledger_root())
    done = []
    for rel, src in kept_files(ledger).items():
        dst = cache / rel
        if not dst.exists():
            _copy(src, dst)
            done.append(rel)
    return done


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fisherkron.repro.ledger", description=__doc__.split("\n")[0])
    ap.add_argument("action", choices=("save", "restore", "runs", "paused"))
    ap.add_argument("run", nargs="?", help="paused: the run's id (its start in data/cache/runs.jsonl)")
    ap.add_argument("seconds", nargs="?", help="paused: how long it was stopped")
    args = ap.parse_args(argv)
    if args.action == "paused":
        if args.run is None or args.seconds is None:
            ap.error("paused needs the run's id and the seconds it was stopped")
        try:
            run_paused(args.run, args.seconds)
        except FisherkronError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        return 0
    if args.action == "runs":
        for name, c in sorted(run_costs().items()):
            print(f"{name}: {c['runs']} run(s), {c['seconds'] / 3600:.2f} h in all"
                  f"{'' if c['finished'] else ', not finished'}")
        return 0
    done = save() if args.action == "save" else restore()
    print(f"[ledger] {args.action}: {len(done)} file(s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
