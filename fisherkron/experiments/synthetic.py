r"""The synthetic covariance experiment (paper Sec. 6.1, Figs. "corr" and "diag_full_synth").

MLPs are trained from scratch on binary classification data whose inputs
``x ~ N(0, Sigma)`` have one of three covariance structures:

* ``isotropic``: ``Sigma = I`` (no correlations);
* ``anisotropic``: ``Sigma = T T^T`` for a fixed random linear transform ``T``
  (rescaled to unit variances: unstructured correlations, a spread spectrum);
* ``toeplitz``: ``Sigma_ij = rho^|i-j|`` (structured, spatially decaying).

Labels come from a fixed random teacher network of ``x``. One target layer
(``n x m``, out x in) of the trained student is then compressed to rank ``r``
by plain SVD, by FWSVD (diagonal Fisher, App. E), by GFWSVD with rank-1 MFF
factors ``F ~= A (x) B`` from ``k`` per-batch gradients (Algorithm 1,
Theorem 1), and by GFWSVD restricted to the diagonals of those factors, and the
validation accuracy is measured. Everything here is a plain function so the
notebook ``notebooks/fig_synthetic_correlations.py`` only loops over
configurations and plots.
"""
from __future__ import annotations

import copy
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from ..core.conventions import FisherkronError
from ..core.factorization import mff
from ..core.lowrank import LowRankLinear
from ..core.methods import factorize_weight

__all__ = ["COVARIANCES", "COMPARED", "covariance", "SyntheticTask", "make_task", "make_mlp", "train_mlp",
           "accuracy", "target_linear", "batch_gradients", "diagonal_fisher", "compress_layer",
           "kronecker_factors", "rank_sweep", "SyntheticConfig", "run_seed", "summarize", "accuracy_gaps",
           "claim_check"]

COVARIANCES = ("isotropic", "anisotropic", "toeplitz")
#: The methods Sec. 6.1 compares (rows of :data:`fisherkron.METHODS`).
COMPARED = ("svd", "fwsvd", "gfwsvd_diag", "gfwsvd")


def covariance(kind: str, d: int, *, rho: float = 0.9, seed: int = 0) -> torch.Tensor:
    r"""Input covariance ``Sigma`` (``d x d``, float64, unit diagonal) of one regime.

    ``isotropic``: ``I``; ``anisotropic``: ``D^{-1/2} T T^T D^{-1/2}`` with
    ``T_ij ~ N(0, 1/d)`` fixed by ``seed`` and ``D = diag(T T^T)``;
    ``toeplitz``: ``rho^{|i-j|}``.

    >>> covariance("toeplitz", 3, rho=0.5).tolist()
    [[1.0, 0.5, 0.25], [0.5, 1.0, 0.5], [0.25, 0.5, 1.0]]
    """
    if d < 1:
        raise FisherkronError(f"input dimension d must be >= 1, got {d}")
    if kind == "isotropic":
        return torch.eye(d, dtype=torch.float64)
    if kind == "anisotropic":
        gen = torch.Generator().manual_seed(10_000 + seed)
        T = torch.randn(d, d, generator=gen, dtype=torch.float64) / math.sqrt(d)  # (d, d) fixed transform
        S = T @ T.T  # (d, d)
        s = S.diagonal().rsqrt()
        return s[:, None] * S * s[None, :]
    if kind == "toeplitz":
        if not -1.0 < rho < 1.0:
            raise FisherkronError(f"Toeplitz rho must be in (-1, 1) for a positive definite Sigma, got {rho}")
        i = torch.arange(d, dtype=torch.float64)
        return rho ** (i[:, None] - i[None, :]).abs()
    raise FisherkronError(f"unknown covariance kind {kind!r}; use one of {COVARIANCES}")


@dataclass
class SyntheticTask:
    """Train/validation data of one regime: ``X`` (``N x d``, float32), ``y`` (``N``, int64 in {0, 1})."""

    kind: str
    Sigma: torch.Tensor
    X_train: torch.Tensor
    y_train: torch.Tensor
    X_val: torch.Tensor
    y_val: torch.Tensor


