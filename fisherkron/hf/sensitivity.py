r"""ASVD's sensitivity sweep, which the paper adopted to allocate ranks across layers (Sec. 6.3).

The protocol: each layer is compressed alone, with the method at hand, at each candidate
per-layer ratio (:data:`SENSITIVITY_RATIOS`: the fraction of the layer's weights removed,
turned into a rank by :func:`~fisherkron.core.lowrank.rank_for_ratio`), and the mean loss on
held-out calibration batches (never the evaluation text) is measured. The table of loss
increases ``{layer: {rank: loss - base}}`` is what ASVD's threshold search
(:func:`fisherkron.core.allocation.choose_by_threshold`) reads in
:func:`fisherkron.hf.allocation.allocate`.

* :func:`sensitivity_sweep`: the table; ``layers x candidates`` model evaluations, each layer
  factorised as :func:`fisherkron.compress` would (:func:`decompose_layer`: the statistics the
  method reads, :func:`layer_statistics`, then its weighted SVD with the same
  ``regularization``, ``alpha``, ``min_alpha``, ``asvd_alpha``, ``mff_options``), so what is
  measured is the factorisation that follows. A
  :class:`~fisherkron.hf.allocation.Decompositions` passed in keeps each layer's weighted SVD
  (it memoises :func:`decompose_layer`, keyed with :func:`options_key`).
* :class:`PrefixReplay`: the blocks before the changed layer's are replayed from recorded
  outputs instead of run again (same losses, about half the cost).
* ``metric="kl"``: instead of the loss increase, the KL divergence of the model's outputs from
  the dense model's (:class:`OutputKL`), the measurement of LEMS and of the ``"calibrated"``
  allocation's option ``calibrate_metric="kl"``; one more evaluation records the dense outputs.
* The cache: the table is written to ``<cache_dir>/sensitivity-<key>.json`` after every layer,
  so an interrupted sweep resumes where it stopped. Its key (:func:`sweep_key`) covers
  everything the losses depend on: the whole model (every weight, its dtype and device), the
  loss function (its code and what it captures, or a ``loss_name``; for ``metric="kl"`` the
  metric and its temperature), the held-out batches, the
  method, its calibration statistics, every option of the factorisation, the candidates, the
  layers, the versions of fisherkron, torch and transformers, and the source of the code that
  computes them (this module, :mod:`fisherkron.hf.allocation` and the core's factorisation).
  Nothing in it is used unverified: each entry (the dense model's value; each layer's row of
  measurements, with what it cost) carries a checksum of its content, the key and its name, and
  is used only if it passes it and holds finite numbers at the layer's candidate ranks
  (:mod:`fisherkron.hf.sweep_cache`); an entry that fails is measured again, with a warning naming
  the file and the entry. The file is replaced whole (:func:`~fisherkron.env.atomic_write`), and a
  measurement that is not finite is refused in one line rather than kept.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import sys
import time
from collections.abc import Mapping
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from .._version import __version__
from ..core.allocation import saving
from ..core.conventions import FisherkronError
from ..core.lowrank import LowRankLinear, rank_for_ratio
from ..core.methods import METHODS, decompose_weight
from ..core.methods import method as method_row
from ..core.phases import timed
from ..core.regularization import MIN_ALPHA
from ..env import atomic_write, code_digest, data_root
from .calibration import CalibrationStats, data_fingerprint, default_loss, loss_key, model_fingerprint
from .sweep_cache import FORMAT, entry, read_sweep

__all__ = ["SENSITIVITY_RATIOS", "METRICS", "sensitivity_sweep", "sweep_key", "mean_loss", "loss_with_factors",
           "PrefixReplay", "OutputKL", "block_index", "layer_statistics", "kronecker_factors", "shrinkage_intensities",
           "decompose_layer", "options_key"]

log = logging.getLogger(__name__)

#: per-layer ratios (fraction of a layer's weights removed) measured by the sensitivity sweep
SENSITIVITY_RATIOS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
CODE_VERSION = "allocation-3"  # bump when the meaning of a cached sweep changes
#: what a sweep measures: the held-out loss increase, or the KL divergence from the dense model's outputs
METRICS = ("loss", "kl")
#: the source files whose code decides a sweep's numbers (their contents enter its key)
_SWEEP_CODE = ("hf/allocation.py", "hf/sensitivity.py", "core/methods.py", "core/wsvd.py", "core/regularization.py",
               "core/shrinkage.py", "core/lowrank.py", "core/factorization.py")


def _describe(value):
    """A JSON-able description of an option value that two different values never share (tensors by content)."""
    if isinstance(value, torch.Tensor):
        raw = value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        return ["tensor", str(value.dtype), list(value.shape), hashlib.blake2b(raw, digest_size=12).hexdigest()]
    if isinstance(value, Mapping):
        return {str(k): _describe(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, (list, tuple)):
        return [type(value).__name__, [_describe(v) for v in value]]
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return [type(value).__name__, repr(value)]  # dtypes, devices; an address in a repr only costs a miss


def options_key(**options) -> str:
    """The factorisation options of a cache key: JSON that two different values never share (tensors by content).

    >>> options_key(regularization="diag", alpha=None, min_alpha=float("inf"))
    '{"alpha": null, "min_alpha": "inf", "regularization": "diag"}'
    """
    return json.dumps(_describe(options), sort_keys=True)


def layer_statistics(stats: CalibrationStats | None, method: str, name: str, mff_options: dict | None = None,
                     device=None, info: dict | None = None) -> dict:
    """The statistics ``method`` reads for layer ``name``, as keyword arguments of ``factorize_weight``.

    For the GFWSVD family MFF runs (or its cached result is read); ``info``, when given,
    receives its ``fisher_share``, ``matvecs`` and ``converged``.
    """
    row = METHODS[method]
    given = {}
    if not row.needs:
        return given
    if stats is None:
        raise FisherkronError(f"method {method} needs calibration statistics")
    if "diag_fisher" in row.needs:
        given["diag_fisher"] = stats.diag_fisher(name)
    if "abs_mean" in row.needs:
        given["abs_mean"] = stats.input_abs_mean(name)
    if "xxt" in row.needs:
        given["xxt"] = stats.xxt(name)
    if "kfac" in row.needs:
        given["kfac"] = stats.kfac(name)
    if row.kronecker:
        res = kronecker_factors(stats, name, mff_options, device)
        given["A"], given["B"] = res["A"], res["B"]  # (m, m), (n, n)
        if info is not None:
            info.update({k: res[k] for k in ("fisher_share", "matvecs", "converged")})
    if method == "gfwsvd_shrunk":  # lambda_A, lambda_B from MFF on each half of the gradients
        given["shrinkage"] = shrinkage_intensities(stats, name, mff_options, device)
        if info is not None:
            info["shrinkage"] = given["shrinkage"]
    return given


def kronecker_factors(stats: CalibrationStats, name: str, mff_options: dict | None, device=None) -> dict:
    """``stats.kronecker`` of layer ``name``; a ``device`` inside ``mff_options`` (the CLI's ``--device``) wins."""
    opts = dict(mff_options or {})
    device = opts.pop("device", device)
    return stats.kronecker(name, device=device, **opts)


def shrinkage_intensities(stats: CalibrationStats, name: str, mff_options: dict | None,
                          device=None) -> tuple[float, float]:
    """``stats.shrinkage`` (``lambda_A``, ``lambda_B``) of layer ``name``, options as :func:`kronecker_factors`."""
    opts = dict(mff_options or {})
    device = opts.pop("device", device)
    return stats.shrinkage(name, device=device, **opts)


@timed("weighted SVDs")
def decompose_layer(module: nn.Linear, method: str, stats: CalibrationStats | None, name: str, *,
                    mff_options: dict | None = None, alpha: float | None = None, min_alpha: float = MIN_ALPHA,
                    regularization: str = "diag", asvd_alpha: float = 0.5, device=None, info: dict | None = None):
    """The full weighted SVD of ``module`` by ``method``, as :func:`fisherkron.compress` factorises it.

    Returns ``(decomposition, given)``: the :class:`~fisherkron.core.wsvd.Decomposition` and the
    statistics read (:func:`layer_statistics`); ``info`` receives MFF's diagnostics for the
    GFWSVD family. :class:`fisherkron.hf.allocation.Decompositions` keeps what it returns.
    """
    given = layer_statistics(stats, method, name, mff_options, device=device, info=info)
    dec = decompose_weight(method, module.weight.detach(), alpha=alpha, min_alpha=min_alpha,
                           regularization=regularization, asvd_alpha=asvd_alpha, layer=name, **given)
    return dec, given


def _code_version() -> str:
    """The package version, :data:`CODE_VERSION` and a digest of what the source that computes a sweep's numbers
    computes (:func:`fisherkron.env.code_digest`: comments and docstrings left out)."""
    pkg = Path(__file__).resolve().parents[1]
    return f"{__version__}/{CODE_VERSION}/{code_digest(pkg / rel for rel in _SWEEP_CODE)}"


def _placement(model: nn.Module) -> str:
    """Hash of every parameter's and buffer's dtype and device (:func:`model_fingerprint` reads values only)."""
    tensors = list(model.named_parameters()) + list(model.named_buffers())
    text = ";".join(f"{n}:{t.dtype}:{t.device.type}" for n, t in tensors)
    return hashlib.blake2b(text.encode(), digest_size=12).hexdigest()


def _loss_description(loss_fn, loss_name: str | None):
    """What the sweep's key says of the loss: ``loss_name`` if given, else :func:`loss_key` (or raise)."""
    if loss_name is not None:
        return ["named", str(loss_name)]
    try:
        return loss_key(loss_fn)
    except TypeError as exc:
        raise FisherkronError(f"loss_fn {getattr(loss_fn, '__qualname__', loss_fn)!r} cannot be keyed for the "
                              f"sensitivity cache ({exc}); pass loss_name='a name unique to this loss' (in "
                              f"allocation_options with compress) or cache=False") from None


def sweep_key(model: nn.Module, method: str, stats: CalibrationStats | None, names: list[str], heldout, *,
              ratios=SENSITIVITY_RATIOS, loss_fn=None, loss_name: str | None = None, min_alpha: float = MIN_ALPHA,
              mff_options: dict | None = None, regularization: str = "diag", alpha: float | None = None,
              asvd_alpha: float = 0.5, metric: str = "loss", temperature: float = 1.0) -> str:
    """The cache key of :func:`sensitivity_sweep`: a hash of everything its losses depend on.

    The whole model (:func:`~fisherkron.hf.calibration.model_fingerprint`: class, config, every
    parameter and buffer; and each one's dtype and device), the loss function
    (:func:`~fisherkron.hf.calibration.loss_key`, or ``loss_name``; for ``metric="kl"`` the metric
    and its ``temperature``), the held-out batches, the
    method and the calibration statistics it reads, every option of the factorisation, the
    candidate ratios, the layers, the versions of fisherkron, torch and transformers and the
    source of the code that computes the numbers. Raises the one-line error when the loss
    function cannot be described.
    """
    row = method_row(method)
    batches = [b if isinstance(b, Mapping) else {"batch": b} for b in heldout]
    cfg = {"code": _code_version(), "torch": torch.__version__,
           "transformers": getattr(sys.modules.get("transformers"), "__version__", None),
           "model": model_fingerprint(model), "placement": _placement(model),
           "loss": (_loss_description(loss_fn, loss_name) if metric == "loss"
                    else ["kl-to-dense-outputs", float(temperature)]),
           "heldout": data_fingerprint(batches), "method": method,
           "stats": stats.key if stats is not None and row.needs else None,
           "options": options_key(min_alpha=min_alpha, regularization=regularization, alpha=alpha,
                                   asvd_alpha=asvd_alpha if method == "asvd" else None, mff_options=mff_options or {}),
           "ratios": [float(r) for r in ratios], "layers": list(names)}
    return hashlib.blake2b(json.dumps(cfg, sort_keys=True, default=str).encode(), digest_size=16).hexdigest()


@torch.no_grad()
def mean_loss(model: nn.Module, batches, loss_fn=None) -> float:
    """Mean of ``loss_fn(model, batch)`` over ``batches`` (default: ``model(**batch).loss``)."""
    loss_fn = loss_fn or default_loss
    return sum(float(loss_fn(model, b)) for b in batches) / len(batches)


@torch.no_grad()
def loss_with_factors(model: nn.Module, name: str, factors, batches, loss_fn=None,
                      replay: "PrefixReplay | None" = None) -> float:
    """:func:`mean_loss` with layer ``name`` replaced by ``W2 W1`` (``factors``); the layer is put back after.

    With ``replay`` (a :class:`PrefixReplay` recorded on these ``batches``), the blocks before
    the layer's are not run again.
    """
    lin = model.get_submodule(name)
    W = lin.weight.detach()
    low = LowRankLinear.from_factors(factors[0].to(W.dtype), factors[1].to(W.dtype),
                                     lin.bias.detach() if lin.bias is not None else None).to(W.device)
    model.set_submodule(name, low)
    try:
        return replay.loss(model, name) if replay is not None else mean_loss(model, batches, loss_fn)
    finally:
        model.set_submodule(name, lin)


class _Replay(nn.Module):
    """Stands in for a block whose output on the current batch was recorded."""

    def __init__(self, out):
        super().__init__()
        self.out = out

    def forward(self, *args, **kwargs):
        return self.out


def _block_list(model: nn.Module, names: list[str]):
    """``(path of the nn.ModuleList of blocks, {layer: block index})``, or ``None`` if the layers are not in one list."""
    mods = dict(model.named_modules())
    path, index = None, {}
    for name in names:
        parts = name.split(".")
        found = next(((".".join(parts[:i]), int(parts[i])) for i in range(len(parts) - 1, 0, -1)
                      if parts[i].isdigit() and isinstance(mods.get(".".join(parts[:i])), nn.ModuleList)), None)
        if found is None or (path is not None and found[0] != path):
            return None
        path, index[name] = found[0], found[1]
    return (path, index) if path is not None else None


class PrefixReplay:
    r"""Held-out losses of a model in which one layer changed, running only the blocks from that layer's on.

    A sensitivity sweep changes one layer at a time, so the blocks before it compute what the
    dense model computes. Their outputs on each held-out batch are recorded once (forward
    hooks on the model's list of blocks) and replayed: a layer in block ``b`` costs the blocks
    ``b..L-1`` and the head instead of the whole model (about half the blocks on average).

    The replay is checked when it is built: with the first half of the blocks replayed, the
    loss must equal the dense loss to ``1e-6`` (relative); otherwise (a model whose blocks keep
    state between calls, or whose layers are not in one ``nn.ModuleList``) it is switched off
    and every evaluation runs the whole model. ``enabled`` says which.
    """

    @torch.no_grad()
    def __init__(self, model: nn.Module, names: list[str], batches, loss_fn=None):
        self.loss_fn = loss_fn or default_loss
        self.batches = list(batches)
        self.outputs: list[list] = []
        self.enabled = False
        self.base: float | None = None  # the dense mean loss, once recorded
        found = _block_list(model, names)
        if found is None:
            return
        self.path, self.index = found
        blocks = model.get_submodule(self.path)
        losses = []
        for batch in self.batches:
            outs = [None] * len(blocks)

            def keep(j):
                return lambda mod, args, out: outs.__setitem__(j, out)

            hooks = [blk.register_forward_hook(keep(j)) for j, blk in enumerate(blocks)]
            try:
                losses.append(float(self.loss_fn(model, batch)))
            finally:
                for h in hooks:
                    h.remove()
            if any(o is None for o in outs):
                return
            self.outputs.append(outs)
        self.base = sum(losses) / len(losses)
        try:
            got = self._loss(model, max(1, len(blocks) // 2))
        except Exception as exc:  # noqa: BLE001 - any failure means: evaluate the whole model
            log.info("block replay is not possible for this model (%s); evaluating whole models", exc)
            self.outputs = []
            return
        self.enabled = abs(got - self.base) <= 1e-6 * max(1.0, abs(self.base))
        if not self.enabled:
            log.info("block replay changes the loss (%.8g against %.8g); evaluating whole models", got, self.base)
            self.outputs = []

    @torch.no_grad()
    def _loss(self, model: nn.Module, upto: int) -> float:
        blocks = model.get_submodule(self.path)
        orig = [blocks[j] for j in range(upto)]
        total = 0.0
        try:
            for batch, outs in zip(self.batches, self.outputs):
                for j in range(upto):
                    blocks[j] = _Replay(outs[j])
                total += float(self.loss_fn(model, batch))
        finally:
            for j, blk in enumerate(orig):
                blocks[j] = blk
        return total / len(self.batches)

    def loss(self, model: nn.Module, name: str) -> float:
        """Mean held-out loss of ``model``, which differs from the recorded one in layer ``name`` only."""
        if not self.enabled:
            return mean_loss(model, self.batches, self.loss_fn)
        return self._loss(model, self.index[name])


def block_index(model: nn.Module, names: list[str]) -> tuple[dict[str, int], int] | None:
    """``({layer: index of its block}, number of blocks)`` when the layers lie in one ``nn.ModuleList`` of blocks.

    ``None`` otherwise. The depth of a layer, for LEMS's depth bias (:func:`fisherkron.core.allocation.depth_bias`).
    """
    found = _block_list(model, names)
    if found is None:
        return None
    path, index = found
    return index, len(model.get_submodule(path))


class OutputKL:
    r"""``loss_fn(model, batch)``: the KL divergence of the model's outputs from the dense model's on ``batch``.

    ``KL = mean_t sum_v p_t(v) (log p_t(v) - log q_t(v))`` with ``p_t = softmax(z_t / T)`` from the
    logits ``z_t`` the model had when this object was built (the dense model) and ``q_t`` from the
    model it is called with, averaged over the tokens ``t`` the ``attention_mask`` keeps (every
    output of a classifier); ``T = temperature``. The dense outputs of each batch are recorded
    once (one evaluation) and looked up by the batch object, so it is called with the batches it
    was built on (the sweep's held-out batches).

    In float64, as ``KL_t = sum_v p_t log p_t - sum_v p_t y_t + logsumexp_v y_t`` with
    ``y_t = z'_t / T`` the model's scaled logits: ``p_t`` and ``sum_v p_t log p_t`` are kept from
    the dense run (8 bytes per output and vocabulary entry), so a call costs one conversion, one
    dot product and one ``logsumexp`` per output (float32 round-off would swamp the KL of one
    compressed layer and make it negative).
    """

    CHUNK = 256  #: outputs converted to float64 at once (256 x 49,152 x 8 bytes: 100 MB)

    @torch.no_grad()
    def __init__(self, model: nn.Module, batches, temperature: float = 1.0):
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature > 0:
            raise FisherkronError(f"the KL temperature must be a number > 0; got {temperature!r}")
        self.temperature = float(temperature)
        self.batches = list(batches)  # kept alive: their ids are the keys of the recorded outputs
        if not all(isinstance(b, Mapping) for b in self.batches):
            raise FisherkronError("the KL divergence runs model(**batch): give the held-out batches as dicts")
        self._dense = {}
        for b in self.batches:
            z = self._logits(model, b)  # (N, V): N = B T outputs (B for a classifier)
            logp = F.log_softmax(self._scaled(z), dim=-1)
            p = logp.exp()
            self._dense[id(b)] = (p, (p * logp).sum(-1))  # (N, V), (N,)

    def _scaled(self, z: torch.Tensor) -> torch.Tensor:
        """``z / T`` in float64; at ``T = 1`` no division (the same values, one pass over the outputs fewer)."""
        y = z.double()
        return y if self.temperature == 1.0 else y / self.temperature

    @staticmethod
    def _logits(model: nn.Module, batch) -> torch.Tensor:
        """The model's logits on ``batch``, one row per output: ``(N, V)``."""
        z = model(**{k: v for k, v in batch.items() if k != "labels"}).logits  # (B, T, V) or (B, C)
        return z.flatten(0, -2)

    @torch.no_grad()
    def __call__(self, model: nn.Module, batch) -> torch.Tensor:
        dense = self._dense.get(id(batch))
        if dense is None:
            raise FisherkronError("OutputKL compares with the dense outputs of the batches it was built on; "
                                  "this batch is not one of them")
        p, negent = dense
        z = self._logits(model, batch)  # (N, V) in the model's dtype
        kl = torch.empty_like(negent)  # (N,)
        for s in range(0, z.shape[0], self.CHUNK):  # float64 a chunk of outputs at a time: a vocabulary is large
            y = self._scaled(z[s:s + self.CHUNK])
            kl[s:s + self.CHUNK] = negent[s:s + self.CHUNK] - (p[s:s + self.CHUNK] * y).sum(-1) + y.logsumexp(-1)
        mask = batch.get("attention_mask")
        if mask is None or mask.numel() != kl.numel():  # a classifier: one output per sequence
            return kl.mean()
        kl = kl.reshape(mask.shape)  # (B, T)
        mask = mask.to(kl.device, kl.dtype)
        return (kl * mask).sum() / mask.sum().clamp_min(1.0)


def _candidates(n: int, m: int, ratios) -> list[int]:
    """The ranks a sweep measures for an ``n x m`` layer: one per candidate ratio, each once, those that save."""
    out = []
    for rho in ratios:
        r = rank_for_ratio(n, m, rho)
        if r not in out and saving(n, m, r) > 0:
            out.append(r)
    return out


def _finite(value: float, metric: str, where: str) -> float:
    """``value`` if finite, else the one-line error: an allocation can not compare layers on NaN or infinity."""
    if not math.isfinite(value):
        what = "held-out loss" if metric == "loss" else "KL divergence from the dense outputs"
        raise FisherkronError(f"the {what} {where} is {value}; an allocation cannot compare layers on it: check the "
                              f"held-out batches, the loss function and the model's dtype (measure in float32)")
    return value


@timed("sensitivity measurements")
def sensitivity_sweep(model: nn.Module, method: str, stats: CalibrationStats | None, names: list[str], heldout,
                      *, ratios=SENSITIVITY_RATIOS, loss_fn=None, loss_name: str | None = None,
                      min_alpha: float = MIN_ALPHA, mff_options: dict | None = None, regularization: str = "diag",
                      alpha: float | None = None, asvd_alpha: float = 0.5, cache: bool = True, cache_dir=None,
                      decompositions=None, progress: bool = False, metric: str = "loss",
                      temperature: float = 1.0, label: str | None = None) -> dict:
    """Loss increase on ``heldout`` of compressing each layer alone at each candidate per-layer ratio.

    Each layer is factorised as :func:`fisherkron.compress` would with the same options. Returns
    ``{"base": loss, "table": {layer: {rank: increase}}, "evaluations": int, "seconds": float,
    "from_cache": bool, "path": str | None}``. With ``cache`` the state is written to
    ``<cache_dir>/sensitivity-<key>.json`` (:func:`sweep_key`) after every layer, so an
    interrupted sweep resumes where it stopped; every entry read back is verified first (its
    checksum, types and finite values: :func:`~fisherkron.hf.sweep_cache.read_sweep`) and one that
    fails is measured again
    with a warning; ``loss_name`` stands for a loss function whose
    code and captured values cannot be described. A folder that cannot be written (read-only,
    not a folder) costs the cache, not the sweep: one warning says so and ``path`` is ``None``.
    ``decompositions`` (a :class:`~fisherkron.hf.allocation.Decompositions`) keeps each layer's
    weighted SVD for the compression that follows; without it each is computed here
    (:func:`decompose_layer`). ``metric="kl"`` measures :class:`OutputKL` (at ``temperature``)
    instead of the loss: the table then holds each compressed model's KL divergence from the dense
    outputs, ``base`` is 0 and one more evaluation records the dense outputs; ``loss_fn`` and
    ``loss_name`` do not apply. ``label`` names the progress bar after the allocation that runs the
    sweep (default ``"sensitivity (<method>)"``).
    """
    method_row(method)
    if metric not in METRICS:
        raise FisherkronError(f"sweep metric {metric!r} is unknown; use one of {', '.join(METRICS)}")
    if metric == "kl" and (loss_fn is not None or loss_name is not None):
        raise FisherkronError("the KL metric compares the model's outputs with the dense model's; loss_fn and "
                              "loss_name do not apply to it (drop them, or measure metric='loss')")
    heldout = list(heldout or ())
    if not heldout:
        raise FisherkronError("the sensitivity allocation needs held-out calibration batches (heldout=)")
    mods = dict(model.named_modules())
    options = dict(min_alpha=min_alpha, mff_options=mff_options, regularization=regularization, alpha=alpha,
                   asvd_alpha=asvd_alpha)
    ranks = {n: _candidates(*mods[n].weight.shape, ratios) for n in names}  # {layer: [rank]}
    key = path = None
    base, entries = None, {}  # the verified entries: the dense value, and each layer's row
    if cache:
        key = sweep_key(model, method, stats, names, heldout, ratios=ratios, loss_fn=loss_fn, loss_name=loss_name,
                        metric=metric, temperature=temperature, **options)
        root = Path(cache_dir) if cache_dir is not None else data_root() / "cache" / "allocation"
        path = root / f"sensitivity-{key}.json"
        base, entries, problems = read_sweep(path, key, {n: {str(r) for r in rs} for n, rs in ranks.items()})
        for name, problem in problems:  # what failed is measured again below
            log.warning("sensitivity cache %s; measuring %s again", problem, "it" if name else "every entry")
    kept = path is not None and base is not None  # the file holds what is returned

    def keep() -> None:
        nonlocal path, kept
        if path is None:
            return
        state = {"format": FORMAT, "key": key, "method": method, "metric": metric, "ratios": list(ratios),
                 "base": base, "layers": entries}
        try:
            atomic_write(path, lambda t: Path(t).write_text(json.dumps(state)))
            kept = True
        except OSError as exc:  # a read-only or missing folder: measure on, without a cache
            log.warning("cannot keep the sensitivity sweep in %s (%s); measuring without a cache. Set "
                        "FISHERKRON_DATA or pass cache_dir= to a writable folder, or cache=False", path.parent, exc)
            path, kept = None, False

    todo = [n for n in names if n not in entries]
    factorise = decompositions.get if decompositions is not None else decompose_layer
    from_cache = not todo and base is not None
    t0 = time.perf_counter()
    pending = 0  # evaluations of this run not yet in an entry (the dense outputs of the KL)
    was_training = model.training
    model.eval()
    try:
        if metric == "kl" and (todo or base is None):
            loss_fn = OutputKL(model, heldout, temperature)  # records the dense outputs: one evaluation
            heldout = loss_fn.batches
            pending += 1
        replay = PrefixReplay(model, todo, heldout, loss_fn) if todo else None
        if base is None:  # the replay recorded the dense losses already, where it could
            value = replay.base if replay is not None and replay.base is not None else mean_loss(model, heldout,
                                                                                                   loss_fn)
            base = entry(key, "base", value=_finite(float(value), metric, "of the dense model"),
                          evaluations=pending + 1, seconds=time.perf_counter() - t0)
            pending, t0 = 0, time.perf_counter()
            keep()
        bar = tqdm(total=len(todo) * len(ratios), desc=label or f"sensitivity ({method})", disable=not progress)
        for name in todo:
            dec, _ = factorise(mods[name], method, stats, name, **options)
            row = {}
            for r in ranks[name]:
                f = dec.factors(r, name)
                loss = loss_with_factors(model, name, f, heldout, loss_fn, replay=replay)
                row[str(r)] = _finite(loss, metric, f"with {name} at rank {r}") - base["value"]
                pending += 1
                bar.update(1)
            bar.update(len(ratios) - len(ranks[name]))  # candidates that repeat a rank or save nothing
            entries[name] = entry(key, name, row=row, evaluations=pending, seconds=time.perf_counter() - t0)
            pending, t0 = 0, time.perf_counter()
            keep()
        bar.close()
    finally:
        model.train(was_training)
    table = {n: {int(r): float(d) for r, d in entries[n]["row"].items()} for n in names}
    every = [base, *(entries[n] for n in names)]
    return {"base": base["value"], "table": table, "evaluations": sum(e["evaluations"] for e in every),
            "seconds": sum(e["seconds"] for e in every), "from_cache": from_cache, "path": str(path) if kept else None,
            "metric": metric}
