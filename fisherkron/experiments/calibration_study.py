r"""Calibration at scale on the embedded decoder: cost and quality against ``k`` and granularity.

Two kinds of measurement, both cached in ``data/cache/studies/calibration-<key>.json`` (written
after every record, so a study can be stopped and resumed):

* **cost** (:func:`measure`): one calibration setting ``(k, granularity, grad_dtype)`` runs in a
  fresh process (so its peak resident memory is its own): :func:`fisherkron.collect_calibration`
  of every linear layer, then MFF's ``A (x) B`` of every layer (Algorithm 1, warm-started from
  K-FAC) and, optionally, GFWSVD compression of the whole model. It records seconds per step,
  tokens/s, bytes on disk, peak RSS, the share of the cores other processes used meanwhile
  (:class:`fisherkron.env.OtherLoad`: 0 on idle cores), whether the collection resumed an
  interrupted one (then its seconds are not the whole collection's), MFF's products and their rate
  (``2 k n m (n + m)`` flops per product with ``k`` stored gradients, ``2 T (n^2 + m^2)`` with
  ``T`` token gradients). The calibration and the factors land in the normal caches, so the
  quality cases below reuse them. With ``keep=False`` it runs in a temporary folder (a size
  measured only for its cost, e.g. ``k = 64``). ``mff_layers`` restricts MFF to some layers
  (the warm-start comparison: the same layers from K-FAC and from the identity). A study
  prepared with ``isolate=False`` measures in its own process instead (the smoke run: it saves
  a process start and imports per setting, and its peak memory is then the notebook's, which the
  record says with ``"isolated": False``).
* **quality** (:func:`run_case`): a copy of the model compressed by one method at one
  whole-model ratio with the ``fisher`` allocation (each method's ranks minimise its own
  Theorem-1 error curves, :mod:`fisherkron.hf.allocation`), scored by perplexity on the
  evaluation texts. A case is keyed by the calibration's cache key, so a changed calibration is
  never served stale results, and, for the methods that read MFF's factors, by MFF's dtype
  (``prepare(mff_dtype=)``; float64 makes the exact knapsack pick the same ranks on every
  machine, see :func:`fisherkron.core.factorization.mff_dtype`). The cost measurements time the
  float32 default.

:func:`encoding_error` measures what 16-bit gradients do to MFF's factors: the relative
Frobenius error of ``A (x) B`` from bfloat16 / float16 gradients against float32 gradients of
the same batches.

``python -m fisherkron.experiments.calibration_study`` runs the cost measurements from the
command line (``--help``).
"""
from __future__ import annotations

import copy
import hashlib
import json
import logging
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..env import OtherLoad, atomic_write, data_root
from .benchmark import kron_rel_error

__all__ = ["Study", "prepare", "measure", "stats_of", "run_case", "gradient_count", "encoding_error",
           "CODE_VERSION"]

log = logging.getLogger(__name__)
CODE_VERSION = "calibration-study-1"


@dataclass
class Study:
    """What the measurements share: the model, its calibration protocol and the evaluation texts."""

    model_name: str
    model: torch.nn.Module
    tokenizer: object
    protocol: dict  # batch_size, seq_len, seed, calib_docs, layers, mff_tol
    eval_ids: dict[str, torch.Tensor]
    eval_seq_len: int
    results_path: Path
    base: dict[str, float] = field(default_factory=dict)
    isolate: bool = True  # cost measurements in a fresh process (their own peak memory)
    mff_dtype: str = "float32"  # MFF's dtype in the quality cases (the cost measurements time float32)
    _decompositions: dict = field(default_factory=dict)

    def decompositions_of(self, key: str, method: str):
        """The weighted SVDs of ``method`` on calibration ``key``; those of any other pair are dropped."""
        from ..hf.allocation import Decompositions

        if (key, method) not in self._decompositions:
            self._decompositions.clear()
            self._decompositions[(key, method)] = Decompositions()
        return self._decompositions[(key, method)]


