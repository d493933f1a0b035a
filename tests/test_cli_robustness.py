"""The command line checks everything it can before the expensive part, and says what is wrong in one line.

Every bad-input case below runs with the expensive calls (data, perplexity, calibration)
replaced by functions that fail the test, so an error that comes out proves it came first.
The models are tiny random Llama / BERT folders with a character-level tokenizer.
"""
import importlib.util
import json
import math
import re

import pytest
import torch
from tiny_models import tiny_bert, tiny_llama
from transformers import BertConfig, BertForSequenceClassification, BertTokenizerFast

import fisherkron.hf as api
import fisherkron.hf.calibration
from fisherkron.cli import main
from fisherkron.hf.saving import MANIFEST, load_compressed

CHARS = "abcdefghijklmnopqrstuvwxyz"
VOCAB = (["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + list(CHARS) + [f"##{c}" for c in CHARS]
         + list("0123456789") + list(".,'-$&?!<>"))  # 77 tokens: fits the tiny Llama's 97


def _save(model, folder):
    folder.mkdir(parents=True)
    model.save_pretrained(folder)
    (folder / "vocab.txt").write_text("\n".join(VOCAB))
    BertTokenizerFast(vocab_file=str(folder / "vocab.txt"), eos_token="[SEP]").save_pretrained(folder)
    return folder


def tiny_classifier() -> BertForSequenceClassification:
    """A two-label BERT classifier over :data:`VOCAB`, 32 positions."""
    return BertForSequenceClassification(BertConfig(
        vocab_size=len(VOCAB), hidden_size=20, num_hidden_layers=2, num_attention_heads=2, intermediate_size=36,
        max_position_embeddings=32, num_labels=2)).eval()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    bert = tiny_classifier()
    bert3 = tiny_bert()  # a 3-label head
    bert3.resize_token_embeddings(len(VOCAB))
    return {"llama": _save(tiny_llama(), root / "llama"), "bert": _save(bert, root / "bert"),
            "bert3": _save(bert3, root / "bert3")}


@pytest.fixture(autouse=True)
def data_root(tmp_path, monkeypatch):
    monkeypatch.setenv("FISHERKRON_DATA", str(tmp_path / "data"))


def _forbid(monkeypatch, *names):
    """Make the named ``fisherkron.hf`` calls fail the test (the CLI must not reach them)."""
    for name in names:
        def boom(*a, _name=name, **k):
            raise AssertionError(f"must not reach {_name}")
        monkeypatch.setattr(api, name, boom)
        for mod in (fisherkron.hf.calibration, fisherkron.hf.data, fisherkron.hf.evaluate):
            if hasattr(mod, name):
                monkeypatch.setattr(mod, name, boom)


EXPENSIVE = ("collect_calibration", "lm_batches", "classification_batches", "c4_documents", "load_task",
             "perplexity", "ptb", "compress", "save_compressed", "run_lm_eval", "evaluate_classifier")


@pytest.fixture
def cheap(monkeypatch):
    _forbid(monkeypatch, *EXPENSIVE)


def run(argv):
    """The exit status of ``fisherkron argv``."""
    try:
        return main([str(a) for a in argv])
    except SystemExit as exc:
        return exc.code


BAR = re.compile(r"\d+/\d+ \[[\d:<?]+")  # a tqdm progress bar (transformers' "Loading weights")


def error(argv, capsys):
    """Run a command that must fail with status 2; return its message, which must be one line."""
    code = run(argv)
    err = capsys.readouterr().err
    lines = [ln for ln in err.replace("\r", "\n").splitlines() if ln.strip() and not BAR.search(ln)]
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("fisherkron"), err
    return lines[0]


# ----------------------------------------------------------------------------- top level

def test_version(capsys):
    from fisherkron import __version__
    assert run(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"fisherkron {__version__}"


def test_quiet_and_verbose_contradict(capsys):
    assert "contradict" in error(["-q", "-v", "compress", "smollm2", "--rank", "2", "--dry-run"], capsys)


# ----------------------------------------------------------------------------- numeric options (argparse)

BAD_COMPRESS = [
    (["--ratio", "nan"], "--ratio"), (["--ratio", "0"], "--ratio"), (["--ratio", "1"], "--ratio"),
    (["--ratio", "-0.2"], "--ratio"), (["--rank", "0"], "--rank"), (["--rank", "2.5"], "--rank"),
    (["--rank", "2", "--tol", "-1e-4"], "--tol"), (["--rank", "2", "--tol", "nan"], "--tol"),
    (["--rank", "2", "--tol", "1"], "--tol"), (["--rank", "2", "--min-alpha", "-1"], "--min-alpha"),
    (["--rank", "2", "--min-alpha", "inf"], "--min-alpha"), (["--rank", "2", "--k", "0"], "--k"),
    (["--rank", "2", "--batch-size", "0"], "--batch-size"), (["--rank", "2", "--seq-len", "1"], "--seq-len"),
    (["--rank", "2", "--ppl-tokens", "-5"], "--ppl-tokens"), (["--rank", "2", "--seed", "-1"], "--seed"),
    (["--rank", "2", "--method", "pca"], "--method"), (["--rank", "2", "--device", "gpu"], "--device"),
    (["--rank", "2", "--task", "qa"], "--task"), (["--rank", "2", "--max-disk", "20 parsecs"], "--max-disk"),
    (["--rank", "2", "--max-disk", "0GB"], "--max-disk"),
]


@pytest.mark.parametrize("extra,option", BAD_COMPRESS, ids=lambda x: " ".join(x) if isinstance(x, list) else None)
def test_compress_rejects_bad_numbers_when_parsing(extra, option, cheap, monkeypatch, capsys, models):
    _forbid(monkeypatch, "load_model")
    err = error(["compress", models["llama"], "--out", "never", *extra], capsys)
    assert f"argument {option}" in err


@pytest.mark.parametrize("extra,option", [
    (["--tol", "-1"], "--tol"), (["--tol", "nan"], "--tol"), (["--tol", "0"], "--tol"),
    (["--terms", "0"], "--terms"), (["--memory-gb", "0"], "--memory-gb"), (["--memory-gb", "nan"], "--memory-gb"),
    (["--device", "cuda:x"], "--device")])
def test_factorize_rejects_bad_numbers_when_parsing(extra, option, tmp_path, capsys):
    err = error(["factorize", tmp_path / "g.npy", "--out", tmp_path / "f.pt", *extra], capsys)
    assert f"argument {option}" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_cuda_is_one_line(capsys, models):
    err = error(["compress", models["llama"], "--rank", "2", "--out", "x", "--device", "cuda"], capsys)
    assert "CUDA is not available" in err


# ----------------------------------------------------------------------------- checked before any data is read

def _fisherkron_folder(path, files=("model.safetensors",)):
    path.mkdir()
    (path / MANIFEST).write_text("{}")
    for f in files:
        (path / f).write_text("x")
    return path


def test_out_is_checked_before_the_model_is_loaded(tmp_path, cheap, monkeypatch, capsys, models):
    _forbid(monkeypatch, "load_model")
    base = ["compress", models["llama"], "--rank", "2", "--out"]
    (tmp_path / "file").write_text("x")
    assert "is a file" in error(base + [tmp_path / "file"], capsys)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    assert "not a fisherkron folder" in error(base + [tmp_path / "other"], capsys)
    _fisherkron_folder(tmp_path / "earlier")
    assert "--overwrite" in error(base + [tmp_path / "earlier"], capsys)
    assert "not a fisherkron folder" in error(base + [tmp_path / "other", "--overwrite"], capsys)
    assert (tmp_path / "other" / "notes.txt").read_text() == "mine"
    assert "--out is required" in error(["compress", models["llama"], "--rank", "2"], capsys)
    assert "--cache-dir" in error(base + [tmp_path / "new", "--cache-dir", tmp_path / "file"], capsys)
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize("extra,message", [
    (["--seq-len", "65"], "exceeds the 64 positions"),
    (["--layers", "model.layers.*.mlp.nothing"], "matches no nn.Linear"),
    (["--ratio", "0.95"], "out of reach"),
    (["--rank", "100"], "rank 100 is outside 1..min(n, m)=24"),
    (["--rank", "2", "--data", "sst2"], "calibrates on c4"),
    (["--rank", "2", "--seq-len", "16", "--ppl-tokens", "8"], "less than one window"),
    (["--rank", "2", "--method", "svd", "--tol", "1e-3"], "does not run MFF"),
], ids=["seq-len", "layers", "ratio", "rank", "data", "ppl-tokens", "tol"])
def test_causal_lm_errors_come_before_calibration(extra, message, tmp_path, cheap, capsys, models):
    extra = extra if "--rank" in extra or "--ratio" in extra else ["--rank", "2", *extra]
    err = error(["compress", models["llama"], "--out", tmp_path / "out", *extra], capsys)
    assert message in err
    assert not (tmp_path / "out").exists() and not (tmp_path / "data").exists()


@pytest.mark.parametrize("model,extra,message", [
    ("bert", [], "no --data was given"),
    ("bert", ["--data", "c4"], "c4 is language-modelling data"),
    ("bert3", ["--data", "sst2"], "3-label classification head but sst2 has 2 labels"),
    ("bert", ["--data", "sst2", "--ppl-tokens", "64"], "is a sequence classifier"),
    ("bert", ["--data", "sst2", "--seq-len", "33"], "exceeds the 32 positions"),
    ("minilm", [], "is a sequence classifier"),  # the embedded alias, detected without loading it
], ids=["no-data", "c4", "labels", "ppl", "seq-len", "minilm"])
def test_classifier_errors_come_before_calibration(model, extra, message, tmp_path, cheap, capsys, models):
    err = error(["compress", models.get(model, model), "--rank", "2", "--out", tmp_path / "out", *extra], capsys)
    assert message in err


def test_model_argument_errors(tmp_path, cheap, monkeypatch, capsys, models):
    _forbid(monkeypatch, "load_model")
    base = ["--rank", "2", "--out", tmp_path / "out"]
    assert "does not exist" in error(["compress", tmp_path / "missing", *base], capsys)
    here = tmp_path / "models"
    here.mkdir()
    monkeypatch.chdir(tmp_path)  # "models/my-modle": a folder of this machine, mistyped, not a hub name
    assert "no model folder at models/my-modle" in error(["compress", "models/my-modle", *base], capsys)
    (tmp_path / "weights.bin").write_text("x")
    assert "is a file" in error(["compress", tmp_path / "weights.bin", *base], capsys)
    (tmp_path / "empty").mkdir()
    assert "no config.json" in error(["compress", tmp_path / "empty", *base], capsys)
    saved = _fisherkron_folder(tmp_path / "saved", files=())
    cfg = json.loads((models["llama"] / "config.json").read_text())
    from fisherkron.hf.saving import MODEL_TYPE
    (saved / "config.json").write_text(json.dumps({**cfg, "model_type": MODEL_TYPE}))
    assert "already factorised" in error(["compress", saved, *base], capsys)


def test_interrupt_and_os_errors_are_one_line(tmp_path, cheap, monkeypatch, capsys, models):
    def interrupt(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(api, "load_model", interrupt)
    code = run(["compress", models["llama"], "--rank", "2", "--out", tmp_path / "out"])
    err = capsys.readouterr().err.strip()
    assert code == 130 and err == "fisherkron: interrupted"

    def unreadable(*a, **k):
        raise PermissionError(13, "Permission denied", str(models["llama"] / "model.safetensors"))
    monkeypatch.setattr(api, "load_model", unreadable)
    err = error(["compress", models["llama"], "--rank", "2", "--out", tmp_path / "out"], capsys)
    assert err == f"fisherkron: error: Permission denied: {models['llama'] / 'model.safetensors'}"


def test_factorize_checks_paths_before_mff(tmp_path, monkeypatch, capsys):
    import numpy as np

    import fisherkron.core.factorization as fac
    monkeypatch.setattr(fac, "mff", lambda *a, **k: (_ for _ in ()).throw(AssertionError("must not run MFF")))
    assert "does not exist" in error(["factorize", tmp_path / "none.npy", "--out", tmp_path / "f.pt"], capsys)
    (tmp_path / "text.npy").write_text("not an array")
    assert "not a .npy array" in error(["factorize", tmp_path / "text.npy", "--out", tmp_path / "f.pt"], capsys)
    np.save(tmp_path / "flat.npy", np.zeros((3, 4), dtype=np.float32))
    assert "expected (k, n, m)" in error(["factorize", tmp_path / "flat.npy", "--out", tmp_path / "f.pt"], capsys)
    np.save(tmp_path / "g.npy", np.zeros((3, 4, 2), dtype=np.float32))
    assert "exceeds the rank bound" in error(["factorize", tmp_path / "g.npy", "--out", tmp_path / "f.pt",
                                              "--terms", "5"], capsys)
    (tmp_path / "f.pt").write_text("earlier result")
    assert "--overwrite" in error(["factorize", tmp_path / "g.npy", "--out", tmp_path / "f.pt"], capsys)
    assert "is a folder" in error(["factorize", tmp_path / "g.npy", "--out", tmp_path], capsys)
    assert (tmp_path / "f.pt").read_text() == "earlier result"


# ----------------------------------------------------------------------------- dry run

def test_dry_run_prints_the_plan_and_writes_nothing(tmp_path, cheap, capsys, models):
    out = tmp_path / "out"
    code = run(["compress", models["llama"], "--ratio", "0.2", "--out", out, "--dry-run"])
    text = capsys.readouterr().out
    assert code == 0
    lines = text.strip().splitlines()
    summary = json.loads(lines[-1])
    assert summary["dry_run"] and summary["layers"] == 14  # 2 blocks x (q, k, v, o, gate, up, down)
    assert "model.layers.0.self_attn.q_proj" in text and "rank" in lines[0]
    assert summary["ratio"] >= 0.2 and summary["params_after"] < summary["params_before"]
    model = tiny_llama()
    mods = dict(model.named_modules())
    removed = sum(mods[n].weight.numel() - r * sum(mods[n].weight.shape) for n, r in summary["ranks"].items())
    assert summary["params_before"] - summary["params_after"] == removed
    assert not out.exists() and not (tmp_path / "data").exists()
    # quiet: the JSON line only
    assert run(["-q", "compress", models["llama"], "--rank", "2", "--dry-run"]) == 0
    captured = capsys.readouterr()
    assert len(captured.out.strip().splitlines()) == 1 and json.loads(captured.out)["ranks"]
    assert captured.err == ""


# ----------------------------------------------------------------------------- real runs (tiny)

FAST = ["--k", "2", "--batch-size", "2", "--seq-len", "16", "--rank", "2", "--no-cache"]


def test_classifier_folder_is_compressed_as_a_classifier(tmp_path, monkeypatch, capsys, models):
    seen = {}
    real = fisherkron.hf.calibration.collect_calibration

    def spy(model, batches, *a, **k):
        seen["model"], seen["batches"] = type(model).__name__, list(batches)
        return real(model, batches, *a, **k)
    monkeypatch.setattr(api, "collect_calibration", spy)
    out = tmp_path / "out"
    code = run(["-q", "compress", models["bert"], "--data", "sst2", "--out", out, *FAST])
    summary = json.loads(capsys.readouterr().out)
    assert code == 0 and summary["task"] == "sequence-classification" and summary["data"] == "sst2"
    # calibrated through the classifier, with one label per sequence (a classification loss)
    assert seen["model"] == "BertForSequenceClassification"
    assert all(b["labels"].shape == (2,) and b["input_ids"].shape[0] == 2 for b in seen["batches"])
    original = BertForSequenceClassification.from_pretrained(models["bert"])
    saved = load_compressed(out)
    assert type(saved).__name__ == "BertForSequenceClassification"
    for name in ("classifier.weight", "classifier.bias", "bert.pooler.dense.weight"):  # the head is kept
        assert torch.equal(saved.state_dict()[name], original.state_dict()[name]), name
    assert type(saved.bert.encoder.layer[0].attention.self.query).__name__ == "LowRankLinear"

    # evaluate: classification metrics on the validation split; causal-LM metrics refused up front
    code = run(["-q", "evaluate", out, "--data", "sst2", "--limit", "8", "--seq-len", "16"])
    res = json.loads(capsys.readouterr().out)
    assert code == 0 and 0.0 <= res["classification"]["accuracy"] <= 1.0
    _forbid(monkeypatch, *EXPENSIVE)
    assert "scores a causal LM" in error(["evaluate", out, "--ppl-tokens", "64"], capsys)
    assert "scores a causal LM" in error(["evaluate", out, "--tasks", "arc_easy"], capsys)
    assert "pass --data" in error(["evaluate", out], capsys)


def test_compress_overwrite_and_evaluate_perplexity(tmp_path, capsys, models):
    out = tmp_path / "out"
    assert run(["-q", "compress", models["llama"], "--out", out, *FAST]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["task"] == "causal-lm" and summary["data"] == "c4"
    listed = set(json.loads((out / MANIFEST).read_text())["files"])
    (out / "notes.txt").write_text("mine")
    assert "--overwrite" in error(["compress", models["llama"], "--out", out, *FAST], capsys)
    assert run(["-q", "compress", models["llama"], "--out", out, "--overwrite", *FAST, "--method", "svd"]) == 0
    capsys.readouterr()
    assert json.loads((out / MANIFEST).read_text())["method"] == "svd"
    assert (out / "notes.txt").read_text() == "mine" and listed <= {p.name for p in out.iterdir()}

    code = run(["-q", "evaluate", out, "--ppl-tokens", "64", "--seq-len", "16"])
    res = json.loads(capsys.readouterr().out)
    assert code == 0 and res["task"] == "causal-lm" and res["params"] == summary["params_after"]
    assert math.isfinite(res["ptb_ppl"]) and res["ptb_ppl"] > 1 and res["ptb_tokens"] == 4 * 15
    # the uncompressed baseline, from a plain Hugging Face folder
    code = run(["-q", "evaluate", models["llama"], "--ppl-tokens", "64", "--seq-len", "16"])
    base = json.loads(capsys.readouterr().out)
    assert code == 0 and base["params"] == summary["params_before"] and math.isfinite(base["ptb_ppl"])
    if importlib.util.find_spec("lm_eval") is not None:  # lm-eval on the local task files (2 examples)
        code = run(["-q", "evaluate", out, "--tasks", "arc_easy", "--limit", "2", "--seq-len", "64"])
        res = json.loads(capsys.readouterr().out)
        assert code == 0 and 0.0 <= res["lm_eval"]["arc_easy"]["acc"] <= 1.0 and "ptb_ppl" not in res


def test_evaluate_errors_come_before_scoring(tmp_path, cheap, capsys, models):
    assert "exceeds the 64 positions" in error(["evaluate", models["llama"], "--seq-len", "128"], capsys)
    assert "less than one window" in error(["evaluate", models["llama"], "--ppl-tokens", "8",
                                            "--seq-len", "16"], capsys)
    assert "scores a sequence classifier" in error(["evaluate", models["llama"], "--data", "sst2"], capsys)
    assert "3-label classification head" in error(["evaluate", models["bert3"], "--data", "sst2"], capsys)
    assert "does not exist" in error(["evaluate", tmp_path / "nothing"], capsys)
    assert "unknown lm-eval task" in error(["evaluate", models["llama"], "--tasks", "arc_easy,nope"], capsys)


def test_compress_with_device_runs_gfwsvd(tmp_path, capsys, models):
    """--device reaches MFF once (it travelled twice into CalibrationStats.kronecker: a TypeError)."""
    out = tmp_path / "out"
    assert run(["-q", "compress", models["llama"], "--out", out, *FAST, "--device", "cpu", "--method", "gfwsvd"]) == 0
    assert json.loads(capsys.readouterr().out)["method"] == "gfwsvd"


@pytest.mark.parametrize("allocation", ["fisher", "sensitivity"])
def test_compress_with_an_allocation_meets_the_ratio(allocation, tmp_path, capsys, models):
    out = tmp_path / "out"
    fast = ["--k", "2", "--batch-size", "2", "--seq-len", "16", "--no-cache"]
    assert run(["-q", "compress", models["llama"], "--out", out, *fast, "--ratio", "0.2", "--allocation", allocation,
                "--method", "gfwsvd", "--grad-dtype", "bfloat16"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["allocation"] == allocation and summary["ratio"] >= 0.2


@pytest.mark.parametrize("extra,message", [
    (["--rank", "2", "--allocation", "fisher"], "give --ratio instead of --rank"),
    (["--ratio", "0.2", "--allocation", "fisher", "--method", "svd"], "method svd collects none"),
    (["--rank", "2", "--method", "svd_llm", "--granularity", "token"], "does not run MFF"),
], ids=["rank", "svd", "granularity"])
def test_allocation_and_gradient_options_are_checked_first(extra, message, tmp_path, cheap, capsys, models):
    err = error(["compress", models["llama"], "--out", tmp_path / "out", *extra], capsys)
    assert message in err


def test_sensitivity_allocation_is_refused_for_a_classifier(tmp_path, cheap, capsys, models):
    err = error(["compress", models["bert"], "--data", "sst2", "--ratio", "0.1", "--allocation", "sensitivity",
                 "--out", tmp_path / "out"], capsys)
    assert "use --allocation fisher or uniform" in err
