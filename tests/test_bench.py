"""The benchmark's pieces (fisherkron.experiments, scripts/bench_mff.py): the authors'-approach reimplementation, the synthetic generator, the error metric.

No timings are asserted here (timings are what `make bench` reports).
"""
import math

import numpy as np
import pytest
import torch

import fisherkron as fk
from fisherkron.experiments.authors import authors_mff
from fisherkron.experiments.benchmark import kron_rel_error
from fisherkron.experiments.synthetic_gradients import ar1_cholesky, synthetic_gradients
from fisherkron.testing import (EPS64, F64_REL, FLOAT64, MFF_F32_REL, MFF_REF_TOL, MONTE_CARLO_REL, abs_sum_scale,
                                assert_close_f32, dense_fisher, dense_rearrangement, float32_tol)
from script_module import load_script

def _load_script(name: str = "bench_mff"):
    return load_script(name)


def main(argv):
    """``scripts/bench_mff.py`` with ``argv``."""
    return _load_script().main(argv)


#: our MFF, run well below MFF_F32_REL, so that float32 round-off (not the stop) decides what is compared
OURS_TOL = 1e-7


def _dense_kron_error(A, B, Ar, Br):
    K, Kr = torch.kron(A, B), torch.kron(Ar, Br)
    return float((K - Kr).norm() / Kr.norm())


def _dense_factors(G):
    """Best A (x) B from the dense SVD of R(F) (float64)."""
    k, n, m = G.shape
    U, S, Vh = torch.linalg.svd(dense_rearrangement(dense_fisher(G.double()), n, m))
    A = math.sqrt(S[0]) * fk.unvec(U[:, 0], m, m)
    B = math.sqrt(S[0]) * fk.unvec(Vh[0], n, n)
    return A, B


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("n,m,k", [(7, 5, 6), (5, 9, 12)])
def test_authors_approach_and_mff_agree_with_dense(n, m, k, dtype):
    G = synthetic_gradients(n, m, k, tokens=16, seed=1).G  # (k, n, m) float32
    A, B = _dense_factors(G)
    ours = fk.mff(G, tol=OURS_TOL, compute_norm=False)
    theirs = authors_mff(G, dtype=dtype)
    assert theirs.A.dtype == np.dtype(dtype)
    assert theirs.status == "measured" and theirs.matvecs > 0
    assert kron_rel_error(ours.A, ours.B, A, B) < MFF_F32_REL
    assert kron_rel_error(torch.from_numpy(theirs.A), torch.from_numpy(theirs.B), A, B) < MFF_F32_REL
    assert abs(theirs.sigma - float(ours.sigma[0])) / float(ours.sigma[0]) < MFF_F32_REL


def test_authors_time_limit_stops_the_solver():
    G = synthetic_gradients(20, 12, 4, tokens=8).G
    res = authors_mff(G, time_limit=0.0)
    assert res.status == "stopped" and res.A is None and res.matvecs == 1


def test_kron_rel_error_matches_dense_and_ignores_the_scale_split():
    g = torch.Generator().manual_seed(0)
    A, Ar = torch.randn(4, 4, generator=g, dtype=torch.float64), torch.randn(4, 4, generator=g, dtype=torch.float64)
    B, Br = torch.randn(3, 3, generator=g, dtype=torch.float64), torch.randn(3, 3, generator=g, dtype=torch.float64)
    A, Ar, B, Br = A @ A.T, Ar @ Ar.T, B @ B.T, Br @ Br.T  # PSD: positive traces, as MFF returns
    assert kron_rel_error(A, B, Ar, Br) == pytest.approx(_dense_kron_error(A, B, Ar, Br), rel=F64_REL)
    assert kron_rel_error(3 * A, B / 3, A, B) == pytest.approx(0, abs=FLOAT64["atol"])  # same A (x) B
    delta = 1e-9
    small = Ar + delta * A  # tiny perturbations are resolved (no cancellation)
    # the dense reference cancels: 144 entries of size ~1 differ by ~delta, each known to ~EPS64
    cancel = float32_tol(1.0, 144, eps=EPS64) / delta
    assert kron_rel_error(small, Br, Ar, Br) == pytest.approx(_dense_kron_error(small, Br, Ar, Br), rel=cancel)
    assert kron_rel_error(2 * A, B, A, B) == pytest.approx(1.0, rel=F64_REL)


def test_ar1_cholesky_closed_form():
    d, rho = 9, 0.8
    s = torch.linspace(1, 0.2, d, dtype=torch.float64)
    L = ar1_cholesky(d, rho, s, dtype=torch.float64)
    i = torch.arange(d, dtype=torch.float64)
    T = rho ** (i[:, None] - i[None, :]).abs()
    torch.testing.assert_close(L @ L.T, s[:, None] * T * s[None, :], **FLOAT64)
    assert torch.equal(L, torch.tril(L))


def test_synthetic_gradients_have_the_claimed_structure():
    n, m, k, T = 12, 8, 6, 4000
    syn = synthetic_gradients(n, m, k, tokens=T, rho=0.9, coupling=0.5, seed=3, dtype=torch.float64)
    # G_i = sum_t delta_t x_t^T
    assert_close_f32(syn.G[2], sum(torch.outer(syn.delta[2, t], syn.x[2, t]) for t in range(T)), length=T,
                     scale=abs_sum_scale(syn.delta[2], syn.x[2]), eps=EPS64, what="G_i (a float64 sum of T tokens)")
    # inputs: AR(1) correlation rho between neighbours, scales j^(-1/2)
    X = syn.x.reshape(-1, m)
    cov = X.T @ X / X.shape[0]
    s = torch.arange(1, m + 1, dtype=torch.float64) ** -0.5
    i = torch.arange(m, dtype=torch.float64)
    target = s[:, None] * 0.9 ** (i[:, None] - i[None, :]).abs() * s[None, :]
    assert float((cov - target).norm() / target.norm()) < MONTE_CARLO_REL  # sampling error of 24,000 tokens
    # output gradients are correlated with the inputs (coupling), and not without it
    D = syn.delta.reshape(-1, n)
    cross = float((D.T @ X / X.shape[0]).norm())
    syn0 = synthetic_gradients(n, m, k, tokens=T, coupling=0.0, seed=3, dtype=torch.float64)
    cross0 = float((syn0.delta.reshape(-1, n).T @ syn0.x.reshape(-1, m) / X.shape[0]).norm())
    assert cross > 10 * cross0


