"""`make verify`: tolerances declared with a table, and the comparison that catches a planted change.

The comparison runs on the committed tables (figures/) and on a tiny table producer written the
way a notebook writes its tables (save_table with tolerances); no notebook runs here.
"""
import json
import math
import re
import shutil
import time
from pathlib import Path

import pandas as pd
import pytest
import torch

import fisherkron as fk
from fisherkron.core.conventions import FisherkronError
from fisherkron.repro import compare, figures, verify
from fisherkron.repro import tolerance as T
from fisherkron.repro.verify_tolerances import TOLERANCES

ROOT = Path(__file__).resolve().parents[1]
FIGURES = ROOT / "figures"


# -- the grammar ---------------------------------------------------------------------------------
def test_tolerance_terms_add_up_from_the_committed_row():
    tol = T.parse("rel=0.01 + abs=0.5 + 3*se(se) + 2*sd(svd std)/sqrt(4)")
    row = {"se": 0.1, "svd std": 1.0}
    assert tol.kind == "bound" and tol.columns == {"se", "svd std"}
    assert math.isclose(tol.width(-100.0, row), 1.0 + 0.5 + 0.3 + 1.0)
    assert math.isclose(T.parse("3*pm/sqrt(9)").width(0.5, {}, cell_sd=0.03), 0.03)
    assert T.parse(" exact ").kind == "exact" and T.parse("timing").width(1.0) == 0.0


@pytest.mark.parametrize("bad", ["", "approx", "rel=", "3*se(se)/sqrt(10)", "rel=1e-3 + ", "3 * se(x)", 1e-3])
def test_unreadable_tolerances_are_refused_naming_the_grammar(bad):
    with pytest.raises(FisherkronError, match="tolerance"):
        T.parse(bad)


def test_default_tolerances_are_conservative_and_say_why():
    df = pd.DataFrame({"rank": [1, 2], "acc": [0.5, 0.25], "ours_s": [1.0, 2.0], "FLOP speedup": [1.1, 1.2],
                       "label": ["a", "b"], "ok": [True, False], "count": [3.0, float("nan")]})
    got = {c: T.default(c, df[c])[0].spec for c in df.columns}
    assert got == {"rank": "exact", "acc": T.DEFAULT_FLOAT, "ours_s": "timing", "FLOP speedup": T.DEFAULT_FLOAT,
                   "label": "exact", "ok": "exact", "count": "exact"}
    assert not T.looks_like_timing("min_share_1") and T.looks_like_timing("total_min")


# -- save_table records them -------------------------------------------------------------------
def test_save_table_records_declared_tolerances_and_refuses_unknown_columns(tmp_path):
    df = pd.DataFrame({"rank": [1, 2], "acc": [0.5, 0.6], "se": [0.01, 0.02]})
    figures.save_table(df, "t", tmp_path, tolerances={"rank": "exact", "acc": "3*se(se)"})
    rec = json.loads((tmp_path / "t.provenance.json").read_text())
    assert rec["tolerances"] == {"rank": "exact", "acc": "3*se(se)"}
    figures.save_table(df, "u", tmp_path)  # backward compatible: no declaration, no key
    assert "tolerances" not in json.loads((tmp_path / "u.provenance.json").read_text())
    with pytest.raises(FisherkronError, match="'accuracy'"):
        figures.save_table(df, "v", tmp_path, tolerances={"accuracy": "exact"})
    with pytest.raises(FisherkronError, match="reads"):
        figures.save_table(df, "v", tmp_path, tolerances={"acc": "3*se(stderr)"})
    assert not (tmp_path / "v.csv").exists()  # checked before anything is written


# -- the committed tables ----------------------------------------------------------------------
def _copy(dst: Path) -> Path:
    shutil.copytree(FIGURES, dst, ignore=shutil.ignore_patterns("*.png", "*.pdf", "*.tex", "*.md", "bench"))
    return dst


def test_every_committed_table_equals_itself():
    tables = verify.tables_of(FIGURES)
    assert len(tables) >= 10
    for name in tables:
        rep = verify.compare_table(name, FIGURES, FIGURES)
        assert rep.status == "PASS" and rep.worst == 0.0 and not rep.failures, rep.line()


