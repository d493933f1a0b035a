r"""The encoder study of Sec. 6.2: fine-tune per task, then compress the FFN layers (Tab. glue_results,
Tab. glue_extended, Fig. bert_glue_avg).

The paper's protocol ("fine-tune then compress", as FWSVD): fine-tune an encoder on each task,
collect gradients of the fine-tuning loss at the fine-tuned weights, build MFF's ``A (x) B``
per layer (Algorithm 1), and factorise the fully connected layers uniformly at one rank with
SVD, ASVD, FWSVD and GFWSVD (Theorem 1), then score each task with its metric.

* :func:`task_splits` -- train / dev / test per task. SST-2, BoolQ, TREC: the shipped train
  split (dev = a held-out slice of it), test = the validation split. MRPC and RTE ship only
  their validation split: it is halved reproducibly, stratified by label (``split_seed``), into a
  training half and a test half.
* :func:`fine_tune` -- AdamW with linear warm-up and decay; :func:`finetuned` caches the
  result on disk (``data/cache/finetune/<key>/``) under a key of the pre-trained weights, the
  task, the data, the seed, every hyperparameter and the fine-tuning code.
* :func:`search_lr` -- the learning rate of each task, chosen on the dev slice (seed 0).
* :class:`Study` -- per (task, seed): the dense score, then calibration (per-batch gradients
  ``G_i`` of the cross-entropy on training batches at the fine-tuned weights, dropout off:
  :func:`fisherkron.collect_calibration`; the same gradients give FWSVD's diagonal Fisher
  ``(1/k) sum_i G_i o G_i`` and MFF's factors), compression of a copy per (method, rank) and
  its score. Every result is written to ``data/cache/studies/glue-<task>-s<seed>-<key>.json``
  as soon as it exists, so a run can be stopped and resumed.
"""
from __future__ import annotations

import copy
import hashlib
import inspect
import json
import logging
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from .._version import __version__
from ..core.conventions import FisherkronError
from ..env import atomic_directory, atomic_write, code_text, data_root
from ..hf.data import no_length_warning

__all__ = ["TaskSpec", "TASK_SPECS", "Splits", "stratified_halves", "task_splits", "task_metric", "trivial_score",
           "FineTuneConfig", "Encoded", "fine_tune", "FineTuned", "finetuned", "score", "search_lr", "Study",
           "CODE_VERSION", "FFN_LAYERS"]

log = logging.getLogger(__name__)
CODE_VERSION = "glue-1"  # the fine-tuned checkpoints (part of their key)
#: the scored cases (their cache key): 2 = ``fwsvd`` is the input-side form its public code runs
SCORES_VERSION = "glue-scores-2"
#: the fully connected (FFN) layers of every block of a BERT-style encoder
FFN_LAYERS = r"(?:\w+\.)?encoder\.layer\.\d+\.(intermediate|output)\.dense"


@dataclass(frozen=True)
class TaskSpec:
    """A task of the study: its reported metric and the longest input kept (tokens)."""

    name: str
    metric: str  # "accuracy", "f1" (binary, positive class 1) or "mcc"
    max_length: int
    why: str


TASK_SPECS: dict[str, TaskSpec] = {s.name: s for s in (
    TaskSpec("sst2", "accuracy", 64, "accuracy, as the paper (sentences <= 64 tokens: none truncated)"),
    TaskSpec("boolq", "mcc", 128, "MCC: 62 % of the answers are 'yes' (the imbalanced task, CoLA's role); "
                                  "question + passage truncated to 128 tokens (the passage is cut)"),
    TaskSpec("trec", "accuracy", 32, "accuracy (6 classes), the usual TREC metric"),
    TaskSpec("mrpc", "f1", 128, "F1 of the paraphrase class, GLUE's MRPC metric"),
    TaskSpec("rte", "accuracy", 128, "accuracy, as the paper and GLUE"),
)}


