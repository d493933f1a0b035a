"""``fisherkron compress`` on the user's own text (``--data PATH``, ``--text-field``), under a bound on the
calibration's disk (``--max-disk``), and what ``--dry-run`` says a calibration will need.

* ``--data notes.txt`` calibrates on that text: the batches are ``lm_batches`` of its documents less
  the last fifth, from which the measured allocation's held-out batches are drawn; ``--text-field``
  reads a ``.jsonl``; the JSON line names the file and the field;
* a bad file (missing, empty, without the field, too short for the batches or for the held-out
  ones), a path for a classifier, ``--text-field`` without a path and an unknown name are one line
  with status 2, before any batch is drawn, also under ``--dry-run``, and nothing is written;
* ``--max-disk`` reaches the calibration: a bound that forces two groups or more gives the ranks and
  the weights of the unbounded run; ``--dry-run`` reports the disk, memory and passes of
  :func:`fisherkron.hf.budget.calibration_needs` (no gradients for KFAC-SVD); a bound too small is
  one line.

The model is a tiny random Llama with a character-level tokenizer that reads lowercase words, so
the user's text and C4 give different batches.
"""
import json
import random

import pytest
import torch
from cli_harness import loader  # noqa: F401 (a fixture)
from test_cli_robustness import EXPENSIVE, VOCAB, _forbid, error, run
from tiny_models import tiny_llama
from transformers import AutoTokenizer, BertTokenizerFast

import fisherkron.hf as api
from fisherkron.cli.compress import HELDOUT_BATCHES, HELDOUT_DOCS, heldout_documents
from fisherkron.hf.budget import calibration_needs
from fisherkron.hf.saving import MANIFEST, load_compressed
from fisherkron.hf.user_data import load_documents

#: tiny batches: 2 batches of 2 x 16 tokens
FAST = ["--k", "2", "--batch-size", "2", "--seq-len", "16", "--no-cache"]
#: 20 paragraphs of 30 random lowercase words: about 180 tokens each
PARAGRAPHS = [" ".join("".join(random.Random(100 * p + w).choices("abcdefghij", k=4)) for w in range(30))
              for p in range(20)]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    folder = tmp_path_factory.mktemp("models") / "llama"
    tiny_llama().save_pretrained(folder)
    BertTokenizerFast(vocab={w: i for i, w in enumerate(VOCAB)}, eos_token="[SEP]").save_pretrained(folder)
    return folder


@pytest.fixture(autouse=True)
def data_root(tmp_path, monkeypatch):
    monkeypatch.setenv("FISHERKRON_DATA", str(tmp_path / "data"))
    monkeypatch.delenv("WORLD_SIZE", raising=False)


