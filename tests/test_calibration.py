"""Calibration statistics against torch autograd and dense references; the cache and its guards."""
import json

import numpy as np
import pytest
import torch

from fisherkron.hf.calibration import collect_calibration, select_layers
from fisherkron.core.conventions import FisherkronError
from fisherkron.core.kfac import kfac_factors
from fisherkron.testing import abs_sum_scale, assert_close_f32, gram_scale
from tiny_models import tiny_bert, tiny_llama


def lm_batches(k=3, B=2, T=9, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(k):
        x = torch.randint(0, 97, (B, T), generator=g)
        out.append({"input_ids": x, "attention_mask": torch.ones_like(x), "labels": x.clone()})
    return out


def bert_batches(k=3, B=3, T=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(k):
        x = torch.randint(1, 50, (B, T), generator=g)
        mask = torch.ones(B, T, dtype=torch.long)
        mask[0, 4:] = 0  # one padded row: its pad tokens must not enter activation statistics
        out.append({"input_ids": x, "attention_mask": mask, "labels": torch.randint(0, 3, (B,), generator=g)})
    return out


def test_select_layers_regex_glob_and_error():
    model = tiny_llama()
    assert select_layers(model, r"model\.layers\.0\.mlp\.\w+_proj") == [
        "model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj", "model.layers.0.mlp.down_proj"]
    assert select_layers(model, "model.layers.*.self_attn.q_proj") == [
        "model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.q_proj"]
    assert "lm_head" not in select_layers(model)  # default: transformer blocks only
    assert len(select_layers(model)) == 14
    with pytest.raises(FisherkronError, match=r"matches no nn.Linear; nearest layers: .*mlp") as err:
        select_layers(model, "model.layers.0.mlp.gate")
    assert "\n" not in str(err.value)


def autograd_reference(model, batches, name):
    """Per-batch gradients by autograd, and the kept tokens' inputs x and output gradients delta by plain hooks."""
    mod = dict(model.named_modules())[name]
    Gs, xs, ds = [], [], []
    for b in batches:
        cap = {}
        h = mod.register_forward_hook(lambda m, i, o: cap.update(x=i[0], y=o))
        out = model(**b)
        h.remove()
        G, dy = torch.autograd.grad(out.loss, [mod.weight, cap["y"]])
        keep = b["attention_mask"].bool()
        Gs.append(G)
        xs.append(cap["x"][keep].detach())  # (T_i, m)
        ds.append(dy[keep])  # (T_i, n)
    return torch.stack(Gs), xs, ds  # (k, n, m)


#: the layers whose statistics are checked against autograd (both shapes of each model)
CHECKED_LAYERS = {"llama": r"model\.layers\.1\.(mlp\.(up|down)_proj|self_attn\.(q|k)_proj)",
                  "bert": r"bert\.encoder\.layer\.0\.(attention\.self\.query|intermediate\.dense)"}


def check_statistics_equal_autograd(kind, cache_dir, stats=None) -> dict[str, float]:
    """Every statistic of :func:`collect_calibration` against an autograd / float64 reference.

    The code sums in float32 per batch (the weight gradient over the batch's B*T positions,
    X^T X and delta^T delta over its kept tokens) and adds batches in float64, so every
    comparison is a float32 sum of at most ``L = B*T`` terms (``float32_tol``) scaled by the
    magnitude of its summands. Returns the worst ratio error / allowed per statistic.
    """
    model = tiny_llama() if kind == "llama" else tiny_bert()
    batches = lm_batches() if kind == "llama" else bert_batches()
    layers = CHECKED_LAYERS[kind]
    names = select_layers(model, layers)
    if stats is None:  # else: statistics collected elsewhere (e.g. by several processes) on these batches
        stats = collect_calibration(model, batches, layers, cache_dir=cache_dir)
    L = max(b["input_ids"].numel() for b in batches)  # positions per batch: the longest float32 sum
    k = len(batches)
    margins: dict[str, float] = {}

    def check(stat, got, ref, **kw):
        margins[stat] = max(margins.get(stat, 0.0), assert_close_f32(got, ref, what=f"{n} {stat}", **kw))

    for n in names:
        G, xs, ds = autograd_reference(model, batches, n)
        # G_i = sum_t delta_t x_t^T over the batch; padded positions have delta = 0
        scale = torch.stack([abs_sum_scale(d, x) for d, x in zip(ds, xs)])  # (k, n, m)
        check("grads", stats.grads(n), G, length=L, scale=scale)
        Gs = torch.from_numpy(np.array(stats.grads(n))).double()  # (k, n, m) as stored
        check("diag_fisher", stats.diag_fisher(n), (Gs ** 2).mean(0), length=k, scale=(Gs ** 2).mean(0))
        X = torch.cat(xs).double()  # (T, m)
        check("abs_mean", stats.input_abs_mean(n), X.abs().mean(0), length=L, scale=X.abs().mean(0))
        xxt = X.T @ X  # (m, m)
        check("xxt", stats.xxt(n), xxt, length=L, scale=gram_scale(xxt))
        ref = kfac_factors(xs, ds, num_batches=k)
        got = stats.kfac(n)
        check("kfac_A", got.A, ref.A, length=L, scale=gram_scale(ref.A))
        check("kfac_B", got.B, ref.B, length=L, scale=gram_scale(ref.B))
        assert stats.layers[n]["tokens"] == X.shape[0]
    assert all(p.requires_grad for p in model.parameters())  # flags restored
    return margins


@pytest.mark.parametrize("kind", ["llama", "bert"])
def test_gradients_and_statistics_equal_autograd(kind, tmp_path):
    check_statistics_equal_autograd(kind, tmp_path)


def test_cache_reused_only_on_identical_configuration(tmp_path):
    model = tiny_llama()
    batches = lm_batches()
    layers = "model.layers.0.mlp.*"
    s1 = collect_calibration(model, batches, layers, cache_dir=tmp_path)
    assert not s1.from_cache
    s2 = collect_calibration(model, batches, layers, cache_dir=tmp_path)
    assert s2.from_cache and s2.key == s1.key and s2.dir == s1.dir
    # every change of configuration gives a new entry
    changed = [
        dict(model=model, batches=batches[:2], layers=layers),
        dict(model=model, batches=batches, layers="model.layers.1.mlp.*"),
        dict(model=model, batches=batches, layers=layers, seed=1),
        dict(model=model, batches=lm_batches(seed=5), layers=layers),
        dict(model=tiny_llama(seed=1), batches=batches, layers=layers),
    ]
    keys = {s1.key}
    for kw in changed:
        s = collect_calibration(kw.pop("model"), kw.pop("batches"), kw.pop("layers"), cache_dir=tmp_path, **kw)
        assert not s.from_cache
        keys.add(s.key)
    assert len(keys) == len(changed) + 1


def test_corrupt_or_mismatched_cache_is_recomputed(tmp_path):
    model = tiny_llama()
    batches = lm_batches()
    s1 = collect_calibration(model, batches, "model.layers.0.mlp.up_proj", cache_dir=tmp_path)
    good = s1.grads("model.layers.0.mlp.up_proj").copy()
    f = s1.grads_path("model.layers.0.mlp.up_proj")
    raw = bytearray(f.read_bytes())
    raw[-8:] = b"\xff" * 8  # flip the last two float32 values into NaN, same size
    f.write_bytes(bytes(raw))
    s2 = collect_calibration(model, batches, "model.layers.0.mlp.up_proj", cache_dir=tmp_path)
    assert not s2.from_cache
    np.testing.assert_array_equal(s2.grads("model.layers.0.mlp.up_proj"), good)
    # a manifest of another configuration in the right folder is never used
    man = json.loads((s2.dir / "manifest.json").read_text())
    man["key"] = "0" * 32
    (s2.dir / "manifest.json").write_text(json.dumps(man))
    s3 = collect_calibration(model, batches, "model.layers.0.mlp.up_proj", cache_dir=tmp_path)
    assert not s3.from_cache
    (s3.dir / "manifest.json").write_text("{not json")
    assert not collect_calibration(model, batches, "model.layers.0.mlp.up_proj", cache_dir=tmp_path).from_cache
    assert collect_calibration(model, batches, "model.layers.0.mlp.up_proj", cache_dir=tmp_path).from_cache


def test_nan_gradient_names_layer_and_batch_and_caches_nothing(tmp_path):
    model = tiny_llama()
    batches = lm_batches()
    name = "model.layers.1.mlp.down_proj"
    mod = dict(model.named_modules())[name]
    calls = {"n": 0}

    def poison(m, grad_in, grad_out):  # NaN into the weight gradient on the second batch only
        calls["n"] += 1
        if calls["n"] == 2:
            return (grad_in[0] * float("nan"),)
    mod.register_full_backward_hook(poison)
    with pytest.raises(FisherkronError) as err:
        collect_calibration(model, batches, r"model\.layers\.\d\.mlp\.down_proj", cache_dir=tmp_path)
    msg = str(err.value)
    assert "\n" not in msg and "batch 1" in msg and "NaN" in msg
    assert "model.layers.0.mlp.down_proj" in msg  # NaN flows back to the earlier layer too
    assert not [p for p in tmp_path.iterdir()]  # no cache entry, no temporary leftovers


def test_uncached_statistics_clean_up_after_themselves(tmp_path):
    import gc
    st = collect_calibration(tiny_llama(), lm_batches(), "model.layers.0.mlp.up_proj", cache=False,
                             cache_dir=tmp_path)
    folder = st.dir
    assert folder.exists() and st.grads("model.layers.0.mlp.up_proj").shape == (3, 40, 24)
    del st
    gc.collect()
    assert not folder.exists()


@pytest.mark.parametrize("kind", ["llama", "bert"])
def test_token_granularity_stores_each_tokens_input_and_output_gradient(kind, tmp_path):
    """granularity='token': X and D are the kept tokens' x_t and delta_t (autograd), their
    rank-one gradients sum to each batch's G_i, and MFF runs on them matrix-free."""
    from fisherkron.core.operators import TokenFisher

    model = tiny_llama() if kind == "llama" else tiny_bert()
    batches = lm_batches() if kind == "llama" else bert_batches()
    layers = CHECKED_LAYERS[kind]
    st = collect_calibration(model, batches, layers, cache_dir=tmp_path, granularity="token")
    L = max(b["input_ids"].numel() for b in batches)
    for n in select_layers(model, layers):
        G, xs, ds = autograd_reference(model, batches, n)
        op = st.gradients(n)
        assert isinstance(op, TokenFisher) and op.k == st.layers[n]["tokens"] == sum(x.shape[0] for x in xs)
        X, D = torch.cat(xs), torch.cat(ds)  # (T, m), (T, n)
        assert_close_f32(op.X, X, what=f"{n} X", length=1, scale=X.abs())
        assert_close_f32(op.D, D, what=f"{n} D", length=1, scale=D.abs())
        # sum over a batch's tokens of delta_t x_t^T is the batch gradient
        at = 0
        for i, x in enumerate(xs):
            Gi = op.D[at:at + x.shape[0]].double().T @ op.X[at:at + x.shape[0]].double()
            assert_close_f32(Gi, G[i], what=f"{n} sum_t G_t", length=L, scale=abs_sum_scale(ds[i], x))
            at += x.shape[0]
        res = st.kronecker(n)
        assert res["A"].shape == (op.m, op.m) and res["B"].shape == (op.n, op.n) and 0 < res["fisher_share"] <= 1
    assert not list(tmp_path.rglob("*.grads.npy"))  # nothing n x m is stored


def test_sequence_granularity_gives_one_gradient_per_sequence(tmp_path):
    """granularity='sequence': k x B gradients, each the gradient of one sequence's loss (autograd)."""
    from fisherkron.hf.calibration import split_sequences

    model, batches = tiny_llama(), lm_batches(k=2, B=3)
    name = "model.layers.1.mlp.down_proj"
    st = collect_calibration(model, batches, name, cache_dir=tmp_path, granularity="sequence")
    assert st.k == 6 and st.granularity == "sequence"
    seqs = split_sequences(batches)
    G, xs, ds = autograd_reference(model, seqs, name)
    got = torch.from_numpy(np.array(st.grads(name)))
    assert_close_f32(got, G, what="per-sequence grads", length=9,
                     scale=torch.stack([abs_sum_scale(d, x) for d, x in zip(ds, xs)]))
    # equal-length sequences: a batch's mean-loss gradient is the mean of its sequences' gradients
    Gb, _, _ = autograd_reference(model, batches, name)
    torch.testing.assert_close(got.view(2, 3, *got.shape[1:]).double().mean(1), Gb.double(),
                               rtol=0, atol=1e-5 * float(Gb.abs().max()))


@pytest.mark.parametrize("grad_dtype", ["bfloat16", "float16"])
def test_half_precision_gradients_round_trip_and_keep_the_factors(grad_dtype, tmp_path):
    """16-bit gradient storage: half the bytes, the same gradients within one rounding of the format,
    and MFF factors close to those of float32 gradients (the measured gap is what the README reports)."""
    from fisherkron.core.operators import GradientStack
    from fisherkron.testing import rel_error

    model, batches = tiny_llama(), lm_batches(k=4)
    name = "model.layers.1.mlp.up_proj"
    f32 = collect_calibration(model, batches, name, cache_dir=tmp_path / "a")
    half = collect_calibration(model, batches, name, cache_dir=tmp_path / "b", grad_dtype=grad_dtype)
    assert half.key != f32.key and half.grad_dtype == grad_dtype
    assert half.grads_path(name).stat().st_size < 0.55 * f32.grads_path(name).stat().st_size
    with pytest.raises(FisherkronError, match="read them with stats.gradients"):
        half.grads(name)
    G32 = torch.from_numpy(np.array(f32.grads(name)))
    G16 = GradientStack(half.gradients(name)).stacked()
    rel = 2.0 ** -8 if grad_dtype == "bfloat16" else 2.0 ** -11
    for a, b in zip(G32, G16):
        assert float((a - b).abs().max()) <= rel * float(a.abs().max())
    a, b = f32.kronecker(name), half.kronecker(name)
    assert rel_error(torch.kron(b["A"], b["B"]), torch.kron(a["A"], a["B"])) < 10 * rel


def test_bad_granularity_and_grad_dtype_are_one_line(tmp_path):
    model, batches = tiny_llama(), lm_batches(k=1)
    with pytest.raises(FisherkronError, match="granularity 'word' is unknown"):
        collect_calibration(model, batches, cache_dir=tmp_path, granularity="word")
    with pytest.raises(FisherkronError, match="grad_dtype 'int8' is unknown"):
        collect_calibration(model, batches, cache_dir=tmp_path, grad_dtype="int8")
    with pytest.raises(FisherkronError, match="leave grad_dtype"):
        collect_calibration(model, batches, cache_dir=tmp_path, granularity="token", grad_dtype="bfloat16")
