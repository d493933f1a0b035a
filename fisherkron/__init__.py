"""fisherkron: Kronecker-factored Fisher approximation (MFF) and generalized Fisher-weighted SVD (GFWSVD).

Convention (see :mod:`fisherkron.conventions`): ``W`` and gradients are ``n x m``
(out x in); ``vec`` is column-major; ``F ~= A (x) B`` with ``A`` (``m x m``, input
side) and ``B`` (``n x n``, output side).
"""
from .conventions import FisherkronError, kron, unvec, vec
from .kfac import KFACFactors, kfac_factors
from .lowrank import LowRankLinear, compression_ratio, lowrank_params, rank_for_ratio
from .mff import MFFResult, kronecker_terms, mff
from .operators import GradientStack, RearrangedFisher, matvec_flops, rearranged_fisher
from .regularize import Regularized, regularize
from .wsvd import asvd, fisher_weighted_error, fwsvd, gfwsvd, svd, svd_llm, weighted_svd

try:  # model-level API (issue 3); optional until its modules land
    from .model_api import *  # noqa: F401,F403
except ImportError as _exc:  # pragma: no cover
    if "model_api" not in str(_exc):
        raise

__version__ = "0.1.0"
