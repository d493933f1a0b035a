"""R(F): matrix-free products against the dense rearrangement built from its definition."""
import numpy as np
import pytest
import torch

import fisherkron as fk
from fisherkron.testing import F64_REL, FLOAT64, dense_fisher, dense_rearrangement

SHAPES = [(7, 5, 4), (5, 7, 6), (3, 3, 2), (6, 1, 3)]  # (n, m, k): non-square both ways


@pytest.mark.parametrize("n,m,k", SHAPES)
def test_matvec_rmatvec_equal_dense_rearrangement(n, m, k):
    g = torch.Generator().manual_seed(n * 100 + m * 10 + k)
    G = torch.randn(k, n, m, generator=g, dtype=torch.float64)
    R_dense = dense_rearrangement(dense_fisher(G), n, m)  # (m^2, n^2) from F entry by entry
    op = fk.rearranged_fisher(G)
    assert op.shape == (m * m, n * n)
    z = torch.randn(n * n, generator=g, dtype=torch.float64).numpy()
    y = torch.randn(m * m, generator=g, dtype=torch.float64).numpy()
    np.testing.assert_allclose(op.matvec(z), R_dense.numpy() @ z, **FLOAT64)
    np.testing.assert_allclose(op.rmatvec(y), R_dense.numpy().T @ y, **FLOAT64)
    np.testing.assert_allclose(op.materialize().numpy(), R_dense.numpy(), **FLOAT64)
    # the scipy adjoint is the rmatvec
    np.testing.assert_allclose(op.H.matvec(y), R_dense.numpy().T @ y, **FLOAT64)


def test_rearrangement_maps_kronecker_to_rank_one():
    g = torch.Generator().manual_seed(1)
    A = torch.randn(3, 3, generator=g, dtype=torch.float64)
    B = torch.randn(4, 4, generator=g, dtype=torch.float64)
    R = dense_rearrangement(torch.kron(A, B), n=4, m=3)
    torch.testing.assert_close(R, torch.outer(fk.vec(A), fk.vec(B)), **FLOAT64)


def test_matvec_matrix_form_and_convention():
    """apply(Z) = (1/k) sum G_i^T Z G_i, and tr(dW^T B dW A) = vec(dW)^T (A (x) B) vec(dW)."""
    g = torch.Generator().manual_seed(2)
    G = torch.randn(5, 7, 5, generator=g, dtype=torch.float64)
    Z = torch.randn(7, 7, generator=g, dtype=torch.float64)
    ref = sum(Gi.T @ Z @ Gi for Gi in G) / 5
    torch.testing.assert_close(fk.rearranged_fisher(G).apply(Z), ref, **FLOAT64)
    A = torch.randn(5, 5, generator=g, dtype=torch.float64)
    B = torch.randn(7, 7, generator=g, dtype=torch.float64)
    A, B = A + A.T, B + B.T  # the identity needs symmetric factors (Fisher factors are)
    dW = torch.randn(7, 5, generator=g, dtype=torch.float64)
    lhs = fk.vec(dW) @ torch.kron(A, B) @ fk.vec(dW)
    assert abs(float(lhs) - float(torch.trace(dW.T @ B @ dW @ A))) <= F64_REL * abs(float(lhs))


def test_streamed_chunks_equal_resident(tmp_path):
    """A tiny memory budget forces chunking; a .npy path and a generator give the same products."""
    g = torch.Generator().manual_seed(3)
    G = torch.randn(9, 7, 5, generator=g, dtype=torch.float64)
    Z = torch.randn(7, 7, generator=g, dtype=torch.float64)
    Y = torch.randn(5, 5, generator=g, dtype=torch.float64)
    ref = fk.rearranged_fisher(G)
    path = tmp_path / "grads.npy"
    np.save(path, G.numpy())
    budget = 3 * 7 * 5 * 8 * 2  # room for two gradients per chunk
    for src in (G, str(path), (Gi for Gi in G)):
        op = fk.rearranged_fisher(src, memory_budget=budget)
        assert op.grads.streamed or not isinstance(src, torch.Tensor)
        torch.testing.assert_close(op.apply(Z), ref.apply(Z), **FLOAT64)
        torch.testing.assert_close(op.apply_adjoint(Y), ref.apply_adjoint(Y), **FLOAT64)
    assert fk.GradientStack(G, dtype=torch.float64, memory_budget=budget).chunk_size < 9


