r"""FLOPs and inference speed of compressed decoders (App. F; Tabs. flops_comparison, throughput_fwsvd,
throughput_forward).

A rank-``r`` factorisation of an ``n x m`` layer turns ``2 T n m`` FLOPs into ``2 T r (n + m)``
(:mod:`fisherkron.hf.speed`), but the whole model also spends FLOPs where compression does not
reach (the LM head, the attention products ``Q K^T`` and ``P V``), and thin GEMMs run below
the machine's peak. This module measures what is left of the FLOP saving in wall time:

* :func:`flop_rows`: analytic and counted FLOPs of one forward pass at each compression ratio
  (uniform per-layer ratio, :func:`fisherkron.plan_ranks`), on the model itself or on a
  ``meta``-device model built from a config alone (:func:`meta_model`, e.g. Llama-2-7B's, for the
  paper's table without its weights);
* :func:`time_forward`: tokens per second of one forward pass over ``B x T`` tokens (the prefill;
  Tab. throughput_fwsvd: ``B = 1``, ``T = 1024``);
* :func:`time_decode`: seconds of one decoding step, one new token for each of ``B`` sequences
  that attend to ``context`` cached tokens (Tab. throughput_forward's "latency per token" at
  batch 16 and 64);
* :func:`layer_rows`: the measured speedup of each distinct layer shape at each rank
  (:func:`fisherkron.hf.speed.layer_speedup`), to see which factorised layers are slower.

All timings are medians of repeated runs after warm-up; random token ids (speed does not depend
on them).
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch
from torch import nn

from ..core.checks import check_int
from ..core.conventions import FisherkronError

__all__ = ["LLAMA2_7B", "CONFIGS", "PAPER_FLOPS", "PAPER_TOKENS_PER_S", "PAPER_MS_PER_TOKEN", "load", "meta_model",
           "uniform_ranks", "flop_rows", "Timing", "time_forward", "time_decode", "layer_rows"]

#: ``config.json`` of meta-llama/Llama-2-7b-chat-hf (the architecture fields): enough to count its FLOPs.
LLAMA2_7B = dict(model_type="llama", hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096,
                 rms_norm_eps=1e-5, hidden_act="silu", tie_word_embeddings=False)
#: Tab. flops_comparison (Llama 2 7B Chat, "trillions of FLOPs"): full model and compressed, by ratio.
PAPER_FLOPS = {"full": 53.05e12, 0.10: 42.43e12, 0.15: 39.24e12, 0.20: 37.18e12, 0.40: 31.83e12, 0.50: 29.37e12}
#: Tab. throughput_fwsvd (Llama 2 7B Chat, FWSVD, A100, batch 1, 1,024 tokens): tokens/s by ratio.
PAPER_TOKENS_PER_S = {0.0: 1186.0, 0.10: 1269.0, 0.20: 1323.0, 0.40: 1510.0, 0.50: 1600.0}
#: Tab. throughput_forward (GFWSVD, A100): milliseconds per token, by batch size and ratio.
PAPER_MS_PER_TOKEN = {16: {0.0: 3.2, 0.10: 3.0, 0.15: 2.8, 0.20: 2.6, 0.40: 2.3, 0.50: 2.15},
                      64: {0.0: 4.7, 0.10: 4.5, 0.15: 4.2, 0.20: 4.0, 0.40: 3.3, 0.50: 2.95}}


#: model name -> architecture config, for :func:`meta_model`
CONFIGS = {"meta-llama/Llama-2-7b-chat-hf": LLAMA2_7B}


def load(model_name: str, method: str, *, k: int = 4, batch_size: int = 2, seq_len: int = 256,
         calib_docs: int = 500, data_profile: str = "default", layers=None, seed: int = 0, progress: bool = False):
    """``(model, tokenizer, stats)``: the model and, if ``method`` reads statistics, its calibration.

    The calibration is :func:`fisherkron.experiments.spectrum.calibrate`'s (for SmolLM2: the
    rank-allocation study's C4 setting and cache entry); ``stats`` is ``None`` for ``svd``.
    """
    from ..core.methods import method as method_row
    from ..hf.registry import load_model
    from .spectrum import calibrate

    if method_row(method).needs:
        return calibrate(model_name, k=k, batch_size=batch_size, seq_len=seq_len, seed=seed, calib_docs=calib_docs,
                         layers=layers, data_profile=data_profile, progress=progress)
    model, tok = load_model(model_name)
    return model, tok, None


def meta_model(config: dict) -> nn.Module:
    """A causal LM built from ``config`` (``model_type`` + architecture fields) on the ``meta`` device.

    Shapes only: no memory, no weights, no download; for :func:`flop_rows` at paper scale.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(config)
    cfg_obj = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(cfg_obj)


