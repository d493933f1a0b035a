"""FLOPs (analytic against FlopCounterMode), measured layer speed, compress(min_speedup=) and the
throughput helpers, on the tiny models of tests/tiny_models.py."""
import logging

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import tiny_models
from fisherkron.core.conventions import FisherkronError
from fisherkron.core.lowrank import LowRankLinear, lowrank_params
from fisherkron.experiments import throughput as tp
from fisherkron.hf import speed
from fisherkron.hf.calibration import select_layers
from fisherkron.hf.surgery import compress, count_params


def _models():
    return {"llama": tiny_models.tiny_llama(), "llama_tied": tiny_models.tiny_llama(tie_word_embeddings=True),
            "bert": tiny_models.tiny_bert()}


def _block0(model):
    return [n for n in select_layers(model) if ".0." in n]


# ----------------------------------------------------------------------------- FLOPs

@pytest.mark.parametrize("kind", ["llama", "llama_tied", "bert"])
@pytest.mark.parametrize("B,T", [(1, 5), (2, 16), (3, 7)])
def test_analytic_flops_equal_flop_counter_dense(kind, B, T):
    model = _models()[kind]
    assert speed.forward_flops(model, B, T).total == speed.counted_flops(model, B, T)


@pytest.mark.parametrize("kind", ["llama", "bert"])
def test_analytic_flops_equal_flop_counter_lowrank(kind):
    """Ranks applied on paper, on a meta twin, and by real surgery: one number."""
    model = _models()[kind]
    names = _block0(model)
    ranks = {n: 1 + i % 3 for i, n in enumerate(names)}
    on_paper = speed.forward_flops(model, 2, 9, ranks=ranks)
    assert on_paper.total == speed.counted_flops(model, 2, 9, ranks=ranks)
    dense = speed.forward_flops(model, 2, 9)
    assert on_paper.total < dense.total and on_paper.attention == dense.attention
    compress(model, "svd", layers=names, ranks=ranks)
    assert sum(isinstance(m, LowRankLinear) for m in model.modules()) == len(names)
    real = speed.forward_flops(model, 2, 9)
    assert real.total == on_paper.total == speed.counted_flops(model, 2, 9)
    for n, r in ranks.items():  # a factorised layer is counted once, under its own name, as 2 T r (n + m)
        lin = model.get_submodule(n)
        assert real.layers[n] == 2 * 2 * 9 * r * (lin.in_features + lin.out_features)
        assert f"{n}.first" not in real.layers


def test_attention_flops_of_a_decoding_step_equal_the_counter():
    """``past``: new tokens attend to the cache too; counted with eager attention on a real cache."""
    model = tiny_models.tiny_llama()
    model.set_attn_implementation("eager")  # attention as bmm, which the counter sees on the CPU
    ids = torch.randint(0, 97, (2, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        cache = model(input_ids=ids, use_cache=True).past_key_values
        with FlopCounterMode(display=False) as counter:
            model(input_ids=ids[:, :3], past_key_values=cache, use_cache=True)
    assert speed.forward_flops(model, 2, 3, past=6).total == counter.get_total_flops()


def test_per_sequence_heads_are_counted_once_per_sequence():
    bert = tiny_models.tiny_bert()
    f1, f2 = speed.forward_flops(bert, 1, 4), speed.forward_flops(bert, 1, 8)
    assert f1.layers["classifier"] == f2.layers["classifier"] == 2 * 20 * 3
    assert f2.layers["bert.encoder.layer.0.intermediate.dense"] == 2 * f1.layers["bert.encoder.layer.0.intermediate.dense"]


@pytest.mark.parametrize("n,m", [(7, 5), (64, 48), (3072, 768)])
def test_breakeven_rank_splits_fewer_from_more_flops(n, m):
    r0 = speed.breakeven_rank(n, m)
    below, above = int(r0 - 1e-9), int(r0) + 1
    assert speed.linear_flops(n, m, 3, below) < speed.linear_flops(n, m, 3) < speed.linear_flops(n, m, 3, above)
    assert lowrank_params(n, m, below, bias=False) < n * m


def test_meta_model_from_a_config_counts_like_the_real_model():
    real = tiny_models.tiny_llama()
    cfg = {k: getattr(real.config, k) for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                                "num_attention_heads", "num_key_value_heads", "vocab_size",
                                                "max_position_embeddings", "tie_word_embeddings")}
    meta = tp.meta_model(dict(cfg, model_type="llama"))
    assert all(p.device.type == "meta" for p in meta.parameters())
    rows, ref = tp.flop_rows(meta, [0.0, 0.3], seq_len=11), tp.flop_rows(real, [0.0, 0.3], seq_len=11)
    assert [r["flops"] for r in rows] == [r["flops"] for r in ref] == [r["counted_flops"] for r in rows]
    assert rows[1]["params_ratio"] >= 0.3 and rows[1]["flop_ratio"] < 1 and rows[0]["flop_ratio"] == 1


def test_flops_errors_are_one_line():
    model = tiny_models.tiny_llama()
    with pytest.raises(FisherkronError, match="not an nn.Linear"):
        speed.forward_flops(model, 1, 4, ranks={"model.norm": 2})
    with pytest.raises(FisherkronError, match="outside|rank"):
        speed.forward_flops(model, 1, 4, ranks={"model.layers.0.mlp.up_proj": 99})
    with pytest.raises(FisherkronError, match="num_hidden_layers"):
        speed.forward_flops(nn.Sequential(nn.Linear(3, 4)), 1, 4)


# ----------------------------------------------------------------------------- measured speed

def test_layer_speedup_sees_a_clearly_slower_and_a_clearly_faster_factorisation():
    """Margins far beyond timing noise: full rank on 8 rows does more FLOPs in two calls; rank 8 of a
    1024 x 1024 layer on 256 rows does 64x fewer FLOPs."""
    slow = speed.layer_speedup(64, 48, 48, tokens=8, repeats=5, cache=False)
    fast = speed.layer_speedup(1024, 1024, 8, tokens=256, repeats=5, cache=False)
    assert slow.flop_speedup < 1 and slow.speedup < 1
    assert fast.flop_speedup == 64 and fast.speedup > 2


def test_layer_speedup_is_cached_per_shape_rank_and_tokens():
    speed.clear_speed_cache()
    a = speed.layer_speedup(32, 24, 4, tokens=16, repeats=2, min_time=1e-4)
    assert speed.layer_speedup(32, 24, 4, tokens=16, repeats=2, min_time=1e-4) is a
    assert speed.layer_speedup(32, 24, 4, tokens=17, repeats=2, min_time=1e-4) is not a
    assert speed.layer_speedup(32, 24, 4, tokens=16, repeats=2, min_time=1e-4, cache=False) is not a
    with pytest.raises(FisherkronError, match="rank"):
        speed.layer_speedup(32, 24, 25)


def _fake_speed(slow_shape):
    def layer_speedup(n, m, rank, tokens=1024, **kw):
        s = 0.5 if (n, m) == slow_shape else 2.0  # dense time / factorised time
        return speed.LayerSpeed(n, m, rank, tokens, dense_s=s, lowrank_s=1.0, device="cpu")
    return layer_speedup


def test_compress_keeps_layers_dense_where_the_factorisation_is_slower(monkeypatch, caplog):
    monkeypatch.setattr(speed, "layer_speedup", _fake_speed((40, 24)))  # gate_proj and up_proj: out 40, in 24
    model = tiny_models.tiny_llama()
    before = count_params(model)
    ref = compress(tiny_models.tiny_llama(), "svd", ratio=0.2)
    with caplog.at_level(logging.WARNING, logger="fisherkron.hf.surgery"):
        rep = compress(model, "svd", ratio=0.2, min_speedup=1.0, speed_tokens=64)
    slow = [n for n in rep.layers if n.endswith(("gate_proj", "up_proj"))]
    assert slow and all(isinstance(model.get_submodule(n), nn.Linear) for n in slow)
    assert all(isinstance(model.get_submodule(n), LowRankLinear) for n in rep.layers if n not in slow)
    for name, lr in rep.layers.items():
        assert lr.speedup == (0.5 if name in slow else 2.0)
        assert (lr.skipped is not None) == (name in slow)
        assert lr.rank == ref.layers[name].rank  # the ranks were planned for the ratio first
    assert "min_speedup 1" in rep.layers[slow[0]].skipped
    assert set(rep.ranks) == set(rep.layers) - set(slow)
    # the counts stay consistent, and the achieved ratio falls short of the target (and says so)
    assert rep.params_after == count_params(model) == before - rep.layer_params_before + rep.layer_params_after
    assert rep.ratio < 0.2 <= ref.ratio
    assert "kept dense" in caplog.text and "instead of the 20.00% planned" in caplog.text
    x = torch.randint(0, 97, (1, 5))
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=x).logits).all()