def test_a_table_value_edited_by_hand_is_caught_and_a_timing_is_not(tmp_path, capsys):
    ref, scratch = _copy(tmp_path / "ref"), tmp_path / "verify"
    new = _copy(scratch / "figures")
    args = ["--no-run", "--ref", str(ref), "--scratch", str(scratch), "--nb", "fig_synthetic_correlations,fig_time_algo"]
    assert verify.main(args) == 0

    sweep = pd.read_csv(new / "tab_time_algo_sweep.csv")
    sweep.loc[0, "ours_s"] *= 3  # a timing: reported, never a failure
    sweep.to_csv(new / "tab_time_algo_sweep.csv", index=False)
    assert verify.main(args) == 0
    assert re.search(r"ours_s x\d", capsys.readouterr().out)

    gaps = pd.read_csv(new / "tab_synthetic_gaps.csv")
    committed = gaps.loc[2, "gap"]
    gaps.loc[2, "gap"] += 5 * gaps.loc[2, "se"]  # one number edited by hand, beyond 3 se of the difference (4.2 se)
    gaps.to_csv(new / "tab_synthetic_gaps.csv", index=False)
    assert verify.main(args) == 1
    out = capsys.readouterr().out
    assert "FAIL tab_synthetic_gaps" in out and "PASS tab_diag_full_synth" in out
    assert re.search(r"tab_synthetic_gaps row 3 \(toeplitz, fwsvd\) column 'gap': committed "
                     + re.escape(repr(float(committed))), out)
    report = json.loads((scratch / "report.json").read_text())
    assert [f["column"] for t in report["tables"] for f in t["failures"]] == ["gap"]
    # the report says what it checked: the commit of the code, the caches (none: --no-run ran nothing), the machine
    assert re.fullmatch(r"[0-9a-f]{40}", report["git"]["commit"]) and report["data"] is None
    assert report["machine"]["cpu"] and report["machine"]["cpu_count"] >= 1 and report["finished"].endswith("Z")


def _fake_runs(monkeypatch, new: Path, ok=("fig_synthetic_correlations", "fig_time_algo")):
    """``execute`` replaced by one that "writes" the tables of ``new`` (no notebook runs)."""
    def execute(n, figdir, *a, **k):
        if n in ok:
            shutil.copytree(new, figdir, dirs_exist_ok=True)
        return n in ok, 2.0, 1.5

    monkeypatch.setattr(verify, "execute", execute)
    monkeypatch.setattr(verify, "_data_env", lambda mode, scratch: ({}, mode))


def test_a_run_keeps_one_record_per_notebook_with_what_it_found(tmp_path, monkeypatch):
    ref, scratch, records = _copy(tmp_path / "ref"), tmp_path / "verify", tmp_path / "records"
    mine = records / verify.cpu_folder()  # this CPU model's records
    new = _copy(tmp_path / "new")
    _fake_runs(monkeypatch, new)
    args = ["--ref", str(ref), "--scratch", str(scratch), "--nb", "fig_synthetic_correlations,fig_time_algo",
            "--record", str(records)]
    assert verify.main(args) == 0
    rec = json.loads((mine / "fig_time_algo.json").read_text())
    assert rec["result"] == "PASS" and rec["worst"] == 0.0 and rec["failures"] == [] and rec["seconds"] == 2.0
    assert {t["name"] for t in rec["tables"]} == {"tab_time_algo", "tab_time_algo_sweep"}
    from fisherkron.env import file_checksum
    assert all(t["sha"] == file_checksum(ref / f"{t['name']}.csv") for t in rec["tables"])
    assert rec["data"] == "fresh" and re.fullmatch(r"[0-9a-f]{40}", rec["git"]["commit"])
    assert rec["others_cpu_share"] is None or 0.0 <= rec["others_cpu_share"] <= 1.0

    gaps = pd.read_csv(new / "tab_synthetic_gaps.csv")
    gaps.loc[2, "gap"] += 5 * gaps.loc[2, "se"]  # the value edited by hand: the record names it
    gaps.to_csv(new / "tab_synthetic_gaps.csv", index=False)
    assert verify.main(args) == 1
    rec = json.loads((mine / "fig_synthetic_correlations.json").read_text())
    assert rec["result"] == "FAIL" and len(rec["failures"]) == 1 and "column 'gap'" in rec["failures"][0]
    assert json.loads((mine / "fig_time_algo.json").read_text())["result"] == "PASS"

    # a resumed run says what it resumes: a statistics run's scratch folder still links data/'s calibrations
    (scratch / "data" / "cache").mkdir(parents=True)
    (scratch / "data" / "cache" / "calibration").symlink_to(tmp_path)
    gaps.loc[2, "gap"] -= 5 * gaps.loc[2, "se"]
    gaps.to_csv(new / "tab_synthetic_gaps.csv", index=False)
    assert verify.main([*args, "--data", "scratch"]) == 0
    rec = json.loads((mine / "fig_time_algo.json").read_text())
    assert rec["data"] == "statistics, resumed" and rec["started"] <= rec["finished"]

    # a comparison that ran nothing vouches for no run: no record is written or changed
    before = {p.name: p.read_text() for p in mine.iterdir()}
    assert verify.main([*args, "--no-run"]) == 0
    assert {p.name: p.read_text() for p in mine.iterdir()} == before