@pytest.fixture
def notes(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("\n\n".join(PARAGRAPHS) + "\n")
    return path


@pytest.fixture
def records(tmp_path):
    path = tmp_path / "records.jsonl"
    path.write_text("".join(json.dumps({"id": i, "body": p}) + "\n" for i, p in enumerate(PARAGRAPHS)))
    return path


def _spy(monkeypatch) -> dict:
    """Record the calibration's batches and ``max_disk``, and compress's held-out batches, and run them."""
    seen = {}
    collect, compress = api.collect_calibration, api.compress

    def spy_collect(model, batches, *a, **k):
        seen["batches"], seen["max_disk"] = list(batches), k.get("max_disk")
        seen["stats"] = collect(model, batches, *a, **k)
        return seen["stats"]

    def spy_compress(*a, **k):
        seen["heldout"] = (k.get("allocation_options") or {}).get("heldout")
        return compress(*a, **k)
    monkeypatch.setattr(api, "collect_calibration", spy_collect)
    monkeypatch.setattr(api, "compress", spy_compress)
    return seen


def _same(got, want) -> bool:
    return len(got) == len(want) and all(a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
                                         for a, b in zip(got, want))


def _summary(capsys) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


# ----------------------------------------------------------------------------- the user's text

def test_own_text_calibrates_and_holds_out_its_last_fifth(llama, notes, tmp_path, monkeypatch, capsys):
    seen = _spy(monkeypatch)
    code = run(["-q", "compress", llama, "--ratio", "0.2", "--data", notes, "--out", tmp_path / "out", *FAST])
    summary = _summary(capsys)
    assert code == 0
    assert (summary["data"], summary["text_field"], summary["calibration"]["data"]) == (str(notes), None, str(notes))
    assert summary["allocation"] == "calibrated"  # the default: a measured allocation
    tok = AutoTokenizer.from_pretrained(llama)
    docs = load_documents(notes)
    n = heldout_documents(len(docs))
    assert len(docs) == 20 and n == 4
    assert _same(seen["batches"], api.lm_batches(tok, docs[:-n], 2, batch_size=2, seq_len=16, seed=0))
    assert _same(seen["heldout"], api.lm_batches(tok, docs[-n:], HELDOUT_BATCHES, batch_size=2, seq_len=16, seed=1))
    c4 = api.c4_documents()[:-HELDOUT_DOCS]
    assert not _same(seen["batches"], api.lm_batches(tok, c4, 2, batch_size=2, seq_len=16, seed=0))
    # the held-out documents' tokens are not in the calibration
    calibration = {tuple(row.tolist()) for b in seen["batches"] for row in b["input_ids"]}
    held = {tuple(row.tolist()) for b in seen["heldout"] for row in b["input_ids"]}
    assert not calibration & held


def test_a_jsonl_file_is_read_through_its_text_field(llama, records, tmp_path, monkeypatch, capsys):
    seen = _spy(monkeypatch)
    code = run(["-q", "compress", llama, "--rank", "2", "--data", records, "--text-field", "body",
                "--out", tmp_path / "out", *FAST])
    summary = _summary(capsys)
    assert code == 0 and (summary["data"], summary["text_field"]) == (str(records), "body")
    tok = AutoTokenizer.from_pretrained(llama)
    assert _same(seen["batches"], api.lm_batches(tok, PARAGRAPHS, 2, batch_size=2, seq_len=16, seed=0))
    assert seen["heldout"] is None  # --rank: the uniform allocation measures nothing
    # the dry run reads the file too, and says what it read
    assert run(["-q", "compress", llama, "--rank", "2", "--data", records, "--text-field", "body", *FAST,
                "--dry-run"]) == 0
    plan = _summary(capsys)
    assert (plan["data"], plan["text_field"]) == (str(records), "body")


@pytest.mark.parametrize("dry_run", [False, True], ids=["run", "dry-run"])
def test_bad_text_is_one_line_before_any_batch(dry_run, llama, notes, records, tmp_path, monkeypatch, capsys):
    _forbid(monkeypatch, *EXPENSIVE)
    out = tmp_path / "out"
    (tmp_path / "empty.txt").write_text("")
    tok = AutoTokenizer.from_pretrained(llama)
    calibration = PARAGRAPHS[:-4]  # the default allocation holds out the last 4 of 20
    have = sum(len(tok(p, add_special_tokens=False)["input_ids"]) + 1 for p in calibration)
    held = sum(len(tok(p, add_special_tokens=False)["input_ids"]) + 1 for p in PARAGRAPHS[-4:])
    assert 2 * 8 * 64 > held and 8 * 64 <= have  # one batch of 8 x 64 fits, two held-out ones do not
    cases = [
        (["--data", tmp_path / "missing.txt"], ["no file or folder at", "missing.txt"]),
        (["--data", tmp_path / "empty.txt"], ["empty.txt is empty"]),
        (["--data", records], ["has no field 'text' (the default)", "fields holding text: body"]),
        (["--data", records, "--text-field", "title"], ["has no field 'title'"]),
        (["--data", notes, "--text-field", "body"], ["is plain text"]),
        (["--data", notes, "--k", "100"],
         [f"16 documents give {have} tokens", f"100 x 2 x 16 = {100 * 2 * 16} are needed", "held out"]),
        (["--data", notes, "--k", "1", "--batch-size", "8", "--seq-len", "64"],
         [f"last 4 of 20 documents, held out", f"give {held} tokens", f"= {2 * 8 * 64} are needed"]),
        (["--data", "wiki"], ["'wiki' is neither a built-in data set"]),
        (["--text-field", "body"], ["--text-field names the text of a --data file or folder"]),
        (["--data", "c4", "--text-field", "body"], ["c4 is a built-in data set"]),
    ]
    for extra, messages in cases:
        base = ["--k", "2", "--batch-size", "2", "--seq-len", "16"]
        err = error(["compress", llama, "--ratio", "0.2", *base, *extra,
                     *(["--dry-run"] if dry_run else ["--out", out])], capsys)
        for message in messages:
            assert message in err, (extra, err)
        assert not out.exists() and not (tmp_path / "data").exists()


def test_a_classifier_refuses_a_path(notes, tmp_path, loader, capsys):  # noqa: F811 (the fixture)
    err = error(["compress", "minilm", "--rank", "2", "--data", notes, "--out", tmp_path / "out"], capsys)
    assert (f"--data {notes} is your own text, which calibrates a causal LM; minilm is a sequence classifier: "
            f"pass --data sst2, boolq or trec") in err
    assert loader == [] and not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------- a bound on the disk

GFWSVD = ["--method", "gfwsvd", "--ratio", "0.2", "--allocation", "fisher"]


def test_max_disk_gives_the_unbounded_ranks_and_weights(llama, tmp_path, monkeypatch, capsys):
    assert run(["-q", "compress", llama, *GFWSVD, *FAST, "--dry-run"]) == 0
    need = _summary(capsys)["needs"]
    bound = (need["min_max_disk"] + need["disk_bytes"]) // 2  # room for some of the gradients, not all
    assert run(["-q", "compress", llama, *GFWSVD, *FAST, "--dry-run", "--max-disk", bound]) == 0
    plan = _summary(capsys)
    assert plan["max_disk"] == bound and plan["needs"]["groups"] >= 2 and plan["needs"]["passes"] == 2 * \
        plan["needs"]["groups"]

    seen = _spy(monkeypatch)
    assert run(["-q", "compress", llama, *GFWSVD, *FAST, "--out", tmp_path / "whole"]) == 0
    assert _summary(capsys)["max_disk"] is None and seen["max_disk"] is None and seen["stats"].keeps_gradients
    assert run(["-q", "compress", llama, *GFWSVD, *FAST, "--out", tmp_path / "bounded", "--max-disk", bound]) == 0
    assert _summary(capsys)["max_disk"] == bound
    assert seen["max_disk"] == bound and not seen["stats"].keeps_gradients  # collected in groups, factors kept
    ranks = [{n: spec["rank"] for n, spec in json.loads((tmp_path / f / MANIFEST).read_text())["layers"].items()}
             for f in ("whole", "bounded")]
    assert ranks[0] == ranks[1] and len(set(ranks[0].values())) > 1  # the Fisher allocation: ranks differ
    x = torch.randint(5, len(VOCAB), (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = [load_compressed(tmp_path / f)(input_ids=x).logits for f in ("whole", "bounded")]
    assert torch.equal(logits[0], logits[1])


def test_dry_run_says_what_the_calibration_needs(llama, capsys):
    model = tiny_llama()
    names = api.select_layers(model)
    shape = dict(k=2, batch_size=2, seq_len=16)
    # the default method, KFAC-SVD, stores no gradients
    assert run(["compress", llama, "--ratio", "0.2", *FAST, "--dry-run"]) == 0
    captured = capsys.readouterr()
    plan = json.loads(captured.out.strip().splitlines()[-1])
    assert plan["needs"] == calibration_needs(model, names, ("kfac_svd",), **shape)
    assert plan["needs"]["gradient_bytes"] == 0 and plan["needs"]["statistics_bytes"] > 0
    assert plan["needs"]["passes"] == 2 and plan["needs"]["memory_bytes"] > plan["needs"]["model_bytes"] > 0
    assert "gradients 0 bytes (kfac_svd stores none)" in captured.err and "2 forward + backward passes" in captured.err
    # GFWSVD under a bound: its gradients, factors, peak disk and passes, bounded and not
    assert run(["compress", llama, "--method", "gfwsvd", "--ratio", "0.2", *FAST, "--dry-run",
                "--max-disk", "1.47MB"]) == 0
    captured = capsys.readouterr()
    plan = json.loads(captured.out.strip().splitlines()[-1])
    need = plan["needs"]
    assert need == calibration_needs(model, names, ("gfwsvd",), max_disk=1_470_000, **shape)
    for key in ("gradient_bytes", "gradient_bytes_bounded", "factor_bytes", "disk_bytes", "disk_bytes_bounded",
                "memory_bytes", "model_bytes", "passes", "groups"):
        assert need[key] > 0, key
    assert need["gradient_bytes_bounded"] < need["gradient_bytes"] and need["disk_bytes_bounded"] <= 1_470_000
    assert need["passes"] == 2 * need["groups"] >= 4 and plan["max_disk"] == 1_470_000
    assert "under --max-disk 1.47 MB: 2 group(s)" in captured.err and "4 forward + backward passes" in captured.err
    # plain SVD collects nothing
    assert run(["-q", "compress", llama, "--method", "svd", "--ratio", "0.2", "--dry-run"]) == 0
    assert _summary(capsys)["needs"] is None


def test_a_bound_too_small_is_one_line(llama, tmp_path, monkeypatch, capsys):
    _forbid(monkeypatch, *EXPENSIVE)
    for where in (["--dry-run"], ["--out", tmp_path / "out"]):
        err = error(["compress", llama, "--method", "gfwsvd", "--rank", "2", *FAST, "--max-disk", "1MB", *where],
                    capsys)
        assert "--max-disk 1.00 MB is too small" in err and "raise --max-disk to at least 1.44 MB" in err, err
    # under what the finished entry keeps (MFF's factors of every layer): more groups cannot help
    err = error(["compress", llama, "--method", "gfwsvd", "--rank", "2", *FAST, "--max-disk", "200kB", "--dry-run"],
                capsys)
    assert "factors of its 14 layers alone take 279.04 kB" in err and "at least 1.44 MB or select fewer" in err, err
    assert not (tmp_path / "out").exists() and not (tmp_path / "data").exists()


def test_max_disk_is_refused_under_torchrun(tmp_path, loader, monkeypatch, capsys):  # noqa: F811 (the fixture)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    err = error(["compress", "smollm2", "--method", "gfwsvd", "--rank", "2", "--max-disk", "20GB",
                 "--out", tmp_path / "out"], capsys)
    assert "--max-disk run in one process only" in err and loader == []