def prepare(model_name: str = "smollm2", *, batch_size: int = 2, seq_len: int = 256, seed: int = 0,
            calib_docs: int = 500, layers=None, eval_tokens: int = 4096, eval_seq_len: int = 512,
            mff_tol: float = 1e-4, isolate: bool = True, mff_dtype: str = "float32") -> Study:
    """Load the model, tokenise the evaluation texts (PTB test, Wikipedia) and score the dense model (cached).

    ``isolate=False`` runs the cost measurements in this process (see the module docstring);
    ``mff_dtype`` is MFF's dtype in :func:`run_case` (a name of ``MFF_DTYPES``, checked before the
    model loads)."""
    from .. import hf
    from ..core.factorization import mff_dtype as _dtype
    from ..hf.evaluate import _token_ids

    _dtype(mff_dtype)

    model, tok = hf.load_model(model_name)
    protocol = {"batch_size": batch_size, "seq_len": seq_len, "seed": seed, "calib_docs": calib_docs,
                "layers": layers, "mff_tol": mff_tol}
    texts = {"ptb": hf.ptb("test"), "wiki": hf.wiki_text()}
    eval_ids = {name: _token_ids(tok, text)[:eval_tokens] for name, text in texts.items()}
    cfg = [CODE_VERSION, model_name, hf.calibration.model_fingerprint(model), protocol, eval_tokens, eval_seq_len]
    key = hashlib.blake2b(json.dumps(cfg, sort_keys=True, default=str).encode(), digest_size=12).hexdigest()
    study = Study(model_name, model, tok, protocol, eval_ids, eval_seq_len,
                  data_root() / "cache" / "studies" / f"calibration-{key}.json", isolate=isolate, mff_dtype=mff_dtype)
    study.base = _cached(study, "dense", lambda: _score(study, model))
    return study


def _load(study: Study) -> dict:
    p = study.results_path
    if p.exists():
        try:
            return json.loads(p.read_text())
        except (OSError, ValueError):
            log.warning("results cache %s is unreadable; recomputing", p)
    return {}


def _cached(study: Study, case: str, compute) -> dict:
    results = _load(study)
    if case in results:
        return results[case]
    value = compute()
    results = _load(study)  # another record may have been written meanwhile
    results[case] = value
    atomic_write(study.results_path, lambda t: Path(t).write_text(json.dumps(results, indent=1)))
    return value


def setting_name(k: int, granularity: str = "batch", grad_dtype: str = "bfloat16") -> str:
    return f"k{k}-{granularity}-{grad_dtype}"


def _batches(tok, protocol: dict, k: int):
    from .. import hf

    docs = hf.c4_documents()[: protocol["calib_docs"]]
    return hf.lm_batches(tok, docs, k=k, batch_size=protocol["batch_size"], seq_len=protocol["seq_len"],
                         seed=protocol["seed"])


def _collect(model, batches, protocol: dict, stats, *, granularity: str, grad_dtype: str, cache_dir=None,
             progress: bool = False):
    """:func:`fisherkron.collect_calibration` of the protocol's ``batches`` (cached)."""
    from .. import hf

    return hf.collect_calibration(model, batches, protocol["layers"], seed=protocol["seed"],
                                  stats=stats, grad_dtype=grad_dtype, granularity=granularity,
                                  cache_dir=cache_dir, progress=progress)


def gradient_count(stats) -> int:
    """The gradients of Eq. (8) behind ``stats``: batches or sequences, or every kept token for
    ``granularity="token"`` (``stats.k`` counts the batches there)."""
    if stats.granularity == "token":
        return next(iter(stats.layers.values()))["tokens"]
    return stats.k


def _stats_for(methods) -> tuple[str, ...]:
    from ..hf.calibration import METHOD_STATS, STATS

    need = {s for m in methods for s in METHOD_STATS[m]}
    return tuple(s for s in STATS if s in need)


