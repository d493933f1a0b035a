r"""The budget of a compression: parameters, uniform ranks for a target (paper Sec. 6), and what a plan may not do.

The compression ratio is the paper's, over the whole model: ``1 - params_after / params_before``.
A rank-``r`` factorisation of an ``n x m`` layer keeps ``r (n + m)`` of its ``n m`` weights
(:mod:`fisherkron.core.lowrank`), so a per-layer ratio ``rho`` gives the largest ``r`` with
``1 - r (n + m) / (n m) >= rho`` (:func:`~fisherkron.core.lowrank.rank_for_ratio`).

* :func:`count_params`: the parameters of a model (tied weights counted once);
* :func:`plan_ranks`: per-layer ranks from one rank, a dict, or a whole-model ratio met by one
  uniform per-layer ratio (bisection);
* :func:`params_after`: the parameters a rank plan leaves, counted exactly (a weight another
  module still holds stays);
* :func:`drop_shared`: a selected layer whose weight another module holds too (an ``lm_head``
  tied to the input embeddings) is left out of the plan: factorising it would untie the two
  and add ``r (n + m)`` parameters instead of removing any;
* :func:`check_factor_memory`: a layer whose factors cannot fit in memory is refused (or left
  out) before any calibration;
* :func:`calibration_needs`: what a calibration will take (disk, memory, forward + backward
  passes), with or without a bound on its disk, from the layers' shapes alone (a dry run).

Both :mod:`fisherkron.hf.allocation` (the ``"uniform"`` strategy and every strategy's budget)
and :mod:`fisherkron.hf.surgery` read them from here, and so does the command line's plan.

**Memory of the factors.** A method that reads Kronecker factors (``A`` (``m x m``, input
side) and ``B`` (``n x n``, output side); the ``grads`` of GFWSVD and its ablations, the
``kfac`` of KFAC-SVD and of the ``fisher`` / ``calibrated`` allocations) or SVD-LLM's
``X X^T`` (``m x m``) estimates, regularises and factorises them in float64, and holds at
least :data:`FACTOR_COPIES` copies of each at once (the factor, its regularised copy, its
Cholesky factor; MFF's Krylov basis adds more): at least ``3 * 8 (m^2 + n^2)`` bytes for an
``n x m`` layer. The calibration keeps every selected layer's K-FAC sums (``8 (m^2 + n^2)``
bytes) or ``X X^T`` sums (``8 m^2``) at once. An ``lm_head`` over a 30,522-token vocabulary
needs at least 22 GB; :func:`check_factor_memory` compares these lower bounds with the
memory available when the plan is made.
"""
from __future__ import annotations

import logging
import math
import numbers
import os
from collections.abc import Iterable, Mapping
from dataclasses import asdict

from torch import nn

from ..core.checks import check_rank
from ..core.conventions import FisherkronError
from ..core.lowrank import compression_ratio, lowrank_params, rank_for_ratio
from ..core.methods import METHODS
from .calibration.disk import layer_disk, parse_size, plan_groups
from .calibration.entry import METHOD_STATS, STATS
from .calibration.layers import select_layers

__all__ = ["RatioReport", "count_params", "plan_ranks", "check_ratio", "params_after", "shared_weights", "drop_shared",
           "factor_bytes", "available_memory", "check_factor_memory", "FACTOR_COPIES", "calibration_needs"]

log = logging.getLogger(__name__)


class RatioReport:
    """What every compression report says about parameters: a dataclass with ``params_before``, ``params_after``,
    ``layer_params_before`` and ``layer_params_after`` gets its two ratios and a plain dict from here."""

    @property
    def ratio(self) -> float:
        """Whole-model compression ratio ``1 - params_after / params_before``."""
        return compression_ratio(self.params_before, self.params_after)

    @property
    def layers_ratio(self) -> float:
        """Compression ratio of the selected layers alone."""
        return compression_ratio(self.layer_params_before, self.layer_params_after)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["ratio"], d["layers_ratio"] = self.ratio, self.layers_ratio
        return d

#: float64 copies of each factor that one layer holds at once, at the least: the factor, its regularised copy
#: and its Cholesky factor (the weighting step of every Kronecker method and of SVD-LLM)
FACTOR_COPIES = 3
#: bytes of one entry of a factor: factors are estimated, regularised and factorised in float64
_ENTRY = 8
#: statistics (see :data:`fisherkron.core.methods.METHODS`) whose factors are ``m x m`` and ``n x n``
_KRONECKER_STATS = ("grads", "kfac")


