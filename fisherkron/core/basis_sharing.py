r"""Basis Sharing (Wang et al. 2024): one input-side basis shared by a group of layers (paper Sec. 6.3 baseline).

Basis Sharing ("Cross-Layer Parameter Sharing for LLM Compression") compresses the same
projection of ``g`` consecutive decoder blocks together. Their weights ``W_j`` (``n_j x m``,
out x in, the ``nn.Linear`` layout of :mod:`fisherkron.core.conventions`) are stacked along the
outputs and whitened on the input side by the Cholesky factor of the group's summed Gram
matrices, i.e. SVD-LLM of the stacked matrix:

.. math::
    W_s = \begin{bmatrix} W_1 \\ \vdots \\ W_g \end{bmatrix} \in \mathbb{R}^{(\sum_j n_j) \times m},\quad
    S S^\top = \sum_j X_j X_j^\top,\quad
    W_s S = U \Sigma V^\top,

    W_1^{\mathrm{sh}} = \Sigma_r^{1/2} V_r^\top S^{-1} \;(r \times m,\ \text{shared}),\qquad
    W_{2,j} = U_{j,r} \Sigma_r^{1/2} \;(n_j \times r,\ \text{layer } j\text{'s rows of } U_r),

so layer ``j`` computes ``y = W_{2,j} (W_1^{sh} x) + b_j``. The singular values are split evenly
between the two factors, as :class:`~fisherkron.core.wsvd.Decomposition` does for every other
method (the authors' code puts all of ``Sigma`` on the basis; the product ``W_{2,j} W_1^{sh}`` is
the same), so a group of one is SVD-LLM (:func:`fisherkron.svd_llm`) factor for factor.

``W_{2,j} W_1^{sh}`` minimises the group's whitened error
``sum_j ||(W_j - W_{2,j} W_1) S||_F^2 = ||(W_s - \hat W_s) S||_F^2`` over all stacked rank-``r``
matrices (Eckart-Young on ``W_s S``); its value is the tail ``sum_{i>r} sigma_i^2``.

Parameters: the group stores ``r m`` (the basis, once) plus ``r sum_j n_j`` (+ biases). For ``g``
equal layers the authors' rank for a ratio ``rho`` of the linear weights is
``r = floor(m n g (1 - rho) / (m + n g))`` (their ``compute_num_basis``), which
:func:`shared_basis_rank` computes.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from .checks import as_tensor, check_finite, check_int, check_matrix, check_rank
from .conventions import FisherkronError
from .regularization import MIN_ALPHA
from .wsvd import _chol, decompose

__all__ = ["SharedFactors", "shared_basis", "shared_basis_rank", "shared_basis_params", "SharedBasisLinear"]


class SharedFactors(tuple):
    """``(W1, [W2_j])``: the shared basis (``r x m``) and each layer's coefficients (``n_j x r``).

    Unpacks as a pair; ``alpha`` is the regularisation the summed Gram matrix needed (as
    ``alpha_A`` of :func:`fisherkron.svd_llm`).
    """

    def __new__(cls, W1: torch.Tensor, W2s: list[torch.Tensor], alpha: float | None = None):
        self = super().__new__(cls, (W1, list(W2s)))
        self.alpha = alpha
        return self

    @property
    def W1(self) -> torch.Tensor:
        return self[0]

    @property
    def W2s(self) -> list[torch.Tensor]:
        return self[1]

    @property
    def rank(self) -> int:
        return int(self[0].shape[0])

    def __repr__(self) -> str:
        return (f"SharedFactors(W1={tuple(self[0].shape)}, W2s={[tuple(w.shape) for w in self[1]]}, "
                f"alpha={self.alpha})")


def shared_basis(Ws, XXt, rank: int, *, alpha: float | None = None, method: str = "diag",
                 min_alpha: float = MIN_ALPHA, name: str = "group") -> SharedFactors:
    r"""Basis Sharing of one group (module docstring): ``W_s S = U Sigma V^T`` with ``S S^T = sum_j X_j X_j^T``,
    ``W1 = Sigma_r^{1/2} V_r^T S^{-1}`` (shared) and ``W2_j = U_{j,r} Sigma_r^{1/2}``.

    Args:
        Ws: the group's weights ``W_j``, each ``(n_j, m)`` (out x in), stacked along the outputs
            into ``W_s`` (``(sum_j n_j) x m``) in this order.
        XXt: ``sum_j X_j X_j^T`` (``m x m``), the group's summed input Gram matrices.
        rank: ``r`` in ``1..min(sum_j n_j, m)``; may exceed a single ``n_j``.
        alpha, method, min_alpha: the regularisation of ``XXt`` before its Cholesky factor ``S``,
            exactly as :func:`fisherkron.svd_llm` regularises ``X X^T`` (same search and floor).
        name: the group in error messages.

    Returns:
        :class:`SharedFactors` ``(W1, [W2_j])`` in the weights' dtype, ``W_j ~= W2_j @ W1``; the
        ``alpha`` used is ``.alpha``. A group of one equals ``svd_llm(W, XXt, rank)``.

    Example:
        >>> W_a, W_b = torch.randn(7, 5, dtype=torch.float64), torch.randn(3, 5, dtype=torch.float64)
        >>> X = torch.randn(5, 40, dtype=torch.float64)
        >>> W1, (W2_a, W2_b) = shared_basis([W_a, W_b], X @ X.T, 5)  # full rank: exact
        >>> bool(torch.allclose(W2_a @ W1, W_a)) and bool(torch.allclose(W2_b @ W1, W_b))
        True
    """
    if isinstance(Ws, torch.Tensor) or not isinstance(Ws, (list, tuple)) or not Ws:
        raise FisherkronError(f"{name}: Ws must be a non-empty list of (n_j, m) weights")
    Ws = [as_tensor(W, f"{name}: weight {j}") for j, W in enumerate(Ws)]
    m = Ws[0].shape[-1] if Ws[0].ndim == 2 else None
    for j, W in enumerate(Ws):
        check_matrix(W, f"{name}: weight {j}", (None, m))
        check_finite(W, f"{name}: weight {j}")
    if len({W.dtype for W in Ws}) != 1 or len({W.device for W in Ws}) != 1:
        raise FisherkronError(f"{name}: the weights of a group must share one dtype and device")
    ns = [int(W.shape[0]) for W in Ws]
    check_rank(rank, sum(ns), m, name)
    reg = _chol(XXt, m, f"{name}: sum_j X_j X_j^T (m x m)", alpha, method, min_alpha)
    Ws_stacked = torch.cat(Ws, dim=0)  # (sum n_j, m): W_s
    dec = decompose(Ws_stacked, right=reg.L, name=name, alpha_A=reg.alpha)  # W_s S = U Sigma V^T (float64)
    W2_s, W1 = dec.factors(rank, name)  # (sum n_j, r): U_r Sigma_r^1/2, (r, m): Sigma_r^1/2 V_r^T S^{-1}
    return SharedFactors(W1, list(torch.split(W2_s, ns, dim=0)), alpha=reg.alpha)


def shared_basis_rank(n: int, m: int, ratio: float, group: int = 1) -> int:
    r"""The authors' rank for ``group`` stacked ``n x m`` layers at a ratio ``rho`` of their weights.

    ``r = floor(m n g (1 - rho) / (m + n g))``, at least 1: the basis (``r m``) and the ``g``
    coefficient blocks (``r n`` each) keep at most ``(1 - rho) g n m`` weights; ``g = 1`` is the
    rank of a private layer (``rank_for_ratio``).

    >>> shared_basis_rank(11008, 4096, 0.2, group=2)  # Llama-2-7B up_proj, 20 %: 4096*11008*2*0.8 // 26112
    2762
    """
    n, m = check_int(n, "n", minimum=1), check_int(m, "m", minimum=1)
    group = check_int(group, "group", minimum=1)
    if not 0.0 <= ratio < 1.0:
        raise FisherkronError(f"compression ratio must be in [0, 1), got {ratio}")
    return max(1, math.floor(m * n * group * (1.0 - ratio) / (m + n * group)))


def shared_basis_params(ns, m: int, rank: int, bias: bool = False) -> int:
    """Parameters of a group sharing one basis: ``r m + r sum_j n_j`` (+ ``sum_j n_j`` biases)."""
    return rank * m + rank * sum(ns) + (sum(ns) if bias else 0)


class SharedBasisLinear(nn.Module):
    """``x -> second(first(x))``: ``first`` = the shared basis ``W_1`` (``r x m``, no bias, one ``nn.Linear``
    referenced by every layer of its group), ``second`` = this layer's ``W_{2,j}`` (``n_j x r``) + bias.

    ``model.parameters()`` (and :func:`fisherkron.count_params`) count the shared basis once.

    Example:
        >>> W1, W2s = torch.randn(3, 5), [torch.randn(7, 3), torch.randn(4, 3)]
        >>> a, b = SharedBasisLinear.from_factors(W1, W2s)
        >>> a.first is b.first, a.rank, b.out_features
        (True, 3, 4)
    """

    def __init__(self, first: nn.Linear, out_features: int, bias: bool = True, device=None, dtype=None):
        super().__init__()
        if not isinstance(first, nn.Linear) or first.bias is not None:
            raise FisherkronError("first must be the group's shared nn.Linear(m, r, bias=False)")
        self.in_features, self.rank = first.in_features, first.out_features
        self.out_features = check_int(out_features, "out_features", minimum=1)
        if not 1 <= self.rank <= self.in_features:
            raise FisherkronError(f"rank {self.rank} is outside 1..in_features={self.in_features}")
        self.first = first  # W1: (r, m), the same module object in every layer of the group
        self.second = nn.Linear(self.rank, self.out_features, bias=bias, device=device,
                                dtype=dtype if dtype is not None else first.weight.dtype)  # W2_j: (n_j, r)

    @classmethod
    def from_factors(cls, W1, W2s, biases=None) -> list["SharedBasisLinear"]:
        """One module per layer from the shared ``W1`` (``r x m``), the ``W2_j`` (``n_j x r``) and optional biases."""
        W1 = as_tensor(W1, "W1")
        check_matrix(W1, "W1")
        check_finite(W1, "W1")
        r, m = W1.shape
        biases = [None] * len(W2s) if biases is None else list(biases)
        if len(biases) != len(W2s):
            raise FisherkronError(f"{len(W2s)} coefficient blocks but {len(biases)} biases")
        first = nn.Linear(m, r, bias=False, device=W1.device, dtype=W1.dtype)
        with torch.no_grad():
            first.weight.copy_(W1)
        out = []
        for j, (W2, b) in enumerate(zip(W2s, biases)):
            W2 = as_tensor(W2, f"W2[{j}]")
            check_matrix(W2, f"W2[{j}]", (None, r))
            check_finite(W2, f"W2[{j}]")
            mod = cls(first, W2.shape[0], bias=b is not None, device=W1.device, dtype=W1.dtype)
            with torch.no_grad():
                mod.second.weight.copy_(W2)
                if b is not None:
                    mod.second.bias.copy_(as_tensor(b, f"bias[{j}]").to(W1.dtype))
            out.append(mod)
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., m) -> (..., n_j)
        return self.second(self.first(x))

    @property
    def weight(self) -> torch.Tensor:
        """The dense ``W_{2,j} W_1`` (``n_j x m``), for inspection."""
        return self.second.weight @ self.first.weight

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, rank={self.rank}, "
                f"first=shared basis (r x m)")
