"""Qwen2 and Gemma 3 decoders beside Llama: calibration, every method, allocations, Basis Sharing, save/reload.

Beside SmolLM2 (a Llama), the embedded decoders are Gemma 3 270M and Qwen2.5-0.5B; each brings what Llama
lacks:

* **Qwen2**: biases on ``q/k/v_proj``, grouped-query attention, an untied ``lm_head`` (a plain
  ``nn.Linear`` the default layers leave out: compressed only when named);
* **Gemma 3** (text): tied embeddings, sliding and full attention layers (``layer_types``, here a
  window shorter than the batches), ``q_norm`` / ``k_norm`` on the projections' outputs, one
  key/value head and ``heads * head_dim != hidden`` (non-square ``q`` and ``o`` projections).

Every test runs on tiny random configurations of the three (Llama the reference), with random
biases and norm scales so that a hook or a surgery that drops them shows, and calibration
batches with a padded row. The ``slow`` tests run the real embedded models.
"""
import copy
import importlib.util
import re

import fisherkron as fk  # before torch: sets OMP_WAIT_POLICY=PASSIVE when this file runs alone (make exports it)
import pytest
import torch
from torch import nn

from fisherkron.core.basis_sharing import SharedBasisLinear
from fisherkron.core.conventions import FisherkronError
from fisherkron.core.lowrank import LowRankLinear, lowrank_params
from fisherkron.core.methods import METHODS
from fisherkron.hf.basis_sharing import compress_basis_sharing
from fisherkron.hf.calibration import collect_calibration
from fisherkron.hf.registry import DEFAULT_LAYERS, EMBEDDED_MODELS
from fisherkron.hf.saving import load_compressed, save_compressed
from fisherkron.hf.surgery import compress, count_params
from fisherkron.testing import MODEL_F32_REL, RELOAD, abs_sum_scale, assert_close_f32, gram_scale

ARCHS = ("llama", "qwen2", "gemma3")
VOCAB = 101
T = 10  # tokens per sequence: longer than Gemma's sliding window
WINDOW = 4
PAD = 3  # padded positions at the end of the second sequence of every batch (< WINDOW: no query sees only pads)
RATIO = 0.2
MFF = dict(max_matvecs=30)  # MFF's iterations on the tiny layers: enough for a usable factor pair, fast
BLOCK_LINEARS = 14  # 2 blocks x (q, k, v, o, gate, up, down)


