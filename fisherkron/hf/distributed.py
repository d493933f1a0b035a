"""Compressing a model on ``torch.distributed``: the process group ``torchrun`` sets up, and MFF of all layers.

``torchrun --nproc_per_node=N -m fisherkron compress ...`` runs the same command in N
processes. Each one joins the process group named by torchrun's environment
(:func:`join_torchrun`: NCCL with one GPU per process, gloo on CPUs); the calibration batches are
split over the ranks (:func:`fisherkron.collect_calibration` with ``group=``); then MFF
(Algorithm 1) runs for every layer (:func:`precompute_kronecker`), either

* ``parallel="batches"``: data-parallel, every rank takes part in every layer with the
  gradients of its own batches (one ``m x m`` or ``n x n`` ``all_reduce`` per product; see
  :mod:`fisherkron.core.distributed`), or
* ``parallel="layers"``: layer ``i`` (in model order) on rank ``i % world``, with all ``k``
  gradients of that layer read from the shared calibration folder (no communication);

and its factors are written to the calibration folder's ``mff/`` cache, where
:meth:`CalibrationStats.kronecker` finds them. Rank 0 then compresses, saves and prints
exactly as one process does.
"""
from __future__ import annotations

import datetime
import logging
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from ..core.conventions import FisherkronError
from ..core.distributed import all_or_none, rank_of, resolve_group, world_of
from .calibration import CalibrationStats

__all__ = ["PARALLEL", "Launch", "torchrun_world", "join_torchrun", "precompute_kronecker"]

log = logging.getLogger(__name__)

#: how MFF of the layers is spread over the ranks
PARALLEL = ("batches", "layers")
#: seconds a collective waits for the slowest rank before the run stops with an error
DEFAULT_TIMEOUT = 1800


def torchrun_world() -> tuple[int, int]:
    """``(rank, world size)`` from torchrun's ``RANK`` and ``WORLD_SIZE`` (``(0, 1)`` when not launched by it)."""
    try:
        return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        raise FisherkronError(f"RANK={os.environ.get('RANK')!r} and WORLD_SIZE={os.environ.get('WORLD_SIZE')!r} "
                              f"are not integers; launch with torchrun --nproc_per_node=N") from None


@dataclass
class Launch:
    """This process's place in a torchrun launch.

    Attributes:
        rank, world: its rank and the number of processes.
        device: the device it computes on (``cuda:LOCAL_RANK`` for ``--device cuda``).
        group: the process group once :meth:`join` was called (``None`` before).
        owned: whether :meth:`join` initialised ``torch.distributed`` (then :meth:`close` ends it).
    """

    rank: int
    world: int
    device: str | None
    group: object = None
    owned: bool = False

    def join(self, timeout: float = DEFAULT_TIMEOUT) -> None:
        """Join the process group of ``torchrun`` (``env://``): NCCL on CUDA, gloo otherwise."""
        if dist.is_initialized():
            self.group = dist.group.WORLD
            return
        backend = "nccl" if self.device and self.device.startswith("cuda") else "gloo"
        try:
            dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout))
        except (ValueError, RuntimeError) as exc:
            line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise FisherkronError(f"rank {self.rank} could not join the {backend} process group ({line}); "
                                  f"launch with torchrun --nproc_per_node=N -m fisherkron compress ...") from None
        self.group, self.owned = dist.group.WORLD, True

    def close(self) -> None:
        """Leave the process group if :meth:`join` started it."""
        if self.owned and dist.is_initialized():
            dist.destroy_process_group()
        self.owned = False


def join_torchrun(device: str | None) -> Launch | None:
    """This process's :class:`Launch` under torchrun (``WORLD_SIZE > 1``), else ``None``.

    ``device="cuda"`` becomes ``cuda:LOCAL_RANK`` (one GPU per process); a fixed
    ``cuda:N`` is refused, since every rank would share that GPU. The process group itself
    is joined by :meth:`Launch.join`, once the cheap checks have passed.
    """
    rank, world = torchrun_world()
    if world <= 1:
        return None
    if device is not None and device.startswith("cuda"):
        if ":" in device:
            raise FisherkronError(f"--device {device} under torchrun would put every rank on one GPU; pass "
                                  f"--device cuda (rank r uses cuda:LOCAL_RANK)")
        local = int(os.environ.get("LOCAL_RANK", "0"))
        if local >= torch.cuda.device_count():
            raise FisherkronError(f"LOCAL_RANK={local} but this node has {torch.cuda.device_count()} CUDA device(s); "
                                  f"start at most that many processes per node (--nproc_per_node)")
        torch.cuda.set_device(local)
        device = f"cuda:{local}"
    return Launch(rank, world, device)


def precompute_kronecker(stats: CalibrationStats, names: list[str] | None = None, *, group="auto",
                         parallel: str = "batches", init: str = "kfac", device=None, progress: bool = False,
                         **mff_options) -> dict[str, dict]:
    """Algorithm 1 (MFF) for every layer of ``stats``, spread over the ranks, into ``stats.dir/mff/``.

    Every rank calls this with the same arguments. ``parallel="batches"``: every layer on
    all ranks, each with the gradients of its batches (``i % world == rank``), products
    summed by one ``all_reduce`` of an ``m x m`` or ``n x n`` float64 matrix.
    ``parallel="layers"``: layer ``i`` of ``names`` on rank ``i % world`` alone, with all its
    ``k`` gradients (the calibration folder must be visible to every rank, as it is for
    :func:`fisherkron.collect_calibration` with ``group=``). Either way the factors are written
    under the key :meth:`CalibrationStats.kronecker` uses for ``init`` and ``mff_options``,
    so a later ``compress(model, "gfwsvd", stats, mff_options=mff_options)`` on rank 0 reads
    them instead of recomputing. A failure on any rank stops every rank with its message.

    Returns:
        ``{layer: {"rank", "matvecs", "converged", "seconds"}}`` for the layers this rank worked on.
    """
    if parallel not in PARALLEL:
        raise FisherkronError(f"parallel={parallel!r}: choose one of {', '.join(PARALLEL)}")
    group = resolve_group(group)
    rank, world = rank_of(group), world_of(group)
    names = list(stats.layers) if names is None else list(names)
    done: dict[str, dict] = {}

    def one(name: str, **kw) -> None:
        t0 = time.perf_counter()
        res = stats.kronecker(name, init=init, device=device, **kw, **mff_options)
        done[name] = {"rank": rank, "matvecs": res["matvecs"], "converged": res["converged"],
                      "seconds": time.perf_counter() - t0}

    if parallel == "layers" or group is None:
        mine = [n for i, n in enumerate(names) if i % world == rank]
        if group is None:
            for name in tqdm(mine, desc="MFF", disable=not progress):
                one(name)
            return done
        with all_or_none(group, "MFF of the layers"):  # no collective inside: every rank works alone
            for name in tqdm(mine, desc=f"MFF (rank {rank}: {len(mine)} of {len(names)} layers)",
                             disable=not progress):
                one(name)
    else:
        for name in tqdm(names, desc=f"MFF ({world} ranks)", disable=not progress):
            one(name, group=group)
    return done
