"""A damaged committed file is one line naming it, what is wrong and what to do; never a traceback.

``make readme``, ``make readme-check``, ``make verify`` and ``make book`` render or compare from committed
files (``figures/*.csv``, ``figures/*.provenance.json``, ``data/verify/*/*.json``). Each damage a user can
leave behind -- an empty or binary file, one cut short, one edited by hand into other JSON -- must stop the
tool with a non-zero status and one line on stderr that names the file and says how to restore it, and must
leave every output as it was. All of them go through :func:`fisherkron.env.read_committed`.
"""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fisherkron.core.conventions import FisherkronError
from fisherkron.env import csv_rows, json_object, read_committed
from fisherkron.repro import figures, readme, verify

ROOT = Path(__file__).resolve().parents[1]
FIGURES = ROOT / "figures"


def _cut_mid_row(p: Path) -> None:
    """The file cut short inside its last row (an interrupted copy, a truncated download)."""
    text = p.read_text(encoding="utf-8").rstrip("\n")
    p.write_text(text[: text.rindex(",")], encoding="utf-8")


def _cut_half(p: Path) -> None:
    data = p.read_bytes()
    p.write_bytes(data[: len(data) // 2])


def _edit_json(**fields):
    def edit(p: Path) -> None:
        rec = json.loads(p.read_text(encoding="utf-8"))
        for k, v in fields.items():
            if v is KeyError:
                rec.pop(k)
            else:
                rec[k] = v
        p.write_text(json.dumps(rec), encoding="utf-8")
    return edit


def _rename_column(old: str, new: str):
    def edit(p: Path) -> None:
        head, _, rest = p.read_text(encoding="utf-8").partition("\n")
        p.write_text(head.replace(old, new) + "\n" + rest, encoding="utf-8")
    return edit


EMPTY = lambda p: p.write_bytes(b"")  # noqa: E731
BINARY = lambda p: p.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\xff\xfe")  # noqa: E731
GARBAGE = lambda p: p.write_text("{\"name\": \"tab_time_algo\", <<<<<<< HEAD", encoding="utf-8")  # noqa: E731
A_LIST = lambda p: p.write_text("[1, 2, 3]\n", encoding="utf-8")  # noqa: E731

#: (file, damage, what the line says): every kind of damage, on each kind of committed file the tools read
DAMAGE = {
    "csv-empty": ("figures/tab_synthetic_gaps.csv", EMPTY, "is empty"),
    "csv-binary": ("figures/tab_synthetic_gaps.csv", BINARY, "is not text"),
    "csv-cut-short": ("figures/tab_synthetic_gaps.csv", _cut_mid_row, "cell(s), the header"),
    "record-garbage": ("figures/tab_time_algo.provenance.json", GARBAGE, "is not a provenance record"),
    "record-a-list": ("figures/tab_time_algo.provenance.json", A_LIST, "not a JSON object"),
    "record-edited": ("figures/tab_time_algo.provenance.json", _edit_json(wall_seconds="fast"),
                      "field 'wall_seconds' is text, not number"),
    "record-binary": ("figures/tab_time_algo.provenance.json", BINARY, "is not text"),
    "verify-cut-short": ("data/verify/amd-epyc/fig_time_algo.json", _cut_half, "is not a `make verify` record"),
    "verify-edited": ("data/verify/amd-epyc/fig_time_algo.json", _edit_json(worst="0.5"), "field 'worst' is text"),
    "verify-no-tables": ("data/verify/amd-epyc/fig_time_algo.json", _edit_json(tables=KeyError),
                         "field 'tables' is missing"),
    "verify-empty": ("data/verify/amd-epyc/fig_time_algo.json", EMPTY, "is empty"),
}


def _one_line(err: str, name: str, says: str) -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err and name in lines[0] and says in lines[0], lines[0]
    assert "git checkout --" in lines[0], lines[0]  # and what to do


# -- the README ----------------------------------------------------------------------------------
#: the front page's blocks: they read every provenance record and the tables the paper's items need
README_BLOCKS = ("results", "recipe")
#: the damage the front page meets (it reads no make-verify record)
README_DAMAGE = sorted(c for c in DAMAGE if not c.startswith("verify-"))


def _readme_tree(tmp_path: Path) -> Path:
    """A checkout's committed outputs in ``tmp_path`` and a README of blocks that read them, out of date (so
    ``make readme`` would rewrite it)."""
    for beside in ("data/verify", "notebooks/params"):
        shutil.copytree(ROOT / beside, tmp_path / beside)
    (tmp_path / "notebooks" / "executed").mkdir()  # the teaching item reads its committed run
    shutil.copy2(ROOT / "notebooks/executed/kronecker_fisher_from_scratch.ipynb", tmp_path / "notebooks" / "executed")
    shutil.copytree(FIGURES, tmp_path / "figures", ignore=shutil.ignore_patterns("*.png", "*.pdf", "*.tex"))
    text = "\n\n".join(f"<!-- generated:{b} -->\nstale\n<!-- /generated:{b} -->" for b in README_BLOCKS) + "\n"
    (tmp_path / "README.md").write_text(text, encoding="utf-8")
    return tmp_path / "README.md"


def test_the_readme_blocks_of_these_tests_render_from_intact_outputs(tmp_path):
    """The damage below is what fails, not the blocks: intact outputs render and rewrite the README."""
    path = _readme_tree(tmp_path)
    assert readme.main(["--check", str(path)]) == 1  # out of date, not broken
    assert readme.main([str(path)]) == 0 and "stale" not in path.read_text()
    assert readme.main(["--check", str(path)]) == 0


@pytest.mark.parametrize("case", README_DAMAGE + ["csv-column-renamed"])
@pytest.mark.parametrize("check", [False, True], ids=["readme", "readme-check"])
def test_a_damaged_committed_file_stops_make_readme_with_one_line(case, check, tmp_path, capsys):
    rel, damage, says = DAMAGE.get(case) or ("figures/tab_synthetic_gaps.csv", _rename_column("gap", "gapp"),
                                             "lack what this item reads")
    path = _readme_tree(tmp_path)
    damage(tmp_path / rel)
    before = path.read_bytes(), path.stat().st_mtime_ns
    assert readme.main([*(["--check"] if check else []), str(path)]) == 2
    _one_line(capsys.readouterr().err, Path(rel).name, says)
    assert (path.read_bytes(), path.stat().st_mtime_ns) == before  # nothing written
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".fisherkron-tmp-")]