def tiny_decoder(arch: str, seed: int = 0) -> nn.Module:
    """A seeded random 2-block ``*ForCausalLM``, hidden 32, with random biases and norm scales (eval mode).

    ``llama``: 4 heads / 2 key-value heads, untied head. ``qwen2``: the same with q/k/v biases.
    ``gemma3``: 2 heads of 24 / 1 key-value head (q 48 x 32, k/v 24 x 32, o 32 x 48), a sliding
    then a full attention layer (window 4), tied embeddings.
    """
    from transformers import (Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM, Qwen2Config,
                              Qwen2ForCausalLM)

    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=56, num_hidden_layers=2,
                  max_position_embeddings=64)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common, num_attention_heads=4, num_key_value_heads=2,
                                             tie_word_embeddings=False))
    elif arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common, num_attention_heads=4, num_key_value_heads=2,
                                             tie_word_embeddings=False))
    elif arch == "gemma3":
        model = Gemma3ForCausalLM(Gemma3TextConfig(
            **common, num_attention_heads=2, num_key_value_heads=1, head_dim=24, query_pre_attn_scalar=24,
            sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"], tie_word_embeddings=True))
    else:
        raise ValueError(arch)
    with torch.no_grad():  # biases start at zero and norm scales at one (Gemma: zero): make both matter
        for name, p in model.named_parameters():
            if name.endswith(".bias") or "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
    return model.eval()


def batches(k: int = 3, seed: int = 0, B: int = 2) -> list[dict]:
    """``k`` batches of ``B`` sequences of ``T`` random tokens; the last ``PAD`` positions of sequence 1 are padding."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(k):
        x = torch.randint(1, VOCAB, (B, T), generator=g)
        mask = torch.ones_like(x)
        mask[1, T - PAD:] = 0
        out.append({"input_ids": x, "attention_mask": mask, "labels": x.masked_fill(mask == 0, -100)})
    return out


def block_linears(model: nn.Module) -> list[str]:
    """The ``nn.Linear`` layers the registry's decoder pattern names (model order): the blocks' projections."""
    return [n for n, m in model.named_modules()
            if isinstance(m, nn.Linear) and re.fullmatch(DEFAULT_LAYERS["decoder"], n)]


def logits(model: nn.Module, batch: dict) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits


def removed_share(rep) -> float:
    """``(params_before - params_after) / params_before``: one rounding, so that exactly 20 % removed reads as 0.2
    (``rep.ratio = 1 - after / before`` can read 0.19999999999999996 there)."""
    return (rep.params_before - rep.params_after) / rep.params_before


def check_head(model: nn.Module, base: nn.Module, arch: str) -> None:
    """Gemma's head stays tied to its embeddings; the others' untied head stays a dense, unchanged ``nn.Linear``."""
    head, emb = model.lm_head, model.model.embed_tokens
    assert type(head) is nn.Linear
    if arch == "gemma3":
        assert head.weight is emb.weight
    else:
        assert head.weight.data_ptr() != emb.weight.data_ptr()
        assert torch.equal(head.weight, base.lm_head.weight)


def check_biases(model: nn.Module, base: nn.Module, arch: str) -> None:
    """Each factorised layer keeps its original bias exactly (Qwen's q/k/v), or has none."""
    mods, base_mods = dict(model.named_modules()), dict(base.named_modules())
    with_bias = 0
    for name, mod in mods.items():
        if isinstance(mod, (LowRankLinear, SharedBasisLinear)):
            b = base_mods[name].bias
            assert (mod.second.bias is None) == (b is None), name
            if b is not None:
                assert torch.equal(mod.second.bias, b), name
                with_bias += 1
    if arch == "qwen2":
        assert with_bias > 0


@pytest.fixture(scope="module", params=ARCHS)
def calibrated(request, tmp_path_factory):
    """``(arch, model, stats)``: every statistic of the default layers on :func:`batches`."""
    model = tiny_decoder(request.param)
    stats = collect_calibration(model, batches(), None, cache_dir=tmp_path_factory.mktemp("cal"))
    return request.param, model, stats


# ----------------------------------------------------------------------------- the tiny models are what they claim

def test_the_tiny_models_have_the_features_under_test():
    qwen, gemma = tiny_decoder("qwen2"), tiny_decoder("gemma3")
    q = qwen.model.layers[0].self_attn
    assert q.q_proj.bias is not None and q.k_proj.weight.shape == (16, 32) and q.o_proj.bias is None
    assert qwen.lm_head.weight.data_ptr() != qwen.model.embed_tokens.weight.data_ptr()
    g = gemma.model.layers[0].self_attn
    assert g.q_proj.weight.shape == (48, 32) and g.k_proj.weight.shape == (24, 32) and g.o_proj.weight.shape == (32, 48)
    assert gemma.lm_head.weight is gemma.model.embed_tokens.weight
    assert gemma.config.layer_types == ["sliding_attention", "full_attention"]
    # the window matters on these batches: the same weights with a window wider than the batches differ
    cfg = copy.deepcopy(gemma.config)
    cfg.sliding_window = 2 * T
    wide = type(gemma)(cfg).eval()
    wide.load_state_dict(gemma.state_dict())
    b = batches(k=1)[0]
    assert (logits(wide, b) - logits(gemma, b)).abs().max() > 1e-3
    cfg.sliding_window = T  # as wide as the batches: the window hides nothing, the logits are the same
    same = type(gemma)(cfg).eval()
    same.load_state_dict(gemma.state_dict())
    torch.testing.assert_close(logits(same, b), logits(wide, b), **RELOAD)


# ----------------------------------------------------------------------------- statistics against hooks

def hooked_reference(model: nn.Module, batches_: list[dict], name: str):
    """Per batch: autograd's ``G_i = dL_i/dW``, and the kept tokens' inputs ``x_t`` and output gradients
    ``delta_t`` of layer ``name`` seen by plain hooks (float64)."""
    mod = model.get_submodule(name)
    Gs, xs, ds = [], [], []
    for b in batches_:
        cap = {}
        hook = mod.register_forward_hook(lambda m, i, o: cap.update(x=i[0], y=o))
        try:
            out = model(**b)
        finally:
            hook.remove()
        G, dy = torch.autograd.grad(out.loss, [mod.weight, cap["y"]])  # (n, m), (B, T, n)
        keep = b["attention_mask"].bool()
        Gs.append(G)
        xs.append(cap["x"][keep].detach().double())  # (T_i, m)
        ds.append(dy[keep].double())  # (T_i, n)
    return torch.stack(Gs), xs, ds  # (k, n, m)


#: the layers checked: q (Qwen: with bias; Gemma: before q_norm), k (GQA shape) of the first block (Gemma:
#: sliding), o and down of the second (Gemma: full attention)
CHECKED = ("model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj", "model.layers.1.self_attn.o_proj",
           "model.layers.1.mlp.down_proj")


def test_statistics_equal_a_float64_recomputation_from_hooks(calibrated):
    """``G_i``, ``E[G o G]``, ``mean |x|``, ``X X^T`` and K-FAC's ``A = X X^T / T``,
    ``B = (1/k) sum_t delta_t delta_t^T`` of the layers :data:`CHECKED`, from the padded batches.

    The code sums in float32 per batch (``L = B T`` terms) and adds batches in float64; each
    comparison's tolerance is that float32 round-off, scaled by its summands (``fisherkron.testing``).
    """
    arch, model, st = calibrated
    data = batches()
    L, k = data[0]["input_ids"].numel(), len(data)
    for name in CHECKED:
        G, xs, ds = hooked_reference(model, data, name)
        X, D = torch.cat(xs), torch.cat(ds)  # (T, m), (T, n): the kept tokens of all batches
        assert st.layers[name]["tokens"] == X.shape[0] == k * (L - PAD)
        # the hooks see what the gradient is made of: G_i = sum_t delta_t x_t^T (the bias and the norms aside)
        for Gi, x, d in zip(G, xs, ds):
            assert_close_f32(Gi, d.T @ x, length=L, scale=abs_sum_scale(d, x), what=f"{arch} {name} G_i = D^T X")
        scale = torch.stack([abs_sum_scale(d, x) for d, x in zip(ds, xs)])  # (k, n, m)
        assert_close_f32(st.grads(name), G, length=L, scale=scale, what=f"{arch} {name} grads")
        Gs = torch.from_numpy(st.grads(name).copy()).double()  # (k, n, m) as stored
        assert_close_f32(st.diag_fisher(name), (Gs ** 2).mean(0), length=k, scale=(Gs ** 2).mean(0),
                         what=f"{arch} {name} diag_fisher")
        assert_close_f32(st.input_abs_mean(name), X.abs().mean(0), length=L, scale=X.abs().mean(0),
                         what=f"{arch} {name} abs_mean")
        XXt = X.T @ X  # (m, m)
        assert_close_f32(st.xxt(name), XXt, length=L, scale=gram_scale(XXt), what=f"{arch} {name} xxt")
        A, B = XXt / X.shape[0], D.T @ D / k  # (m, m), (n, n)
        f = st.kfac(name)
        assert_close_f32(f.A, A, length=L, scale=gram_scale(A), what=f"{arch} {name} kfac A")
        assert_close_f32(f.B, B, length=L, scale=gram_scale(B), what=f"{arch} {name} kfac B")
    assert all(p.requires_grad for p in model.parameters())  # the collection put the flags back


# ----------------------------------------------------------------------------- every method

@pytest.mark.parametrize("method", list(METHODS))
def test_every_method_compresses_exactly_the_block_linears(method, calibrated):
    arch, base, st = calibrated
    model = copy.deepcopy(base)
    names = block_linears(base)
    assert len(names) == BLOCK_LINEARS and "lm_head" not in names and list(st.layers) == names
    rep = compress(model, method, st, ratio=RATIO, mff_options=MFF)
    assert removed_share(rep) >= RATIO and rep.layers_ratio > RATIO
    low = {n: m for n, m in model.named_modules() if isinstance(m, LowRankLinear)}
    assert list(low) == names == list(rep.ranks)
    mods = dict(base.named_modules())
    removed = sum(mods[n].weight.numel() + (mods[n].out_features if mods[n].bias is not None else 0)
                  - lowrank_params(m.out_features, m.in_features, m.rank, m.second.bias is not None)
                  for n, m in low.items())
    assert rep.params_after == count_params(model) == count_params(base) - removed
    check_biases(model, base, arch)
    check_head(model, base, arch)
    b = batches(k=1)[0]
    out = logits(model, b)
    assert out.shape == (2, T, VOCAB) and torch.isfinite(out).all()


@pytest.mark.parametrize("arch", ARCHS)
def test_full_rank_factorisation_keeps_the_logits(arch):
    """Every block linear at full rank (bias in ``second``): the model computes what it did, up to round-off."""
    base = tiny_decoder(arch)
    model = copy.deepcopy(base)
    mods = dict(base.named_modules())
    ranks = {n: min(mods[n].weight.shape) for n in block_linears(base)}
    compress(model, "svd", ranks=ranks, skip_unprofitable=False)
    assert sum(isinstance(m, LowRankLinear) for m in model.modules()) == BLOCK_LINEARS
    b = batches(k=1)[0]
    want, got = logits(base, b), logits(model, b)
    assert float((got - want).abs().max()) <= MODEL_F32_REL * float(want.abs().max())


@pytest.mark.parametrize("arch", ARCHS)
def test_the_head_is_compressed_only_when_named_and_a_tied_one_never(arch, caplog):
    base = tiny_decoder(arch)
    model = copy.deepcopy(base)
    compress(model, "svd", rank=4)  # the default layers
    check_head(model, base, arch)
    model = copy.deepcopy(base)
    if arch == "gemma3":
        with pytest.raises(FisherkronError, match="tied embeddings") as err:
            compress(model, "svd", layers="lm_head", rank=4)
        assert "\n" not in str(err.value) and type(model.lm_head) is nn.Linear
        compress(model, "svd", layers="*", rank=4)  # every nn.Linear: the tied head is left out, with a warning
        assert "tied embeddings" in caplog.text
        check_head(model, base, arch)
        assert sum(isinstance(m, LowRankLinear) for m in model.modules()) == BLOCK_LINEARS
    else:
        rep = compress(model, "svd", layers=[DEFAULT_LAYERS["decoder"], "lm_head"], rank=4)
        assert isinstance(model.lm_head, LowRankLinear) and "lm_head" in rep.ranks
        assert sum(isinstance(m, LowRankLinear) for m in model.modules()) == BLOCK_LINEARS + 1
        assert torch.equal(model.model.embed_tokens.weight, base.model.embed_tokens.weight)
        assert torch.isfinite(logits(model, batches(k=1)[0])).all()


# ----------------------------------------------------------------------------- allocations

@pytest.mark.parametrize("strategy", ["uniform", "fisher", "calibrated"])
def test_allocations_meet_the_ratio_on_the_block_linears(strategy, calibrated, tmp_path):
    arch, base, st = calibrated
    model = copy.deepcopy(base)
    opts = {"heldout": batches(k=2, seed=9), "cache_dir": tmp_path} if strategy == "calibrated" else None
    rep = compress(model, "kfac_svd", st, ratio=RATIO, allocation=strategy, allocation_options=opts, mff_options=MFF)
    assert rep.allocation == strategy and removed_share(rep) >= RATIO
    if strategy != "uniform":  # the knapsack meets the budget to within one rank step of one layer
        step = max(lr.n + lr.m for lr in rep.layers.values())
        assert rep.ratio < RATIO + step / rep.params_before
    names = block_linears(base)
    assert list(rep.layers) == names
    for n, lr in rep.layers.items():
        assert isinstance(model.get_submodule(n), nn.Linear if lr.skipped else LowRankLinear), n
    assert count_params(model) == rep.params_after
    check_biases(model, base, arch)
    check_head(model, base, arch)
    b = batches(k=1)[0]
    assert torch.isfinite(logits(model, b)).all()
    loaded = load_compressed(save_compressed(model, tmp_path / "m", report=rep))
    torch.testing.assert_close(logits(loaded, b), logits(model, b), **RELOAD)


# ----------------------------------------------------------------------------- Basis Sharing

@pytest.mark.parametrize("shared", [None, ("q", "k", "v", "up", "gate")], ids=["gqa-default", "shared-kv"])
def test_basis_sharing_groups_each_architecture(shared, calibrated, tmp_path):
    """All three are GQA models (the authors' choice then shares q, up, gate); sharing k and v too, on their
    narrow GQA shapes (and Qwen's biases), works as well. Each group's layers hold one basis module."""
    arch, base, st = calibrated
    model = copy.deepcopy(base)
    rep = compress_basis_sharing(model, st, RATIO, shared=shared)
    want = ("q", "gate", "up") if shared is None else ("q", "k", "v", "gate", "up")
    assert rep.shared == want and removed_share(rep) >= RATIO
    assert rep.params_after == count_params(model)
    mods, base_mods = dict(model.named_modules()), dict(base.named_modules())
    for g in rep.groups:
        layers = [mods[n] for n in g["layers"]]
        assert all(isinstance(m, SharedBasisLinear) for m in layers)
        assert len(layers) == (2 if g["type"] in want else 1)
        assert all(m.first is layers[0].first for m in layers)
        assert all(m.out_features == base_mods[n].out_features for n, m in zip(g["layers"], layers))
    assert sorted(n for g in rep.groups for n in g["layers"]) == sorted(block_linears(base))
    check_biases(model, base, arch)
    check_head(model, base, arch)
    b = batches(k=1)[0]
    out = logits(model, b)
    assert torch.isfinite(out).all()
    loaded = load_compressed(save_compressed(model, tmp_path / "bs", report=rep))
    torch.testing.assert_close(logits(loaded, b), out, **RELOAD)
    assert count_params(loaded) == rep.params_after
    check_head(loaded, base, arch)


# ----------------------------------------------------------------------------- save -> reload

def tiny_tokenizer():
    """A word-level tokenizer over the tiny vocabulary: ``w1 .. w100`` are ids 1 .. 100, ``<eos>`` is 0."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<eos>": 0, **{f"w{i}": i for i in range(1, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<eos>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<eos>")


def plain_tokenizer(model: nn.Module, tok, folder):
    """What transformers loads as the tokenizer of a plain folder of ``model`` and ``tok``.

    The reference of a reloaded tokenizer: for some model types (``qwen2`` among them) transformers
    takes the tokenizer class from the model's config, not from ``tokenizer_config.json``.
    """
    from transformers import AutoTokenizer

    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return AutoTokenizer.from_pretrained(folder)


def test_save_and_reload_give_identical_logits(calibrated, tmp_path):
    arch, base, st = calibrated
    model = copy.deepcopy(base)
    rep = compress(model, "gfwsvd", st, ratio=RATIO, mff_options=MFF)
    tok = tiny_tokenizer()
    b = batches(k=1)[0]
    ref = logits(model, b)
    out = save_compressed(model, tmp_path / "c", report=rep, tokenizer=tok)
    loaded, tok2 = load_compressed(out, return_tokenizer=True)
    via_registry, tok3 = fk.load_model(str(out))
    text = "w3 w17 w99 w5"
    want = plain_tokenizer(base, tok, tmp_path / "plain")
    if arch != "qwen2":
        assert want(text)["input_ids"] == tok(text)["input_ids"] == [3, 17, 99, 5]
    for m, t in ((loaded, tok2), (via_registry, tok3)):
        assert type(m) is type(model)
        torch.testing.assert_close(logits(m, b), ref, **RELOAD)
        assert [n for n, x in m.named_modules() if isinstance(x, LowRankLinear)] == list(rep.ranks)
        assert count_params(m) == rep.params_after
        check_biases(m, base, arch)
        check_head(m, base, arch)
        assert type(t) is type(want) and t(text)["input_ids"] == want(text)["input_ids"]
    # the merged form is a plain folder of the real model type, which transformers itself loads
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(save_compressed(model, tmp_path / "merged", merged=True)).eval()
    assert type(merged) is type(model)
    assert float((logits(merged, b) - ref).abs().max()) <= MODEL_F32_REL * float(ref.abs().max())
    check_head(merged, base, arch)


# ----------------------------------------------------------------------------- the real embedded models

REAL = {"gemma3-270m": ("Gemma3ForCausalLM", 18), "qwen2.5-0.5b": ("Qwen2ForCausalLM", 24)}
#: the attention projections of the first block: regularising a Kronecker factor takes an eigendecomposition,
#: cubic in its side: Qwen's MLP factor (4864 x 4864) takes minutes on 2 cores where these (<= 1024) take seconds
REAL_LAYERS = r"model\.layers\.0\.self_attn\.(q|k|v|o)_proj"


def installed(name: str) -> bool:
    """Whether the packages of embedded model ``name`` are installed (its fp32 folder is made from them once)."""
    spec = EMBEDDED_MODELS[name]
    return all(importlib.util.find_spec(m) is not None for m in (spec.module, *(m for _, m, _ in spec.parts)))


@pytest.mark.slow
@pytest.mark.parametrize("method", ["gfwsvd", "kfac_svd"])
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.skipif(not installed(n), reason=f"{n} missing"))
                                  for n in REAL])
def test_real_decoder_compress_save_reload(name, method, tmp_path):
    """Load, calibrate on 2 batches of 2 x 64 C4 tokens, compress block 0's attention, save, reload: same logits."""
    model, tok = fk.load_model(name)
    cls, blocks = REAL[name]
    assert type(model).__name__ == cls and model.config.num_hidden_layers == blocks
    data = fk.lm_batches(tok, fk.c4_documents(), k=2, batch_size=2, seq_len=64)
    st = collect_calibration(model, data, REAL_LAYERS, methods=[method], cache_dir=tmp_path / "cal")
    assert len(st.layers) == 4
    mods = dict(model.named_modules())
    biases = {n: mods[n].bias.clone() for n in st.layers if mods[n].bias is not None}
    assert bool(biases) == (name == "qwen2.5-0.5b")  # Qwen: q, k, v
    head = model.lm_head.weight.clone()
    with torch.no_grad():
        before = float(model(**data[1]).loss)
    ranks = {n: min(mods[n].weight.shape) // 4 for n in st.layers}  # a quarter of the rank: half the parameters or less
    rep = compress(model, method, st, ranks=ranks)
    assert list(rep.ranks) == list(st.layers) and rep.ratio > 0
    for n, b in biases.items():
        assert torch.equal(model.get_submodule(n).second.bias, b)
    if name == "gemma3-270m":
        assert model.lm_head.weight is model.model.embed_tokens.weight
    else:
        assert type(model.lm_head) is nn.Linear and torch.equal(model.lm_head.weight, head)
    with torch.no_grad():
        after = float(model(**data[1]).loss)
    # a quarter of the rank on the attention of one block of 18 or 24 moves the loss a little, either way
    assert after != before and abs(after - before) < 0.1 * before, (before, after)
    x = {"input_ids": data[0]["input_ids"][:, :32], "attention_mask": data[0]["attention_mask"][:, :32]}
    ref = logits(model, x)
    out = save_compressed(model, tmp_path / "saved", report=rep, tokenizer=tok)
    loaded, tok2 = fk.load_model(str(out))
    assert type(loaded).__name__ == cls
    torch.testing.assert_close(logits(loaded, x), ref, **RELOAD)
    text = "Kronecker factors of the Fisher"
    assert tok2(text)["input_ids"] == tok(text)["input_ids"]
    if name == "gemma3-270m":
        assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
