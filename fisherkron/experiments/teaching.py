r"""Library side of the teaching notebook ``notebooks/kronecker_fisher_from_scratch.py``.

Three pieces, each a loop with mathematics in it that the notebook calls rather than spells out:

* **The weighted-SVD family as pairs of transformation matrices** (Sec. 5.1, Fig. connection2fwsvd,
  App. E). Every method of :mod:`fisherkron.core.methods` compresses ``W`` (``n x m``, out x in)
  through the one kernel of Theorem 1 / Eq. (7),

  .. math:: \widetilde W = L_B^\top W L_A,\qquad
            W_r = L_B^{-\top}\,\mathrm{SVD}_r(\widetilde W)\,L_A^{-1},

  and differs only in the pair ``(L_B, L_A)``: ``L_B`` (``n x n``) acts on the output side, ``L_A``
  (``m x m``) on the input side. The library stores an identity as ``None`` and a diagonal as its
  vector (:class:`fisherkron.core.methods.Weights`); :func:`transform_pair` writes both out as dense
  matrices, so a figure or a check can show them side by side:

  ==============  ================================================  ===================================
  method          ``L_B`` (output side)                             ``L_A`` (input side)
  ==============  ================================================  ===================================
  ``svd``         ``I_n``                                           ``I_m``
  ``fwsvd_rows``  ``D = diag(sqrt(sum_j E[G_ij^2]))`` (App. E)      ``I_m``
  ``fwsvd``       ``I_n``                                           ``C = diag(sqrt(sum_i E[G_ij^2]))``
  ``gfwsvd``      ``chol(B)``                                       ``chol(A)``
  ==============  ================================================  ===================================

  The weights themselves come from :func:`fisherkron.core.methods.method_weights`; nothing is
  re-derived here.

* **Convergence of MFF** (Sec. 4, Algorithm 1): :func:`kron_distance` measures
  ``||A (x) B - A' (x) B'||_F`` without forming either product, and :func:`lanczos_errors` the error
  of the library's :func:`fisherkron.mff` after each number of products, for the convergence plot.

* **The loss link** (Sec. 3.1, Eq. (1)-(2)): ``L(W + dW) - L(W) ~= 1/2 vec(dW)^T H vec(dW)`` with
  ``H ~= F ~= A (x) B``. For the last encoder block of a BERT-style sequence classifier the logits
  read only the first ([CLS]) token, and everything after the block's attention acts token by token,
  so the loss as a function of that block's ``intermediate.dense`` weight is a small float64 network
  of the [CLS] inputs (:class:`CLSPath`): the actual loss change of hundreds of perturbations costs
  seconds. :func:`loss_link` measures it on held-out sentences and sets it beside the quadratic
  predictions of the Fisher, its Kronecker approximation, its diagonal (FWSVD's statistic) and an
  isotropic multiple of the identity (plain SVD's implicit curvature).
"""
from __future__ import annotations

import copy
import logging
import math
from dataclasses import dataclass
from typing import NamedTuple

import pandas as pd
import torch
import torch.nn.functional as nnf
from torch import nn

from ..core.checks import check_matrix
from ..core.conventions import FisherkronError
from ..core.factorization import MFFResult, mff
from ..core.methods import method_weights
from ..core.operators import TokenFisher
from ..core.wsvd import fwsvd, gfwsvd, svd

__all__ = ["TransformPair", "dense_weight", "transform_pair", "offdiagonal_share",
           "kron_distance", "lanczos_errors",
           "CLSInputs", "LayerData", "CLSPath", "sorted_batches", "cls_inputs", "FisherStats", "perturbation_directions",
           "LossLink", "loss_link", "link_summary", "link_verdict", "LINK_LAYERS"]

F64 = torch.float64


class TransformPair(NamedTuple):
    """The dense pair of one method for one layer: ``W~ = L_B^T W L_A`` (Eq. (7)).

    ``L_B`` is ``n x n`` (output side), ``L_A`` is ``m x m`` (input side), both float64;
    ``alpha_A`` / ``alpha_B`` the regularisation the Kronecker factors needed (``None`` where the
    method has no such factor).
    """

    L_B: torch.Tensor
    L_A: torch.Tensor
    alpha_A: float | None = None
    alpha_B: float | None = None