def uniform_ranks(model: nn.Module, ratio: float, layers=None) -> dict[str, int]:
    """Ranks of :func:`fisherkron.compress` with ``ratio=`` (one per-layer ratio for every layer); ``{}`` at 0."""
    from ..hf.calibration import select_layers
    from ..hf.surgery import plan_ranks

    if ratio == 0:
        return {}
    return plan_ranks(model, select_layers(model, layers), ratio=ratio)


def flop_rows(model: nn.Module, ratios, *, batch_size: int = 1, seq_len: int = 1024, layers=None,
              count: bool = True) -> list[dict]:
    """FLOPs of one forward pass of ``model`` compressed at each ratio (uniform ranks), analytic and counted.

    Each row: ``ratio`` (target), ``params_ratio`` (achieved), ``flops`` (analytic total),
    ``linear_flops``, ``attention_flops``, ``counted_flops`` (``FlopCounterMode`` on a meta twin;
    with ``count``), ``flop_ratio`` (compressed / dense).
    """
    from ..hf.speed import counted_flops, forward_flops
    from ..hf.surgery import count_params

    mods = dict(model.named_modules())
    total = count_params(model)
    dense = forward_flops(model, batch_size, seq_len).total
    rows = []
    for ratio in ratios:
        ranks = uniform_ranks(model, ratio, layers)
        removed = sum(mods[n].out_features * mods[n].in_features - r * (mods[n].out_features + mods[n].in_features)
                      for n, r in ranks.items())
        f = forward_flops(model, batch_size, seq_len, ranks=ranks)
        row = {"ratio": ratio, "params_ratio": removed / total, "flops": f.total, "linear_flops": f.linear,
               "attention_flops": f.attention, "flop_ratio": f.total / dense}
        if count:
            row["counted_flops"] = counted_flops(model, batch_size, seq_len, ranks=ranks)
        rows.append(row)
    return rows


# ----------------------------------------------------------------------------- timing

@dataclass
class Timing:
    """Seconds of each timed run of a call that processes ``tokens`` tokens."""

    seconds: list[float]
    tokens: int
    what: str = ""
    details: dict = field(default_factory=dict)

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.median

    @property
    def ms_per_step(self) -> float:
        return 1e3 * self.median


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def _ids(model: nn.Module, batch_size: int, seq_len: int, seed: int = 0) -> torch.Tensor:
    vocab = int(model.config.vocab_size)
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch_size, seq_len), generator=g).to(_device(model))  # (B, T)


def _timed(fn, *, warmup: int, repeats: int, device: torch.device, between=None) -> list[float]:
    for _ in range(warmup):
        fn()
        if between is not None:
            between()
    out = []
    for _ in range(repeats):
        _sync(device)
        t = time.perf_counter()
        fn()
        _sync(device)
        out.append(time.perf_counter() - t)
        if between is not None:
            between()
    return out


