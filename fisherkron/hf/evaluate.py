r"""Evaluation of compressed models (paper Sec. 6): perplexity, GLUE-style metrics, lm-eval.

* :func:`perplexity` -- token-level ``PPL = exp(sum_t -log p(x_t | x_<t) / N)`` of
  a causal LM over fixed-length windows, non-overlapping (the SVD-LLM/ASVD
  protocol: the text is cut into ``seq_len``-token windows, the tail dropped,
  and every token but each window's first is scored) or strided (each window
  scores only the tokens not scored by the previous one).
* :func:`classification_metrics` -- accuracy, F1, MCC (scikit-learn) and
  Pearson/Spearman (scipy), the GLUE metrics of App. "Extended GLUE results".
* :func:`run_lm_eval` -- lm-eval zero-/few-shot runs of an in-memory model on
  the local task YAMLs of :mod:`fisherkron.hf.lm_eval_tasks`.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import numpy as np
import torch
from tqdm.auto import tqdm

from ..core.checks import check_int
from ..core.conventions import FisherkronError
from ..core.phases import phase, timed
from .data import window_ids

__all__ = ["PerplexityResult", "perplexity", "classification_metrics", "predict_classifier",
           "evaluate_classifier", "run_lm_eval"]


@dataclass
class PerplexityResult:
    """``ppl = exp(nll / tokens)``; ``nll`` is the summed negative log-likelihood (nats)."""

    ppl: float
    nll: float
    tokens: int
    windows: int
    seq_len: int
    stride: int

    def __float__(self) -> float:
        return self.ppl


def _token_ids(tokenizer, text) -> torch.Tensor:
    if isinstance(text, torch.Tensor):
        return text.reshape(-1).long()
    if tokenizer is None:
        raise FisherkronError("perplexity needs a tokenizer when the text is a string")
    return torch.tensor(window_ids(tokenizer, text), dtype=torch.long)  # cut into windows below: no length warning


@torch.no_grad()
@timed("perplexity")
def perplexity(model, tokenizer, text, *, seq_len: int = 2048, stride: int | None = None,
               max_tokens: int | None = None, batch_size: int = 1, progress: bool = False) -> PerplexityResult:
    r"""Token-level perplexity ``exp(-(1/N) sum_t log p(x_t | window context))``.

    Args:
        model: causal LM returning ``.logits`` of shape ``(B, T, V)``.
        tokenizer: tokenizer for ``text`` (unused if ``text`` is a tensor of token ids).
        text: a string (tokenised once, no special tokens) or a 1-D tensor of ids.
        seq_len: window length ``T``.
        stride: ``None`` or ``seq_len``: non-overlapping windows, tail dropped;
            smaller: sliding windows advancing by ``stride``, each scoring only its
            new tokens (the last window may be shorter).
        max_tokens: use only the first ``max_tokens`` tokens (for CPU runs).
        batch_size: windows per forward pass.
        progress: tqdm bar over batches.
    """
    check_int(seq_len, "seq_len", minimum=2), check_int(batch_size, "batch_size", minimum=1)
    positions = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if isinstance(positions, int) and seq_len > positions:
        raise FisherkronError(f"seq_len={seq_len} exceeds the model's {positions} positions; use seq_len <= {positions}")
    ids = _token_ids(tokenizer, text)
    if max_tokens is not None:
        ids = ids[:check_int(max_tokens, "max_tokens", minimum=2)]
    N = ids.numel()
    stride = seq_len if stride is None else stride
    if not 1 <= stride <= seq_len:
        raise FisherkronError(f"stride must be in 1..seq_len={seq_len}, got {stride}")
    # windows as (begin, end, first scored position inside the window)
    spans: list[tuple[int, int, int]] = []
    if stride == seq_len:
        spans = [(b, b + seq_len, 1) for b in range(0, N - seq_len + 1, seq_len)]
    else:
        prev_end = 0
        for b in range(0, N, stride):
            e = min(b + seq_len, N)
            spans.append((b, e, max(prev_end - b, 1)))
            prev_end = e
            if e == N:
                break
    if not spans:
        raise FisherkronError(f"the text has {N} tokens, fewer than seq_len={seq_len}; lower seq_len")
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    nll, count = 0.0, 0
    groups: list[list[tuple[int, int, int]]] = []
    for s in spans:  # batch windows of equal length
        if groups and len(groups[-1]) < batch_size and (groups[-1][0][1] - groups[-1][0][0]) == s[1] - s[0]:
            groups[-1].append(s)
        else:
            groups.append([s])
    try:
        for grp in tqdm(groups, desc="perplexity", disable=not progress):
            x = torch.stack([ids[b:e] for b, e, _ in grp]).to(device)  # (B, T)
            logits = model(input_ids=x).logits.float()  # (B, T, V)
            logp = torch.log_softmax(logits[:, :-1], dim=-1)  # (B, T-1, V): predicts x[:, 1:]
            tok = logp.gather(-1, x[:, 1:, None]).squeeze(-1).double()  # (B, T-1)
            for j, (_, _, first) in enumerate(grp):
                nll -= float(tok[j, first - 1:].sum())
                count += tok.shape[1] - (first - 1)
    finally:
        model.train(was_training)
    if not math.isfinite(nll):
        raise FisherkronError("perplexity is not finite: the model produced NaN/inf log-probabilities")
    return PerplexityResult(math.exp(nll / count), nll, count, len(spans), seq_len, stride)


def classification_metrics(labels, predictions, *, regression: bool = False) -> dict[str, float]:
    """GLUE-style metrics: accuracy, F1 (binary; macro for more classes), MCC; or Pearson/Spearman.

    >>> classification_metrics([0, 1, 1, 0], [0, 1, 0, 0])["accuracy"]
    0.75
    """
    y = np.asarray(labels)
    p = np.asarray(predictions)
    if y.shape != p.shape or y.size == 0:
        raise FisherkronError(f"labels {y.shape} and predictions {p.shape} must be equal-length and non-empty")
    if regression:
        from scipy.stats import pearsonr, spearmanr
        return {"pearson": float(pearsonr(y, p)[0]), "spearman": float(spearmanr(y, p)[0])}
    from sklearn.metrics import accuracy_score, f1_score, matthews_corrcoef
    binary = set(np.unique(np.concatenate([y, p]))) <= {0, 1}
    return {"accuracy": float(accuracy_score(y, p)),
            "f1": float(f1_score(y, p, average="binary" if binary else "macro", zero_division=0)),
            "mcc": float(matthews_corrcoef(y, p))}


@torch.no_grad()
@timed("classifier scoring")
def predict_classifier(model, tokenizer, dataset, *, text_fields=None, task: str | None = None,
                       batch_size: int = 32, max_length: int = 128, limit: int | None = None,
                       progress: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """``(labels, predictions)`` of a sequence classifier on a labelled :class:`datasets.Dataset`."""
    from .data import TASKS
    if text_fields is None:
        text_fields = TASKS[task][0] if task in TASKS else tuple(
            c for c in dataset.column_names if c not in ("label", "idx"))[:2]
    n = len(dataset) if limit is None else min(limit, len(dataset))
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    preds = []
    try:
        for s in tqdm(range(0, n, batch_size), desc="classify", disable=not progress):
            rows = dataset[s:min(s + batch_size, n)]
            enc = tokenizer(*[rows[f] for f in text_fields], truncation=True, max_length=max_length,
                            padding=True, return_tensors="pt").to(device)
            logits = model(**enc).logits  # (B, C)
            preds.append(logits.squeeze(-1) if logits.shape[-1] == 1 else logits.argmax(-1))
    finally:
        model.train(was_training)
    return np.asarray(dataset[:n]["label"]), torch.cat(preds).cpu().numpy()


def evaluate_classifier(model, tokenizer, dataset, **kwargs) -> dict[str, float]:
    """:func:`predict_classifier` followed by :func:`classification_metrics`."""
    y, p = predict_classifier(model, tokenizer, dataset, **kwargs)
    return classification_metrics(y, p, regression=np.issubdtype(p.dtype, np.floating))


class _ReusedTasks:
    """A :class:`lm_eval.tasks.TaskManager` for one shot count whose ``load`` builds each task list once per process.

    ``simple_evaluate`` asks its task manager to load the tasks on every call: for the 57 MMLU subjects
    that reads and indexes 57 datasets each time a compressed model is scored. The loaded tasks hold no
    results between calls (each evaluation builds its requests afresh, and ``simple_evaluate`` sets
    ``num_fewshot`` and re-seeds the few-shot sampler on every call), so one copy, kept in ``loaded`` by
    task list and shot count, serves every call with the same ones; ``tests/test_evaluate.py`` checks that
    a reused copy scores exactly as a fresh one.
    """

    def __init__(self, manager, loaded: dict[tuple, dict], num_fewshot: int | None):
        self._manager, self._loaded, self._shots = manager, loaded, num_fewshot

    def load(self, tasks):
        key = (tuple(tasks), self._shots)
        if key not in self._loaded:
            with phase("lm-eval task loading"):
                self._loaded[key] = self._manager.load(tasks)
        return self._loaded[key]

    def __getattr__(self, name):
        return getattr(self._manager, name)


#: the process's task managers and their loaded task lists, by task folder ("hub" for the paper profile)
_TASK_MANAGERS: dict[str, tuple[object, dict[tuple, dict]]] = {}


def _task_manager(profile: str, num_fewshot: int | None) -> _ReusedTasks:
    """The process's task manager for ``profile`` (``"paper"``: lm-eval's hub tasks; else the local YAMLs)."""
    from lm_eval.tasks import TaskManager

    from .lm_eval_tasks import write_tasks

    folder = "hub" if profile == "paper" else str(write_tasks())
    if folder not in _TASK_MANAGERS:
        manager = TaskManager() if profile == "paper" else TaskManager(include_path=folder,
                                                                          include_defaults=False)
        _TASK_MANAGERS[folder] = (manager, {})
    return _ReusedTasks(*_TASK_MANAGERS[folder], num_fewshot)


@contextlib.contextmanager
def _without_environment_report():
    """Within the block, lm-eval's ``simple_evaluate`` adds no report of the environment to its results (torch's
    ``collect_env``: about 0.8 s a call on 2 cores, several seconds the first time, for text nothing here reads;
    the provenance records keep the versions that matter)."""
    from lm_eval import evaluator

    report = evaluator.add_env_info
    evaluator.add_env_info = lambda storage: None
    try:
        yield
    finally:
        evaluator.add_env_info = report


@timed("lm-eval")
def run_lm_eval(model, tokenizer, tasks, *, num_fewshot: int | None = 0, limit: int | float | None = None,
                bootstrap_iters: int = 100, batch_size: int = 1, profile: str = "default",
                seed: int = 0, max_length: int | None = None, per_example: bool = False) -> dict[str, dict]:
    """lm-eval on an in-memory model: ``{task: {metric: value}}`` (plus ``*_stderr``).

    ``per_example``: also ``{task: {"<metric>_examples": [value of each example, in lm-eval's document
    order]}}``, so that two models scored on the same examples can be compared pair by pair (the standard error
    of a paired difference is far below that of two independent accuracies).

    Args:
        tasks: names from :data:`fisherkron.hf.lm_eval_tasks.LOCAL_TASKS` (``"mmlu"`` is the
            57-subject group; single subjects are ``"mmlu_<subject>"``).
        num_fewshot: 0 for the zero-shot suite, 5 for MMLU (the paper's protocol).
        limit: examples per task (CPU runs); ``None`` = all.
        bootstrap_iters: bootstrap resamples for standard errors (lm-eval's default,
            100,000, takes minutes per metric).
        profile: ``"default"`` = local YAMLs only; ``"paper"`` = lm-eval's hub tasks.
    """
    import logging

    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    from ..env import set_offline_env

    if isinstance(tasks, str):
        tasks = [tasks]
    set_offline_env(hub=profile == "paper")
    tm = _task_manager(profile, num_fewshot)
    logging.getLogger("lm_eval").setLevel(logging.WARNING)
    kw = {"max_length": max_length} if max_length else {}
    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, **kw)
    with _without_environment_report():
        out = simple_evaluate(model=lm, tasks=list(tasks), num_fewshot=num_fewshot, limit=limit,
                              bootstrap_iters=bootstrap_iters, task_manager=tm, log_samples=per_example,
                              random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed,
                              fewshot_random_seed=seed)
    res = {}
    for name, metrics in out["results"].items():
        res[name] = {k.split(",")[0]: float(v) for k, v in metrics.items()
                     if isinstance(v, (int, float)) and not isinstance(v, bool)}
    for name, samples in (out.get("samples") or {}).items() if per_example else ():
        samples = sorted(samples, key=lambda e: e["doc_id"])
        for metric in (samples[0].get("metrics") or []) if samples else []:
            if metric in res.get(name, {}):
                res[name][f"{metric}_examples"] = [float(e[metric]) for e in samples]
    return res
