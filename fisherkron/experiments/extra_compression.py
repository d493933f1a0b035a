r"""A weighted SVD as the start of an optimisation pipeline: learned truncation and LoRA recovery (paper Sec. 6.4).

The paper puts GFWSVD into the Dobi-SVD pipeline in place of SVD and reports Dobi-GFWSVD ahead of
Dobi-SVD at 20 % and 40 % (Tab. extra-compression-results). This module runs that comparison for
SVD, SVD-LLM and GFWSVD with the decoder study's protocol (:mod:`fisherkron.experiments.llm_compression`:
its model, its one calibration entry, its held-out selection batches, its evaluation texts and tasks,
its example limits), three rows per method and ratio:

* **(a) ``allocated``**: the method's weighted SVD at its per-layer ranks from one allocation rule
  (:attr:`Training.allocation`, default ``"fisher"``: no model evaluation), the decoder study's case
  :class:`~fisherkron.experiments.cases.Case` itself;
* **(b) ``dobi``**: Dobi-SVD's learned truncation on that decomposition
  (:func:`fisherkron.hf.truncation.learn_truncation`: one position ``gamma_l`` per layer through the mask
  ``0.5 tanh(beta (gamma - i)) + 0.5`` on the weighted singular values, every weight frozen, loss
  ``l_LM + lambda |rho(gamma) - rho*|``), started from (a)'s ranks (``init="allocated"``) or from the
  uniform allocation (``"uniform"``, Dobi's own start), materialised at the learned ranks;
* **(c) ``lora``**: LoRA recovery of (b)'s two factors (:func:`fisherkron.hf.recovery.recover`, PEFT,
  merged so the ratio survives), optionally after :func:`~fisherkron.hf.recovery.rebalance_factors`.

The ratio is the package's everywhere: the fraction of the **whole model's** parameters removed,
``1 - compressed / original`` (embeddings included). Dobi's ``target_ratio`` is the fraction kept and,
with its remapping, a memory ratio; the paper's "20 %" / "40 %" are read here as 20 % / 40 % of the
parameters removed.

**Training text** (:func:`training_documents`): C4 documents of the calibration's share
(``docs[:calib_docs]``) that share no span of :data:`~fisherkron.hf.recovery.OVERLAP_SPAN` letters with
any calibration window the decoder study drew, with the held-out (sweep and selection) documents, or
with any evaluation text (:func:`~fisherkron.hf.recovery.evaluation_texts`); the embedded C4 set has
584 documents, so there are no later ones to take. ``text="wikitext2"`` (the paper profile) trains on
WikiText-2's train split as Dobi does. Each seed draws its own training windows
(:func:`~fisherkron.hf.data.lm_batches` with seed ``TRAIN_SEED + seed``), its data order and its LoRA
initialisation; the same seed gives every method the same windows, so seeds pair across methods.

**Caching.** Every score is one JSON file under ``data/cache/studies/extra_compression/`` named by a
hash of everything it depends on (:meth:`ExtraStudy.config`), written as soon as it exists; the (a) rows
are the decoder study's cases with its keys, so those the decoder study already scored are read from
its folder (read-only). Every trained model is kept as its training checkpoint under ``runs/`` (the
positions, or the LoRA weights, with the optimiser state) named by its training configuration
(:meth:`ExtraStudy.train_config`): a model whose scores are missing is rebuilt from it without training,
and an interrupted training resumes where it stopped.

The tables and verdicts drawn from the rows are in :mod:`~fisherkron.experiments.extra_summary` (importable from
here too).
"""
from __future__ import annotations

import copy
import hashlib
import json
import logging
import math
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
from torch import nn
from tqdm.auto import tqdm

from ..core.conventions import FisherkronError
from ..env import atomic_write, data_root
from . import llm_compression as lc
from .extra_summary import (COLUMN_NAMES, COLUMNS, STAGE_NAMES, STAGES, TASKS4, aggregate, ahead, all_collapsed,
                            lead_change, leads, rebalance_effect, results_table, row_name, standing, training_curves)

