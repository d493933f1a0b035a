r"""FLOPs and measured speed of dense and factorised linear layers (paper App. F; Tabs. flops_comparison,
throughput_fwsvd, throughput_forward).

Counting convention, the one of ``torch.utils.flop_counter.FlopCounterMode``: 2 FLOPs per
multiply-add of a matrix product; norms, activations, softmax, bias additions and embedding
lookups are not counted. On ``T`` tokens a dense ``n x m`` layer costs ``2 T n m`` and its
rank-``r`` factorisation ``W_2 W_1`` costs ``2 T r (n + m)``: fewer FLOPs (and parameters)
exactly when ``r < n m / (n + m)`` (:func:`breakeven_rank`). Whether the factorisation is also
*faster* depends on the two thinner GEMMs and the extra call, so :func:`layer_speedup`
measures it; :func:`fisherkron.compress` uses it with ``min_speedup=`` to keep a layer dense
where factorising would slow it down.

* :func:`forward_flops`: analytic FLOPs of one forward pass of a Hugging Face transformer
  (decoder or encoder) holding dense and ``LowRankLinear`` layers, or of the same model with
  per-layer ranks applied on paper (``ranks=``): ``sum_l 2 T_l n_l m_l`` (``2 T_l r_l (n_l + m_l)``
  for a factorised layer) plus ``4 B H T (T + past) d_h`` per attention layer (``Q K^T`` and the
  product with ``V`` over every key, as the kernels compute them whatever the mask);
* :func:`counted_flops`: the same forward pass counted by ``FlopCounterMode`` on a ``meta``
  device twin of the model (:func:`meta_twin`: no weights are copied and nothing is computed);
* :func:`layer_speedup`: the measured time of a dense layer over that of its factorisation
  (median of interleaved repeats), cached per (shape, rank, tokens, device, dtype, threads).
"""
from __future__ import annotations

import copy
import itertools
import math
import re
import statistics
import time
from dataclasses import dataclass, field

import torch
from torch import nn

from ..core.checks import check_int, check_rank
from ..core.conventions import FisherkronError
from ..core.basis_sharing import SharedBasisLinear
from ..core.lowrank import LowRankLinear

__all__ = ["PER_SEQUENCE", "FlopCount", "linear_flops", "breakeven_rank", "forward_flops", "meta_twin",
           "counted_flops", "LayerSpeed", "layer_speedup", "clear_speed_cache"]

#: linear layers that run once per sequence, not once per token: an encoder's pooler and
#: sequence-classification head (BERT's ``pooler.dense``, ``classifier``; RoBERTa's
#: ``classifier.dense`` / ``classifier.out_proj``). A causal LM's head runs on every token.
PER_SEQUENCE = re.compile(r"(?:.*\.)?(?:pooler\.dense|classifier(?:\.dense|\.out_proj)?)")


def linear_flops(n: int, m: int, tokens: int, rank: int | None = None) -> int:
    """FLOPs of an ``n x m`` layer on ``tokens`` rows: ``2 T n m``, or ``2 T r (n + m)`` at rank ``r``.

    >>> linear_flops(3072, 768, 1), linear_flops(3072, 768, 1, rank=307)
    (4718592, 2357760)
    """
    if rank is None:
        return 2 * tokens * n * m
    return 2 * tokens * rank * (n + m)


def breakeven_rank(n: int, m: int) -> float:
    """``n m / (n + m)``: below it a rank-``r`` factorisation has fewer FLOPs and parameters than ``W``.

    >>> breakeven_rank(3072, 768)
    614.4
    """
    return n * m / (n + m)


@dataclass
class FlopCount:
    """FLOPs of one forward pass: ``linear`` (every linear layer), ``attention`` (``Q K^T`` and ``P V``)."""

    linear: int
    attention: int
    layers: dict[str, int] = field(default_factory=dict)  # FLOPs of each linear layer (a factorised one by its name)

    @property
    def total(self) -> int:
        return self.linear + self.attention


