r"""The decoder study of Sec. 6.3 and its appendices: every method, one protocol, every score cached.

The paper compresses Llama-2-7B-chat and Llama-3.1-8B-Instruct by FWSVD, ASVD, SVD-LLM, Basis
Sharing and GFWSVD (Tabs. Llama31_compression_50, Llama2_chat_compression_50, Llama2_compression,
Llama3_compression, Fig. mmlu_avg) and ablates the factors' diagonal (Tab. ablation_diag_results).
This module runs all of it with one protocol, the same for every method:

* **one calibration set** (:func:`calibrate`, the one call of :func:`fisherkron.collect_calibration`
  every notebook of the study makes, so they share its cache entry): ``k`` batches of C4 documents
  ``docs[:calib_docs]``, every statistic any method of :data:`STUDY_METHODS` reads, collected once;
* **held-out batches** from the other documents, split by document into the sensitivity sweep's
  batches and the *selection* batches on which each method's best allocation is chosen
  (:func:`~fisherkron.experiments.cases.best_allocation`); the evaluation texts are never seen by calibration,
  sweep or choice;
* **the sweep as ASVD runs it**: its candidate per-layer ratios (:data:`ASVD_CANDIDATES`, ASVD4LLM's
  ``param_ratio_candidates`` in our convention), its noise measured by :func:`sweep_noise`;
* **evaluation** (:data:`~fisherkron.experiments.cases.KINDS`): held-out loss, perplexity of the Wikipedia text
  (WikiText-2's role) and PTB test, lm-eval's zero-shot tasks and 5-shot MMLU with a per-task example limit.

A case (:class:`~fisherkron.experiments.cases.Case`: method, allocation, ratio) is compressed once per missing
evaluation and each evaluation is kept as one JSON file under ``data/cache/studies/llm_compression/`` whose name
is a hash of everything it depends on (:mod:`~fisherkron.experiments.cases`), written atomically as
soon as it exists: a rerun after a plotting change reads them in seconds and an interrupted run
resumes at the next case. Each method's weighted SVDs (:class:`~fisherkron.hf.allocation.Decompositions`)
serve all its ratios and allocations.

A case, its key and its cached scores are in :mod:`~fisherkron.experiments.cases`, the sweep's noise and the
per-window losses in :mod:`~fisherkron.experiments.loss_noise`, the pitfall of App. "Impact of diagonal ..."
(GFWSVD with the output-side Cholesky factor untransposed) in :mod:`~fisherkron.experiments.pitfall`; all are
importable from here too.
"""
from __future__ import annotations

import copy
import hashlib
import logging
import math
import time
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm

from .._version import __version__
from ..core.conventions import FisherkronError
from ..env import code_digest, data_root
from .cases import (ALLOCATIONS, KINDS, MEASURED, Case, best_allocation, case_config, case_key, finite_or_none,
                    first_seconds, read_score, scored, write_score)
from .llm_summary import ZERO_SHOT, mmlu_scores, zero_shot_scores
from .loss_noise import difference_noise, sweep_noise, token_losses, window_losses
from .pitfall import compress_transposed, transposed_decomposition

__all__ = ["CODE_VERSION", "STUDY_METHODS", "ALLOCATIONS", "PAPER_ALLOCATION", "ASVD_CANDIDATES", "KINDS",
           "Protocol", "Case", "Study", "check_reachable", "study_stats", "calibrate", "first_tokens", "split_batches",
           "prepare", "case_config", "case_key", "best_allocation", "run_table", "token_losses", "difference_noise",
           "sweep_noise", "window_losses", "transposed_decomposition", "compress_transposed", "scored", "first_seconds",
           "read_score", "write_score", "finite_or_none"]

log = logging.getLogger(__name__)

