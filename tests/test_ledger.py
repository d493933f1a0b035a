"""The ledger keeps a long study's finished scores and sweeps, and gives them back only where the cache lacks them."""
import json

from fisherkron.repro import ledger


def _write(path, obj):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj))


def test_save_keeps_scores_and_sweeps_only(tmp_path):
    cache, book = tmp_path / "cache", tmp_path / "ledger"
    _write(cache / "studies" / "llm_compression" / "abc.json", {"key": "abc", "result": {"ppl": 1.0}})
    _write(cache / "allocation" / "sensitivity-k1.json", {"layers": {}})
    _write(cache / "allocation" / "other.json", {"x": 1})  # not a sweep
    _write(cache / "calibration" / "k" / "stats.json", {"x": 1})  # statistics are never kept
    (cache / "studies" / "half.json").write_text('{"key": ')  # a file being written
    assert sorted(ledger.save(cache, book)) == ["allocation/sensitivity-k1.json", "studies/llm_compression/abc.json"]
    assert ledger.save(cache, book) == []  # nothing new
    _write(cache / "allocation" / "sensitivity-k1.json", {"layers": {"a": 1}})  # the sweep grew
    assert ledger.save(cache, book) == ["allocation/sensitivity-k1.json"]
    assert json.loads((book / "allocation" / "sensitivity-k1.json").read_text()) == {"layers": {"a": 1}}


def test_restore_never_overwrites_the_cache(tmp_path):
    cache, book = tmp_path / "cache", tmp_path / "ledger"
    _write(book / "studies" / "llm_compression" / "abc.json", {"key": "abc", "v": "ledger"})
    _write(book / "studies" / "llm_compression" / "def.json", {"key": "def", "v": "ledger"})
    _write(cache / "studies" / "llm_compression" / "def.json", {"key": "def", "v": "cache"})
    assert ledger.restore(cache, book) == ["studies/llm_compression/abc.json"]
    assert json.loads((cache / "studies" / "llm_compression" / "def.json").read_text())["v"] == "cache"
    assert json.loads((cache / "studies" / "llm_compression" / "abc.json").read_text())["v"] == "ledger"
    assert ledger.restore(cache, book) == []


def test_command_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FISHERKRON_DATA", str(tmp_path))
    _write(tmp_path / "cache" / "studies" / "a.json", {"key": "a"})
    assert ledger.main(["save"]) == 0
    assert "1 file(s)" in capsys.readouterr().out
    assert (tmp_path / "ledger" / "studies" / "a.json").is_file()
