"""Calibration over a ``torch.distributed`` process group (torchrun): batch ``i`` on rank ``i % world``.

Each rank writes the gradient rows of its own batches into the shared ``(k, n, m)`` files
(:class:`RowWriter`); the sums behind the other statistics are all-reduced
(:func:`reduce_statistics`); rank 0 writes them and the manifest. The entry is the one a
single process writes and is reused by any world size.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
import weakref
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from ...core.conventions import FisherkronError
from ...core.distributed import all_or_none, all_reduce_, broadcast_object, rank_of, world_of
from ...env import atomic_directory, sigterm_as_interrupt, temporary_name
from .accumulate import accumulate, save_statistics
from .entry import CalibrationStats, read_manifest, write_manifest
from .resume import reclaim

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

    def write(self, i: int, G: torch.Tensor) -> None:
        data = memoryview(np.ascontiguousarray(G.detach().float().cpu().numpy())).cast("B")  # (n, m) float32
        done = 0
        while done < len(data):
            done += os.pwrite(self.fd, data[done:], self.offset + i * self.row_bytes + done)

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
                     cache, verify_cache, group) -> CalibrationStats:
    """:func:`collect_calibration` over a process group: batch ``i`` on rank ``i % world``.

    Rank 0 reads the cache, creates the (temporary) folder and the ``(k, n, m)`` gradient
    files; every rank writes the rows of its batches; the sums behind the other statistics
    are all-reduced and rank 0 writes them, the manifest (with the world size) and moves
    the folder into the cache in one rename. Each step ends in a collective that tells every
    rank whether any rank failed, so a failure anywhere stops all ranks with the same
    error, and rank 0 removes the temporary folder: no half-written entry is left.
    """
    rank, world = rank_of(group), world_of(group)
    k = len(batches)
    keys = [None] * world
    dist.all_gather_object(keys, key, group=group)
    other = next((r for r, kk in enumerate(keys) if kk != keys[0]), None)
    if other is not None:
        raise FisherkronError(f"rank {other} has another calibration configuration than rank 0 (model weights, "
                              f"batches, layers, k, seed, statistics or loss); give every rank the same")
    man = None
    with sigterm_as_interrupt():
        with all_or_none(group, "reading the calibration cache"):
            if rank == 0:
                reclaim(root)
                if cache:
                    man = read_manifest(final, key, verify_cache)
                    if man is None and final.exists():
                        shutil.rmtree(final)
                root.mkdir(parents=True, exist_ok=True)
        man = broadcast_object(man, group)
        if man is not None:
            with all_or_none(group, "opening the cached calibration"):
                _visible(final / "manifest.json", rank)
            return CalibrationStats(final, man["layers"], man["k"], key, man["config"],
                                    tuple(man["config"]["stats"]), from_cache=True)
        entry = contextlib.ExitStack()  # rank 0: the atomic folder of the cache entry
        tmp = None
        try:
            with all_or_none(group, "creating the calibration folder"):
                if rank == 0:
                    if cache:
                        tmp = entry.enter_context(atomic_directory(final))
                    else:
                        tmp = Path(tempfile.mkdtemp(prefix=temporary_name(f"private-{key[:8]}"), dir=root))
                    if "grads" in stats:
                        for n in names:  # every rank fills its rows of these
                            np.lib.format.open_memmap(tmp / f"{n}.grads.npy", mode="w+", dtype=np.float32,
                                                      shape=(k, *shapes[n])).flush()  # (k, n, m)
            tmp = broadcast_object(tmp, group)
            with all_or_none(group, "calibration"):
                _visible(tmp, rank)
                writers = {n: RowWriter(tmp / f"{n}.grads.npy") for n in names} if "grads" in stats else {}
                try:
                    acc, tokens = accumulate(model, batches, range(rank, k, world), names, modules, stats, loss_fn,
                                              lambda n, i, G: writers[n].write(i, G), progress and rank == 0)
                finally:
                    for w in writers.values():
                        w.close()
            acc, tokens = reduce_statistics(acc, tokens, names, shapes, stats, group)
            info = None
            with all_or_none(group, "writing the calibration statistics"):
                if rank == 0:
                    save_statistics(acc, tokens, k, names, stats, tmp)
                    info = write_manifest(tmp, key, config, k, names, shapes, modules, tokens, world_size=world)
                    entry.close()  # the temporary folder becomes the cache entry (one rename)
            info = broadcast_object(info, group)
        except BaseException:
            if rank == 0:
                with contextlib.suppress(BaseException):
                    entry.__exit__(*sys.exc_info())  # removes the temporary folder
                if not cache and tmp is not None:
                    shutil.rmtree(tmp, ignore_errors=True)
            raise
    folder = final if cache else tmp
    out = CalibrationStats(folder, info, k, key, config, stats, from_cache=False)
    if not cache and rank == 0:  # the private folder belongs to rank 0's object
        weakref.finalize(out, shutil.rmtree, str(folder), True)
    return out
