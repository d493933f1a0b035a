"""README.md's numbers against the committed outputs (issue 24, "numbers that cannot drift").

Every number of the README's results sections sits in a generated block that
``fisherkron.experiments.readme`` renders from ``figures/`` (tables, summary records, wall times).
These tests render every block and compare, so ``make test`` fails when a hand edit of the README
or a regenerated table leaves the two apart. No notebook runs.
"""
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fisherkron.core.conventions import FisherkronError
from fisherkron.experiments import readme

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
FIGURES = ROOT / "figures"


def _text() -> str:
    return README.read_text(encoding="utf-8")


def _figures_copy(tmp_path: Path) -> Path:
    """The tables and records of figures/ (no images) in a folder the test may edit, with what the README
    also renders from beside it (the verify records in data/verify/, the notebooks' parameter files)."""
    images = shutil.ignore_patterns("*.png", "*.pdf", "*.tex")
    for beside in ("data/verify", "notebooks/params"):
        shutil.copytree(ROOT / beside, tmp_path / beside)
    return Path(shutil.copytree(FIGURES, tmp_path / "figures", ignore=images))


def _block(text: str, name: str) -> str:
    return next(body for n, body, _ in readme.blocks(text) if n == name)


def test_readme_numbers_match_the_committed_outputs():
    problems = readme.check(_text(), FIGURES)
    assert not problems, "\n\n".join(problems)  # each message names its block and says `make readme`


def test_every_renderer_has_a_block_in_the_readme():
    """A results section whose markers were deleted would no longer be checked: every renderer is used."""
    used = {name.partition(":")[0] for name, _, _ in readme.blocks(_text())}
    assert set(readme.renderers()) <= used, sorted(set(readme.renderers()) - used)
    notebooks = {p.stem for p in (ROOT / "notebooks").glob("*.py")}
    timed = {name.partition(":")[2] for name, _, _ in readme.blocks(_text()) if name.startswith("time:")}
    assert notebooks <= timed, f"notebooks without a run time in the reproduction table: {sorted(notebooks - timed)}"


def test_planted_drift_in_the_readme_is_caught_and_repaired(tmp_path):
    text = _text()
    gaps = _block(text, "synthetic-gaps")
    line = next(ln for ln in gaps.splitlines() if ln.startswith("| FWSVD |"))
    m = re.search(r"\*\*([+\u2212])(\d+)\.(\d) ± (\d+\.\d)\*\*", line)  # FWSVD's bold gap, e.g. **+6.3 ± 0.9**
    cell = m.group(0)
    planted = f"**{m[1]}{m[2]}.{(int(m[3]) + 1) % 10} ± {m[4]}**"  # its first decimal moved by one
    assert planted != cell
    copy = tmp_path / "README.md"
    copy.write_text(text.replace(gaps, gaps.replace(cell, planted)), encoding="utf-8")

    problems = readme.check(copy.read_text(encoding="utf-8"), FIGURES)
    assert len(problems) == 1
    assert "'synthetic-gaps'" in problems[0] and "make readme" in problems[0]
    assert "-" + line.replace(cell, planted) in problems[0]  # the diff shows the line

    cmd = [sys.executable, "-m", "fisherkron.experiments.readme", str(copy), "--figures", str(FIGURES)]
    r = subprocess.run([*cmd, "--check"], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "'synthetic-gaps'" in r.stderr and "make readme" in r.stderr
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path)  # `make readme`
    assert r.returncode == 0, r.stderr
    assert copy.read_text(encoding="utf-8") == text


def test_planted_drift_in_an_inline_table_cell_is_caught(tmp_path):
    text = _text()
    cell = re.search(r"<!-- generated:time:fig_time_algo -->(.*?)<!-- /generated:time:fig_time_algo -->", text)
    planted = text.replace(cell.group(0), cell.group(0).replace(cell.group(1), "259 s"))
    assert planted != text
    problems = readme.check(planted, FIGURES)
    assert [p.split("\n")[0] for p in problems] == [
        "README block 'time:fig_time_algo' differs from the committed outputs: run `make readme`"]


