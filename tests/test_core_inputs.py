"""What the core accepts: fisherkron's own 16-bit gradient files, and one-line refusals for everything else.

Inputs once mishandled: a float16 calibration file was factorised without its per-gradient
scales (A (x) B 8e6 times too large) and a bfloat16 one refused as "uint16 values"; complex and
non-tensor gradients, negative-definite factors, mismatched shapes and a string ``min_speedup``
ended in a raw traceback or were accepted silently.
"""
import json
import math

import numpy as np
import pytest
import torch

import fisherkron as fk
from fisherkron.core.operators import GradientStack
from fisherkron.core.regularization import INDEFINITE_TOL
from fisherkron.core.stored import StoredGradients, encode_gradient
from fisherkron.testing import FLOAT64

#: relative rounding of the 16-bit encodings (one rounding of the format, per gradient)
ROUNDING = {"bfloat16": 2.0 ** -8, "float16": 2.0 ** -11}


def _one_line(exc) -> str:
    msg = str(exc.value)
    assert "\n" not in msg, msg
    return msg


def _gradients(k=5, n=7, m=6, seed=3) -> torch.Tensor:
    """``k`` gradients of an odd ``n x m`` layer over 13 orders of magnitude (float16 alone would flush 1e-9)."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.tensor([1.0, 1e-9, 3e4, 1e-3, 1.0])[:k, None, None]
    return torch.randn(k, n, m, generator=g, dtype=torch.float64).float() * scale  # (k, n, m)


def _entry(folder, G, encoding, layer="model.layers.0.mlp.up_proj", manifest=True, scales=True):
    """A calibration entry as collect_calibration writes it: ``<layer>.grads.npy`` (+ scales) and manifest.json."""
    folder.mkdir(parents=True, exist_ok=True)
    rows, s = zip(*(encode_gradient(Gi, encoding) for Gi in G))
    path = folder / f"{layer}.grads.npy"
    np.save(path, np.stack(rows))
    if encoding == "float16" and scales:
        np.save(folder / f"{layer}.grad_scales.npy", np.asarray(s))
    if manifest:
        (folder / "manifest.json").write_text(json.dumps({"key": "k", "k": len(G), "config": {"grad_dtype": encoding}}))
    return path, StoredGradients(str(path), encoding, tuple(s) if encoding == "float16" else None)


# ----------------------------------------------------------------------------- 1. fisherkron's 16-bit files

@pytest.mark.parametrize("encoding", ["float16", "bfloat16"])
def test_a_16_bit_gradient_file_of_a_calibration_entry_is_decoded(encoding, tmp_path):
    """The path of a 16-bit ``<layer>.grads.npy`` reads exactly as the entry's StoredGradients do (scales applied)."""
    G = _gradients()
    path, stored = _entry(tmp_path / "entry", G, encoding)
    by_path, by_entry = GradientStack(str(path)).stacked(), GradientStack(stored).stacked()
    assert torch.equal(by_path, by_entry)
    for Gi, Hi in zip(G, by_path):  # each gradient within one rounding of the format, tiny ones included
        assert float((Gi - Hi).abs().max()) <= ROUNDING[encoding] * float(Gi.abs().max())
    res, ref = fk.mff(path, dtype=torch.float64), fk.mff(stored, dtype=torch.float64)
    torch.testing.assert_close(torch.kron(res.A, res.B), torch.kron(ref.A, ref.B), **FLOAT64)


@pytest.mark.parametrize("encoding", ["float16", "bfloat16"])
def test_a_collected_16_bit_file_reads_as_its_calibration_stats(encoding, tmp_path):
    """On a real entry of collect_calibration: fk.mff(stats.grads_path(name)) == fk.mff(stats.gradients(name))."""
    from tiny_models import tiny_llama

    from fisherkron.hf import collect_calibration

    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(3):
        x = torch.randint(1, 97, (2, 8), generator=g)
        batches.append({"input_ids": x, "attention_mask": torch.ones_like(x), "labels": x.clone()})
    name = "model.layers.0.mlp.up_proj"
    stats = collect_calibration(tiny_llama(), batches, name, stats=("grads",), cache_dir=tmp_path,
                                grad_dtype=encoding)
    by_path = fk.mff(str(stats.grads_path(name)), dtype=torch.float64)
    ref = fk.mff(stats.gradients(name), dtype=torch.float64)
    torch.testing.assert_close(torch.kron(by_path.A, by_path.B), torch.kron(ref.A, ref.B), **FLOAT64)