def count_params(model: nn.Module) -> int:
    """Unique parameters (tied weights counted once)."""
    return sum(p.numel() for p in model.parameters())


def check_ratio(ratio) -> float:
    """``ratio`` as a float in ``(0, 1)``, or the one-line error naming what was given.

    >>> check_ratio(0.25)
    0.25
    """
    if isinstance(ratio, bool) or not isinstance(ratio, numbers.Real) or not (math.isfinite(ratio)
                                                                               and 0.0 < ratio < 1.0):
        raise FisherkronError(f"ratio must be a number in (0, 1), the fraction of the model's parameters "
                              f"removed; got {ratio!r}")
    return float(ratio)


def plan_ranks(model: nn.Module, names: list[str], *, rank: int | None = None,
               ranks: dict[str, int] | None = None, ratio: float | None = None) -> dict[str, int]:
    """Per-layer ranks from exactly one of ``rank``, ``ranks`` (``None``: keep dense) or a whole-model ``ratio``.

    With ``ratio``, every selected layer gets ``rank_for_ratio(n, m, rho)`` with
    the smallest uniform ``rho`` whose total removal reaches
    ``ratio * count_params(model)`` (``1 - r (n + m) / (n m) >= rho`` per layer).

    >>> model = nn.Sequential(nn.Linear(8, 6), nn.Linear(6, 8))
    >>> plan_ranks(model, ["0", "1"], ratio=0.3)
    {'0': 2, '1': 2}
    """
    if sum(x is not None for x in (rank, ranks, ratio)) != 1:
        raise FisherkronError("give exactly one of rank=, ranks= or ratio=")
    mods = dict(model.named_modules())
    shape = {n: (mods[n].out_features, mods[n].in_features) for n in names}
    if rank is not None:
        out = {n: rank for n in names}
    elif ranks is not None:
        unknown = [n for n in ranks if n not in shape]
        if unknown:
            raise FisherkronError(f"ranks names layer {unknown[0]}, which is not among the selected layers")
        missing = [n for n in names if n not in ranks]
        if missing:
            raise FisherkronError(f"ranks gives no rank for layer {missing[0]} ({len(missing)} missing)")
        out = dict(ranks)
    else:
        ratio = check_ratio(ratio)
        need = ratio * count_params(model)

        def plan(rho):
            return {n: rank_for_ratio(*shape[n], rho) for n in names}

        def removed(p):
            return sum(shape[n][0] * shape[n][1] - p[n] * sum(shape[n]) for n in names)

        best = removed(plan(1.0 - 1e-12))
        if best < need:
            total = count_params(model)
            raise FisherkronError(f"ratio {ratio:.3f} is out of reach: factorising the {len(names)} selected "
                                  f"layers at rank 1 removes at most {best / total:.3f} of the model; "
                                  f"select more layers")
        lo, hi = 0.0, 1.0 - 1e-12
        for _ in range(60):
            mid = 0.5 * (lo + hi)
            lo, hi = (lo, mid) if removed(plan(mid)) >= need else (mid, hi)
        out = plan(hi)
    return {n: None if r is None else check_rank(r, *shape[n], name=f"layer {n}") for n, r in out.items()}


# ----------------------------------------------------------------------------- what a plan leaves

def params_after(model: nn.Module, plan: dict[str, int | None]) -> int:
    """Parameters of ``model`` once each layer of ``plan`` (``{name: rank}``) is factorised, counted exactly.

    A layer whose rank is ``None`` or saves nothing (``r (n + m) >= n m``, kept dense by
    :func:`fisherkron.compress`) keeps its weights. A factorised layer's weight and bias go,
    unless another module holds them too (tied embeddings): those stay and are counted once.

    >>> model = nn.Sequential(nn.Linear(8, 6, bias=False), nn.Linear(6, 8, bias=False))
    >>> params_after(model, {"0": 2, "1": None})
    76
    """
    mods = dict(model.named_modules())
    low = {}
    for name, r in plan.items():
        lin = mods[name]
        n, m, bias = lin.out_features, lin.in_features, getattr(lin, "bias", None) is not None
        if r is not None and lowrank_params(n, m, r, bias) < n * m + (n if bias else 0):
            low[name] = lowrank_params(n, m, r, bias)
    kept = {}
    for name, mod in model.named_modules():
        if name in low or any(name.startswith(f"{x}.") for x in low):
            continue
        for p in mod.parameters(recurse=False):
            kept[id(p)] = p.numel()
    return sum(kept.values()) + sum(low.values())


