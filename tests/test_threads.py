"""The float32 checks with 1 and with 2 torch threads.

The thread count changes how GEMMs and reductions split their sums, and so the
order in which float32 round-off accumulates (as a different CPU's kernels do).
The tolerances of :mod:`fisherkron.testing` scale with the length and magnitude of
those sums, so each check here must pass with either count.
"""
import contextlib

import pytest
import torch

import fisherkron as fk
from fisherkron.testing import (MFF_F32_REL, MFF_F64_REL, assert_close_f32, dense_fisher, dense_rearrangement,
                                rel_error)
from test_calibration import check_statistics_equal_autograd


@contextlib.contextmanager
def _num_threads(n: int):
    """``torch.set_num_threads(n)`` inside the block; the old count restored afterwards."""
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield n
    finally:
        torch.set_num_threads(old)


@pytest.fixture(params=[1, 2], ids=lambda t: f"{t}thread")
def threads(request):
    """Run the test with ``torch.set_num_threads(request.param)``; restore the old count afterwards."""
    with _num_threads(request.param) as n:
        yield n


@pytest.mark.parametrize("kind", ["llama", "bert"])
def test_calibration_equals_autograd(kind, threads, tmp_path):
    margins = check_statistics_equal_autograd(kind, tmp_path)
    assert torch.get_num_threads() == threads  # the collection leaves the thread count alone
    assert set(margins) == {"grads", "diag_fisher", "abs_mean", "xxt", "kfac_A", "kfac_B"}


def _gradients(k, n, m, seed):
    return torch.randn(k, n, m, generator=torch.Generator().manual_seed(seed))  # (k, n, m) float32


def test_float32_products_equal_dense(threads):
    """``(1/k) sum_i G_i^T Z G_i`` and ``(1/k) sum_i G_i Y G_i^T`` in float32 GEMMs against float64.

    Entry ``(a, b)`` of the first is a nested float32 sum over ``n`` (``Z G_i``) and ``k n``
    (``G^T P``) terms, of scale ``(1/k) sum_i |G_i|^T |Z| |G_i|``; the second likewise with ``m``.
    """
    k, n, m = 24, 67, 45  # large enough for the GEMMs to split across threads
    G = _gradients(k, n, m, seed=threads)
    g = torch.Generator().manual_seed(100)
    CZ, CY = torch.randn(n, n, generator=g), torch.randn(m, m, generator=g)
    Z = (torch.eye(n) + CZ @ CZ.T / n).double()  # SPD, as the factors MFF multiplies by; float32-representable
    Y = (torch.eye(m) + CY @ CY.T / m).double()
    op = fk.rearranged_fisher(G, dtype=torch.float32)
    Gd, Ga = G.double(), G.double().abs()
    cases = {
        "R(Z)": (op.apply(Z, True), torch.einsum("kia,ij,kjb->ab", Gd, Z, Gd) / k,
                 torch.einsum("kia,ij,kjb->ab", Ga, Z.abs(), Ga) / k, n + k * n),
        "R^T(Y)": (op.apply_adjoint(Y, True), torch.einsum("kia,ab,kjb->ij", Gd, Y, Gd) / k,
                   torch.einsum("kia,ab,kjb->ij", Ga, Y.abs(), Ga) / k, m + k * m),
        "R(I)": (op.apply(None), torch.einsum("kia,kib->ab", Gd, Gd) / k,
                 torch.einsum("kia,kib->ab", Ga, Ga) / k, k * n),
        "R^T(I)": (op.apply_adjoint(None), torch.einsum("kia,kja->ij", Gd, Gd) / k,
                   torch.einsum("kia,kja->ij", Ga, Ga) / k, k * m),
    }
    for what, (got, ref, scale, length) in cases.items():
        assert_close_f32(got, ref, length=length, scale=scale, what=f"{what} with {threads} thread(s)")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_mff_equals_dense_top_triplet(threads, dtype):
    """MFF (float32 default and float64) against the top singular pair of the dense R(F)."""
    k, n, m = 10, 11, 7
    G = _gradients(k, n, m, seed=5)
    U, S, Vh = torch.linalg.svd(dense_rearrangement(dense_fisher(G), n, m))  # float64
    ref = S[0] * torch.outer(U[:, 0], Vh[0])  # R(A (x) B) of the best Kronecker product
    res = fk.mff(G, dtype=dtype)
    assert res.converged and torch.get_num_threads() == threads
    bar = MFF_F32_REL if dtype == torch.float32 else MFF_F64_REL
    assert rel_error(torch.outer(fk.vec(res.A), fk.vec(res.B)), ref) <= bar
    assert abs(float(res.sigma[0]) - float(S[0])) <= bar * float(S[0])


def test_float64_mff_is_independent_of_the_thread_count():
    """float64 MFF gives the same factors at 1 and 2 threads to round-off (the ``fisher`` allocation's need).

    Measured on a 2-core Intel Xeon: 3e-16 relative at float64, 1.4e-7 at float32 (the summation
    order alone); an exact knapsack over Theorem 1's curves turned float32's differences into
    other ranks (``scripts/allocation_reproducibility.py``). The bar, 1e-12, is far above float64's
    round-off for these sizes and far below float32's.
    """
    G = torch.randn(8, 300, 200, generator=torch.Generator().manual_seed(0))  # large enough to split the GEMMs
    got = {}
    for t in (1, 2):
        with _num_threads(t):
            got[t] = fk.mff(G, dtype=torch.float64, tol=1e-4)
    assert got[1].matvecs == got[2].matvecs
    assert rel_error(got[1].A, got[2].A) < 1e-12 and rel_error(got[1].B, got[2].B) < 1e-12


@pytest.mark.parametrize("preset,want", [(None, "PASSIVE"), ("ACTIVE", "ACTIVE")])
def test_openmp_threads_wait_passively_unless_the_user_chose(preset, want):
    """fisherkron sets OMP_WAIT_POLICY=PASSIVE before torch loads OpenMP (README, "Threads")."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if preset:
        env["OMP_WAIT_POLICY"] = preset
    code = "import os, fisherkron, torch; print(os.environ.get('OMP_WAIT_POLICY'))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == want