def _spec(task: str) -> TaskSpec:
    if task not in TASK_SPECS:
        raise FisherkronError(f"task {task!r} is not in the study; use one of {', '.join(TASK_SPECS)}")
    return TASK_SPECS[task]


def task_metric(task: str, metrics: dict[str, float]) -> float:
    """The reported metric of ``task`` from :func:`fisherkron.classification_metrics`'s dict."""
    return float(metrics[_spec(task).metric])


def trivial_score(task: str, labels) -> float:
    """The reported metric of always predicting the majority class (the floor a collapsed model reaches)."""
    from ..hf.evaluate import classification_metrics

    y = np.asarray(labels)
    majority = np.bincount(y).argmax()
    return task_metric(task, classification_metrics(y, np.full_like(y, majority)))


# ----------------------------------------------------------------------------- data

@dataclass
class Splits:
    """The examples of one task: ``train`` (fine-tuning, calibration), ``dev`` (lr search), ``test``."""

    task: str
    train: object
    dev: object
    test: object
    note: str
    fields: tuple[str, ...] = ()
    num_labels: int = 2

    def fingerprint(self, parts=("train", "dev", "test")) -> str:
        """Hash of every text and label of ``parts``, in order."""
        h = hashlib.blake2b(digest_size=16)
        for part in (getattr(self, name) for name in parts):
            h.update(json.dumps({c: list(part[c]) for c in (*self.fields, "label")}).encode())
        return h.hexdigest()


def stratified_halves(labels, seed: int = 0) -> tuple[list[int], list[int]]:
    """Split indices into two disjoint halves with the same label mix (seeded, reproducible).

    Each label's indices are shuffled with ``seed``; the shuffled lists, one label after another,
    are dealt alternately to the two halves, so each label's counts, and the halves' sizes,
    differ by at most one.

    >>> a, b = stratified_halves([0, 0, 1, 1, 1, 0], seed=0)
    >>> sorted(a + b), len(a), len(b)
    ([0, 1, 2, 3, 4, 5], 3, 3)
    """
    y = np.asarray(labels)
    rng = np.random.default_rng(seed)
    dealt = []
    for c in np.unique(y):
        idx = np.flatnonzero(y == c)
        rng.shuffle(idx)
        dealt += idx.tolist()
    first, second = dealt[0::2], dealt[1::2]
    return sorted(first), sorted(second)


def task_splits(task: str, *, max_train: int | None = None, dev_fraction: float = 0.2, dev_max: int = 200,
                eval_size: int | None = None, split_seed: int = 0, profile: str = "default") -> Splits:
    """Train / dev / test of ``task`` (see the module docstring for where each part comes from).

    Args:
        max_train: at most this many fine-tuning examples (a seeded subset; ``None``: all).
        dev_fraction, dev_max: the dev slice is ``min(dev_max, round(dev_fraction * available))``
            training examples, disjoint from ``train``.
        eval_size: at most this many test examples (a seeded subset; ``None``: all).
        split_seed: the seed of every split and subset (fixed across fine-tuning seeds).
    """
    from ..hf.data import TASKS, load_task

    _spec(task)
    fields, num_labels = TASKS[task]
    if task in ("mrpc", "rte"):
        if profile == "paper":  # the hub has the real train split
            import datasets

            pool, test = datasets.load_dataset("glue", task, split="train"), load_task(task, "validation", profile)
            origin = "GLUE train split; test = GLUE validation"
        else:
            val = load_task(task, "validation", profile)
            a, b = stratified_halves(val["label"], split_seed)
            pool, test = val.select(a), val.select(b)
            origin = (f"only the GLUE validation split ships ({len(val)} rows): halved, stratified by label "
                      f"(seed {split_seed}), {len(a)} for training / {len(b)} for test")
    else:
        pool, test = load_task(task, "train", profile), load_task(task, "validation", profile)
        origin = f"train split ({len(pool)} rows); test = validation split ({len(test)} rows)"
    order = np.random.default_rng(split_seed).permutation(len(pool)).tolist()
    n_dev = min(dev_max, round(dev_fraction * len(pool)))
    if n_dev < 1 or len(pool) - n_dev < 1:
        raise FisherkronError(f"{task}: {len(pool)} training examples leave no dev or train part "
                              f"(dev_fraction={dev_fraction}, dev_max={dev_max})")
    rest = order[n_dev:]
    train_idx = rest if max_train is None else rest[:max_train]
    dev, train = pool.select(sorted(order[:n_dev])), pool.select(sorted(train_idx))
    if eval_size is not None and eval_size < len(test):
        pick = np.random.default_rng(split_seed + 1).permutation(len(test))[:eval_size]
        test = test.select(sorted(pick.tolist()))
    note = (f"{origin}; dev = {len(dev)} held-out training examples; {len(train)} fine-tuning examples; "
            f"{len(test)} test examples")
    return Splits(task, train, dev, test, note, tuple(fields), num_labels)