def _attention_shape(model: nn.Module) -> tuple[int, int, int]:
    """``(layers, query heads, head dim)`` from a Hugging Face config."""
    cfg = getattr(model, "config", None)
    cfg = getattr(cfg, "text_config", None) or cfg
    try:
        L, H = int(cfg.num_hidden_layers), int(cfg.num_attention_heads)
    except AttributeError:
        raise FisherkronError(f"forward_flops needs a transformer with config.num_hidden_layers and "
                              f"config.num_attention_heads; {type(model).__name__} has none") from None
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // H
    return L, H, int(d)


def forward_flops(model: nn.Module, batch_size: int, seq_len: int, *, past: int = 0,
                  ranks: dict[str, int | None] | None = None) -> FlopCount:
    """Analytic FLOPs of ``model`` on ``batch_size`` sequences of ``seq_len`` new tokens (App. F).

    ``sum_l 2 T_l n_l m_l`` over the linear layers (``2 T_l r_l (n_l + m_l)`` where a layer is a
    ``LowRankLinear`` of rank ``r_l``, or is given a rank in ``ranks``), with ``T_l = B T``, or
    ``B`` for the per-sequence heads of :data:`PER_SEQUENCE`; plus ``L * 4 B H T (T + past) d_h``
    for the attention products of ``L`` layers of ``H`` query heads of size ``d_h`` (``past``:
    tokens already in the KV cache, for a decoding step).

    Args:
        model: a Hugging Face model (dense, compressed, or on the ``meta`` device).
        batch_size, seq_len: ``B`` and ``T``.
        past: cached tokens each new token attends to besides the ``T`` new ones.
        ranks: ``{name: rank}`` of ``nn.Linear`` layers to count as factorised (``None``: dense).
    """
    B = check_int(batch_size, "batch_size", minimum=1)
    T = check_int(seq_len, "seq_len", minimum=1)
    past = check_int(past, "past", minimum=0)
    ranks = dict(ranks or {})
    mods = dict(model.named_modules())
    for name in ranks:
        if not isinstance(mods.get(name), nn.Linear):
            raise FisherkronError(f"ranks names {name!r}, which is not an nn.Linear of this model")
    lowrank = [name for name, mod in mods.items() if isinstance(mod, (LowRankLinear, SharedBasisLinear))]
    layers: dict[str, int] = {}
    for name, mod in mods.items():
        if any(name.startswith(p + ".") for p in lowrank):  # the two halves of a LowRankLinear: counted below
            continue
        tokens = B if PER_SEQUENCE.fullmatch(name) else B * T
        if isinstance(mod, (LowRankLinear, SharedBasisLinear)):  # a shared basis is applied to each layer's input
            layers[name] = linear_flops(mod.out_features, mod.in_features, tokens, mod.rank)
        elif isinstance(mod, nn.Linear):
            r = ranks.get(name)
            if r is not None:
                check_rank(r, mod.out_features, mod.in_features, f"layer {name}")
            layers[name] = linear_flops(mod.out_features, mod.in_features, tokens, r)
    L, H, d = _attention_shape(model)
    return FlopCount(sum(layers.values()), L * 4 * B * H * T * (T + past) * d, layers)


