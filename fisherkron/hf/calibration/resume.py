"""Interrupted collections: the checkpoints of a ``<key>.partial/`` folder, the rows they vouch for, and the signals.

A cached collection is written into ``<cache>/<key>.partial/`` (its owner and its disk space:
:mod:`.folders`). At a batch boundary, at least every ``checkpoint_seconds`` and when Ctrl-C or
SIGTERM asks it to stop, the progress is kept there (:class:`Checkpoint`): the batches done, the
sums so far, the per-gradient scales of ``grad_dtype="float16"``, and a CRC-32 of every range of
rows written into the gradient files (:class:`Rows`); a digest of all of it guards the file itself.

A resume trusts nothing it did not check: the checkpoint must carry this key and its digest,
each gradient file must have the dtype and shape of the collection, and every row range the
checkpoint lists must still have its checksum (a truncated, deleted or zero-filled file fails).
Damaged rows of per-batch gradients are run again (only their batches, only their gradients);
damage in the per-token rows, or a checkpoint that fails its own check, starts the collection
again; both with a warning. Before the folder becomes an entry every row of every gradient file
must be accounted for (:meth:`Rows.require`): no zero-filled row is ever sealed.

Under a process group every rank keeps its own checkpoint ``progress.rank<r>-of-<w>.pt`` (its
batches ``r, r + w, ...``); a later run with the same world size resumes each rank from its own,
and one with another world size (or one process) starts again with a warning.
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
import time
import zlib
from pathlib import Path

import numpy as np
import torch

from ...core.conventions import FisherkronError
from ...env import atomic_write

__all__ = ["Checkpoint", "Rows", "deferred_interrupts", "open_rows", "progress_file", "drop_foreign_progress",
           "plan_resume"]

log = logging.getLogger(__name__)


def progress_file(rank: int = 0, world: int = 1) -> str:
    """The checkpoint's file name: ``progress.pt`` for one process, ``progress.rank<r>-of-<w>.pt`` per rank."""
    return "progress.pt" if world == 1 else f"progress.rank{rank}-of-{world}.pt"


def drop_foreign_progress(folder: Path, world: int) -> None:
    """Remove checkpoints of another world size from ``folder`` (they cannot be resumed here), with a warning."""
    mine = {progress_file(r, world) for r in range(world)}
    foreign = [p for p in folder.glob("progress*.pt") if p.name not in mine]
    if foreign:
        log.warning("%s holds the progress of an interrupted collection run on another number of processes "
                    "(%s); this run has %d, so it starts again", folder, ", ".join(sorted(p.name for p in foreign)),
                    world)
        for p in foreign:
            p.unlink(missing_ok=True)


def _digest(obj, h=None) -> str:
    """A stable hash of a checkpoint's contents (dicts, lists, tensors, numbers, strings)."""
    top = h is None
    h = h or hashlib.blake2b(digest_size=16)
    if isinstance(obj, dict):
        h.update(b"{")
        for key in sorted(obj, key=repr):
            h.update(repr(key).encode())
            _digest(obj[key], h)
        h.update(b"}")
    elif isinstance(obj, (list, tuple)):
        h.update(b"[")
        for v in obj:
            _digest(v, h)
        h.update(b"]")
    elif isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    else:
        h.update(repr(obj).encode())
    return h.hexdigest() if top else ""


class Rows:
    """CRC-32 of every range of rows written into the ``.npy`` files of a folder: ``{file: {start: [stop, crc]}}``.

    Recorded as the rows are written; kept in the checkpoint; checked against the files when
    a collection resumes (:meth:`damaged`) and for completeness before the folder is sealed.
    """

    def __init__(self, log_: dict | None = None):
        self.log = {f: {int(s): [int(v[0]), int(v[1])] for s, v in r.items()} for f, r in (log_ or {}).items()}

    def record(self, file: str, start: int, stop: int, data: np.ndarray) -> None:
        self.log.setdefault(file, {})[start] = [stop, zlib.crc32(np.ascontiguousarray(data))]

    def forget(self, file: str) -> None:
        self.log.pop(file, None)

    def damaged(self, folder: Path, layout: dict) -> tuple[set[str], dict[str, set[int]]]:
        """``(broken files, {file: starts of damaged ranges})``: files missing or not of ``layout``'s dtype and
        shape, and recorded ranges whose rows no longer have their checksum."""
        broken, bad = set(), {}
        for file, (dtype, shape) in layout.items():
            path = folder / file
            try:
                mm = np.load(path, mmap_mode="r")
                ok = mm.dtype == np.dtype(dtype) and mm.shape == tuple(shape)
            except (OSError, ValueError, EOFError):
                ok = False
            if not ok:
                broken.add(file)
                continue
            for start, (stop, crc) in self.log.get(file, {}).items():
                if stop > mm.shape[0] or zlib.crc32(np.ascontiguousarray(mm[start:stop])) != crc:
                    bad.setdefault(file, set()).add(start)
            del mm
        return broken, bad

    def covers(self, file: str, starts=None, total: int | None = None) -> bool:
        """Whether the ranges of ``file`` include every start of ``starts`` (one row each), or tile ``[0, total)``."""
        got = self.log.get(file, {})
        if starts is not None:
            return all(s in got and got[s][0] == s + 1 for s in starts)
        at = 0
        for s in sorted(got):
            if s != at:
                return False
            at = got[s][0]
        return at == total

    def require(self, folder: Path, file: str, starts=None, total: int | None = None) -> None:
        """Raise unless every row of ``file`` was written and checksummed (no zero-filled row is sealed)."""
        if not self.covers(file, starts, total):
            raise FisherkronError(f"{folder / file}: some rows were never written (a damaged resume); delete "
                                  f"{folder} and collect the calibration again")