def test_verify_stale_runs_only_the_notebooks_whose_record_does_not_vouch_for_the_committed_tables(
        tmp_path, monkeypatch, capsys):
    ref, scratch, records = _copy(tmp_path / "ref"), tmp_path / "verify", tmp_path / "records"
    mine = records / verify.cpu_folder()  # this CPU model's records
    _fake_runs(monkeypatch, _copy(tmp_path / "new"))
    both = ["--ref", str(ref), "--scratch", str(scratch), "--nb", "fig_synthetic_correlations,fig_time_algo",
            "--record", str(records)]
    assert verify.main(both) == 0
    capsys.readouterr()
    assert verify.main([*both, "--stale", "--list"]) == 0
    assert "every record" in capsys.readouterr().out

    timing = pd.read_csv(ref / "tab_time_algo.csv")  # a table committed since the record
    timing.iloc[0, -1] = 2 * timing.iloc[0, -1]
    timing.to_csv(ref / "tab_time_algo.csv", index=False)
    assert verify.main([*both, "--stale", "--list"]) == 0
    out = capsys.readouterr().out
    assert "fig_time_algo: changed since its record: tab_time_algo\n" in out
    assert out.splitlines()[-1] == "fig_time_algo"

    ran = []

    def execute(n, figdir, *a, **k):  # "writes" the committed tables, so each rerun passes
        ran.append(n)
        shutil.copytree(ref, figdir, dirs_exist_ok=True)
        return True, 1.0, 1.0

    monkeypatch.setattr(verify, "execute", execute)
    (mine / "fig_synthetic_correlations.json").unlink()  # and a notebook never verified
    assert verify.main([*both, "--stale"]) == 0
    assert ran == ["fig_synthetic_correlations", "fig_time_algo"]
    assert verify.stale_notebooks(["fig_synthetic_correlations", "fig_time_algo"], records, ref) == {}
    other = "intel-xeon" if mine.name == "amd-epyc" else "amd-epyc"  # another CPU model has verified nothing
    assert verify.stale_notebooks(["fig_time_algo"], records, ref, cpu=other) == {"fig_time_algo":
                                                                                   f"no record from {other}"}
    rec = json.loads((mine / "fig_time_algo.json").read_text())
    rec["result"] = "FAIL"
    (mine / "fig_time_algo.json").write_text(json.dumps(rec))
    assert verify.stale_notebooks(["fig_time_algo"], records, ref) == {"fig_time_algo": "its record says FAIL"}
    with pytest.raises(SystemExit):  # which records is required
        verify.main(["--ref", str(ref), "--stale"])


