"""Misuse of the API and of the files the package writes: nothing lost, nothing silently wrong.

Each case is a regression test on tiny random models (tests/tiny_models.py): a bad input is a
one-line FisherkronError raised before the expensive part, and no file the package did not
write is ever deleted. The command line has its own cases in tests/test_cli_robustness.py.
"""
import copy
import functools
import json
import logging
import os
import re
import signal

import numpy as np
import pytest
import torch
import transformers

import fisherkron as fk
from fisherkron.core.conventions import FisherkronError
from fisherkron.env import TMP_PREFIX, offline_advice, set_offline_env, stale_temporaries
from fisherkron.hf.calibration import collect_calibration
from fisherkron.hf.registry import load_model
from fisherkron.hf.saving import MANIFEST, load_compressed, save_compressed
from fisherkron.hf.surgery import compress
from fisherkron.testing import FLOAT64, MODEL_F32_REL, RELOAD
from tiny_models import tiny_bert, tiny_llama, token_batches


def _batches(vocab=97, k=3, B=2, T=8, seed=0):
    return token_batches(k=k, seed=seed, B=B, T=T, vocab=vocab)


def _one_line(exc) -> str:
    msg = str(exc.value)
    assert "\n" not in msg, msg
    return msg


@pytest.fixture
def saved(tmp_path):
    model = tiny_llama()
    compress(model, "svd", None, rank=2)
    out = save_compressed(model, tmp_path / "out")
    return model, out


# ---------------------------------------------------------------------------- 1. no data loss
def test_resaving_needs_overwrite_and_keeps_the_users_files(saved):
    model, out = saved
    (out / "NOTES.md").write_text("mine")
    with pytest.raises(FisherkronError, match="pass overwrite=True") as err:
        save_compressed(model, out)
    _one_line(err)
    assert (out / "NOTES.md").read_text() == "mine" and (out / MANIFEST).exists()
    model2 = copy.deepcopy(model)
    with torch.no_grad():
        model2.model.layers[0].mlp.up_proj.first.weight.mul_(2)
    save_compressed(model2, out, overwrite=True)
    assert (out / "NOTES.md").read_text() == "mine"
    x = _batches(k=1)[0]["input_ids"]
    with torch.no_grad():
        torch.testing.assert_close(load_compressed(out)(x).logits, model2(x).logits, **RELOAD)


def test_an_overwrite_removes_only_files_the_earlier_save_wrote(saved, tmp_path):
    model, out = saved
    tok_file = out / "tokenizer.json"
    meta = json.loads((out / MANIFEST).read_text())
    tok_file.write_text("{}")
    from fisherkron.env import file_checksum
    meta["files"]["tokenizer.json"] = {"size": 2, "blake2b": file_checksum(tok_file)}  # as if the first save had a tokenizer
    (out / MANIFEST).write_text(json.dumps(meta))
    (out / "mine.txt").write_text("keep")
    save_compressed(model, out, overwrite=True)  # no tokenizer this time
    assert not tok_file.exists() and (out / "mine.txt").read_text() == "keep"


@pytest.mark.parametrize("case", ["file", "foreign folder"])
def test_saving_onto_a_file_or_a_foreign_folder_is_refused_before_any_work(case, tmp_path, monkeypatch):
    model = tiny_llama()
    target = tmp_path / "t"
    if case == "file":
        target.write_text("data")
    else:
        target.mkdir()
        (target / "paper.pdf").write_text("x")
    monkeypatch.setattr(type(model), "save_pretrained", lambda *a, **k: pytest.fail("wrote before checking"))
    with pytest.raises(FisherkronError) as err:
        save_compressed(model, target, overwrite=True)
    assert ("is a file" if case == "file" else "not a fisherkron folder") in _one_line(err)
    assert (target.read_text() == "data") if case == "file" else (target / "paper.pdf").exists()


