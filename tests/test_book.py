"""The committed executed notebooks and the book's sources; no notebook runs.

The browser test of the built site is tests/test_book_browser.py (`make book-test`).
"""
import copy
import json
import os
import subprocess
from pathlib import Path

import nbformat
import pytest

from fisherkron.core.conventions import FisherkronError
from fisherkron.repro.book import sources
from fisherkron.repro import claims
from fisherkron.repro.book.executed import strip_volatile, write_executed

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted(p.stem for p in (ROOT / "notebooks").glob("*.py"))


def _papermill_notebook() -> dict:
    """An executed notebook as papermill leaves it: timings, paths and random cell ids."""
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell("# Title"),
                nbformat.v4.new_code_cell("x = 1", metadata={"tags": ["parameters"]}),
                nbformat.v4.new_code_cell("print(x)", execution_count=2,
                                          outputs=[nbformat.v4.new_output("stream", text="1\n")]),
                nbformat.v4.new_code_cell("print(x)")]  # the same source twice
    nb.metadata["papermill"] = {"parameters": {"x": 1}, "duration": 1.5, "start_time": "2026-01-01T00:00:00",
                                "input_path": "build/notebooks/default/t.src.ipynb", "exception": None}
    for cell in nb.cells:
        cell.metadata["papermill"] = {"duration": 0.1, "status": "completed"}
        if cell.cell_type == "code":
            cell.metadata["execution"] = {"iopub.status.idle": "2026-01-01T00:00:01Z"}
    return json.loads(nbformat.writes(nb))


def test_strip_volatile_keeps_what_a_reader_sees_and_nothing_that_changes_per_run():
    nb = _papermill_notebook()
    out = strip_volatile(nb)
    assert out["metadata"]["papermill"] == {"parameters": {"x": 1}}
    assert all(set(c["metadata"]) <= {"tags"} for c in out["cells"])
    assert out["cells"][1]["metadata"]["tags"] == ["parameters"]
    assert out["cells"][2]["outputs"] == nb["cells"][2]["outputs"]
    assert out["cells"][2]["execution_count"] == 2
    ids = [c["id"] for c in out["cells"]]
    assert len(set(ids)) == len(ids), ids  # equal sources still get distinct ids
    rerun = copy.deepcopy(nb)  # a re-run: new random ids and times, same results
    for i, cell in enumerate(rerun["cells"]):
        cell["id"] = f"rnd{i}"
        cell["metadata"]["papermill"]["duration"] = 9.9
    rerun["metadata"]["papermill"]["duration"] = 7.0
    assert strip_volatile(rerun) == out
    assert strip_volatile(out) == out
    assert nb["metadata"]["papermill"]["duration"] == 1.5  # the input is not modified


def test_a_cells_stderr_is_kept_settled_each_bar_at_the_furthest_it_got():
    """A sweep's nested progress bars write thousands of stderr outputs (carriage returns, cursor-up escapes)
    and a library repeats its warning in every case; the committed copy keeps one output per run of them: each
    bar once at the furthest it got, each warning once, no control character. stdout and displays are left as they
    were, in their order."""
    bar = []
    for i in range(300):  # an outer bar and a nested one below it, as tqdm writes them, and a warning per case
        bar += [f"\rcases: {i // 3:3d}%|#| {i}/300", "\n", f"\rsweep: {i % 7}it [00:0{i % 7}]", "\x1b[A",
                "\x1b[33mkwarg is not a str\x1b[0m\n"]
    bar += ["\n", "\r" + " " * 20, "\x1b[A", "\rcases: 100%|#| 300/300", "\n"]
    stream = [{"output_type": "stream", "name": "stderr", "text": s} for s in bar]
    table = {"output_type": "display_data", "data": {"text/plain": ["x"]}, "metadata": {}}
    said = {"output_type": "stream", "name": "stdout", "text": ["\rkept as printed\n", "\n"]}
    nb = {"nbformat": 4, "nbformat_minor": 5, "metadata": {}, "cells": [
        {"cell_type": "code", "id": "a", "source": "run()", "execution_count": 1, "metadata": {},
         "outputs": stream + [table, said] + [{"output_type": "stream", "name": "stderr", "text": "\n\n"}]}]}
    out = strip_volatile(nb)["cells"][0]["outputs"]
    assert out[0] == {"output_type": "stream", "name": "stderr",
                      "text": "cases: 100%|#| 300/300\nsweep: 6it [00:06]\nkwarg is not a str\n"}
    assert out[1:] == [table, said]  # the empty stderr after them is gone
    assert strip_volatile(strip_volatile(nb)) == strip_volatile(nb)