def test_a_notebook_that_failed_to_run_is_recorded_so_and_an_old_report_can_be_filed(tmp_path, monkeypatch):
    ref, scratch, records = _copy(tmp_path / "ref"), tmp_path / "verify", tmp_path / "records"
    new = _copy(tmp_path / "new")
    _fake_runs(monkeypatch, new, ok=("fig_time_algo",))
    args = ["--ref", str(ref), "--scratch", str(scratch), "--nb", "fig_synthetic_correlations,fig_time_algo"]
    assert verify.main(args) == 2
    report = json.loads((scratch / "report.json").read_text())
    for key in ("git", "machine", "finished", "others_cpu_share"):  # as a report from before these fields
        report.pop(key)
    (tmp_path / "old.json").write_text(json.dumps(report))
    with pytest.raises(SystemExit):  # where to file it is required
        verify.main(["--record-from", str(tmp_path / "old.json")])
    assert verify.main(["--ref", str(ref), "--record", str(records), "--record-from", str(tmp_path / "old.json")]) == 0
    failed = json.loads((records / "unknown" / "fig_synthetic_correlations.json").read_text())
    assert failed["result"] == "FAILED TO RUN" and failed["tables"] == []
    ok = json.loads((records / "unknown" / "fig_time_algo.json").read_text())
    assert ok["result"] == "PASS" and ok["git"] is None and ok["finished"].endswith("Z")  # the file's time


def test_structural_changes_fail(tmp_path):
    ref = pd.read_csv(FIGURES / "tab_synthetic_gaps.csv")
    assert verify.compare_frames("t", ref, ref.iloc[:-1]).status == "FAIL"  # a row lost
    assert verify.compare_frames("t", ref, ref.drop(columns="se")).status == "FAIL"
    assert verify.compare_frames("t", ref, ref.assign(extra=1)).status == "FAIL"
    assert verify.compare_frames("t", ref, ref.assign(versus=ref["versus"].str.upper())).status == "FAIL"
    shutil.copy(FIGURES / "tab_synthetic_gaps.csv", tmp_path / "tab_synthetic_gaps.csv")
    rep = verify.compare_table("tab_synthetic_gaps", tmp_path, tmp_path / "nothing")
    assert rep.status == "MISSING" and rep.failures


def test_text_cells_compare_their_numbers_within_the_seed_spread():
    ref = pd.DataFrame({"m": ["SVD", "ratio"], "acc": ["0.616 ± 0.006", "5.8 %"]})
    # 3 standard errors of the difference of the two 3-seed means: 3 * sqrt(0.006^2 + 0.006^2) / sqrt(3) = 0.0147
    tol = {"m": "exact", "acc": "3*pm/sqrt(3)"}
    ok = ref.assign(acc=["0.629 ± 0.006", "5.8 %"])
    far = ref.assign(acc=["0.633 ± 0.006", "5.8 %"])
    words = ref.assign(acc=["0.616 +- 0.006", "5.8 %"])
    assert verify.compare_frames("t", ref, ok, tol).status == "PASS"
    assert verify.compare_frames("t", ref, far, tol).status == "FAIL"
    assert verify.compare_frames("t", ref, words, tol).status == "FAIL"
    assert verify.compare_frames("t", ref, ref.assign(acc=["0.616 ± 0.006", "5.9 %"]), tol).status == "FAIL"


def test_a_spread_bounds_the_difference_of_two_means_each_with_its_own_spread():
    # two seeds each: the committed spread came out small by chance, the new run's is larger
    ref = pd.DataFrame({"row": ["LoRA"], "ppl": ["185 ± 0.36"], "acc": [0.50], "se": [0.01]})
    tol = {"row": "exact", "ppl": "rel=0.05 + 3*pm/sqrt(2)", "acc": "3*se(se)", "se": "abs=0.1"}
    # 3 * sqrt(0.36^2 + 10.99^2) / sqrt(2) = 23.3, + 9.25 + half a printed unit of each: 14 apart passes
    assert verify.compare_frames("t", ref, ref.assign(ppl=["199 ± 10.99"]), tol).status == "PASS"
    # the committed spread alone (3 * 0.36 / sqrt(2) + 9.25 + 1 = 11.0) would not have admitted it; with both
    # spreads small (11.4) the same difference still fails
    assert verify.compare_frames("t", ref, ref.assign(ppl=["199 ± 0.40"]), tol).status == "FAIL"
    # se columns: 3 * sqrt(0.01^2 + 0.04^2) = 0.124
    assert verify.compare_frames("t", ref, ref.assign(acc=[0.62], se=[0.04]), tol).status == "PASS"
    assert verify.compare_frames("t", ref, ref.assign(acc=[0.62], se=[0.01]), tol).status == "FAIL"


