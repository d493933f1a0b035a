r"""Learned truncation: one trainable position per layer on a method's weighted SVD (paper Sec. 6.4, Dobi-SVD).

The paper's last experiment puts GFWSVD into the Dobi-SVD pipeline (Wang et al., ICLR 2025) in
place of SVD. Dobi's training learns **one truncation position** ``gamma_l`` per layer; every
weight stays frozen. Here the position acts on the singular values of the layer's weighted SVD
(:class:`~fisherkron.core.wsvd.Decomposition`, Theorem 1 / Eq. (7)): with
``L_B^T W L_A = U S V^T``, ``P = L_B^{-T} U`` (``n x q``) and ``Q = L_A^{-T} V`` (``m x q``),

.. math::
    W_l(\gamma_l) = P \operatorname{diag}(s \odot \mu(\gamma_l)) Q^\top, \qquad
    \mu_i(\gamma) = \tfrac12 \tanh(\beta (\gamma - i)) + \tfrac12, \quad i = 0, \dots, q - 1,

(``beta = 10``), applied in factored form ``y = ((x Q) \odot (s \odot \mu)) P^T + b`` (the
``n x m`` weight is never formed, and no SVD runs inside the loop: ``P``, ``s``, ``Q`` are the
decomposition's, computed once). ``mu`` is ~1 for ``i < gamma`` and ~0 above, so at
``gamma = r - 1/2`` the layer is the rank-``r`` factorisation of Eq. (7). The soft rank
``k_l = sum_i mu_i(gamma_l)`` prices the layer at ``min(n m, k_l (n + m))`` parameters, and

.. math::
    \mathcal L(\gamma) = \ell_{LM}(\gamma) + \lambda\,|\rho(\gamma) - \rho^\ast|
      + \textstyle\sum_l [\max(0, -\gamma_l)^2 + \max(0, \gamma_l - q_l)^2],
    \qquad \rho(\gamma) = \frac{\sum_l \max(0, n_l m_l - k_l (n_l + m_l))}{N_{\text{model}}},

with ``rho`` this package's **whole-model** ratio ``1 - compressed / original`` (the fraction
removed, as :func:`fisherkron.compress` reports it) and the last term Dobi's guard that keeps
each position inside ``[0, q_l]``. After training each layer gets ``round(k_l)``, and the ranks
are adjusted greedily until the whole-model budget is met (:func:`budget_ranks`); the layers
are then replaced by ``LowRankLinear`` with the decomposition's Eq. (7) factors at those ranks
(:func:`fisherkron.compress` with ``ranks=``), a normal compressed model that
:func:`~fisherkron.hf.saving.save_compressed` writes.

**What is taken from Dobi-SVD** (github.com/wangqinsi1/Dobi-SVD, ``svd_trainer.py``,
``modules/stable_svd.py``, ``weight_updater.py``): the tanh mask and ``beta = 10``, the
penalty ``lambda |ratio - target|`` with ``lambda = 200`` (its command-line default; its
released Llama configurations use 150), the range guard, the language-model term as
**perplexity** ``exp(NLL)`` (its ``compute_loss``; ``lm_loss="nll"`` trains on the NLL), Adam at
learning rate 5 with a cosine annealed between 5 and 4 whose half-period is one epoch
(``CosineAnnealingLR(T_max=steps per epoch, eta_min=4)``), an initial position at the uniform
allocation for the target, and optionally the best snapshot instead of the last
(``keep="best"``; Dobi keeps ``best_gamma.json``). What differs: Dobi masks the singular values
of each layer's *activations* (a differentiable SVD of ``x W^T`` per sequence, positions in
units of ``min(n, m) / seq_len``) and rebuilds the weights from IPCA of the truncated
activations; here the mask acts on the weighted SVD of the weight itself, the position is in
units of rank, and the weights at the learned ranks are Eq. (7)'s factors. **The target.**
Dobi's ``target_ratio`` is the fraction **kept** (its "0.4" removes 60 %), measured over the
linear layers only, and with its remapping option (``--remapping``) a memory ratio
(``max(n, m) k`` stored values per layer instead of ``k (n + m)``), not a parameter count. Here
``ratio`` is the fraction of the whole model's parameters **removed** (embeddings included), the
reading of the paper's 20 % / 40 % rows this package takes everywhere.

Deterministic with a seed (data order; the model runs in ``eval()`` mode, no dropout), a tqdm
bar (``progress``), a checkpoint (positions, Adam state, step, data position, loss curve) every
``checkpoint_every`` steps and on Ctrl-C / SIGTERM, and a resumed run reproduces the
uninterrupted one.

**What a failed run leaves** (:mod:`fisherkron.hf.training`, shared with
:mod:`fisherkron.hf.recovery`). The run stops at the step where the loss, a gradient or a
trained position stops being finite (:class:`~fisherkron.hf.training.NonFiniteTraining` names the
step and the loss) and puts the model back as it was before the call. A checkpoint folder is
made ready before any work (the temporaries of a writer that was killed outright are removed,
an unwritable folder is a one-line error); each checkpoint is written whole, with Ctrl-C and
SIGTERM held until it is in place.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import re
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from ..core.allocation import max_profitable_rank, saving
from ..core.checks import check_int, check_positive
from ..core.conventions import FisherkronError
from ..core.methods import method as method_row
from ..core.phases import timed
from ..core.regularization import MIN_ALPHA
from ..env import sigterm_as_interrupt
from .allocation import Decompositions
from .budget import check_ratio, count_params, plan_ranks
from .calibration import CalibrationStats, default_loss, select_layers
from .calibration.keys import data_fingerprint
from .surgery import CompressionReport, compress
from .training import (batch_index, check_batches, check_finite, check_rates, config_key, load_checkpoint,
                       prepare_checkpoint, save_checkpoint, save_on_interrupt, to_device, uninterrupted)

__all__ = ["SoftTruncatedLinear", "TruncationReport", "train_truncation", "learn_truncation", "materialise",
           "budget_ranks", "soft_ratio", "budget_term", "lm_term", "DOBI", "LM_LOSSES"]

log = logging.getLogger(__name__)

#: Dobi-SVD's hyperparameters (``svd_trainer.py`` defaults; its released Llama runs use ``lam=150``,
#: 8 micro-batches of one 2,048-token sequence per step, 20 epochs of 256 WikiText-2 sequences)
DOBI = {"beta": 10.0, "lam": 200.0, "lr": 5.0, "min_lr": 4.0, "lm_loss": "perplexity", "epochs": 20}
LM_LOSSES = ("perplexity", "nll")
CODE_VERSION = "truncation-2"  # enters the checkpoint key: bump when a checkpoint's meaning changes


# ----------------------------------------------------------------------------- the soft-truncated layer

class SoftTruncatedLinear(nn.Module):
    r"""``y = ((x Q) * (s * nu(gamma))) P^T + b``: the layer ``P diag(s nu(gamma)) Q^T`` in factored form.

    ``P = L_B^{-T} U`` (``n x q``), ``s`` (``q``), ``Q = L_A^{-T} V`` (``m x q``) from a
    :class:`~fisherkron.core.wsvd.Decomposition` are frozen buffers; ``gamma`` (a scalar) is the
    only parameter. The mask is Dobi's ``mu_i = 0.5 tanh(beta (gamma - i)) + 0.5``, ``i = 0..q-1``,
    opened to all ones by the dense gate ``sigma = 0.5 tanh(beta (gamma - r_max)) + 0.5``:

    .. math::  \nu_i = \mu_i + \sigma (1 - \mu_i),

    with ``r_max`` the largest rank that saves parameters (``r (n + m) < n m``,
    :func:`~fisherkron.core.allocation.max_profitable_rank`). :func:`budget_ranks` keeps a layer
    dense once its rank passes ``r_max``, and the soft model must be the model that is
    materialised: at ``gamma = r - 1/2`` it is the rank-``r`` factorisation for ``r <= r_max`` and
    ``W`` itself (all ``q`` triplets) above, up to the mask's ``e^{-10}`` tail. Without the gate a
    position between ``r_max`` and ``q`` truncated a layer that the budget keeps dense (on SmolLM2's
    SVD, 176 of 210 layers after 32 steps: training NLL 12.0 against 4.7 for the materialised model
    at the same positions). The budget term is unchanged: :func:`soft_ratio` already counts such a
    layer as saving nothing.

    Only the triplets ``i < gamma + ceil(TAIL / beta)`` are applied while the gate is shut (Dobi
    likewise computes ``gamma + 5`` activation triplets): the rest have ``nu_i < e^{-2 TAIL} ~ 1e-20``
    and, with their derivatives, vanish against float64 round-off, so a step costs about what the
    compressed layer costs, not ``q (n + m)``; once ``gamma > r_max - TAIL / beta`` all ``q`` are.
    """

    #: ``beta (i - gamma)`` beyond which a triplet is skipped: ``mu_i <= e^{-2 TAIL}``
    TAIL = 23.0

    def __init__(self, P: torch.Tensor, s: torch.Tensor, Q: torch.Tensor, bias: torch.Tensor | None,
                 gamma: float, beta: float = 10.0, gamma_dtype: torch.dtype = torch.float32):
        super().__init__()
        self.out_features, self.q = P.shape
        self.width = math.ceil(self.TAIL / float(beta))
        self.in_features = Q.shape[0]
        self.r_max = max_profitable_rank(self.out_features, self.in_features)  # above it: materialised dense
        self.beta = float(beta)
        self.register_buffer("Pt", P.T.contiguous())  # (q, n): (L_B^{-T} U)^T
        self.register_buffer("Qt", Q.T.contiguous())  # (q, m): (L_A^{-T} V)^T
        self.register_buffer("s", s.to(gamma_dtype))  # (q,)
        self.register_buffer("index", torch.arange(self.q, dtype=gamma_dtype, device=s.device))  # (q,): i
        self.bias = bias  # the original layer's (frozen) bias, not a parameter of this module
        self.gamma = nn.Parameter(torch.tensor(float(gamma), dtype=gamma_dtype, device=s.device))

    def mask(self) -> torch.Tensor:
        """``mu(gamma)`` (``q``): ~1 below the position, ~0 above."""
        return 0.5 * torch.tanh(self.beta * (self.gamma - self.index)) + 0.5

    def dense_gate(self) -> torch.Tensor:
        """``sigma(gamma)``: ~0 while the position's rank saves parameters, ~1 once :func:`budget_ranks`
        would keep the layer dense (``round(k) > r_max``, i.e. ``gamma > r_max``)."""
        return 0.5 * torch.tanh(self.beta * (self.gamma - self.r_max)) + 0.5

    def effective_mask(self) -> torch.Tensor:
        """``nu(gamma) = mu + sigma (1 - mu)`` (``q``): the mask the forward applies."""
        mu = self.mask()
        return mu + self.dense_gate() * (1.0 - mu)

    def soft_rank(self) -> torch.Tensor:
        """``k = sum_i mu_i(gamma)`` (``= r`` at ``gamma = r - 1/2``, up to ``e^{-10}``): the rank the
        budget counts (the gate does not enter it; above ``r_max`` the layer saves nothing either way)."""
        return self.mask().sum()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., m) -> (..., n)
        g = float(self.gamma.detach())
        if self.beta * (g - self.r_max) > -self.TAIL:  # the dense gate is open: every triplet matters
            k = self.q
        else:
            k = min(self.q, max(1, math.floor(g) + self.width + 1))  # triplets that matter
        h = F.linear(x, self.Qt[:k])  # (..., k): x Q_{:k}
        h = h * (self.s[:k] * self.effective_mask()[:k]).to(h.dtype)  # (..., k)
        return F.linear(h, self.Pt[:k].T, self.bias)  # (..., n)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, q={self.q}, beta={self.beta:g}"


def soft_ratio(soft: Mapping[str, SoftTruncatedLinear], total: int) -> torch.Tensor:
    r"""``rho(gamma) = sum_l max(0, n_l m_l - k_l (n_l + m_l)) / total`` (differentiable; float64)."""
    removed = sum(torch.relu(mod.out_features * mod.in_features - mod.soft_rank().double()
                             * (mod.out_features + mod.in_features)) for mod in soft.values())
    return removed / total


def budget_term(soft: Mapping[str, SoftTruncatedLinear], total: int, ratio: float,
                lam: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(lam |rho(gamma) - ratio| + guard, rho, lam |rho - ratio|)``; the guard is Dobi's range penalty
    ``sum_l max(0, -gamma_l)^2 + max(0, gamma_l - q_l)^2``."""
    rho = soft_ratio(soft, total)
    penalty = lam * torch.abs(rho - ratio)
    guard = sum(torch.relu(-mod.gamma.double()) ** 2 + torch.relu(mod.gamma.double() - mod.q) ** 2
                for mod in soft.values())
    return penalty + guard, rho, penalty


