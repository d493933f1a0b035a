r"""Data-parallel MFF on ``torch.distributed`` (paper Sec. 4.1, Eq. (12) and (23), across processes).

``R(F) = (1/k) sum_i G_i^T (x) G_i^T`` is a mean over the ``k`` calibration batches. With the
batches split over the ranks of a process group (rank ``p`` holds the ``k_p`` gradients of
its own batches, ``k = sum_p k_p``), a product is a local sum and one ``all_reduce``:

.. math:: R(F)\,\mathrm{vec}(Z) = \mathrm{vec}\Big(\tfrac1k \sum_p \underbrace{\textstyle\sum_{i \in p}
          G_i^\top Z G_i}_{\text{rank } p}\Big),

so each product moves one ``m x m`` (or, for ``R(F)^T``, one ``n x n``) float64 matrix, plus
one float64 that counts ranks whose local part failed: ``8 (m^2 + 1)`` or ``8 (n^2 + 1)``
bytes per product. The Lanczos vectors are replicated on every rank, and every decision
that changes the number of collectives (stop or go) is taken on rank 0 and broadcast,
so all ranks run the same collectives in the same order.

The rule for failures: no rank ever skips a collective. A rank whose local work fails
takes part in the next collective with a "failed" flag (:func:`all_reduce_sum`) or an
error message (:func:`all_or_none`), and then every rank raises, so none is left waiting.
A rank that dies outright (killed, segfault) is noticed when its connection closes, at the
latest after the process group's timeout (``init_process_group(timeout=)``).

Only ``torch.distributed``: NCCL on GPUs, gloo on CPUs, started by ``torchrun``.
"""
from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

from .conventions import FisherkronError

__all__ = ["resolve_group", "rank_of", "world_of", "all_reduce_sum", "all_reduce_", "broadcast_int", "broadcast_tensor",
           "broadcast_object", "all_or_none", "agree", "fisher_norm_sq", "product_comm_bytes"]

#: float64 entries added to every product's all_reduce: the count of ranks whose local part failed.
FLAG_ENTRIES = 1


def resolve_group(group):
    """The process group to use, or ``None`` for the single-process code path.

    ``None`` stays ``None``. ``"auto"`` is the default group when ``torch.distributed`` is
    initialised with more than one process, else ``None``. A process group of one process
    is ``None`` too (its result is the single-process one). Anything else is a group.
    """
    if group is None:
        return None
    if isinstance(group, str):
        if group != "auto":
            raise FisherkronError(f"group={group!r}: pass a torch.distributed process group, 'auto' or None")
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return None
        return dist.group.WORLD
    if not (dist.is_available() and dist.is_initialized()):
        raise FisherkronError("a process group was given but torch.distributed is not initialised; call "
                              "torch.distributed.init_process_group first (torchrun does it for you) or pass group=None")
    return None if dist.get_world_size(group) == 1 else group


def rank_of(group) -> int:
    """This process's rank within ``group`` (0 without a group)."""
    return 0 if group is None else dist.get_rank(group)


def world_of(group) -> int:
    """The number of processes in ``group`` (1 without a group)."""
    return 1 if group is None else dist.get_world_size(group)


def _global(group, rank: int) -> int:
    """Global rank of the group's rank ``rank``."""
    return rank if group is None or group is dist.group.WORLD else dist.get_global_rank(group, rank)


def _src(group) -> int:
    """Global rank of the group's rank 0 (the source of every broadcast)."""
    return _global(group, 0)