def _disk(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def _peak_gb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def _product_flops(stats, name: str) -> float:
    """Flops of one product with ``R(F)`` (or its transpose) of layer ``name``."""
    n, m = stats.layers[name]["n"], stats.layers[name]["m"]
    if stats.granularity == "token":
        return 2.0 * stats.layers[name]["tokens"] * (n * n + m * m)
    return 2.0 * stats.k * n * m * (n + m)


def child(spec: dict) -> dict:
    """One cost measurement in this process (see the module docstring); returns its record."""
    with OtherLoad() as load:
        rec = _measure_here(spec)
    rec["others_cpu_share"] = load.share
    return rec


def _measure_here(spec: dict) -> dict:
    import re

    from .. import hf
    from ..hf.surgery import compress

    model, tok = hf.load_model(spec["model_name"])
    batches = _batches(tok, spec["protocol"], spec["k"])
    stats_kinds = tuple(spec["stats"])
    pending = _partial_keys(Path(spec["cache_dir"]) if spec.get("cache_dir") else data_root() / "cache" / "calibration")
    t = time.perf_counter()
    st = _collect(model, batches, spec["protocol"], stats_kinds, granularity=spec["granularity"],
                  grad_dtype=spec["grad_dtype"], cache_dir=spec.get("cache_dir"), progress=spec.get("progress", False))
    rec = {"setting": spec["setting"], "key": st.key, "k": spec["k"], "granularity": spec["granularity"],
           "grad_dtype": spec["grad_dtype"], "gradients": gradient_count(st), "stats": list(stats_kinds),
           "collected_now": not st.from_cache, "resumed": not st.from_cache and st.key in pending,
           "collect_seconds": time.perf_counter() - t,
           "tokens": sum(int(b["attention_mask"].sum()) for b in batches), "layers": len(st.layers),
           "threads": torch.get_num_threads()}
    rec["tokens_per_s"] = rec["tokens"] / rec["collect_seconds"]
    if spec.get("mff", True) and "grads" in stats_kinds:
        names = [n for n in st.layers if spec.get("mff_layers") is None or re.fullmatch(spec["mff_layers"], n)]
        opts = {"tol": spec["protocol"]["mff_tol"]}
        for init in spec.get("inits", ["kfac"]):
            per_layer, flops = {}, 0.0
            for n in names:
                before = len(list((st.dir / "mff").glob("*.pt")))
                t = time.perf_counter()
                res = st.kronecker(n, init=init, **opts)
                computed = len(list((st.dir / "mff").glob("*.pt"))) > before  # else it was cached
                per_layer[n] = {"seconds": time.perf_counter() - t, "matvecs": res["matvecs"], "computed": computed}
                flops += res["matvecs"] * _product_flops(st, n)
            sec = sum(v["seconds"] for v in per_layer.values())
            rec[f"mff_{init}"] = {"seconds": sec, "layers": len(names),
                                  "computed_now": sum(v["computed"] for v in per_layer.values()),
                                  "matvecs": sum(v["matvecs"] for v in per_layer.values()),
                                  "gflops_per_s": flops / sec / 1e9 if sec > 0 else None, "per_layer": per_layer}
    if spec.get("compress_ratio"):
        t = time.perf_counter()
        rep = compress(model, "gfwsvd", st, ratio=spec["compress_ratio"], allocation="fisher",
                       mff_options={"tol": spec["protocol"]["mff_tol"]})
        rec["compress_seconds"] = time.perf_counter() - t
        rec["compress_ratio"] = rep.ratio
    rec["disk_gb"] = _disk(st.dir) / 1e9
    rec["peak_gb"] = _peak_gb()
    return rec


def _partial_keys(root: Path) -> set[str]:
    """The keys of the interrupted collections under ``root`` (a collection that resumes one is not timed whole)."""
    from ..hf.calibration.folders import INFO, PARTIAL_SUFFIX

    keys = set()
    for p in root.glob(f"*{PARTIAL_SUFFIX}"):
        try:
            keys.add(json.loads((p / INFO).read_text())["key"])
        except (OSError, ValueError, KeyError, TypeError):
            keys.add(p.name[: -len(PARTIAL_SUFFIX)])
    return keys


def _run_child(spec: dict) -> dict:
    proc = subprocess.run([sys.executable, "-m", "fisherkron.experiments.calibration_study", "--child",
                           json.dumps(spec)], capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-4000:])
        raise RuntimeError(f"cost measurement {spec['setting']} failed (exit {proc.returncode}); its stderr is above")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _run_here(spec: dict) -> dict:
    return {**child(spec), "isolated": False}


def measure(study: Study, k: int, *, granularity: str = "batch", grad_dtype: str = "bfloat16",
            methods=("gfwsvd", "kfac_svd", "svd_llm"), stats=None, keep: bool = True, mff: bool = True,
            mff_layers: str | None = None, inits=("kfac",), compress_ratio: float | None = None,
            tag: str = "") -> dict:
    """The cost record of one calibration setting, measured in a fresh process unless the study says not to
    (cached; see the module doc)."""
    setting = setting_name(k, granularity, grad_dtype)
    spec = {"model_name": study.model_name, "protocol": study.protocol, "k": k, "granularity": granularity,
            "grad_dtype": grad_dtype, "stats": tuple(stats) if stats else _stats_for(methods), "mff": mff,
            "mff_layers": mff_layers, "inits": list(inits), "compress_ratio": compress_ratio, "setting": setting}
    where = {} if study.isolate else {"isolated": False}  # an isolated record's key is unchanged
    case = "cost|" + json.dumps({**spec, "keep": keep, "tag": tag, **where}, sort_keys=True, default=str)
    run = _run_child if study.isolate else _run_here

    def compute() -> dict:
        if keep:
            return run(spec)
        with tempfile.TemporaryDirectory(prefix="fisherkron-cost-", dir=data_root() / "cache") as tmp:
            return run({**spec, "cache_dir": tmp})

    return _cached(study, case, compute)