def lm_term(model: nn.Module, batch: Mapping, lm_loss: str = "perplexity", loss_fn=None) -> torch.Tensor:
    """The language-model term of one batch: ``exp(NLL)`` (``"perplexity"``, Dobi's) or the ``NLL``."""
    nll = (loss_fn or default_loss)(model, batch)
    return torch.exp(nll) if lm_loss == "perplexity" else nll


# ----------------------------------------------------------------------------- ranks under the budget

def budget_ranks(soft_ranks: Mapping[str, float], shapes: Mapping[str, tuple[int, int]], need: int) -> dict:
    """Integer ranks near the learned soft ranks that remove at least ``need`` parameters, tightly.

    Each layer starts at ``round(k_l)`` (in ``1..q``; above :func:`max_profitable_rank` it is kept
    dense, ``None``). While fewer than ``need`` parameters are removed, the rank furthest above its
    soft rank (``r - k`` largest) drops by one; then, while some layer can take one rank more and
    the budget still holds, the one furthest below its soft rank gains it. The result removes
    ``>= need`` and no single rank can be added without breaking the budget (the ratio is met as
    :func:`~fisherkron.hf.budget.plan_ranks` meets it: at least the target, by less than one step).

    >>> budget_ranks({"a": 2.4, "b": 1.2}, {"a": (8, 6), "b": (6, 8)}, need=40)  # 48 - 14 r removed each
    {'a': 3, 'b': 1}
    """
    need = int(need)
    bad = [n for n, k in soft_ranks.items() if not math.isfinite(float(k))]
    if bad:
        raise FisherkronError(f"the soft rank of {bad[0]} is {float(soft_ranks[bad[0]])} ({len(bad)} of "
                              f"{len(soft_ranks)} layers not finite); train the positions again with a lower "
                              f"learning rate")
    rmax = {n: max_profitable_rank(*shapes[n]) for n in soft_ranks}
    rank = {}
    for n, k in soft_ranks.items():
        r = min(max(1, int(round(float(k)))), min(shapes[n]))
        rank[n] = min(r, rmax[n] + 1)  # rmax + 1 stands for "dense"

    def save(n, r):
        return saving(*shapes[n], r) if r <= rmax[n] else 0

    removed = sum(save(n, r) for n, r in rank.items())
    most = sum(save(n, 1) for n in rank if rmax[n] >= 1)
    if most < need:
        raise FisherkronError(f"the budget of {need:,} parameters is out of reach: every layer at rank 1 removes "
                              f"{most:,}; select more layers or lower the ratio")
    order = {n: i for i, n in enumerate(soft_ranks)}
    while removed < need:
        cand = [n for n, r in rank.items() if r > 1 and rmax[n] >= 1]
        n = max(cand, key=lambda n: (rank[n] - float(soft_ranks[n]), sum(shapes[n]), -order[n]))
        removed += save(n, rank[n] - 1) - save(n, rank[n])
        rank[n] -= 1
    while True:
        cand = [n for n, r in rank.items() if r <= rmax[n] and removed - (save(n, r) - save(n, r + 1)) >= need]
        if not cand:
            break
        n = max(cand, key=lambda n: (float(soft_ranks[n]) - rank[n], -sum(shapes[n]), -order[n]))
        removed -= save(n, rank[n]) - save(n, rank[n] + 1)
        rank[n] += 1
    return {n: (r if r <= rmax[n] else None) for n, r in rank.items()}