def test_the_registry_declares_only_real_columns_of_tables_declared_nowhere_else():
    for name, decl in TOLERANCES.items():
        csv = FIGURES / f"{name}.csv"
        if csv.is_file():
            T.declare(decl, pd.read_csv(csv).columns)  # raises on a misspelt column
        rec = json.loads((FIGURES / f"{name}.provenance.json").read_text()) if csv.is_file() else {}
        assert "tolerances" not in rec, f"{name} declares its tolerances itself: delete its verify_tolerances entry"


def test_verify_quick_covers_the_notebooks_that_run_in_minutes():
    mk = (ROOT / "mk" / "verify.mk").read_text()
    quick = re.search(r"^VERIFY_QUICK\s*:=\s*(.+)$", mk, re.M).group(1).split()
    assert {"kronecker_fisher_from_scratch", "fig_synthetic_correlations", "fig_time_algo", "tab_throughput"} <= set(quick)
    assert all((ROOT / "notebooks" / f"{n}.py").is_file() for n in quick)


# -- a method's weights perturbed --------------------------------------------------------------
def _produce(folder: Path, *, perturb: float = 0.0) -> None:
    """A tiny table producer written as a notebook writes one: weighted-SVD errors of a 7 x 5 layer by rank.

    ``perturb`` adds that much noise to GFWSVD's compressed weights (a planted bug in one method).
    """
    g = torch.Generator().manual_seed(0)
    W = torch.randn(7, 5, generator=g, dtype=torch.float64)  # (n, m)
    G = torch.randn(6, 7, 5, generator=g, dtype=torch.float64)  # (k, n, m) batch gradients
    A = torch.einsum("kni,knj->ij", G, G) / 6  # (m, m) input side
    B = torch.einsum("kin,kjn->ij", G, G) / 6  # (n, n) output side
    rows = []
    for rank in (1, 2, 3):
        for method in ("svd", "gfwsvd"):
            t0 = time.perf_counter()
            W2, W1 = fk.svd(W, rank) if method == "svd" else fk.gfwsvd(W, A, B, rank)
            W_hat = W2 @ W1
            if method == "gfwsvd" and perturb:
                W_hat = W_hat + perturb * torch.randn(W_hat.shape, generator=torch.Generator().manual_seed(1),
                                                      dtype=W_hat.dtype)
            rows.append({"method": method, "rank": rank, "fisher error": fk.fisher_weighted_error(W, W_hat, A, B),
                         "seconds": time.perf_counter() - t0})
    figures.save_table(pd.DataFrame(rows), "tab_tiny", folder, notebook="notebooks/tiny.py",
                       tolerances={"method": "exact", "rank": "exact", "fisher error": "rel=1e-6",
                                   "seconds": "timing"})


def test_a_rerun_passes_and_a_perturbed_method_fails(tmp_path):
    _produce(tmp_path / "committed")
    _produce(tmp_path / "rerun")
    _produce(tmp_path / "perturbed", perturb=1e-3)
    same = verify.compare_table("tab_tiny", tmp_path / "committed", tmp_path / "rerun")
    assert same.status == "PASS" and same.declared == 4 and not same.defaults and "seconds" in same.timing
    bad = verify.compare_table("tab_tiny", tmp_path / "committed", tmp_path / "perturbed")
    assert bad.status == "FAIL" and bad.source == "provenance"
    assert {(f.column, f.label.split(",")[0]) for f in bad.failures} == {("fisher error", "gfwsvd")}
    assert len(bad.failures) == 3 and bad.worst > 1
    assert not same.notes  # the same declarations on both sides: nothing to say


