"""The paper's method, with nothing but torch, numpy and scipy (Secs. 3-5).

=====================  =====================================================================
module                 what it holds
=====================  =====================================================================
``conventions``        ``vec`` (column-major), ``unvec``, ``kron``: the one convention
``operators``          the rearranged Fisher ``R(F)`` as a matrix-free operator (Sec. 4.1)
``stored``             gradients on disk: the 16-bit encodings and what a gradient source may hold
``factorization``      MFF, Algorithm 1: ``F ~= A (x) B`` by Lanczos on ``R(F)`` (Sec. 4)
``distributed``        data-parallel MFF over a ``torch.distributed`` group: one all-reduce per product
``kfac``               K-FAC factors, MFF's warm start
``regularization``     making ``A``, ``B`` positive definite (Sec. 5, "Singularity")
``shrinkage``          ``A``, ``B`` shrunk toward their diagonals, the intensity from split halves
``wsvd``               the weighted SVD: GFWSVD (Theorem 1, Eq. (7)) and its special cases
``methods``            the compression methods in one table
``lowrank``            ``LowRankLinear``: ``W ~= W2 W1`` as a module
``basis_sharing``      Basis Sharing: one whitened input basis shared by a group of layers
``checks``             input validation (one-line :class:`FisherkronError`)
``phases``             where a process's seconds go: wall time per named phase, in provenance records
=====================  =====================================================================

Nothing here imports from the layers above it (``fisherkron.hf``, ``fisherkron.experiments``,
``fisherkron.cli``); ``tests/test_layout.py`` checks this on the import graph.
"""
from .basis_sharing import SharedBasisLinear, SharedFactors, shared_basis, shared_basis_params, shared_basis_rank
from .conventions import FisherkronError, kron, unvec, vec
from .factorization import MFF_DTYPES, MFFResult, kronecker_terms, mff, mff_dtype
from .kfac import KFACFactors, kfac_factors
from .lowrank import LowRankLinear, compression_ratio, lowrank_params, rank_for_ratio
from .methods import METHODS, Method, factorize_weight
from .operators import GradientStack, RearrangedFisher, matvec_flops, rearranged_fisher
from .regularization import MIN_ALPHA, Regularized, regularize
from .shrinkage import shrink_to_diagonal, split_half_intensity
from .wsvd import Factors, asvd, fisher_weighted_error, fwsvd, fwsvd_rows, gfwsvd, svd, svd_llm, weighted_svd

__all__ = [
    "FisherkronError", "vec", "unvec", "kron",
    "rearranged_fisher", "RearrangedFisher", "GradientStack", "matvec_flops",
    "mff", "MFFResult", "kronecker_terms", "MFF_DTYPES", "mff_dtype",
    "kfac_factors", "KFACFactors",
    "regularize", "Regularized", "MIN_ALPHA", "shrink_to_diagonal", "split_half_intensity",
    "weighted_svd", "gfwsvd", "svd", "fwsvd", "fwsvd_rows", "asvd", "svd_llm", "Factors", "fisher_weighted_error",
    "METHODS", "Method", "factorize_weight",
    "LowRankLinear", "lowrank_params", "rank_for_ratio", "compression_ratio",
    "shared_basis", "SharedFactors", "SharedBasisLinear", "shared_basis_rank", "shared_basis_params",
]