@torch.inference_mode()
def time_forward(model: nn.Module, batch_size: int = 1, seq_len: int = 1024, *, warmup: int = 1,
                 repeats: int = 3) -> Timing:
    """One forward pass over ``batch_size x seq_len`` random tokens (logits of every position, no cache).

    ``Timing.tokens_per_s`` is ``B T / median seconds``: the prefill throughput.
    """
    check_int(warmup, "warmup", minimum=0), check_int(repeats, "repeats", minimum=1)
    ids = _ids(model, batch_size, seq_len)
    secs = _timed(lambda: model(input_ids=ids, use_cache=False), warmup=warmup, repeats=repeats,
                  device=_device(model))
    return Timing(secs, batch_size * seq_len, f"forward B={batch_size} T={seq_len}")


@torch.inference_mode()
def time_decode(model: nn.Module, batch_size: int = 16, context: int = 1024, *, warmup: int = 2,
                repeats: int = 10) -> Timing:
    """One decoding step: a new token for each of ``batch_size`` sequences with ``context`` cached tokens.

    The KV cache comes from one prefill of a single ``context``-token sequence, repeated
    ``batch_size`` times (its contents do not change the step's cost); after each step it is
    cropped back to ``context`` tokens, so every timed step attends to the same length.
    ``Timing.ms_per_step`` is the latency of one generated token (per sequence of the batch);
    ``Timing.tokens_per_s`` counts the ``batch_size`` tokens a step produces.
    """
    check_int(warmup, "warmup", minimum=0), check_int(repeats, "repeats", minimum=1)
    check_int(batch_size, "batch_size", minimum=1), check_int(context, "context", minimum=1)
    out = model(input_ids=_ids(model, 1, context), use_cache=True)
    cache = out.past_key_values
    if cache is None or not hasattr(cache, "crop"):
        raise FisherkronError(f"{type(model).__name__} returned no croppable KV cache; time_decode needs a "
                              f"decoder with a DynamicCache")
    cache.batch_repeat_interleave(batch_size)
    nxt = _ids(model, batch_size, 1, seed=1)  # (B, 1)

    def crop() -> None:  # drop the tokens the step appended (a negative crop removes that many)
        extra = cache.get_seq_length() - context
        if extra > 0:
            cache.crop(-extra)

    secs = _timed(lambda: model(input_ids=nxt, past_key_values=cache, use_cache=True), warmup=warmup,
                  repeats=repeats, device=_device(model), between=crop)
    if cache.get_seq_length() != context:
        raise FisherkronError(f"the KV cache holds {cache.get_seq_length()} tokens after cropping, not {context}")
    return Timing(secs, batch_size, f"decode B={batch_size} context={context}")


def layer_rows(model: nn.Module, ratios, tokens, *, layers=None, repeats: int = 7) -> list[dict]:
    """Measured speedup of every distinct (shape, rank) the uniform ranks of ``ratios`` give, at each token count.

    Rows: ``ratio``, ``n``, ``m``, ``rank``, ``layers`` (how many layers share it), ``tokens``,
    ``dense_ms``, ``lowrank_ms``, ``speedup``, ``flop_speedup``.
    """
    from ..hf.speed import layer_speedup

    mods = dict(model.named_modules())
    p = next(model.parameters())
    rows = []
    for ratio in ratios:
        groups: dict[tuple, int] = {}
        for name, r in uniform_ranks(model, ratio, layers).items():
            key = (mods[name].out_features, mods[name].in_features, r, mods[name].bias is not None)
            groups[key] = groups.get(key, 0) + 1
        for (n, m, r, bias), count in groups.items():
            for t in tokens:
                s = layer_speedup(n, m, r, t, bias=bias, device=p.device, dtype=p.dtype, repeats=repeats)
                rows.append({"ratio": ratio, "n": n, "m": m, "rank": r, "layers": count, "tokens": t,
                             "dense_ms": 1e3 * s.dense_s, "lowrank_ms": 1e3 * s.lowrank_s,
                             "speedup": s.speedup, "flop_speedup": s.flop_speedup})
    return rows