def dense_weight(weight: torch.Tensor | None, size: int) -> torch.Tensor:
    """A weight of :func:`fisherkron.weighted_svd` as a dense ``size x size`` float64 matrix.

    ``None`` is the identity, a vector the diagonal matrix it holds, a matrix itself.

    >>> dense_weight(torch.tensor([2.0, 3.0]), 2).tolist()
    [[2.0, 0.0], [0.0, 3.0]]
    >>> bool(torch.equal(dense_weight(None, 3), torch.eye(3, dtype=torch.float64)))
    True
    """
    if weight is None:
        return torch.eye(size, dtype=torch.float64)
    weight = torch.as_tensor(weight).double().cpu()
    return torch.diag(weight) if weight.ndim == 1 else weight.clone()


def transform_pair(method: str, W: torch.Tensor, *, A=None, B=None, diag_fisher=None, abs_mean=None, xxt=None,
                   kfac=None, alpha: float | None = None, layer: str = "weight", **options) -> TransformPair:
    """``(L_B, L_A)`` of ``method`` for the ``n x m`` weight ``W``, from the statistics the method reads.

    Arguments as for :func:`fisherkron.core.methods.factorize_weight` (``A``, ``B``: MFF's factors
    for the GFWSVD family; ``diag_fisher``: ``E[G * G]`` for the two FWSVD forms; ``options``: its
    ``min_alpha``, ``regularization``, ``asvd_alpha``); ``W`` is read for its shape only.

    Example:
        >>> W, G = torch.randn(7, 5), torch.randn(3, 7, 5)
        >>> pair = transform_pair("fwsvd", W, diag_fisher=(G * G).mean(0))
        >>> tuple(pair.L_B.shape), tuple(pair.L_A.shape), bool(torch.equal(pair.L_B, torch.eye(7).double()))
        ((7, 7), (5, 5), True)
    """
    W = torch.as_tensor(W)
    check_matrix(W, layer)
    n, m = W.shape
    w = method_weights(method, n, m, A=A, B=B, diag_fisher=diag_fisher, abs_mean=abs_mean, xxt=xxt, kfac=kfac,
                       alpha=alpha, layer=layer, **options)
    return TransformPair(dense_weight(w.left, n), dense_weight(w.right, m), w.alpha_A, w.alpha_B)


def offdiagonal_share(M: torch.Tensor) -> float:
    r"""``||M - diag(M)||_F / ||M||_F``: 0 for a diagonal matrix, near 1 when the off-diagonal dominates.

    >>> offdiagonal_share(torch.eye(3))
    0.0
    """
    M = torch.as_tensor(M).double()
    off = M - torch.diag(torch.diagonal(M))
    return float(off.norm() / M.norm())


# ----------------------------------------------------------------------------- convergence of MFF


