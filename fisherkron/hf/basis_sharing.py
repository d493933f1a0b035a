r"""Basis Sharing on a Hugging Face decoder (Wang et al. 2024; a baseline of the paper's Sec. 6.3 tables).

What the authors' code (TUDa-HWAI/Basis_Sharing) does, in our conventions (see
:mod:`fisherkron.core.basis_sharing` for the factorisation of one group):

* consecutive decoder blocks form groups of ``group_size = 2`` (``[0, 1], [2, 3], ...``; a last,
  smaller group when the count is odd);
* some projection types share one basis per group: ``q, k, v, up, gate`` in their multi-head
  configs, only ``q, up, gate`` in their grouped-query (GQA) configs; the others (``o, down``;
  with GQA also ``k, v``) stay per layer, i.e. plain SVD-LLM;
* a shared group is whitened by the Cholesky factor of its layers' *summed* Gram matrices
  ``sum_j X_j X_j^T`` (our :meth:`CalibrationStats.xxt`);
* a type's rank is ``floor(m n g (1 - rho) / (m + n g))`` (``g = 1`` when private), where ``rho``
  is a ratio of the linear weights. We aim ``rho`` at the *whole-model* ratio
  ``1 - compressed / original`` (:func:`fisherkron.count_params`, the paper's definition) by
  bisection, counting each shared basis once; embeddings stay as they are (tied stays tied)
  and ``lm_head`` is never compressed.

One choice of ours: a last, smaller group (odd block count) gets the rank of the formula with its
own size ``g``, so that every group keeps at most ``(1 - rho)`` of its weights; the authors use the
full groups' rank there (their shipped configs have an even block count, where this never arises).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from torch import nn
from tqdm.auto import tqdm

from ..core.basis_sharing import SharedBasisLinear, shared_basis, shared_basis_params, shared_basis_rank
from ..core.checks import check_int, check_positive
from ..core.conventions import FisherkronError
from ..core.phases import timed
from ..core.regularization import MIN_ALPHA
from .calibration import CalibrationStats
from .budget import RatioReport, count_params

__all__ = ["compress_basis_sharing", "plan_basis_sharing", "BasisSharingPlan", "BasisSharingReport", "GroupPlan",
           "PROJECTIONS", "SHARED_MHA", "SHARED_GQA", "shared_types", "decoder_projections"]

log = logging.getLogger(__name__)

#: the projection types of a Llama-like decoder block, by the authors' short names
PROJECTIONS = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj",
               "o": "self_attn.o_proj", "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}
#: the shared types of the authors' multi-head configs (Llama-2, OPT) ...
SHARED_MHA = ("q", "k", "v", "up", "gate")
#: ... and of their grouped-query configs (Mistral): ``k`` and ``v`` are small and stay per layer
SHARED_GQA = ("q", "up", "gate")
_BLOCKS = "model.layers"


def decoder_projections(model: nn.Module) -> dict[str, list[str]]:
    """``{type: [name of that projection in block 0, 1, ...]}``; a one-line error names what is missing."""
    looked = (f"looked for {_BLOCKS}.{{i}}.self_attn.{{q,k,v,o}}_proj and {_BLOCKS}.{{i}}.mlp.{{gate,up,down}}_proj "
              f"as nn.Linear")
    blocks = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(blocks, nn.ModuleList) or len(blocks) == 0:
        raise FisherkronError(f"basis sharing needs a Llama-like decoder with blocks {_BLOCKS}: "
                              f"{type(model).__name__} has none ({looked})")
    mods = dict(model.named_modules())
    out = {t: [f"{_BLOCKS}.{i}.{p}" for i in range(len(blocks))] for t, p in PROJECTIONS.items()}
    for names in out.values():
        for name in names:
            if type(mods.get(name)) is not nn.Linear:
                what = "is missing" if name not in mods else f"is a {type(mods[name]).__name__} (already compressed?)"
                raise FisherkronError(f"basis sharing cannot use {type(model).__name__}: {name} {what} ({looked})")
    return out


def shared_types(model: nn.Module) -> tuple[str, ...]:
    """The authors' choice: ``SHARED_GQA`` when ``num_key_value_heads < num_attention_heads``, else ``SHARED_MHA``."""
    cfg = getattr(model, "config", None)
    heads = getattr(cfg, "num_attention_heads", None)
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    return SHARED_GQA if heads is not None and kv < heads else SHARED_MHA


@dataclass
class GroupPlan:
    """One group: a projection type, its layers (block order = stacking order), their shapes and the rank."""

    type: str
    names: list[str]
    ns: list[int]
    m: int
    bias: bool
    rank: int
    alpha: float | None = None

    @property
    def dense_params(self) -> int:
        return sum(self.ns) * self.m + (sum(self.ns) if self.bias else 0)

    @property
    def params(self) -> int:
        """``r m`` (the basis, once) ``+ r sum_j n_j`` (+ biases)."""
        return shared_basis_params(self.ns, self.m, self.rank, self.bias)