@pytest.mark.parametrize("chunk", range(1, 8))
def test_every_chunk_size_gives_the_resident_products(tmp_path, chunk):
    """k = 11 gradients in chunks of 1..7 (all streamed): the last chunk holds 2..5 gradients for 3, 4, 6, 7.

    The streamed chunks share one buffer; a shorter last chunk used to be a slice ``buf[:, :kc]``
    of the ``(n, size, m)`` buffer, not contiguous, and the products' ``view(n kc, m)`` raised
    (for 2 <= kc < size; first seen on a GPU, whose memory budget streamed the 75 gradients of
    an 11008 x 4096 layer).
    """
    g = torch.Generator().manual_seed(8)
    G = torch.randn(11, 7, 5, generator=g, dtype=torch.float64)
    Z = torch.randn(7, 7, generator=g, dtype=torch.float64)
    Y = torch.randn(5, 5, generator=g, dtype=torch.float64)
    ref = fk.rearranged_fisher(G)
    np.save(tmp_path / "g.npy", G.numpy())
    budget = 3 * chunk * 7 * 5 * 8  # chunk_size = budget // (3 bytes per gradient); resident from 2 k = 22
    for src in (G, str(tmp_path / "g.npy")):
        op = fk.rearranged_fisher(src, memory_budget=budget)
        assert op.grads.chunk_size == chunk and op.grads.streamed
        for _ in range(2):  # the buffer is reused by the next product
            torch.testing.assert_close(op.apply(Z), ref.apply(Z), **FLOAT64)
            torch.testing.assert_close(op.apply_adjoint(Y), ref.apply_adjoint(Y), **FLOAT64)


def test_generator_spills_to_disk_past_budget():
    g = torch.Generator().manual_seed(4)
    G = torch.randn(12, 6, 4, generator=g)
    stack = fk.GradientStack((Gi for Gi in G), memory_budget=6 * 4 * 4 * 3)
    assert stack._tmpfile is not None and stack.k == 12
    torch.testing.assert_close(stack.stacked(), G)
    path = stack._tmpfile
    stack.close()
    import os
    assert not os.path.exists(path)


def test_fisher_norm_from_gram():
    g = torch.Generator().manual_seed(5)
    G = torch.randn(6, 4, 3, generator=g, dtype=torch.float64)
    want = float(dense_fisher(G).norm() ** 2)
    for budget in (None, 4 * 3 * 8 * 3):
        got = fk.GradientStack(G, dtype=torch.float64, memory_budget=budget).fisher_norm_sq()
        assert abs(got - want) <= F64_REL * want


def test_matvec_flops_formula():
    assert fk.matvec_flops(768, 384, 16) == 2 * 16 * 768 * 384 * (768 + 384)


@pytest.mark.parametrize("bad,msg", [
    (torch.randn(4, 3), "expected a (k, n, m)"),
    (torch.tensor([[[1.0, float("nan")]]]), "batch 0"),
    ([torch.randn(3, 2), torch.randn(2, 3)], "gradient 1 has shape"),
    ([], "no gradients"),
])
def test_bad_gradients_one_line_error(bad, msg):
    with pytest.raises(fk.FisherkronError, match=msg.replace("(", r"\(").replace(")", r"\)")) as e:
        fk.mff(bad)
    assert "\n" not in str(e.value)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_stays_on_device():  # pragma: no cover - runs where a GPU exists
    G = torch.randn(4, 7, 5, device="cuda")
    op = fk.rearranged_fisher(G, dtype=torch.float32)
    assert op.apply(torch.eye(7, device="cuda")).device.type == "cuda"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_budget_counts_the_allocators_idle_memory():  # pragma: no cover - runs where a GPU exists
    """Memory the caching allocator holds for reuse is free for the gradients (mem_get_info calls it taken)."""
    from fisherkron.core.gradient_stack import default_memory_budget
    dev = torch.device("cuda")
    before = default_memory_budget(dev)
    x = torch.empty(1 << 30, dtype=torch.uint8, device=dev)  # 1 GiB, then idle in the allocator's cache
    del x
    assert torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev) >= 1 << 30
    assert abs(default_memory_budget(dev) - before) < 1 << 27  # not 512 MiB less