def _param_key(p):
    return id(p) if p.device.type == "meta" else (p.data_ptr(), tuple(p.shape), p.dtype)


def shared_weights(model: nn.Module, names: Iterable[str]) -> dict[str, str]:
    """The layers of ``names`` whose weight another module holds too: ``{layer: the other's parameter name}``.

    An ``lm_head`` tied to the input embeddings (``tie_word_embeddings``) is the usual one.

    >>> emb, head = nn.Embedding(10, 4), nn.Linear(4, 10, bias=False)
    >>> head.weight = emb.weight
    >>> shared_weights(nn.ModuleDict({"emb": emb, "head": head}), ["head"])
    {'head': 'emb.weight'}
    """
    holders: dict = {}
    for mod_name, mod in model.named_modules():
        for p_name, p in mod.named_parameters(recurse=False):
            holders.setdefault(_param_key(p), []).append(f"{mod_name}.{p_name}" if mod_name else p_name)
    mods = dict(model.named_modules())
    out = {}
    for name in names:
        w = getattr(mods[name], "weight", None)
        if isinstance(w, nn.Parameter):
            others = [h for h in holders.get(_param_key(w), []) if h != f"{name}.weight"]
            if others:
                out[name] = others[0]
    return out


def _named_explicitly(name: str, layers) -> bool:
    patterns = [] if layers is None else [layers] if isinstance(layers, str) else list(layers)
    return name in patterns


def drop_shared(model: nn.Module, names: list[str], layers=None, *, option: str = "layers") -> list[str]:
    """``names`` without the layers whose weight another module holds (see :func:`shared_weights`).

    Factorising such a layer (an ``lm_head`` tied to the input embeddings) would replace it by
    new factors while the embedding keeps the matrix: the model would grow by ``r (n + m)``.
    A layer a pattern matched is left out with a plain sentence (a warning); one that
    ``layers`` names exactly is refused in one line, as is a selection of such layers alone.
    ``option``: how the message names the selection (``"--layers"`` on the command line).
    """
    shared = shared_weights(model, names)
    if not shared:
        return list(names)
    named = [n for n in shared if _named_explicitly(n, layers)]
    if named:
        n = named[0]
        raise FisherkronError(f"layer {n} shares its weight with {shared[n]} (tied embeddings): factorising it "
                              f"would untie them and make the model larger; leave {n} out of {option}")
    kept = [n for n in names if n not in shared]
    if not kept:
        raise FisherkronError(f"every selected layer shares its weight with another module ({', '.join(shared)}; "
                              f"tied embeddings): factorising would make the model larger; select other layers")
    for n, other in shared.items():
        log.warning("%s is left as it is: its weight is %s (tied embeddings), so factorising it would add "
                    "parameters instead of removing any", n, other)
    return kept


# ----------------------------------------------------------------------------- memory of the factors

def _stats(methods) -> set[str]:
    methods = [methods] if isinstance(methods, str) else list(methods)
    return {s for name in methods for s in (METHODS[name].needs if name in METHODS else (name,))}


def factor_bytes(n: int, m: int, methods) -> int:
    """Bytes an ``n x m`` layer's factors take at once, at the least, for ``methods`` (names of
    :data:`~fisherkron.core.methods.METHODS`, or statistics such as ``"kfac"``).

    ``FACTOR_COPIES * 8 (m^2 + n^2)`` for the Kronecker factors, ``FACTOR_COPIES * 8 m^2`` for
    SVD-LLM's ``X X^T``, 0 for the methods whose weights are vectors.

    >>> round(factor_bytes(30522, 384, "gfwsvd") / 1e9, 1)  # GB for a BERT-vocabulary lm_head
    22.4
    """
    stats = _stats(methods)
    if stats & set(_KRONECKER_STATS):
        return FACTOR_COPIES * _ENTRY * (m * m + n * n)
    if "xxt" in stats:
        return FACTOR_COPIES * _ENTRY * m * m
    return 0


def _calibration_bytes(n: int, m: int, methods) -> int:
    """Bytes of one layer's sums the calibration keeps for all layers at once: K-FAC's, or ``X X^T``."""
    stats = _stats(methods)
    return _ENTRY * ((m * m + n * n) if "kfac" in stats else m * m if "xxt" in stats else 0)


