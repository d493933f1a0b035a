"""Interrupted collections: the ``<key>.partial/`` folder, its checkpoints, its owner, and the signals.

A cached collection is written into ``<cache>/<key>.partial/``. At a batch boundary, at least
every ``checkpoint_seconds`` and when Ctrl-C or SIGTERM asks it to stop, the progress (the
batches done and the sums so far) is kept there (:class:`Checkpoint`); the same call later
resumes from it, and the folder becomes the entry ``<cache>/<key>/`` in one rename when the
last batch is done. A folder a live process is filling is refused (:func:`owned`).
"""
from __future__ import annotations

import contextlib
import logging
import os
import time
from pathlib import Path

import numpy as np
import torch

from ...core.conventions import FisherkronError
from ...env import atomic_write, remove_stale_temporaries

__all__ = ["PARTIAL_SUFFIX", "Checkpoint", "deferred_interrupts", "owned", "reclaim", "note_other_partials",
           "open_rows"]

log = logging.getLogger(__name__)

PARTIAL_SUFFIX = ".partial"


def reclaim(root: Path) -> None:
    """Remove the temporary folders that killed calibration runs left in ``root``, and say so."""
    if root.is_dir():
        count, freed = remove_stale_temporaries(root)
        if count:
            log.warning("removed %d temporary folder(s) left by interrupted calibration runs in %s "
                        "(%.1f MB reclaimed)", count, root, freed / 2**20)


class Checkpoint:
    """The progress of a cached collection in its ``<key>.partial/`` folder: batches done and the sums so far.

    Saved (atomically) at a batch boundary at least every ``every`` seconds and when a signal
    asked the collection to stop; read back by the next call with the same key.
    """

    FILE = "progress.pt"

    def __init__(self, folder: Path, key: str, every: float, signals: "_Signals"):
        self.folder, self.key, self.every, self.signals = folder, key, every, signals
        self.last = time.monotonic()

    def load(self):
        """``(done, acc, tokens)`` of an earlier interrupted run, or ``None``."""
        f = self.folder / self.FILE
        if not f.exists():
            return None
        try:
            got = torch.load(f, weights_only=True)
        except Exception as exc:  # noqa: BLE001 - an unreadable checkpoint means: start again
            log.warning("calibration progress %s is unreadable (%s); starting again", f, exc)
            return None
        if got.get("key") != self.key:
            return None
        return int(got["done"]), got["acc"], dict(got["tokens"])

    def due(self) -> bool:
        return self.signals.pending is not None or time.monotonic() - self.last >= self.every

    def save(self, done: int, acc, tokens) -> None:
        state = {"key": self.key, "done": done, "acc": acc, "tokens": tokens}
        atomic_write(self.folder / self.FILE, lambda t: torch.save(state, t))
        self.last = time.monotonic()


class _Signals:
    pending: int | None = None


@contextlib.contextmanager
def deferred_interrupts():
    """Ctrl-C and SIGTERM set ``pending`` instead of raising, so the batch under way can finish and
    the progress be kept; a second signal raises ``KeyboardInterrupt`` at once (main thread only)."""
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


@contextlib.contextmanager
def owned(partial: Path):
    """Create ``partial`` (or take over a dead process's); refuse one a live process is filling."""
    from ...env import _pid_alive

    partial.mkdir(parents=True, exist_ok=True)
    lock = partial / "owner.pid"
    if lock.exists():
        try:
            pid = int(lock.read_text().strip() or 0)
        except (OSError, ValueError):
            pid = 0
        if pid and pid != os.getpid() and _pid_alive(pid):
            raise FisherkronError(f"process {pid} is collecting this calibration into {partial}; wait for it "
                                  f"to finish (or stop it) and run again")
    lock.write_text(str(os.getpid()))
    try:
        yield
    finally:
        lock.unlink(missing_ok=True)


def note_other_partials(root: Path, mine: Path) -> None:
    """Say once that interrupted collections of other configurations hold disk space."""
    others = [p for p in root.glob(f"*{PARTIAL_SUFFIX}") if p != mine and p.is_dir()]
    if others:
        size = sum(f.stat().st_size for p in others for f in p.rglob("*") if f.is_file())
        log.info("%d interrupted calibration(s) of other configurations in %s hold %.2f GB; they resume if "
                 "run again with the same arguments, or delete them", len(others), root, size / 1e9)


def open_rows(path: Path, dtype, shape, resume: bool) -> np.memmap:
    """A ``.npy`` memory map to fill: the existing one when resuming (same dtype and shape), else a new one."""
    if resume and path.exists():
        try:
            mm = np.load(path, mmap_mode="r+")
            if mm.dtype == np.dtype(dtype) and mm.shape == tuple(shape):
                return mm
        except (OSError, ValueError, EOFError):
            pass
        raise FisherkronError(f"{path} does not match the interrupted collection it belongs to; delete "
                              f"{path.parent} and run again")
    return np.lib.format.open_memmap(path, mode="w+", dtype=dtype, shape=tuple(shape))