@pytest.mark.parametrize("n,m,k", SHAPES)
def test_identity_products_are_the_gradient_grams(n, m, k):
    """apply(None) = R(I_n) = (1/k) sum G_i^T G_i and apply_adjoint(None) = R^T(I_m), each one cheap GEMM."""
    g = torch.Generator().manual_seed(n * 100 + m * 10 + k + 1)
    G = torch.randn(k, n, m, generator=g, dtype=torch.float64)
    R_dense = dense_rearrangement(dense_fisher(G), n, m)
    op = fk.rearranged_fisher(G)
    np.testing.assert_allclose(fk.vec(op.apply(None)).numpy(), R_dense.numpy() @ fk.vec(torch.eye(n, dtype=torch.float64)).numpy(), **FLOAT64)
    np.testing.assert_allclose(fk.vec(op.apply_adjoint(None)).numpy(), R_dense.numpy().T @ fk.vec(torch.eye(m, dtype=torch.float64)).numpy(), **FLOAT64)
    assert op.num_matvecs == 2
    assert op.nominal_flops == 2 * k * n * m * m + 2 * k * n * n * m  # a plain G^T G and G G^T
    assert op.executed_flops <= op.nominal_flops


def test_symmetric_block_products_match_plain(monkeypatch):
    """Several row blocks (forced by a small SYM_BLOCK) give the same symmetric products."""
    import fisherkron.core.operators as ops
    g = torch.Generator().manual_seed(8)
    G = torch.randn(5, 11, 7, generator=g, dtype=torch.float64)
    Z = torch.randn(11, 11, generator=g, dtype=torch.float64)
    Y = torch.randn(7, 7, generator=g, dtype=torch.float64)
    Z, Y = Z + Z.T, Y + Y.T
    ref = fk.rearranged_fisher(G)
    want = (ref.apply(Z), ref.apply_adjoint(Y), ref.apply(None), ref.apply_adjoint(None))
    monkeypatch.setattr(ops, "SYM_BLOCK", 3)
    op = fk.rearranged_fisher(G)
    got = (op.apply(Z, True), op.apply_adjoint(Y, True), op.apply(None), op.apply_adjoint(None))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **FLOAT64)
    assert op.executed_flops < op.nominal_flops  # the upper block triangles were skipped


@pytest.mark.parametrize("block", [None, 3])
def test_symmetric_products_are_exactly_symmetric(block, monkeypatch):
    """MFF relies on it: symmetric inputs give bit-for-bit symmetric outputs (one GEMM or row blocks)."""
    import fisherkron.core.operators as ops
    if block:
        monkeypatch.setattr(ops, "SYM_BLOCK", block)
    g = torch.Generator().manual_seed(9)
    G = torch.randn(4, 10, 7, generator=g)
    Z, Y = torch.randn(10, 10, generator=g, dtype=torch.float64), torch.randn(7, 7, generator=g, dtype=torch.float64)
    op = fk.rearranged_fisher(G, dtype=torch.float32)
    for out in (op.apply(Z + Z.T, True), op.apply_adjoint(Y + Y.T, True), op.apply(None), op.apply_adjoint(None)):
        assert torch.equal(out, out.T)


@pytest.mark.parametrize("n,m,T", [(7, 5, 9), (5, 7, 4), (6, 1, 3)])
def test_token_fisher_equals_dense_rearrangement_of_its_rank_one_gradients(n, m, T):
    """R(F) of the per-token Fisher, matrix-free from X and D, against R(F) built entry by entry
    from the dense Fisher of the T rank-one gradients delta_t x_t^T."""
    from fisherkron.core.operators import TokenFisher

    g = torch.Generator().manual_seed(n * 31 + m * 7 + T)
    X = torch.randn(T, m, generator=g, dtype=torch.float64)
    D = torch.randn(T, n, generator=g, dtype=torch.float64)
    op = TokenFisher(X, D, dtype=torch.float64)
    G = torch.einsum("ti,tj->tij", D, X)  # (T, n, m): G_t = delta_t x_t^T
    F = dense_fisher(G)
    R_dense = dense_rearrangement(F, n, m)
    torch.testing.assert_close(op.materialize(), R_dense, **FLOAT64)
    Z = torch.randn(n, n, generator=g, dtype=torch.float64)
    Y = torch.randn(m, m, generator=g, dtype=torch.float64)
    torch.testing.assert_close(fk.vec(op.apply(Z)), R_dense @ fk.vec(Z), **FLOAT64)
    torch.testing.assert_close(fk.vec(op.apply_adjoint(Y)), R_dense.T @ fk.vec(Y), **FLOAT64)
    torch.testing.assert_close(fk.vec(op.apply(None)), R_dense @ fk.vec(torch.eye(n, dtype=torch.float64)), **FLOAT64)
    torch.testing.assert_close(fk.vec(op.apply_adjoint(None)), R_dense.T @ fk.vec(torch.eye(m, dtype=torch.float64)),
                               **FLOAT64)
    assert op.fisher_norm_sq(block=2) == pytest.approx(float((F ** 2).sum()), rel=F64_REL)
    # the same per-token gradients through the gradient stack give the same R(F)
    torch.testing.assert_close(fk.rearranged_fisher(G).materialize(), R_dense, **FLOAT64)


