"""The paper's 19 items and their computed verdicts (fisherkron.repro.claims); reads files only."""
import copy
import json
import re
import shutil
from pathlib import Path

import pytest

from fisherkron.core.conventions import FisherkronError
from fisherkron.repro import claims

ROOT = Path(__file__).resolve().parents[1]
PAPERS = [Path("/work/shared/paper/paper.tex"), ROOT.parent / "shared" / "paper" / "paper.tex"]
ITEM = {item.label: item for item in claims.ITEMS}


@pytest.fixture(scope="module")
def records() -> dict:
    return claims.load_records(ROOT / "figures")


def test_nineteen_items_in_seven_groups_each_with_a_rule():
    labels = [item.label for item in claims.PAPER_ITEMS]
    assert len(labels) == len(set(labels)) == 19 and len(claims.ITEMS) == 20  # and the scale study, beyond the paper
    groups = [item.group for item in claims.ITEMS]
    assert len(set(groups)) == 8 and groups == sorted(groups, key=groups.index)  # each group in one run
    assert groups[-1] == claims.BEYOND
    assert all(item.claim and item.paper and item.rule for item in claims.ITEMS)
    assert ITEM["tab:glue_results"].title == "Tab. glue_results"
    assert {item.notebook for item in claims.ITEMS} <= {p.stem for p in (ROOT / "notebooks").glob("*.py")}


def test_the_labels_are_the_papers_figures_and_tables():
    paper = next((p for p in PAPERS if p.is_file()), None)
    if paper is None:
        pytest.skip("the paper's LaTeX is not beside this checkout")
    found = set(re.findall(r"\\label\{((?:fig|tab):[^}]+)\}", paper.read_text(encoding="utf-8")))
    assert found == {item.label for item in claims.PAPER_ITEMS}


def test_every_item_finds_what_it_reads_in_the_committed_records():
    rows = claims.results()
    assert [r["label"] for r in rows] == list(ITEM)
    assert all(set(r) == {"label", "title", "group", "claim", "paper", "ours", "verdict", "notebook"} for r in rows)
    assert all(r["verdict"] in claims.VERDICTS for r in rows)
    assert not [r["label"] for r in rows if "not in the records" in r["ours"]]
    paper = {item.label for item in claims.PAPER_ITEMS}
    assert all(re.search(r"\d", r["ours"]) for r in rows if r["label"] in paper)  # a number read from a record


def test_missing_records_give_cannot_tell_and_say_what_is_missing(tmp_path):
    rows = claims.results(tmp_path)
    assert {r["verdict"] for r in rows} == {"cannot tell"}
    assert "tab_ablation_diag_summary" in next(r["ours"] for r in rows if r["label"] == "tab:ablation_diag_results")


def _ordering(records: dict, holding: int) -> dict:
    out = copy.deepcopy(records)
    cases = out["tab_ablation_diag_summary"]["extra"]["verdict"]["ordering"]["cases"]
    for i, case in enumerate(cases.values()):
        case["holds"] = i < holding
    return out


def test_the_ablation_verdict_counts_the_cases_where_the_ordering_holds(records):
    ablation = ITEM["tab:ablation_diag_results"].ours
    assert ablation(_ordering(records, 4)) == ("order in 4 of 4 cases; 10%/ptb: 112.2 > 111.2 > 1246 > 148.3", "holds")
    assert ablation(_ordering(records, 2))[1] == "holds in part"
    assert ablation(_ordering(records, 0))[1] == "does not hold"


def test_mmlu_cannot_tell_while_the_dense_model_is_at_chance_and_judges_once_it_is_not(records):
    fig = ITEM["fig:mmlu_avg"].ours
    assert fig(records)[1] == "cannot tell"
    clear = copy.deepcopy(records)
    v = clear["tab_llm_compression_mmlu_summary"]["extra"]["verdict"]
    v["dense_at_chance"], v["at_chance"] = False, []
    v["lead_over"] = {"fwsvd": [0.0, 0.1], "asvd": [0.0, 0.1]}
    v["lead_change"] = {r: {"beyond_2se": True} for r in ("fwsvd", "asvd")}
    assert fig(clear)[1] == "holds"
    v["lead_change"]["asvd"]["beyond_2se"] = False
    assert fig(clear)[1] == "holds in part"
    for label in ("tab:Llama2_compression", "tab:Llama3_compression"):
        assert ITEM[label].ours(records)[1] == "cannot tell"
        assert ITEM[label].ours(clear)[1] in ("holds", "holds in part", "does not hold")
    # the compressed rows not scored at all (the dense model at chance): no lead to read
    unscored = copy.deepcopy(records)
    v = unscored["tab_llm_compression_mmlu_summary"]["extra"]["verdict"]
    v["dense_at_chance"], v["at_chance"], v["lead_over"] = True, [], {"fwsvd": [], "asvd": []}
    ours, verdict = fig(unscored)
    assert verdict == "cannot tell" and ours.startswith("rows not scored")