def _canonical(A: torch.Tensor, B: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The same ``A (x) B`` split so that ``||A|| = ||B||`` and ``tr A >= 0`` (the split is free up to ``c A, B / c``)."""
    A, B = torch.as_tensor(A).double(), torch.as_tensor(B).double()
    c = math.sqrt(float(B.norm()) / max(float(A.norm()), 1e-300))
    if torch.trace(A) < 0:
        c = -c
    return c * A, B / c


def kron_distance(A1, B1, A2, B2) -> float:
    r"""``||A1 (x) B1 - A2 (x) B2||_F`` without forming either Kronecker product.

    With both pairs split alike (:func:`_canonical`), ``A1 (x) B1 - A2 (x) B2 = dA (x) B1 + A2 (x) dB``
    (``dA = A1 - A2``, ``dB = B1 - B2``), and since ``<K (x) L, M (x) N> = <K, M><L, N>``,

    .. math:: \lVert\cdot\rVert_F^2 = \lVert dA\rVert^2\lVert B_1\rVert^2 + \lVert A_2\rVert^2\lVert dB\rVert^2
              + 2\langle dA, A_2\rangle\langle B_1, dB\rangle,

    a sum of small terms when the pairs are close (no cancellation of large ones).

    >>> A, B = torch.eye(2), torch.diag(torch.tensor([1.0, 2.0, 3.0]))
    >>> kron_distance(A, B, 2 * A, B / 2)
    0.0
    """
    A1, B1 = _canonical(A1, B1)
    A2, B2 = _canonical(A2, B2)
    dA, dB = A1 - A2, B1 - B2
    sq = (dA.norm() * B1.norm()) ** 2 + (A2.norm() * dB.norm()) ** 2 + 2 * (dA * A2).sum() * (B1 * dB).sum()
    return math.sqrt(max(float(sq), 0.0))


def lanczos_errors(G, A_ref, B_ref, max_products: int) -> list[tuple[int, float]]:
    """``(products, ||A (x) B - A_ref (x) B_ref|| / ||A_ref (x) B_ref||)`` of :func:`fisherkron.mff` stopped after
    ``1, 2, ..., max_products`` products (float64 GEMMs, default start), until it converges on its own.

    Each truncated run warns that it stopped before its tolerance; that is the point here, so the
    warnings are silenced for the duration.
    """
    ref = float(torch.as_tensor(A_ref).double().norm() * torch.as_tensor(B_ref).double().norm())
    log = logging.getLogger("fisherkron.core.factorization")
    level = log.level
    log.setLevel(logging.ERROR)
    out: list[tuple[int, float]] = []
    try:
        for budget in range(1, max_products + 1):
            res = mff(G, dtype=F64, max_matvecs=budget, compute_norm=False)
            out.append((res.matvecs, kron_distance(res.A, res.B, A_ref, B_ref) / ref))
            if res.converged:
                break
    finally:
        log.setLevel(level)
    return out


# ----------------------------------------------------------------------------- the loss link (Eq. (1)-(2))

#: the linear layers of the last encoder block a :class:`CLSPath` can perturb: all act token by token
LINK_LAYERS = ("attention.output.dense", "intermediate.dense", "output.dense")


class CLSInputs(NamedTuple):
    """What a BERT-style classifier's last block sees of each sentence's first ([CLS]) token.

    ``C``: ``(N, d)`` the attention context entering ``attention.output.dense``; ``R``: ``(N, d)`` the
    block's input (the residual that ``attention.output`` adds back); ``y``: ``(N,)`` labels;
    ``logits``: ``(N, classes)`` the model's own logits, for checking a :class:`CLSPath` against it.
    All float64 but ``y``.
    """

    C: torch.Tensor
    R: torch.Tensor
    y: torch.Tensor
    logits: torch.Tensor


class LayerData(NamedTuple):
    """The studied layer's inputs ``X`` (``(N, m)``), what the rest of the path needs (``ctx``), labels ``y``."""

    X: torch.Tensor
    ctx: torch.Tensor
    y: torch.Tensor


def _last_block(model: nn.Module):
    base = getattr(model, "base_model", None)
    layers = getattr(getattr(base, "encoder", None), "layer", None)
    if layers is None or getattr(base, "pooler", None) is None or not isinstance(getattr(model, "classifier", None),
                                                                                nn.Linear):
        raise FisherkronError(f"the [CLS] path needs a BERT-style sequence classifier (base_model.encoder.layer, "
                              f"base_model.pooler and a linear classifier); got {type(model).__name__}")
    return base, layers[-1], len(layers) - 1


def sorted_batches(tokenizer, dataset, count: int, *, batch_size: int, seed: int, text_field: str = "sentence",
                   max_length: int = 64) -> list[dict[str, torch.Tensor]]:
    """``count`` labelled examples drawn without replacement with ``seed``, in batches of similar length.

    Only the [CLS] token is read downstream and padding is masked, so grouping sentences by length
    changes nothing but the padding each forward pass computes.
    """
    if count > len(dataset):
        raise FisherkronError(f"{count} sentences asked for; the split has {len(dataset)}")
    pick = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed))[:count].tolist()
    rows = dataset.select(pick)
    texts, labels = list(rows[text_field]), list(rows["label"])
    order = sorted(range(count), key=lambda i: len(tokenizer(texts[i], truncation=True, max_length=max_length)
                                                  ["input_ids"]))
    out = []
    for start in range(0, count, batch_size):
        chunk = order[start:start + batch_size]
        batch = dict(tokenizer([texts[i] for i in chunk], truncation=True, max_length=max_length, padding=True,
                               return_tensors="pt"))
        batch["labels"] = torch.tensor([labels[i] for i in chunk])
        out.append(batch)
    return out