def test_a_changed_table_fails_the_readme_until_it_is_rendered_again(tmp_path):
    """The other direction: a regenerated figures/ table with another value fails the unchanged README."""
    figures = _figures_copy(tmp_path)
    table = figures / "tab_rank_allocation.csv"
    rows = table.read_text().split("\n")
    i = next(i for i, r in enumerate(rows) if r.startswith("gfwsvd,sensitivity,0.1,"))
    cells = rows[i].split(",")
    cells[4] = "171.65643930000232"  # ppl_ptb: 151.7 -> 171.7
    rows[i] = ",".join(cells)
    table.write_text("\n".join(rows))

    names = {p.split("'")[1] for p in readme.check(_text(), figures)}
    # the verify block too while fig_rank_allocation's record vouches for the table as it was committed (once
    # the table changed after its verify, the block already says so and an edit changes nothing there)
    from fisherkron.experiments.readme.reproduce import _changed_since, verify_records
    rec = verify_records(readme.Outputs(FIGURES))["fig_rank_allocation"]
    vouches = "tab_rank_allocation" not in _changed_since(readme.Outputs(FIGURES), rec)
    assert names == {"rank-allocation", "rank-allocation-headline", "rank-allocation-verdicts"} | (
        {"verify-record"} if vouches else set())
    fixed = readme.render(_text(), figures)
    assert readme.check(fixed, figures) == []
    assert "| GFWSVD | sensitivity (the paper's) | **88** | 172 |" in _block(fixed, "rank-allocation")


def test_a_verdict_text_in_another_format_is_an_error_not_a_wrong_readme(tmp_path):
    figures = _figures_copy(tmp_path)
    rec = figures / "tab_glue_results_summary.provenance.json"
    rec.write_text(rec.read_text().replace("closest", "nearest"))
    with pytest.raises(FisherkronError, match="tab_glue_results_summary.*format"):
        readme.check(_text(), figures)


def test_markers_are_checked():
    with pytest.raises(FisherkronError, match="no renderer.*'nope'|'nope'.*no renderer"):
        readme.render("<!-- generated:nope -->\nx\n<!-- /generated:nope -->", FIGURES)
    with pytest.raises(FisherkronError, match="unpaired"):
        readme.blocks("<!-- generated:spectrum -->\nx\n")
    with pytest.raises(FisherkronError, match="unpaired"):
        readme.blocks("<!-- generated:spectrum -->\nx\n<!-- /generated:throughput -->")


def test_a_block_inside_a_list_item_keeps_its_indent():
    text = "* item:\n\n  <!-- generated:synthetic-setup -->\n  old\n  <!-- /generated:synthetic-setup -->\n* next\n"
    out = readme.render(text, FIGURES)
    body = _block(out, "synthetic-setup")
    assert all(line.startswith("  ") for line in body.strip("\n").split("\n") if line)
    assert readme.check(out, FIGURES) == []


@pytest.mark.parametrize("line", [
    "* **Holds:** 70 of SmolLM2's 210 layers (33 %) have `σ₁/σ₂ > 3`, as 74 of Llama-2-7B-chat's 224 (33 %) in "
    "the paper; MiniLM 10 of 36 (28 %) and at r = 1. then more words follow here to wrap",
    "  - a nested item with [a link whose text has spaces](figures/x.md) and `code with spaces` " * 3,
    "plain text - with a dash + plus > quote # hash 1. one 2) two " * 4,
])
def test_wrapped_lines_stay_the_same_markdown(line):
    lines = readme.wrap(line, 60)
    assert " ".join(" ".join(lines).split()) == " ".join(line.split())  # nothing lost, nothing added
    for x in lines[1:]:
        first = x.split()[0]
        assert not re.fullmatch(r"\d+[.)]|[-+*>#=|]+", first), x  # would start a list, quote or heading
        assert not first.startswith("%"), x
    assert all(len(x) <= 60 or " " not in x.strip() or "`" in x or "[" in x for x in lines)