#: bump when the meaning of a cached score changes (part of every case key)
CODE_VERSION = "llm-compression-1"
#: every method any notebook of the study compresses with: the calibration collects what they read, once
STUDY_METHODS = ("fwsvd", "asvd", "svd_llm", "gfwsvd", "gfwsvd_diag", "gfwsvd_offdiag", "kfac_svd", "basis_sharing")
#: how the paper ran each method (Sec. 6.3): GFWSVD with ASVD's sensitivity scores (its own sweep), ASVD
#: with its own, SVD-LLM uniform as its authors' code, FWSVD uniform as the paper describes it, Basis
#: Sharing with its own rank rule
PAPER_ALLOCATION = {"fwsvd": "uniform", "asvd": "sensitivity", "svd_llm": "uniform", "gfwsvd": "sensitivity",
                    "basis_sharing": "own"}
#: ASVD4LLM's ``param_ratio_candidates`` (sensitivity.py, since commit 1d213d5: 0.4 ... 0.9 of a layer's
#: weights *kept*) in our convention, the fraction of the layer's weights *removed*
ASVD_CANDIDATES = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6)
#: the library sources whose code decides a cached score (their contents enter every case key)
_SOURCES = ("core/methods.py", "core/wsvd.py", "core/regularization.py", "core/shrinkage.py", "core/lowrank.py",
            "core/factorization.py",
            "core/allocation.py", "core/basis_sharing.py", "hf/surgery.py", "hf/allocation.py", "hf/sensitivity.py",
            "hf/basis_sharing.py", "hf/budget.py", "hf/evaluate.py", "hf/lm_eval_tasks.py")


# ----------------------------------------------------------------------------- the protocol

@dataclass(frozen=True)
class Protocol:
    """Everything every case shares: the model, the data and the evaluation settings.

    ``calib_docs`` C4 (paper: FineWeb) documents give ``k`` calibration batches of ``batch_size``
    sequences of ``seq_len`` tokens; of the remaining documents, the first ``sweep_docs`` give the
    sweep's ``heldout_k`` batches and the rest the ``select_k`` selection batches. Perplexity: the
    first ``eval_tokens`` tokens (0: all) of each text in ``eval_seq_len`` windows. lm-eval:
    ``zero_shot_limit`` / ``mmlu_limit`` examples per task (per MMLU subject; ``None``: all) of the six
    zero-shot tasks and of ``mmlu_tasks`` (the 57-subject group, or a few subjects for a smoke run).
    """

    model_name: str = "smollm2"
    profile: str = "default"  # data and lm-eval tasks: "default" (embedded) or "paper" (the hub)
    calib_docs: int = 500
    k: int = 32
    batch_size: int = 2
    seq_len: int = 256
    seed: int = 0
    sweep_docs: int = 40
    heldout_k: int = 8
    select_k: int = 8
    layers: str | None = None
    eval_tokens: int = 4096
    eval_seq_len: int = 512
    sens_ratios: tuple = ASVD_CANDIDATES
    mff_tol: float = 1e-4
    zero_shot_limit: int | None = 100
    mmlu_limit: int | None = 2
    mmlu_tasks: tuple = ("mmlu",)  # the 57-subject group, or some ``mmlu_<subject>`` (a smoke run)
    lm_eval_batch_size: int = 16
    bootstrap_iters: int = 100

    @classmethod
    def from_params(cls, params: dict) -> "Protocol":
        """The protocol a notebook's recorded parameters describe: each field of this class that ``params`` names
        (a list as a tuple); a field it does not name keeps its default.

        >>> Protocol.from_params({"k": 4, "sens_ratios": [0.5], "ratios": [0.1]}).sens_ratios
        (0.5,)
        """
        names = {f.name for f in fields(cls)}
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in params.items() if k in names})


def check_reachable(model_name: str, target: str) -> None:
    """Raise the one-line error naming the embedded profile when ``model_name`` needs the hub and it is off."""
    from ..env import hub_offline
    from ..hf.registry import PAPER_MODELS

    if model_name in PAPER_MODELS and hub_offline():
        raise FisherkronError(
            f"{model_name} needs the Hugging Face hub, which is switched off here: run the embedded profile "
            f"(make {target} PROFILE=default, {PAPER_MODELS[model_name]}), or switch the hub on "
            f"(make {target} PROFILE=paper HF_HUB_OFFLINE=0 TRANSFORMERS_OFFLINE=0 HF_DATASETS_OFFLINE=0)")