def cls_inputs(model: nn.Module, batches) -> CLSInputs:
    """Run ``model`` (in eval mode) on labelled ``batches``; keep the [CLS] token's inputs of the last block's
    ``attention.output`` (the context and the residual), the labels and the model's logits."""
    _, block, _ = _last_block(model)
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []

    def keep(module, inputs, output):  # attention.output(context, hidden_states): LN(dense(context) + hidden_states)
        seen.append((inputs[0][:, 0].detach(), inputs[1][:, 0].detach()))

    hook = block.attention.output.register_forward_hook(keep)
    ys, logits = [], []
    try:
        with torch.no_grad():
            for batch in batches:
                logits.append(model(**{k: v for k, v in batch.items() if k != "labels"}).logits)
                ys.append(batch["labels"])
    finally:
        hook.remove()
    C = torch.cat([c for c, _ in seen]).double()  # (N, d)
    R = torch.cat([r for _, r in seen]).double()  # (N, d)
    return CLSInputs(C, R, torch.cat(ys), torch.cat(logits).double())


class CLSPath(nn.Module):
    r"""The logits of a BERT-style classifier as a function of one linear layer of its last block, in float64.

    The logits read the [CLS] token of the last block only, and after the block's attention every
    step acts token by token, so for the [CLS] token with attention context ``c`` and block input ``r``

    .. math:: a = \mathrm{LN}_1(W_{ao} c + b_{ao} + r),\quad z = \mathrm{LN}_2(W_o\,\mathrm{GELU}(W_i a + b_i) + b_o + a),
              \quad \mathrm{logits} = W_c \tanh(W_p z + b_p) + b_c .

    ``layer`` picks the studied ``W`` (``n x m``) among :data:`LINK_LAYERS`; :meth:`data` turns
    :class:`CLSInputs` into that layer's inputs ``x_t`` and what the rest of the path needs. The
    modules are float64 copies (the model is not touched), so a loss change of ``1e-9`` is still
    above round-off.
    """

    def __init__(self, model: nn.Module, layer: str = "attention.output.dense"):
        super().__init__()
        if layer not in LINK_LAYERS:
            raise FisherkronError(f"layer {layer!r}: the [CLS] path can perturb one of {', '.join(LINK_LAYERS)}")
        base, block, index = _last_block(model)
        self.attention_output = copy.deepcopy(block.attention.output).double()  # LN_1(W_ao c + b_ao + r)
        self.intermediate = copy.deepcopy(block.intermediate).double()  # GELU(W_i a + b_i)
        self.output = copy.deepcopy(block.output).double()  # LN_2(W_o h + b_o + a)
        self.pooler = copy.deepcopy(base.pooler).double()  # tanh(W_p z + b_p) of the first token
        self.classifier = copy.deepcopy(model.classifier).double()  # W_c p + b_c
        self.requires_grad_(False)
        self.eval()
        self.sublayer = layer
        self.layer = f"{getattr(model, 'base_model_prefix', 'bert')}.encoder.layer.{index}.{layer}"
        dense = {"attention.output.dense": self.attention_output.dense, "intermediate.dense": self.intermediate.dense,
                 "output.dense": self.output.dense}[layer]
        self.W = dense.weight.detach().clone()  # (n, m)
        self.b = dense.bias.detach().clone()  # (n,)

    def data(self, inputs: CLSInputs) -> LayerData:
        """The studied layer's inputs ``X`` (``N x m``) and the context ``ctx`` the path needs after it."""
        with torch.no_grad():
            if self.sublayer == "attention.output.dense":
                return LayerData(inputs.C, inputs.R, inputs.y)  # x = c; after it: r
            a = self.attention_output(inputs.C, inputs.R)  # (N, d)
            if self.sublayer == "intermediate.dense":
                return LayerData(a, a, inputs.y)  # x = a; after it: a (the residual)
            return LayerData(self.intermediate(a), a, inputs.y)  # x = GELU(W_i a + b_i); after it: a

    def body(self, U: torch.Tensor, ctx: torch.Tensor) -> torch.Tensor:
        """The last hidden state of the [CLS] token (``N x d``) from the layer's pre-activations ``U`` (``N x n``)."""
        ao, it, out = self.attention_output, self.intermediate, self.output
        if self.sublayer == "attention.output.dense":
            a = ao.LayerNorm(U + ctx)  # (N, d)
            return out(it(a), a)
        if self.sublayer == "intermediate.dense":
            return out(it.intermediate_act_fn(U), ctx)
        return out.LayerNorm(U + ctx)

    def head(self, Z: torch.Tensor) -> torch.Tensor:
        """Logits (``N x classes``) from the last hidden state of the [CLS] token."""
        return self.classifier(self.pooler(Z[:, None]))

    def logits(self, data: LayerData, W: torch.Tensor | None = None) -> torch.Tensor:
        """Logits with the studied weight replaced by ``W`` (``n x m``; default: the model's)."""
        W = self.W if W is None else W
        return self.head(self.body(data.X @ W.T + self.b, data.ctx))  # (N, classes)

    def loss(self, data: LayerData, W: torch.Tensor | None = None) -> float:
        """Mean cross-entropy ``L(W)`` over the sentences of ``data``."""
        with torch.no_grad():
            return float(nnf.cross_entropy(self.logits(data, W), data.y))

    def gradient(self, data: LayerData) -> torch.Tensor:
        """``dL/dW`` (``n x m``) of the mean cross-entropy at the model's ``W``."""
        W = self.W.clone().requires_grad_()
        with torch.enable_grad():
            (g,) = torch.autograd.grad(nnf.cross_entropy(self.logits(data, W), data.y), W)
        return g

    def output_grads(self, data: LayerData, y: torch.Tensor | None = None) -> torch.Tensor:
        r"""``delta_t = d l_t / d u_t`` (``N x n``) for labels ``y`` (default: the data's), ``u_t = W x_t + b``.

        Sentence ``t``'s gradient is the rank-one ``G_t = delta_t x_t^T`` (Sec. 1 of the notebook).
        """
        U = (data.X @ self.W.T + self.b).requires_grad_()
        with torch.enable_grad():
            total = nnf.cross_entropy(self.head(self.body(U, data.ctx)), data.y if y is None else y, reduction="sum")
            (D,) = torch.autograd.grad(total, U)
        return D

    def fisher_inputs(self, data: LayerData, labels: str = "data") -> tuple[torch.Tensor, torch.Tensor]:
        r"""``(X, D)`` whose rows give the per-sentence gradients ``G = delta x^T`` of a Fisher (for :class:`TokenFisher`).

        ``labels="data"``: the empirical Fisher, ``(1/N) sum_t g_t g_t^T`` with the data's labels.
        ``labels="model"``: the Fisher of the model's own predictive distribution,
        ``(1/N) sum_t sum_c p_c(x_t) g_{tc} g_{tc}^T`` (``g_{tc}``: the gradient had the label been
        ``c``), computed exactly over the classes rather than by sampling: ``classes * N`` rows, each
        ``delta`` scaled by ``sqrt(classes * p_c)`` so that the mean over the rows is that sum.
        """
        if labels == "data":
            return data.X, self.output_grads(data)
        if labels != "model":
            raise FisherkronError(f"labels={labels!r}: use 'data' (empirical Fisher) or 'model' (the model's Fisher)")
        with torch.no_grad():
            P = torch.softmax(self.logits(data), dim=1)  # (N, classes)
        k = P.shape[1]
        D = torch.cat([self.output_grads(data, torch.full_like(data.y, c)) * (k * P[:, c:c + 1]).sqrt()
                       for c in range(k)])  # (classes N, n)
        return data.X.repeat(k, 1), D

    def fit_head(self, data: LayerData, l2: float) -> float:
        """Fit the classifier to the pooled features by L-BFGS on ``CE + l2 ||W_c||_F^2`` (a convex problem);
        returns the training cross-entropy it reaches. The studied layer is left as it is."""
        with torch.no_grad():
            P = self.pooler(self.body(data.X @ self.W.T + self.b, data.ctx)[:, None])  # (N, d): fixed features
        Wc = torch.zeros_like(self.classifier.weight, requires_grad=True)  # (classes, d)
        bc = torch.zeros_like(self.classifier.bias, requires_grad=True)  # (classes,)
        opt = torch.optim.LBFGS([Wc, bc], max_iter=500, tolerance_grad=1e-10, tolerance_change=1e-14,
                                line_search_fn="strong_wolfe")

        def closure():
            opt.zero_grad()
            loss = nnf.cross_entropy(P @ Wc.T + bc, data.y) + l2 * (Wc * Wc).sum()
            loss.backward()
            return loss

        with torch.enable_grad():
            opt.step(closure)
        with torch.no_grad():
            self.classifier.weight.copy_(Wc)
            self.classifier.bias.copy_(bc)
        return self.loss(data)