def test_behind_svd_llm_is_not_at_this_scale_only_while_the_gap_narrows_with_k(records):
    chat = ITEM["tab:Llama2_chat_compression_50"].ours
    assert chat(records)[1] == "not at this scale"
    wider = copy.deepcopy(records)
    for v in wider["fig_calibration_summary"]["extra"]["verdict"].values():
        if isinstance(v, dict) and "gap_to_svd_llm_kmax" in v:
            v["gap_to_svd_llm_kmax"] = 2 * v["gap_to_svd_llm_kmin"]
    assert chat(wider)[1] in ("holds in part", "does not hold")
    ahead = copy.deepcopy(records)
    for pair in ahead["tab_llm_compression_main_summary"]["extra"]["verdict"]["gfwsvd_beats_paper"]:
        pair["beats"] = True
    assert chat(ahead)[1] == "holds"


def test_the_teaching_item_reads_a_summary_of_named_checks_when_there_is_one(records):
    teach = ITEM["fig:connection2fwsvd"].ours
    summary = {"extra": {"verdict": {"theorem_1": True, "fwsvd_special_case": True}}}
    assert teach({**records, "kronecker_fisher_from_scratch_summary": summary})[1] == "holds"
    summary["extra"]["verdict"]["fwsvd_special_case"] = False
    assert teach({**records, "kronecker_fisher_from_scratch_summary": summary})[1] == "holds in part"
    assert teach({**records, claims.TEACHING: {"cells": 3, "errors": 1}})[1] == "does not hold"
    assert teach(records)[1] == "cannot tell"  # neither a summary nor the executed notebook


def test_a_damaged_record_is_one_line_naming_it(tmp_path):
    shutil.copy(ROOT / "figures" / "tab_ablation_diag_summary.provenance.json", tmp_path)
    (tmp_path / "fig_x.provenance.json").write_text('{"name": "fig_x", "extr')
    with pytest.raises(FisherkronError, match=r"fig_x\.provenance\.json.*restore it from git") as err:
        claims.results(tmp_path)
    assert "\n" not in str(err.value)
    (tmp_path / "fig_x.provenance.json").write_text(json.dumps(["not", "a", "record"]))
    with pytest.raises(FisherkronError, match=r"fig_x\.provenance\.json.*not a JSON object"):
        claims.load_records(tmp_path)


def test_the_table_has_a_row_per_item_and_links_through_the_callable():
    table = claims.results_table(claims.results(), link=lambda nb: f"notebooks/executed/{nb}.ipynb")
    lines = table.splitlines()
    items = [line for line in lines if line.startswith(("| Fig.", "| Tab."))]
    assert len(items) == 20 and len([line for line in lines if line.startswith("| **")]) == 8
    assert all(re.search(r"\| \*\*(" + "|".join(claims.VERDICTS) + r")\*\* \|", line) for line in items)
    assert all(line.count(" | ") == 5 for line in items)  # six cells: no pipe of a cell leaks
    assert "[tab_ablation_diag](notebooks/executed/tab_ablation_diag.ipynb)" in table


def test_the_scale_row_names_the_cut_and_the_shrinkage_it_reports():
    def trend(change, **kw):
        return {"models": 3, "smallest": "a", "largest": "c", "gap_smallest": 1.0, "gap_largest": 1.0 + change,
                "change": change, "se": 0.1, "shrinks": change < -0.2, "grows": change > 0.2, **kw}

    verdict = {"trend_0.1": trend(0.5), "trend_matched_cut": trend(0.6, reference_share=0.25),
               "shrinkage": [{"model": "c", "target": 0.2, "allocation": "calibrated_kl", "shrunk_vs_plain": -0.3,
                              "se": 0.05}]}
    ours, v = claims._scale({"fig_scale_summary": {"extra": {"verdict": verdict}}})
    assert v == "does not hold"
    assert ours.startswith("gap at a matched cut (25 % of the block linears removed) +1.00 (a) -> +1.60 (c)")
    assert ours.endswith("shrinkage -0.30 ± 0.05 on c at 20 % (calibrated_kl ranks)")
    verdict = {"trend_0.1": trend(-0.5), "trend_0.2": trend(-0.4)}  # no matched cut, no shrinkage
    ours, v = claims._scale({"fig_scale_summary": {"extra": {"verdict": verdict}}})
    assert v == "holds" and ours == "gap +1.00 (a) -> +0.60 (c), change -0.40 ± 0.10"
