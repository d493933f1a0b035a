"""load_documents: a user's corpus in every format datasets reads, one-line refusals, no stray cache;
check_enough_tokens: the tokens lm_batches needs against the tokens the documents give."""
import json

import pytest

datasets = pytest.importorskip("datasets")

from fisherkron.core.conventions import FisherkronError  # noqa: E402
from fisherkron.hf.data import lm_batches  # noqa: E402
from fisherkron.hf.user_data import check_enough_tokens, data_source, load_documents  # noqa: E402

DOCS = ["The first document,\nwhich runs over two lines.", "A second one.", "Third:\nthree\nlines."]


@pytest.fixture(autouse=True)
def hf_home(tmp_path, monkeypatch):
    """A private HF_HOME and datasets cache, to show that a load writes nothing there."""
    home = tmp_path / "hf_home"
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(home / "datasets"))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", home / "datasets")
    return home


def _one_line_naming(excinfo, path):
    msg = str(excinfo.value)
    assert "\n" not in msg, msg
    assert str(path) in msg, msg
    return msg


# -- each format --------------------------------------------------------------------------------------
def test_txt_paragraphs_are_documents_and_multi_line_paragraphs_stay_whole(tmp_path, hf_home):
    p = tmp_path / "notes.txt"
    p.write_text("\n\n".join(DOCS[:2]) + "\n\n\n\n" + DOCS[2] + "\n", encoding="utf-8")  # extra blank lines too
    assert load_documents(p) == DOCS
    assert load_documents(str(p)) == DOCS
    assert not hf_home.exists()  # the Arrow cache went to a temporary folder, removed


def test_a_file_name_with_glob_characters_is_that_file(tmp_path):
    (tmp_path / "notes [draft].txt").write_text("mine")
    (tmp_path / "notes d.txt").write_text("a file the pattern [draft] would match")
    assert load_documents(tmp_path / "notes [draft].txt") == ["mine"]


def test_txt_with_windows_line_ends(tmp_path):
    p = tmp_path / "crlf.txt"
    p.write_bytes("\n\n".join(DOCS).replace("\n", "\r\n").encode())
    assert load_documents(p) == DOCS


def test_jsonl_and_json_with_a_custom_field(tmp_path, hf_home):
    rows = [{"id": i, "body": d} for i, d in enumerate(DOCS)]
    jl = tmp_path / "corpus.jsonl"
    jl.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    js = tmp_path / "corpus.json"
    js.write_text(json.dumps(rows))
    assert load_documents(jl, text_field="body") == DOCS
    assert load_documents(js, text_field="body") == DOCS
    assert not hf_home.exists()


def test_the_default_field_is_text_and_blank_or_missing_rows_are_dropped(tmp_path):
    p = tmp_path / "c.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in [{"text": DOCS[0]}, {"text": "  "}, {"other": 1},
                                                   {"text": DOCS[1]}]))
    assert load_documents(p) == DOCS[:2]


def test_csv_and_parquet(tmp_path):
    pd = pytest.importorskip("pandas")
    frame = pd.DataFrame({"n": range(len(DOCS)), "review": DOCS})
    frame.to_csv(tmp_path / "r.csv", index=False)
    frame.to_parquet(tmp_path / "r.parquet")
    assert load_documents(tmp_path / "r.csv", text_field="review") == DOCS
    assert load_documents(tmp_path / "r.parquet", text_field="review") == DOCS


def test_saved_dataset_and_dataset_dict_folders(tmp_path, caplog):
    datasets.Dataset.from_dict({"text": DOCS, "label": [0, 1, 0]}).save_to_disk(tmp_path / "ds")
    assert load_documents(tmp_path / "ds") == DOCS
    train, test = datasets.Dataset.from_dict({"t": DOCS}), datasets.Dataset.from_dict({"t": ["held out"]})
    datasets.DatasetDict({"test": test, "train": train}).save_to_disk(tmp_path / "dd")
    with caplog.at_level("INFO", logger="fisherkron.hf.user_data"):
        assert load_documents(tmp_path / "dd", text_field="t") == DOCS
    assert "'train'" in caplog.text  # which split was used is said
    datasets.DatasetDict({"validation": test}).save_to_disk(tmp_path / "one")
    assert load_documents(tmp_path / "one", text_field="t") == ["held out"]  # the only split
    before = sorted(p.name for p in (tmp_path / "ds").iterdir())
    load_documents(tmp_path / "ds")
    assert sorted(p.name for p in (tmp_path / "ds").iterdir()) == before  # read in place, nothing written


# -- bad input: one line naming the file ---------------------------------------------------------------
def _bad_files(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "blank.txt").write_text("\n\n   \n\n\n")
    (tmp_path / "blank.jsonl").write_text(json.dumps({"text": " "}) + "\n" + json.dumps({"text": None}) + "\n")
    (tmp_path / "notes.docx").write_text("x")
    (tmp_path / "noext").write_text("x")
    (tmp_path / "body.jsonl").write_text(json.dumps({"body": "x", "n": 1}) + "\n")
    (tmp_path / "broken.jsonl").write_text('{"text": "x"\n')
    (tmp_path / "broken.csv").write_text('text,n\n"never closed,1\n')
    (tmp_path / "broken.parquet").write_text("not parquet")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 au lait".encode("latin-1"))
    (tmp_path / "plain_folder").mkdir()
    train, test = datasets.Dataset.from_dict({"text": ["a"]}), datasets.Dataset.from_dict({"text": ["b"]})
    datasets.DatasetDict({"validation": train, "test": test}).save_to_disk(tmp_path / "two_splits")