@dataclass
class FisherStats:
    r"""One Fisher of the studied layer, from per-sentence gradients ``G_t = D_t X_t^T``, and its quadratic forms.

    ``mff``: MFF's ``A (x) B`` (float64, on :class:`TokenFisher`); ``diag``: ``E[G * G]`` (``n x m``),
    the diagonal FWSVD reads. :meth:`quadratic_forms` gives ``vec(V)^T M vec(V)`` for the Fisher itself,
    its Kronecker and diagonal approximations and the isotropic ``(tr F / nm) I``.
    """

    X: torch.Tensor  # (N, m)
    D: torch.Tensor  # (N, n)
    mff: MFFResult
    diag: torch.Tensor  # (n, m)

    @classmethod
    def of(cls, X: torch.Tensor, D: torch.Tensor, name: str = "layer") -> "FisherStats":
        res = mff(TokenFisher(X, D, dtype=F64, name=name), dtype=F64, name=name)
        return cls(X, D, res, (D * D).T @ (X * X) / X.shape[0])

    @property
    def A(self) -> torch.Tensor:
        return self.mff.A

    @property
    def B(self) -> torch.Tensor:
        return self.mff.B

    def quadratic_forms(self, V: torch.Tensor) -> dict[str, float]:
        """``vec(V)^T M vec(V)`` for ``M`` = the Fisher, ``A (x) B``, ``diag(F)`` and ``(tr F / nm) I``."""
        n, m = V.shape
        return {
            "fisher": float((((self.X @ V.T) * self.D).sum(1) ** 2).mean()),  # mean_t (delta_t^T V x_t)^2
            "kronecker": float(torch.trace(V.T @ self.B @ V @ self.A)),  # tr(V^T B V A)
            "diagonal": float((self.diag * V * V).sum()),  # sum_ij E[G_ij^2] V_ij^2
            "isotropic": float(self.diag.sum() / (n * m) * (V * V).sum()),  # (tr F / nm) ||V||^2
        }


