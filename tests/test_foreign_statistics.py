"""Statistics belong to the whole model they were collected on: compression refuses another model's.

* the statistics carry the record of every parameter and buffer, the class and the config from
  their cache key (:func:`~fisherkron.hf.calibration.keys.model_record`); ``compress``,
  ``compress_basis_sharing`` and ``learn_truncation`` refuse, in one line naming the first
  difference, statistics of a model that differs anywhere: outside the selected layers too (its
  norms, embeddings, head, a buffer, a config field that changes what it computes);
* a model saved and loaded again, or one whose config differs only in where it came from, is the
  same model;
* the check costs one hash of the model, and the collection hashes it once for both the key and
  the record;
* statistics of an earlier version (a fingerprint without the record) are checked against it;
  statistics that record no model are refused.
"""
import copy
import dataclasses

import pytest
import torch
from transformers import LlamaForCausalLM

import fisherkron as fk
from fisherkron.hf.basis_sharing import compress_basis_sharing
from fisherkron.hf.calibration import collect_calibration, keys, model_fingerprint
from fisherkron.hf.truncation import learn_truncation
from tiny_models import tiny_llama, token_batches

LAYERS = "model.layers.0.mlp.*"
#: parts of the model outside the selected layers; the last is a buffer
OUTSIDE = ["model.norm.weight", "model.embed_tokens.weight", "lm_head.weight",
           "model.layers.1.input_layernorm.weight", "model.rotary_emb.inv_freq"]


def _one_line(exc_info) -> str:
    msg = str(exc_info.value)
    assert "\n" not in msg and isinstance(exc_info.value, fk.FisherkronError)
    return msg


def _changed(model, part: str):
    """A copy of ``model`` whose tensor ``part`` (a parameter or buffer) is scaled by 1.5."""
    other = copy.deepcopy(model)
    with torch.no_grad():
        dict(list(other.named_parameters()) + list(other.named_buffers()))[part].mul_(1.5)
    return other


def _factorised(model) -> bool:
    return any(isinstance(m, fk.LowRankLinear) for m in model.modules())


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    """A tiny Llama and its statistics of every projection (X X^T: SVD-LLM and basis sharing read it)."""
    model = tiny_llama()
    return model, collect_calibration(model, token_batches(k=3), None, stats=("xxt",),
                                      cache_dir=tmp_path_factory.mktemp("cal"))


@pytest.mark.parametrize("part", OUTSIDE)
def test_compress_refuses_statistics_of_a_model_that_differs_outside_the_selected_layers(part, calibrated):
    base, st = calibrated
    other = _changed(base, part)
    with pytest.raises(fk.FisherkronError) as err:
        fk.compress(other, "svd_llm", st, LAYERS, rank=2)
    msg = _one_line(err)
    assert f"(first: {part})" in msg and "collect them again" in msg
    assert ("buffers differ" if part.endswith("inv_freq") else "parameters differ") in msg
    assert not _factorised(other)  # refused before any layer changed
    fk.compress(copy.deepcopy(base), "svd_llm", st, LAYERS, rank=2)  # the model they belong to


@pytest.mark.parametrize("part", ["model.norm.weight", "model.embed_tokens.weight"])
def test_compress_refuses_before_it_measures_an_allocation(part, calibrated, tmp_path, monkeypatch):
    base, st = calibrated
    from fisherkron.hf import surgery

    def measured(*args, **kwargs):
        raise AssertionError("the allocation ran on statistics of another model")
    monkeypatch.setattr(surgery, "allocate", measured)
    with pytest.raises(fk.FisherkronError) as err:
        fk.compress(_changed(base, part), "svd_llm", st, LAYERS, ratio=0.05, allocation="sensitivity",
                    allocation_options={"heldout": token_batches(k=1, seed=7), "cache_dir": tmp_path})
    assert f"(first: {part})" in _one_line(err)


@pytest.mark.parametrize("part", ["model.norm.weight", "model.embed_tokens.weight"])
def test_basis_sharing_refuses_statistics_of_a_model_that_differs_outside_its_groups(part, calibrated):
    base, st = calibrated
    other = _changed(base, part)
    with pytest.raises(fk.FisherkronError) as err:
        compress_basis_sharing(other, st, 0.1)
    assert f"(first: {part})" in _one_line(err)
    assert not any(isinstance(m, fk.SharedBasisLinear) for m in other.modules())
    compress_basis_sharing(copy.deepcopy(base), st, 0.1)


@pytest.mark.parametrize("part", ["model.norm.weight", "lm_head.weight"])
def test_learned_truncation_refuses_statistics_of_a_model_that_differs_outside_the_layers(part, calibrated):
    base, st = calibrated
    other = _changed(base, part)
    with pytest.raises(fk.FisherkronError) as err:
        learn_truncation(other, "svd_llm", st, token_batches(k=2, seed=3), ratio=0.05, layers=LAYERS, steps=1)
    assert f"(first: {part})" in _one_line(err)
    assert not _factorised(other)