# ----------------------------------------------------------------------------- the report

@dataclass
class TruncationReport:
    """Learned positions, soft and budgeted ranks, the loss curve, and (after :func:`materialise`) the compression.

    ``history`` holds one record per optimiser step: ``loss`` (total), ``lm`` (mean language-model
    term over the step's micro-batches), ``ratio`` (soft whole-model ratio before the update),
    ``penalty`` (``lambda |ratio - target|``) and ``lr``.
    """

    method: str
    target_ratio: float
    total_params: int
    need: int
    shapes: dict[str, tuple[int, int]]
    init_ranks: dict[str, int | None]
    gammas: dict[str, float]
    soft_ranks: dict[str, float]
    ranks: dict[str, int | None]
    history: list[dict] = field(default_factory=list)
    steps: int = 0
    seconds: float = 0.0
    resumed_at: int | None = None
    config: dict = field(default_factory=dict)
    compression: CompressionReport | None = None

    @property
    def removed(self) -> int:
        """Parameters the budgeted ranks remove."""
        return sum(saving(*self.shapes[n], r) for n, r in self.ranks.items())

    @property
    def ratio(self) -> float:
        """Whole-model ratio the budgeted ranks reach (``>= target_ratio``)."""
        return self.removed / self.total_params

    @property
    def losses(self) -> list[float]:
        """The loss curve: total loss per step."""
        return [h["loss"] for h in self.history]

    def to_dict(self) -> dict:
        d = asdict(self)
        d["compression"] = self.compression.to_dict() if self.compression is not None else None
        d["ratio"], d["removed"] = self.ratio, self.removed
        return d