__all__ = ["CODE_VERSION", "METHODS", "STAGES", "STAGE_NAMES", "COLUMNS", "COLUMN_NAMES", "TASKS4", "TRAIN_SEED",
           "Training", "Row",
           "ExtraStudy", "training_documents", "wikitext2_train", "prepare", "run_rows", "flat_scores", "aggregate",
           "row_name",
           "results_table", "ahead", "leads", "lead_change", "standing", "rebalance_effect", "all_collapsed", "training_curves"]

log = logging.getLogger(__name__)

#: bump when the meaning of a cached score or training checkpoint changes (part of every key here)
CODE_VERSION = "extra-compression-1"
#: the decompositions compared (keys of :data:`fisherkron.METHODS`)
METHODS = ("svd", "svd_llm", "gfwsvd")
#: added to a row's seed for the draw of its training windows (the calibration uses the protocol's seed)
TRAIN_SEED = 1000
#: the library sources whose code decides a trained model (their contents enter every training key)
_SOURCES = ("hf/truncation.py", "hf/recovery.py", "hf/training.py")


# ----------------------------------------------------------------------------- configuration

@dataclass(frozen=True)
class Training:
    """How rows (b) and (c) are trained; every field enters the training key.

    Data: ``train_k`` batches of ``batch_size`` x ``seq_len`` tokens per seed from the training text
    (``"c4"``, or ``"wikitext2"``: Dobi's, from the hub). Truncation (Dobi-SVD's defaults:
    :data:`fisherkron.hf.truncation.DOBI`): ``trunc_steps`` Adam steps of ``trunc_accumulate``
    micro-batches at learning rate ``lr`` annealed to ``min_lr`` over one epoch, penalty ``lam``, mask
    steepness ``beta``, LM term ``lm_loss``, ``keep`` the final or best positions, started at ``init``.
    Recovery (SVD-LLM's LoRA settings: :data:`fisherkron.hf.recovery.LORA`): ``lora_steps`` AdamW steps
    of ``lora_accumulate`` micro-batches, peak ``lora_lr`` after ``warmup`` (a fraction of the steps),
    ``schedule`` decay, LoRA rank / alpha / dropout, on the factors ``lora_targets``.
    """

    allocation: str = "fisher"
    init: str = "allocated"
    text: str = "c4"
    train_k: int = 32
    batch_size: int = 2
    seq_len: int = 256
    trunc_steps: int = 64
    trunc_accumulate: int = 1
    lr: float = 5.0
    min_lr: float = 4.0
    lam: float = 200.0
    beta: float = 10.0
    lm_loss: str = "perplexity"
    keep: str = "final"
    lora_steps: int = 64
    lora_accumulate: int = 1
    lora_lr: float = 1e-4
    lora_rank: int = 8
    lora_alpha: float = 16.0
    lora_dropout: float = 0.05
    warmup: float = 0.05
    schedule: str = "cosine"
    lora_targets: tuple = ("first", "second")
    checkpoint_every: int = 25

    def __post_init__(self):
        if self.init not in ("allocated", "uniform"):
            raise FisherkronError(f"init must be 'allocated' ((a)'s ranks) or 'uniform' (Dobi's start); got "
                                  f"{self.init!r}")
        if self.text not in ("c4", "wikitext2"):
            raise FisherkronError(f"text must be 'c4' (the embedded documents) or 'wikitext2' (Dobi's, from the hub); "
                                  f"got {self.text!r}")
        if self.allocation not in ("uniform", "fisher", "sensitivity", "calibrated"):
            raise FisherkronError(f"allocation {self.allocation!r} is not one (a) can use; use 'fisher' (free), "
                                  f"'uniform', 'calibrated' or 'sensitivity' (a sweep per method)")

    def truncation(self) -> dict:
        """The truncation's settings (the training key's ``truncation`` part)."""
        return {k: getattr(self, k) for k in ("init", "text", "train_k", "batch_size", "seq_len", "trunc_steps",
                                              "trunc_accumulate", "lr", "min_lr", "lam", "beta", "lm_loss", "keep")}

    def recovery(self) -> dict:
        """The recovery's settings (the training key's ``recovery`` part)."""
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(self).items()
                if k.startswith("lora_") or k in ("warmup", "schedule")}


