r"""A case of the decoder study: one compressed model, the key of each of its scores, and the scores kept on disk.

A case (:class:`Case`) is a method, an allocation and a whole-model ratio. Each kind of score of it
(:data:`KINDS`) is one JSON file named by :func:`case_key`, the hash of :func:`case_config`: everything the score
depends on (the model's fingerprint, the calibration's key, the code, the evaluation settings) and nothing else,
so a changed input gives a new name and a stale score is never read. :func:`scored` reads the kinds a case has,
builds the model once for the ones it lacks and writes each as soon as it exists (:func:`write_score`,
atomically), so an interrupted study resumes at its next missing score. :mod:`fisherkron.experiments.llm_compression`
runs the study on these.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

from ..core.conventions import FisherkronError
from ..env import atomic_write

__all__ = ["ALLOCATIONS", "MEASURED", "KINDS", "Case", "case_config", "case_key", "finite_or_none", "best_allocation",
           "read_score", "write_score", "scored", "first_seconds"]

log = logging.getLogger(__name__)

#: the allocations a method is tried with; its best is chosen on the held-out selection loss
ALLOCATIONS = ("uniform", "fisher", "sensitivity")
#: the allocations that measure one point per layer on the sweep batches: a case's allocation
#: name -> the library's strategy and its options (``fisherkron.hf.allocation.allocate``); the Theorem-1
#: curves calibrated by the held-out loss (the default) or by the KL divergence, and LEMS's baseline
MEASURED = {"calibrated": ("calibrated", {"calibrate_metric": "loss"}),  # named: the library default is kl
            "calibrated_kl": ("calibrated", {"calibrate_metric": "kl"}),
            "lems": ("lems", {})}
#: the evaluations of a case, each cached on its own: held-out selection loss, perplexities, lm-eval suites, and
#: the perplexities' per-window negative log-likelihoods (for paired standard errors between cases)
KINDS = ("heldout", "ppl", "zeroshot", "mmlu", "windows")


@dataclass(frozen=True)
class Case:
    """One compressed model: ``method`` (a key of :data:`fisherkron.METHODS`, ``"basis_sharing"``,
    ``"gfwsvd_transposed"`` or ``"dense"``), its ``allocation`` (:data:`ALLOCATIONS`, ``"own"`` for
    Basis Sharing, ``"ranks"`` for the ranks of another case, ``"dense"``) and the target whole-model
    ``ratio``. With ``allocation="ranks"``, ``source`` is the ``(method, allocation)`` whose ranks at the
    same ratio are reused (the ablation: every row gets GFWSVD's ranks)."""

    method: str
    allocation: str
    ratio: float
    source: tuple[str, str] | None = None

    @property
    def label(self) -> str:
        if self.method == "dense":
            return "dense"
        src = f"<{self.source[0]}:{self.source[1]}>" if self.source else ""
        return f"{self.method}|{self.allocation}{src}|{self.ratio:.4f}"


def case_config(*, method: str, allocation: str, ratio: float, kind: str, model: str, calibration: str | None,
                code: str, sweep: str | None = None, candidates=None, ranks: dict | None = None,
                mff_options: dict | None = None, evaluation: dict | None = None) -> dict:
    """Everything a cached score depends on, and nothing else.

    ``model``: the dense model's fingerprint; ``calibration``: the statistics' key (not for the dense
    model or plain SVD); ``code``: :data:`CODE_VERSION`, the library sources and versions; ``sweep`` and
    ``candidates``: the sweep's held-out batches and per-layer ratios (the sensitivity allocation
    only); ``ranks``: the per-layer ranks of an ``allocation="ranks"`` case; ``mff_options``: for the
    methods that run MFF; ``evaluation``: the settings of this ``kind`` of score.

    >>> a = case_config(method="svd_llm", allocation="uniform", ratio=0.1, kind="ppl", model="m", calibration="c",
    ...                 code="v", sweep="s", mff_options={"tol": 1e-4})
    >>> a == case_config(method="svd_llm", allocation="uniform", ratio=0.1, kind="ppl", model="m", calibration="c",
    ...                  code="v")  # neither the sweep nor MFF's options change a uniform SVD-LLM
    True
    """
    from ..core.methods import METHODS

    if kind not in KINDS:
        raise FisherkronError(f"kind {kind!r} is unknown; use one of {', '.join(KINDS)}")
    dense = method == "dense"
    kron = method == "gfwsvd_transposed" or (method in METHODS and METHODS[method].kronecker)
    cfg = {"code": code, "model": model, "kind": kind, "method": method,
           "allocation": "dense" if dense else allocation, "ratio": 0.0 if dense else round(float(ratio), 6),
           "calibration": None if dense or (method == "svd" and allocation not in _READS_STATS) else calibration,
           "evaluation": _jsonable(evaluation or {})}
    uses_sweep = allocation == "sensitivity" or (allocation == "ranks" and ranks is None)
    if uses_sweep and not dense:
        cfg["sweep"] = sweep
        cfg["candidates"] = [float(c) for c in (candidates or ())]
    if allocation in MEASURED and not dense:  # one point per layer, measured on the sweep batches
        cfg["sweep"] = sweep
        cfg["measured"] = _jsonable(MEASURED[allocation][1])
    if allocation == "ranks" and ranks is not None:
        cfg["ranks"] = hashlib.blake2b(json.dumps(sorted(ranks.items()), default=str).encode(),
                                       digest_size=12).hexdigest()
    if kron and not dense:
        cfg["mff_options"] = _jsonable(mff_options or {})
    return cfg


#: the allocations that read the calibration statistics even for plain SVD (Theorem 1's curves in the Fisher metric)
_READS_STATS = ("fisher", "calibrated", "calibrated_kl")


def case_key(config: dict) -> str:
    """The file name of a cached score: a hash of its :func:`case_config` (key order does not matter)."""
    return hashlib.blake2b(json.dumps(config, sort_keys=True, default=str).encode(), digest_size=16).hexdigest()


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in sorted(x.items(), key=lambda kv: str(kv[0]))}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return repr(x)
    return x


