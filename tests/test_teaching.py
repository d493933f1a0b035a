"""``experiments.teaching`` against dense float64 references (the teaching notebook's library side).

* ``transform_pair`` (Fig. connection2fwsvd): the references build each method's pair from its
  definition: the identity for SVD, the diagonal Fisher read entry by entry off the dense
  ``nm x nm`` Fisher for the two FWSVD forms (``vec`` column-major: ``F[i + n j, i + n j] = E[G_ij^2]``),
  and ``A + alpha diag(A)``, ``B + alpha diag(B)`` for GFWSVD. Then the dense pair, pushed through
  Eq. (7) with explicit inverses, must give the library's factors at every rank: a pair with swapped
  sides, a transposed factor or a wrong reduction axis fails on the non-square layers.
* ``kron_distance`` and ``lanczos_errors`` (the convergence plot) against the dense Kronecker products.
* The loss link (Eq. (1)-(2)): ``CLSPath`` on a tiny float64 BERT classifier against the whole model
  (its logits, its loss with the weight replaced, each sentence's gradient through autograd), the
  Fishers' quadratic forms against the dense Fisher, and ``loss_link``'s table against the loss
  re-measured and the forms re-evaluated.
"""
import pytest
import torch
from torch import nn

import fisherkron as fk
from fisherkron.core.conventions import FisherkronError
from fisherkron.core.methods import factorize_weight
from fisherkron.core.operators import TokenFisher
from fisherkron.experiments import teaching as tc
from fisherkron.experiments.teaching import TransformPair, dense_weight, offdiagonal_share, transform_pair
from fisherkron.testing import F64_REL, FLOAT64, MFF_F64_REL, dense_fisher

SHAPES = [(7, 5), (5, 7), (6, 6)]
F64 = torch.float64
ALPHA = 0.05  # a fixed regularisation, so the GFWSVD reference is A + alpha diag(A) exactly
#: Eq. (7) through explicit inverses of well-conditioned 5-7 dimensional factors: round-off ~1e-13
EQ7 = dict(rtol=1e-8, atol=1e-10)


def _problem(n, m, seed=0):
    """``W`` (n x m), ``k = 12`` gradients with unequal row and column scales, and MFF's factors."""
    g = torch.Generator().manual_seed(seed)
    row = torch.logspace(-1, 1, n, dtype=F64)[torch.randperm(n, generator=g)]  # (n,)
    col = torch.logspace(-1, 1, m, dtype=F64)[torch.randperm(m, generator=g)]  # (m,)
    G = torch.randn(12, n, m, generator=g, dtype=F64) * row[:, None] * col[None, :]  # (k, n, m)
    W = torch.randn(n, m, generator=g, dtype=F64)  # (n, m)
    res = fk.mff(G, dtype=F64)
    return W, G, res.A, res.B


def _references(W, G, A, B):
    """The dense ``(L_B, L_A)`` of each method, from the definitions (not from the library's weights)."""
    n, m = W.shape
    Fd = torch.diagonal(dense_fisher(G))  # (n m,): E[G_ij^2] at i + n j
    rows = torch.tensor([sum(float(Fd[i + n * j]) for j in range(m)) for i in range(n)], dtype=F64)  # (n,)
    cols = torch.tensor([sum(float(Fd[i + n * j]) for i in range(n)) for j in range(m)], dtype=F64)  # (m,)
    In, Im = torch.eye(n, dtype=F64), torch.eye(m, dtype=F64)
    return {
        "svd": (In, Im),
        "fwsvd_rows": (torch.diag(rows.sqrt()), Im),  # App. E: D_ii = sqrt(sum_j E[G_ij^2])
        "fwsvd": (In, torch.diag(cols.sqrt())),  # its code: C_jj = sqrt(sum_i E[G_ij^2])
        "gfwsvd": (torch.linalg.cholesky(B + ALPHA * torch.diag(torch.diagonal(B))),
                   torch.linalg.cholesky(A + ALPHA * torch.diag(torch.diagonal(A)))),
    }