# ----------------------------------------------------------------------------- training

def _names(model: nn.Module, layers, stats: CalibrationStats | None) -> list[str]:
    names = list(stats.layers) if layers is None and stats is not None else select_layers(model, layers)
    mods = dict(model.named_modules())
    bad = [n for n in names if not isinstance(mods.get(n), nn.Linear)]
    if bad:
        raise FisherkronError(f"layer {bad[0]} is not a dense nn.Linear of this model (compressed already?); "
                              f"learned truncation starts from the dense model")
    return names


def _init_ranks(model, names, ratio, init) -> dict:
    if isinstance(init, str):
        if init != "uniform":
            raise FisherkronError(f"init must be 'uniform', a dict of ranks or an Allocation; got {init!r}")
        return plan_ranks(model, names, ratio=ratio)
    ranks = dict(getattr(init, "ranks", init))
    if set(ranks) != set(names):
        raise FisherkronError(f"init gives ranks for {len(ranks)} layers, {len(names)} are selected")
    return ranks


def _check_options(accumulate, checkpoint_every, beta, lam, lr, min_lr, lm_loss, keep) -> None:
    """The options of :func:`train_truncation` it refuses before any work (one-line errors)."""
    check_int(accumulate, "accumulate", minimum=1)
    check_int(checkpoint_every, "checkpoint_every", minimum=1)
    for value, name in ((beta, "beta"), (lam, "lam")):
        check_positive(value, name)
    check_rates(lr, min_lr)
    if lm_loss not in LM_LOSSES:
        raise FisherkronError(f"lm_loss must be one of {', '.join(LM_LOSSES)}; got {lm_loss!r}")
    if keep not in ("final", "best"):
        raise FisherkronError(f"keep must be 'final' or 'best'; got {keep!r}")


