r"""Recovery fine-tuning of a compressed model's factors with LoRA, and training text kept apart from evaluation text.

After a compression (or a learned truncation, :mod:`fisherkron.hf.truncation`) practitioners
recover part of the loss by training the factors themselves: SVD-LLM trains LoRA on one factor,
merges, then on the other; LEMS and Basis Sharing train LoRA on the factors; all through PEFT.
:func:`recover` does this on :class:`~fisherkron.core.lowrank.LowRankLinear`'s two factors,
``first`` (``W_1``, ``r x m``) and ``second`` (``W_2``, ``n x r``), as PEFT LoRA targets:

.. math::  W_1 \leftarrow W_1 + \tfrac{\alpha}{r_{LoRA}} B_1 A_1, \qquad
           W_2 \leftarrow W_2 + \tfrac{\alpha}{r_{LoRA}} B_2 A_2,

trained on calibration text (C4 documents) with AdamW, a token budget and a warmup + cosine (or
linear) schedule, then merged: each factor keeps its shape, so the compression ratio survives.
Defaults are SVD-LLM's LoRA settings (:data:`LORA`: rank 8, alpha 16, dropout 0.05, learning
rate 1e-4). For SVD-LLM's order call it twice, ``targets=("first",)`` then ``("second",)``.

**Rebalancing** (``rebalance=True``, off by default until a study shows it helps): a product is
unchanged by ``W_2 W_1 = (W_2 c)(W_1 / c)``; :func:`rebalance_factors` picks
``c = sqrt(||W_1||_F / ||W_2||_F)`` so both factors have norm ``sqrt(||W_1||_F ||W_2||_F)``.
GFWSVD's ``W_2 = L_B^{-T} U S^{1/2}`` and ``W_1 = S^{1/2} V^T L_A^{-1}`` are not balanced (the
Cholesky factors scale them), and LoRA's update is of the same absolute size on both.

**Training text kept apart from evaluation text** (:func:`check_disjoint`): no training
document may share a span of ``span`` letters (default 100, about 20 words, compared after
lower-casing and dropping everything but ``a-z``, PTB's ``<unk>`` and ``N``) with the evaluation
texts (:func:`evaluation_texts`: the Wikipedia text, PTB's test split and the documents of every
local lm-eval task). Every candidate from a 64-bit rolling hash is confirmed by comparing the
strings, so a reported overlap is an exact shared span.
"""
from __future__ import annotations

import json
import logging
import math
import re
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

from ..core.basis_sharing import SharedBasisLinear
from ..core.checks import check_int, check_positive
from ..core.conventions import FisherkronError
from ..core.lowrank import LowRankLinear
from ..core.phases import timed
from ..env import require, sigterm_as_interrupt
from .budget import count_params
from .calibration import default_loss
from .calibration.keys import data_fingerprint, model_fingerprint
from .training import (NonFiniteTraining, batch_index, check_batches, check_finite, check_rates, config_key,
                       load_checkpoint, prepare_checkpoint, save_checkpoint, save_on_interrupt, to_device,
                       uninterrupted)

__all__ = ["LORA", "SCHEDULES", "RecoveryReport", "recover", "rebalance_factors", "lowrank_layers", "lr_factor",
           "Overlap", "normalise", "evaluation_texts", "check_disjoint", "assert_disjoint", "OVERLAP_SPAN"]

log = logging.getLogger(__name__)

#: SVD-LLM's LoRA fine-tuning settings (rank, alpha, dropout, learning rate)
LORA = {"rank": 8, "alpha": 16.0, "dropout": 0.05, "lr": 1e-4}
SCHEDULES = ("cosine", "linear")
CODE_VERSION = "recovery-1"
#: letters a training document may share with an evaluation text (about 20 words); 50 already
#: finds boilerplate (a C4 page and an MMLU accounting question share "conditions and events that
#: raise substantial doubt about the entity's ability to continue as a going concern")
OVERLAP_SPAN = 100


# ----------------------------------------------------------------------------- the factors

