r"""A low-rank linear layer ``y = W_2 (W_1 x) + b`` and rank/ratio bookkeeping (paper App. F).

A dense ``n x m`` layer has ``n m`` weights; its rank-``r`` factorisation has
``r (n + m)``. Compression ratio, as in the paper: ``1 - compressed/original``.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from .checks import as_tensor, check_finite, check_matrix
from .conventions import FisherkronError

__all__ = ["LowRankLinear", "lowrank_params", "rank_for_ratio", "compression_ratio"]


class LowRankLinear(nn.Module):
    """``x -> second(first(x))``: ``first`` = ``W_1`` (``r x m``, no bias), ``second`` = ``W_2`` (``n x r``) + bias.

    Example:
        >>> from fisherkron import svd
        >>> lin = nn.Linear(5, 7)
        >>> low = LowRankLinear.from_factors(*svd(lin.weight.detach(), 5), lin.bias)  # full rank: exact
        >>> x = torch.randn(3, 5)
        >>> bool(torch.allclose(low(x), lin(x), atol=1e-5))
        True
    """

    def __init__(self, in_features: int, out_features: int, rank: int, bias: bool = True,
                 device=None, dtype=None):
        super().__init__()
        if not 1 <= rank <= min(in_features, out_features):
            raise FisherkronError(f"rank {rank} is outside 1..min(n, m)={min(in_features, out_features)}")
        self.in_features, self.out_features, self.rank = in_features, out_features, rank
        self.first = nn.Linear(in_features, rank, bias=False, device=device, dtype=dtype)  # W1: (r, m)
        self.second = nn.Linear(rank, out_features, bias=bias, device=device, dtype=dtype)  # W2: (n, r)

    @classmethod
    def from_factors(cls, W2, W1, bias=None) -> "LowRankLinear":
        """Build from ``W2`` (``n x r``) and ``W1`` (``r x m``) and an optional bias (``n``)."""
        W2, W1 = as_tensor(W2, "W2"), as_tensor(W1, "W1")
        check_matrix(W2, "W2")
        check_matrix(W1, "W1", (W2.shape[1], None))
        check_finite(W2, "W2")
        check_finite(W1, "W1")
        n, r = W2.shape
        m = W1.shape[1]
        mod = cls(m, n, r, bias=bias is not None, device=W2.device, dtype=W2.dtype)
        with torch.no_grad():
            mod.first.weight.copy_(W1)
            mod.second.weight.copy_(W2)
            if bias is not None:
                mod.second.bias.copy_(as_tensor(bias, "bias").to(W2.dtype))
        return mod

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., m) -> (..., n)
        return self.second(self.first(x))

    @property
    def weight(self) -> torch.Tensor:
        """The dense ``W_2 W_1`` (``n x m``), for inspection."""
        return self.second.weight @ self.first.weight

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, rank={self.rank}"


def lowrank_params(n: int, m: int, rank: int, bias: bool = True) -> int:
    """Parameters of a rank-``r`` factorised ``n x m`` layer: ``r (n + m)`` (+ ``n`` bias)."""
    return rank * (n + m) + (n if bias else 0)


def rank_for_ratio(n: int, m: int, ratio: float) -> int:
    """Largest rank whose factorisation removes at least ``ratio`` of the ``n m`` weights.

    ``1 - r (n + m) / (n m) >= ratio``  =>  ``r = floor((1 - ratio) n m / (n + m))``, at least 1.

    >>> rank_for_ratio(3072, 768, 0.5)
    307
    """
    if not 0.0 <= ratio < 1.0:
        raise FisherkronError(f"compression ratio must be in [0, 1), got {ratio}")
    return max(1, min(min(n, m), math.floor((1.0 - ratio) * n * m / (n + m))))


def compression_ratio(original: int, compressed: int) -> float:
    """``1 - compressed / original`` (the paper's definition), computed as ``(original - compressed) / original`` so that
    a share met exactly reads exactly.

    >>> compression_ratio(1000, 800), 1.0 - 800 / 1000
    (0.2, 0.19999999999999996)
    """
    if original <= 0:
        raise FisherkronError(f"original parameter count must be positive, got {original}")
    return (original - compressed) / original