def finite_or_none(x):
    """``x`` with every non-finite float replaced by ``None`` (strict JSON; read back as ``nan`` by the tables)."""
    if isinstance(x, dict):
        return {k: finite_or_none(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [finite_or_none(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def best_allocation(losses: dict[str, float], order=ALLOCATIONS) -> str:
    """The allocation of lowest held-out selection loss; a tie (equal losses) goes to the first in ``order``.

    The rule of the "best allocation here" rows: chosen on the loss of the selection batches (held-out
    C4 documents that neither calibration nor the sweep saw), never on the evaluation texts. A
    missing or non-finite loss never wins.

    >>> best_allocation({"uniform": 5.1, "fisher": 4.2, "sensitivity": 4.2})
    'fisher'
    """
    got = [(float(losses[a]), i, a) for i, a in enumerate(order) if a in losses and math.isfinite(losses[a])]
    if not got:
        raise FisherkronError(f"no finite selection loss among {', '.join(order)}: {losses}")
    return min(got)[2]


def read_score(folder, config: dict) -> dict | None:
    """The cached record of ``config`` in ``folder`` (``{"key", "config", "result", "seconds"}``), or ``None`` when
    it is missing, unreadable (a warning) or holds another key."""
    path = Path(folder) / f"{case_key(config)}.json"
    try:
        got = json.loads(path.read_text()) if path.is_file() else None
    except (OSError, ValueError) as exc:
        log.warning("cached score %s is unreadable (%s); computing it again", path, exc)
        return None
    if not isinstance(got, dict) or got.get("key") != case_key(config) or "result" not in got:
        return None
    return got


def write_score(folder, config: dict, result: dict, seconds: float) -> None:
    """Keep ``result`` of ``config`` in ``folder`` (atomically; strict JSON, non-finite floats as ``null``)."""
    rec = {"key": case_key(config), "config": config, "result": finite_or_none(result), "seconds": seconds}
    atomic_write(Path(folder) / f"{rec['key']}.json",
                 lambda t: Path(t).write_text(json.dumps(rec, indent=1, allow_nan=False)))


def scored(configs: dict, build, evaluate, *, read, write, timings: dict, cached: dict,
           first: dict | None = None) -> dict:
    """``{kind: result}`` of one model under ``configs`` (``{kind: its case_config}``): each kind read back with
    ``read(config)`` (a record with ``"result"``, or ``None``); for the missing ones the model is built once
    (``build() -> (model, info)``), each missing kind evaluated (``evaluate(model, kind)``) and kept with
    ``write(config, result, seconds)`` as soon as it exists. The ``heldout`` result also holds ``info``. A fresh
    result is returned as a rerun reads it back (non-finite floats as ``None``). ``timings`` adds the seconds
    of work done (``compress`` from ``info["compress_seconds"]``, and each kind), ``cached`` counts the kinds
    read back. ``first`` (optional) receives ``{(kind, case key): seconds}`` as first measured, whether computed
    now or read back with their records (a score used twice counts once): what the scores cost from empty
    caches, :func:`first_seconds` sums it by kind."""
    first = {} if first is None else first

    def spent(kind: str, seconds, of: str | None = None) -> None:
        first[(kind, case_key(configs[of or kind]))] = float(seconds or 0.0)

    out, todo = {}, []
    for k, cfg in configs.items():
        got = read(cfg)
        if got is None:
            todo.append(k)
        else:
            out[k] = got["result"]
            cached[k] = cached.get(k, 0) + 1
            spent(k, got.get("seconds"))
            if k == "heldout":
                spent("compress", (got["result"] or {}).get("compress_seconds"), of="heldout")
    if not todo:
        return out
    model, info = build()
    timings["compress"] = timings.get("compress", 0.0) + info.get("compress_seconds", 0.0)
    if "heldout" in todo:  # the compression's seconds are kept with the heldout record
        spent("compress", info.get("compress_seconds"), of="heldout")
    for k in todo:
        t = time.perf_counter()
        res = evaluate(model, k)
        if k == "heldout":
            res = {**info, **res}
        sec = time.perf_counter() - t
        timings[k] = timings.get(k, 0.0) + sec
        spent(k, sec)
        write(configs[k], res, sec)
        out[k] = finite_or_none(res)
    del model
    return out


def first_seconds(first: dict) -> dict:
    """``{kind: seconds}`` summed over the scores of ``first`` (see :func:`scored`)."""
    out: dict = {}
    for (kind, _), sec in first.items():
        out[kind] = out.get(kind, 0.0) + sec
    return out