def study_stats() -> tuple[str, ...]:
    """The statistics :data:`STUDY_METHODS` read, in the calibration's order (the same in every notebook)."""
    from ..hf.calibration import METHOD_STATS, STATS

    need = {s for m in STUDY_METHODS for s in METHOD_STATS[m]}
    return tuple(s for s in STATS if s in need)


def calibrate(model: nn.Module, batches, protocol: Protocol, progress: bool = True):
    """The study's one calibration call (cached on disk; the three notebooks share its entry)."""
    from .. import hf

    return hf.collect_calibration(model, batches, protocol.layers, seed=protocol.seed, grad_dtype="bfloat16",
                                  stats=study_stats(), progress=progress)


def _documents(protocol: Protocol) -> list[str]:
    from .. import hf

    if protocol.profile == "paper":  # FineWeb, streamed: enough documents for every split
        need = protocol.calib_docs + protocol.sweep_docs + max(protocol.sweep_docs, 100)
        return hf.c4_documents(profile="paper", n=need)
    return hf.c4_documents()


def sources_hash(sources=_SOURCES) -> str:
    """A digest of what the library files ``sources`` (paths below ``fisherkron/``) compute, comments and docstrings
    left out (:func:`fisherkron.env.code_digest`): the part of a cached score's key that changes when the code that
    computes it changes."""
    pkg = Path(__file__).resolve().parents[1]
    return code_digest(pkg / rel for rel in sources)


def first_tokens(tokenizer, text: str, n: int, margin: int = 256) -> torch.Tensor:
    """The first ``n`` token ids of ``text`` (``n = 0``: all of them), tokenising only a prefix.

    A tokenizer splits text into words before it merges, so a prefix's tokens agree with the whole
    text's except near the cut; the prefix is grown until it holds ``n + margin`` tokens.
    """
    from ..hf.evaluate import _token_ids

    if n <= 0:
        return _token_ids(tokenizer, text)
    chars = 8 * (n + margin)
    while chars < len(text):
        ids = _token_ids(tokenizer, text[:chars])
        if ids.numel() >= n + margin:
            return ids[:n]
        chars *= 2
    return _token_ids(tokenizer, text)[:n]


def _ids_fingerprint(ids: dict[str, torch.Tensor]) -> str:
    h = hashlib.blake2b(digest_size=12)
    for name in sorted(ids):
        h.update(name.encode())
        h.update(ids[name].numpy().tobytes())
    return h.hexdigest()


# ----------------------------------------------------------------------------- the study