def test_a_long_study_renders_pending_until_its_outputs_land_then_its_table_and_verdicts(tmp_path):
    """A study not yet run shows no number; once its table and summary are committed, the block is the
    committed Markdown table (with the caption the notebook recorded) and the notebook's own verdict lines."""
    import pandas as pd

    from fisherkron.experiments import figures
    text = ("<!-- generated:study-table:tab_ablation_diag -->\n<!-- /generated:study-table:tab_ablation_diag -->\n"
            "<!-- generated:study-verdicts:tab_ablation_diag -->\n<!-- /generated:study-verdicts:tab_ablation_diag -->\n")
    pending = readme.render(text, tmp_path)
    assert "Not yet run: `make tab_ablation_diag`" in pending and not re.search(r"\d", pending.replace(
        "tab_ablation_diag", ""))
    figures.save_table(pd.DataFrame({"Method": ["GFWSVD"], "PTB": [123.4]}), "tab_ablation_diag", tmp_path, {},
                       caption="PTB perplexity at 10 %.", notebook="notebooks/tab_ablation_diag.py")
    figures.write_provenance(tmp_path, "tab_ablation_diag_summary", figures.provenance(
        "tab_ablation_diag_summary", {}, extra={"lines": ["* The ordering **does not hold**."]}))
    done = readme.render(pending, tmp_path)
    assert "| GFWSVD | 123.4 |" in done and "PTB perplexity at 10 %." in done
    assert "* The ordering **does not hold**." in done and "Not yet run" not in done
    assert readme.check(done, tmp_path) == [] and readme.check(pending, tmp_path) != []


def test_the_decoder_headline_ranks_gfwsvd_by_ptb_in_the_best_allocation_block(tmp_path):
    """The headline reads the summary's rows: per ratio GFWSVD's place by PTB perplexity among the methods of
    the "best allocation here" block (the paper block is ignored), and who is ahead of it."""
    from fisherkron.experiments import figures
    rows = [{"block": "best", "target": 0.2, "method": m, "ppl_ptb": p}
            for m, p in (("gfwsvd", 300.0), ("kfac_svd", 200.0), ("svd_llm", 400.0))]
    rows += [{"block": "paper", "target": 0.2, "method": "asvd", "ppl_ptb": 100.0},
             {"block": "best", "target": 0.3, "method": "gfwsvd", "ppl_ptb": 500.0},
             {"block": "best", "target": 0.3, "method": "svd_llm", "ppl_ptb": 600.0}]
    figures.write_provenance(tmp_path, "tab_x_summary", figures.provenance(
        "tab_x_summary", {}, extra={"rows": rows, "verdict": {"dense": {"ppl_ptb": 50.0}}}))
    text = readme.renderers()["decoder-headline"](readme.Outputs(tmp_path), "tab_x")
    assert "is not ahead" in text and "first by PTB perplexity at 1 of 2 ratios" in text
    assert "20 %: GFWSVD 300 (6.0× dense), second of 3; ahead of it: KFAC-SVD 200." in text
    assert "30 %: GFWSVD 500 (10.0× dense), first of 2." in text and "ASVD" not in text


def test_the_bench_note_says_a_run_is_older_than_the_code_only_when_it_is(tmp_path):
    """A clean run of today's runner reproduces from its commit; a runner that is gone or a dirty tree does not
    (the note once said "older than the code" of every run)."""
    import json

    shutil.copytree(ROOT / "figures" / "bench", tmp_path / "bench")
    rec_file = tmp_path / "bench" / "bench_mff.provenance.json"
    rec = json.loads(rec_file.read_text())

    def note(**change):
        rec_file.write_text(json.dumps({**rec, **change}))
        return readme.renderers()["bench-run"](readme.Outputs(tmp_path))

    ok = {"git": {"commit": "0123456789", "dirty": False}, "notebook": "scripts/bench_mff.py"}
    assert "older than the code" not in note(**ok) and "commit `0123456`" in note(**ok)
    assert "uncommitted changes, so no commit" in note(**{**ok, "git": {"commit": "0123456789", "dirty": True}})
    assert "`fisherkron/bench.py`, which no longer exists" in note(**{**ok, "notebook": "fisherkron/bench.py"})