def _soft_layers(mods: Mapping[str, nn.Module], decs: Mapping, init_ranks: Mapping[str, int | None],
                 beta: float) -> dict[str, SoftTruncatedLinear]:
    """Each layer of ``decs`` as a :class:`SoftTruncatedLinear` on its decomposition, at ``gamma = r_0 - 1/2``
    (``r_0`` its initial rank, ``None``: ``q``); the positions are float64 for a float64 layer, else float32."""
    soft: dict[str, SoftTruncatedLinear] = {}
    for n, dec in decs.items():
        lin = mods[n]
        W = lin.weight
        gdt = torch.float64 if W.dtype == torch.float64 else torch.float32
        r0 = init_ranks[n] if init_ranks[n] is not None else min(lin.out_features, lin.in_features)
        soft[n] = SoftTruncatedLinear(dec.P.to(W.device, W.dtype), dec.S.to(W.device), dec.Q.to(W.device, W.dtype),
                                      lin.bias.detach() if lin.bias is not None else None, r0 - 0.5, beta, gdt)
    return soft


def _gradients(model: nn.Module, soft: Mapping[str, SoftTruncatedLinear], batches: list, step: int, config: dict,
               lr_t: float, loss_fn, dev, advice: str) -> dict:
    """Accumulate the gradients of one step's loss in the positions: the language-model term of each
    micro-batch, then the budget term. Returns the step's record; a loss that is not finite stops the run
    before its backward (:func:`~fisherkron.hf.training.check_finite`)."""
    accumulate, total_steps, what = config["accumulate"], config["steps"], "learned truncation"
    lm = 0.0
    for a in range(accumulate):
        b = batches[batch_index(step * accumulate + a, len(batches), config["seed"])]
        term = lm_term(model, to_device(b, dev), config["lm_loss"], loss_fn)
        value = float(term.detach())
        check_finite(what, step, total_steps, value, advice=advice)  # before its backward
        (term / accumulate).backward()
        lm += value / accumulate
    budget, rho, penalty = budget_term(soft, config["total"], config["ratio"], config["lam"])
    budget.backward()
    return {"step": step, "loss": lm + float(penalty.detach()), "lm": lm, "ratio": float(rho.detach()),
            "penalty": float(penalty.detach()), "lr": lr_t}


