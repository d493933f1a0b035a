"""The paper's method, with nothing but torch, numpy and scipy (Secs. 3-5).

=====================  =====================================================================
module                 what it holds
=====================  =====================================================================
``conventions``        ``vec`` (column-major), ``unvec``, ``kron``: the one convention
``operators``          the rearranged Fisher ``R(F)`` as a matrix-free operator (Sec. 4.1)
``gradient_stack``     a layer's per-batch gradients, resident, memory-mapped or streamed in chunks
``stored``             gradients on disk: the 16-bit encodings and what a gradient source may hold
``factorization``      MFF, Algorithm 1: ``F ~= A (x) B`` by Lanczos on ``R(F)`` (Sec. 4)
``distributed``        data-parallel MFF over a ``torch.distributed`` group: one all-reduce per product
``kfac``               K-FAC factors, MFF's warm start
``regularization``     making ``A``, ``B`` positive definite (Sec. 5, "Singularity")
``shrinkage``          ``A``, ``B`` shrunk toward their diagonals, the intensity from split halves
``wsvd``               the weighted SVD: GFWSVD (Theorem 1, Eq. (7)) and its special cases
``methods``            the compression methods in one table
``allocation``         per-layer ranks under a budget from Theorem 1's predicted error curves
``lowrank``            ``LowRankLinear``: ``W ~= W2 W1`` as a module
``basis_sharing``      Basis Sharing: one whitened input basis shared by a group of layers
``checks``             input validation (one-line :class:`FisherkronError`)
``errors``             :class:`FisherkronError`, the one exception type (no torch needed to raise or catch it)
``phases``             where a process's seconds go: wall time per named phase, in provenance records
=====================  =====================================================================

Nothing here imports from the layers above it (``fisherkron.hf``, ``fisherkron.experiments``,
``fisherkron.cli``); ``tests/test_layout.py`` checks this on the import graph.

The names below are imported from their modules on first use (PEP 562), so ``import fisherkron.core`` alone
imports no torch: the repository's tooling, which needs only :mod:`errors` and :mod:`phases`, starts in a
fraction of a second instead of the three that torch and scipy take.
"""
from __future__ import annotations

import importlib

#: every public name, by the module that defines it
_EXPORTS = {
    "errors": ("FisherkronError",),
    "conventions": ("vec", "unvec", "kron"),
    "operators": ("rearranged_fisher", "RearrangedFisher", "matvec_flops"),
    "gradient_stack": ("GradientStack",),
    "factorization": ("mff", "MFFResult", "kronecker_terms", "MFF_DTYPES", "mff_dtype"),
    "kfac": ("kfac_factors", "KFACFactors"),
    "regularization": ("regularize", "Regularized", "MIN_ALPHA"),
    "shrinkage": ("shrink_to_diagonal", "split_half_intensity"),
    "wsvd": ("weighted_svd", "gfwsvd", "svd", "fwsvd", "fwsvd_rows", "asvd", "svd_llm", "Factors",
             "fisher_weighted_error"),
    "methods": ("METHODS", "Method", "factorize_weight"),
    "lowrank": ("LowRankLinear", "lowrank_params", "rank_for_ratio", "compression_ratio"),
    "basis_sharing": ("shared_basis", "SharedFactors", "SharedBasisLinear", "shared_basis_rank",
                      "shared_basis_params"),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = list(_MODULE_OF)


def __getattr__(name: str):
    """Import the module that defines ``name`` on its first use."""
    if name in _MODULE_OF:
        value = getattr(importlib.import_module(f".{_MODULE_OF[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