def test_synthetic_fisher_is_more_kronecker_than_unstructured_gradients():
    n, m, k = 10, 6, 40
    syn = synthetic_gradients(n, m, k, tokens=64, seed=0, dtype=torch.float64)
    iid = torch.randn(k, n, m, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    share = fk.mff(syn.G, dtype=torch.float64).fisher_share
    share_iid = fk.mff(iid, dtype=torch.float64).fisher_share
    assert share > 2 * share_iid


def test_kfac_warm_start_of_the_synthetic_layer_is_usable():
    syn = synthetic_gradients(16, 10, 8, tokens=32, seed=2)
    res = fk.mff(syn.G, init=syn.kfac(), tol=1e-6, compute_norm=False)
    ref = fk.mff(syn.G, dtype=torch.float64, tol=MFF_REF_TOL, compute_norm=False)
    assert res.converged and kron_rel_error(res.A, res.B, ref.A, ref.B) < MFF_F32_REL


def test_cli_quick_writes_csv_and_markdown(tmp_path, capsys):
    assert main(["--quick", "--out", str(tmp_path)]) == 0
    import pandas as pd

    df = pd.read_csv(tmp_path / "bench_mff.csv")
    assert len(df) == 2 and {"ours_s", "authors_s", "speedup", "ours_err", "ours_matvecs"} <= set(df.columns)
    assert (df["ours_err"] < MFF_F32_REL).all() and (df["authors_err"] < MFF_F32_REL).all()
    assert (tmp_path / "bench_mff.md").read_text().startswith("| case")
    assert "GEMM peak" in capsys.readouterr().out


def test_overheads_benchmark_times_both_ways_and_finds_the_same_keys(tmp_path):
    """``scripts/bench_overheads.py --quick``: each code hash timed parsed on every call and once per process,
    with equal keys, the disjointness check (no overlap) and the GEMM peak by size; the three tables with their
    provenance."""
    import pandas as pd

    assert _load_script("bench_overheads").main(["--quick", "--out", str(tmp_path)]) == 0
    hashes, peaks = pd.read_csv(tmp_path / "bench_code_hashes.csv"), pd.read_csv(tmp_path / "bench_gemm_peak.csv")
    assert len(hashes) == 6 and hashes["same key"].all() and (hashes["seconds per call"] > 0).all()
    assert set(hashes["sources"]) == {"parsed on every call", "parsed once per process"}
    assert list(peaks["size"]) == [256, 128] and (peaks["GFLOP/s"] > 0).all()
    stems = ("bench_code_hashes", "bench_disjoint", "bench_gemm_peak")
    assert all((tmp_path / f"{s}.provenance.json").is_file() for s in stems)
    assert pd.read_csv(tmp_path / "bench_disjoint.csv")["overlaps"].tolist() == [0]


@pytest.mark.parametrize("n,m,k", [(23, 9, 5), (7, 19, 4)])
def test_symmetric_block_products_equal_plain_products(monkeypatch, n, m, k):
    """The fast path (lower block triangle for symmetric inputs) equals the plain GEMMs."""
    import fisherkron.core.operators as ops

    monkeypatch.setattr(ops, "SYM_BLOCK", 3)  # several row blocks even at test sizes
    G = torch.randn(k, n, m, generator=torch.Generator().manual_seed(n), dtype=torch.float64)
    R = fk.rearranged_fisher(G)
    Z = torch.randn(n, n, dtype=torch.float64)
    Z = Z + Z.T
    Y = torch.randn(m, m, dtype=torch.float64)
    Y = Y + Y.T
    torch.testing.assert_close(R.apply(Z, symmetric=True), R.apply(Z), **FLOAT64)
    torch.testing.assert_close(R.apply_adjoint(Y, symmetric=True), R.apply_adjoint(Y), **FLOAT64)
    ref = torch.as_tensor(R.materialize().numpy() @ fk.vec(Z).numpy())
    torch.testing.assert_close(fk.vec(R.apply(Z, symmetric=True)), ref, **FLOAT64)


def test_replot_redraws_the_figure_from_the_tables(tmp_path):
    with pytest.raises(fk.FisherkronError, match="run the benchmark first"):
        main(["--replot", "--out", str(tmp_path)])
    import pandas as pd
    pd.DataFrame({"case": ["synthetic 8x4x2"], "ours_s": [0.1], "ident_s": [0.08], "authors_s": [3.0],
                  "speedup": [30.0], "speedup_ident": [37.5]}).to_csv(tmp_path / "bench_mff.csv", index=False)
    pd.DataFrame({"layer": ["a", "b", "a", "b"], "start": ["kfac", "kfac", "identity", "identity"],
                  "matvecs": [5, 7, 6, 8]}).to_csv(tmp_path / "bench_minilm_layers.csv", index=False)
    assert main(["--replot", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "fig_bench_mff.png").stat().st_size > 0 and (tmp_path / "fig_bench_mff.pdf").exists()
    assert (tmp_path / "fig_bench_mff.provenance.json").exists()  # its own record, not the table's