@pytest.mark.parametrize("encoding", ["float16", "bfloat16"])
def test_a_16_bit_file_that_cannot_be_decoded_is_refused(encoding, tmp_path):
    """Outside its entry (no manifest), or against its manifest, a 16-bit file is refused naming how to read it."""
    G = _gradients()
    loose, _ = _entry(tmp_path / "loose", G, encoding, manifest=False)
    with pytest.raises(fk.FisherkronError, match=r"CalibrationStats\(\.\.\.\)\.gradients") as e:
        fk.mff(loose)
    assert f"StoredGradients(path, '{encoding}'" in _one_line(e)
    other = tmp_path / "other.npy"  # not <layer>.grads.npy: no entry could describe it
    np.save(other, np.load(loose))
    with pytest.raises(fk.FisherkronError, match="not inside a calibration entry"):
        fk.mff(other)
    wrong, _ = _entry(tmp_path / "wrong", G, encoding)
    (tmp_path / "wrong" / "manifest.json").write_text(json.dumps({"config": {"grad_dtype": "float32"}}))
    with pytest.raises(fk.FisherkronError, match="entry stores float32 gradients") as e:
        fk.mff(wrong)
    _one_line(e)


def test_float16_gradients_without_their_scales_are_refused(tmp_path):
    G = _gradients()
    path, _ = _entry(tmp_path / "entry", G, "float16", scales=False)
    with pytest.raises(fk.FisherkronError, match="scales .*grad_scales.npy are missing") as e:
        fk.mff(path)
    _one_line(e)
    np.save(tmp_path / "entry" / "model.layers.0.mlp.up_proj.grad_scales.npy", np.ones(len(G) - 1))
    with pytest.raises(fk.FisherkronError, match=f"should hold {len(G)} finite positive scales"):
        fk.mff(path)
    # in memory: a float16 array (np.load of such a file) or the uint16 bits of bfloat16
    raw = np.load(path)
    with pytest.raises(fk.FisherkronError, match=r"scaled encoding G_i / s_i without their scales") as e:
        fk.mff(raw)
    assert "CalibrationStats(...).gradients" in _one_line(e)
    with pytest.raises(fk.FisherkronError, match="scaled encoding"):
        fk.mff(torch.from_numpy(raw))
    bits = np.stack([encode_gradient(Gi, "bfloat16")[0] for Gi in G])
    with pytest.raises(fk.FisherkronError, match="uint16 gradients are fisherkron's bfloat16 bits"):
        fk.mff(bits)
    # bfloat16 *tensors* hold values: read as such
    bf = G.to(torch.bfloat16)
    torch.testing.assert_close(GradientStack(bf).stacked(), bf.float(), rtol=0, atol=0)


@pytest.mark.parametrize("encoding", ["float16", "bfloat16"])
def test_factorize_command_reads_a_16_bit_entry_file(encoding, tmp_path, capsys):
    """``fisherkron factorize`` on an entry's 16-bit file: the factors of the decoded gradients, not of the raw ones."""
    from fisherkron.cli import main

    G = _gradients()
    path, stored = _entry(tmp_path / "entry", G, encoding)
    assert main(["-q", "factorize", str(path), "--out", str(tmp_path / "f.pt"), "--float64"]) == 0
    got = torch.load(tmp_path / "f.pt", weights_only=True)
    ref = fk.mff(stored, dtype=torch.float64)
    torch.testing.assert_close(torch.kron(got["A"], got["B"]), torch.kron(ref.A, ref.B), **FLOAT64)
    capsys.readouterr()
    loose, _ = _entry(tmp_path / "loose", G, encoding, manifest=False)
    try:
        code = main(["factorize", str(loose), "--out", str(tmp_path / "g.pt")])
    except SystemExit as exc:
        code = exc.code
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "CalibrationStats(...).gradients" in err, err
    assert not (tmp_path / "g.pt").exists()


# ----------------------------------------------------------------------------- 2. what no gradient is