def _train(model: nn.Module, soft: dict[str, SoftTruncatedLinear], batches: list, config: dict, key: str,
           state: dict | None, path: Path | None, *, checkpoint_every: int, loss_fn, callback,
           progress: bool) -> tuple[int, list, float, dict | None, int | None]:
    """The training loop of :func:`train_truncation` on the layers ``soft`` (swapped into ``model`` for the
    run and put back), with the hyperparameters of ``config`` (what the checkpoint key hashes), resumed from
    ``state``. Returns ``(steps, history, seconds, best, resumed_at)``."""
    names = list(soft)
    total_steps, accumulate, keep = config["steps"], config["accumulate"], config["keep"]
    lr, min_lr, period = config["lr"], config["min_lr"], config["period"]
    dense = {n: model.get_submodule(n) for n in names}
    opt = torch.optim.Adam([soft[n].gamma for n in names], lr=lr)
    step, history, seconds, best, resumed_at = 0, [], 0.0, None, None
    if state is not None:
        with torch.no_grad():
            for n in names:
                soft[n].gamma.copy_(state["gammas"][n])
        opt.load_state_dict(state["optimizer"])
        step, history, seconds, best = state["step"], state["history"], state["seconds"], state["best"]
        resumed_at = step
        log.info("learned truncation: resuming %s at step %d of %d", path, step, total_steps)

    def snapshot() -> dict:
        return {"key": key, "gammas": {n: soft[n].gamma.detach().clone() for n in names},
                "optimizer": opt.state_dict(), "step": step, "micro_batch": step * accumulate,
                "history": history, "seconds": seconds, "best": best}

    dev = next(iter(soft.values())).Pt.device
    modes = [(m, m.training) for m in model.modules()]  # each module's own mode, put back after eval()
    grads = {name: p.requires_grad for name, p in model.named_parameters()}
    gammas = {f"the position of {n}": soft[n].gamma for n in names}
    advice = (f"Lower the learning rate (lr={lr:g}, min_lr={min_lr:g}), train on lm_loss='nll' (exp(NLL) overflows "
              f"where the NLL passes ~88 in float32), use float32 or bfloat16 rather than float16, or check loss_fn")
    what = "learned truncation"
    t0 = time.perf_counter()
    bar = tqdm(total=total_steps, initial=step, desc=f"learned truncation ({config['method']})", disable=not progress)
    with sigterm_as_interrupt():
        try:
            model.eval()
            model.requires_grad_(False)
            for n in names:
                model.set_submodule(n, soft[n])
            while step < total_steps:
                lr_t = min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * step / period))
                for group in opt.param_groups:
                    group["lr"] = lr_t
                opt.zero_grad(set_to_none=True)
                record = _gradients(model, soft, batches, step, config, lr_t, loss_fn, dev, advice)
                check_finite(what, step, total_steps, record["loss"], {n: g.grad for n, g in gammas.items()},
                             advice=advice)
                with uninterrupted():
                    if keep == "best" and (best is None or record["loss"] < best["loss"]):
                        best = {"loss": record["loss"], "step": step,
                                "gammas": {n: soft[n].gamma.detach().clone() for n in names}}
                    opt.step()
                    check_finite(what, step, total_steps, record["loss"], gammas, kind="parameter", advice=advice)
                    history.append(record)
                    step += 1
                bar.update(1)
                bar.set_postfix(loss=f"{record['loss']:.4g}", ratio=f"{record['ratio']:.4f}")
                if path is not None and (step % checkpoint_every == 0 or step == total_steps):
                    seconds_now = seconds + time.perf_counter() - t0
                    save_checkpoint(path, {**snapshot(), "seconds": seconds_now})
                if callback is not None:
                    callback(step, record)
        except KeyboardInterrupt:
            save_on_interrupt(path, lambda: {**snapshot(), "seconds": seconds + time.perf_counter() - t0}, what,
                              step, total_steps)
            raise
        finally:
            with uninterrupted():  # the dense layers back whole, whatever arrives meanwhile
                bar.close()
                for n in names:
                    if model.get_submodule(n) is soft[n]:
                        model.set_submodule(n, dense[n])
                for name, p in model.named_parameters():
                    p.requires_grad_(grads.get(name, p.requires_grad))
                for m, mode in modes:
                    m.training = mode
    seconds += time.perf_counter() - t0
    return step, history, seconds, best, resumed_at


