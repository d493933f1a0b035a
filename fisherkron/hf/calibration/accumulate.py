"""Collection and accumulation: one forward + backward per batch, the per-batch gradients ``G_i`` and the sums.

Eq. (8): ``I_F = (1/k) sum_i vec(G_i) vec(G_i)^T`` with ``G_i = dL_i/dW``. Forward hooks
see every selected layer's inputs ``x_t`` (tokens kept by the attention mask); backward hooks
its output gradients ``delta_t``. :func:`accumulate` hands each ``G_i`` to a store (a file, or
a rank's rows of a shared file) and keeps the running sums the baselines need;
:func:`save_statistics` turns the sums into the entry's arrays.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from ...core.conventions import FisherkronError

__all__ = ["accumulate", "save_statistics"]


def accumulate(model, batches, indices, names, modules, stats, loss_fn, store, progress: bool, store_rows=None,
               acc=None, tokens=None, after_batch=None, total: int | None = None):
    """One forward + backward for each batch ``i`` in ``indices``; per-layer sums and token counts.

    ``store(name, i, G_i)`` keeps each gradient. Returns ``(acc, tokens)``: per layer the sums
    ``g2 = sum_i G_i o G_i``, ``abs_sum = sum_t |x_t|``, ``xxt = sum_t x_t x_t^T`` and
    ``ddt = sum_t delta_t delta_t^T`` over these batches (absent when no batch was run).
    ``store_rows(kind, name, rows)``, when given, receives each batch's layer inputs
    (``kind="X"``, ``(T_b, m)``) and output gradients (``"D"``, ``(T_b, n)``): the per-token form.
    ``acc`` / ``tokens``: sums to continue (a resumed collection); ``after_batch(i, acc, tokens)``
    runs after each batch is complete; ``total``: the number of batches the progress bar shows.
    """
    want_act = any(s in stats for s in ("abs_mean", "xxt", "kfac")) or store_rows is not None
    acc = acc if acc is not None else {n: {} for n in names}
    tokens = tokens if tokens is not None else {n: 0 for n in names}
    mask_holder: dict[str, torch.Tensor | None] = {"mask": None}
    shared_gram: dict = {}

    def rows(t: torch.Tensor) -> torch.Tensor:
        mask = mask_holder["mask"]
        if mask is not None and t.dim() == 3 and t.shape[:2] == mask.shape:
            return t[mask]  # (T_kept, features)
        return t.reshape(-1, t.shape[-1])

    def make_hook(n):
        def fwd(mod, inp, outp):
            x_in = inp[0].detach()
            x = rows(x_in).float()  # (T, m)
            a = acc[n]
            tokens[n] += x.shape[0]
            if store_rows is not None:
                store_rows("X", n, x)
            # layers fed by the same tensor (q/k/v, gate/up) share one X X^T per batch
            shared = (x_in.data_ptr(), tuple(x_in.shape), x_in._version)
            if "abs_mean" in stats:
                s = x.abs().sum(0).double()
                a["abs_sum"] = s if "abs_sum" not in a else a["abs_sum"] + s
            if "xxt" in stats or "kfac" in stats:
                if shared_gram.get("key") != shared:
                    shared_gram["key"], shared_gram["val"] = shared, (x.T @ x).double()  # (m, m)
                g = shared_gram["val"]
                a["xxt"] = g.clone() if "xxt" not in a else a["xxt"].add_(g)
            if ("kfac" in stats or store_rows is not None) and outp.requires_grad:
                def bwd(grad):
                    d = rows(grad.detach()).float()  # (T, n)
                    if store_rows is not None:
                        store_rows("D", n, d)
                    if "kfac" in stats:
                        dd = (d.T @ d).double()  # (n, n)
                        a["ddt"] = dd if "ddt" not in a else a["ddt"] + dd
                outp.register_hook(bwd)
        return fwd

    flags = {p: p.requires_grad for p in model.parameters()}
    was_training = model.training
    handles = [modules[n].register_forward_hook(make_hook(n)) for n in names] if want_act else []
    try:
        for p in model.parameters():
            p.requires_grad_(False)
        for n in names:
            modules[n].weight.requires_grad_(True)
        model.eval()
        device = next(model.parameters()).device
        indices = list(indices)
        start = total - len(indices) if total is not None else 0
        for i in tqdm(indices, desc="calibration", disable=not progress, initial=start,
                      total=total if total is not None else len(indices)):
            batch = batches[i]
            if isinstance(batch, dict):
                batch = {key: v.to(device) if isinstance(v, torch.Tensor) else v for key, v in batch.items()}
            mask = batch.get("attention_mask") if isinstance(batch, dict) else None
            mask_holder["mask"] = mask.bool() if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None
            shared_gram.clear()
            for n in names:
                modules[n].weight.grad = None
            loss = loss_fn(model, batch)
            if not torch.isfinite(loss):
                raise FisherkronError(f"loss of batch {i} is {float(loss)}; check the data (nothing was cached)")
            loss.backward()
            for n in names:
                G = modules[n].weight.grad  # (n, m)
                if G is None:
                    raise FisherkronError(f"layer {n} got no gradient in batch {i}; is it used by the loss?")
                if not torch.isfinite(G).all():
                    raise FisherkronError(f"gradient of layer {n} in batch {i} has NaN/inf entries "
                                          f"(nothing was cached)")
                if "grads" in stats:
                    store(n, i, G)
                if "diag_fisher" in stats:
                    Gf = G.detach().float()
                    if "g2" not in acc[n]:
                        acc[n]["g2"] = torch.zeros_like(Gf)  # (n, m) float32: k is small
                    acc[n]["g2"].addcmul_(Gf, Gf)
                modules[n].weight.grad = None
            if after_batch is not None:
                after_batch(i, acc, tokens)
    finally:
        for h in handles:
            h.remove()
        for p, f in flags.items():
            p.requires_grad_(f)
        model.train(was_training)
    return acc, tokens


def save_statistics(acc, tokens, k: int, names, stats, out: Path) -> None:
    """Eq. (8)'s diagonal ``(1/k) sum_i G_i o G_i``, ``mean |x|``, ``X X^T`` and ``sum delta delta^T`` to ``out``."""
    for n in names:
        a = acc[n]
        if "diag_fisher" in stats:
            np.save(out / f"{n}.diag_fisher.npy", (a["g2"].double() / k).cpu().numpy())
        if "abs_mean" in stats:
            np.save(out / f"{n}.abs_mean.npy", (a["abs_sum"] / max(tokens[n], 1)).float().cpu().numpy())
        if "xxt" in stats or "kfac" in stats:
            np.save(out / f"{n}.xxt.npy", a["xxt"].cpu().numpy())
        if "kfac" in stats:
            if "ddt" not in a:
                raise FisherkronError(f"layer {n}: no output gradients were seen for K-FAC")
            np.save(out / f"{n}.ddt.npy", a["ddt"].cpu().numpy())
