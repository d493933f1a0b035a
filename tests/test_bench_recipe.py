"""The recipe benchmark (scripts/bench_recipe.py): its cases, the bound it sets, its disk probe, its resumption,
and its ``--quick`` pipeline end to end on a tiny random Llama.

No timings are asserted here (timings are what `make bench-recipe` reports). The end-to-end run starts
18 ``fisherkron`` commands (about 90 s on 2 shared cores), so it is marked ``slow``.
"""
import json
import math
import os
import time

import pytest
from script_module import load_script

bench = load_script("bench_recipe")


def test_the_cases_are_the_commands_a_practitioner_types():
    full = bench.FULL
    assert bench.case_options("recommended", full) == []  # the command's defaults: the recipe
    assert bench.case_options("old-default", full) == ["--method", "gfwsvd", "--allocation", "uniform",
                                                       "--k", "16", "--batch-size", "4"]
    assert bench.case_options("gfwsvd-recipe", full) == bench.case_options("gfwsvd-recipe-bounded", full) \
        == ["--method", "gfwsvd"]
    quick = bench.case_options("gfwsvd-recipe", bench.QUICK)
    assert quick[:2] == ["--method", "gfwsvd"] and "--k" in quick  # the same case on a tiny calibration
    with pytest.raises(bench.FisherkronError, match="unknown case 'svd'"):
        bench.case_options("svd", full)


def test_the_bound_is_a_third_of_the_plan_or_the_smallest_that_works():
    # SmolLM2's GFWSVD plan at the recipe's calibration (the dry run's numbers)
    plan = {"disk_bytes": 16_048_638_208, "min_max_disk": 2_571_456_640}
    bound = bench.bound_for(plan)
    assert plan["disk_bytes"] / 3 <= bound < plan["disk_bytes"] / 3 + 1000
    # a third below the smallest bound that works: that one, never less
    small = {"disk_bytes": 3_000_000, "min_max_disk": 2_500_001}
    assert 2_500_001 <= bench.bound_for(small) < 2_501_001


def test_the_disk_probe_sees_a_file_that_came_and_went(tmp_path):
    folder = tmp_path / "cache"
    with bench.DiskPeak(folder, every=0.05) as disk:
        time.sleep(0.1)  # the folder does not exist yet: nothing to count
        folder.mkdir()
        (folder / "grads.npy").write_bytes(b"\0" * 300_000)
        time.sleep(0.5)
        (folder / "grads.npy").unlink()
        (folder / "factors.npy").write_bytes(b"\0" * 1000)
    assert disk.peak == 300_000  # the largest size seen, not the size at the end


def _bench(tmp_path, **kw):
    return bench.Bench("model", bench.QUICK, tmp_path, force=kw.get("force", False),
                       keep_finished=kw.get("keep_finished", False), clock=bench.Clock())


def test_a_finished_case_is_kept_only_for_the_same_configuration_and_code(tmp_path, capsys):
    b = _bench(tmp_path)
    config = {"case": "dense", "model": "tiny-llama"}
    b._keep("dense", {"format": bench.FORMAT, "config": config, "code": b.code, "finished_utc": "then"})
    assert b._finished("dense", config)["finished_utc"] == "then"
    assert b._finished("dense", {**config, "model": "other"}) is None
    assert "another configuration" in capsys.readouterr().err
    assert _bench(tmp_path, force=True)._finished("dense", config) is None
    b.code = "other code"
    assert b._finished("dense", config) is None
    assert "measured by other code" in capsys.readouterr().err
    b.keep_finished = True
    assert b._finished("dense", config) is not None
    (tmp_path / "cases" / "dense.json").write_text("{cut sh")
    assert b._finished("dense", config) is None
    assert "cannot be read" in capsys.readouterr().err


def test_the_bounded_case_waits_for_a_command_with_max_disk(tmp_path, capsys):
    b = _bench(tmp_path)
    b._max_disk = False  # as `fisherkron compress --help` of a checkout without the option says
    assert b.case("gfwsvd-recipe-bounded", 0.1) is None
    assert "has no --max-disk" in capsys.readouterr().err
    assert not (tmp_path / "scratch").exists()  # nothing was started


@pytest.mark.slow
def test_quick_runs_every_case_and_a_second_run_keeps_them(tmp_path, monkeypatch, capsys):
    import pandas as pd

    monkeypatch.setattr(bench, "code_fingerprint", lambda: "this code")  # others' edits meanwhile change nothing
    out = tmp_path / "out"
    assert bench.main(["--quick", "--out", str(out)]) == 0
    err = capsys.readouterr().err
    df = pd.read_csv(out / "bench_recipe.csv")
    rec = json.loads((out / "bench_recipe.provenance.json").read_text())
    supported = bench.has_max_disk(dict(os.environ))
    cases = [c for c in bench.CASES if supported or not c.endswith("-bounded")]
    expected = {("dense", 0.0)} | {(c, r) for c in cases for r in (0.1, 0.2)}
    assert set(zip(df["case"], df["ratio"])) == expected and len(df) == len(expected)
    assert all(math.isfinite(v) and v > 1 for v in [*df["ppl_ptb"], *df["ppl_wiki"]])
    compressed = df[df["case"] != "dense"]
    assert ((compressed["params_ratio"] > 0) & (compressed["params_ratio"] < 1)).all()
    assert (compressed["compress_s"] > 0).all() and (compressed["peak_disk_gb"] > 0).all()
    assert rec["extra"]["ptb_before_max_rel_diff"] == 0  # every command's dense PTB is the reference row's
    assert set(rec["tolerances"]) == set(df.columns) and "others_load" in rec["extra"]
    if not supported:
        assert len(rec["extra"]["not_run"]) == 2 and "--max-disk" in err
    else:
        for r in (0.1, 0.2):
            row = df[(df["case"] == "gfwsvd-recipe-bounded") & (df["ratio"] == r)].iloc[0]
            free = df[(df["case"] == "gfwsvd-recipe") & (df["ratio"] == r)].iloc[0]
            assert row["peak_disk_gb"] < row["max_disk_gb"]  # the bound held
            assert row["peak_disk_gb"] < free["peak_disk_gb"]  # the bound bit: the unbounded run went above it
            assert row["passes"] > free["passes"]  # in groups: more forward + backward passes
            # the same factors: the same model
            assert (row["params_ratio"], row["ppl_ptb"], row["ppl_wiki"]) == \
                (free["params_ratio"], free["ppl_ptb"], free["ppl_wiki"])
    kept = {p: p.stat().st_mtime_ns for p in (out / "work" / "cases").glob("*.json")}
    assert len(kept) == len(expected)
    assert bench.main(["--quick", "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert err.count("kept (--force measures it again)") == len(expected) and "start" not in err
    assert {p: p.stat().st_mtime_ns for p in kept} == kept
    assert pd.read_csv(out / "bench_recipe.csv").equals(df)