def lowrank_layers(model: nn.Module) -> list[str]:
    """Names of the model's :class:`~fisherkron.core.lowrank.LowRankLinear` layers, in module order."""
    return [n for n, mod in model.named_modules() if isinstance(mod, LowRankLinear)]


def _untrainable(model: nn.Module, bad: str | None) -> FisherkronError:
    """Why :func:`recover` can not train ``bad`` (or, with ``None``, the model): a one-line error that
    names the compressed layers it holds instead (Basis Sharing's share ``W_1`` within a group, and
    LoRA on a shared factor would give each layer of the group its own update to one matrix)."""
    mods = dict(model.named_modules())
    shared = [n for n, mod in mods.items() if isinstance(mod, SharedBasisLinear)]
    if bad is not None and isinstance(mods.get(bad), SharedBasisLinear) or bad is None and shared:
        where = bad if bad is not None else f"{shared[0]} and {len(shared) - 1} more" if len(shared) > 1 else shared[0]
        return FisherkronError(f"recovery trains low-rank factorised layers (LowRankLinear, from fisherkron.compress); "
                               f"this model's compressed layers ({where}) are Basis Sharing layers "
                               f"(SharedBasisLinear), which it does not train")
    if bad is not None:
        return FisherkronError(f"layer {bad} is not a LowRankLinear of this model")
    return FisherkronError("the model has no LowRankLinear layer; compress it first")


@torch.no_grad()
def rebalance_factors(model: nn.Module, layers: list[str] | None = None) -> dict[str, float]:
    r"""``W_2 W_1 = (W_2 c)(W_1 / c)`` with ``c = sqrt(||W_1||_F / ||W_2||_F)``: equal factor norms, same product.

    In place on each ``LowRankLinear`` of ``layers`` (default: all); returns ``{layer: c}``.

    >>> low = LowRankLinear.from_factors(torch.ones(2, 2), 4 * torch.ones(2, 2))  # norms 2 and 8
    >>> c = rebalance_factors(nn.Sequential(low))["0"]
    >>> c, float(low.second.weight.detach().norm()), float(low.first.weight.detach().norm())
    (2.0, 4.0, 4.0)
    """
    out = {}
    for name in layers if layers is not None else lowrank_layers(model):
        low = model.get_submodule(name)
        n1, n2 = float(low.first.weight.norm()), float(low.second.weight.norm())
        if n1 == 0.0 or n2 == 0.0:
            out[name] = 1.0
            continue
        c = math.sqrt(n1 / n2)
        low.second.weight.mul_(c)
        low.first.weight.div_(c)
        out[name] = c
    return out


def lr_factor(step: int, total: int, warmup: int, schedule: str = "cosine", floor: float = 0.0) -> float:
    r"""The learning rate of step ``t`` (from 0) as a fraction of the peak.

    Warmup ``(t + 1) / w`` for ``t < w``; then, with ``p = (t - w) / (T - w)``, cosine
    ``f + (1 - f) (1 + cos(pi p)) / 2`` or linear ``f + (1 - f)(1 - p)`` (``f = floor``).

    >>> [round(lr_factor(t, 6, 2), 3) for t in range(6)]
    [0.5, 1.0, 1.0, 0.854, 0.5, 0.146]
    """
    if step < warmup:
        return (step + 1) / warmup
    p = (step - warmup) / max(1, total - warmup)
    shape = 0.5 * (1.0 + math.cos(math.pi * p)) if schedule == "cosine" else 1.0 - p
    return floor + (1.0 - floor) * shape


# ----------------------------------------------------------------------------- the report

@dataclass
class RecoveryReport:
    """What :func:`recover` trained and how the loss went (``history``: one record per optimiser step)."""

    layers: list[str]
    targets: tuple[str, ...]
    lora: dict
    steps: int
    tokens: int
    params_before: int
    params_after: int
    rebalanced: dict[str, float] = field(default_factory=dict)
    history: list[dict] = field(default_factory=list)
    seconds: float = 0.0
    resumed_at: int | None = None
    config: dict = field(default_factory=dict)

    @property
    def losses(self) -> list[float]:
        """The training loss per step (mean over its micro-batches)."""
        return [h["loss"] for h in self.history]

    def to_dict(self) -> dict:
        return asdict(self)