@timed("learned truncation")
def train_truncation(model: nn.Module, method: str, stats: CalibrationStats | None, batches, *, ratio: float,
                     layers=None, init="uniform", decompositions: Decompositions | None = None,
                     epochs: int = 1, steps: int | None = None, accumulate: int = 1, lr: float = DOBI["lr"],
                     min_lr: float = DOBI["min_lr"], period: int | None = None, beta: float = DOBI["beta"],
                     lam: float = DOBI["lam"], lm_loss: str = DOBI["lm_loss"], keep: str = "final", seed: int = 0,
                     checkpoint=None, checkpoint_every: int = 50, loss_fn=None, callback=None,
                     regularization: str = "diag", alpha: float | None = None, min_alpha: float = MIN_ALPHA,
                     asvd_alpha: float = 0.5, mff_options: dict | None = None, device=None,
                     progress: bool = False) -> TruncationReport:
    r"""Learn one truncation position per layer; the model's weights are not changed (see the module docstring).

    Minimises ``l_LM(gamma) + lam |rho(gamma) - ratio|`` (+ the range guard) over the positions
    ``gamma_l`` with Adam, every other parameter frozen; then rounds and budgets the ranks
    (:func:`budget_ranks`). :func:`learn_truncation` also materialises them.

    Args:
        model: the dense model (left as it was: its layers are swapped for
            :class:`SoftTruncatedLinear` during training and put back).
        method: a key of :data:`fisherkron.METHODS` (``svd``, ``svd_llm``, ``kfac_svd``, ``gfwsvd``, ...).
        stats: its calibration statistics (``None`` for ``svd``).
        batches: training batches (dicts of tensors with ``labels``, e.g. :func:`~fisherkron.hf.data.lm_batches`
            of C4 documents; never the evaluation text, see :func:`fisherkron.hf.recovery.check_disjoint`).
        ratio: target whole-model ratio ``1 - compressed / original`` (fraction removed).
        layers: patterns of the layers to truncate (default: the layers of ``stats``, or the paper's).
        init: initial ranks: ``"uniform"`` (:func:`~fisherkron.hf.budget.plan_ranks` for ``ratio``),
            ``{name: rank or None}`` or an :class:`~fisherkron.hf.allocation.Allocation`;
            ``gamma_l = r_l - 1/2`` (``None``: ``q_l - 1/2``).
        decompositions: a :class:`~fisherkron.hf.allocation.Decompositions` shared with the
            compression that follows (one weighted SVD per layer).
        epochs, steps: length: ``steps`` optimiser steps, or ``epochs`` passes over ``batches``.
        accumulate: micro-batches per optimiser step.
        lr, min_lr, period: Adam's learning rate ``min_lr + (lr - min_lr) (1 + cos(pi t / period)) / 2``
            at step ``t`` (Dobi's annealing; ``period`` default: the steps of one epoch).
        beta: the mask's steepness. lam: the budget penalty's weight.
        lm_loss: ``"perplexity"`` (``exp(NLL)``, Dobi's) or ``"nll"``.
        keep: ``"final"`` positions, or ``"best"``: those of the step with the lowest total loss.
        seed: data order (each epoch a seeded permutation of ``batches``).
        checkpoint: a file for the training state; an existing one of the same run is resumed.
        checkpoint_every: steps between checkpoints (also written on Ctrl-C / SIGTERM).
        loss_fn: ``loss_fn(model, batch) -> NLL`` (default ``model(**batch).loss``); not in the
            checkpoint's key.
        callback: ``callback(step, record)`` after every step (logging; raising stops the run).
        regularization, alpha, min_alpha, asvd_alpha, mff_options, device: as for
            :func:`fisherkron.compress` (the factorisation trained on is the one materialised).
        progress: tqdm bar.
    """
    method_row(method)
    ratio = check_ratio(ratio)
    batches = check_batches(batches)
    _check_options(accumulate, checkpoint_every, beta, lam, lr, min_lr, lm_loss, keep)
    per_epoch = math.ceil(len(batches) / accumulate)
    total_steps = check_int(steps, "steps", minimum=1) if steps is not None else \
        check_int(epochs, "epochs", minimum=1) * per_epoch
    period = check_int(period, "period", minimum=1) if period is not None else per_epoch
    decompositions = decompositions if decompositions is not None else Decompositions()
    names = _names(model, layers, stats)
    if stats is not None:  # statistics of another model would train positions for a wrong factorisation
        stats.check_model(model)
    mods = dict(model.named_modules())
    shapes = {n: (mods[n].out_features, mods[n].in_features) for n in names}
    total = count_params(model)
    need = math.ceil(ratio * total)
    init_ranks = _init_ranks(model, names, ratio, init)
    path = Path(checkpoint) if checkpoint is not None else None
    prepare_checkpoint(path)  # before the weighted SVDs: an unwritable folder fails now
    decs = {n: decompositions.get(mods[n], method, stats, n, mff_options=mff_options, alpha=alpha,
                                  min_alpha=min_alpha, regularization=regularization, asvd_alpha=asvd_alpha,
                                  device=device)[0]
            for n in tqdm(names, desc=f"decompose ({method})", disable=not progress)}
    config = {"code": CODE_VERSION, "method": method, "ratio": ratio, "layers": names, "shapes": shapes,
              "init": init_ranks, "steps": total_steps, "accumulate": accumulate, "lr": lr, "min_lr": min_lr,
              "period": period, "beta": beta, "lam": lam, "lm_loss": lm_loss, "keep": keep, "seed": seed,
              "total": total, "data": data_fingerprint(batches),
              "spectra": hashlib.blake2b(b"".join(decs[n].S.double().cpu().numpy().tobytes() for n in names),
                                         digest_size=16).hexdigest(),
              "options": json.dumps({"regularization": regularization, "alpha": alpha, "min_alpha": min_alpha,
                                     "asvd_alpha": asvd_alpha, "mff_options": repr(mff_options)}, default=str)}
    key = config_key(config)
    state = load_checkpoint(path, key, "learned-truncation")
    soft = _soft_layers(mods, decs, init_ranks, beta)
    step, history, seconds, best, resumed_at = _train(model, soft, batches, config, key, state, path,
                                                      checkpoint_every=checkpoint_every, loss_fn=loss_fn,
                                                      callback=callback, progress=progress)
    chosen = best["gammas"] if keep == "best" and best is not None else {n: soft[n].gamma.detach() for n in names}
    with torch.no_grad():
        for n in names:
            soft[n].gamma.copy_(chosen[n])
    soft_ranks = {n: float(soft[n].soft_rank().detach()) for n in names}
    report = TruncationReport(method, ratio, total, need, shapes, init_ranks,
                              {n: float(soft[n].gamma.detach()) for n in names}, soft_ranks,
                              budget_ranks(soft_ranks, shapes, need), history, step, seconds, resumed_at, config)
    log.info("learned truncation (%s): %d steps, soft ratio %.4f, budgeted ratio %.4f (target %.4f)", method,
             step, history[-1]["ratio"] if history else float("nan"), report.ratio, ratio)
    return report