def test_a_failed_overwrite_leaves_the_earlier_save_loadable(saved, monkeypatch):
    model, out = saved
    before = sorted(p.name for p in out.iterdir())

    def boom(self, *a, **k):
        raise RuntimeError("disk full")
    monkeypatch.setattr(type(model), "save_pretrained", boom)
    with pytest.raises(RuntimeError, match="disk full"):
        save_compressed(model, out, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == before
    assert not [p for p in out.parent.iterdir() if p.name.startswith(TMP_PREFIX)]
    load_compressed(out)


# ---------------------------------------------------------------------------- 2. never silently wrong
def test_plain_transformers_refuses_a_factorised_folder_and_names_load_compressed(saved):
    _, out = saved
    with pytest.raises(ValueError, match="fisherkron.load_compressed"):
        transformers.AutoModelForCausalLM.from_pretrained(out)
    with pytest.raises(ValueError, match="fisherkron.load_compressed"):
        transformers.AutoConfig.from_pretrained(out)


@pytest.mark.parametrize("kind", ["llama", "bert"])
def test_merged_folder_loads_correctly_in_plain_transformers(kind, tmp_path):
    model = tiny_llama(tie_word_embeddings=True) if kind == "llama" else tiny_bert()
    compress(model, "svd", None, rank=3)
    x = torch.randint(1, 20, (2, 7))
    with torch.no_grad():
        ref = model(x).logits
    out = save_compressed(model, tmp_path / "merged", merged=True)
    assert sum(isinstance(m, fk.LowRankLinear) for m in model.modules()) > 0  # the model itself untouched
    auto = transformers.AutoModelForCausalLM if kind == "llama" else transformers.AutoModelForSequenceClassification
    plain = auto.from_pretrained(out).eval()
    with torch.no_grad():
        got = plain(x).logits  # (W2 W1) x instead of W2 (W1 x): float32 re-association only
        assert float((got - ref).abs().max()) <= MODEL_F32_REL * float(ref.abs().max())
        torch.testing.assert_close(load_compressed(out)(x).logits, plain(x).logits, **RELOAD)
    assert json.loads((out / MANIFEST).read_text())["form"] == "merged"


def _loss_scaled(model, batch, scale=1.0):
    return scale * model(**batch).loss


def test_cache_keys_differ_for_partials_and_lambdas_with_other_arguments(tmp_path):
    model, b = tiny_llama(), _batches()
    run = functools.partial(collect_calibration, model, b, "model.layers.0.mlp.up_proj", stats=("diag_fisher",),
                            cache_dir=tmp_path)
    one = run(loss_fn=functools.partial(_loss_scaled, scale=1.0))
    two = run(loss_fn=functools.partial(_loss_scaled, scale=2.0))
    assert one.key != two.key and not two.from_cache
    n = "model.layers.0.mlp.up_proj"
    assert torch.equal(two.diag_fisher(n), 4 * one.diag_fisher(n))  # a factor 2 on the loss scales exactly
    c1, c2 = 1.0, 3.0
    l1 = run(loss_fn=lambda m, x: c1 * m(**x).loss)
    l2 = run(loss_fn=lambda m, x: c2 * m(**x).loss)
    assert l1.key != l2.key
    again = run(loss_fn=functools.partial(_loss_scaled, scale=2.0))
    assert again.from_cache and again.key == two.key


def test_a_loss_that_cannot_be_keyed_is_refused_for_the_cache_but_runs_without_it(tmp_path):
    model, b = tiny_llama(), _batches()
    other = tiny_bert()  # captured state: no stable description

    def loss(m, x):
        return m(**x).loss + 0.0 * sum(p.sum() for p in other.parameters())
    with pytest.raises(FisherkronError, match="loss_name=") as err:
        collect_calibration(model, b, "model.layers.0.mlp.up_proj", stats=("diag_fisher",), loss_fn=loss,
                            cache_dir=tmp_path)
    _one_line(err)
    st = collect_calibration(model, b, "model.layers.0.mlp.up_proj", stats=("diag_fisher",), loss_fn=loss,
                             cache=False, cache_dir=tmp_path)
    assert st.k == 3
    named = collect_calibration(model, b, "model.layers.0.mlp.up_proj", stats=("diag_fisher",), loss_fn=loss,
                                loss_name="lm loss v1", cache_dir=tmp_path)
    assert named.from_cache is False


def test_statistics_of_another_model_are_refused_by_compress(tmp_path):
    a, b = tiny_llama(seed=0), tiny_llama(seed=1)
    st = collect_calibration(a, _batches(), "model.layers.0.mlp.*", methods=("fwsvd",), cache_dir=tmp_path)
    with pytest.raises(FisherkronError, match="collected on other weights") as err:
        compress(b, "fwsvd", st, rank=2)
    _one_line(err)
    assert not any(isinstance(m, fk.LowRankLinear) for m in b.modules())
    compress(a, "fwsvd", st, rank=2)  # the right model still works


@pytest.mark.parametrize("kw,what", [(dict(tol=-1e-3), "tol"), (dict(tol=float("nan")), "tol"),
                                     (dict(tol=0.0), "tol"), (dict(tol=2.0), "tol"),
                                     (dict(max_matvecs=0), "max_matvecs"), (dict(terms=0), "terms"),
                                     (dict(terms=1.5), "terms")])
def test_invalid_numbers_for_mff_are_refused(kw, what):
    with pytest.raises(FisherkronError, match=what) as err:
        fk.mff(torch.randn(4, 5, 3), **kw)
    _one_line(err)


@pytest.mark.parametrize("kw", [dict(min_alpha=float("nan")), dict(min_alpha=-1.0), dict(alpha=float("nan")),
                                dict(alpha=-0.5)])
def test_invalid_regularisation_numbers_are_refused(kw):
    A = torch.eye(3, dtype=torch.float64)
    with pytest.raises(FisherkronError, match="alpha") as err:
        fk.gfwsvd(torch.randn(4, 3, dtype=torch.float64), A, torch.eye(4, dtype=torch.float64), 2, **kw)
    _one_line(err)


@pytest.mark.parametrize("ratio", [0.0, 1.0, float("nan"), -0.2])
def test_invalid_ratios_are_refused(ratio):
    with pytest.raises(FisherkronError, match="ratio") as err:
        compress(tiny_llama(), "svd", None, ratio=ratio)
    _one_line(err)


# ---------------------------------------------------------------------------- 3. damaged files
def _damage(path, how):
    data = path.read_bytes()
    if how == "truncate":
        path.write_bytes(data[: len(data) // 2])
    elif how == "bitflip":
        i = len(data) - 9
        path.write_bytes(data[:i] + bytes([data[i] ^ 0x10]) + data[i + 1:])
    else:
        path.write_text("{ not json")


@pytest.mark.parametrize("fname,how", [("model.safetensors", "truncate"), ("model.safetensors", "bitflip"),
                                       ("config.json", "garbage"), (MANIFEST, "garbage"),
                                       (MANIFEST, "truncate")])
def test_a_damaged_saved_folder_is_one_line_error(saved, fname, how):
    _, out = saved
    _damage(out / fname, how)
    with pytest.raises(FisherkronError) as err:
        load_compressed(out)
    assert fname in _one_line(err) or MANIFEST in str(err.value)


def test_damaged_config_is_reported_even_without_checksums(saved):
    _, out = saved
    (out / "config.json").write_text("[1, 2]")
    with pytest.raises(FisherkronError, match="config.json") as err:
        load_compressed(out, verify=False)
    _one_line(err)


@pytest.mark.parametrize("how", ["truncate", "garbage"])
def test_a_damaged_gradient_file_is_one_line_error(tmp_path, how):
    f = tmp_path / "g.npy"
    np.save(f, np.random.default_rng(0).standard_normal((4, 5, 3)).astype(np.float32))
    _damage(f, how)
    with pytest.raises(FisherkronError, match="g.npy") as err:
        fk.mff(f)
    _one_line(err)
    np.save(f, np.array(["a", "b"]).reshape(1, 2, 1))
    with pytest.raises(FisherkronError, match="floats"):
        fk.mff(f)


def test_a_damaged_cache_entry_is_recomputed_not_served(tmp_path):
    model, b = tiny_llama(), _batches()
    st = collect_calibration(model, b, "model.layers.0.mlp.up_proj", stats=("grads",), cache_dir=tmp_path)
    g = st.grads_path("model.layers.0.mlp.up_proj")
    ref = np.array(np.load(g))
    _damage(g, "bitflip")
    again = collect_calibration(model, b, "model.layers.0.mlp.up_proj", stats=("grads",), cache_dir=tmp_path)
    assert not again.from_cache
    np.testing.assert_array_equal(np.load(again.grads_path("model.layers.0.mlp.up_proj")), ref)


# ---------------------------------------------------------------------------- 4. interruptions
@pytest.mark.parametrize("grad_dtype,granularity", [("float32", "batch"), ("float16", "batch"),
                                                    ("float32", "token")])
def test_sigterm_during_calibration_keeps_the_batches_done_and_a_rerun_resumes(grad_dtype, granularity, tmp_path):
    """SIGTERM (or Ctrl-C) finishes the batch under way, keeps the progress, and the same call resumes:
    only the remaining batches run again and the entry equals an uninterrupted one."""
    model, b = tiny_llama(), _batches(k=4)
    layers = r"model\.layers\.0\.mlp\..*"
    calls, armed = [], [True]

    def loss(m, x):
        calls.append(1)
        if armed[0] and len(calls) == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return m(**x).loss
    old = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    run = functools.partial(collect_calibration, model, b, layers, loss_fn=loss, loss_name="t",
                            grad_dtype=grad_dtype, granularity=granularity)
    with pytest.raises(KeyboardInterrupt, match="after batch 2 of 4"):
        run(cache_dir=tmp_path)
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == old
    (partial,) = list(tmp_path.iterdir())
    assert partial.name.endswith(".partial") and (partial / "progress.pt").exists()
    calls.clear()
    armed[0] = False
    st = run(cache_dir=tmp_path)
    assert len(calls) == 2  # batches 3 and 4 only
    assert [p.name for p in tmp_path.iterdir()] == [st.key] and not (st.dir / "progress.pt").exists()
    ref = collect_calibration(model, b, layers, loss_fn=loss, loss_name="t", grad_dtype=grad_dtype,
                              granularity=granularity, cache_dir=tmp_path / "ref")
    for name in st.layers:
        for stat in ("diag_fisher", "xxt", "ddt", "abs_mean"):
            np.testing.assert_array_equal(st._load(name, stat).numpy(), ref._load(name, stat).numpy())
        if granularity == "token":
            np.testing.assert_array_equal(st._load(name, "X").numpy(), ref._load(name, "X").numpy())
            np.testing.assert_array_equal(st._load(name, "D").numpy(), ref._load(name, "D").numpy())
        else:
            np.testing.assert_array_equal(np.load(st.grads_path(name)), np.load(ref.grads_path(name)))
        assert st.layers[name]["tokens"] == ref.layers[name]["tokens"]


def test_a_second_signal_stops_calibration_at_once_and_a_live_owner_is_respected(tmp_path, monkeypatch):
    model, b = tiny_llama(), _batches(k=3)
    calls = []

    def loss(m, x):
        calls.append(1)
        if len(calls) == 1:
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGTERM)  # the second one raises inside this batch
        return m(**x).loss
    with pytest.raises(KeyboardInterrupt, match="terminated by signal"):
        collect_calibration(model, b, "model.layers.0.mlp.up_proj", loss_fn=loss, loss_name="s", cache_dir=tmp_path)
    (partial,) = list(tmp_path.iterdir())
    assert not (partial / "progress.pt").exists()  # nothing finished: a rerun starts from batch 1
    # a folder another live process is filling is left alone (refused at once with waiting off)
    monkeypatch.setenv("FISHERKRON_CALIBRATION_WAIT", "0")
    (partial / "owner.pid").write_text(str(os.getppid()))
    with pytest.raises(FisherkronError, match=f"process {os.getppid()} is collecting this calibration"):
        collect_calibration(model, b, "model.layers.0.mlp.up_proj", loss_fn=loss, loss_name="s", cache_dir=tmp_path)


def test_stale_temporaries_of_dead_processes_are_reclaimed(tmp_path, caplog):
    dead = tmp_path / f"{TMP_PREFIX}999999999-abc-x"
    (dead / "sub").mkdir(parents=True)
    (dead / "sub" / "g.npy").write_bytes(b"0" * 4096)
    live = tmp_path / f"{TMP_PREFIX}{os.getpid()}-def-y"
    live.mkdir()
    assert stale_temporaries(tmp_path) == [dead]
    with caplog.at_level(logging.WARNING, logger="fisherkron"):
        collect_calibration(tiny_llama(), _batches(k=1), "model.layers.0.mlp.up_proj", stats=("diag_fisher",),
                            cache_dir=tmp_path)
    assert not dead.exists() and live.exists()
    assert any("reclaimed" in r.getMessage() for r in caplog.records)


# ---------------------------------------------------------------------------- 5. advice that works
def test_the_offline_advice_switches_off_every_switch_the_package_sets(monkeypatch):
    for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(v, raising=False)
    set_offline_env()  # what the package does on its own
    with pytest.raises(FisherkronError) as err:
        load_model("bert-base-uncased")
    msg = _one_line(err)
    assert "TRANSFORMERS_OFFLINE=1" in msg and "HF_HUB_OFFLINE=0 TRANSFORMERS_OFFLINE=0" in msg
    # follow the advice: the package no longer considers the hub off (the download itself then fails here)
    for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.setenv(v, "0")
    set_offline_env()
    from fisherkron.env import hub_offline
    assert not hub_offline()
    # a user who switched only HF_HUB_OFFLINE off asked for the hub: the package forces nothing back on
    for v in ("TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(v)
    set_offline_env()
    assert not hub_offline() and "TRANSFORMERS_OFFLINE" not in os.environ
    assert "no switch set" in offline_advice()


def test_float64_tolerance_is_shared():
    assert FLOAT64["rtol"] <= 1e-9  # the named tolerances live in fisherkron.testing


@pytest.mark.parametrize("call,what", [
    (lambda: collect_calibration(tiny_llama(), _batches(), k=-1, cache=False), "k must be >= 1"),
    (lambda: fk.lm_batches(None, "text", k=0), "k must be >= 1"),
    (lambda: fk.lm_batches(None, "text", k=1, batch_size=0), "batch_size must be >= 1"),
    (lambda: fk.lm_batches(None, "text", k=1, seq_len=1), "seq_len must be >= 2"),
    (lambda: fk.perplexity(tiny_llama(), None, torch.arange(200), seq_len=65), "exceeds the model's 64 positions"),
    (lambda: fk.perplexity(tiny_llama(), None, torch.arange(200), seq_len=16, batch_size=0), "batch_size"),
])
def test_invalid_sizes_are_refused_before_any_work(call, what):
    with pytest.raises(FisherkronError, match=what) as err:
        call()
    _one_line(err)


def test_load_model_of_local_folders(tmp_path):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    model = tiny_llama()
    model.save_pretrained(tmp_path / "plain")
    with pytest.raises(FisherkronError, match="tokenizer") as err:  # weights without a tokenizer
        load_model(str(tmp_path / "plain"))
    _one_line(err)
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")),
                                  eos_token="a")
    tok.save_pretrained(tmp_path / "plain")
    f = tmp_path / "plain" / "model.safetensors"
    good = f.read_bytes()
    f.write_bytes(good[: len(good) // 2])
    with pytest.raises(FisherkronError, match="could not load") as err:  # truncated weights
        load_model(str(tmp_path / "plain"))
    _one_line(err)
    compress(model, "svd", None, rank=2)
    save_compressed(model, tmp_path / "saved", tokenizer=tok)
    loaded, _ = load_model(str(tmp_path / "saved"))  # a fisherkron save is rebuilt with its low-rank layers
    x = torch.randint(0, 90, (1, 5))
    with torch.no_grad():
        torch.testing.assert_close(loaded(x).logits, model(x).logits, **RELOAD)


@pytest.mark.parametrize("given", ["./my-modle", "ABS/doesnotexist", "~/fisherkron-no-such-model-folder",
                                   "models/my-modle", "models/a/b", "ABS/a-file"])
@pytest.mark.parametrize("hub", [None, True], ids=["offline", "hub-allowed"])
def test_a_mistyped_model_path_is_no_model_folder_not_a_hub_problem(given, hub, tmp_path, monkeypatch):
    """A name that is a path never goes to the hub: one line naming the path and what to do, hub on or off."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # were the name sent to the hub, no download is tried
    (tmp_path / "models").mkdir()  # "models/my-modle": a path because its folder exists here
    (tmp_path / "a-file").write_text("not a model")
    name = given.replace("ABS", str(tmp_path))
    with pytest.raises(FisherkronError, match=f"^no model folder at {re.escape(name)}") as err:
        load_model(name, hub=hub)
    msg = _one_line(err)
    assert "hub" not in msg and ("it is a file" in msg if given.endswith("a-file") else "check the path" in msg)


@pytest.mark.parametrize("name", ["bert-base-uncased", "meta-llama/Llama-2-7b-chat-hf", "my-org/my-model"])
def test_hub_names_offline_keep_the_hub_message(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no folder "meta-llama" or "my-org" here
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FisherkronError, match=f"^{re.escape(name)} needs the Hugging Face hub") as err:
        load_model(name)
    _one_line(err)