def perturbation_directions(W: torch.Tensor, *, A, B, diag_fisher, rank: int, draws: int, seed: int,
                            share: float = 0.05) -> list[tuple[str, torch.Tensor]]:
    """Unit-norm directions (``n x m``) to move ``W`` along: four random shapes, ``draws`` of each, and the
    directions of the compression errors ``W_r - W`` of SVD, FWSVD and GFWSVD at ``rank``.

    Random shapes: ``iid`` Gaussian entries; ``rows``: Gaussian on a random ``share`` of the output rows
    (neurons), zero elsewhere; ``columns``: the same for the input columns; ``rank one``: ``u v^T``.
    """
    n, m = W.shape
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(draws):
        out.append(("iid", torch.randn(n, m, generator=g, dtype=F64)))
        rows = torch.randperm(n, generator=g)[: max(1, round(share * n))]
        out.append(("rows", torch.zeros(n, m, dtype=F64).index_copy(
            0, rows, torch.randn(len(rows), m, generator=g, dtype=F64))))
        cols = torch.randperm(m, generator=g)[: max(1, round(share * m))]
        out.append(("columns", torch.zeros(n, m, dtype=F64).index_copy(
            1, cols, torch.randn(n, len(cols), generator=g, dtype=F64))))
        out.append(("rank one", torch.outer(torch.randn(n, generator=g, dtype=F64),
                                            torch.randn(m, generator=g, dtype=F64))))
    W = W.double()
    for name, factors in (("SVD error", svd(W, rank)), ("FWSVD error", fwsvd(W, diag_fisher, rank)),
                          ("GFWSVD error", gfwsvd(W, A, B, rank))):
        out.append((name, torch.matmul(*factors) - W))
    return [(kind, V / V.norm()) for kind, V in out]