def materialise(model: nn.Module, report: TruncationReport, stats: CalibrationStats | None, *,
                decompositions: Decompositions | None = None, regularization: str = "diag",
                alpha: float | None = None, min_alpha: float = MIN_ALPHA, asvd_alpha: float = 0.5,
                mff_options: dict | None = None, progress: bool = False) -> CompressionReport:
    """Replace each truncated layer (in place) by ``LowRankLinear`` with Eq. (7)'s factors at its budgeted rank.

    :func:`fisherkron.compress` with ``ranks=report.ranks`` (``None``: kept dense); the
    factorisation options must be those of the training (pass the same ``decompositions`` to
    reuse its weighted SVDs). The result is stored in ``report.compression`` and returned.
    """
    layers = [re.escape(n) for n in report.ranks]
    out = compress(model, report.method, stats, layers=layers, ranks=dict(report.ranks), regularization=regularization,
                   alpha=alpha, min_alpha=min_alpha, asvd_alpha=asvd_alpha, mff_options=mff_options,
                   decompositions=decompositions, progress=progress)
    if out.params_before != report.total_params or out.params_before - out.params_after != report.removed:
        raise FisherkronError(f"the compressed model removes {out.params_before - out.params_after:,} of "
                              f"{out.params_before:,} parameters, the budget {report.removed:,} of "
                              f"{report.total_params:,}: the model changed since the training")
    out.target_ratio = report.target_ratio
    report.compression = out
    return out


def learn_truncation(model: nn.Module, method: str, stats: CalibrationStats | None, batches, *, ratio: float,
                     decompositions: Decompositions | None = None, **kwargs) -> TruncationReport:
    """:func:`train_truncation`, then :func:`materialise`: ``model`` is compressed in place at the learned ranks.

    Keyword arguments are :func:`train_truncation`'s. Returns its report with ``compression``
    (the :class:`~fisherkron.CompressionReport`; ``report.compression.ratio`` is the ratio
    reached, at least ``ratio``).

    Example (a dense model, its C4 calibration batches and statistics):
        >>> report = learn_truncation(model, "gfwsvd", stats, batches, ratio=0.2,
        ...                           checkpoint="runs/dobi-gfwsvd.pt")  # doctest: +SKIP
        >>> save_compressed(model, "out/dobi-gfwsvd", report=report.compression)  # doctest: +SKIP
    """
    decompositions = decompositions if decompositions is not None else Decompositions()
    report = train_truncation(model, method, stats, batches, ratio=ratio, decompositions=decompositions, **kwargs)
    options = {k: kwargs[k] for k in ("regularization", "alpha", "min_alpha", "asvd_alpha", "mff_options")
               if k in kwargs}
    materialise(model, report, stats, decompositions=decompositions, progress=kwargs.get("progress", False),
                **options)
    return report
