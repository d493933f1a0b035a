"""README.md is a front page whose numbers come from the committed summary records.

``make test`` fails when a hand edit of the README or a regenerated record leaves its generated
blocks (the paper's items with their verdicts, the recommended recipe's measurements) apart from
``figures/``; the README stays short, and LICENSE and CITATION.cff stand beside it.
"""
import json
import re
import shutil
from pathlib import Path

import pytest
import yaml

from fisherkron.core.conventions import FisherkronError
from fisherkron.repro import claims, readme

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
FRONT_PAGE_LINES = 250  # curvlinops ~75, nanoGPT ~230: what, install, one example, one table, links


def test_readme_is_a_front_page():
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= FRONT_PAGE_LINES
    assert not re.search(r"\bissues? #?\d+\b", text, re.I), "the README speaks of the project, not its issues"
    assert not re.search(r"\bcommits? `?[0-9a-f]{7,40}\b", text), "no commit hashes on the front page"
    for target in re.findall(r"\]\(((?!https?:|#)[^)]+)\)", text):  # every local link resolves
        assert (ROOT / target.split("#")[0]).exists(), target


def test_readme_blocks_match_the_committed_records():
    assert readme.check(README.read_text(encoding="utf-8")) == []


def test_the_results_block_lists_every_paper_item_with_a_verdict():
    text = README.read_text(encoding="utf-8")
    block = readme.BLOCK.search(text.split("<!-- generated:results -->", 1)[1].join(["<!-- generated:results -->", ""]))
    rows = [line for line in block["body"].splitlines() if any(f"**{v}**" in line for v in claims.VERDICTS)]
    assert len(rows) == len(claims.ITEMS) == 20  # the paper's 19 items and the scale study


def _figures_copy(tmp_path: Path) -> Path:
    figures = tmp_path / "figures"
    figures.mkdir()
    for path in (ROOT / "figures").glob("*.provenance.json"):
        shutil.copy2(path, figures / path.name)
    for path in (ROOT / "figures").glob("*.csv"):
        shutil.copy2(path, figures / path.name)
    (figures / "bench").mkdir()
    for path in (ROOT / "figures" / "bench").glob("bench_recipe.*"):  # the recipe's timed command
        shutil.copy2(path, figures / "bench" / path.name)
    executed = tmp_path / "notebooks" / "executed"  # the teaching item reads its committed run
    executed.mkdir(parents=True)
    shutil.copy2(ROOT / "notebooks/executed/kronecker_fisher_from_scratch.ipynb", executed)
    return figures


def test_planted_drift_is_caught_both_ways(tmp_path):
    text = README.read_text(encoding="utf-8")
    figures = _figures_copy(tmp_path)
    assert readme.check(text, figures) == []
    edited = re.sub(r"\| 20% \| [0-9.,]+", "| 20% | 99.9", text, count=1)  # a hand edit of the recipe table
    assert edited != text
    assert readme.check(edited, figures) == ["README block 'recipe' differs from the committed outputs: run `make readme`"]
    assert readme.check(readme.render(edited, figures), figures) == []
    record = figures / "fig_allocation_cost_summary.provenance.json"  # a regenerated record
    data = json.loads(record.read_text())
    for row in data["extra"]["rows"]:
        if row["method"] == "kfac_svd" and row["allocation"] == "calibrated_kl":
            row["ppl_ptb"] *= 1.5
    record.write_text(json.dumps(data))
    assert any("'recipe'" in p for p in readme.check(text, figures))


def test_the_timed_command_comes_from_the_recipe_benchmark_once_it_has_run(tmp_path):
    import pandas as pd

    from fisherkron.repro.figures import save_table

    figures = tmp_path / "figures"
    assert readme.timed_line(figures) == ""  # not run: the block is the study's table alone
    nan = float("nan")
    rows = [{"case": "dense", "ratio": 0.0, "ppl_ptb": 56.8, "ptb_x_dense": 1.0, "compress_s": nan,
             "peak_disk_gb": nan, "others_load": nan},
            {"case": "recommended", "ratio": 0.2, "ppl_ptb": 115.4, "ptb_x_dense": 2.03, "compress_s": 1140.7,
             "peak_disk_gb": 4.87, "others_load": 0.5}]
    save_table(pd.DataFrame(rows), "bench_recipe", figures / "bench", {})
    line = readme.timed_line(figures)
    assert "PTB 115.4 (2.03x dense) in 19 min" in line and "4.9 GB" in line and "upper bound" in line
    save_table(pd.DataFrame(rows[:1]), "bench_recipe", figures / "bench", {})
    with pytest.raises(FisherkronError, match="no 'recommended' row"):
        readme.timed_line(figures)


def test_a_damaged_record_is_one_line_naming_it(tmp_path):
    figures = _figures_copy(tmp_path)
    (figures / "fig_allocation_cost_summary.provenance.json").write_text('{"name": "fig_all')
    with pytest.raises(FisherkronError, match="fig_allocation_cost_summary.provenance.json"):
        readme.render(README.read_text(encoding="utf-8"), figures)


def test_the_command_line_reports_a_damaged_readme_in_one_line(tmp_path, capsys):
    bad = tmp_path / "README.md"
    bad.write_bytes(b"\xff\xfe\x00garbage")
    assert readme.main(["--check", str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "README.md" in err[0]


def test_licence_and_citation_stand_beside_the_readme():
    assert "MIT License" in (ROOT / "LICENSE").read_text()
    cff = yaml.safe_load((ROOT / "CITATION.cff").read_text())
    assert cff["cff-version"] == "1.2.0" and cff["license"] == "MIT"
    paper = cff["preferred-citation"]
    assert paper["title"] == "Scalable Kronecker-Factored Fisher Approximation for Neural Network Parameter Sensitivity"
    assert [a["family-names"] for a in paper["authors"]][0] == "Chekalina"
    from fisherkron import __version__
    assert cff["version"] == __version__