def _eq7(W, L_B, L_A, r):
    """``L_B^{-T} SVD_r(L_B^T W L_A) L_A^{-1}`` with explicit inverses (dense reference)."""
    U, S, Vh = torch.linalg.svd(L_B.T @ W @ L_A)  # (n, q), (q,), (q, m)
    return torch.linalg.inv(L_B.T) @ (U[:, :r] * S[:r]) @ Vh[:r] @ torch.linalg.inv(L_A)  # (n, m)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_pairs_equal_the_dense_references(shape):
    W, G, A, B = _problem(*shape)
    stats = dict(A=A, B=B, diag_fisher=(G * G).mean(0), alpha=ALPHA)
    for method, (ref_B, ref_A) in _references(W, G, A, B).items():
        pair = transform_pair(method, W, **stats)
        assert isinstance(pair, TransformPair)
        assert pair.L_B.dtype == F64 and pair.L_A.dtype == F64
        assert torch.allclose(pair.L_B, ref_B, **FLOAT64), f"{method}: L_B (output side, n x n)"
        assert torch.allclose(pair.L_A, ref_A, **FLOAT64), f"{method}: L_A (input side, m x m)"


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_pairs_give_the_librarys_factors_through_eq7(shape):
    W, G, A, B = _problem(*shape, seed=1)
    stats = dict(A=A, B=B, diag_fisher=(G * G).mean(0), alpha=ALPHA)
    for method in ("svd", "fwsvd_rows", "fwsvd", "gfwsvd"):
        pair = transform_pair(method, W, **stats)
        for r in range(1, min(shape) + 1):
            got = torch.matmul(*factorize_weight(method, W, r, **stats))
            assert torch.allclose(_eq7(W, pair.L_B, pair.L_A, r), got, **EQ7), f"{method} at rank {r}"


def test_gfwsvd_pair_is_lower_triangular_and_reports_its_regularisation():
    W, G, A, B = _problem(7, 5)
    pair = transform_pair("gfwsvd", W, A=A, B=B, alpha=ALPHA)
    assert torch.equal(pair.L_B, torch.tril(pair.L_B)) and torch.equal(pair.L_A, torch.tril(pair.L_A))
    assert (pair.alpha_A, pair.alpha_B) == (ALPHA, ALPHA)
    svd_pair = transform_pair("svd", W)
    assert svd_pair.alpha_A is None and svd_pair.alpha_B is None


def test_the_two_fwsvd_forms_are_mirror_images():
    """``fwsvd`` of ``W`` weights the same axis as ``fwsvd_rows`` of ``W^T`` with the transposed Fisher."""
    W, G, _, _ = _problem(7, 5, seed=2)
    cols = transform_pair("fwsvd", W, diag_fisher=(G * G).mean(0))
    rows_T = transform_pair("fwsvd_rows", W.T, diag_fisher=(G * G).mean(0).T)
    assert torch.allclose(cols.L_A, rows_T.L_B, **FLOAT64)
    assert torch.equal(cols.L_B, torch.eye(7, dtype=F64)) and torch.equal(rows_T.L_A, torch.eye(7, dtype=F64))


def test_missing_statistics_are_refused_naming_the_layer():
    W = torch.randn(7, 5, dtype=F64)
    with pytest.raises(FisherkronError, match="gfwsvd needs the Kronecker factors.*layer enc.3"):
        transform_pair("gfwsvd", W, layer="enc.3")


def test_dense_weight_and_offdiagonal_share():
    v = torch.tensor([1.0, 2.0, 3.0], dtype=F64)
    assert torch.equal(dense_weight(v, 3), torch.diag(v))
    M = torch.tensor([[1.0, 0.0], [3.0, 4.0]], dtype=F64)
    assert torch.equal(dense_weight(M, 2), M)
    assert offdiagonal_share(torch.diag(v)) == 0.0
    assert offdiagonal_share(M) == pytest.approx(3.0 / float(M.norm()), rel=1e-12)



# ----------------------------------------------------------------------------- convergence of MFF

