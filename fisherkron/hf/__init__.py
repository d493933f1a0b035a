"""Hugging Face models: the embedded and paper-scale models, data, calibration, surgery, save/load, evaluation.

===================  ======================================================================
module               what it holds
===================  ======================================================================
``registry``         ``load_model``: embedded MiniLM / SmolLM2, local folders, paper-scale hub names
``data``             calibration and evaluation data that ship inside packages (offline)
``user_data``        ``load_documents``: the user's calibration text (.txt .jsonl .json .csv .parquet, a saved folder)
``calibration``      per-batch gradients and the statistics every method reads, cached on disk
``distributed``      under torchrun: the process group, and MFF of all layers spread over the ranks
``budget``           ``count_params``, ``plan_ranks``: the parameter budget, uniform ranks for a ratio
``sensitivity``      ASVD's sensitivity sweep: each layer compressed alone, held-out loss (Sec. 6.3)
``decompositions``   each layer's full weighted SVD, computed once and sliced for every rank (cached)
``sweep_cache``      the sweep's cache file: entries with their checksum, read only once verified
``allocation``       ``allocate``: per-layer ranks for a ratio (uniform, sensitivity, fisher, calibrated, lems)
``surgery``          ``compress``: replace ``nn.Linear`` layers by ``LowRankLinear`` (Secs. 5-6)
``basis_sharing``    Basis Sharing (Wang et al. 2024): cross-layer shared bases, a Sec. 6.3 baseline
``truncation``       ``learn_truncation``: Dobi-SVD's trainable truncation positions on any weighted SVD (Sec. 6.4)
``recovery``         ``recover``: PEFT LoRA on LowRankLinear's factors, merged; training text kept apart from evaluation
``training``         what both trainers guarantee: non-finite steps stop the run, checkpoints written whole
``speed``            FLOPs of a forward pass (analytic, and counted on a meta copy); measured layer speed
``saving``           ``save_compressed`` / ``load_compressed``: safetensors folders
``transaction``      all-or-nothing replacement of a folder's files (mount points too): journal, commit, undo
``evaluate``         perplexity, GLUE-style metrics, lm-eval tasks
``lm_eval_tasks``    local lm-eval task folders built from packaged data
===================  ======================================================================

Needs the ``hf`` extra (transformers, safetensors, datasets, ...). Builds on
:mod:`fisherkron.core` and :mod:`fisherkron.env` only.
"""
from .basis_sharing import BasisSharingReport, compress_basis_sharing, plan_basis_sharing
from .budget import count_params, plan_ranks
from .calibration import CalibrationStats, collect_calibration, select_layers
from .data import c4_documents, classification_batches, lm_batches, load_task, ptb, wiki_text
from .distributed import precompute_kronecker
from .evaluate import (PerplexityResult, classification_metrics, evaluate_classifier, perplexity,
                       predict_classifier, run_lm_eval)
from .lm_eval_tasks import LOCAL_TASKS, write_tasks
from .registry import EMBEDDED_MODELS, PAPER_MODELS, load_model
from .recovery import RecoveryReport, assert_disjoint, check_disjoint, evaluation_texts, rebalance_factors, recover
from .saving import load_compressed, save_compressed
from .surgery import CompressionReport, LayerReport, compress
from .truncation import TruncationReport, learn_truncation, train_truncation
from .user_data import check_enough_tokens, load_documents

__all__ = [
    "load_model", "EMBEDDED_MODELS", "PAPER_MODELS",
    "load_task", "ptb", "wiki_text", "c4_documents", "lm_batches", "classification_batches",
    "load_documents", "check_enough_tokens",
    "collect_calibration", "select_layers", "CalibrationStats", "precompute_kronecker",
    "compress", "plan_ranks", "count_params", "CompressionReport", "LayerReport",
    "save_compressed", "load_compressed",
    "perplexity", "PerplexityResult", "classification_metrics", "predict_classifier",
    "evaluate_classifier", "run_lm_eval", "write_tasks", "LOCAL_TASKS",
    "compress_basis_sharing", "plan_basis_sharing", "BasisSharingReport",
    "learn_truncation", "train_truncation", "TruncationReport",
    "recover", "RecoveryReport", "rebalance_factors", "check_disjoint", "assert_disjoint", "evaluation_texts",
]