def meta_twin(model: nn.Module, ranks: dict[str, int | None] | None = None) -> nn.Module:
    """A copy of ``model`` on the ``meta`` device (shapes only, no memory), with ``ranks`` applied.

    Every parameter and buffer is replaced by an empty ``meta`` tensor of its shape (tied weights
    stay tied); each ``nn.Linear`` named in ``ranks`` becomes a ``LowRankLinear`` of that rank.
    """
    memo: dict[int, torch.Tensor] = {}
    for t in itertools.chain(model.parameters(), model.buffers()):
        empty = torch.empty_like(t, device="meta")
        memo[id(t)] = nn.Parameter(empty, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else empty
    twin = copy.deepcopy(model, memo)
    mods = dict(twin.named_modules())
    for name, r in (ranks or {}).items():
        lin = mods.get(name)
        if not isinstance(lin, nn.Linear):
            raise FisherkronError(f"ranks names {name!r}, which is not an nn.Linear of this model")
        if r is None:
            continue
        check_rank(r, lin.out_features, lin.in_features, f"layer {name}")
        twin.set_submodule(name, LowRankLinear(lin.in_features, lin.out_features, r, bias=lin.bias is not None,
                                               device="meta", dtype=lin.weight.dtype))
    return twin


def counted_flops(model: nn.Module, batch_size: int, seq_len: int, *,
                  ranks: dict[str, int | None] | None = None) -> int:
    """FLOPs of one forward pass on ``batch_size x seq_len`` token ids, counted by ``FlopCounterMode``.

    Runs on :func:`meta_twin` (shapes only: instant, no memory), where scaled-dot-product
    attention is counted too (the CPU kernel of PyTorch 2.13 is not registered with the counter).
    Equals :func:`forward_flops` for the Llama and BERT families (``tests/test_speed.py``).
    """
    from torch.utils.flop_counter import FlopCounterMode

    B = check_int(batch_size, "batch_size", minimum=1)
    T = check_int(seq_len, "seq_len", minimum=1)
    twin = meta_twin(model, ranks)
    ids = torch.zeros(B, T, dtype=torch.long, device="meta")
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        twin(input_ids=ids)
    return int(counter.get_total_flops())


# ----------------------------------------------------------------------------- measured speed

@dataclass
class LayerSpeed:
    """Median seconds of one call of a dense ``n x m`` layer and of its rank-``r`` factorisation."""

    n: int
    m: int
    rank: int
    tokens: int
    dense_s: float
    lowrank_s: float
    device: str

    @property
    def speedup(self) -> float:
        """``dense_s / lowrank_s``: above 1 the factorisation is faster."""
        return self.dense_s / self.lowrank_s

    @property
    def flop_speedup(self) -> float:
        """``n m / (r (n + m))``: the speedup the FLOP count predicts."""
        return self.n * self.m / (self.rank * (self.n + self.m))


_SPEED_CACHE: dict[tuple, LayerSpeed] = {}


def clear_speed_cache() -> None:
    """Forget the timings :func:`layer_speedup` has kept."""
    _SPEED_CACHE.clear()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _sample(fn, calls: int, device: torch.device) -> float:
    _sync(device)
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    _sync(device)
    return (time.perf_counter() - t) / calls


@torch.inference_mode()
def layer_speedup(n: int, m: int, rank: int, tokens: int = 1024, *, bias: bool = True, device=None,
                  dtype: torch.dtype = torch.float32, repeats: int = 7, min_time: float = 0.01,
                  cache: bool = True) -> LayerSpeed:
    """Measured time of ``nn.Linear(m, n)`` against ``LowRankLinear(m, n, rank)`` on ``tokens`` rows.

    Both modules are called as a model calls them (module overhead included) on the same
    random ``(tokens, m)`` input. Each sample times enough calls to last ``min_time``; dense and
    factorised samples alternate (so a change of machine load hits both) and the median of
    ``repeats`` samples is kept. Results are kept for the process, per (``n, m, rank, tokens,
    bias``, device, dtype, torch threads); ``cache=False`` measures again.

    >>> s = layer_speedup(64, 48, 48, tokens=8, repeats=3, min_time=0.001, cache=False)
    >>> (s.n, s.m, s.rank, s.flop_speedup < 1)
    (64, 48, 48, True)
    """
    check_int(tokens, "tokens", minimum=1)
    check_int(repeats, "repeats", minimum=1)
    rank = check_rank(rank, n, m, f"{n} x {m} layer")
    device = torch.device(device or "cpu")
    key = (n, m, rank, tokens, bool(bias), str(device), str(dtype), torch.get_num_threads())
    if cache and key in _SPEED_CACHE:
        return _SPEED_CACHE[key]
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, m, generator=gen).to(device, dtype)  # (T, m)
    dense = nn.Linear(m, n, bias=bias).to(device, dtype)  # W: (n, m)
    low = LowRankLinear(m, n, rank, bias=bias).to(device, dtype)  # W1: (r, m), W2: (n, r)
    fns = (lambda: dense(x), lambda: low(x))
    calls = []
    for fn in fns:  # warm-up, then enough calls per sample to last min_time
        fn(), fn()
        once = max(_sample(fn, 1, device), 1e-7)
        calls.append(max(1, math.ceil(min_time / once)))
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            times[i].append(_sample(fn, calls[i], device))
    out = LayerSpeed(n, m, rank, tokens, statistics.median(times[0]), statistics.median(times[1]), str(device))
    if cache:
        _SPEED_CACHE[key] = out
    return out
