"""Calibration over a ``torch.distributed`` process group (torchrun): batch ``i`` on rank ``i % world``.

Each rank writes the gradient rows of its own batches into the shared ``(k, n, m)`` files
(:class:`RowWriter`); the sums behind the other statistics are all-reduced
(:func:`reduce_statistics`); rank 0 writes them and the manifest. The entry is the one a
single process writes and is reused by any world size.

A cached collection is written into the same ``<key>.partial/`` a single process uses, and each
rank keeps its own checkpoint there (its batches done, its own sums, the checksums of its rows:
:mod:`.resume`); Ctrl-C or SIGTERM (what torchrun sends every rank) finishes each rank's batch
and keeps it, and the same command with the same number of processes resumes every rank from
its own checkpoint.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import weakref
import zlib
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from ...core.conventions import FisherkronError
from ...core.distributed import all_or_none, all_reduce_, broadcast_object, rank_of, world_of
from ...env import sigterm_as_interrupt, temporary_name
from .accumulate import accumulate, save_statistics
from .entry import CalibrationStats, read_manifest, write_manifest
from .folders import (OWNER, PARTIAL_SUFFIX, NoSpace, owned, preallocate, read_only, reclaim, release_entry, seal,
                      writable_root)
from .resume import (Checkpoint, Rows, deferred_interrupts, drop_foreign_progress, open_rows, plan_resume,
                     progress_file)

__all__ = ["collect_on_ranks"]


class RowWriter:
    """Writes gradient ``i`` into row ``i`` of an existing ``(k, n, m)`` float32 ``.npy`` file.

    Each rank writes only the bytes of its own rows (``os.pwrite``), so ranks never touch
    each other's data, also on a shared filesystem where pages are not coherent.
    """

    def __init__(self, path: Path):
        with open(path, "rb") as fh:
            version = np.lib.format.read_magic(fh)
            read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
            shape, _, dtype = read(fh)
            self.offset = fh.tell()
        self.row_bytes = int(np.prod(shape[1:])) * np.dtype(dtype).itemsize
        self.fd = os.open(path, os.O_WRONLY)

    def write(self, i: int, G: torch.Tensor) -> int:
        """Write row ``i``; returns the CRC-32 of its bytes (for :class:`~.resume.Rows`)."""
        data = memoryview(np.ascontiguousarray(G.detach().float().cpu().numpy())).cast("B")  # (n, m) float32
        done = 0
        while done < len(data):
            done += os.pwrite(self.fd, data[done:], self.offset + i * self.row_bytes + done)
        return zlib.crc32(data)

    def close(self) -> None:
        os.close(self.fd)


def _visible(path: Path, rank: int) -> None:
    if not path.exists():
        raise FisherkronError(f"rank {rank} does not see {path}; put the calibration cache (--cache-dir) on a "
                              f"filesystem every rank sees")


def reduce_statistics(acc, tokens, names, shapes, stats, group):
    """Sum the per-rank sums of :func:`~.accumulate.accumulate` over the ranks (``all_reduce``; zeros where a
    rank ran none)."""
    for n in names:
        a, (rows, cols) = acc[n], shapes[n]
        counts = torch.tensor([tokens[n], "ddt" in a], dtype=torch.float64)  # exact below 2^53
        all_reduce_(counts, group)
        tokens[n] = int(counts[0])
        if "diag_fisher" in stats:
            a["g2"] = all_reduce_(a.get("g2", torch.zeros(rows, cols)), group)  # (n, m) float32
        if "abs_mean" in stats:
            a["abs_sum"] = all_reduce_(a.get("abs_sum", torch.zeros(cols, dtype=torch.float64)), group)  # (m,)
        if "xxt" in stats or "kfac" in stats:
            a["xxt"] = all_reduce_(a.get("xxt", torch.zeros(cols, cols, dtype=torch.float64)), group)  # (m, m)
        if "kfac" in stats:
            a["ddt"] = all_reduce_(a.get("ddt", torch.zeros(rows, rows, dtype=torch.float64)), group)  # (n, n)
            if counts[1] == 0:  # no rank saw an output gradient
                del a["ddt"]
    return acc, tokens


def collect_on_ranks(model, batches, names, modules, shapes, stats, loss_fn, progress, *, key, config, root, final,
                     cache, verify_cache, group, checkpoint_seconds: float = 300.0) -> CalibrationStats:
    """:func:`collect_calibration` over a process group: batch ``i`` on rank ``i % world``.

    Rank 0 reads the cache, takes the ``<key>.partial/`` folder (or, with ``cache=False``, makes
    a private one) and creates (or, resuming, checks) the ``(k, n, m)`` gradient files; every
    rank resumes from its own checkpoint (repairing its damaged rows), writes the rows of its
    batches and keeps its progress; the sums behind the other statistics are all-reduced and
    rank 0 writes them, the manifest (with the world size) and moves the folder into the cache
    in one rename. Each step ends in a collective that tells every rank whether any rank
    failed, so a failure anywhere stops all ranks with the same error, and rank 0 removes the
    folder: no half-written entry is left. A signal (Ctrl-C, SIGTERM) instead keeps every
    rank's progress for the next run with the same world size.
    """
    rank, world = rank_of(group), world_of(group)
    k = len(batches)
    keys = [None] * world
    dist.all_gather_object(keys, key, group=group)
    other = next((r for r, kk in enumerate(keys) if kk != keys[0]), None)
    if other is not None:
        raise FisherkronError(f"rank {other} has another calibration configuration than rank 0 (model weights, "
                              f"batches, layers, k, seed, statistics or loss); give every rank the same")
    partial = root / f"{final.name}{PARTIAL_SUFFIX}"
    man = None
    with sigterm_as_interrupt():
        with all_or_none(group, "reading the calibration cache"):
            if rank == 0:
                reclaim(root, partial)
                if cache:
                    man = read_manifest(final, key, verify_cache)
                    if man is None and final.exists():
                        try:
                            shutil.rmtree(final)
                        except OSError as exc:
                            raise read_only(root, cache, exc.strerror or type(exc).__name__) from None
                    if man is not None and (final / OWNER).exists():
                        release_entry(final)
                if man is None:
                    writable_root(root, cache)
        man = broadcast_object(man, group)
        if man is not None:
            with all_or_none(group, "opening the cached calibration"):
                _visible(final / "manifest.json", rank)
            return CalibrationStats(final, man["layers"], man["k"], key, man["config"],
                                    tuple(man["config"]["stats"]), from_cache=True)
    layout = {f"{n}.grads.npy": (np.float32, (k, *shapes[n])) for n in names} if "grads" in stats else {}
    hold = contextlib.ExitStack()  # rank 0: the ownership of the partial folder
    tmp, signals, owns = None, None, False
    try:
        # cached: a signal finishes each rank's batch and keeps its progress; uncached: it stops at once
        with deferred_interrupts() if cache else sigterm_as_interrupt() as signals:
            with all_or_none(group, "creating the calibration folder"):
                if rank == 0:
                    if cache:
                        try:
                            hold.enter_context(owned(partial, key))
                        except OSError as exc:
                            raise read_only(root, cache, exc.strerror or type(exc).__name__) from None
                        tmp, owns = partial, True
                        drop_foreign_progress(tmp, world)
                    else:
                        tmp = Path(tempfile.mkdtemp(prefix=temporary_name(f"private-{key[:8]}"), dir=root))
                    resuming = any((tmp / progress_file(r, world)).exists() for r in range(world))
                    fresh = set()
                    for file, (dtype, shape) in layout.items():  # every rank fills its rows of these
                        mm, created = open_rows(tmp / file, dtype, shape, keep=resuming)
                        mm.flush()
                        del mm
                        if created:
                            fresh.add(tmp / file)
                    try:
                        preallocate(tmp, [tmp / f for f in layout], fresh)
                    except NoSpace as exc:  # resuming: the progress of every rank is kept
                        raise NoSpace(str(exc), keep=resuming) from None
            tmp = broadcast_object(tmp, group)
            with all_or_none(group, "calibration"):
                _visible(tmp, rank)
                acc, tokens = _run_share(model, batches, names, modules, stats, loss_fn, progress, rank, world, tmp,
                                         layout, Checkpoint(tmp, key, checkpoint_seconds, signals,
                                                            progress_file(rank, world)) if cache else None)
            acc, tokens = reduce_statistics(acc, tokens, names, shapes, stats, group)
            info = None
            with all_or_none(group, "writing the calibration statistics"):
                if rank == 0:
                    save_statistics(acc, tokens, k, names, stats, tmp)
                    info = write_manifest(tmp, key, config, k, names, shapes, tokens, world_size=world)
                    if cache:
                        seal(tmp, final)  # the partial folder becomes the cache entry (one rename)
                    hold.close()
            info = broadcast_object(info, group)
    except BaseException as exc:
        if rank == 0:
            keep = isinstance(exc, KeyboardInterrupt) or getattr(signals, "pending", None) is not None \
                or getattr(exc, "keep", False)
            if tmp is not None and (not cache or (owns and not keep)):
                # a failure: nothing of it is kept (a signal keeps every rank's progress in the partial folder)
                shutil.rmtree(tmp, ignore_errors=True)
            hold.close()
        raise
    folder = final if cache else tmp
    out = CalibrationStats(folder, info, k, key, config, stats, from_cache=False)
    if not cache and rank == 0:  # the private folder belongs to rank 0's object
        weakref.finalize(out, shutil.rmtree, str(folder), True)
    return out


def _run_share(model, batches, names, modules, stats, loss_fn, progress, rank: int, world: int, folder: Path,
               layout: dict, checkpoint: Checkpoint | None):
    """This rank's batches ``rank, rank + world, ...``: resumed from its checkpoint, its damaged rows run again,
    its progress kept (always after its last batch, so a signal to another rank loses none of it)."""
    k = len(batches)
    mine = list(range(rank, k, world))
    state, redo = plan_resume(checkpoint, layout, mine, False, names)
    done = state["done"] if state is not None else 0
    rows = state["rows"] if state is not None else Rows()
    writers = {n: RowWriter(folder / f"{n}.grads.npy") for n in names} if layout else {}

    def store(n, i, G, only=None):
        file = f"{n}.grads.npy"
        if only is None or i in only.get(file, ()):
            rows.log.setdefault(file, {})[i] = [i + 1, writers[n].write(i, G)]

    def after_batch(i, acc, tokens):
        if checkpoint is None or not (i == mine[-1] or checkpoint.due()):
            return
        ran = (i - rank) // world + 1  # of this rank's batches
        checkpoint.save(ran, acc, tokens, rows)
        if checkpoint.signals.pending is not None:
            raise KeyboardInterrupt(f"calibration stopped on rank {rank} after {ran} of its {len(mine)} batches; "
                                    f"its progress is kept in {folder}: run the same command (with {world} "
                                    f"processes) again to resume")

    try:
        if redo:
            accumulate(model, batches, sorted(set().union(*redo.values())), names, modules, ("grads",), loss_fn,
                       lambda n, i, G: store(n, i, G, only=redo), False)
        acc, tokens = accumulate(model, batches, mine[done:], names, modules, stats, loss_fn, store,
                                  progress and rank == 0, acc=state["acc"] if state is not None else None,
                                  tokens=state["tokens"] if state is not None else None, after_batch=after_batch,
                                  total=len(mine))
    finally:
        for w in writers.values():
            w.close()
    for file in layout:
        rows.require(folder, file, starts=mine)
    return acc, tokens