@dataclass(frozen=True)
class Row:
    """One compressed model of the table: ``method`` at whole-model ``ratio``, ``stage`` (:data:`STAGES`);
    a trained stage has a ``seed``, a recovery may ``rebalance`` the factors first."""

    method: str
    ratio: float
    stage: str
    seed: int | None = None
    rebalance: bool = False

    def __post_init__(self):
        if self.stage not in STAGES:
            raise FisherkronError(f"stage {self.stage!r} is unknown; use one of {', '.join(STAGES)}")
        if (self.stage == "allocated") != (self.seed is None):
            raise FisherkronError(f"stage {self.stage!r} {'has no' if self.stage == 'allocated' else 'needs a'} "
                                  f"seed (got seed={self.seed})")
        if self.rebalance and self.stage != "lora":
            raise FisherkronError("only the LoRA recovery rebalances the factors; use rebalance=False here")

    @property
    def label(self) -> str:
        seed = "" if self.seed is None else f"|seed{self.seed}"
        return f"{self.method}|{self.stage}{'+rebalanced' if self.rebalance else ''}|{self.ratio:.4f}{seed}"


def _hash(obj) -> str:
    return hashlib.blake2b(json.dumps(obj, sort_keys=True, default=str).encode(), digest_size=12).hexdigest()


# ----------------------------------------------------------------------------- training text

def wikitext2_train() -> list[str]:
    """WikiText-2's train split (``wikitext-2-raw-v1``, the hub) as articles: Dobi-SVD's training text."""
    import datasets

    lines = datasets.load_dataset("wikitext", "wikitext-2-raw-v1", split="train")["text"]
    docs, cur = [], []
    for line in lines:
        if re.match(r"^ = [^=].* = $", line.rstrip("\n")) and cur:  # a top-level heading starts an article
            docs.append("".join(cur))
            cur = []
        cur.append(line)
    if cur:
        docs.append("".join(cur))
    return [d for d in docs if d.strip()]


def training_documents(study: lc.Study, text: str = "c4", *, evaluation: dict | None = None, span: int | None = None,
                       cache_dir=None) -> tuple[list[str], dict]:
    """The training documents, disjoint from the calibration windows, the held-out documents and the evaluation.

    ``text="c4"``: the calibration's share ``docs[:calib_docs]`` of the C4 documents; ``"wikitext2"``:
    :func:`wikitext2_train`. A candidate is dropped when :func:`~fisherkron.hf.recovery.check_disjoint` finds
    it sharing a span of ``span`` letters with a calibration window of the decoder study (its ``k`` batches
    drawn again as :func:`~fisherkron.experiments.llm_compression.prepare` draws them), with a held-out
    document (``docs[calib_docs:]``: the sweep's and the selection's), or with an evaluation text
    (``evaluation``, default :func:`~fisherkron.hf.recovery.evaluation_texts` of the protocol's profile), so
    the kept ones share no such span with any of them. With ``cache_dir`` the dropped indices are kept in
    ``disjoint-<hash>.json``, the hash of every text compared and ``span`` (the check reads every window of
    the evaluation texts, seconds to tens of seconds). Returns ``(documents, report)``, the report counting
    what was dropped and why.
    """
    from .. import hf
    from ..hf.recovery import OVERLAP_SPAN, check_disjoint, evaluation_texts

    p = study.protocol
    span = OVERLAP_SPAN if span is None else span
    profile = "paper" if p.profile == "paper" else "default"
    docs = hf.c4_documents(profile=profile, n=p.calib_docs + p.sweep_docs + max(p.sweep_docs, 100)) \
        if profile == "paper" else hf.c4_documents()
    calib = hf.lm_batches(study.tokenizer, docs[:p.calib_docs], k=p.k, batch_size=p.batch_size, seq_len=p.seq_len,
                          seed=p.seed)
    windows = [study.tokenizer.decode(x) for b in calib for x in b["input_ids"]]  # the calibration's text
    candidates = docs[:p.calib_docs] if text == "c4" else wikitext2_train()
    evaluation = evaluation_texts(profile) if evaluation is None else evaluation
    against = {"calibration windows": windows, "held-out documents": docs[p.calib_docs:], **evaluation}
    h = hashlib.blake2b(f"{CODE_VERSION}/{span}".encode(), digest_size=12)
    for part in (candidates, *(against[k] if isinstance(against[k], list) else [against[k]] for k in sorted(against))):
        for t in part:
            h.update(t.encode("utf-8", "surrogatepass"))
            h.update(b"\x00")
    path = Path(cache_dir) / f"disjoint-{h.hexdigest()}.json" if cache_dir is not None else None
    if path is not None and path.is_file():
        dropped = {k: set(v) for k, v in json.loads(path.read_text())["dropped"].items()}
    else:
        dropped: dict[str, set] = {}
        for o in check_disjoint(candidates, against, span=span):
            key = o.source if o.source in ("calibration windows", "held-out documents") else "evaluation texts"
            dropped.setdefault(key, set()).add(o.document)
        if path is not None:
            atomic_write(path, lambda t: Path(t).write_text(json.dumps(
                {"dropped": {k: sorted(v) for k, v in dropped.items()}})))
    bad = set().union(*dropped.values()) if dropped else set()
    kept = [d for i, d in enumerate(candidates) if i not in bad]
    if not kept:
        raise FisherkronError(f"every one of the {len(candidates)} {text} documents shares a span of {span} letters "
                              f"with the calibration, held-out or evaluation texts; use another training text")
    report = {"text": text, "candidates": len(candidates), "kept": len(kept), "span": span,
              "dropped": {k: len(v) for k, v in dropped.items()}, "calibration_windows": len(windows),
              "evaluation_sources": len(evaluation)}
    return kept, report