def test_the_gpu_target_is_met_missed_or_not_measured_by_the_committed_gpu_run(tmp_path):
    """The GPU row of the speed targets reads figures/bench/gpu/ (scripts/gpu_check.sh); without it, not measured."""
    import csv

    from fisherkron.experiments.readme.layer_studies import BENCH_GPU_S, gpu_target

    shutil.copy(ROOT / "figures" / "tab_time_algo.csv", tmp_path)
    assert gpu_target(readme.Outputs(tmp_path)).startswith("**not measured**")
    shutil.copytree(ROOT / "figures" / "bench" / "gpu", tmp_path / "bench" / "gpu")
    text = gpu_target(readme.Outputs(tmp_path))
    with open(ROOT / "figures" / "bench" / "gpu" / "bench_mff.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    main = next(r for r in rows if (r["n"], r["m"], r["k"]) == ("11008", "4096", "75"))
    slowest = max(float(main["ours_s"]), float(main["ident_s"]))
    assert text.startswith("**met**" if slowest <= BENCH_GPU_S else "**missed**")
    with open(ROOT / "figures" / "tab_time_algo.csv", newline="") as fh:
        quoted = next(float(r["paper GPU seconds"]) for r in csv.DictReader(fh) if r["layer (n x m)"] == "11008 x 4096")
    assert f"**{float(main['ours_s']):.1f} s** from the K-FAC start" in text and f"gives {quoted:.0f} s" in text
    main["ident_s"] = str(BENCH_GPU_S + 0.5)  # one start over the target: missed
    with open(tmp_path / "bench" / "gpu" / "bench_mff.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    assert gpu_target(readme.Outputs(tmp_path)).startswith("**missed**")


def test_the_verify_block_says_what_each_run_found_and_which_tables_changed_since(tmp_path):
    import json

    from fisherkron.env import file_checksum

    figs = tmp_path / "figures"
    figs.mkdir()
    (figs / "tab_a.csv").write_text("x,y\n1,2\n")
    params = tmp_path / "notebooks" / "params"
    params.mkdir(parents=True)
    for nb in ("nb_a", "nb_b"):
        (params / f"{nb}.default.yaml").write_text("x: 1\n")
    render = readme.renderers()["verify-record"]
    assert "No notebook has been verified yet" in render(readme.Outputs(figs))

    rec = {"notebook": "nb_a", "result": "PASS", "values": 2, "worst": 0.5, "failures": [],
           "tables": [{"name": "tab_a", "status": "PASS", "columns": 2, "values": 2, "worst": 0.5,
                       "sha": file_checksum(figs / "tab_a.csv")}],
           "seconds": 754.0, "cpu_seconds": 1400.0, "others_cpu_share": 0.02, "data": "fresh",
           "git": {"commit": "0123456789abcdef" * 2 + "01234567", "dirty": False},
           "machine": {"cpu": "AMD EPYC", "cpu_count": 2}, "finished": "2026-11-25T14:00:00Z"}
    (tmp_path / "data" / "verify").mkdir(parents=True)
    (tmp_path / "data" / "verify" / "nb_a.json").write_text(json.dumps(rec))
    text = render(readme.Outputs(figs))
    assert "| `nb_a` | PASS | 1 | 2 | 0.50 | fresh | 13 min | idle | 2-core AMD EPYC | 0123456 | 2026-11-25 |" in text
    assert "outside their tolerance in these runs: none." in text and "Not yet verified: `nb_b`." in text
    assert "verify again" not in text and "another CPU model" not in text

    # the committed table written on another CPU model than the verify ran on: the block says so
    (figs / "tab_a.provenance.json").write_text(json.dumps({"machine": {"cpu": "Intel(R) Xeon(R) Processor"}}))
    assert "another CPU model" in render(readme.Outputs(figs)) and "(AMD EPYC against Intel Xeon)" in \
        render(readme.Outputs(figs))
    (figs / "tab_a.provenance.json").write_text(json.dumps({"machine": {"cpu": "AMD EPYC"}}))
    assert "another CPU model" not in render(readme.Outputs(figs))

    (figs / "tab_a.csv").write_text("x,y\n1,3\n")  # the table regenerated after the run: the run no longer vouches
    text = render(readme.Outputs(figs))
    assert "PASS (since then `tab_a` changed)" in text and "(verify again): `nb_a`." in text

    rec.update(result="FAIL", failures=["tab_a row 1 (1) column 'y': committed 2, now 3"], others_cpu_share=0.4)
    (tmp_path / "data" / "verify" / "nb_a.json").write_text(json.dumps(rec))
    text = render(readme.Outputs(figs))
    assert "shared (40 % other work)" in text
    # a failing run on another CPU model is no verification there (the block once listed it as one)
    (figs / "tab_a.provenance.json").write_text(json.dumps({"machine": {"cpu": "Intel(R) Xeon(R) Processor"}}))
    (figs / "tab_a.csv").write_text("x,y\n1,2\n")
    rec["tables"][0]["sha"] = file_checksum(figs / "tab_a.csv")
    (tmp_path / "data" / "verify" / "nb_a.json").write_text(json.dumps(rec))
    failing = render(readme.Outputs(figs))
    assert "| FAIL |" in failing and "another CPU model" not in failing
    rec.update(result="PASS", failures=[])
    (tmp_path / "data" / "verify" / "nb_a.json").write_text(json.dumps(rec))
    assert "(AMD EPYC against Intel Xeon)" in render(readme.Outputs(figs))
    (figs / "tab_a.csv").write_text("x,y\n1,3\n")  # changed since: no longer vouched for on either CPU
    assert "another CPU model" not in render(readme.Outputs(figs))
    # failing again, and an exact column (a count) changed: its margin is infinite
    rec.update(result="FAIL", failures=["tab_a row 1 (1) column 'y': committed 2, now 3"], worst=float("inf"))
    (tmp_path / "data" / "verify" / "nb_a.json").write_text(json.dumps(rec))
    assert "| FAIL (since then `tab_a` changed) | 1 | 2 | an exact value differs |" in render(readme.Outputs(figs))
    assert "in these runs: 1:\n* `nb_a`: tab_a row 1 (1) column 'y': committed 2, now 3" in text


def test_the_rank_allocation_setup_says_whether_its_run_computed_its_cases(tmp_path):
    """A run shorter than half of its cases' compression times read them from the cache and says so; a longer one
    computed them (the block once said "other studies shared the cores" of any run, a 2-minute one from the cache
    too)."""
    import json

    figs = _figures_copy(tmp_path)
    rec_file = figs / "fig_rank_allocation_summary.provenance.json"  # the record the block reads its time from
    rec = json.loads(rec_file.read_text())
    compress = sum(r["compress_seconds"] for r in readme.Outputs(figs).table("tab_rank_allocation"))

    def setup(wall):
        rec_file.write_text(json.dumps({**rec, "wall_seconds": wall}))
        return readme.renderers()["rank-allocation-setup"](readme.Outputs(figs))

    cached, computed = setup(0.4 * compress), setup(1.5 * compress)
    assert "read its cases from the cache" in cached and "other studies shared" not in cached
    assert "read its cases from the cache" not in computed and "whether other work shared the cores" in computed