def test_a_rule_changed_since_the_committed_table_is_applied_and_named(tmp_path):
    """The run's record (the code as it is now) declares the tolerances; where the committed record, written by
    older code, declared a column otherwise, the report says which and how, so the committed record is not read
    as the rule the comparison used."""
    _produce(tmp_path / "committed")
    _produce(tmp_path / "rerun", perturb=1e-3)
    rec = tmp_path / "rerun" / "tab_tiny.provenance.json"
    r = json.loads(rec.read_text())
    r["tolerances"]["fisher error"] = "rel=10"  # a looser rule in today's code
    rec.write_text(json.dumps(r))
    rep = verify.compare_table("tab_tiny", tmp_path / "committed", tmp_path / "rerun")
    assert rep.status == "PASS" and rep.source == "provenance"
    assert rep.notes == ["1 column(s) declared otherwise than the committed record, which keeps the declarations "
                         "of the code that wrote it: 'fisher error' rel=1e-6 -> rel=10"]


def test_data_modes_link_only_what_they_say(tmp_path, monkeypatch):
    """``fresh`` empties the scratch caches and links only the dequantised model; ``statistics`` also links
    the calibration statistics and sweeps (never the score caches); ``scratch`` keeps what the last run left."""
    data = tmp_path / "data"
    for sub in ("models", "hf_home", "cache/calibration", "cache/allocation", "cache/lm_eval_tasks", "cache/finetune",
                "cache/studies"):
        (data / sub).mkdir(parents=True)
    monkeypatch.setenv("FISHERKRON_DATA", str(data))
    scratch = tmp_path / "scratch"
    env, what = verify._data_env("statistics", scratch)
    sd = Path(env["FISHERKRON_DATA"])
    assert "every score recomputed" in what
    assert all((sd / s).is_symlink() for s in verify.STATISTICS_CACHES)
    # the model loads from data/'s own folder: its path is in the config that the calibration keys hash
    assert env["FISHERKRON_MODELS"] == str(data / "models") and not (sd / "models").exists()
    assert not (sd / "cache" / "studies").exists()  # no study result file in data/: nothing carried over
    # a study's cost measurements come over, its scores do not; a file without any, or not a result file, stays
    cost = 'cost|{"k": 64}'
    (data / "cache" / "studies" / "calibration-x.json").write_text(
        json.dumps({cost: {"collect_s": 812.0}, "case|k4|gfwsvd|0.1": {"ppl_ptb": 70.1}, "dense": {"ppl_ptb": 56.8}}))
    (data / "cache" / "studies" / "rank_allocation-y.json").write_text(json.dumps({"case|a": {"ppl_ptb": 1.0}}))
    (data / "cache" / "studies" / "broken.json").write_text("{")
    env, what = verify._data_env("statistics", scratch)
    assert "1 cost measurement(s) of its studies copied" in what
    assert json.loads((sd / "cache" / "studies" / "calibration-x.json").read_text()) == {cost: {"collect_s": 812.0}}
    assert sorted(p.name for p in (sd / "cache" / "studies").iterdir()) == ["calibration-x.json"]
    (sd / "cache" / "studies" / "case.json").write_text("{}")  # a score the run wrote
    env, what = verify._data_env("scratch", scratch)  # resumes the statistics run: same links, same model path
    assert (sd / "cache" / "studies").is_dir() and "resumed" in what
    assert env["FISHERKRON_MODELS"] == str(data / "models") and not (sd / "models").exists()
    env, what = verify._data_env("fresh", scratch)
    assert what.startswith("empty caches")
    assert (sd / "models").is_symlink() and not (sd / "cache").exists() and "FISHERKRON_MODELS" not in env
    assert (data / "cache" / "calibration").is_dir()  # removing the scratch links never touched data/