# ----------------------------------------------------------------------------- the study

@dataclass
class ExtraStudy:
    """The decoder study's :class:`~fisherkron.experiments.llm_compression.Study`, the training settings and
    documents, and this study's score cache (``fallback_dirs``: read-only folders of the decoder study's
    scores, read under the same keys)."""

    study: lc.Study
    training: Training
    documents: list[str]
    disjoint: dict
    cache_dir: Path
    fallback_dirs: tuple = ()
    timings: dict = field(default_factory=dict)
    cached: dict = field(default_factory=dict)
    _batches: dict = field(default_factory=dict, repr=False)

    @property
    def code(self) -> str:
        import peft

        return f"{self.study.code}/{CODE_VERSION}/{lc.sources_hash(_SOURCES)}/peft-{peft.__version__}"

    def batches(self, seed: int) -> list:
        """Seed ``seed``'s training batches: ``train_k`` windows of the training documents, drawn with
        ``TRAIN_SEED + seed`` (the same for every method)."""
        if seed not in self._batches:
            from .. import hf

            t = self.training
            self._batches[seed] = hf.lm_batches(self.study.tokenizer, self.documents, k=t.train_k,
                                                batch_size=t.batch_size, seq_len=t.seq_len, seed=TRAIN_SEED + seed)
        return self._batches[seed]

    def case(self, row: Row) -> lc.Case:
        """The decoder study's case of (a) for ``row``'s method and ratio."""
        return lc.Case(row.method, self.training.allocation, row.ratio)

    # -- keys
    def allocated_config(self, row: Row, kind: str) -> dict:
        """(a)'s key: the decoder study's :func:`~fisherkron.experiments.cases.case_config` (which names
        the calibration for plain SVD too where the allocation reads it)."""
        return self.study.config(self.case(row), kind)

    def train_config(self, row: Row) -> dict:
        """Everything a trained model depends on: (a)'s case, this code, the training settings, the data and seed."""
        if row.stage == "allocated":
            raise FisherkronError("row (a) is not trained; use allocated_config")
        from ..hf.calibration import data_fingerprint

        base = {k: v for k, v in self.allocated_config(row, "heldout").items() if k not in ("kind", "evaluation")}
        cfg = {**base, "code": self.code, "stage": row.stage, "seed": row.seed,
               "data": data_fingerprint(self.batches(row.seed)), "truncation": self.training.truncation()}
        if row.stage == "lora":
            cfg["recovery"] = {**self.training.recovery(), "rebalance": row.rebalance}
        return cfg

    def config(self, row: Row, kind: str) -> dict:
        """The key of one score of ``row``: (a)'s as the decoder study keys it, a trained row's training key
        with the evaluation settings of ``kind``."""
        if row.stage == "allocated":
            return self.allocated_config(row, kind)
        return {**self.train_config(row), "kind": kind, "evaluation": self.study.evaluation_settings(kind)}

    def checkpoint(self, row: Row) -> Path:
        """Where ``row``'s trained model is kept: its training checkpoint, named by its training key."""
        return self.cache_dir / "runs" / f"{row.stage}-{lc.case_key(self.train_config(row))}.pt"

    # -- the cache
    def _read(self, config: dict) -> dict | None:
        return next((got for folder in (self.cache_dir, *self.fallback_dirs)
                     if (got := lc.read_score(folder, config)) is not None), None)

    def _write(self, config: dict, result: dict, seconds: float) -> None:
        lc.write_score(self.cache_dir, config, result, seconds)

    # -- models
    def allocated_ranks(self, row: Row) -> dict:
        """(a)'s per-layer ranks (from its held-out record; computed if missing)."""
        return self.scores(Row(row.method, row.ratio, "allocated"), ("heldout",))["heldout"]["ranks"]

    def build(self, row: Row, progress: bool = False) -> tuple[nn.Module, dict]:
        """The compressed model of ``row`` and what made it; a trained one from its checkpoint when complete."""
        from ..hf.budget import count_params
        from ..hf.recovery import recover
        from ..hf.truncation import learn_truncation

        if row.stage == "allocated":
            return self.study.build(self.case(row), progress=progress)  # lc.scored tallies its seconds
        s, t = self.study, self.training
        before = count_params(s.model)
        if row.stage == "dobi":
            init = self.allocated_ranks(row) if t.init == "allocated" else "uniform"
            model = copy.deepcopy(s.model)
            tic = time.perf_counter()
            rep = learn_truncation(model, row.method, s.stats, self.batches(row.seed), ratio=row.ratio, init=init,
                                   decompositions=s.decompositions_of(row.method), mff_options=s.mff_options,
                                   steps=t.trunc_steps, accumulate=t.trunc_accumulate, lr=t.lr, min_lr=t.min_lr,
                                   beta=t.beta, lam=t.lam, lm_loss=t.lm_loss, keep=t.keep, seed=row.seed,
                                   checkpoint=self.checkpoint(row), checkpoint_every=t.checkpoint_every,
                                   progress=progress)
            self._tick("truncation" if rep.resumed_at != rep.steps else "rebuild", time.perf_counter() - tic)
            info = {"ranks": rep.ranks, "init_ranks": rep.init_ranks, "soft_ranks": rep.soft_ranks,
                    "soft_ratio": rep.history[-1]["ratio"] if rep.history else float("nan"),
                    "layers_ratio": rep.compression.layers_ratio, "history": rep.history,
                    "train_seconds": rep.seconds}
        else:
            model, prev = self.build(Row(row.method, row.ratio, "dobi", row.seed), progress=progress)
            tic = time.perf_counter()
            rep = recover(model, self.batches(row.seed), steps=t.lora_steps, accumulate=t.lora_accumulate,
                          lr=t.lora_lr, schedule=t.schedule, warmup=t.warmup, lora_rank=t.lora_rank,
                          lora_alpha=t.lora_alpha, lora_dropout=t.lora_dropout, targets=tuple(t.lora_targets),
                          rebalance=row.rebalance, seed=row.seed, checkpoint=self.checkpoint(row),
                          checkpoint_every=t.checkpoint_every, progress=progress)
            self._tick("recovery" if rep.resumed_at != rep.steps else "rebuild", time.perf_counter() - tic)
            scales = np.array(list(rep.rebalanced.values()) or [1.0])
            info = {"ranks": prev["ranks"], "layers_ratio": prev["layers_ratio"], "history": rep.history,
                    "train_seconds": rep.seconds, "tokens": rep.tokens,
                    "rebalance_scale_median": float(np.median(scales)),
                    "rebalance_scale_range": [float(scales.min()), float(scales.max())]}
        info["ratio"] = 1.0 - count_params(model) / before
        return model, info

    def _tick(self, what: str, seconds: float) -> None:
        self.timings[what] = self.timings.get(what, 0.0) + seconds

    def scores(self, row: Row, kinds=("heldout", "ppl"), progress: bool = False) -> dict:
        """``{kind: result}`` of ``row``: read from the cache, or the model built once (trained, or rebuilt from
        its checkpoint) and every missing kind computed and kept as soon as it exists. The ``heldout`` record
        also holds the ranks, the achieved ratio and the training curve, and is always made first."""
        kinds = ["heldout"] + [k for k in kinds if k != "heldout"]
        return self._scores({k: self.config(row, k) for k in kinds}, lambda: self.build(row, progress=progress))

    def dense(self, kinds=("heldout", "ppl")) -> dict:
        """The dense model's scores under the decoder study's keys (read from its folder when it has them)."""
        case = lc.Case("dense", "dense", 0.0)
        kinds = ["heldout"] + [k for k in kinds if k != "heldout"]
        return self._scores({k: self.study.config(case, k) for k in kinds}, lambda: self.study.build(case))

    def _scores(self, configs: dict, build) -> dict:
        return lc.scored(configs, build, self.study.evaluate, read=self._read, write=self._write,
                         timings=self.timings, cached=self.cached)