def test_write_executed_writes_a_valid_notebook_atomically(tmp_path):
    src = tmp_path / "run.ipynb"
    src.write_text(json.dumps(_papermill_notebook()))
    dst = tmp_path / "executed" / "t.ipynb"
    write_executed(src, dst)
    nbformat.validate(nbformat.read(dst, as_version=4))
    text = dst.read_text()
    assert "duration" not in text and "iopub" not in text and "input_path" not in text
    assert sorted(p.name for p in dst.parent.iterdir()) == ["t.ipynb"]  # no temporary left
    write_executed(src, dst)
    assert dst.read_text() == text  # a second run of the same results: no diff


def test_every_notebook_has_a_place_in_the_books_order():
    placed = [name for name, _, _ in sources.PAGES]
    assert len(set(placed)) == len(placed)
    assert placed[0] == "kronecker_fisher_from_scratch"  # the teaching notebook opens the book
    missing = sorted(set(NOTEBOOKS) - set(placed))
    assert not missing, f"add these notebooks to PAGES in fisherkron/repro/book/sources.py: {missing}"
    assert set(placed) <= set(NOTEBOOKS), sorted(set(placed) - set(NOTEBOOKS))


def test_sources_show_the_executed_notebook_or_the_committed_outputs(tmp_path):
    executed = tmp_path / "executed"
    executed.mkdir()
    run = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# The synthetic study"),
                                          nbformat.v4.new_code_cell("1 + 1", execution_count=1, outputs=[
                                              nbformat.v4.new_output("execute_result", {"text/plain": "2"},
                                                                     execution_count=1)])])
    nbformat.write(run, executed / "fig_synthetic_correlations.ipynb")
    out = tmp_path / "src"
    book = sources.write_sources(out, executed=executed)

    assert [p.name for p in book] == [n for n, _, _ in sources.PAGES if n in NOTEBOOKS]
    assert {p.name for p in book if p.executed} == {"fig_synthetic_correlations"}
    page = nbformat.read(out / "fig_synthetic_correlations.ipynb", as_version=4)
    assert page.cells[0].source == "# The synthetic study"
    result = page.cells[1].source  # the result comes right below the title and claim, before any code
    assert result.startswith("::::{admonition} Result\n:class: result")
    assert "Fig. diag_full_synth" in result and "**holds" in result
    assert "_figures/fig_diag_full_synth.png" in result and (out / "_figures/fig_diag_full_synth.png").is_file()
    assert page.cells[2].outputs[0]["data"]["text/plain"] == "2"
    assert "Not run yet" not in json.dumps(page)

    other = nbformat.read(out / "fig_time_algo.ipynb", as_version=4)
    assert other.cells[0].source.startswith("# ")
    assert "{admonition} Result" in other.cells[1].source and "{admonition} Not run yet" in other.cells[1].source
    committed = other.cells[2].source
    assert committed.startswith("## Committed outputs")
    assert "![fig_time_algo](_figures/fig_time_algo.png)" in committed and (out / "_figures/fig_time_algo.png").is_file()
    assert (ROOT / "figures/tab_time_algo.md").read_text().strip() in committed
    assert "\n".join(json.loads((ROOT / "figures/fig_singular_values_summary.provenance.json").read_text())["extra"]["lines"]) \
        in nbformat.read(out / "fig_singular_values.ipynb", as_version=4).cells[1].source
    params = [c for c in other.cells if "parameters" in c.metadata.get("tags", [])]
    assert params and all("hide-input" in c.metadata["tags"] for c in params)  # collapsed

    index = (out / "index.md").read_text()
    items = [line for line in index.splitlines() if line.startswith("| ") and "**" in line and ": " in line]
    assert len(items) == len(claims.ITEMS) == 20, items  # the paper's 19 items and the scale study
    assert all(any(f"**{v}**" in line for v in claims.VERDICTS) for line in items)
    assert "[page](fig_synthetic_correlations.ipynb)" in index and "guide\nreproduce" in index
    assert (out / "conf.py").read_text() == (ROOT / "book/conf.py").read_text()
    assert (out / "guide.md").is_file() and (out / "_bookstatic/fisherkron.css").is_file()
    assert (out / "_mathjax/mathjax/tex-svg.js").is_file()  # conf.py's mathjax_path, served locally


def test_a_damaged_verify_record_is_one_line_naming_it(tmp_path):
    root = tmp_path / "repo"
    (root / "data" / "verify" / "amd-epyc").mkdir(parents=True)
    (root / "data" / "verify" / "amd-epyc" / "fig_x.json").write_text('{"notebook": "fig_x", "res')
    with pytest.raises(FisherkronError, match=r"fig_x\.json.*git checkout"):
        sources._verify_results(root)