@dataclass
class BasisSharingPlan(RatioReport):
    """Groups and ranks at ``rho``, with the whole-model and linear-layer parameter counts they give (each shared
    basis counted once)."""

    rho: float
    group_size: int
    shared: tuple[str, ...]
    groups: list[GroupPlan]
    params_before: int
    layer_params_before: int

    @property
    def layer_params_after(self) -> int:
        return sum(g.params for g in self.groups)

    @property
    def params_after(self) -> int:
        return self.params_before - self.layer_params_before + self.layer_params_after

    @property
    def ranks(self) -> dict[str, int]:
        """Rank of each projection type in its full-size groups (a smaller last group may differ)."""
        out: dict[str, int] = {}
        for g in self.groups:
            if g.type not in out or len(g.names) == (self.group_size if g.type in self.shared else 1):
                out[g.type] = g.rank
        return out


def _groups(num_blocks: int, size: int) -> list[list[int]]:
    """``[[0, .., size-1], [size, ..], ..]`` and a last, smaller group for the remainder."""
    return [list(range(i, min(i + size, num_blocks))) for i in range(0, num_blocks, size)]


def plan_basis_sharing(model: nn.Module, *, ratio: float | None = None, rho: float | None = None,
                       group_size: int = 2, shared=None) -> BasisSharingPlan:
    r"""Groups and ranks of Basis Sharing, from shapes alone: at a given ``rho``, or at the smallest ``rho``
    whose whole-model ratio ``1 - params_after / params_before`` reaches ``ratio`` (bisection).

    Each group of ``g`` layers ``n x m`` gets ``r = floor(m n g (1 - rho) / (m + n g))``
    (:func:`~fisherkron.core.basis_sharing.shared_basis_rank`, ``n g = sum_j n_j``) and stores
    ``r m + r n g`` weights. ``shared``: the types that share (default :func:`shared_types`).
    """
    if (ratio is None) == (rho is None):
        raise FisherkronError("give exactly one of ratio= (whole-model) or rho= (of the linear weights)")
    group_size = check_int(group_size, "group_size", minimum=1)
    projections = decoder_projections(model)
    if shared is None:
        shared = shared_types(model)
    elif isinstance(shared, str) or not all(isinstance(t, str) for t in shared):
        raise FisherkronError(f"shared must be a collection of projection types from {', '.join(PROJECTIONS)}, "
                              f"got {shared!r}")
    bad = [t for t in shared if t not in PROJECTIONS]
    if bad:
        raise FisherkronError(f"shared names {bad[0]!r}, not a projection type; use some of {', '.join(PROJECTIONS)}")
    shared = tuple(t for t in PROJECTIONS if t in set(shared))
    mods = dict(model.named_modules())
    num_blocks = len(projections["q"])
    layout = []  # (type, names, ns, m, bias)
    for t, names in projections.items():
        for idx in _groups(num_blocks, group_size if t in shared else 1):
            lins = [mods[names[i]] for i in idx]
            ms = {lin.in_features for lin in lins}
            biases = {lin.bias is not None for lin in lins}
            if len(ms) != 1 or len(biases) != 1:
                raise FisherkronError(f"the {t} projections of blocks {idx} differ in input size or bias; "
                                      f"they cannot share a basis (pass shared= without {t!r})")
            layout.append((t, [names[i] for i in idx], [lin.out_features for lin in lins], ms.pop(), biases.pop()))
    before = count_params(model)
    layer_before = sum(sum(ns) * m + (sum(ns) if b else 0) for _, _, ns, m, b in layout)

    def plan(r: float) -> BasisSharingPlan:
        groups = [GroupPlan(t, names, ns, m, b, min(sum(ns), m, shared_basis_rank(sum(ns), m, r)))
                  for t, names, ns, m, b in layout]  # n g = sum_j n_j
        return BasisSharingPlan(r, group_size, shared, groups, before, layer_before)

    if rho is not None:
        return plan(check_positive(rho, "rho", below=1.0, zero_ok=True))
    ratio = check_positive(ratio, "ratio", below=1.0)
    need = ratio * before
    top = 1.0 - 1e-12
    best = plan(top)
    if before - best.params_after < need:
        raise FisherkronError(f"ratio {ratio:.3f} is out of reach: basis sharing of the {len(layout)} groups at "
                              f"rank 1 removes at most {best.ratio:.3f} of the model's parameters")
    lo, hi = 0.0, top
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        lo, hi = (lo, mid) if before - plan(mid).params_after >= need else (mid, hi)
    return plan(hi)