def test_a_config_field_that_changes_the_computation_is_named(calibrated):
    base, st = calibrated
    other = copy.deepcopy(base)
    other.config.rms_norm_eps = 1e-2
    with pytest.raises(fk.FisherkronError) as err:
        fk.compress(other, "svd_llm", st, LAYERS, rank=2)
    assert "config differs from this one's (first: rms_norm_eps)" in _one_line(err)


def test_another_class_is_named(calibrated):
    base, st = calibrated

    class Renamed(LlamaForCausalLM):
        pass

    other = copy.deepcopy(base)
    other.__class__ = Renamed
    with pytest.raises(fk.FisherkronError) as err:
        fk.compress(other, "svd_llm", st, LAYERS, rank=2)
    assert "a LlamaForCausalLM, not this Renamed" in _one_line(err)


def test_the_same_model_saved_and_loaded_again_is_accepted(calibrated, tmp_path):
    """Where it came from (its path, the saving library's version) or what its forward returns is no difference."""
    base, st = calibrated
    base.save_pretrained(tmp_path / "saved")
    loaded = LlamaForCausalLM.from_pretrained(tmp_path / "saved").eval()
    loaded.config.use_cache = not base.config.use_cache
    loaded.config.output_hidden_states = True
    assert model_fingerprint(loaded) != model_fingerprint(base)  # the cache key still tells them apart
    fk.compress(loaded, "svd_llm", st, LAYERS, rank=2)
    compress_basis_sharing(LlamaForCausalLM.from_pretrained(tmp_path / "saved").eval(), st, 0.1)


def test_a_changed_layer_is_still_named_by_the_per_layer_check(calibrated):
    base, st = calibrated
    name = "model.layers.0.mlp.up_proj"
    other = _changed(base, f"{name}.weight")
    st.check_weights(name, base.get_submodule(name))
    with pytest.raises(fk.FisherkronError, match=f"layer {name} were collected on other weights"):
        st.check_weights(name, other.get_submodule(name))
    with pytest.raises(fk.FisherkronError, match=f"first: {name}.weight"):
        st.check_model(other)


def test_the_same_model_in_two_folders_has_one_fingerprint(calibrated, tmp_path):
    """Scores, sweeps and fine-tuned models are keyed by it: a copy or another checkout finds them."""
    base, _ = calibrated
    for where in ("a", "b/c"):
        base.save_pretrained(tmp_path / where)
    a, b = (LlamaForCausalLM.from_pretrained(tmp_path / w).eval() for w in ("a", "b/c"))
    assert a.config._name_or_path != b.config._name_or_path
    assert model_fingerprint(a) == model_fingerprint(b)
    assert model_fingerprint(a, with_location=True) != model_fingerprint(b, with_location=True)


def test_the_model_is_hashed_once_to_collect_and_once_to_check(tmp_path, monkeypatch):
    model = tiny_llama()
    tensors = [t for _, t in list(model.named_parameters()) + list(model.named_buffers())]
    recorded, again = [], []
    record, plain = keys._tensor_buffer, keys._tensor_bytes

    def counted(t):
        recorded.append(t)
        return record(t)

    def other_hash(t):
        if any(t is u for u in tensors):
            again.append(t)
        return plain(t)

    monkeypatch.setattr(keys, "_tensor_buffer", counted)
    monkeypatch.setattr(keys, "_tensor_bytes", other_hash)
    st = collect_calibration(model, token_batches(k=2), LAYERS, stats=("xxt",), cache_dir=tmp_path)
    assert len(recorded) == len(tensors) and not again  # the key and the record the statistics carry: one pass
    recorded.clear()
    st.check_model(model)
    assert len(recorded) == len(tensors)


def test_statistics_of_an_earlier_version_are_checked_against_their_fingerprint(calibrated):
    base, st = calibrated
    earlier = dataclasses.replace(st, config={**st.config, "model": model_fingerprint(base, with_location=True)})
    fk.compress(copy.deepcopy(base), "svd_llm", earlier, LAYERS, rank=2)
    with pytest.raises(fk.FisherkronError) as err:
        fk.compress(_changed(base, "model.norm.weight"), "svd_llm", earlier, LAYERS, rank=2)
    assert "earlier version" in _one_line(err)


def test_statistics_that_record_no_model_are_refused_in_one_line(calibrated):
    base, st = calibrated
    bare = dataclasses.replace(st, config={k: v for k, v in st.config.items() if k != "model"})
    with pytest.raises(fk.FisherkronError) as err:
        fk.compress(copy.deepcopy(base), "svd_llm", bare, LAYERS, rank=2)
    assert "do not record the model" in _one_line(err)