def make_task(kind: str, d: int, n_train: int, n_val: int, *, rho: float = 0.9, teacher_width: int = 32,
              seed: int = 0) -> SyntheticTask:
    r"""Binary classification data with ``x ~ N(0, Sigma)`` and labels from a random teacher.

    ``x = L z`` with ``L = chol(Sigma)``, ``z ~ N(0, I)``; the teacher is
    ``f(x) = v^T tanh(U x)`` with ``U`` (``teacher_width x d``) and ``v`` random,
    ``U`` scaled so each ``u_j^T x`` has unit variance under ``Sigma``; the label
    is ``1[f(x) > median f]`` (balanced classes). ``seed`` fixes the data, the
    teacher and (for ``anisotropic``) ``Sigma``.
    """
    Sigma = covariance(kind, d, rho=rho, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    L = torch.linalg.cholesky(Sigma)  # (d, d)
    Z = torch.randn(n_train + n_val, d, generator=gen, dtype=torch.float64)  # (N, d)
    X = Z @ L.T  # (N, d): rows ~ N(0, Sigma)
    U = torch.randn(teacher_width, d, generator=gen, dtype=torch.float64)  # (t, d)
    U = U / torch.einsum("td,de,te->t", U, Sigma, U).sqrt()[:, None]  # Var(u_j^T x) = 1
    v = torch.randn(teacher_width, generator=gen, dtype=torch.float64)  # (t,)
    f = (X @ U.T) ** 2 @ v  # (N,): a quadratic form of rank t, so the classifier needs t directions
    y = (f > f[:n_train].median()).long()  # (N,)
    X = X.float()
    return SyntheticTask(kind, Sigma, X[:n_train], y[:n_train], X[n_train:], y[n_train:])


def make_mlp(d: int, hidden: Sequence[int], num_classes: int = 2, *, seed: int = 0) -> nn.Sequential:
    """``Linear(d, h1) - ReLU - ... - Linear(h_last, num_classes)``, initialised from ``seed``."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    width = d
    for h in hidden:
        layers += [nn.Linear(width, h), nn.ReLU()]
        width = h
    layers.append(nn.Linear(width, num_classes))
    return nn.Sequential(*layers)


def _batches(X: torch.Tensor, y: torch.Tensor, batch_size: int, gen: torch.Generator):
    perm = torch.randperm(X.shape[0], generator=gen)
    for s in range(0, X.shape[0] - batch_size + 1, batch_size):
        idx = perm[s:s + batch_size]
        yield X[idx], y[idx]


def train_mlp(model: nn.Module, task: SyntheticTask, *, epochs: int = 30, batch_size: int = 64,
              lr: float = 1e-3, weight_decay: float = 0.0, seed: int = 0) -> list[float]:
    """Train with Adam on cross-entropy; returns the mean training loss of each epoch."""
    opt = torch.optim.Adam(model.parameters(), lr=lr, weight_decay=weight_decay)
    gen = torch.Generator().manual_seed(seed)
    loss_fn = nn.CrossEntropyLoss()
    losses = []
    model.train()
    for _ in range(epochs):
        total, count = 0.0, 0
        for xb, yb in _batches(task.X_train, task.y_train, batch_size, gen):
            opt.zero_grad()
            loss = loss_fn(model(xb), yb)
            loss.backward()
            opt.step()
            total += float(loss.detach()) * xb.shape[0]
            count += xb.shape[0]
        losses.append(total / max(count, 1))
    model.eval()
    return losses


@torch.no_grad()
def accuracy(model: nn.Module, X: torch.Tensor, y: torch.Tensor) -> float:
    """Fraction of ``argmax model(X) == y``."""
    model.eval()
    return float((model(X).argmax(dim=1) == y).float().mean())


def target_linear(model: nn.Sequential, index: int) -> tuple[int, nn.Linear]:
    """The ``index``-th ``nn.Linear`` of ``model`` (0 = the input layer) and its position in the Sequential."""
    linears = [(i, mod) for i, mod in enumerate(model) if isinstance(mod, nn.Linear)]
    if not -len(linears) <= index < len(linears):
        raise FisherkronError(f"target layer {index} does not exist: the model has {len(linears)} linear layers")
    return linears[index]


def batch_gradients(model: nn.Sequential, layer: int, X: torch.Tensor, y: torch.Tensor, k: int,
                    batch_size: int, *, seed: int = 0) -> torch.Tensor:
    r"""``k`` per-batch gradients ``G_i = dL_i/dW`` of the target layer (Eq. (8)): ``(k, n, m)``.

    ``L_i`` is the mean cross-entropy (true labels: the empirical Fisher) on
    batch ``i`` of ``batch_size`` examples drawn without replacement (with
    replacement across batches when ``k * batch_size > N``).
    """
    _, lin = target_linear(model, layer)
    gen = torch.Generator().manual_seed(seed)
    N = X.shape[0]
    if batch_size > N:
        raise FisherkronError(f"batch_size {batch_size} exceeds the {N} available examples")
    loss_fn = nn.CrossEntropyLoss()
    model.eval()
    grads = []
    perm = torch.randperm(N, generator=gen)
    pos = 0
    for _ in range(k):
        if pos + batch_size > N:
            perm, pos = torch.randperm(N, generator=gen), 0
        idx = perm[pos:pos + batch_size]
        pos += batch_size
        (G,) = torch.autograd.grad(loss_fn(model(X[idx]), y[idx]), lin.weight)  # (n, m)
        grads.append(G.detach().double())
    return torch.stack(grads)  # (k, n, m)


def diagonal_fisher(grads: torch.Tensor) -> torch.Tensor:
    r"""Diagonal empirical Fisher ``E[G * G]`` (``n x m``) from ``(k, n, m)`` gradients (FWSVD's weights)."""
    if grads.ndim != 3:
        raise FisherkronError(f"expected (k, n, m) gradients, got shape {tuple(grads.shape)}")
    return (grads * grads).mean(dim=0)  # (n, m)


def kronecker_factors(grads: torch.Tensor, **mff_kwargs):
    """Rank-1 MFF factors ``F ~= A (x) B`` (Algorithm 1) of the gradients, in float64."""
    mff_kwargs.setdefault("dtype", torch.float64)
    return mff(grads, **mff_kwargs)


def compress_layer(model: nn.Sequential, layer: int, method: str, rank: int, *, A=None, B=None,
                   fisher_diag=None) -> nn.Sequential:
    """A copy of ``model`` whose target layer is a rank-``rank`` :class:`LowRankLinear`.

    ``method``: ``svd``; ``fwsvd`` (needs ``fisher_diag``, ``(n, m)`` or row sums);
    ``gfwsvd`` (needs the MFF factors ``A`` ``(m x m)``, ``B`` ``(n x n)``);
    ``gfwsvd_diag`` (GFWSVD with ``diag(A)`` and ``diag(B)``).
    """
    pos, lin = target_linear(model, layer)
    W = lin.weight.detach()  # (n, m)
    W2, W1 = factorize_weight(method, W, rank, A=A, B=B, diag_fisher=fisher_diag,
                              layer=f"layer {layer}")  # (n, r), (r, m)
    out = copy.deepcopy(model)
    bias = lin.bias.detach() if lin.bias is not None else None
    out[pos] = LowRankLinear.from_factors(W2.to(W.dtype), W1.to(W.dtype), bias)
    return out


def rank_sweep(model: nn.Sequential, layer: int, task: SyntheticTask, ranks: Iterable[int],
               methods: Iterable[str], *, A=None, B=None, fisher_diag=None) -> list[dict]:
    """Validation accuracy of every ``(method, rank)``; one dict per pair (plus ``method='dense'``)."""
    rows = [{"method": "dense", "rank": None, "accuracy": accuracy(model, task.X_val, task.y_val)}]
    for method in methods:
        for r in ranks:
            comp = compress_layer(model, layer, method, int(r), A=A, B=B, fisher_diag=fisher_diag)
            rows.append({"method": method, "rank": int(r), "accuracy": accuracy(comp, task.X_val, task.y_val)})
    return rows


@dataclass
class SyntheticConfig:
    """One configuration of the experiment (the notebook's parameters, minus plotting)."""

    d: int = 64
    hidden: list[int] = field(default_factory=lambda: [128, 128])
    target_layer: int = 0
    rho: float = 0.95
    teacher_width: int = 16
    n_train: int = 8000
    n_val: int = 4000
    epochs: int = 40
    batch_size: int = 128
    lr: float = 1e-3
    k: int = 64
    calib_batch_size: int = 64
    ranks: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32])
    methods: list[str] = field(default_factory=lambda: list(COMPARED))


