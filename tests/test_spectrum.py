"""The Kronecker spectrum helper (experiments.spectrum) against the dense float64 R(F)."""
import json

import numpy as np
import pytest
import torch

import tiny_models
from fisherkron.experiments import spectrum
from fisherkron.hf.calibration import collect_calibration
from fisherkron.testing import F64_REL, MFF_F32_REL, MFF_F64_REL, MFF_REF_TOL, dense_fisher, dense_rearrangement


def _dense_R(G: torch.Tensor) -> torch.Tensor:
    """R(F) (m^2 x n^2) by a reshape: R[j + m j', i + n i'] = F[i + n j, i' + n j'] (checked below)."""
    k, n, m = G.shape
    F = dense_fisher(G)  # (nm, nm), column-major vec
    return F.reshape(m, n, m, n).permute(2, 0, 3, 1).reshape(m * m, n * n)


def test_reshaped_rearrangement_equals_the_entrywise_reference():
    G = torch.randn(3, 7, 5, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    assert torch.equal(_dense_R(G), dense_rearrangement(dense_fisher(G), 7, 5))


@pytest.mark.parametrize("n,m,k,terms", [(7, 5, 6, 10), (5, 7, 3, 12), (4, 4, 2, 8)])
def test_layer_spectrum_equals_dense_singular_values(n, m, k, terms):
    G = torch.randn(k, n, m, generator=torch.Generator().manual_seed(n * m + k), dtype=torch.float64)
    S = torch.linalg.svdvals(_dense_R(G))
    got = spectrum.layer_spectrum(G, terms, tol=MFF_REF_TOL, dtype=torch.float64)
    sig = torch.tensor(got["sigma"], dtype=torch.float64)
    assert float((sig - S[:terms]).abs().max()) <= MFF_F64_REL * float(S[0])
    norm_sq = float((S ** 2).sum())  # ||R(F)||_F^2 = ||F||_F^2 = (1/k^2) sum_ij <G_i, G_j>^2
    assert abs(got["fisher_norm_sq"] - norm_sq) <= F64_REL * norm_sq
    assert abs(got["share_1"] - float(S[0] ** 2) / norm_sq) <= MFF_F64_REL
    assert abs(got["share_top"] - float((S[:terms] ** 2).sum()) / norm_sq) <= MFF_F64_REL
    assert got["ratio_12"] == pytest.approx(float(S[0] / S[1]), rel=MFF_F64_REL)


def test_all_kronecker_terms_hold_the_whole_fisher():
    """With every singular value of R(F) (min(n, m)^2 of them), sum sigma_j^2 = ||F||_F^2 exactly."""
    G = torch.randn(5, 3, 2, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    got = spectrum.layer_spectrum(G, 4, tol=MFF_REF_TOL, dtype=torch.float64)
    assert abs(got["share_top"] - 1.0) <= MFF_F64_REL


def test_one_gradient_gives_rank_of_G_squared_kronecker_terms():
    """R(g g^T) = G^T (x) G^T: its singular values are s_a s_b, so R(F) is not of rank <= k."""
    G = torch.randn(1, 6, 4, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    s = torch.linalg.svdvals(G[0])
    S = torch.linalg.svdvals(_dense_R(G))
    products = torch.sort(torch.outer(s, s).reshape(-1), descending=True).values
    assert int((S > 1e-10 * S[0]).sum()) == 16
    torch.testing.assert_close(S[:16], products, rtol=1e-10, atol=0)


def test_layer_type_strips_model_and_block():
    assert spectrum.layer_type("model.layers.3.self_attn.q_proj") == "self_attn.q_proj"
    assert spectrum.layer_type("bert.encoder.layer.11.output.dense") == "output.dense"
    assert spectrum.layer_type("transformer.h.0.mlp.c_fc") == "mlp.c_fc"
    assert spectrum.layer_type("classifier") == "classifier"


@pytest.fixture(scope="module")
def tiny_stats(tmp_path_factory):
    model = tiny_models.tiny_llama()
    g = torch.Generator().manual_seed(5)
    batches = []
    for _ in range(3):
        x = torch.randint(1, 97, (2, 9), generator=g)
        batches.append({"input_ids": x, "attention_mask": torch.ones_like(x), "labels": x.clone()})
    return collect_calibration(model, batches, "model.layers.0.*", stats=("grads",),
                               cache_dir=tmp_path_factory.mktemp("cal"))


def test_model_spectra_of_a_tiny_model_match_dense_references(tiny_stats, tmp_path):
    rows = spectrum.model_spectra(tiny_stats, 6, tol=1e-5, cache_dir=tmp_path)
    assert [r["layer"] for r in rows] == list(tiny_stats.layers)
    for r in rows:
        G = torch.from_numpy(np.array(tiny_stats.grads(r["layer"]))).double()  # (k, n, m)
        S = torch.linalg.svdvals(_dense_R(G))
        got = torch.tensor(r["sigma"], dtype=torch.float64)
        # float32 GEMMs: relative to sigma_1, at the accuracy of float32 MFF
        assert float((got - S[:6]).abs().max()) <= MFF_F32_REL * float(S[0]), r["layer"]
        assert r["share_1"] == pytest.approx(float(S[0] ** 2 / (S ** 2).sum()), rel=MFF_F32_REL)
        assert (r["n"], r["m"], r["k"]) == (*G.shape[1:], 3) and r["type"] == spectrum.layer_type(r["layer"])


def test_model_spectra_are_cached_per_calibration_and_k(tiny_stats, tmp_path, monkeypatch):
    first = spectrum.model_spectra(tiny_stats, 4, cache_dir=tmp_path)
    files = list(tmp_path.glob("spectrum-*.json"))
    assert len(files) == 1 and set(json.loads(files[0].read_text())) == set(tiny_stats.layers)

    def boom(*a, **kw):
        raise AssertionError("recomputed a cached layer")

    monkeypatch.setattr(spectrum, "layer_spectrum", boom)
    assert spectrum.model_spectra(tiny_stats, 4, cache_dir=tmp_path) == first
    monkeypatch.undo()
    fewer = spectrum.model_spectra(tiny_stats, 4, k=1, cache_dir=tmp_path)  # another k: another entry
    assert len(list(tmp_path.glob("spectrum-*.json"))) == 2
    assert all(r["k"] == 1 for r in fewer) and [r["sigma"] for r in fewer] != [r["sigma"] for r in first]
    files[0].write_text("{not json")  # a damaged cache is recomputed, not trusted
    again = spectrum.model_spectra(tiny_stats, 4, cache_dir=tmp_path)
    np.testing.assert_allclose([r["sigma"] for r in again], [r["sigma"] for r in first], rtol=1e-6)


def test_model_spectra_errors(tiny_stats, tmp_path):
    from fisherkron.core.conventions import FisherkronError

    with pytest.raises(FisherkronError, match="k=4 exceeds the 3 gradients"):
        spectrum.model_spectra(tiny_stats, 4, k=4, cache_dir=tmp_path)
    with pytest.raises(FisherkronError, match="no calibration statistics"):
        spectrum.model_spectra(tiny_stats, 4, layers=["model.layers.1.mlp.up_proj"], cache_dir=tmp_path)


def test_summary_by_type_counts_the_gap():
    rows = [{"type": t, "ratio_12": r, "share_1": s, "share_top": 0.9}
            for t, r, s in [("q", 4.0, 0.6), ("q", 2.0, 0.2), ("k", 3.5, 0.7), ("q", 3.0, 0.4)]]
    out = {d["type"]: d for d in spectrum.summary_by_type(rows, threshold=3.0)}
    assert list(out) == ["q", "k"]
    assert (out["q"]["layers"], out["q"]["gap_layers"], out["k"]["gap_layers"]) == (3, 1, 1)  # 3.0 is not > 3
    assert out["q"]["median_share_1"] == 0.4 and out["q"]["min_share_1"] == 0.2