@dataclass
class BasisSharingReport(RatioReport):
    """What :func:`compress_basis_sharing` did: ``rho``, ranks, groups and parameter counts (shared bases once)."""

    method: str
    target_ratio: float
    rho: float
    group_size: int
    shared: tuple[str, ...]
    ranks: dict[str, int]
    params_before: int
    params_after: int
    layer_params_before: int
    layer_params_after: int
    groups: list[dict] = field(default_factory=list)
    seconds: float = 0.0


    def __str__(self) -> str:
        alphas = [g["alpha"] for g in self.groups if g.get("alpha") is not None]
        s = (f"basis_sharing (groups of {self.group_size}, shared {','.join(self.shared) or 'none'}; rho "
             f"{self.rho:.4f}, ranks {self.ranks}): model {self.params_before:,} -> {self.params_after:,} params "
             f"(ratio {self.ratio:.2%}); layers {self.layer_params_before:,} -> {self.layer_params_after:,} "
             f"(ratio {self.layers_ratio:.2%})")
        if alphas:
            s += f"; alpha max {max(alphas):.3g}"
        return s


@timed("compression")
def compress_basis_sharing(model: nn.Module, stats: CalibrationStats, ratio: float, *, group_size: int = 2, shared=None,
                  alpha: float | None = None, regularization: str = "diag", min_alpha: float = MIN_ALPHA,
                  progress: bool = False) -> BasisSharingReport:
    r"""Compress a Llama-like decoder in place by Basis Sharing at a whole-model ``ratio``.

    For every group (:func:`plan_basis_sharing`): ``W_s S = U Sigma V^T`` with ``W_s`` the stacked
    weights and ``S S^T = sum_j X_j X_j^T``; the blocks become :class:`SharedBasisLinear` layers
    ``y = W_{2,j} (W_1 x) + b_j`` that hold one ``W_1 = Sigma_r^{1/2} V_r^T S^{-1}`` (shared, the same
    module object) and their own ``W_{2,j} = U_{j,r} Sigma_r^{1/2}``
    (:func:`~fisherkron.core.basis_sharing.shared_basis`).

    Args:
        model: a ``*ForCausalLM`` with blocks ``model.layers.{i}`` (Llama, Mistral, Qwen2, SmolLM2, ...);
            changed in place once every group is factorised (on an error it is left as it was).
        stats: calibration statistics with ``xxt`` of all seven projections of every block,
            collected on this model (every parameter and buffer; refused in one line otherwise).
        ratio: target whole-model ratio ``1 - compressed / original`` in ``(0, 1)``.
        group_size: blocks per group (the authors': 2).
        shared: the projection types that share a basis (default: ``q, up, gate`` for a GQA model,
            ``q, k, v, up, gate`` otherwise); the others are per layer (SVD-LLM).
        alpha, regularization, min_alpha: the regularisation of each summed Gram matrix, as for
            :func:`fisherkron.svd_llm` (default: the same floor ``MIN_ALPHA``).
        progress: tqdm bar over groups.

    Returns:
        :class:`BasisSharingReport`: ``rho``, ranks per type, every group (layers, rank, ``alpha``),
        parameters before and after, the whole-model ``ratio`` and the ``layers_ratio``.
    """
    t0 = time.perf_counter()
    plan = plan_basis_sharing(model, ratio=ratio, group_size=group_size, shared=shared)
    if stats is None:
        raise FisherkronError("basis sharing needs calibration statistics with 'xxt': "
                              "pass stats=collect_calibration(..., stats=('xxt',))")
    stats._need("xxt")
    mods = dict(model.named_modules())
    names = [n for g in plan.groups for n in g.names]
    missing = [n for n in names if n not in stats.layers]
    if missing:
        raise FisherkronError(f"layer {missing[0]} has no calibration statistics ({len(missing)} of {len(names)} "
                              f"missing); collect them for every projection of every block")
    stats.check_model(model)  # statistics of another model (other norms, say) give a plausible-looking wrong one
    new: dict[str, SharedBasisLinear] = {}
    for g in tqdm(plan.groups, desc="basis sharing", disable=not progress):
        lins = [mods[n] for n in g.names]
        XXt = sum(stats.xxt(n).double() for n in g.names)  # (m, m): sum_j X_j X_j^T
        f = shared_basis([lin.weight.detach() for lin in lins], XXt, g.rank, alpha=alpha, method=regularization,
                         min_alpha=min_alpha, name=f"{g.type} group {', '.join(g.names)}")
        g.alpha = f.alpha
        biases = [lin.bias.detach() if lin.bias is not None else None for lin in lins]
        for name, mod in zip(g.names, SharedBasisLinear.from_factors(f.W1, f.W2s, biases)):
            new[name] = mod
    for name, mod in new.items():  # surgery only once every group is factorised
        model.set_submodule(name, mod)
    after = count_params(model)
    if after != plan.params_after:
        log.warning("model has %d params after basis sharing, %d expected from the groups", after, plan.params_after)
    return BasisSharingReport(
        "basis_sharing", float(ratio), plan.rho, plan.group_size, plan.shared, plan.ranks, plan.params_before, after,
        plan.layer_params_before, plan.layer_params_after,
        groups=[{"type": g.type, "layers": g.names, "rank": g.rank, "alpha": g.alpha, "params": g.params}
                for g in plan.groups],
        seconds=time.perf_counter() - t0)