def _comm_device(group) -> torch.device:
    """Where the collectives of ``group`` take their tensors: the current GPU for NCCL, else the CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def product_comm_bytes(size: int) -> int:
    """Bytes one product all-reduces for a ``size x size`` result: ``8 (size^2 + 1)`` (float64 + the flag)."""
    return 8 * (size * size + FLAG_ENTRIES)


def all_reduce_sum(buf: torch.Tensor, group, *, failed: bool = False) -> tuple[torch.Tensor, int]:
    """``sum_p buf_p`` over the ranks and the number of ranks that failed, in one ``all_reduce``.

    ``buf`` is a flat float64 tensor whose last entry is left for the failure flag (so the
    flag costs no extra collective); it is written with ``failed`` and summed with the rest.
    Returns ``(buf, failures)`` with ``buf`` on its original device.
    """
    buf[-1] = float(failed)
    dev = _comm_device(group)
    work = buf if buf.device == dev else buf.to(dev)
    dist.all_reduce(work, op=dist.ReduceOp.SUM, group=group)
    if work is not buf:
        buf.copy_(work)
    return buf, round(float(buf[-1]))


def all_reduce_(x: torch.Tensor, group) -> torch.Tensor:
    """``x <- sum_p x_p`` in place (a statistic summed over the ranks' batches)."""
    dev = _comm_device(group)
    work = x if x.device == dev and x.is_contiguous() else x.to(dev).contiguous()
    dist.all_reduce(work, op=dist.ReduceOp.SUM, group=group)
    if work is not x:
        x.copy_(work)
    return x


def broadcast_int(value: int, group) -> int:
    """Rank 0's ``value`` on every rank (a decision that changes the number of collectives)."""
    t = torch.tensor([int(value)], dtype=torch.int64, device=_comm_device(group))
    dist.broadcast(t, src=_src(group), group=group)
    return int(t.item())


def broadcast_tensor(x: torch.Tensor, group) -> torch.Tensor:
    """Rank 0's ``x`` on every rank (same shape and dtype everywhere), on ``x``'s device."""
    dev = _comm_device(group)
    work = x.contiguous() if x.device == dev else x.to(dev).contiguous()
    if work.data_ptr() == x.data_ptr():
        work = work.clone()
    dist.broadcast(work, src=_src(group), group=group)
    return work.to(x.device)


def broadcast_object(obj, group):
    """Rank 0's picklable ``obj`` on every rank."""
    box = [obj]
    dist.broadcast_object_list(box, src=_src(group), group=group)
    return box[0]


def _line(exc: BaseException) -> str:
    text = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return text if isinstance(exc, FisherkronError) else f"{type(exc).__name__}: {text}"


def agree(group, error: BaseException | None, what: str) -> None:
    """Every rank learns whether any rank failed ``what``, and then every rank raises (one ``all_gather``).

    The failing rank raises its own exception; the others raise a one-line
    :class:`FisherkronError` naming the first failing rank and its message.
    """
    msgs = [None] * world_of(group)
    dist.all_gather_object(msgs, None if error is None else _line(error), group=group)
    failed = [(r, m) for r, m in enumerate(msgs) if m is not None]
    if not failed:
        return
    if error is not None:
        raise error
    r, msg = failed[0]
    raise FisherkronError(f"{what} failed on rank {r} of {len(msgs)}: {msg} (every rank stopped)")


@contextmanager
def all_or_none(group, what: str) -> Iterator[None]:
    """Run the block on every rank; if it raises (an ``Exception``) on any rank, every rank raises.

    The block must contain no collective: it is the local work between two collectives.
    ``KeyboardInterrupt`` and ``SystemExit`` are not held back (``torchrun`` stops the others).
    """
    error = None
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - shared with the other ranks, then re-raised
        error = exc
    agree(group, error, what)


def fisher_norm_sq(stack, group, k: int) -> float:
    r"""``||F||_F^2 = (1/k^2) sum_{i,j} <G_i, G_j>^2`` over the gradients of all ranks.

    The cross-rank inner products need the other ranks' gradients: every rank broadcasts its
    gradients in turn, chunk by chunk, and each rank adds the squares of the inner products
    of its own gradients with the chunk; one scalar ``all_reduce`` ends it. It moves every
    gradient once (``k n m`` entries in all) and reads the local gradients once per received
    chunk: pass ``compute_norm=False`` to :func:`fisherkron.mff` to skip it.
    """
    world, me = world_of(group), rank_of(group)
    n, m = stack.n, stack.m
    dev = _comm_device(group)
    counts = torch.tensor([stack.k, stack.chunk_size], dtype=torch.int64, device=dev)
    everyone = [torch.zeros_like(counts) for _ in range(world)]
    dist.all_gather(everyone, counts, group=group)  # every rank's (k_p, chunk size)
    total, error = 0.0, None
    for src in range(world):
        k_src, c_src = (int(v) for v in everyone[src])
        own = iter(stack.chunks(reuse=False)) if src == me else None
        for start in range(0, k_src, c_src):
            H = torch.zeros(n, min(c_src, k_src - start), m, dtype=stack.dtype, device=dev)  # (n, kc, m)
            if own is not None and error is None:
                try:
                    H.copy_(next(own))
                except Exception as exc:  # noqa: BLE001 - still take part in the broadcast
                    error = exc
            dist.broadcast(H, src=_global(group, src), group=group)
            if error is not None:
                continue
            try:
                Hf = H.to(stack.device).permute(1, 0, 2).reshape(H.shape[1], n * m)  # (kc, n m)
                for Gc in stack.chunks():  # (n, kc_local, m)
                    Gf = Gc.permute(1, 0, 2).reshape(Gc.shape[1], n * m)  # (kc_local, n m)
                    total += float(((Gf @ Hf.T).double() ** 2).sum())
            except Exception as exc:  # noqa: BLE001
                error = exc
    buf = torch.tensor([total, 0.0], dtype=torch.float64)
    buf, failures = all_reduce_sum(buf, group, failed=error is not None)
    if failures:
        if error is not None:
            raise error
        raise FisherkronError(f"{stack.name}: ||F|| stopped because {failures} other rank(s) failed (see their error)")
    return float(buf[0]) / (k * k) if k else math.nan