@pytest.mark.parametrize("grads,message", [
    (torch.randn(4, 3, 2, dtype=torch.complex64), "complex"),
    (np.ones((4, 3, 2), dtype=complex), "complex"),
    ([torch.randn(3, 2, dtype=torch.complex64)] * 3, "complex"),
    (torch.ones(4, 3, 2, dtype=torch.int64), "int64 values; gradients must be floats"),
    (torch.ones(4, 3, 2, dtype=torch.bool), "bool values"),
    (np.array([[[object()]]]), "object values"),
    (["ab", "cd"], "gradient 0 is a str"),
    ({"a": 1}, "gradient 0 is a str"),
    ([[[1.0, 2.0], [3.0]]], "gradient 0 is a list"),
    ((None for _ in range(2)), "gradient 0 is a NoneType"),
    (None, "got NoneType"),
    (3.0, "got float"),
    ([[1.0, 2.0], [3.0, 4.0]], r"gradient 0 has shape \(2,\), expected \(n, m\)"),
], ids=["complex", "complex-numpy", "complex-list", "int", "bool", "object", "strings", "dict", "ragged",
        "generator-of-None", "None", "number", "list-of-lists"])
def test_mff_refuses_what_is_no_real_gradient(grads, message):
    with pytest.raises(fk.FisherkronError, match=message) as e:
        fk.mff(grads)
    _one_line(e)


# ----------------------------------------------------------------------------- 2. factors that are no curvature

def _factors(n=7, m=5, seed=2):
    g = torch.Generator().manual_seed(seed)
    X, D = torch.randn(m, 40, generator=g, dtype=torch.float64), torch.randn(n, 40, generator=g, dtype=torch.float64)
    W = torch.randn(n, m, generator=g, dtype=torch.float64)
    return W, X @ X.T / 40, D @ D.T / 40  # W (n, m), A (m, m), B (n, n): positive definite


@pytest.mark.parametrize("side", ["A", "B"])
@pytest.mark.parametrize("kind", ["negative definite", "sign-flipped PSD", "indefinite"])
def test_gfwsvd_refuses_a_factor_that_is_no_curvature(side, kind):
    """Regularisation reached a Cholesky factor of -A by replacing it (alpha = 1e7); now refused, naming the side."""
    W, A, B = _factors()
    F = A if side == "A" else B
    if kind == "negative definite":
        F = -F
    elif kind == "sign-flipped PSD":
        F = -(F - float(torch.linalg.eigvalsh(F).min()) * torch.eye(F.shape[0], dtype=F.dtype))  # singular, -PSD
    else:
        lam, Q = torch.linalg.eigh(F)
        lam[0] = -0.5 * lam[-1]  # one eigenvalue half the largest, negative
        F = (Q * lam) @ Q.T
    low = float(torch.linalg.eigvalsh(0.5 * (F + F.T)).min())
    A, B = (F, B) if side == "A" else (A, F)
    for kw in ({}, {"min_alpha": 0}, {"method": "shrink"}, {"alpha": 10.0}):
        with pytest.raises(fk.FisherkronError, match="not positive semidefinite") as e:
            fk.gfwsvd(W, A, B, 2, **kw)
        msg = _one_line(e)
        assert f"{side} ({'input' if side == 'A' else 'output'} side" in msg
        assert f"smallest eigenvalue {low:.3g}" in msg


def test_regularize_refuses_nan_and_negative_factors_in_one_line():
    W, A, B = _factors()
    with pytest.raises(fk.FisherkronError, match="B .*NaN/inf"):
        fk.gfwsvd(W, A, torch.full_like(B, float("nan")), 2)
    with pytest.raises(fk.FisherkronError, match=r"factor is not positive semidefinite: smallest eigenvalue -3"):
        fk.regularize(-torch.diag(torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)))
    with pytest.raises(fk.FisherkronError, match="indefinite_tol must be"):
        fk.regularize(A, indefinite_tol=-1)