def test_the_converted_model_folder_follows_fisherkron_models(tmp_path, monkeypatch):
    """``$FISHERKRON_MODELS`` moves the converted SmolLM2 folder (no conversion when it is there), so the statistics
    mode loads the model from the path data/'s calibration keys were made with."""
    from fisherkron.hf.registry import smollm2_folder

    folder = tmp_path / "elsewhere" / "SmolLM2-135M-Instruct-fp32"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"")
    monkeypatch.setenv("FISHERKRON_DATA", str(tmp_path / "data"))
    monkeypatch.setenv("FISHERKRON_MODELS", str(folder.parent))
    assert smollm2_folder() == folder


def test_text_cells_read_thousands_separators_and_ignore_the_best_value_emphasis():
    """A tab_extra_compression_results verify: "3,327 ± 825" against "4,259 ± 782" was read as the numbers 3, 327
    and 825 (|diff| 1 for 3 against 4), and a bold moved to a tied neighbour failed as a changed word."""
    tol = {"ppl": "rel=0.05"}
    ref = pd.DataFrame({"ppl": ["3,327 ± 825", "**94,632 ± 15,436**"]})
    rep = verify.compare_frames("t", ref, ref.assign(ppl=["4,259 ± 825", "**94,632 ± 15,436**"]), tol)
    # 4,259 is 28 % from 3,327: the margin is the whole numbers' (932 / 166), not 1 / 0.15
    assert rep.status == "FAIL" and rep.failures[0].delta == pytest.approx(932)
    near = ref.assign(ppl=["3,400 ± 825", "95,000 ± 15,436"])  # 2.2 % and 0.4 %, bold dropped
    assert verify.compare_frames("t", ref, near, tol).status == "PASS"
    # the spread is held to its mean's width (5 % of 3,327 = 166), not 5 % of itself (41)
    assert verify.compare_frames("t", ref, ref.assign(ppl=["3,327 ± 900", ref.ppl[1]]), tol).status == "PASS"
    assert verify.compare_frames("t", ref, ref.assign(ppl=["3,327 ± 1,000", ref.ppl[1]]), tol).status == "FAIL"
    assert verify.compare_frames("t", ref, ref.assign(ppl=["3,327 ± 825 x", ref.ppl[1]]), tol).status == "FAIL"


def test_printed_numbers_are_compared_within_their_printing_unit():
    """A tab_extra_compression_results verify failed "0.562 ± 0.018" -> "0.613 ± 0.053" at abs=0.05: the seed means
    are 0.5625 and 0.6125 (accuracies in steps of 1/40, averaged over two seeds), 0.05 apart, printed
    0.051 apart; and "0.175" -> "0.225" failed on float rounding (|diff| 0.05000000000000002)."""
    tol = {"acc": "abs=0.05"}
    ref = pd.DataFrame({"acc": ["0.562 ± 0.018", "0.175 ± 0.000"]})
    assert verify.compare_frames("t", ref, ref.assign(acc=["0.613 ± 0.018", "0.225 ± 0.000"]), tol).status == "PASS"
    # a change of 0.052 in printed thousandths is more than rounding can explain
    assert verify.compare_frames("t", ref, ref.assign(acc=["0.614 ± 0.018", ref.acc[1]]), tol).status == "FAIL"
    # the unit follows the printed digits: integers printed whole get half a unit each
    ppl = {"ppl": "rel=0.05"}
    r2 = pd.DataFrame({"ppl": ["100 ± 2"]})
    assert verify.compare_frames("t", r2, r2.assign(ppl=["106 ± 2"]), ppl).status == "PASS"  # 5 + 1 >= 6
    assert verify.compare_frames("t", r2, r2.assign(ppl=["107 ± 2"]), ppl).status == "FAIL"
    # numbers stored as numbers get only float rounding, not a printing unit
    num = pd.DataFrame({"acc": [0.225]})
    assert verify.compare_frames("t", num, num.assign(acc=[0.275]), tol).status == "PASS"
    assert verify.compare_frames("t", num, num.assign(acc=[0.2751]), tol).status == "FAIL"
    assert [compare._unit(x) for x in ("0.263", "94,632", "1.5e+03", "7.")] == [0.001, 1.0, 100.0, 1.0]