@dataclass
class Study:
    """The model, its calibration, the held-out and evaluation data, and the score cache."""

    protocol: Protocol
    model: nn.Module
    tokenizer: object
    stats: object
    sweep_batches: list
    select_batches: list
    eval_ids: dict[str, torch.Tensor]
    names: list[str]
    model_key: str
    code: str
    cache_dir: Path
    decompositions: dict = field(default_factory=dict)  # method -> Decompositions (one method kept)
    timings: dict = field(default_factory=dict)  # seconds of computed (not cached) work, by kind
    cached: dict = field(default_factory=dict)  # scores read from the cache, by kind
    first: dict = field(default_factory=dict)  # {(kind, case key): seconds as first measured} (see scored)

    @property
    def mff_options(self) -> dict:
        return {"tol": self.protocol.mff_tol}

    def decompositions_of(self, method: str):
        """The weighted SVDs of ``method``, shared by its cases; those of another method are dropped from memory.
        They are also kept on disk (``data/cache/decompositions/``, bounded: :mod:`fisherkron.hf.decompositions`), so
        the next notebook on this model and calibration reads them instead of factorising again."""
        from ..hf.allocation import Decompositions

        if method not in self.decompositions:
            self.decompositions.clear()
            self.decompositions[method] = Decompositions(data_root() / "cache" / "decompositions")
        return self.decompositions[method]

    # -- keys and the cache
    def evaluation_settings(self, kind: str) -> dict:
        """What a score of ``kind`` depends on besides the compressed model."""
        from ..hf.calibration import data_fingerprint
        from ..hf.lm_eval_tasks import VERSION

        p = self.protocol
        if kind == "heldout":
            return {"batches": data_fingerprint(self.select_batches)}
        if kind in ("ppl", "windows"):
            return {"texts": _ids_fingerprint(self.eval_ids), "seq_len": p.eval_seq_len}
        import lm_eval

        common = {"lm_eval": lm_eval.__version__, "tasks": "hub" if p.profile == "paper" else f"local-v{VERSION}",
                  "batch_size": p.lm_eval_batch_size, "bootstrap_iters": p.bootstrap_iters}
        if kind == "zeroshot":
            return {**common, "names": list(ZERO_SHOT), "limit": p.zero_shot_limit, "fewshot": 0, "per_example": True}
        return {**common, "names": list(p.mmlu_tasks), "limit": p.mmlu_limit, "fewshot": 5}

    def config(self, case: Case, kind: str) -> dict:
        from ..hf.calibration import data_fingerprint

        ranks = self.ranks_of(case) if case.allocation == "ranks" else None
        return case_config(method=case.method, allocation=case.allocation, ratio=case.ratio, kind=kind,
                           model=self.model_key, calibration=self.stats.key, code=self.code,
                           sweep=data_fingerprint(self.sweep_batches), candidates=self.protocol.sens_ratios,
                           ranks=ranks, mff_options=self.mff_options, evaluation=self.evaluation_settings(kind))

    def _read(self, config: dict) -> dict | None:
        return read_score(self.cache_dir, config)

    def _write(self, config: dict, result: dict, seconds: float) -> None:
        write_score(self.cache_dir, config, result, seconds)

    # -- compression
    def ranks_of(self, case: Case) -> dict:
        """The per-layer ranks of ``case.source`` at ``case.ratio`` (from its cached held-out record)."""
        if case.source is None:
            raise FisherkronError(f"case {case.label} reuses ranks but names no source case")
        src = Case(case.source[0], case.source[1], case.ratio)
        return self.scores(src, ("heldout",))["heldout"]["ranks"]

    def build(self, case: Case, progress: bool = False) -> tuple[nn.Module, dict]:
        """A compressed copy of the model and what the compression did (ratios, ranks, timings)."""
        from ..hf.basis_sharing import compress_basis_sharing
        from ..hf.budget import count_params
        from ..hf.surgery import compress

        model = copy.deepcopy(self.model)
        before = count_params(self.model)
        t = time.perf_counter()
        info: dict = {}
        if case.method == "dense":
            return model, {"ratio": 0.0, "layers_ratio": 0.0, "ranks": {}, "compress_seconds": 0.0}
        if case.method == "basis_sharing":
            rep = compress_basis_sharing(model, self.stats, case.ratio, progress=progress)
            info = {"layers_ratio": rep.layers_ratio, "ranks": dict(rep.ranks), "rho": rep.rho}  # ranks by type
        elif case.method == "gfwsvd_transposed":
            ranks = self.ranks_of(case)
            rep = compress_transposed(model, self.stats, ranks, mff_options=self.mff_options, progress=progress)
            info = {"layers_ratio": rep["layers_ratio"], "ranks": ranks}
        elif case.allocation in MEASURED:
            alloc = self.allocation(case, progress=progress)
            rep = compress(model, case.method, self.stats, None, ranks=alloc.ranks, mff_options=self.mff_options,
                           decompositions=self.decompositions_of(case.method), progress=progress)
            d = alloc.details
            info = {"layers_ratio": rep.layers_ratio, "ranks": dict(alloc.ranks),
                    "allocation_evaluations": alloc.evaluations, "sweep_seconds": d.get("sweep_seconds", 0.0),
                    "allocation_seconds": alloc.seconds, "predicted": dict(alloc.predicted or {}),
                    "scales": d.get("scales"), "fallback_scale": d.get("fallback_scale"),
                    "solver": {k: d.get(k) for k in ("solver", "optimal", "gap", "mip_gap", "solve_seconds")}}
        else:
            kw: dict = {}
            if case.allocation == "ranks":
                kw["ranks"] = self.ranks_of(case)
            else:
                kw["ratio"] = case.ratio
                kw["allocation"] = case.allocation
                if case.allocation == "sensitivity":
                    kw["allocation_options"] = {"heldout": self.sweep_batches,
                                                "sensitivity_ratios": tuple(self.protocol.sens_ratios)}
            rep = compress(model, case.method, self.stats, None, mff_options=self.mff_options,  # the stats' layers
                           decompositions=self.decompositions_of(case.method), progress=progress, **kw)
            cost = rep.allocation_cost or {}
            info = {"layers_ratio": rep.layers_ratio, "ranks": {n: lr.rank if lr.skipped is None else None
                                                                for n, lr in rep.layers.items()},
                    "allocation_evaluations": cost.get("evaluations", 0),
                    "sweep_seconds": cost.get("sweep_seconds", 0.0)}
        info["ratio"] = 1.0 - count_params(model) / before  # the paper's 1 - compressed / original
        info["compress_seconds"] = time.perf_counter() - t
        return model, info

    def allocation(self, case: Case, progress: bool = False):
        """The :class:`~fisherkron.hf.allocation.Allocation` of a measured case (:data:`MEASURED`): its one
        point per layer measured on the sweep batches (cached by the library like the sweep), its curves
        from the method's kept SVDs, its ranks from the exact integer program."""
        from ..hf.allocation import allocate

        strategy, options = MEASURED[case.allocation]
        return allocate(self.model, case.method, self.stats, self.names, ratio=case.ratio, strategy=strategy,
                        heldout=self.sweep_batches, mff_options=self.mff_options,
                        decompositions=self.decompositions_of(case.method), progress=progress, **options)

    # -- evaluation
    @torch.no_grad()
    def evaluate(self, model: nn.Module, kind: str) -> dict:
        """One ``kind`` of score of ``model`` (see :data:`KINDS`)."""
        from ..hf.evaluate import perplexity, run_lm_eval
        from ..hf.sensitivity import mean_loss

        p = self.protocol
        model.eval()
        if kind == "heldout":
            return {"loss": mean_loss(model, self.select_batches)}
        if kind == "ppl":
            return {name: perplexity(model, None, ids, seq_len=p.eval_seq_len).ppl
                    for name, ids in self.eval_ids.items()}
        if kind == "windows":
            return {name: window_losses(model, ids, p.eval_seq_len) for name, ids in self.eval_ids.items()}
        profile = "paper" if p.profile == "paper" else "default"
        if kind == "zeroshot":
            res = run_lm_eval(model, self.tokenizer, list(ZERO_SHOT), num_fewshot=0, limit=p.zero_shot_limit,
                              per_example=True,
                              batch_size=p.lm_eval_batch_size, bootstrap_iters=p.bootstrap_iters, profile=profile,
                              seed=p.seed)
            return zero_shot_scores(res)
        res = run_lm_eval(model, self.tokenizer, list(p.mmlu_tasks), num_fewshot=5, limit=p.mmlu_limit,
                          batch_size=p.lm_eval_batch_size, bootstrap_iters=p.bootstrap_iters, profile=profile,
                          seed=p.seed)
        subjects = None if "mmlu" in p.mmlu_tasks else [t.removeprefix("mmlu_") for t in p.mmlu_tasks]
        return mmlu_scores(res, subjects=subjects)

    def scores(self, case: Case, kinds=("heldout", "ppl"), progress: bool = False) -> dict:
        """``{kind: result}`` of ``case``: read from the cache, or the model compressed once and every
        missing kind computed and kept as soon as it exists. The ``heldout`` record also holds the
        compression's ratios and ranks and is always made first."""
        kinds = ["heldout"] + [k for k in kinds if k != "heldout"]
        return scored({k: self.config(case, k) for k in kinds}, lambda: self.build(case, progress=progress),
                      self.evaluate, read=self._read, write=self._write, timings=self.timings, cached=self.cached,
                      first=self.first)

    def max_sensitivity_removal(self) -> int:
        """Parameters removed with every layer at the sweep's largest candidate: the most the sensitivity
        allocation can reach. ASVD's candidates remove at most 60 % of a layer, so where the embeddings are a
        large share of the model (21 % of SmolLM2) the largest whole-model ratios are out of its reach."""
        from ..core.allocation import saving
        from ..core.lowrank import rank_for_ratio

        mods = dict(self.model.named_modules())
        top = max(self.protocol.sens_ratios)
        return sum(max(saving(*mods[name].weight.shape, rank_for_ratio(*mods[name].weight.shape, top)), 0)
                   for name in self.names)

    def sensitivity_reach(self) -> float:
        """:meth:`max_sensitivity_removal` as a whole-model ratio."""
        from ..hf.budget import count_params

        return self.max_sensitivity_removal() / count_params(self.model)

    def feasible(self, allocation: str, ratio: float) -> bool:
        """Whether ``allocation`` can reach ``ratio`` (only the sensitivity allocation is bounded)."""
        from ..hf.budget import count_params

        return allocation != "sensitivity" or math.ceil(ratio * count_params(self.model)) <= \
            self.max_sensitivity_removal()

    def sweep(self, method: str, progress: bool = True) -> dict:
        """ASVD's sensitivity sweep of ``method`` on the sweep batches (cached by the library, resumable), run with
        its progress bar before the first sensitivity case needs it; that case and :func:`sweep_noise` then read
        the same cache entry (the same model, layers in the statistics' order, batches, candidates and options)."""
        from ..hf.sensitivity import sensitivity_sweep

        return sensitivity_sweep(self.model, method, self.stats, self.names, self.sweep_batches,
                                 ratios=tuple(self.protocol.sens_ratios), mff_options=self.mff_options,
                                 decompositions=self.decompositions_of(method), progress=progress)

    def selection(self, method: str, ratio: float, allocations=ALLOCATIONS) -> dict:
        """Each allocation's held-out selection loss for ``method`` at ``ratio``, and the best one
        (:func:`best_allocation`).

        An allocation that cannot reach ``ratio`` (:meth:`feasible`) is skipped and listed in ``infeasible``.
        """
        tried = [a for a in allocations if self.feasible(a, ratio)]
        if "sensitivity" in tried:
            self.sweep(method)
        losses = {a: self.scores(Case(method, a, ratio), ("heldout",))["heldout"]["loss"] for a in tried}
        return {"losses": losses, "best": best_allocation(losses, tuple(tried)),
                "infeasible": [a for a in allocations if a not in tried]}