def stats_of(study: Study, k: int, granularity: str = "batch", grad_dtype: str = "bfloat16",
             methods=("gfwsvd", "kfac_svd", "svd_llm")):
    """The calibration statistics of one setting (from the cache that :func:`measure` filled)."""
    return _collect(study.model, _batches(study.tokenizer, study.protocol, k), study.protocol, _stats_for(methods),
                    granularity=granularity, grad_dtype=grad_dtype)


@torch.no_grad()
def _score(study: Study, model) -> dict:
    from ..hf.evaluate import perplexity

    t = time.perf_counter()
    out = {f"ppl_{name}": perplexity(model, None, ids, seq_len=study.eval_seq_len).ppl
           for name, ids in study.eval_ids.items()}
    out["eval_seconds"] = time.perf_counter() - t
    return out


def run_case(study: Study, stats, method: str, ratio: float, *, k: int, setting: str = "") -> dict:
    """Compress a copy of the model with ``method`` at whole-model ``ratio`` (``fisher`` allocation), score it."""
    from ..core.factorization import mff_dtype
    from ..core.methods import method as method_row
    from ..hf.surgery import compress

    case = f"case|{stats.key}|{method}|{ratio:.4f}"
    mff_options = {"tol": study.protocol["mff_tol"]}
    if method_row(method).kronecker and study.mff_dtype != "float32":  # float32 cases keep their keys
        case += f"|mff-{study.mff_dtype}"
        mff_options["dtype"] = mff_dtype(study.mff_dtype)

    def compute() -> dict:
        model = copy.deepcopy(study.model)
        t = time.perf_counter()
        rep = compress(model, method, stats, ratio=ratio, allocation="fisher",
                       mff_options=mff_options,
                       decompositions=study.decompositions_of(stats.key, method))
        row = {"setting": setting, "k": k,
               "granularity": stats.granularity, "gradients": gradient_count(stats), "method": method, "target_ratio": ratio,
               "ratio": rep.ratio, "compress_seconds": time.perf_counter() - t,
               "dense_layers": sum(lr.skipped is not None for lr in rep.layers.values())}
        row.update(_score(study, model))
        return row

    return _cached(study, case, compute)


def encoding_error(study: Study, k: int, layers: str, encodings=("bfloat16", "float16")) -> dict:
    """MFF's ``A (x) B`` from 16-bit gradients against float32 gradients of the same ``k`` batches (cached).

    Run in temporary caches (the gradients of ``layers`` only); MFF is started from the
    identity in every encoding, so the difference is the encoding's alone (plus MFF's ``tol``).
    """
    from .. import hf

    def compute() -> dict:
        batches = _batches(study.tokenizer, study.protocol, k)
        rows, factors = [], {}
        with tempfile.TemporaryDirectory(prefix="fisherkron-enc-", dir=data_root() / "cache") as tmp:
            for enc in ("float32", *encodings):
                st = hf.collect_calibration(study.model, batches, layers, stats=("grads",), grad_dtype=enc,
                                            cache_dir=Path(tmp) / enc)
                factors[enc] = {n: st.kronecker(n, init="identity", tol=study.protocol["mff_tol"])
                                for n in st.layers}
                del st
        for n, ref in factors["float32"].items():
            for enc in encodings:
                got = factors[enc][n]
                rows.append({"layer": n, "encoding": enc,
                             "rel_error": kron_rel_error(got["A"], got["B"], ref["A"], ref["B"])})
        return {"k": k, "layers": layers, "mff_tol": study.protocol["mff_tol"], "rows": rows}

    return _cached(study, f"encoding|{k}|{layers}|{','.join(encodings)}", compute)


def main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(description="Cost of calibration at scale on the embedded decoder (one JSON "
                                            "line per setting); see fisherkron.experiments.calibration_study.")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--ks", default="4,16,32", help="calibration sizes (batches of 2 x 256 tokens)")
    p.add_argument("--granularity", default="batch", choices=("batch", "sequence", "token"))
    p.add_argument("--grad-dtype", default="bfloat16")
    p.add_argument("--no-mff", action="store_true", help="measure the collection only")
    p.add_argument("--temporary", action="store_true", help="collect into a temporary folder, removed afterwards")
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return 0
    study = prepare(args.model)
    for k in map(int, args.ks.split(",")):
        print(json.dumps(measure(study, k, granularity=args.granularity, grad_dtype=args.grad_dtype,
                                 keep=not args.temporary, mff=not args.no_mff)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
