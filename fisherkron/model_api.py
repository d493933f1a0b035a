"""Model-level API (issue 3): embedded models and data, calibration, surgery, save/reload, evaluation.

Re-exported by :mod:`fisherkron` (``from .model_api import *``).
"""
from .calibration import CalibrationStats, collect_calibration, select_layers
from .compress import METHODS, CompressionReport, compress, count_params, plan_ranks
from .data import c4_documents, classification_batches, lm_batches, load_task, ptb, wiki_text
from .evaluate import (PerplexityResult, classification_metrics, evaluate_classifier, perplexity,
                       predict_classifier, run_lm_eval)
from .io import load_compressed, save_compressed
from .lm_eval_tasks import LOCAL_TASKS, write_tasks
from .models import EMBEDDED_MODELS, PAPER_MODELS, load_model

__all__ = [
    "load_model", "EMBEDDED_MODELS", "PAPER_MODELS",
    "load_task", "ptb", "wiki_text", "c4_documents", "lm_batches", "classification_batches",
    "collect_calibration", "select_layers", "CalibrationStats",
    "compress", "plan_ranks", "count_params", "CompressionReport", "METHODS",
    "save_compressed", "load_compressed",
    "perplexity", "PerplexityResult", "classification_metrics", "predict_classifier",
    "evaluate_classifier", "run_lm_eval", "write_tasks", "LOCAL_TASKS",
]
