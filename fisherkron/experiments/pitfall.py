r"""The pitfall of App. "Impact of diagonal ...": GFWSVD with the output-side Cholesky factor untransposed, as a
public reimplementation (lems-svd/lems) computes it.

Eq. (7) weighs ``W`` by ``L_B^T W L_A``; with ``L_B`` in place of ``L_B^T`` the best rank-``r`` fit is taken in
another metric, and the two agree only where ``L_B`` is diagonal or at full rank. The decoder study
(:class:`~fisherkron.experiments.llm_compression.Study`) scores the untransposed variant beside GFWSVD.
"""
from __future__ import annotations

import torch
from torch import nn
from tqdm.auto import tqdm

__all__ = ["transposed_decomposition", "compress_transposed"]


def transposed_decomposition(W: torch.Tensor, L_A: torch.Tensor | None, L_B: torch.Tensor | None, *,
                             name: str = "weight", dtype: torch.dtype = torch.float64):
    r"""GFWSVD with the output-side Cholesky factor untransposed, as lems-svd/lems computes it.

    Eq. (7) is ``W_r = L_B^{-T} SVD_r(L_B^T W L_A) L_A^{-1}``. lems' ``_factorize_matrix`` (in the
    ``nn.Linear`` layout ``W``: ``n x m``, out x in; its ``A`` is the output-side factor, our ``B``)
    computes ``W_r = L_B^{-1} SVD_r(L_B W L_A) L_A^{-1}``: the best rank-``r`` fit in the metric
    ``L_B^T L_B (x) ...`` instead of ``B = L_B L_B^T``. Both agree when ``L_B`` is diagonal (FWSVD's
    case, and ``A = B = I``) and at full rank. Returns the
    :class:`~fisherkron.core.wsvd.Decomposition` (its ``factors(r)`` slice every rank), built by the
    same kernel with ``L_B^T`` in the left weight's place.
    """
    from ..core.wsvd import decompose

    left = None if L_B is None else (L_B if L_B.ndim == 1 else L_B.T)  # the kernel transposes it back: L_B W
    return decompose(W, left, L_A, dtype=dtype, name=name)


def compress_transposed(model: nn.Module, stats, ranks: dict, *, mff_options: dict | None = None,
                        progress: bool = False) -> dict:
    """Replace each layer of ``ranks`` (``None``: kept dense) in place by its :func:`transposed_decomposition`
    factors at that rank, from GFWSVD's own regularised ``L_A``, ``L_B`` (MFF's factors, as
    :func:`fisherkron.compress` reads them). Returns the selected layers' parameter counts and ratio."""
    from ..core.lowrank import LowRankLinear, compression_ratio, lowrank_params
    from ..core.methods import method_weights
    from ..hf.sensitivity import layer_statistics

    mods = dict(model.named_modules())
    new, before, after = {}, 0, 0
    for name, r in tqdm(ranks.items(), desc="compress (transposed GFWSVD)", disable=not progress):
        lin = mods[name]
        W = lin.weight.detach()  # (n, m)
        n, m = W.shape
        has_bias = lin.bias is not None
        dense = n * m + (n if has_bias else 0)
        before += dense
        if r is None:
            after += dense
            continue
        given = layer_statistics(stats, "gfwsvd", name, mff_options)
        w = method_weights("gfwsvd", n, m, A=given["A"], B=given["B"], layer=name)  # left L_B, right L_A
        W2, W1 = transposed_decomposition(W, w.right, w.left, name=name).factors(r, name)
        new[name] = LowRankLinear.from_factors(W2.to(W.dtype), W1.to(W.dtype),
                                               lin.bias.detach() if has_bias else None).to(W.device)
        after += lowrank_params(n, m, r, has_bias)
    for name, low in new.items():
        model.set_submodule(name, low)
    return {"layer_params_before": before, "layer_params_after": after,
            "layers_ratio": compression_ratio(before, after)}