def run_table(study: Study, methods, targets, kinds, *, extra=(), allocations=ALLOCATIONS,
              progress: bool = True) -> tuple[list[dict], dict]:
    """The rows of a comparison table, in two blocks per target ratio, and each method's selection.

    Block ``"paper"``: each of ``methods`` allocated as the paper ran it (:data:`PAPER_ALLOCATION`);
    block ``"best"``: each of ``methods`` and ``extra`` with its best of ``allocations`` on the held-out
    selection loss (:meth:`Study.selection`; Basis Sharing keeps its own rank rule in both). A paper row whose
    allocation cannot reach the ratio (:meth:`Study.feasible`) is kept with ``infeasible=True`` and no scores.
    Work runs method by method, so each method's weighted SVDs are computed once for all its cases. Returns
    ``(rows, selections)``: one dict per (block, target, method) with the case and its :func:`flatten`-ed
    scores, and ``{method: {target: selection}}``.
    """
    from .llm_summary import flatten

    order = list(dict.fromkeys([*methods, *extra]))
    rows, selections = [], {}
    bar = tqdm(total=len(order) * len(targets), desc="cases (method x ratio)", disable=not progress)
    for method in order:
        for target in targets:
            if method == "basis_sharing":
                chosen = {"paper": "own", "best": "own"}
            else:
                sel = study.selection(method, target, allocations)
                selections.setdefault(method, {})[target] = sel
                chosen = {"best": sel["best"]}
                if method in methods and method in PAPER_ALLOCATION:
                    chosen["paper"] = PAPER_ALLOCATION[method]
            for block, allocation in chosen.items():
                if block == "paper" and method not in methods:
                    continue
                case = Case(method, allocation, target)
                row = {"block": block, "target": target, "method": method, "allocation": allocation,
                       "label": case.label, "infeasible": not study.feasible(allocation, target)}
                if not row["infeasible"]:
                    row.update(flatten(study.scores(case, kinds)))
                rows.append(row)
            bar.update(1)
    bar.close()
    return rows, selections


