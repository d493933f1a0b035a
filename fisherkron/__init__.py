"""fisherkron: Kronecker-factored Fisher approximation (MFF) and generalized Fisher-weighted SVD (GFWSVD).

Convention (see :mod:`fisherkron.core.conventions`): ``W`` and gradients are ``n x m``
(out x in); ``vec`` is column-major; ``F ~= A (x) B`` with ``A`` (``m x m``, input
side) and ``B`` (``n x n``, output side).

The package in layers, each importing only from those listed before it:

* :mod:`fisherkron.core`: the method (R(F), MFF, K-FAC, regularisation, the weighted-SVD
  family, ``LowRankLinear``); needs torch, numpy, scipy, tqdm only;
* :mod:`fisherkron.env`: paths, offline switches, atomic writes;
* :mod:`fisherkron.hf`: Hugging Face models (``pip install 'fisherkron[hf]'``);
* :mod:`fisherkron.experiments`: code only the notebooks and scripts use;
* :mod:`fisherkron.cli`: the ``fisherkron`` command.

Every name below is importable from ``fisherkron``, each imported on first use: ``import fisherkron``
alone imports no torch, and the Hugging Face names need ``transformers`` only when used.
"""
from __future__ import annotations

import importlib
import logging
import os
import sys

# OpenMP threads that spin while they wait stall on a shared machine: with another process busy
# on one of 2 cores, every parallel region waits for a thread that is not scheduled (compressing
# MiniLM's block 0: 70 s against 5 s). Passive waiting costs within the run-to-run noise on an
# idle machine at the benchmark's sizes (README, "Threads"). GNU OpenMP (libgomp, the runtime of
# torch's Linux wheels) reads OMP_WAIT_POLICY once, when it is loaded, and that is when torch is
# imported (OMP_DISPLAY_ENV=TRUE prints its settings right there); no call changes the policy
# afterwards. So the variable is set here whenever the user has not chosen (OMP_WAIT_POLICY=ACTIVE
# keeps spinning): it takes effect in this process if torch comes after fisherkron, and in every
# process started from this one; if torch came first, a one-line warning says what to do instead.
_OPENMP_RUNTIMES = ("libgomp", "libiomp", "libomp")


def _openmp_loaded() -> bool:
    """Whether an OpenMP runtime is already loaded in this process (``True`` where that cannot be told)."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as fh:
            return any(r in line for line in fh for r in _OPENMP_RUNTIMES)
    except OSError:
        return True


def _passive_openmp() -> None:
    """Set ``OMP_WAIT_POLICY=PASSIVE`` unless the user chose; warn when torch's OpenMP has already read it."""
    if "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ:
        return
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    if "torch" in sys.modules and _openmp_loaded():
        logging.getLogger(__name__).warning(
            "fisherkron: torch was imported before fisherkron, so its OpenMP threads spin while they wait (a "
            "block can take 10x longer when another process shares the cores); set OMP_WAIT_POLICY=PASSIVE "
            "before starting Python (export OMP_WAIT_POLICY=PASSIVE), or import fisherkron before torch")


_passive_openmp()

from ._version import __version__

#: the core's names (``fisherkron.core``: needs torch, numpy and scipy)
_CORE = ("FisherkronError", "vec", "unvec", "kron",
         "rearranged_fisher", "RearrangedFisher", "GradientStack", "matvec_flops",
         "mff", "MFFResult", "kronecker_terms",
         "kfac_factors", "KFACFactors",
         "regularize", "Regularized", "MIN_ALPHA",
         "weighted_svd", "gfwsvd", "svd", "fwsvd", "fwsvd_rows", "asvd", "svd_llm", "Factors", "fisher_weighted_error",
         "METHODS", "Method", "factorize_weight",
         "LowRankLinear", "lowrank_params", "rank_for_ratio", "compression_ratio",
         "shared_basis", "SharedBasisLinear")
#: the Hugging Face layer's names (``pip install 'fisherkron[hf]'``)
_HF = ("load_model", "EMBEDDED_MODELS", "PAPER_MODELS",
       "load_task", "ptb", "wiki_text", "c4_documents", "lm_batches", "classification_batches",
       "load_documents", "check_enough_tokens",
       "collect_calibration", "select_layers", "CalibrationStats", "precompute_kronecker",
       "compress", "plan_ranks", "count_params", "CompressionReport", "LayerReport",
       "save_compressed", "load_compressed",
       "perplexity", "PerplexityResult", "classification_metrics", "predict_classifier",
       "evaluate_classifier", "run_lm_eval", "write_tasks", "LOCAL_TASKS",
       "compress_basis_sharing", "plan_basis_sharing", "BasisSharingReport",
       "learn_truncation", "TruncationReport", "recover", "RecoveryReport", "rebalance_factors")

__all__ = [
    # fisherkron.core: the method
    *_CORE,
    # fisherkron.hf: Hugging Face models
    *_HF,
    "__version__",
]


def __getattr__(name: str):
    """Import the core or the Hugging Face layer on first use of one of its names (PEP 562)."""
    if name in _CORE:
        value = getattr(importlib.import_module(".core", __name__), name)
        globals()[name] = value
        return value
    if name in _HF:
        from .env import require

        require("transformers", "hf")
        value = getattr(importlib.import_module(".hf", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'fisherkron' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_CORE) | set(_HF))