BAD = [  # (file, text_field, words the message must hold)
    ("missing.txt", None, ["no file or folder", ".jsonl", "save_to_disk"]),
    ("empty.txt", None, ["is empty"]),
    ("blank.txt", None, ["no non-empty documents"]),
    ("blank.jsonl", None, ["no non-empty documents", "'text'"]),
    ("notes.docx", None, ["(.docx)", ".txt", ".jsonl", ".json", ".csv", ".parquet", "save_to_disk"]),
    ("noext", None, ["no extension", ".txt"]),
    ("body.jsonl", None, ["no field 'text' (the default)", "body, n", "fields holding text: body"]),
    ("body.jsonl", "title", ["no field 'title'", "body, n", "text_field"]),
    ("body.jsonl", "n", ["'n' holds int64, not text", "body"]),
    ("broken.jsonl", None, ["cannot read", "as JSON Lines", "JSON parse error"]),
    ("broken.csv", None, ["cannot read", "as CSV", "EOF inside string"]),
    ("broken.parquet", None, ["cannot read", "as Parquet", "magic bytes"]),
    ("latin1.txt", None, ["cannot read", "as UTF-8 text", "can't decode byte 0xe9"]),
    ("latin1.txt", "body", ["plain text", "no field 'body'"]),
    ("plain_folder", None, ["not one written by Dataset.save_to_disk"]),
    ("two_splits", None, ["validation, test", "none is 'train'"]),
]


@pytest.mark.parametrize("name,field,words", BAD, ids=[f"{b[0]}-{b[1]}" for b in BAD])
def test_bad_input_is_one_line_naming_the_file(tmp_path, hf_home, capfd, caplog, name, field, words):
    _bad_files(tmp_path)
    capfd.readouterr()
    with pytest.raises(FisherkronError) as e:
        load_documents(tmp_path / name, text_field=field)
    msg = _one_line_naming(e, tmp_path / name)
    for w in words:
        assert w in msg, (w, msg)
    out, err = capfd.readouterr()
    assert out == err == "", (out, err)  # no progress bars
    assert not [r.getMessage() for r in caplog.records if r.name.startswith("datasets")]  # nor datasets' error log
    assert not hf_home.exists()


# -- enough tokens --------------------------------------------------------------------------------------
def _word_tokenizer():
    """A word-level tokenizer (one token per word) with an EOS: token counts are word counts."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["[UNK]", "<eos>", "the", "cat", "sat", "on", "a", "mat"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


def test_too_few_tokens_names_both_numbers(tmp_path):
    tok = _word_tokenizer()
    docs = ["the cat sat on the mat"] * 3  # 3 x (6 words + EOS) = 21 tokens
    with pytest.raises(FisherkronError) as e:
        check_enough_tokens(tok, docs, k=2, batch_size=3, seq_len=4, source=tmp_path / "c.txt")
    msg = _one_line_naming(e, tmp_path / "c.txt")
    assert "3 documents give 21 tokens" in msg and "2 x 3 x 4 = 24 are needed" in msg, msg
    assert check_enough_tokens(tok, docs, k=1, batch_size=5, seq_len=4) >= 20


@pytest.mark.parametrize("k,batch_size,seq_len", [(2, 3, 4), (1, 5, 4), (5, 1, 4), (1, 1, 21), (1, 1, 22)])
def test_the_check_passes_exactly_when_lm_batches_can_draw(k, batch_size, seq_len):
    tok = _word_tokenizer()
    docs = ["the cat sat on the mat"] * 3
    try:
        check_enough_tokens(tok, docs, k, batch_size, seq_len)
        ok = True
    except FisherkronError:
        ok = False
    try:
        lm_batches(tok, docs, k, batch_size=batch_size, seq_len=seq_len)
        drew = True
    except FisherkronError:
        drew = False
    assert ok == drew == (k * batch_size * seq_len <= 21)


# -- what --data names ----------------------------------------------------------------------------------
def test_data_source_tells_built_in_names_from_paths(tmp_path, monkeypatch):
    names = ("c4", "sst2", "boolq", "trec")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "c4").write_text("a file named like a built-in set")
    (tmp_path / "mine.txt").write_text("x")
    assert data_source("c4", names) == "c4"
    assert data_source("./c4", names).resolve() == (tmp_path / "c4").resolve()  # written as a path: the file
    assert str(data_source("mine.txt", names)) == "mine.txt"
    with pytest.raises(FisherkronError, match=r"^'sst' is neither a built-in data set \(c4, sst2, boolq, trec\)"):
        data_source("sst", names)
    with pytest.raises(FisherkronError, match="^no file or folder at corpus/x.jsonl"):
        data_source("corpus/x.jsonl", names)
