r"""The Kronecker spectrum of every linear layer (Sec. 4, "Rank-1 Kronecker Fisher and multi-term
extensions", Fig. singular_values).

The singular values ``sigma_1 >= sigma_2 >= ...`` of the rearranged Fisher
``R(F) = (1/k) sum_i G_i^T (x) G_i^T`` (``m^2 x n^2``) are the weights of the Kronecker SVD
``F = sum_j sigma_j mat(u_j) (x) mat(v_j)``; MFF keeps the first term. How much of ``F`` one
term holds is

.. math:: \sigma_1^2 / \lVert F\rVert_F^2, \qquad
          \lVert F\rVert_F^2 = \lVert R(F)\rVert_F^2 = \tfrac{1}{k^2}\textstyle\sum_{i,j}\langle G_i, G_j\rangle^2,

the norm read exactly from the ``k x k`` Gram matrix of the gradients (``R`` only permutes
entries, and ``F = (1/k) sum_i g_i g_i^T`` with ``g_i = vec(G_i)``). A large gap
``sigma_1 / sigma_2`` means ``A (x) B`` is a good summary of the layer's Fisher.

``R(F)`` is *not* of rank ``<= k``: one gradient ``G = sum_a s_a p_a q_a^T`` alone gives
``R(g g^T) = G^T (x) G^T`` with singular values ``s_a s_b`` (rank ``rank(G)^2``). So ``k = 4``
batch gradients already give hundreds of non-zero Kronecker singular values per layer; ``k``
sets how well the empirical Fisher is estimated, not how many values exist.

:func:`layer_spectrum` computes the top ``terms`` values of one layer with
:func:`fisherkron.kronecker_terms`; :func:`model_spectra` does every layer of a calibration,
caching each layer's result on disk as soon as it is computed (keyed by the calibration key and
the options, written atomically, so a run can be stopped and resumed); :func:`calibrate` gives
the calibration the notebook uses; :func:`summary_by_type` makes the per-type table.
"""
from __future__ import annotations

import hashlib
import json
import logging
import re
import time
from pathlib import Path

import numpy as np
import torch

from ..core.checks import check_int, check_positive
from ..core.factorization import kronecker_terms
from ..env import atomic_write, data_root

__all__ = ["CODE_VERSION", "layer_type", "layer_spectrum", "model_spectra", "calibrate", "summary_by_type"]

log = logging.getLogger(__name__)
CODE_VERSION = "spectrum-1"  # bump when the meaning of a cached record changes

_BLOCK = re.compile(r"^(?:.*\.)?(?:layers?|h|blocks?)\.\d+\.")


def layer_type(name: str) -> str:
    """The layer's role within its block: the name without the model prefix and block index.

    >>> layer_type("model.layers.12.mlp.down_proj"), layer_type("bert.encoder.layer.3.attention.self.query")
    ('mlp.down_proj', 'attention.self.query')
    """
    return _BLOCK.sub("", name)


def layer_spectrum(grads, terms: int = 10, *, tol: float = 1e-3, max_matvecs: int = 300,
                   dtype: torch.dtype = torch.float32, name: str = "layer") -> dict:
    r"""Top ``terms`` singular values of ``R(F)`` of one layer and the shares of ``F`` they hold.

    Args:
        grads: the layer's ``k`` gradients (``(k, n, m)`` tensor or ``.npy`` path), as for
            :func:`fisherkron.mff`.
        terms: how many singular values.
        tol: Lanczos stops when the residual of each of the ``terms`` triplets is below
            ``tol * sigma_1``. With ``tol = 1e-3`` the top 10 matched a ``tol = 1e-7`` run to 1e-5
            of ``sigma_1`` on SmolLM2 layers; at ``1e-2`` near-equal pairs were missed.
        max_matvecs: product budget.
        dtype: GEMM dtype (float64 for references).

    Returns:
        ``{"sigma": [sigma_1, ...], "fisher_norm_sq": ||F||_F^2, "ratio_12": sigma_1 / sigma_2,
        "share_1": sigma_1^2 / ||F||^2, "share_top": sum_j sigma_j^2 / ||F||^2, "matvecs",
        "converged", "residual", "seconds"}``.
    """
    check_int(terms, "terms", minimum=2)
    check_positive(tol, "tol", below=1.0)
    t = time.perf_counter()
    res = kronecker_terms(grads, terms, tol=tol, max_matvecs=max_matvecs, dtype=dtype, name=name)
    sigma = [float(s) for s in res.sigma]
    norm_sq = float(res.fisher_norm_sq)
    return {"sigma": sigma, "fisher_norm_sq": norm_sq,
            "ratio_12": sigma[0] / sigma[1] if sigma[1] > 0 else float("inf"),
            "share_1": sigma[0] ** 2 / norm_sq, "share_top": sum(s * s for s in sigma) / norm_sq,
            "matvecs": int(res.matvecs), "converged": bool(res.converged), "residual": float(res.residual),
            "seconds": time.perf_counter() - t}


def _cache_path(stats, terms: int, tol: float, max_matvecs: int, cache_dir, k: int) -> Path:
    cfg = [CODE_VERSION, stats.key, terms, tol, max_matvecs, k]
    tag = hashlib.blake2b(json.dumps(cfg).encode(), digest_size=10).hexdigest()
    root = Path(cache_dir) if cache_dir is not None else data_root() / "cache" / "spectrum"
    return root / f"spectrum-{tag}.json"


def _read(path: Path) -> dict:
    if path.exists():
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            log.warning("spectrum cache %s is unreadable; recomputing", path)
    return {}