def test_round_off_and_mild_indefiniteness_are_still_regularised():
    """The refusal leaves what regularisation is for: round-off negatives, early-stopping negatives, ablations."""
    W, A, B = _factors()
    lam, Q = torch.linalg.eigh(A)
    lam[0] = -0.5 * INDEFINITE_TOL * lam[-1]  # inside the tolerance
    mild = (Q * lam) @ Q.T
    reg = fk.regularize(mild, min_alpha=0)
    assert reg.alpha > 0
    torch.testing.assert_close(reg.L @ reg.L.T, reg.matrix, **FLOAT64)
    # the off-diagonal ablation is indefinite by construction and still regularised
    from fisherkron.core.methods import ablate
    g = torch.Generator().manual_seed(5)
    u = torch.tensor([10.0, 10.0, 0.1, 0.1, 0.1], dtype=torch.float64)
    Aw = torch.outer(u, u) + 0.1 * torch.eye(5, dtype=torch.float64)  # two dominant, correlated units
    off, _ = ablate(Aw, "offdiag")
    ev = torch.linalg.eigvalsh(off)
    assert float(ev.min()) < -INDEFINITE_TOL * float(ev.max())  # beyond the tolerance of a Fisher factor
    with pytest.raises(fk.FisherkronError, match="not positive semidefinite"):
        fk.regularize(off)
    W2, W1 = fk.factorize_weight("gfwsvd_offdiag", torch.randn(7, 5, generator=g, dtype=torch.float64), 2,
                                 A=Aw, B=B)
    assert W2.shape == (7, 2) and W1.shape == (2, 5)


# ----------------------------------------------------------------------------- 2. shapes and numbers

def test_fisher_weighted_error_names_the_shapes_it_expects():
    W, A, B = _factors()  # W 7 x 5: n=7, m=5
    assert fk.fisher_weighted_error(W, torch.zeros_like(W), A, B) > 0
    for args, what, shape in (((W, W, B, B), "A", (7, 7)), ((W, W, A, A), "B", (5, 5)),
                              ((W, W.T, A, B), "W_hat", (5, 7))):
        with pytest.raises(fk.FisherkronError, match=rf"{what} has shape \({shape[0]}, {shape[1]}\)") as e:
            fk.fisher_weighted_error(*args)
        assert "W and W_hat n x m, A m x m and B n x n with n=7, m=5" in _one_line(e)
    with pytest.raises(fk.FisherkronError, match="2-D"):
        fk.fisher_weighted_error(W[0], W[0], A, B)


@pytest.mark.parametrize("value,message", [("1.5", "got a string '1.5'; pass min_speedup=1.5"),
                                           ("fast", "got a string 'fast'"), (True, "got a bool")])
def test_numbers_given_as_strings_are_refused(value, message):
    from fisherkron.core.checks import check_positive

    with pytest.raises(fk.FisherkronError, match=message):
        check_positive(value, "min_speedup")
    assert check_positive(1.5, "min_speedup") == 1.5 and check_positive(np.float32(2), "x") == 2.0


def test_compress_refuses_a_string_min_speedup_before_changing_the_model():
    """compress(min_speedup="1.5") passed the check and failed comparing a float with a str (a TypeError)."""
    from torch import nn

    from fisherkron.hf import compress

    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 4))
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(fk.FisherkronError, match=r"min_speedup must be a number.*'1\.5'") as e:
        compress(model, "svd", None, "0", rank=2, min_speedup="1.5")
    _one_line(e)
    assert isinstance(model[0], nn.Linear)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert math.isfinite(float(compress(model, "svd", None, "0", rank=2, min_speedup=0.01).ratio))


def test_phases_count_exclusive_wall_time_and_reach_provenance_records():
    import time

    from fisherkron.core import phases
    from fisherkron.repro.figures import provenance

    phases.reset()

    @phases.timed("outer")
    def outer():
        time.sleep(0.03)
        with phases.phase("inner"):
            time.sleep(0.05)

    t = time.perf_counter()
    outer()
    wall = time.perf_counter() - t
    s = phases.seconds()
    assert s["inner"] >= 0.05 and s["outer"] >= 0.03
    assert s["inner"] + s["outer"] <= wall + 1e-3          # nested time is counted once, in the inner phase
    assert list(s) == sorted(s, key=lambda k: -s[k])       # largest first
    assert provenance("x")["phases"] == s
    phases.reset()
    assert phases.seconds() == {} and provenance("x")["phases"] == {}