class Encoded:
    """Examples tokenised once (truncated to ``max_length``, not padded); padded per batch."""

    def __init__(self, tokenizer, dataset, fields, max_length: int):
        cols = [list(dataset[f]) for f in fields]
        enc = tokenizer(*cols, truncation=True, max_length=max_length)
        self.tokenizer = tokenizer
        self.features = {k: list(v) for k, v in enc.items()}
        self.labels = torch.tensor(list(dataset["label"]))  # (N,)
        with no_length_warning(tokenizer):  # the full lengths only count what truncation cut
            full = tokenizer(*cols, truncation=False)["input_ids"]
        self.truncated = sum(len(x) > max_length for x in full) / max(len(full), 1)
        self.lengths = [len(x) for x in self.features["input_ids"]]

    def __len__(self) -> int:
        return len(self.labels)

    def batch(self, idx) -> dict[str, torch.Tensor]:
        """Examples ``idx`` padded to their longest: ``input_ids`` etc. ``(B, T)``, ``labels`` ``(B,)``."""
        idx = [int(i) for i in idx]
        out = dict(self.tokenizer.pad({k: [v[i] for i in idx] for k, v in self.features.items()},
                                      return_tensors="pt"))
        out["labels"] = self.labels[idx]
        return out


# ----------------------------------------------------------------------------- fine-tuning

@dataclass(frozen=True)
class FineTuneConfig:
    """Hyperparameters of one fine-tuning run (all of them enter the checkpoint key)."""

    lr: float
    epochs: float = 3.0
    batch_size: int = 16
    warmup: float = 0.1  # fraction of the steps with a linear warm-up, then linear decay to 0
    weight_decay: float = 0.01
    max_length: int = 128
    freeze_embeddings: bool = True  # the embedding tables stay pre-trained (half of MiniLM's weights)
    clip: float = 1.0  # gradient-norm clip

    def steps(self, n: int) -> int:
        return max(1, math.ceil(self.epochs * n / self.batch_size))


def _lr_factor(step: int, total: int, warmup: int) -> float:
    """Linear warm-up over ``warmup`` steps, then linear decay to 0 at ``total``."""
    if step < warmup:
        return (step + 1) / warmup
    return max(0.0, (total - step) / max(1, total - warmup))