def test_kron_distance_equals_the_dense_norm():
    g = torch.Generator().manual_seed(5)
    A1, A2 = torch.randn(5, 5, generator=g, dtype=F64), torch.randn(5, 5, generator=g, dtype=F64)
    B1, B2 = torch.randn(7, 7, generator=g, dtype=F64), torch.randn(7, 7, generator=g, dtype=F64)
    dense = float(torch.linalg.norm(torch.kron(A1, B1) - torch.kron(A2, B2)))
    assert tc.kron_distance(A1, B1, A2, B2) == pytest.approx(dense, rel=F64_REL)
    assert tc.kron_distance(A1, B1, -3.0 * A1, -B1 / 3.0) == pytest.approx(0.0, abs=1e-12), "the split is free"
    near = 1e-7 * torch.randn(5, 5, generator=g, dtype=F64)  # a close pair: no cancellation of large terms
    dense = float(torch.linalg.norm(torch.kron(A1 + near, B1) - torch.kron(A1, B1)))
    assert tc.kron_distance(A1 + near, B1, A1, B1) == pytest.approx(dense, rel=1e-6)


def test_lanczos_errors_fall_to_the_dense_pair():
    g = torch.Generator().manual_seed(6)
    G = torch.randn(12, 7, 5, generator=g, dtype=F64) * torch.logspace(-1, 1, 5, dtype=F64)  # (k, n, m)
    U, S, Vh = torch.linalg.svd(fk.rearranged_fisher(G).materialize())
    A, B = S[0].sqrt() * fk.unvec(U[:, 0], 5, 5), S[0].sqrt() * fk.unvec(Vh[0], 7, 7)
    errors = tc.lanczos_errors(G, A, B, max_products=40)
    products = [p for p, _ in errors]
    assert products == list(range(1, len(errors) + 1)), "one more product per entry"
    assert errors[-1][1] < 100 * MFF_F64_REL < errors[0][1], "from a rough start to the dense pair"
    assert len(errors) < 40, "it converged on its own within the budget"


# ----------------------------------------------------------------------------- the loss link