def test_compress_min_speedup_keeps_every_measured_slower_layer_dense(monkeypatch):
    """compress acts on what layer_speedup measures (replaced here by a fixed answer, so the test does not
    depend on the machine's timing): a layer measured slower than min_speedup stays nn.Linear."""
    from types import SimpleNamespace

    asked = []

    def measured(n, m, rank, tokens, **kw):
        asked.append((n, m, rank, tokens))
        return SimpleNamespace(speedup=0.8 if n * m < 900 else 1.5)  # the small layers "run slower"

    monkeypatch.setattr(speed, "layer_speedup", measured)
    model = tiny_models.tiny_llama()
    rep = compress(model, "svd", rank=1, min_speedup=1.0, speed_tokens=8)
    assert asked and all(t == 8 for *_, t in asked)
    for name, lr in rep.layers.items():
        slow = lr.n * lr.m < 900
        assert (lr.skipped is not None) == slow and lr.speedup == (0.8 if slow else 1.5)
        assert isinstance(model.get_submodule(name), LowRankLinear) != slow
    plain = compress(tiny_models.tiny_llama(), "svd", rank=1)  # without the option nothing is measured
    assert all(lr.skipped is None and lr.speedup is None for lr in plain.layers.values())


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), "fast"])
def test_min_speedup_must_be_a_positive_number(bad):
    with pytest.raises(FisherkronError, match="min_speedup"):
        compress(tiny_models.tiny_llama(), "svd", rank=1, min_speedup=bad)


# ----------------------------------------------------------------------------- model timing

def test_decode_timing_keeps_the_cache_at_its_context():
    model = tiny_models.tiny_llama()
    t = tp.time_decode(model, batch_size=3, context=7, warmup=1, repeats=2)
    assert len(t.seconds) == 2 and t.tokens == 3 and t.ms_per_step > 0
    f = tp.time_forward(model, 2, 5, warmup=0, repeats=2)
    assert f.tokens == 10 and f.tokens_per_s == pytest.approx(10 / f.median)


def test_layer_rows_group_layers_by_shape_and_rank():
    model = tiny_models.tiny_llama()
    rows = tp.layer_rows(model, [0.3], [4], repeats=1)
    assert sum(r["layers"] for r in rows) == len(select_layers(model))
    assert {(r["n"], r["m"]) for r in rows} == {(24, 24), (12, 24), (40, 24), (24, 40)}
    ranks = tp.uniform_ranks(model, 0.3)
    assert {(r["n"], r["m"], r["rank"]) for r in rows} == {
        (model.get_submodule(n).out_features, model.get_submodule(n).in_features, k) for n, k in ranks.items()}