def fine_tune(model, data: Encoded, cfg: FineTuneConfig, *, seed: int = 0, progress: bool = False) -> dict:
    """Fine-tune ``model`` in place on ``data`` (cross-entropy of ``model(**batch).loss``).

    AdamW (``cfg.lr``, ``cfg.weight_decay``; no decay on biases and LayerNorm), ``cfg.steps(N)`` steps
    of ``cfg.batch_size`` examples in a seeded order (a new permutation each epoch), linear warm-up
    and decay, gradient norm clipped to ``cfg.clip``. Returns the loss of every step and the time.
    """
    steps = cfg.steps(len(data))
    warm = max(1, round(cfg.warmup * steps))
    trained = [(n, p) for n, p in model.named_parameters()
               if not (cfg.freeze_embeddings and ".embeddings." in f".{n}")]
    flags = {p: p.requires_grad for p in model.parameters()}
    for p in model.parameters():
        p.requires_grad_(False)
    for _, p in trained:
        p.requires_grad_(True)
    no_decay = [p for n, p in trained if n.endswith("bias") or "LayerNorm" in n or "layernorm" in n]
    decay = [p for n, p in trained if not (n.endswith("bias") or "LayerNorm" in n or "layernorm" in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _lr_factor(s, steps, warm))
    gen = torch.Generator().manual_seed(seed)
    order: list[int] = []
    losses = []
    t = time.perf_counter()
    model.train()
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)  # dropout
            for _ in tqdm(range(steps), desc="fine-tune", disable=not progress, leave=False):
                if len(order) < cfg.batch_size:
                    order += torch.randperm(len(data), generator=gen).tolist()
                idx, order = order[:cfg.batch_size], order[cfg.batch_size:]
                loss = model(**data.batch(idx)).loss
                if not torch.isfinite(loss):
                    raise FisherkronError(f"fine-tuning diverged (loss {float(loss)}); lower the learning rate "
                                          f"(lr={cfg.lr})")
                opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_([p for _, p in trained], cfg.clip)
                opt.step()
                sched.step()
                losses.append(loss.item())
    finally:
        model.eval()
        for p, f in flags.items():
            p.requires_grad_(f)
    return {"losses": losses, "steps": steps, "seconds": time.perf_counter() - t,
            "trained": [n for n, _ in trained]}


def _finetune_code() -> str:
    """Hash of the code that decides the fine-tuned weights (part of the checkpoint key)."""
    src = "".join(code_text(inspect.getsource(f)) for f in (Encoded, FineTuneConfig, _lr_factor, fine_tune))
    return f"{__version__}/{CODE_VERSION}/{hashlib.blake2b(src.encode(), digest_size=8).hexdigest()}"


@torch.no_grad()
def _predict(model, data: Encoded, batch_size: int = 64) -> tuple[np.ndarray, float]:
    """Predicted labels (in ``data``'s order) and the mean loss, in batches of similar length."""
    model.eval()
    order = np.argsort(data.lengths, kind="stable")
    preds = np.empty(len(data), dtype=np.int64)
    loss = 0.0
    for s in range(0, len(data), batch_size):
        idx = order[s:s + batch_size]
        out = model(**data.batch(idx))
        preds[idx] = out.logits.argmax(-1).numpy()  # (B,)
        loss += float(out.loss) * len(idx)
    return preds, loss / max(len(data), 1)


def score(model, data: Encoded, task: str) -> dict[str, float]:
    """Accuracy, F1, MCC, the task's reported ``metric`` and the mean loss of ``model`` on ``data``."""
    from ..hf.evaluate import classification_metrics

    t = time.perf_counter()
    preds, loss = _predict(model, data)
    out = classification_metrics(data.labels.numpy(), preds)
    out.update(metric=task_metric(task, out), loss=loss, eval_seconds=time.perf_counter() - t)
    return out


@dataclass
class FineTuned:
    """A fine-tuned model, its cache key and what its training recorded."""

    model: torch.nn.Module
    tokenizer: object
    key: str
    info: dict
    from_cache: bool