def model_spectra(stats, terms: int = 10, *, tol: float = 1e-3, max_matvecs: int = 300, layers=None,
                  k: int | None = None, cache: bool = True, cache_dir=None, progress: bool = False) -> list[dict]:
    """:func:`layer_spectrum` of every layer of ``stats`` (a :class:`~fisherkron.CalibrationStats`).

    Each layer's record (plus ``layer``, ``type``, ``n``, ``m``, ``k``) is written to
    ``<cache_dir>/spectrum-<key>.json`` (default ``data/cache/spectrum``) as soon as it is
    computed; the key covers the calibration key (model weights, data, loss, k) and the options.
    ``layers``: a subset of the layer names (default: all, in model order). ``k``: use only the
    first ``k`` gradients (to see how the spectrum moves with the number of batches).
    """
    from ..core.conventions import FisherkronError

    names = list(stats.layers) if layers is None else list(layers)
    unknown = [n for n in names if n not in stats.layers]
    if unknown:
        raise FisherkronError(f"layer {unknown[0]} has no calibration statistics")
    k = stats.k if k is None else check_int(k, "k", minimum=1)
    if k > stats.k:
        raise FisherkronError(f"k={k} exceeds the {stats.k} gradients of the calibration")
    path = _cache_path(stats, terms, tol, max_matvecs, cache_dir, k)
    done = _read(path) if cache else {}
    from tqdm.auto import tqdm

    todo = [n for n in names if n not in done]
    for name in tqdm(todo, desc=f"Kronecker spectra (k={k})", disable=not progress or not todo):
        info = stats.layers[name]
        grads = (stats.grads_path(name) if k == stats.k
                 else torch.from_numpy(np.array(stats.grads(name)[:k])))  # (k, n, m): a copy of the first k
        rec = layer_spectrum(grads, terms, tol=tol, max_matvecs=max_matvecs, name=name)
        rec.update(layer=name, type=layer_type(name), n=int(info["n"]), m=int(info["m"]), k=k)
        done[name] = rec
        if cache:
            latest = _read(path)  # another process may have added layers meanwhile
            latest[name] = rec
            done.update(latest)
            atomic_write(path, lambda t: Path(t).write_text(json.dumps(latest)))
    return [done[n] for n in names]


def calibrate(model_name: str, *, k: int = 4, batch_size: int = 2, seq_len: int = 256, seed: int = 0,
              calib_docs: int = 500, layers=None, data_profile: str = "default", progress: bool = False):
    """Per-batch gradients of a model's linear layers, cached by :func:`fisherkron.collect_calibration`.

    * A decoder (causal LM, the Llama role) gets the rank-allocation study's setting: ``k``
      batches of ``batch_size`` random ``seq_len``-token windows of the first ``calib_docs`` C4
      documents (FineWeb with ``data_profile="paper"``), next-token loss, every statistic (so
      the cache entry is the one that study uses).
    * An encoder (the BERT role: a sequence classifier) gets ``k`` batches of ``batch_size``
      SST-2 training sentences (at most ``seq_len`` tokens) and the classification loss, as
      :func:`fisherkron.experiments.benchmark.minilm_calibration`. The embedded MiniLM has no
      fine-tuned head: its head is drawn with a fixed seed, so the gradients are those of a
      random linear read-out of the sentence representation.

    Returns ``(model, tokenizer, stats)``.
    """
    from .. import hf

    model, tok = hf.load_model(model_name)
    encoder = getattr(model.config, "model_type", "") in ("bert", "roberta", "distilbert", "electra")
    if encoder:
        ds = hf.load_task("sst2", "train", profile=data_profile)
        batches = hf.classification_batches(tok, ds, k, batch_size=batch_size, max_length=seq_len, seed=seed,
                                            task="sst2")
        stats = hf.collect_calibration(model, batches, layers, seed=seed, stats=("grads",), progress=progress)
    else:
        docs = hf.c4_documents(profile=data_profile)[:calib_docs]
        batches = hf.lm_batches(tok, docs, k=k, batch_size=batch_size, seq_len=seq_len, seed=seed)
        stats = hf.collect_calibration(model, batches, layers, seed=seed, progress=progress)
    return model, tok, stats


def summary_by_type(rows: list[dict], threshold: float = 3.0) -> list[dict]:
    """Per layer type: how many layers, how many with ``sigma_1 / sigma_2 > threshold``, and medians.

    >>> rows = [{"type": "q", "ratio_12": 4.0, "share_1": 0.5, "share_top": 0.8},
    ...         {"type": "q", "ratio_12": 2.0, "share_1": 0.3, "share_top": 0.6}]
    >>> summary_by_type(rows)[0]["gap_layers"], summary_by_type(rows)[0]["median_ratio_12"]
    (1, 3.0)
    """
    import statistics

    out = []
    for kind in dict.fromkeys(r["type"] for r in rows):  # first-seen order: the order within a block
        sel = [r for r in rows if r["type"] == kind]
        out.append({"type": kind, "layers": len(sel),
                    "gap_layers": sum(r["ratio_12"] > threshold for r in sel),
                    "median_ratio_12": statistics.median(r["ratio_12"] for r in sel),
                    "median_share_1": statistics.median(r["share_1"] for r in sel),
                    "min_share_1": min(r["share_1"] for r in sel),
                    "max_share_1": max(r["share_1"] for r in sel),
                    "median_share_top": statistics.median(r["share_top"] for r in sel)})
    return out