def available_memory() -> int | None:
    """Bytes of memory available now: ``MemAvailable`` (Linux), else the physical memory; ``None`` if unknown."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def _gb(b: float) -> str:
    return f"{b / 1e9:.3g} GB"


def check_factor_memory(model: nn.Module, names: list[str], methods, *, limit: int | None = None,
                        skip: bool = False, calibration: bool = True, skip_option: str = "skip_large_layers=True",
                        limit_option: str = "factor_memory_limit=") -> list[str]:
    """``names`` without the layers whose factors cannot fit in memory; refuses them in one line unless ``skip``.

    A layer is too large when :func:`factor_bytes` (a lower bound of what its factors take at
    once) exceeds ``limit`` bytes (default: :func:`available_memory`, the memory available
    when the plan is made; no check when it is unknown). Refused: one line naming the first
    such layer, its factor size in GB and the limit, and what to do (deselect it, or
    ``skip_option``). With ``skip``, such layers are left out (kept dense) with one warning.
    With ``calibration`` (before the statistics are collected), the calibration's sums of the
    remaining layers (:func:`_calibration_bytes`, all layers at once) are checked against the
    same limit. ``skip_option`` / ``limit_option``: how the
    message names the two settings (the command line passes its flags).
    """
    if not names:
        return list(names)
    where = "the limit given"
    if limit is None:
        limit = available_memory()
        if limit is None:
            log.info("the memory available is unknown here: the factors' sizes are not checked")
            return list(names)
        where = "the memory available now"
    mods = dict(model.named_modules())
    shape = {n: (mods[n].out_features, mods[n].in_features) for n in names}
    large = {n: factor_bytes(*shape[n], methods) for n in names if factor_bytes(*shape[n], methods) > limit}
    if large and not skip:
        n = max(large, key=large.get)
        more = f" (and {len(large) - 1} more layers)" if len(large) > 1 else ""
        raise FisherkronError(f"layer {n} ({shape[n][0]} x {shape[n][1]}) needs at least {_gb(large[n])} for its "
                              f"factors (m^2 + n^2 float64 entries, {FACTOR_COPIES} copies){more}, more than "
                              f"{_gb(limit)}, {where}; leave it out of the layers, or pass {skip_option} to keep such layers "
                              f"dense (or set the limit: {limit_option})")
    if large:
        log.warning("%d layer(s) kept dense: their factors need more than %s (%s): %s", len(large), _gb(limit),
                    where, ", ".join(f"{n} ({_gb(b)})" for n, b in large.items()))
    kept = [n for n in names if n not in large]
    total = sum(_calibration_bytes(*shape[n], methods) for n in kept) if calibration else 0
    if total > limit:
        raise FisherkronError(f"the calibration keeps the factor sums of all {len(kept)} selected layers at once, "
                              f"{_gb(total)} in all, more than {_gb(limit)}, {where}; select fewer layers")
    return kept


# ----------------------------------------------------------------------------- what a calibration will take

def calibration_needs(model, layers=None, methods=("gfwsvd",), *, k: int, batch_size: int, seq_len: int,
                      grad_dtype: str = "float32", granularity: str = "batch", max_disk=None,
                      params: int | None = None, param_bytes: int | None = None) -> dict:
    r"""Disk, memory and passes of :func:`fisherkron.collect_calibration` for ``methods``, before running it.

    Eq. (8) keeps ``k`` gradients per layer: ``k x sum(n m) x bytes`` on disk
    (:mod:`fisherkron.hf.calibration.disk`). Under ``max_disk`` the layers are collected in
    groups (:func:`~fisherkron.hf.calibration.disk.plan_groups`, the plan the collection itself
    makes): ``k x groups`` forward + backward passes, one group's gradients on disk at once.

    Args:
        model: an ``nn.Module`` (``layers`` selects its linear layers as the calibration does), or
            ``{name: (n, m)}`` shapes (out x in) with no model loaded; then ``params`` and
            ``param_bytes`` give the model's size.
        methods: compression methods (their statistics are what is collected).
        k, batch_size, seq_len: the calibration batches (``k`` batches of ``batch_size`` sequences
            of ``seq_len`` tokens, no padding).
        grad_dtype, granularity: as for :func:`fisherkron.collect_calibration`.
        max_disk: the bound, in bytes or a string such as ``"200GB"``.

    Returns:
        A dict of numbers: ``gradient_bytes`` (every layer's gradient files: what an unbounded
        entry keeps), ``statistics_bytes``, ``factor_bytes`` (MFF's ``A``, ``B`` in float64, kept
        beside the gradients once compression ran, or instead of them under a bound), ``disk_bytes``
        (the most an unbounded entry holds), ``min_max_disk`` (the smallest bound that works: the
        statistics and factors of all layers and the largest layer's gradients), and under
        ``max_disk``: ``groups``, ``gradient_bytes_bounded`` (the largest group's gradients, alive at
        once), ``disk_bytes_bounded`` (the peak); ``passes`` (forward + backward: ``k x groups``);
        ``model_bytes`` and ``memory_bytes``, a lower bound of the memory: the model, one gradient of
        each weight collected at once, the inputs those layers keep for backward, the running sums,
        or while MFF runs :data:`FACTOR_COPIES` float64 copies of the largest layer's factors.

    >>> shapes = {f"{i}.{p}": (4096, 4096) for i in range(32) for p in "qkvo"}
    >>> shapes.update({f"{i}.{p}": (11008, 4096) for i in range(32) for p in ("gate", "up")})
    >>> shapes.update({f"{i}.down": (4096, 11008) for i in range(32)})
    >>> need = calibration_needs(shapes, k=75, batch_size=1, seq_len=4096, grad_dtype="bfloat16",
    ...                          max_disk="300GB", params=6_738_415_616, param_bytes=2)
    >>> round(need["gradient_bytes"] / 1e9), need["groups"], need["passes"]  # GB of an unbounded entry
    (971, 5, 375)
    """
    methods = [methods] if isinstance(methods, str) else list(methods)
    unknown = [m for m in methods if m not in METHOD_STATS]
    if unknown:
        raise FisherkronError(f"method {unknown[0]!r} is unknown; use one of {', '.join(METHOD_STATS)}")
    stats = tuple(s for s in STATS if any(s in METHOD_STATS[m] for m in methods))
    if isinstance(model, Mapping):
        shapes = {str(n): (int(s[0]), int(s[1])) for n, s in model.items()}
        model_bytes = None if params is None or param_bytes is None else params * param_bytes
    else:
        mods = dict(model.named_modules())
        shapes = {n: (mods[n].out_features, mods[n].in_features) for n in select_layers(model, layers)}
        params = count_params(model) if params is None else params
        model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        param_bytes = param_bytes or next(model.parameters()).element_size()
    param_bytes = param_bytes or 4
    per_layer = k * batch_size if granularity == "sequence" else k
    tokens = k * batch_size * seq_len
    sizes = {n: layer_disk(n_, m_, k=per_layer, stats=stats, grad_dtype=grad_dtype, granularity=granularity,
                           tokens=tokens) for n, (n_, m_) in shapes.items()}
    whole = plan_groups(sizes, None)
    bound = None if max_disk is None else parse_size(max_disk)
    plan = whole if bound is None else plan_groups(sizes, bound, option="max_disk")
    groups = plan.groups if bound is not None and len(plan.groups) > 1 else whole.groups

    def pass_memory(group):  # weight gradients, the inputs kept for backward, the running sums
        return sum(shapes[n][0] * shapes[n][1] * param_bytes + batch_size * seq_len * shapes[n][1] * param_bytes
                   + sizes[n].sums for n in group)

    mff = max((factor_bytes(*shapes[n], methods) for n in shapes), default=0)
    out = {"layers": len(shapes), "k": k, "gradients_per_layer": per_layer, "tokens": tokens,
           "grad_dtype": grad_dtype, "params": params, "model_bytes": model_bytes,
           "gradient_bytes": whole.unbounded,
           "statistics_bytes": sum(s.statistics for s in sizes.values()),
           "factor_bytes": sum(s.factors for s in sizes.values()),
           "disk_bytes": whole.unbounded_peak,
           "min_max_disk": whole.minimum,
           "max_disk": bound, "groups": len(groups),
           "gradient_bytes_bounded": max(sum(sizes[n].gradients for n in g) for g in groups),
           "disk_bytes_bounded": plan.peak if len(groups) > 1 else whole.unbounded_peak,
           "passes": k * len(groups),
           "memory_bytes": (model_bytes or 0) + max(max(pass_memory(g) for g in groups), mff)}
    return out
