r"""The rank-allocation study (Sec. 6.3's protocol): methods x allocation strategies x ratios on a decoder.

:func:`prepare` loads the model, collects calibration statistics on C4 documents and a
held-out set of calibration batches from other C4 documents (for the sensitivity sweep; the
allocation never sees the evaluation text), and tokenises the evaluation texts once.
:func:`run_case` compresses a copy of the model with one method, strategy and ratio and
scores it; each result is kept in a JSON file beside the calibration cache, written after
every case, so a study can be run in pieces and resumed. :func:`validate_predictions`
compares Theorem 1's predicted loss increase with the measured one, per layer and rank.
"""
from __future__ import annotations

import copy
import hashlib
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..core.factorization import mff_dtype
from ..env import atomic_write, data_root

__all__ = ["Setup", "prepare", "run_case", "validate_predictions", "CODE_VERSION"]

log = logging.getLogger(__name__)
CODE_VERSION = "rank-allocation-3"  # 2: rows carry sweep_seconds; 3: fwsvd is the input-side form


def _mff_options(options: dict | None) -> dict:
    """``options`` for :func:`fisherkron.mff`, a ``dtype`` given by name made the torch dtype; one-line error else.

    float64 GEMMs leave MFF's factors independent of the summation order to round-off (float32's
    differ in their 4th-5th digit between 1 and 2 threads on SmolLM2), so the exact knapsack of the
    ``fisher`` allocation picks the same ranks from the same gradients on any thread count
    (``scripts/allocation_reproducibility.py``).

    >>> _mff_options({"tol": 1e-4, "dtype": "float64"})
    {'tol': 0.0001, 'dtype': torch.float64}
    """
    out = dict(options or {})
    if "dtype" in out:
        out["dtype"] = mff_dtype(out["dtype"])
    return out


@dataclass
class Setup:
    """Everything the cases share."""

    model: torch.nn.Module
    tokenizer: object
    stats: object
    heldout: list
    names: list[str]
    eval_ids: dict[str, torch.Tensor]
    eval_seq_len: int
    base: dict[str, float] = field(default_factory=dict)
    key: str = ""
    results_path: Path | None = None
    sens_ratios: tuple[float, ...] = (0.2, 0.4, 0.6, 0.8)
    mff_options: dict = field(default_factory=dict)
    decompositions: dict = field(default_factory=dict)  # method -> hf.allocation.Decompositions (one kept)

    def decompositions_of(self, method: str):
        """The weighted SVDs of ``method``, shared by its cases; those of other methods are dropped."""
        from ..hf.allocation import Decompositions

        if method not in self.decompositions:
            self.decompositions.clear()
            self.decompositions[method] = Decompositions()
        return self.decompositions[method]


def prepare(model_name: str = "smollm2", *, k: int = 4, batch_size: int = 2, seq_len: int = 256, seed: int = 0,
            heldout_k: int = 2, calib_docs: int = 500, layers=None, eval_tokens: int = 4096,
            eval_seq_len: int = 512, sens_ratios=(0.2, 0.4, 0.6, 0.8), mff_options: dict | None = None,
            progress: bool = False) -> Setup:
    """Load, calibrate (cached) and tokenise; the held-out batches come from C4 documents the calibration
    does not use."""
    from .. import hf

    mff = _mff_options(mff_options)  # a bad dtype fails before the model loads
    model, tok = hf.load_model(model_name)
    docs = hf.c4_documents()
    if calib_docs >= len(docs):
        raise ValueError(f"calib_docs={calib_docs} leaves no held-out documents of {len(docs)}")
    batches = hf.lm_batches(tok, docs[:calib_docs], k=k, batch_size=batch_size, seq_len=seq_len, seed=seed)
    heldout = hf.lm_batches(tok, docs[calib_docs:], k=heldout_k, batch_size=batch_size, seq_len=seq_len,
                            seed=seed + 1)
    stats = hf.collect_calibration(model, batches, layers, seed=seed, progress=progress)
    from ..hf.evaluate import _token_ids

    texts = {"ptb": hf.ptb("test"), "wiki": hf.wiki_text()}
    eval_ids = {name: _token_ids(tok, text)[:eval_tokens] for name, text in texts.items()}
    cfg = [CODE_VERSION, stats.key, hf.calibration.data_fingerprint(heldout), eval_tokens, eval_seq_len,
           list(sens_ratios), sorted((mff_options or {}).items())]
    key = hashlib.blake2b(json.dumps(cfg, default=str).encode(), digest_size=12).hexdigest()
    setup = Setup(model, tok, stats, heldout, list(stats.layers), eval_ids, eval_seq_len, key=key,
                  results_path=data_root() / "cache" / "studies" / f"rank_allocation-{key}.json",
                  sens_ratios=tuple(sens_ratios), mff_options=mff)
    setup.base = _cached(setup, "dense", lambda: _score(setup, model))
    return setup