def _tiny_bert(seed=0):
    """A float64 two-block BERT classifier (hidden 8, feed-forward 12, 3 classes) and two padded batches."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    config = transformers.BertConfig(vocab_size=40, hidden_size=8, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=12, max_position_embeddings=16, num_labels=3)
    model = transformers.BertForSequenceClassification(config).double().eval()
    g = torch.Generator().manual_seed(seed)
    batches = []
    for size, length in ((5, 6), (4, 9)):
        ids = torch.randint(1, 40, (size, length), generator=g)
        mask = torch.ones(size, length, dtype=torch.long)
        mask[0, length // 2:] = 0  # one padded sentence per batch
        batches.append(dict(input_ids=ids, attention_mask=mask, labels=torch.randint(0, 3, (size,), generator=g)))
    return model, batches


def _sentence_loss(model, batches, index, labels=None):
    """Cross-entropy of sentence ``index`` (over the concatenated batches) through the whole model."""
    for b in batches:
        if index < len(b["labels"]):
            inputs = {k: v[index:index + 1] for k, v in b.items() if k != "labels"}
            y = b["labels"][index:index + 1] if labels is None else labels
            return nn.functional.cross_entropy(model(**inputs).logits, y)
        index -= len(b["labels"])
    raise IndexError(index)


@pytest.mark.parametrize("layer", tc.LINK_LAYERS)
def test_cls_path_is_the_model(layer):
    model, batches = _tiny_bert()
    inputs = tc.cls_inputs(model, batches)
    path = tc.CLSPath(model, layer)
    data = path.data(inputs)
    dense = model.get_submodule(f"bert.encoder.layer.1.{layer}")
    assert path.layer == f"bert.encoder.layer.1.{layer}" and torch.equal(path.W, dense.weight.detach())
    assert torch.allclose(path.logits(data), inputs.logits, **FLOAT64), "logits of the [CLS] path = the model's"
    dW = 0.1 * torch.randn(path.W.shape, dtype=F64)  # (n, m)
    with torch.no_grad():
        dense.weight += dW
        moved = torch.cat([model(**{k: v for k, v in b.items() if k != "labels"}).logits for b in batches])
        dense.weight -= dW
    assert torch.allclose(path.logits(data, path.W + dW), moved, **FLOAT64), "with the weight replaced"
    # each sentence's gradient through the whole model is delta_t x_t^T
    X, D = path.fisher_inputs(data, "data")  # (N, m), (N, n)
    for t in range(len(inputs.y)):
        (G_t,) = torch.autograd.grad(_sentence_loss(model, batches, t), dense.weight)
        assert torch.allclose(G_t, torch.outer(D[t], X[t]), **FLOAT64), f"sentence {t}"


def test_the_models_fisher_is_the_expectation_over_its_labels():
    model, batches = _tiny_bert(seed=1)
    path = tc.CLSPath(model, "intermediate.dense")  # 12 x 8
    data = path.data(tc.cls_inputs(model, batches))
    N, classes = len(data.y), 3
    P = torch.softmax(path.logits(data), dim=1)  # (N, classes)
    dense = model.get_submodule("bert.encoder.layer.1.intermediate.dense").weight
    F = torch.zeros(dense.numel(), dense.numel(), dtype=F64)
    for t in range(N):
        for c in range(classes):
            (G,) = torch.autograd.grad(_sentence_loss(model, batches, t, torch.tensor([c])), dense)
            F += P[t, c] * torch.outer(fk.vec(G), fk.vec(G)) / N  # sum_c p_c g_c g_c^T
    X, D = path.fisher_inputs(data, "model")  # (classes N, m), (classes N, n)
    assert torch.allclose(dense_fisher(TokenFisher(X, D, dtype=F64).gradients()), F, **FLOAT64)
    with pytest.raises(fk.FisherkronError, match="labels='sampled'"):
        path.fisher_inputs(data, "sampled")


def test_fisher_quadratic_forms_against_the_dense_fisher():
    g = torch.Generator().manual_seed(7)
    X, D = torch.randn(40, 5, generator=g, dtype=F64), torch.randn(40, 7, generator=g, dtype=F64)  # (N, m), (N, n)
    st = tc.FisherStats.of(X, D)
    F = dense_fisher(D[:, :, None] * X[:, None, :])  # (n m, n m) from G_t = delta_t x_t^T
    V = torch.randn(7, 5, generator=g, dtype=F64)
    v = fk.vec(V)
    forms = st.quadratic_forms(V)
    assert forms["fisher"] == pytest.approx(float(v @ F @ v), rel=F64_REL)
    assert forms["kronecker"] == pytest.approx(float(v @ torch.kron(st.A, st.B) @ v), rel=F64_REL)
    assert forms["diagonal"] == pytest.approx(float(v @ torch.diag(torch.diagonal(F)) @ v), rel=F64_REL)
    assert forms["isotropic"] == pytest.approx(float(torch.trace(F) / 35 * v @ v), rel=F64_REL)
    assert torch.allclose(st.diag, fk.unvec(torch.diagonal(F), 7, 5), **FLOAT64), "E[G_ij^2] at i + n j"


def test_perturbation_directions():
    g = torch.Generator().manual_seed(8)
    W = torch.randn(40, 20, generator=g, dtype=F64)
    G = torch.randn(30, 40, 20, generator=g, dtype=F64)
    res = fk.mff(G, dtype=F64)
    diag = (G * G).mean(0)
    dirs = tc.perturbation_directions(W, A=res.A, B=res.B, diag_fisher=diag, rank=3, draws=2, seed=0)
    kinds = [k for k, _ in dirs]
    assert kinds == ["iid", "rows", "columns", "rank one"] * 2 + ["SVD error", "FWSVD error", "GFWSVD error"]
    for kind, V in dirs:
        assert V.shape == (40, 20) and float(V.norm()) == pytest.approx(1.0, rel=1e-12), kind
    rows, cols, rank_one = dirs[1][1], dirs[2][1], dirs[3][1]
    assert int((rows.abs().sum(1) > 0).sum()) == 2, "rows: 5 % of the 40 output rows"
    assert int((cols.abs().sum(0) > 0).sum()) == 1, "columns: 5 % of the 20 input columns"
    assert int(torch.linalg.matrix_rank(rank_one)) == 1
    E = torch.matmul(*fk.svd(W, 3)) - W
    assert torch.allclose(dirs[8][1], E / E.norm(), **FLOAT64), "the direction of SVD's compression error"


def test_loss_link_table_is_what_it_says():
    model, batches = _tiny_bert(seed=2)
    path = tc.CLSPath(model, "output.dense")  # 8 x 12
    calib = path.data(tc.cls_inputs(model, batches[:1]))
    heldout = path.data(tc.cls_inputs(model, batches[1:]))
    before = path.loss(calib)
    assert path.fit_head(calib, l2=1e-2) < before, "fitting the head lowers the training loss"
    sizes = [0.01, 0.1]
    link = tc.loss_link(path, calib, heldout, sizes=sizes, rank=2, draws=1, seed=0)
    t = link.table
    assert len(t) == 7 * len(sizes) and link.shape == (8, 12) and link.heldout == 4 and link.calibration == 5
    emp = link.fishers["data"]
    dirs = tc.perturbation_directions(path.W, A=emp.A, B=emp.B, diag_fisher=emp.diag, rank=2, draws=1, seed=0)
    L0 = path.loss(heldout)
    g = path.gradient(heldout)
    for row in t.itertuples():
        V = dirs[row.index][1]
        dW = float(row.size * path.W.norm()) * V
        plus, minus = path.loss(heldout, path.W + dW) - L0, path.loss(heldout, path.W - dW) - L0
        assert row.one_sided == pytest.approx(plus, rel=1e-12, abs=1e-15)
        assert row.measured == pytest.approx((plus + minus) / 2, rel=1e-12, abs=1e-15)
        assert row.first_order == pytest.approx(float((g * dW).sum()), rel=1e-12, abs=1e-15)
        for labels, st in link.fishers.items():
            for form, q in st.quadratic_forms(V).items():
                assert getattr(row, f"{form}_{labels}") == pytest.approx(0.5 * float(dW.norm()) ** 2 * q, rel=1e-9)
    summary = tc.link_summary(link)
    assert len(summary) == 8 and summary.loc[summary.prediction == "isotropic (SVD)", "spearman"].isna().all()
    lines = tc.link_verdict(link, summary)
    assert len(lines) == 4 and lines[0].startswith("Loss link on bert.encoder.layer.1.output.dense (8 x 12)")


def test_the_path_needs_a_bert_style_classifier():
    transformers = pytest.importorskip("transformers")
    model = transformers.GPT2ForSequenceClassification(transformers.GPT2Config(n_embd=8, n_layer=1, n_head=2,
                                                                               vocab_size=20, n_positions=8))
    with pytest.raises(FisherkronError, match="BERT-style sequence classifier"):
        tc.CLSPath(model)
    bert, _ = _tiny_bert()
    with pytest.raises(FisherkronError, match="one of attention.output.dense"):
        tc.CLSPath(bert, "attention.self.query")


def test_sorted_batches_keep_the_draw():
    datasets = pytest.importorskip("datasets")

    class Words:  # a tokenizer stand-in: one id per word, [CLS] first
        def __call__(self, texts, truncation=True, max_length=64, padding=False, return_tensors=None):
            single = isinstance(texts, str)
            ids = [[101] + [len(w) for w in s.split()][: max_length - 1] for s in ([texts] if single else texts)]
            if single:
                return {"input_ids": ids[0]}
            width = max(map(len, ids))
            return {"input_ids": torch.tensor([i + [0] * (width - len(i)) for i in ids]),
                    "attention_mask": torch.tensor([[1] * len(i) + [0] * (width - len(i)) for i in ids])}

    rows = [{"sentence": " ".join(["w"] * (1 + (7 * i) % 11)), "label": i % 2} for i in range(30)]
    data = datasets.Dataset.from_list(rows)
    batches = tc.sorted_batches(Words(), data, 12, batch_size=5, seed=0)
    assert [len(b["labels"]) for b in batches] == [5, 5, 2]
    pick = torch.randperm(30, generator=torch.Generator().manual_seed(0))[:12].tolist()
    got = sorted((int(m.sum()), int(y)) for b in batches for m, y in zip(b["attention_mask"], b["labels"]))
    assert got == sorted((2 + (7 * i) % 11, i % 2) for i in pick), "the same sentences and labels"
    widths = [b["input_ids"].shape[1] for b in batches]
    assert widths == sorted(widths), "batches in order of length"
    with pytest.raises(FisherkronError, match="30"):
        tc.sorted_batches(Words(), data, 31, batch_size=5, seed=0)
