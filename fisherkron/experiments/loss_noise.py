r"""How far a measured loss change stands above its noise: the per-token losses behind the decoder study's
held-out loss and perplexities, and the sweep's noise (Sec. 6.3).

ASVD's sensitivity sweep ranks layers by the loss change of compressing each one alone on a few thousand
held-out tokens. :func:`sweep_noise` measures, for the layers the sweep finds least sensitive, whether
those changes stand above the token-to-token spread of the loss at the sweep's size; :func:`window_losses`
keeps a perplexity's per-window negative log-likelihoods, so that two compressed models' log-perplexity gap
gets a paired standard error.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import nn
from tqdm.auto import tqdm

from ..core.errors import FisherkronError

if TYPE_CHECKING:
    from .llm_compression import Study

__all__ = ["token_losses", "window_losses", "difference_noise", "sweep_noise"]


@torch.no_grad()
def token_losses(model: nn.Module, batches) -> torch.Tensor:
    """``(S, T-1)`` negative log-likelihood of every predicted token of every sequence (float64).

    Their mean over a batch is ``model(**batch).loss``, the loss the sweep measures.
    """
    rows = []
    for b in batches:
        x = b["input_ids"]  # (B, T)
        logits = model(input_ids=x, attention_mask=b.get("attention_mask")).logits.float()  # (B, T, V)
        logp = torch.log_softmax(logits[:, :-1], dim=-1)  # (B, T-1, V): predicts x[:, 1:]
        labels = b.get("labels", x)[:, 1:]  # (B, T-1)
        rows.append(-logp.gather(-1, labels[..., None]).squeeze(-1).double())  # (B, T-1)
    return torch.cat(rows)


@torch.no_grad()
def window_losses(model: nn.Module, ids: torch.Tensor, seq_len: int) -> dict:
    """The summed negative log-likelihood of each window of ``ids`` as :func:`fisherkron.perplexity` scores them
    (non-overlapping ``seq_len``-token windows, the tail dropped, ``seq_len - 1`` tokens predicted in each):
    ``{"nll": [per window], "tokens": per window}``. ``exp(sum(nll) / (windows * tokens))`` is the perplexity;
    two cases' per-window differences give a paired standard error of their log-perplexity gap."""
    if ids.numel() < seq_len:
        raise FisherkronError(f"the text has {ids.numel()} tokens, fewer than seq_len={seq_len}; lower seq_len")
    nll = []
    for b in range(0, ids.numel() - seq_len + 1, seq_len):
        x = ids[b:b + seq_len][None]  # (1, T)
        logp = torch.log_softmax(model(input_ids=x).logits.float()[:, :-1], dim=-1)  # (1, T-1, V)
        nll.append(-float(logp.gather(-1, x[:, 1:, None]).double().sum()))
    return {"nll": nll, "tokens": seq_len - 1}


def difference_noise(d: torch.Tensor) -> dict:
    r"""Mean and standard errors of per-token loss differences ``d`` (``S`` sequences x ``T`` tokens).

    ``se_token = sd(d) / sqrt(S T)`` treats tokens as independent (the standard error of per-token
    loss differences); ``se_sequence = sd(dbar_s) / sqrt(S)`` uses the per-sequence means, which is
    honest when the tokens of one sequence are correlated (and coarse when ``S`` is small).

    >>> r = difference_noise(torch.tensor([[1.0, -1.0], [1.0, -1.0]]))
    >>> r["mean"], round(r["sd_token"], 6), round(r["se_token"], 6)
    (0.0, 1.154701, 0.57735)
    """
    d = torch.as_tensor(d, dtype=torch.float64)
    if d.ndim != 2 or d.numel() < 2:
        raise FisherkronError(f"d must be a (sequences, tokens) tensor with at least two entries, got {tuple(d.shape)}")
    S, T = d.shape
    sd = float(d.reshape(-1).std(unbiased=True))
    seq = d.mean(1)  # (S,)
    sd_seq = float(seq.std(unbiased=True)) if S > 1 else float("nan")
    return {"mean": float(d.mean()), "sd_token": sd, "se_token": sd / math.sqrt(S * T), "sd_sequence": sd_seq,
            "se_sequence": sd_seq / math.sqrt(S), "sequences": S, "tokens": S * T}


@torch.no_grad()
def sweep_noise(study: Study, method: str, *, ratio: float | None = None, n_layers: int = 8,
                progress: bool = False) -> list[dict]:
    r"""How far the least sensitive layers' loss changes stand above the sweep's noise.

    The sweep of ``method`` (cached) ranks the layers by their loss change at the gentlest candidate
    ``ratio`` (default: the smallest of the protocol's); the ``n_layers`` with the smallest change are
    compressed alone again at that rank and their per-token loss differences to the dense model are
    measured on the selection batches, which the sweep did not see (so choosing the layers does not bias
    the measurement). Per layer: the change on the sweep's batches, the change ``delta`` and the
    per-token spread ``sd`` on the selection batches, the standard error at the sweep's token count
    ``sd / sqrt(T_sweep)`` (per-token, and per-sequence), ``z = delta / se`` and the tokens that a
    change of that size needs to stand two standard errors above the noise, ``(2 sd / delta)^2``.
    """
    from ..core.lowrank import LowRankLinear, rank_for_ratio

    p = study.protocol
    ratio = min(p.sens_ratios) if ratio is None else ratio
    decs = study.decompositions_of(method)
    sweep = study.sweep(method, progress=progress)
    mods = dict(study.model.named_modules())
    ranked = []
    for name in study.names:
        n, m = mods[name].weight.shape
        r = rank_for_ratio(n, m, ratio)
        if r in sweep["table"][name]:
            ranked.append((sweep["table"][name][r], name, r))
    ranked.sort()
    base = token_losses(study.model, study.select_batches)  # (S, T-1)
    t_sweep = sum(b["input_ids"].shape[0] * (b["input_ids"].shape[1] - 1) for b in study.sweep_batches)
    s_sweep = sum(b["input_ids"].shape[0] for b in study.sweep_batches)
    rows = []
    for delta_sweep, name, r in tqdm(ranked[:n_layers], desc=f"sweep noise ({method})", disable=not progress):
        lin = mods[name]
        dec, _ = decs.get(lin, method, study.stats, name, mff_options=study.mff_options)
        W2, W1 = dec.factors(r, name)
        low = LowRankLinear.from_factors(W2.to(lin.weight.dtype), W1.to(lin.weight.dtype),
                                         lin.bias.detach() if lin.bias is not None else None)
        study.model.set_submodule(name, low)
        try:
            d = token_losses(study.model, study.select_batches) - base  # (S, T-1)
        finally:
            study.model.set_submodule(name, lin)
        noise = difference_noise(d)
        se_sweep = noise["sd_token"] / math.sqrt(t_sweep)
        se_seq_sweep = noise["sd_sequence"] / math.sqrt(s_sweep)
        delta = noise["mean"]
        rows.append({"layer": name, "rank": r, "ratio": ratio, "delta_sweep": float(delta_sweep), "delta": delta,
                     "sd_token": noise["sd_token"], "se_token_selection": noise["se_token"],
                     "se_token_sweep": se_sweep, "se_sequence_sweep": se_seq_sweep,
                     "z_sweep": delta / se_sweep if se_sweep > 0 else float("inf"),
                     "tokens_needed": (2 * noise["sd_token"] / delta) ** 2 if delta != 0 else float("inf"),
                     "sweep_tokens": t_sweep, "selection_tokens": noise["tokens"]})
    return rows