def _load(setup: Setup) -> dict:
    p = setup.results_path
    if p is not None and p.exists():
        try:
            return json.loads(p.read_text())
        except (OSError, ValueError):
            log.warning("results cache %s is unreadable; recomputing", p)
    return {}


def _cached(setup: Setup, case: str, compute) -> dict:
    results = _load(setup)
    if case in results:
        return results[case]
    value = compute()
    results = _load(setup)  # another case may have been written meanwhile
    results[case] = value
    atomic_write(setup.results_path, lambda t: Path(t).write_text(json.dumps(results, indent=1)))
    return value


@torch.no_grad()
def _score(setup: Setup, model) -> dict:
    from ..hf.sensitivity import mean_loss
    from ..hf.evaluate import perplexity

    t = time.perf_counter()
    out = {f"ppl_{name}": perplexity(model, None, ids, seq_len=setup.eval_seq_len).ppl
           for name, ids in setup.eval_ids.items()}
    out["heldout_loss"] = mean_loss(model, setup.heldout)
    out["eval_seconds"] = time.perf_counter() - t
    return out


def run_case(setup: Setup, method: str, strategy: str, ratio: float, *, progress: bool = False) -> dict:
    """Compress a copy of the model (``method``, ``strategy``, whole-model ``ratio``) and score it (cached)."""
    from ..hf.surgery import compress

    case = f"{method}|{strategy}|{ratio:.4f}"

    def compute() -> dict:
        model = copy.deepcopy(setup.model)
        opts = ({"heldout": setup.heldout, "sensitivity_ratios": setup.sens_ratios}
                if strategy == "sensitivity" else None)
        t = time.perf_counter()
        rep = compress(model, method, setup.stats, ratio=ratio, allocation=strategy, allocation_options=opts,
                       mff_options=setup.mff_options, decompositions=setup.decompositions_of(method),
                       progress=progress)
        row = {"method": method, "strategy": strategy, "target_ratio": ratio, "ratio": rep.ratio,
               "compress_seconds": time.perf_counter() - t,
               "allocation_evaluations": (rep.allocation_cost or {}).get("evaluations", 0),
               "allocation_seconds": (rep.allocation_cost or {}).get("seconds", 0.0),
               "sweep_seconds": (rep.allocation_cost or {}).get("sweep_seconds", 0.0),
               "dense_layers": sum(lr.skipped is not None for lr in rep.layers.values()),
               "ranks": rep.ranks}
        row.update(_score(setup, model))
        return row

    return _cached(setup, case, compute)


@torch.no_grad()
def validate_predictions(setup: Setup, method: str = "gfwsvd", layers: list[str] | None = None,
                         ratios=(0.3, 0.6, 0.9), progress: bool = False) -> list[dict]:
    """Predicted (Theorem 1, ``0.5 tr(dW^T B dW A)``) against measured held-out loss increase,
    compressing one layer at a time at several per-layer ratios (cached)."""
    from tqdm.auto import tqdm

    from ..core.lowrank import rank_for_ratio
    from ..hf.allocation import fisher_curves
    from ..hf.sensitivity import loss_with_factors

    layers = layers or setup.names
    decs = setup.decompositions_of(method)
    curves, _ = fisher_curves(setup.model, method, setup.stats, layers, mff_options=setup.mff_options,
                              decompositions=decs)

    def compute() -> list[dict]:
        rows = []
        base = setup.base["heldout_loss"]
        for name in tqdm(layers, desc="validation", disable=not progress):
            lin = setup.model.get_submodule(name)
            n, m = lin.weight.shape
            dec, _ = decs.get(lin, method, setup.stats, name, mff_options=setup.mff_options)
            for rho in ratios:
                r = rank_for_ratio(n, m, rho)
                f = dec.factors(r, name)
                loss = loss_with_factors(setup.model, name, f, setup.heldout)
                rows.append({"layer": name, "ratio": rho, "rank": r, "predicted": float(curves[name][r]),
                             "measured": loss - base})
        return rows

    key = f"validation|{method}|{','.join(map(str, ratios))}|{hashlib.blake2b(''.join(layers).encode(), digest_size=6).hexdigest()}"
    return _cached(setup, key, compute)