def run_seed(kind: str, seed: int, cfg: SyntheticConfig) -> list[dict]:
    """Data, training, ``k`` batch gradients, MFF factors and the rank sweep for one (regime, seed).

    Returns one row per (method, rank) with the columns ``covariance, seed,
    method, rank, accuracy, fisher_share, mff_matvecs, train_loss``.
    """
    task = make_task(kind, cfg.d, cfg.n_train, cfg.n_val, rho=cfg.rho, teacher_width=cfg.teacher_width, seed=seed)
    model = make_mlp(cfg.d, cfg.hidden, seed=seed)
    losses = train_mlp(model, task, epochs=cfg.epochs, batch_size=cfg.batch_size, lr=cfg.lr, seed=seed)
    G = batch_gradients(model, cfg.target_layer, task.X_train, task.y_train, cfg.k, cfg.calib_batch_size,
                        seed=seed)  # (k, n, m)
    res = kronecker_factors(G)
    rows = rank_sweep(model, cfg.target_layer, task, cfg.ranks, cfg.methods, A=res.A, B=res.B,
                      fisher_diag=diagonal_fisher(G))
    for r in rows:
        r.update(covariance=kind, seed=seed, fisher_share=res.fisher_share, mff_matvecs=res.matvecs,
                 train_loss=losses[-1] if losses else float("nan"))
    return rows