def prepare(protocol: lc.Protocol, training: Training, target: str = "tab_extra_compression_results",
            progress: bool = True) -> ExtraStudy:
    """The decoder study's :func:`~fisherkron.experiments.llm_compression.prepare` (its calibration entry, cached),
    this study's training documents (:func:`training_documents`) and cache folder."""
    study = lc.prepare(protocol, target=target, progress=progress)
    cache = data_root() / "cache" / "studies" / "extra_compression"
    docs, report = training_documents(study, training.text, cache_dir=cache)
    return ExtraStudy(study, training, docs, report, cache, fallback_dirs=(study.cache_dir,))


def flat_scores(scores: dict) -> dict:
    """One flat row from a row's ``{kind: result}`` (:func:`~fisherkron.experiments.llm_summary.flatten`), with
    ``acc4`` / ``acc4_se``, the mean of the paper's four zero-shot accuracies, and the truncation's last soft ratio."""
    from .llm_summary import flatten

    row = flatten(scores)
    if all(t in row for t in TASKS4):
        row["acc4"] = float(np.mean([row[t] for t in TASKS4]))
        row["acc4_se"] = float(math.sqrt(sum(row[f"{t}_se"] ** 2 for t in TASKS4)) / len(TASKS4))
    held = scores.get("heldout", {})
    for k in ("soft_ratio", "train_seconds"):
        if k in held:
            row[k] = float("nan") if held[k] is None else float(held[k])
    return row