def code_tag() -> str:
    """The code part of every case key: :data:`CODE_VERSION`, the package version, :func:`sources_hash` and the
    versions of torch and transformers."""
    import transformers

    return (f"{CODE_VERSION}/{__version__}/{sources_hash()}/torch-{torch.__version__}/"
            f"transformers-{transformers.__version__}")


def split_batches(protocol: Protocol, tok) -> tuple[list, list, list]:
    """``(calibration, sweep, selection)`` token batches of the protocol, from disjoint documents: the first
    ``calib_docs`` give the ``k`` calibration batches, the next ``sweep_docs`` the ``heldout_k`` sweep batches, the
    rest the ``select_k`` selection batches (each draw seeded)."""
    from .. import hf

    p = protocol
    docs = _documents(p)
    if p.calib_docs + p.sweep_docs >= len(docs):
        raise FisherkronError(f"calib_docs={p.calib_docs} + sweep_docs={p.sweep_docs} leave no selection documents "
                              f"of {len(docs)}; lower them")
    calib = hf.lm_batches(tok, docs[:p.calib_docs], k=p.k, batch_size=p.batch_size, seq_len=p.seq_len, seed=p.seed)
    rest = docs[p.calib_docs:]
    sweep = hf.lm_batches(tok, rest[:p.sweep_docs], k=p.heldout_k, batch_size=p.batch_size, seq_len=p.seq_len,
                          seed=p.seed + 1)
    select = hf.lm_batches(tok, rest[p.sweep_docs:], k=p.select_k, batch_size=p.batch_size, seq_len=p.seq_len,
                           seed=p.seed + 2)
    return calib, sweep, select


def prepare(protocol: Protocol, target: str = "tab_llm_compression_main", progress: bool = True,
            loaded: tuple | None = None) -> Study:
    """Load the model, calibrate (cached), draw the held-out batches and tokenise the evaluation texts.

    ``target``: the notebook's Make target, named in the one-line error of an unreachable hub model;
    ``loaded``: ``(model, tokenizer)`` of ``protocol.model_name`` already loaded (else it is loaded here).
    """
    from .. import hf
    from ..hf.calibration import model_fingerprint

    check_reachable(protocol.model_name, target)
    p = protocol
    model, tok = loaded if loaded is not None else hf.load_model(p.model_name)
    batches, sweep, select = split_batches(p, tok)
    stats = calibrate(model, batches, p, progress=progress)
    profile = "paper" if p.profile == "paper" else "default"
    texts = {"wiki": hf.wiki_text(profile=profile), "ptb": hf.ptb("test", profile=profile)}
    eval_ids = {name: first_tokens(tok, text, p.eval_tokens) for name, text in texts.items()}
    return Study(p, model, tok, stats, sweep, select, eval_ids, list(stats.layers), model_fingerprint(model),
                 code_tag(), data_root() / "cache" / "studies" / "llm_compression")