def summarize(df):
    """Mean, standard deviation and count of the accuracy over seeds per (covariance, method, rank).

    ``df`` has the columns of :func:`run_seed`; the dense model's row has rank NaN.
    """
    g = df.groupby(["covariance", "method", "rank"], dropna=False)["accuracy"]
    out = g.agg(mean="mean", std="std", seeds="count").reset_index()
    return out


def accuracy_gaps(df, *, reference: str = "gfwsvd", others: Sequence[str] = ("fwsvd", "svd"),
                  max_rank: int | None = None):
    r"""Per-seed accuracy gap ``acc(reference) - acc(other)`` averaged over ranks ``<= max_rank``.

    Returns one row per (covariance, other) with the mean gap over seeds, its
    standard error ``std / sqrt(seeds)`` and the number of seeds.
    """
    import pandas as pd

    d = df[df["method"] != "dense"]
    if max_rank is not None:
        d = d[d["rank"] <= max_rank]
    if d.empty:
        raise FisherkronError("no compressed rows to compare (check the ranks and max_rank)")
    wide = d.pivot_table(index=["covariance", "seed", "rank"], columns="method", values="accuracy")
    if reference not in wide.columns:
        raise FisherkronError(f"reference method {reference!r} was not run")
    rows = []
    for other in others:
        if other not in wide.columns:
            raise FisherkronError(f"method {other!r} was not run")
        per_seed = (wide[reference] - wide[other]).groupby(level=["covariance", "seed"]).mean()
        for cov, s in per_seed.groupby(level="covariance"):
            n = int(s.count())
            se = float(s.std(ddof=1) / math.sqrt(n)) if n > 1 else float("nan")
            rows.append({"covariance": cov, "versus": other, "gap": float(s.mean()), "se": se, "seeds": n})
    order = {c: i for i, c in enumerate(COVARIANCES)}
    out = pd.DataFrame(rows)
    return out.sort_values(["versus", "covariance"], key=lambda c: c.map(order) if c.name == "covariance" else c,
                           ignore_index=True)


def claim_check(gaps, *, versus: str = "fwsvd", isotropic_tol: float = 0.01, z: float = 2.0) -> dict[str, bool]:
    r"""The parts of the Sec. 6.1 claim, tested on :func:`accuracy_gaps` against ``versus``.

    Point estimates (mean gaps over seeds):

    * ``diagonal_fine_isotropic``: the isotropic gap is at most ``isotropic_tol``;
    * ``gap_grows_with_correlation``: isotropic < anisotropic < Toeplitz;
    * ``largest_for_toeplitz``: the Toeplitz gap is the largest and positive.

    Allowing for seed noise (``z`` standard errors; regimes use independent seeds, so the
    standard error of a difference is ``sqrt(se_1^2 + se_2^2)``):

    * ``diagonal_fine_isotropic_within_noise``: ``gap_iso - z se_iso <= isotropic_tol``;
    * ``anisotropic_above_isotropic``: ``gap_ani - gap_iso > z se(diff)``;
    * ``toeplitz_above_anisotropic``: ``gap_toe - gap_ani > z se(diff)``;
    * ``toeplitz_positive``: ``gap_toe > z se_toe``.
    """
    sel = gaps[gaps["versus"] == versus].set_index("covariance")
    missing = [c for c in COVARIANCES if c not in sel.index]
    if missing:
        raise FisherkronError(f"gaps lack the regimes {missing}; run all of {COVARIANCES}")
    (iso, ani, toe) = (float(sel.loc[c, "gap"]) for c in COVARIANCES)
    (si, sa, st) = (float(sel.loc[c, "se"]) for c in COVARIANCES)

    def above(x, y, sx, sy):
        se = math.sqrt(sx ** 2 + sy ** 2)
        return bool(x - y > z * se) if math.isfinite(se) else x > y

    return {"diagonal_fine_isotropic": iso <= isotropic_tol,
            "gap_grows_with_correlation": iso < ani < toe,
            "largest_for_toeplitz": toe > 0 and toe >= max(iso, ani),
            "diagonal_fine_isotropic_within_noise": bool(iso - z * (si if math.isfinite(si) else 0.0)
                                                         <= isotropic_tol),
            "anisotropic_above_isotropic": above(ani, iso, sa, si),
            "toeplitz_above_anisotropic": above(toe, ani, st, sa),
            "toeplitz_positive": above(toe, 0.0, st, 0.0)}