def run_rows(ex: ExtraStudy, methods, ratios, seeds, *, rebalance_methods=(), rebalance_ratios=None,
             kinds=("heldout", "ppl", "zeroshot"), progress: bool = True) -> tuple[list[dict], list[dict]]:
    """Every row of the table for ``methods`` x ``ratios``: (a), then per seed (b) and (c) (and (c) rebalanced
    for ``rebalance_methods`` at ``rebalance_ratios``, default every ratio). Method by method, so each method's
    weighted SVDs are computed once. Returns
    ``(rows, records)``: one flat dict per row (:func:`~fisherkron.experiments.llm_summary.flatten`-ed scores
    with ``acc4``, its mean over the paper's four tasks) and the held-out records (ranks, training curves)."""
    plan = []
    for m in methods:
        for r in ratios:
            plan.append(Row(m, r, "allocated"))
            for s in seeds:
                plan += [Row(m, r, "dobi", s), Row(m, r, "lora", s)]
                if m in rebalance_methods and (rebalance_ratios is None or any(np.isclose(r, rebalance_ratios))):
                    plan.append(Row(m, r, "lora", s, True))
    rows, records = [], []
    bar = tqdm(plan, desc="extra-compression rows", disable=not progress)
    for row in bar:
        bar.set_postfix_str(row.label)
        sc = ex.scores(row, kinds, progress=False)
        meta = {"method": row.method, "target": row.ratio, "stage": row.stage, "seed": row.seed,
                "rebalance": row.rebalance, "name": row_name(row.method, row.stage, row.rebalance)}
        rows.append({**meta, **flat_scores(sc)})
        records.append({**meta, "heldout": sc["heldout"]})
    return rows, records
