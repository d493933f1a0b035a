"""Input validation shared by the core: every failure is a one-line FisherkronError."""
from __future__ import annotations

import math

import torch

from .conventions import FisherkronError


def as_tensor(x, name: str, dtype=None, device=None) -> torch.Tensor:
    """Convert array-likes to a tensor, refusing non-numeric input."""
    try:
        t = torch.as_tensor(x, device=device)
    except Exception as exc:  # noqa: BLE001 - re-raised as one line
        raise FisherkronError(f"{name}: cannot convert {type(x).__name__} to a tensor ({exc})") from None
    if dtype is not None:
        t = t.to(dtype)
    return t


def check_finite(t: torch.Tensor, name: str) -> None:
    if not torch.isfinite(t).all():
        bad = int((~torch.isfinite(t)).sum())
        raise FisherkronError(f"{name} has {bad} NaN/inf entries; check the model and data that produced it")


def check_matrix(t: torch.Tensor, name: str, shape: tuple[int | None, int | None] | None = None) -> None:
    if t.ndim != 2:
        raise FisherkronError(f"{name} must be a 2-D matrix, got shape {tuple(t.shape)}")
    if shape is not None:
        for got, want, what in zip(t.shape, shape, ("rows", "columns")):
            if want is not None and got != want:
                raise FisherkronError(f"{name} has {got} {what}, expected {want} (shape {tuple(t.shape)})")


def check_square(t: torch.Tensor, name: str, size: int | None = None) -> None:
    check_matrix(t, name)
    if t.shape[0] != t.shape[1]:
        raise FisherkronError(f"{name} must be square, got shape {tuple(t.shape)}")
    if size is not None and t.shape[0] != size:
        raise FisherkronError(f"{name} must be {size} x {size}, got {tuple(t.shape)}")


def check_int(value, name: str, *, minimum: int | None = None) -> int:
    """``value`` as an ``int`` (not a bool), at least ``minimum``; one-line error otherwise."""
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise FisherkronError(f"{name} must be an integer, got {value!r}")
    value = int(value)
    if minimum is not None and value < minimum:
        raise FisherkronError(f"{name} must be >= {minimum}, got {value}")
    return value


def check_positive(value, name: str, *, below: float | None = None, zero_ok: bool = False) -> float:
    """``value`` as a finite float > 0 (``>= 0`` with ``zero_ok``) and ``< below``; one-line error otherwise.

    A string or a bool is refused even when ``float()`` would read it: the callers compare and
    compute with the value they were given, so ``"1.5"`` would pass here and fail later.
    """
    if isinstance(value, (str, bytes, bool)):
        try:
            hint = f"; pass {name}={float(value)!r}" if not isinstance(value, bool) else ""
        except ValueError:
            hint = ""
        kind = "a bool" if isinstance(value, bool) else "a string"
        raise FisherkronError(f"{name} must be a number, got {kind} {value!r}{hint}")
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise FisherkronError(f"{name} must be a number, got {value!r}") from None
    if not math.isfinite(x) or x < 0 or (x == 0 and not zero_ok) or (below is not None and x >= below):
        span = f"{'[0' if zero_ok else '(0'}, {below if below is not None else 'inf'})"
        raise FisherkronError(f"{name} must be a finite number in {span}, got {value!r}")
    return x


def check_rank(rank: int, n: int, m: int, name: str = "weight") -> int:
    if isinstance(rank, bool) or not isinstance(rank, (int,)) and not (hasattr(rank, "__index__")):
        raise FisherkronError(f"rank must be an integer, got {rank!r}")
    rank = int(rank)
    if rank < 1 or rank > min(n, m):
        raise FisherkronError(f"rank {rank} is outside 1..min(n, m)={min(n, m)} for {name} of shape ({n}, {m})")
    return rank