@dataclass
class LossLink:
    """Result of :func:`loss_link`: ``table`` has one row per (direction, size), ``fishers`` the two Fishers."""

    layer: str
    shape: tuple[int, int]
    table: pd.DataFrame
    fishers: dict[str, FisherStats]
    loss: float  # held-out L(W)
    heldout: int  # sentences
    calibration: int  # sentences


def loss_link(path: CLSPath, calibration: LayerData, heldout: LayerData, *, sizes, rank: int, draws: int,
              seed: int) -> LossLink:
    r"""Measured loss changes against second-order predictions (Eq. (1)-(2)) for ``W + dW``.

    Fishers from the ``calibration`` sentences (per-sentence gradients; ``"data"``: the data's labels,
    ``"model"``: the model's predictive distribution, :meth:`CLSPath.fisher_inputs`); directions from
    :func:`perturbation_directions`, each scaled to ``||dW||_F = size * ||W||_F``. On the ``heldout``
    sentences, per perturbation: ``one_sided = L(W + dW) - L(W)``; ``measured`` = its even part
    ``(L(W + dW) + L(W - dW)) / 2 - L(W)`` (the first-order term cancels, the second-order one stays:
    ``1/2 vec(dW)^T H vec(dW) + O(dW^4)``); ``first_order = <dL/dW, dW>``; and the predictions
    ``1/2 vec(dW)^T M vec(dW)`` in columns ``<form>_<labels>`` (see :meth:`FisherStats.quadratic_forms`).
    """
    W = path.W
    fishers = {labels: FisherStats.of(*path.fisher_inputs(calibration, labels), name=path.layer)
               for labels in ("data", "model")}
    emp = fishers["data"]
    directions = perturbation_directions(W, A=emp.A, B=emp.B, diag_fisher=emp.diag, rank=rank, draws=draws, seed=seed)
    L0 = path.loss(heldout)
    grad = path.gradient(heldout)  # (n, m)
    rows = []
    for index, (kind, V) in enumerate(directions):
        forms = {f"{form}_{labels}": q for labels, st in fishers.items() for form, q in st.quadratic_forms(V).items()}
        for size in sizes:
            scale = float(size * W.norm())  # ||dW||_F
            dW = scale * V  # (n, m)
            plus, minus = path.loss(heldout, W + dW) - L0, path.loss(heldout, W - dW) - L0
            rows.append(dict(direction=kind, index=index, size=size, norm2=scale ** 2, one_sided=plus,
                             measured=(plus + minus) / 2, first_order=float((grad * dW).sum()),
                             **{k: 0.5 * scale ** 2 * q for k, q in forms.items()}))
    return LossLink(path.layer, tuple(W.shape), pd.DataFrame(rows), fishers, L0, len(heldout.y), len(calibration.y))


