"""The float32 checks with 1 and with 2 torch threads, and how the threads wait.

The thread count changes how GEMMs and reductions split their sums, and so the
order in which float32 round-off accumulates (as a different CPU's kernels do).
The tolerances of :mod:`fisherkron.testing` scale with the length and magnitude of
those sums, so each check here must pass with either count.

OpenMP threads wait passively (``OMP_WAIT_POLICY=PASSIVE``) when fisherkron is imported before torch;
when torch came first its OpenMP runtime has already read its settings, which a one-line warning says.
"""
import contextlib
import os
import re
import subprocess
import sys

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


#: GNU OpenMP's spin count before a waiting thread sleeps under OMP_WAIT_POLICY=PASSIVE (300000 when unset,
#: 30000000000 under ACTIVE)
PASSIVE_SPINS = "0"


def _openmp_spins(code: str, policy: str | None = None) -> tuple[list[str], list[str]]:
    """The spin count each OpenMP runtime of ``python -c code`` (and of the processes it starts) read, in load
    order, and the other lines it wrote to stderr.

    The observable is the runtime's own: with ``OMP_DISPLAY_ENV=VERBOSE`` GNU OpenMP prints the settings it
    parsed at the moment it reads them, when torch loads it (``import torch``), before any parallel region.
    """
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env["OMP_DISPLAY_ENV"] = "VERBOSE"
    if policy:
        env["OMP_WAIT_POLICY"] = policy
    err = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True,
                         timeout=120).stderr
    spins = re.findall(r"GOMP_SPINCOUNT = '(\d+)'", err)
    if not spins:
        pytest.skip("torch's OpenMP runtime is not GNU OpenMP: it does not print its settings")
    other = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith("  ") and "OPENMP DISPLAY" not in ln]
    return spins, other


def test_the_wait_policy_takes_effect_when_fisherkron_comes_first():
    spins, other = _openmp_spins("import fisherkron, torch; torch.ones(64, 64) @ torch.ones(64, 64)")
    assert spins == [PASSIVE_SPINS] and other == []  # no warning


def test_torch_imported_first_is_too_late_for_its_own_threads_and_a_warning_says_what_to_do():
    """The runtime has read its settings when ``import torch`` returns: fisherkron can no longer make this
    process's threads wait passively, and says so in one line; processes it starts still get the policy."""
    spins, other = _openmp_spins("import torch, fisherkron, subprocess, sys; "
                                 "subprocess.run([sys.executable, '-c', 'import torch'], check=True)")
    assert spins[0] != PASSIVE_SPINS and spins[1:] == [PASSIVE_SPINS]  # this process: too late; the child: passive
    assert len(other) == 1, other
    assert "torch was imported before fisherkron" in other[0]
    assert "set OMP_WAIT_POLICY=PASSIVE before starting Python" in other[0]
    assert "import fisherkron before torch" in other[0]


def test_no_warning_when_the_user_chose_a_policy():
    spins, other = _openmp_spins("import torch, fisherkron", policy="ACTIVE")
    assert len(spins) == 1 and int(spins[0]) > 300000 and other == []  # spinning, as asked