def test_make_readme_on_a_damaged_table_prints_one_line_from_the_command(tmp_path):
    """The entry point ``python -m fisherkron.repro.readme`` (what ``make readme`` runs), end to end."""
    path = _readme_tree(tmp_path)
    BINARY(tmp_path / "figures" / "tab_synthetic_gaps.csv")
    run = subprocess.run([sys.executable, "-m", "fisherkron.repro.readme", "--check", str(path)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    _one_line(run.stderr, "tab_synthetic_gaps.csv", "is not text")
    assert "regenerate" in run.stderr or "re-run its notebook: `rm " in run.stderr


def test_a_binary_readme_is_one_line_too(tmp_path, capsys):
    path = _readme_tree(tmp_path)
    BINARY(path)
    assert readme.main([str(path)]) == 2
    _one_line(capsys.readouterr().err, "README.md", "is not text")


# -- make verify -----------------------------------------------------------------------------------
VERIFY_DAMAGE = {k: v for k, v in DAMAGE.items() if v[0].startswith("figures/")} | {
    "tolerance-edited": ("figures/tab_synthetic_gaps.provenance.json", _edit_json(tolerances={"gap": "approx"}),
                         "tolerance"),
}


def _verify_tree(tmp_path: Path) -> tuple[Path, Path, list[str]]:
    ref = Path(shutil.copytree(FIGURES, tmp_path / "ref", ignore=shutil.ignore_patterns(
        "*.png", "*.pdf", "*.tex", "*.md", "bench")))
    scratch = tmp_path / "verify"
    return ref, scratch, ["--ref", str(ref), "--scratch", str(scratch),
                          "--nb", "fig_synthetic_correlations,fig_time_algo"]


@pytest.mark.parametrize("case", sorted(VERIFY_DAMAGE))
def test_a_damaged_committed_file_stops_make_verify_before_anything_runs(case, tmp_path, monkeypatch, capsys):
    rel, damage, says = VERIFY_DAMAGE[case]
    ref, scratch, args = _verify_tree(tmp_path)
    damage(ref / Path(rel).name)
    ran = []
    monkeypatch.setattr(verify, "execute", lambda n, *a, **k: ran.append(n) or (True, 1.0, 1.0))
    monkeypatch.setattr(verify, "_data_env", lambda mode, s: ran.append("data") or ({}, mode))
    records = tmp_path / "records"
    assert verify.main([*args, "--record", str(records)]) == 2
    _one_line(capsys.readouterr().err, Path(rel).name, says)
    assert ran == [] and not scratch.exists() and not records.exists()  # nothing ran, nothing written
    assert verify.main([*args, "--no-run"]) == 2  # the comparison alone: the same line
    _one_line(capsys.readouterr().err, Path(rel).name, says)
    assert not (scratch / "report.json").exists()


def test_make_verify_on_a_damaged_record_prints_one_line_from_the_command(tmp_path):
    ref, scratch, args = _verify_tree(tmp_path)
    GARBAGE(ref / "tab_time_algo.provenance.json")
    run = subprocess.run([sys.executable, "-m", "fisherkron.repro.verify", *args, "--no-run"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    _one_line(run.stderr, "tab_time_algo.provenance.json", "is not a provenance record")


def test_a_damaged_table_a_run_wrote_is_named_with_make_verify_as_the_remedy(tmp_path, capsys):
    ref, scratch, args = _verify_tree(tmp_path)
    shutil.copytree(ref, scratch / "figures")
    EMPTY(scratch / "figures" / "tab_time_algo.csv")
    assert verify.main([*args, "--no-run"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "tab_time_algo.csv is empty" in err and "make verify` again" in err
    assert "git checkout" not in err  # not a committed file


@pytest.mark.parametrize("damage", [_cut_half, _edit_json(tables=[{"notebook": "notebooks/fig_time_algo.py"}])],
                         ids=["cut-short", "hand-edited"])
def test_a_damaged_report_to_record_from_writes_no_record(damage, tmp_path, capsys):
    ref, _, _ = _verify_tree(tmp_path)
    report = tmp_path / "report.json"
    report.write_text(json.dumps({"notebooks": ["fig_time_algo", "fig_synthetic_correlations"], "tables": []}))
    damage(report)
    records = tmp_path / "records"
    assert verify.main(["--ref", str(ref), "--record", str(records), "--record-from", str(report)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "report.json" in err and "Traceback" not in err
    assert not records.exists()


# -- the shared reader -------------------------------------------------------------------------------
def test_read_committed_names_the_file_says_what_is_wrong_and_what_to_do(tmp_path):
    p = tmp_path / "t.csv"
    with pytest.raises(FisherkronError, match=r"t\.csv is missing: restore it from git \(`git checkout -- .*t\.csv`\) "
                                              r"or run `make t`$"):
        read_committed(p, csv_rows, what="a CSV table", remake="run `make t`")
    p.write_text("a,b\n1,2\n3,4\n")
    assert read_committed(p, csv_rows) == [{"a": "1", "b": "2"}, {"a": "3", "b": "4"}]
    p.write_text("a,b\n1,2\n3\n")
    with pytest.raises(FisherkronError, match=r"row 2 has 1 cell\(s\), the header 2"):
        read_committed(p, csv_rows, what="a CSV table")
    p.write_text("\n\n")
    with pytest.raises(FisherkronError, match="is empty, not a CSV table"):
        read_committed(p, csv_rows, what="a CSV table")
    p.write_bytes(b"a,b\n1,\x002\n")  # a NUL byte decodes as UTF-8, but no committed text holds one
    with pytest.raises(FisherkronError, match="byte 6 is not text"):
        read_committed(p, csv_rows, what="a CSV table")
    with pytest.raises(FisherkronError, match=r"cannot read .*: write it again|is a directory"):
        read_committed(tmp_path, committed=False)


def test_json_objects_are_checked_field_by_field():
    parse = json_object({"worst": "number", "tables": "list"}, {"git": "object|null"})
    assert parse('{"worst": Infinity, "tables": [], "git": null}')["worst"] == float("inf")
    for text, why in [('{"worst": true, "tables": []}', "'worst' is bool, not number"),
                      ('{"worst": 1}', "'tables' is missing"),
                      ('{"worst": 1, "tables": [], "git": "abc"}', "'git' is text, not object or null"),
                      ('"worst"', "a JSON text, not a JSON object")]:
        with pytest.raises(ValueError, match=why):
            parse(text)


def test_the_committed_records_and_tables_all_read():
    """Every committed file passes the checks that refuse damaged ones (they are not too strict)."""
    for p in sorted(FIGURES.rglob("*.provenance.json")):
        figures.read_provenance(p)
    for p in sorted(FIGURES.rglob("*.csv")):
        figures.read_table(p)
        figures.read_table(p, frame=True)
    records = verify.read_records(ROOT / "data" / "verify")
    assert records and not list((ROOT / "data" / "verify").glob("*.json"))  # each in its CPU model's folder


# -- make book ---------------------------------------------------------------------------------------
def test_a_damaged_executed_notebook_stops_make_book_with_one_line(tmp_path, capsys):
    from fisherkron.repro.book.__main__ import main as book

    executed = Path(shutil.copytree(ROOT / "notebooks" / "executed", tmp_path / "executed"))
    first = sorted(executed.glob("*.ipynb"))[0]
    _cut_half(first)
    assert book(["sources", str(tmp_path / "src"), "--executed", str(executed)]) == 2
    _one_line(capsys.readouterr().err, first.name, "is not an executed notebook")

    assert book(["strip", str(first), str(tmp_path / "committed.ipynb")]) == 2  # the copy make commits
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and first.name in err and f"make {first.stem}" in err
    assert not (tmp_path / "committed.ipynb").exists()


# -- make readme (the front page's results, rendered from the summary records and their tables) ------------
@pytest.mark.parametrize("case", ["csv-empty", "csv-binary", "csv-cut-short", "record-garbage", "record-a-list"])
def test_a_damaged_committed_file_stops_the_front_page_render_with_one_line(case, tmp_path):
    from fisherkron.repro import readme as front

    rel, damage, says = DAMAGE[case]
    figs = Path(shutil.copytree(FIGURES, tmp_path / "figures", ignore=shutil.ignore_patterns("*.png", "*.pdf")))
    shutil.copytree(ROOT / "notebooks" / "executed", tmp_path / "notebooks" / "executed")
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    front.render(text, figs)  # intact: renders
    damage(tmp_path / rel)
    with pytest.raises(FisherkronError) as err:
        front.render(text, figs)
    _one_line(str(err.value), Path(rel).name, says)