#: the predictions :func:`link_summary` scores, in the order of the weighted-SVD family they stand for
FORMS = {"isotropic": "isotropic (SVD)", "diagonal": "diagonal (FWSVD)", "kronecker": "Kronecker (GFWSVD)",
         "fisher": "full Fisher"}


def link_summary(link: LossLink) -> pd.DataFrame:
    """How well each prediction tracks the measured (even) loss change, per Fisher.

    ``pearson``: correlation of measured and predicted ``Delta L`` over all perturbations (sizes mixed, so
    even a prediction that knows only ``||dW||`` scores well); ``spearman``: rank correlation of the
    curvature along each direction, ``Delta L / ||dW||^2``, which ``||dW||`` cannot explain (not defined
    for the isotropic prediction: the same curvature in every direction); ``ratio``: median of
    measured / predicted.
    """
    t = link.table
    curv = t.measured / t.norm2
    rows = []
    for labels in ("data", "model"):
        for form, name in FORMS.items():
            p = t[f"{form}_{labels}"]
            spearman = float("nan") if form == "isotropic" else float(curv.corr(p / t.norm2, method="spearman"))
            rows.append(dict(fisher="empirical (data labels)" if labels == "data" else "model's (its own labels)",
                             prediction=name, pearson=float(t.measured.corr(p)), spearman=spearman,
                             ratio=float((t.measured / p).median())))
    return pd.DataFrame(rows)


def link_verdict(link: LossLink, summary: pd.DataFrame, margin: float = 0.05) -> list[str]:
    """The loss link's verdict, one sentence a line, every number from ``link`` and ``summary``."""
    t = link.table
    s = summary.set_index(["fisher", "prediction"])
    emp = "empirical (data labels)"
    kron, diag, full = (s.loc[(emp, FORMS[f])] for f in ("kronecker", "diagonal", "fisher"))
    model_kron = s.loc[("model's (its own labels)", FORMS["kronecker"])]
    d = kron.spearman - diag.spearman
    compare = ("ranks them better than" if d > margin else "ranks them worse than" if d < -margin
               else "ranks them about as well as")
    per_direction = t.groupby("index").measured.max()
    negative = int((t.groupby("index").measured.max() < 0).sum())
    one = t.one_sided.corr(t.kronecker_data)
    both = t.one_sided.corr(t.first_order + t.kronecker_data)
    n, m = link.shape
    lines = [
        f"Loss link on {link.layer} ({n} x {m}), {link.heldout} held-out sentences, {len(per_direction)} directions "
        f"x {t['size'].nunique()} sizes: the Kronecker prediction 1/2 tr(dW^T B dW A) of the empirical Fisher ranks "
        f"the directions by their measured curvature with Spearman rho = {kron.spearman:.2f}; it {compare} the "
        f"diagonal (FWSVD) prediction (rho = {diag.spearman:.2f}); the full Fisher it approximates: "
        f"rho = {full.spearman:.2f}.",
        f"Scale: the measured change is {kron.ratio:.2f} x the empirical-Fisher Kronecker prediction (median), "
        f"{model_kron.ratio:.2f} x with the model's Fisher (rho = {model_kron.spearman:.2f}).",
        (f"Along {negative} of {len(per_direction)} directions the loss fell on both sides (negative curvature), "
         f"which no Fisher, being positive semidefinite, can predict: W is not a minimum of this loss."
         if negative else
         f"Along all {len(per_direction)} directions the loss rose on both sides (no negative curvature was met), "
         f"as a positive semidefinite Fisher assumes."),
        f"One-sided change L(W + dW) - L(W): correlation with the quadratic prediction r = {one:.2f}, with the "
        f"first-order term added r = {both:.2f}; Eq. (1) drops that term, which holds only at an optimum.",
    ]
    return lines