def test_a_verify_result_whose_table_was_committed_since_is_out_of_date(tmp_path):
    from fisherkron.repro import verify

    root = tmp_path / "repo"
    (root / "figures").mkdir(parents=True)
    (root / "figures" / "tab_x.csv").write_text("a\n1\n")
    report = {"notebooks": ["fig_x"], "tables": [{"name": "tab_x", "notebook": "notebooks/fig_x.py",
                                                  "status": "PASS", "columns": 1, "values": 1, "worst": 0.0}]}
    verify.write_records(root / "data" / "verify", report | {"machine": {"cpu": "AMD EPYC"}}, root / "figures")
    assert sources._verify_results(root) == {"fig_x": "PASS on AMD EPYC"}
    (root / "figures" / "tab_x.csv").write_text("a\n2\n")  # the table regenerated after the verify
    assert sources._verify_results(root) == {"fig_x": "PASS, out of date on AMD EPYC"}
    # a run on another CPU model keeps its own record beside the first
    assert verify.write_records(root / "data" / "verify", report | {"machine": {"cpu": "Intel(R) Xeon(R) Processor"}},
                                root / "figures")[0] == root / "data" / "verify" / "intel-xeon" / "fig_x.json"
    assert sources._verify_results(root) == {"fig_x": "PASS, out of date on AMD EPYC; PASS on Intel Xeon"}


def _make_dry_run(*args: str) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS", "MAKEOVERRIDES")}
    r = subprocess.run(["make", "--no-print-directory", "-n", *args], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


@pytest.mark.parametrize("overrides,commits", [
    ((), True),
    (("PROFILE=smoke",), False),
    (("PROFILE=paper",), False),
    (("FIGDIR=build/verify/figures",), False),
    (("NB_BUILD=build/verify/notebooks",), False),
])
def test_only_a_default_run_into_figures_writes_the_committed_executed_notebook(overrides, commits):
    plan = _make_dry_run("-B", "fig_time_algo", *overrides)
    assert "fisherkron.repro.execute fig_time_algo" in plan  # the notebook runs
    committed = "fisherkron.repro.book strip build/notebooks/default/fig_time_algo.ipynb " \
                "notebooks/executed/fig_time_algo.ipynb"
    assert (committed in plan) == commits, plan
    assert ("notebooks/executed/" in plan) == commits


def test_make_book_never_runs_a_notebook():
    """The book reads figures/ and notebooks/executed/; making them is the notebooks' business."""
    plan = _make_dry_run("-W", "notebooks/fig_time_algo.py", "-W", "fisherkron/core/wsvd.py", "book")
    assert "papermill" not in plan and "jupytext" not in plan, plan


def test_the_committed_copy_shows_no_path_of_the_machine_that_ran_it(tmp_path):
    nb = _papermill_notebook()
    nb["cells"][2]["outputs"] = [
        nbformat.v4.new_output("execute_result", {"text/plain": "[PosixPath('/home/ann/repo/figures/fig_x.png')]"},
                               execution_count=3),
        nbformat.v4.new_output("stream", name="stdout", text="records in /srv/ci/clone/data/cache/studies/x.json\n")]
    src = tmp_path / "run.ipynb"
    src.write_text(json.dumps(nb))
    text = write_executed(src, tmp_path / "executed" / "t.ipynb").read_text()
    assert "/home/ann" not in text and "/srv/ci" not in text
    assert "figures/fig_x.png" in text and "data/cache/studies/x.json" in text


def test_a_page_whose_code_changed_since_its_run_says_so():
    def nb(*codes, injected=False):
        cells = [nbformat.v4.new_markdown_cell("# T")]
        if injected:
            cells.append(nbformat.v4.new_code_cell("x = 2", metadata={"tags": ["injected-parameters"]}))
        cells += [nbformat.v4.new_code_cell(c) for c in codes]
        return nbformat.v4.new_notebook(cells=cells)

    src = nb("x = 1", "print(x)\n")
    assert sources.changed_code_cells(nb("x = 1", "print(x)", injected=True), src) == 0  # papermill's cell, spaces
    assert sources.changed_code_cells(nb("x = 1", "print(x + 1)", injected=True), src) == 1
    assert sources.changed_code_cells(nb("x = 1"), src) == 1  # a cell added since the run
    assert sources.changed_code_cells(nb("y = 1", "print(y)", "z"), src) == 3
    assert sources.changed_code_cells(nb("x = 1", "print(x)"), nb("x = 1", "import os", "print(x)")) == 1  # inserted


def test_the_book_flags_an_executed_page_whose_code_changed(tmp_path):
    executed = tmp_path / "executed"
    executed.mkdir()
    run = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# The synthetic study"),
                                          nbformat.v4.new_code_cell("1 + 1")])  # not the source's code
    nbformat.write(run, executed / "fig_synthetic_correlations.ipynb")
    sources.write_sources(tmp_path / "src", executed=executed)
    page = nbformat.read(tmp_path / "src" / "fig_synthetic_correlations.ipynb", as_version=4)
    result = page.cells[1].source
    assert result.startswith("::::{admonition} Result") and "{admonition} The code changed since this run" in result
    assert "`make fig_synthetic_correlations` runs it again" in result