# ----------------------------------------------------------------------------- training

def _warmup_steps(warmup, total: int) -> int:
    if isinstance(warmup, float) and not isinstance(warmup, bool):
        if not 0.0 <= warmup < 1.0:
            raise FisherkronError(f"warmup as a fraction of the steps must be in [0, 1); got {warmup}")
        return math.ceil(warmup * total)
    return check_int(warmup, "warmup", minimum=0)


def _rng_devices(device: torch.device) -> list:
    return [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else []


def _check_merge(wrapped, what: str, step: int, total: int, loss: float, advice: str) -> None:
    r"""Raise :class:`~fisherkron.hf.training.NonFiniteTraining` before the merge if a merged factor
    ``W + (alpha / r_LoRA) B A`` would not be finite (e.g. a float16 overflow): the merge is in place,
    and a factor half merged could not be put back."""
    for name, mod in wrapped.named_modules():
        if not (hasattr(mod, "get_delta_weight") and hasattr(mod, "get_base_layer")):
            continue
        W = mod.get_base_layer().weight  # (rows, cols) of W_1 or W_2
        for adapter in mod.active_adapters:
            if adapter in getattr(mod, "lora_A", {}) and \
                    not bool(torch.isfinite(W + mod.get_delta_weight(adapter).to(W.dtype)).all()):
                raise NonFiniteTraining(f"{what} stopped after step {step} of {total}: merging the LoRA update into "
                                        f"{name} gives a factor that is not finite (last loss {loss:.6g}); the model "
                                        f"is left as it was before the call. {advice}")


def _check_options(accumulate, checkpoint_every, lora_rank, lr, min_lr, lora_alpha, weight_decay, max_grad_norm,
                   lora_dropout, schedule, targets) -> tuple[str, ...]:
    """The options of :func:`recover` it refuses before any work (one-line errors); returns ``targets`` as a tuple."""
    check_int(accumulate, "accumulate", minimum=1)
    check_int(checkpoint_every, "checkpoint_every", minimum=1)
    check_int(lora_rank, "lora_rank", minimum=1)
    check_rates(lr, min_lr)
    check_positive(lora_alpha, "lora_alpha")
    check_positive(weight_decay, "weight_decay", zero_ok=True)
    if max_grad_norm is not None:
        check_positive(max_grad_norm, "max_grad_norm")
    if not 0.0 <= lora_dropout < 1.0:
        raise FisherkronError(f"lora_dropout must be in [0, 1); got {lora_dropout}")
    if schedule not in SCHEDULES:
        raise FisherkronError(f"schedule must be one of {', '.join(SCHEDULES)}; got {schedule!r}")
    targets = tuple(targets)
    if not targets or not set(targets) <= {"first", "second"}:
        raise FisherkronError(f"targets must name the factors 'first' (W_1) and/or 'second' (W_2); got {targets!r}")
    return targets


def _layers(model: nn.Module, layers: list[str] | None) -> tuple[list[str], dict[str, nn.Module]]:
    """The ``LowRankLinear`` layers :func:`recover` trains (``layers``, default all) and the model's modules."""
    names = list(layers) if layers is not None else lowrank_layers(model)
    mods = dict(model.named_modules())
    bad = [n for n in names if not isinstance(mods.get(n), LowRankLinear)]
    if bad or not names:
        raise _untrainable(model, bad[0] if bad else None)
    if layers is None and any(isinstance(m, SharedBasisLinear) for m in mods.values()):
        log.warning("recovery: the model's Basis Sharing layers (SharedBasisLinear) are not trained, only its "
                    "%d LowRankLinear layers", len(names))
    return names, mods


def _total_steps(batches: list, tokens: int | None, steps: int | None, accumulate: int) -> int:
    """Optimiser steps: for a ``tokens`` budget, ``steps``, or one pass over ``batches``."""
    per_batch = int(batches[0]["input_ids"].numel()) if "input_ids" in batches[0] else 1
    if tokens is not None and steps is not None:
        raise FisherkronError("give tokens= (a budget) or steps=, not both")
    if tokens is not None:
        return max(1, math.ceil(check_int(tokens, "tokens", minimum=1) / (accumulate * per_batch)))
    if steps is not None:
        return check_int(steps, "steps", minimum=1)
    return math.ceil(len(batches) / accumulate)


def _gradients(wrapped: nn.Module, batches: list, step: int, config: dict, loss_fn, dev,
               advice: str) -> tuple[float, int]:
    """Accumulate the gradients of step ``step``'s micro-batches in the LoRA weights, drawing dropout from the
    step's own seed; returns the mean loss and the tokens seen. A loss that is not finite stops the run
    before its backward (:func:`~fisherkron.hf.training.check_finite`)."""
    accumulate, seed = config["accumulate"], config["seed"]
    loss, step_tokens = 0.0, 0
    with torch.random.fork_rng(devices=_rng_devices(dev)):
        torch.manual_seed(seed * 1_000_003 + step + 1)
        for a in range(accumulate):
            b = batches[batch_index(step * accumulate + a, len(batches), seed)]
            value = loss_fn(wrapped, to_device(b, dev))
            v = float(value.detach())
            check_finite("LoRA recovery", step, config["steps"], v, advice=advice)  # before its backward
            (value / accumulate).backward()
            loss += v / accumulate
            step_tokens += int(b["input_ids"].numel()) if "input_ids" in b else 0
    return loss, step_tokens


def _put_back(wrapped, done: bool, saved: dict, mods: dict, flags: list, modes: list) -> None:
    """After the run: merge the LoRA update (``done``), or remove LoRA unmerged and put the factors back as they
    were; then each parameter's ``requires_grad`` flag and each module's mode."""
    if done:
        wrapped.merge_and_unload()
    else:
        if wrapped is not None:
            wrapped.unload()
        with torch.no_grad():
            for n, (W1, W2) in saved.items():
                mods[n].first.weight.copy_(W1)
                mods[n].second.weight.copy_(W2)
    for p, flag in flags:
        p.requires_grad_(flag)
    for m, mode in modes:
        m.training = mode


def _train(model: nn.Module, lora_cfg, mods: dict, batches: list, config: dict, key: str, state: dict | None,
           path: Path | None, *, checkpoint_every: int, loss_fn, callback, progress: bool) -> tuple:
    """The training loop of :func:`recover`: LoRA by ``lora_cfg`` on ``model``, trained with the hyperparameters
    of ``config`` (what the checkpoint key hashes), resumed from ``state``, then merged (or removed, on an
    error). Returns ``(steps, history, tokens, seconds, resumed_at, rebalancing scales)``."""
    names, total_steps, accumulate = config["layers"], config["steps"], config["accumulate"]
    lr, min_lr, max_grad_norm = config["lr"], config["min_lr"], config["max_grad_norm"]
    dev = next(model.parameters()).device
    flags = [(p, p.requires_grad) for p in model.parameters()]  # PEFT freezes every base parameter
    modes = [(m, m.training) for m in model.modules()]
    saved = {n: (mods[n].first.weight.detach().clone(), mods[n].second.weight.detach().clone())
             for n in names} if config["rebalance"] else {}
    what = "LoRA recovery"
    advice = (f"Lower the learning rate (lr={lr:g}), train in float32 or bfloat16 rather than float16, "
              f"or check loss_fn")
    step, history, seen, seconds, resumed_at, scales = 0, [], 0, 0.0, None, {}
    wrapped, bar, ready, done = None, None, False, False

    def snapshot() -> dict:
        return {"key": key, "lora": {n: p.detach().clone() for n, p in trainable.items()},
                "optimizer": opt.state_dict(), "step": step, "micro_batch": step * accumulate, "history": history,
                "tokens": seen, "seconds": seconds + time.perf_counter() - t0}

    t0 = time.perf_counter()
    with sigterm_as_interrupt():
        try:
            scales = rebalance_factors(model, names) if config["rebalance"] else {}
            with torch.random.fork_rng(devices=_rng_devices(dev)), warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
                torch.manual_seed(config["seed"])
                wrapped = require("peft", "hf").get_peft_model(model, lora_cfg)
            trainable = {n: p for n, p in wrapped.named_parameters() if p.requires_grad}
            opt = torch.optim.AdamW(list(trainable.values()), lr=lr, weight_decay=config["weight_decay"])
            if state is not None:
                with torch.no_grad():
                    for n, p in trainable.items():
                        p.copy_(state["lora"][n])
                opt.load_state_dict(state["optimizer"])
                step, history, seen, seconds = state["step"], state["history"], state["tokens"], state["seconds"]
                resumed_at = step
                log.info("recovery: resuming %s at step %d of %d", path, step, total_steps)
            ready = True
            bar = tqdm(total=total_steps, initial=step, desc="LoRA recovery", disable=not progress)
            wrapped.train()
            while step < total_steps:
                lr_t = lr * lr_factor(step, total_steps, config["warmup"], config["schedule"], min_lr / lr)
                for group in opt.param_groups:
                    group["lr"] = lr_t
                opt.zero_grad(set_to_none=True)
                loss, step_tokens = _gradients(wrapped, batches, step, config, loss_fn, dev, advice)
                check_finite(what, step, total_steps, loss, {n: p.grad for n, p in trainable.items()}, advice=advice)
                if max_grad_norm is not None:
                    torch.nn.utils.clip_grad_norm_(list(trainable.values()), max_grad_norm)
                record = {"step": step, "loss": loss, "lr": lr_t, "tokens": seen + step_tokens}
                with uninterrupted():
                    opt.step()
                    check_finite(what, step, total_steps, loss, trainable, kind="parameter", advice=advice)
                    history.append(record)
                    seen += step_tokens
                    step += 1
                bar.update(1)
                bar.set_postfix(loss=f"{loss:.4g}")
                if path is not None and (step % checkpoint_every == 0 or step == total_steps):
                    save_checkpoint(path, snapshot())
                if callback is not None:
                    callback(step, record)
            _check_merge(wrapped, what, step, total_steps, history[-1]["loss"] if history else float("nan"),
                         advice)
            done = True
        except KeyboardInterrupt:
            if ready:
                save_on_interrupt(path, snapshot, what, step, total_steps)
            raise
        finally:
            with uninterrupted():  # the model back whole, whatever arrives meanwhile
                if bar is not None:
                    bar.close()
                _put_back(wrapped, done, saved, mods, flags, modes)
    seconds += time.perf_counter() - t0
    return step, history, seen, seconds, resumed_at, scales


@timed("LoRA recovery")
def recover(model: nn.Module, batches, *, tokens: int | None = None, steps: int | None = None,
            accumulate: int = 1, lr: float = LORA["lr"], schedule: str = "cosine", warmup=0.05,
            min_lr: float = 0.0, weight_decay: float = 0.0, max_grad_norm: float | None = 1.0,
            lora_rank: int = LORA["rank"], lora_alpha: float = LORA["alpha"], lora_dropout: float = LORA["dropout"],
            targets: tuple[str, ...] = ("first", "second"), layers: list[str] | None = None,
            rebalance: bool = False, seed: int = 0, checkpoint=None, checkpoint_every: int = 50,
            loss_fn=None, callback=None, progress: bool = False) -> RecoveryReport:
    r"""Fine-tune the factors of every ``LowRankLinear`` with LoRA, then merge (in place; shapes kept).

    Args:
        model: a compressed model (``LowRankLinear`` layers, e.g. from :func:`fisherkron.compress`).
        batches: training batches with ``labels`` (e.g. :func:`~fisherkron.hf.data.lm_batches` of
            :func:`~fisherkron.hf.data.c4_documents`; check them with :func:`check_disjoint`).
        tokens: the token budget: ``ceil(tokens / (accumulate * tokens per batch))`` steps.
        steps: or the number of optimiser steps (default: one pass over ``batches``).
        accumulate: micro-batches per step (each epoch visits ``batches`` in a seeded order).
        lr, schedule, warmup, min_lr: AdamW's peak rate, ``"cosine"`` or ``"linear"`` decay to
            ``min_lr`` after ``warmup`` steps (an int) or that fraction of the steps (a float).
        weight_decay, max_grad_norm: AdamW's decay; gradient clipping (``None``: none).
        lora_rank, lora_alpha, lora_dropout: PEFT ``LoraConfig``'s ``r``, ``lora_alpha``, ``lora_dropout``.
        targets: which factors get LoRA: ``("first", "second")`` (``W_1``, ``W_2``) or one of them.
        layers: the ``LowRankLinear`` layers to train (default: all).
        rebalance: :func:`rebalance_factors` first (equal factor norms, same product).
        seed: LoRA's initialisation, the data order and dropout (each step reseeded from
            ``seed`` and its index, so a resumed run draws what the uninterrupted one drew).
        checkpoint: a file for the training state (LoRA weights, AdamW state, step, data
            position, loss curve); an existing one of the same run is resumed.
        checkpoint_every: steps between checkpoints (also written on Ctrl-C / SIGTERM).
        loss_fn: ``loss_fn(model, batch)`` (default ``model(**batch).loss``); not in the checkpoint's key.
        callback: ``callback(step, record)`` after every step.
        progress: tqdm bar.

    On an error or an interruption the LoRA layers are removed and the factors put back as
    they were, so ``model`` is unchanged (its parameters bit for bit, their ``requires_grad``
    flags, its train/eval mode). A loss, gradient or LoRA weight that is NaN or infinite stops
    the run at that step with :class:`~fisherkron.hf.training.NonFiniteTraining` (as does an
    update whose merge would overflow); ``min_lr > lr`` and a checkpoint folder that can not be
    written are refused before any work. Returns a :class:`RecoveryReport`.
    """
    peft = require("peft", "hf")
    batches = check_batches(batches)
    targets = _check_options(accumulate, checkpoint_every, lora_rank, lr, min_lr, lora_alpha, weight_decay,
                             max_grad_norm, lora_dropout, schedule, targets)
    names, mods = _layers(model, layers)
    total_steps = _total_steps(batches, tokens, steps, accumulate)
    warm = _warmup_steps(warmup, total_steps)
    loss_fn = loss_fn or default_loss
    shapes = {n: (mods[n].out_features, mods[n].in_features, mods[n].rank) for n in names}
    params_before = count_params(model)
    config = {"code": CODE_VERSION, "layers": names, "shapes": shapes, "targets": targets, "steps": total_steps,
              "accumulate": accumulate, "lr": lr, "schedule": schedule, "warmup": warm, "min_lr": min_lr,
              "weight_decay": weight_decay, "max_grad_norm": max_grad_norm, "lora": [lora_rank, lora_alpha,
                                                                                      lora_dropout],
              "rebalance": rebalance, "seed": seed, "data": data_fingerprint(batches),
              "model": model_fingerprint(model)}
    key = config_key(config)
    path = Path(checkpoint) if checkpoint is not None else None
    prepare_checkpoint(path)  # before the model is touched: an unwritable folder fails now
    state = load_checkpoint(path, key, "recovery")
    lora_cfg = peft.LoraConfig(r=lora_rank, lora_alpha=lora_alpha, lora_dropout=lora_dropout, bias="none",
                               target_modules=[f"{n}.{t}" for n in names for t in targets])
    step, history, seen, seconds, resumed_at, scales = _train(
        model, lora_cfg, mods, batches, config, key, state, path, checkpoint_every=checkpoint_every,
        loss_fn=loss_fn, callback=callback, progress=progress)
    after = dict(model.named_modules())
    for n, (rows, cols, r) in shapes.items():
        low = after[n]
        if not isinstance(low, LowRankLinear) or tuple(low.first.weight.shape) != (r, cols) or \
                tuple(low.second.weight.shape) != (rows, r):  # pragma: no cover - merge keeps shapes by construction
            raise FisherkronError(f"layer {n} lost its factor shapes in the LoRA merge")
    report = RecoveryReport(names, targets, {"rank": lora_rank, "alpha": lora_alpha, "dropout": lora_dropout},
                            step, seen, params_before, count_params(model), scales, history, seconds, resumed_at,
                            config)
    if report.params_after != report.params_before:  # pragma: no cover - guarded by the shape check above
        raise FisherkronError(f"the merge changed the parameter count {params_before:,} -> {report.params_after:,}")
    return report


# ----------------------------------------------------------------------------- training text vs evaluation text

_NOT_LETTER = bytes(c for c in range(128) if not ord("a") <= c <= ord("z"))  # the ASCII bytes that are no letter
_PTB_TOKENS = re.compile(r"<unk>|\bN\b")
_BASE = 0x100000001B3  # odd, so invertible modulo 2^64
_INV = pow(_BASE, -1, 1 << 64)


def normalise(text: str) -> str:
    """Lower-case letters only (PTB's ``<unk>`` and number token ``N`` dropped first): what :func:`check_disjoint` compares.

    >>> normalise("Don't stop -- N <unk> Believin' 1979!")
    'dontstopbelievin'
    """
    # what [^a-z] leaves of the lower-cased text: no character outside ASCII is a letter a-z, then ASCII's others
    return _PTB_TOKENS.sub(" ", text).lower().encode("ascii", "ignore").translate(None, _NOT_LETTER).decode("ascii")


def _window_hashes(s: str, span: int) -> np.ndarray:
    r"""``h_i = sum_{t<span} c_{i+t} B^t mod 2^64`` for every window of ``span`` characters of an ASCII string."""
    c = np.frombuffer(s.encode("ascii"), dtype=np.uint8).astype(np.uint64)  # (L,)
    if len(c) < span:
        return np.zeros(0, dtype=np.uint64)
    with np.errstate(over="ignore"):
        pw = np.concatenate([np.ones(1, np.uint64), np.cumprod(np.full(len(c) - 1, _BASE, dtype=np.uint64))])  # B^t
        inv = np.concatenate([np.ones(1, np.uint64), np.cumprod(np.full(len(c) - 1, _INV, dtype=np.uint64))])  # B^-t
        prefix = np.concatenate([np.zeros(1, np.uint64), np.cumsum(c * pw)])  # (L + 1,)
        return (prefix[span:] - prefix[:-span]) * inv[: len(c) - span + 1]  # (L - span + 1,)


@dataclass(frozen=True)
class Overlap:
    """Training document ``document`` shares the (normalised) ``text`` with evaluation source ``source``."""

    document: int
    source: str
    text: str


def _strings(value):
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _strings(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _strings(v)


def evaluation_texts(profile: str = "default") -> dict[str, list[str]]:
    """Every text the evaluations read: ``{source: [documents]}``.

    ``wiki_text`` (its articles), ``ptb_test`` and one entry per file of the local lm-eval tasks
    (:func:`~fisherkron.hf.lm_eval_tasks.write_tasks`: ARC-E/-C, PIQA, HellaSwag, WinoGrande,
    OpenBookQA and MMLU, their test/validation documents and the few-shot splits), each record's
    strings (question, choices, ...) joined. ``profile="paper"`` reads WikiText-2 and PTB from the hub.
    """
    from .data import ptb, wiki_text
    from .lm_eval_tasks import write_tasks

    out = {"wiki_text": wiki_text(profile=profile).split("\n\n"), "ptb_test": [ptb("test", profile=profile)]}
    root = write_tasks()
    for f in sorted(root.rglob("*.jsonl")):
        with open(f, encoding="utf-8") as fh:
            out[f.relative_to(root).with_suffix("").as_posix()] = [" ".join(_strings(json.loads(line)))
                                                                   for line in fh if line.strip()]
    return out


def check_disjoint(documents, evaluation: dict, *, span: int = OVERLAP_SPAN) -> list[Overlap]:
    """The training documents that share a span of ``span`` normalised letters with an evaluation text.

    ``documents``: the training documents (strings); ``evaluation``: ``{source: text or [texts]}``
    (:func:`evaluation_texts`). Both are :func:`normalise`-d; every window of ``span`` letters of
    every training document is hashed, the evaluation texts' windows are looked up, and each hit is
    confirmed by comparing the strings. A training document shorter than ``span`` letters is
    looked up whole. Returns one :class:`Overlap` per (document, source) pair found (empty: disjoint).

    >>> check_disjoint(["a quote: to be or not to be, that is the question"], {"play": "To be, or not to be"}, span=12)
    [Overlap(document=0, source='play', text='tobeornottob')]
    """
    check_int(span, "span", minimum=8)
    docs = [normalise(d) for d in documents]
    hashes, owner, start = [], [], []
    for i, d in enumerate(docs):
        h = _window_hashes(d, span)
        hashes.append(h)
        owner.append(np.full(len(h), i, dtype=np.int64))
        start.append(np.arange(len(h), dtype=np.int64))
    hashes, owner, start = (np.concatenate(a) if a else np.zeros(0, t) for a, t in
                            ((hashes, np.uint64), (owner, np.int64), (start, np.int64)))
    order = np.argsort(hashes, kind="stable")
    hashes, owner, start = hashes[order], owner[order], start[order]
    # which top bits the documents' windows have, in a table about eight times their number: most evaluation
    # windows miss it and are never searched for (a binary search of every window took most of the time)
    bits = min(26, max(16, (8 * len(hashes)).bit_length()))
    shift = np.uint64(64 - bits)
    present = np.zeros(1 << bits, dtype=bool)
    present[hashes >> shift] = True
    short = [i for i, d in enumerate(docs) if 0 < len(d) < span]
    found: dict[tuple[int, str], Overlap] = {}
    for source, texts in evaluation.items():
        pieces = [texts] if isinstance(texts, str) else list(texts)
        blob = "|".join(normalise(t) for t in pieces)  # "|" is no letter: no window of a document spans two
        for i in short:
            if docs[i] in blob:
                found[(i, source)] = Overlap(i, source, docs[i])
        if not len(hashes):
            continue
        h = _window_hashes(blob, span)
        cand = np.nonzero(present[h >> shift])[0]  # a window whose top bits no document window has cannot match
        hc = h[cand]
        at = np.minimum(np.searchsorted(hashes, hc), len(hashes) - 1)
        for idx in np.nonzero(hashes[at] == hc)[0]:
            pos = int(cand[idx])
            text = blob[pos:pos + span]
            k = int(at[idx])
            while k < len(hashes) and hashes[k] == hc[idx]:
                i, j = int(owner[k]), int(start[k])
                if (i, source) not in found and docs[i][j:j + span] == text:
                    found[(i, source)] = Overlap(i, source, text)
                k += 1
    return sorted(found.values(), key=lambda o: (o.document, o.source))


def assert_disjoint(documents, evaluation: dict | None = None, *, span: int = OVERLAP_SPAN) -> None:
    """:func:`check_disjoint` (against :func:`evaluation_texts` by default), raising a one-line error on an overlap."""
    hits = check_disjoint(documents, evaluation if evaluation is not None else evaluation_texts(), span=span)
    if hits:
        o = hits[0]
        raise FisherkronError(f"{len(hits)} training document/evaluation text pairs share a span of {span} letters, "
                              f"e.g. document {o.document} and {o.source}: {o.text[:60]!r}...; drop those documents")