class Checkpoint:
    """The progress of a cached collection in its ``<key>.partial/`` folder.

    Saved (atomically) at a batch boundary at least every ``every`` seconds and when a signal
    asked the collection to stop; read back (and checked) by the next call with the same key.
    ``file``: :func:`progress_file` of this process.
    """

    FILE = "progress.pt"

    def __init__(self, folder: Path, key: str, every: float, signals: "_Signals", file: str = FILE):
        self.folder, self.key, self.every, self.signals, self.file = folder, key, every, signals, file
        self.last = time.monotonic()

    @property
    def path(self) -> Path:
        return self.folder / self.file

    def load(self) -> dict | None:
        """``{"done", "acc", "tokens", "rows", "scales"}`` of an earlier interrupted run, or ``None``."""
        f = self.path
        if not f.exists():
            return None
        try:
            got = torch.load(f, weights_only=True)
            if got.get("key") != self.key:
                return None
            digest = got.pop("digest", None)
            if digest != _digest(got):
                raise ValueError("its contents fail their digest")
            return {"done": int(got["done"]), "acc": got["acc"], "tokens": dict(got["tokens"]),
                    "rows": Rows(got["rows"]), "scales": got.get("scales") or {}}
        except Exception as exc:  # noqa: BLE001 - an unreadable or damaged checkpoint means: start again
            log.warning("calibration progress %s is unreadable or damaged (%s); starting the collection again",
                        f, str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
            return None

    def due(self) -> bool:
        return self.signals.pending is not None or time.monotonic() - self.last >= self.every

    def save(self, done: int, acc, tokens, rows: Rows, scales: dict | None = None) -> None:
        state = {"key": self.key, "done": done, "acc": acc, "tokens": tokens, "rows": rows.log,
                 "scales": {n: torch.as_tensor(s, dtype=torch.float64).clone() for n, s in (scales or {}).items()}}
        state["digest"] = _digest(state)
        atomic_write(self.path, lambda t: torch.save(state, t))
        self.last = time.monotonic()


class _Signals:
    pending: int | None = None


@contextlib.contextmanager
def deferred_interrupts():
    """Ctrl-C and SIGTERM set ``pending`` instead of raising, so the batch under way can finish and
    the progress be kept; a second signal raises ``KeyboardInterrupt`` at once (main thread only).
    A signal that nothing acted on (it came after the last batch) raises once the block is done."""
    import signal
    import threading

    flag = _Signals()
    if threading.current_thread() is not threading.main_thread():
        yield flag
        return

    def handler(signum, frame):
        if flag.pending is not None:
            raise KeyboardInterrupt(f"terminated by signal {signum}")
        flag.pending = signum
        log.warning("signal %d: finishing the current calibration batch and keeping the progress "
                    "(send it again to stop at once)", signum)

    old = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield flag
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)
    if flag.pending is not None:
        raise KeyboardInterrupt(f"stopped by signal {flag.pending}; the calibration had finished and is kept")


def open_rows(path: Path, dtype, shape, keep: bool) -> tuple[np.memmap, bool]:
    """``(memory map, created)`` of a ``.npy`` file to fill: the existing one when ``keep`` and it has this dtype
    and shape (its rows were checked by :meth:`Rows.damaged`), else a new one."""
    if keep and path.exists():
        try:
            mm = np.load(path, mmap_mode="r+")
            if mm.dtype == np.dtype(dtype) and mm.shape == tuple(shape):
                return mm, False
        except (OSError, ValueError, EOFError):
            pass
    path.unlink(missing_ok=True)
    return np.lib.format.open_memmap(path, mode="w+", dtype=dtype, shape=tuple(shape)), True


def plan_resume(checkpoint: "Checkpoint | None", layout: dict, mine: list[int], per_token: bool,
                names: list[str]) -> tuple[dict | None, dict[str, set[int]]]:
    """What a collection resumes from: ``(state, redo)``.

    ``state``: the checked checkpoint (``None``: start from the first batch). ``redo``: per
    gradient file, the batches of ``mine`` (the batch indices this process runs, in order) whose
    rows are missing or damaged; they are run again before the collection goes on. ``layout``:
    ``{file: (dtype, shape)}`` of the gradient files. Per-token rows (``per_token``) are not
    repaired: any damage starts the collection again.
    """
    state = checkpoint.load() if checkpoint is not None else None
    if state is None:
        return None, {}
    rows, done = state["rows"], state["done"]
    broken, bad = rows.damaged(checkpoint.folder, layout)
    if per_token:
        whole = all(rows.covers(f"{n}.{kind}.npy", total=state["tokens"][n]) for n in names for kind in "XD")
        if broken or bad or not whole:
            what = sorted(broken | set(bad)) or ["rows the checkpoint lists"]
            log.warning("%s: %s missing, truncated or changed since the last checkpoint; the per-token rows cannot be "
                        "repaired, so the collection starts again", checkpoint.folder, ", ".join(what[:3]))
            return None, {}
        return state, {}
    redo = {}
    for file in layout:
        if file in broken:
            rows.forget(file)
            miss = set(mine[:done])
        else:
            miss = bad.get(file, set()) | {i for i in mine[:done] if not rows.covers(file, [i])}
        if miss:
            redo[file] = miss
    if redo:
        batches = sorted(set().union(*redo.values()))
        log.warning("%s: the rows of %d batch(es) (%s) in %s are missing, truncated or changed since the last "
                    "checkpoint; running those batches again", checkpoint.folder, len(batches),
                    ", ".join(map(str, batches[:8])) + (", ..." if len(batches) > 8 else ""),
                    ", ".join(sorted(redo)[:3]) + (", ..." if len(redo) > 3 else ""))
    return state, redo