def finetuned(load, splits: Splits, cfg: FineTuneConfig, seed: int, *, cache_dir=None,
              progress: bool = False) -> FineTuned:
    """The model ``load(seed)`` fine-tuned on ``splits.train`` with ``cfg``, from the cache when it is there.

    ``load(seed) -> (model, tokenizer)`` gives the pre-trained model (its new head drawn with
    ``seed``). Key: the pre-trained weights (:func:`fisherkron.hf.calibration.model_fingerprint`),
    the task, the fine-tuning and dev data (not the test set), ``seed``, ``cfg`` and the fine-tuning
    code. The entry holds the trained parameters (``trained.safetensors``) and ``meta.json``
    (training losses, dev scores, the fine-tuned model's fingerprint, checked on reload); it is
    written atomically.
    """
    from safetensors.torch import load_file, save_file

    from ..hf.calibration import model_fingerprint

    def fresh():
        model, tok = load(seed)
        # transformers sets this at the first labelled forward pass, which would change the fingerprint
        model.config.problem_type = "single_label_classification"
        return model, tok

    model, tok = fresh()
    config = {"model": model_fingerprint(model), "task": splits.task, "data": splits.fingerprint(("train", "dev")),
              "seed": seed, "cfg": asdict(cfg), "code": _finetune_code()}
    key = hashlib.blake2b(json.dumps(config, sort_keys=True).encode(), digest_size=12).hexdigest()
    root = Path(cache_dir) if cache_dir is not None else data_root() / "cache" / "finetune"
    folder = root / f"{splits.task}-s{seed}-{key}"
    if (folder / "meta.json").exists():
        try:
            meta = json.loads((folder / "meta.json").read_text())
            state = load_file(folder / "trained.safetensors")
            missing = set(state) - set(dict(model.named_parameters()))
            if meta["key"] != key or missing:
                raise ValueError(f"key or parameter names differ ({sorted(missing)[:2]})")
            model.load_state_dict(state, strict=False)
            if model_fingerprint(model) != meta["fingerprint"]:
                raise ValueError("the reloaded weights do not match the saved fingerprint")
            model.eval()
            return FineTuned(model, tok, key, meta["info"], True)
        except Exception as exc:  # noqa: BLE001 - any unreadable or mismatched entry is trained again
            log.warning("fine-tuned checkpoint %s is unusable (%s); training again", folder, exc)
            model, tok = fresh()
    train = Encoded(tok, splits.train, splits.fields, cfg.max_length)
    dev = Encoded(tok, splits.dev, splits.fields, cfg.max_length)
    log_ = fine_tune(model, train, cfg, seed=seed, progress=progress)
    losses = log_.pop("losses")
    tenth = max(1, len(losses) // 10)
    info = {**log_, "n_train": len(train), "truncated_train": train.truncated,
            "loss_first_tenth": float(np.mean(losses[:tenth])), "loss_last_tenth": float(np.mean(losses[-tenth:])),
            "losses": losses, "dev": score(model, dev, splits.task), "config": config}
    trained = set(info["trained"])
    meta = {"key": key, "info": info, "fingerprint": model_fingerprint(model)}
    with atomic_directory(folder) as tmp:
        save_file({n: p.detach().contiguous() for n, p in model.named_parameters() if n in trained},
                  str(Path(tmp) / "trained.safetensors"))
        (Path(tmp) / "meta.json").write_text(json.dumps(meta, indent=1))
    return FineTuned(model, tok, key, info, False)


def search_lr(load, splits: Splits, cfg: FineTuneConfig, lrs, *, seed: int = 0, cache_dir=None,
              progress: bool = False) -> tuple[float, list[dict]]:
    """The learning rate of ``lrs`` whose model scores best on ``splits.dev`` (ties: lower dev loss).

    Every run is a cached :func:`finetuned`, so the winner's run is the study's seed-``seed`` model.
    """
    rows = []
    for lr in lrs:
        ft = finetuned(load, splits, FineTuneConfig(**{**asdict(cfg), "lr": float(lr)}), seed,
                       cache_dir=cache_dir, progress=progress)
        rows.append({"task": splits.task, "lr": float(lr), "dev_metric": ft.info["dev"]["metric"],
                     "dev_loss": ft.info["dev"]["loss"], "train_seconds": ft.info["seconds"],
                     "loss_first_tenth": ft.info["loss_first_tenth"], "loss_last_tenth": ft.info["loss_last_tenth"]})
    best = max(rows, key=lambda r: (r["dev_metric"], -r["dev_loss"]))
    return best["lr"], rows


# ----------------------------------------------------------------------------- the study

@dataclass
class Study:
    """Fine-tune, calibrate, compress and score: one results file per (task, seed), written per case.

    ``finetune[task]`` holds that task's :class:`FineTuneConfig` keyword arguments except ``lr``
    (chosen by :func:`search_lr` from ``lrs``) and ``max_length`` (the task's); ``max_train[task]``
    caps its fine-tuning examples.
    """

    model_name: str = "minilm"
    tasks: tuple[str, ...] = ("sst2", "boolq", "trec", "mrpc", "rte")
    ranks: tuple[int, ...] = (300, 250, 125, 50, 25, 5, 1)
    methods: tuple[str, ...] = ("svd", "asvd", "fwsvd", "gfwsvd", "svd_llm")
    seeds: tuple[int, ...] = (0, 1, 2)
    lrs: tuple[float, ...] = (5e-5, 1e-4, 2e-4)
    finetune: dict = field(default_factory=dict)
    max_train: dict = field(default_factory=dict)
    eval_size: dict = field(default_factory=dict)
    max_length: dict = field(default_factory=dict)  # overrides of TASK_SPECS' lengths
    dev_fraction: float = 0.2
    dev_max: int = 200
    split_seed: int = 0
    k: int = 32  # calibration batches (one gradient each)
    calib_batch_size: int = 8
    layers: str = FFN_LAYERS
    mff_options: dict = field(default_factory=lambda: {"tol": 1e-4})
    profile: str = "default"
    cache_calibration: bool = False  # gradients are ~0.9 GB per (task, seed) at k = 32; results are cached
    progress: bool = True
    load: object = None  # seed -> (model, tokenizer); default: load_model(model_name, num_labels=..., seed=seed)
    data: dict = field(default_factory=dict)  # task -> Splits given directly (other data, tests)
    _splits: dict = field(default_factory=dict, repr=False)
    _best_lr: dict = field(default_factory=dict, repr=False)
    search_rows: list = field(default_factory=list, repr=False)

    def length(self, task: str) -> int:
        return int(self.max_length.get(task, _spec(task).max_length))

    def splits(self, task: str) -> Splits:
        if task in self.data:
            return self.data[task]
        if task not in self._splits:
            self._splits[task] = task_splits(task, max_train=self.max_train.get(task),
                                             dev_fraction=self.dev_fraction, dev_max=self.dev_max,
                                             eval_size=self.eval_size.get(task), split_seed=self.split_seed,
                                             profile=self.profile)
        return self._splits[task]

    def loader(self, task: str):
        from ..hf.registry import load_model

        if self.load is not None:
            return self.load
        num_labels = self.splits(task).num_labels
        return lambda seed: load_model(self.model_name, num_labels=num_labels, seed=seed)

    def config(self, task: str, lr: float) -> FineTuneConfig:
        return FineTuneConfig(lr=float(lr), max_length=self.length(task), **self.finetune.get(task, {}))

    def best_lr(self, task: str) -> float:
        """:func:`search_lr` on the dev slice with the first seed (cached runs)."""
        if task not in self._best_lr:
            lr, rows = search_lr(self.loader(task), self.splits(task), self.config(task, self.lrs[0]), self.lrs,
                                 seed=self.seeds[0], progress=self.progress)
            for r in rows:
                r["chosen"] = r["lr"] == lr
            self._best_lr[task] = lr
            self.search_rows += rows
        return self._best_lr[task]

    def model(self, task: str, seed: int) -> FineTuned:
        return finetuned(self.loader(task), self.splits(task), self.config(task, self.best_lr(task)), seed,
                         progress=self.progress)

    def _results_path(self, task: str, ft: FineTuned, test: Encoded) -> Path:
        cfg = [SCORES_VERSION, ft.key, self.k, self.calib_batch_size, self.layers, self.split_seed,
               hashlib.blake2b(test.labels.numpy().tobytes() + json.dumps(test.features["input_ids"]).encode(),
                               digest_size=8).hexdigest(), sorted(self.mff_options.items())]
        key = hashlib.blake2b(json.dumps(cfg, default=str).encode(), digest_size=10).hexdigest()
        return data_root() / "cache" / "studies" / f"glue-{task}-s{ft.info['config']['seed']}-{key}.json"

    def calibration_batches(self, tok, splits: Splits, seed: int) -> list[dict]:
        """``k`` batches of ``calib_batch_size`` training examples (a seeded permutation, cycled when
        ``k * batch`` exceeds the training set; no example twice in one batch unless the set is smaller)."""
        data = Encoded(tok, splits.train, splits.fields, self.length(splits.task))
        gen = torch.Generator().manual_seed(1000 + seed)
        need, order = self.k * self.calib_batch_size, []
        while len(order) < need:
            order += torch.randperm(len(data), generator=gen).tolist()
        return [data.batch(order[i * self.calib_batch_size:(i + 1) * self.calib_batch_size]) for i in range(self.k)]

    def run_task_seed(self, task: str, seed: int) -> list[dict]:
        """Dense and every (method, rank) result of one fine-tuned model (cached per case)."""
        from ..hf.allocation import Decompositions
        from ..hf.calibration import collect_calibration
        from ..hf.surgery import compress

        ft = self.model(task, seed)
        splits = self.splits(task)
        test = Encoded(ft.tokenizer, splits.test, splits.fields, self.length(task))
        path = self._results_path(task, ft, test)
        results = json.loads(path.read_text()) if path.exists() else {}

        def keep(case: str, row: dict) -> None:
            results[case] = row
            atomic_write(path, lambda t: Path(t).write_text(json.dumps(results, indent=1)))

        common = {"task": task, "seed": seed, "lr": ft.info["config"]["cfg"]["lr"], "checkpoint": ft.key}
        if "dense" not in results:
            keep("dense", {**common, "method": "dense", "rank": None, "ratio": 0.0, "layers_ratio": 0.0,
                           **score(ft.model, test, task), "truncated_test": test.truncated,
                           "trivial": trivial_score(task, test.labels.numpy())})
        todo = [(m, r) for m in self.methods for r in self.ranks if f"{m}|{r}" not in results]
        if todo:
            t = time.perf_counter()
            stats = collect_calibration(ft.model, self.calibration_batches(ft.tokenizer, splits, seed), self.layers,
                                        methods=list(self.methods), seed=seed, cache=self.cache_calibration,
                                        progress=False)
            calib_seconds = time.perf_counter() - t
            decs = {m: Decompositions() for m in self.methods}
            bar = tqdm(todo, desc=f"{task} seed {seed}", disable=not self.progress, leave=False)
            for i, (method, rank) in enumerate(bar):
                bar.set_postfix_str(f"{method} r={rank}")
                model = copy.deepcopy(ft.model)
                t = time.perf_counter()
                rep = compress(model, method, stats, rank=rank, mff_options=self.mff_options,
                               decompositions=decs[method])
                keep(f"{method}|{rank}", {**common, "method": method, "rank": rank, "ratio": rep.ratio,
                                          "layers_ratio": rep.layers_ratio, "compress_seconds": time.perf_counter() - t,
                                          "calibration_seconds": calib_seconds, "k": stats.k,
                                          **score(model, test, task)})
                if i + 1 == len(todo) or todo[i + 1][0] != method:
                    decs[method].clear()  # this method's weighted SVDs are no longer needed
            del stats
        return [results["dense"]] + [results[f"{m}|{r}"] for m in self.methods for r in self.ranks]

    def run(self) -> list[dict]:
        """Every task and seed (each result cached as soon as it is computed)."""
        rows = []
        for task in self.tasks:
            for seed in self.seeds:
                t = time.perf_counter()
                rows += self.run_task_seed(task, seed)
                log.info("%s seed %d done in %.0f s", task, seed, time.perf_counter() - t)
        return rows