def test_mff_on_token_fisher_equals_mff_on_the_token_gradients():
    from fisherkron.core.operators import TokenFisher
    from fisherkron.testing import MFF_F64_REL, rel_error

    g = torch.Generator().manual_seed(4)
    X = torch.randn(40, 6, generator=g, dtype=torch.float64)
    D = torch.randn(40, 8, generator=g, dtype=torch.float64) * torch.linspace(0.2, 2.0, 8, dtype=torch.float64)
    got = fk.mff(TokenFisher(X, D, dtype=torch.float64), dtype=torch.float64)
    ref = fk.mff(torch.einsum("ti,tj->tij", D, X), dtype=torch.float64)
    assert rel_error(torch.kron(got.A, got.B), torch.kron(ref.A, ref.B)) <= MFF_F64_REL
    assert got.fisher_share == pytest.approx(ref.fisher_share, rel=MFF_F64_REL)


def test_token_fisher_bad_input_is_one_line():
    from fisherkron.core.operators import TokenFisher

    with pytest.raises(fk.FisherkronError, match="X has 3 tokens and D 4"):
        TokenFisher(torch.randn(3, 2), torch.randn(4, 5))
    with pytest.raises(fk.FisherkronError, match="NaN/inf"):
        TokenFisher(torch.full((3, 2), float("nan")), torch.randn(3, 5))


@pytest.mark.parametrize("encoding,rel", [("float32", 0.0), ("bfloat16", 2.0 ** -8), ("float16", 2.0 ** -11)])
def test_stored_gradients_decode_within_their_rounding(encoding, rel, tmp_path):
    """16-bit gradient files decode to float32 within one rounding of their format, tiny gradients included
    (unscaled float16 would flush a 1e-9 gradient to zero: relative error 1)."""
    from fisherkron.core.operators import GradientStack, StoredGradients, encode_gradient

    g = torch.Generator().manual_seed(11)
    G = torch.randn(5, 7, 6, generator=g) * torch.tensor([1.0, 1e-9, 3e4, 1e-3, 1.0])[:, None, None]
    rows, scales = zip(*(encode_gradient(Gi, encoding) for Gi in G))
    np.save(tmp_path / "g.npy", np.stack(rows))
    stack = GradientStack(StoredGradients(str(tmp_path / "g.npy"), encoding, tuple(scales)), memory_budget=1)
    assert stack.streamed
    got = stack.stacked()
    for Gi, Hi in zip(G, got):
        assert float((Gi - Hi).abs().max()) <= rel * float(Gi.abs().max())
    # MFF reads the same decoded gradients
    res = fk.mff(StoredGradients(str(tmp_path / "g.npy"), encoding, tuple(scales)))
    ref = fk.mff(got)
    torch.testing.assert_close(torch.kron(res.A, res.B), torch.kron(ref.A, ref.B))


def test_stored_gradients_refuse_a_mismatched_file(tmp_path):
    from fisherkron.core.operators import GradientStack, StoredGradients

    np.save(tmp_path / "g.npy", np.zeros((2, 3, 4), dtype=np.float32))
    with pytest.raises(fk.FisherkronError, match="not bfloat16 gradients"):
        GradientStack(StoredGradients(str(tmp_path / "g.npy"), "bfloat16"))
    with pytest.raises(fk.FisherkronError, match="encoding 'int8' is unknown"):
        StoredGradients(str(tmp_path / "g.npy"), "int8")
