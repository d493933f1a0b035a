"""The cold-run driver: every notebook named once, run by name with a data root of its own, resumable."""
import json
import stat

import pytest

from fisherkron.core.conventions import FisherkronError
from fisherkron.env import REPO_ROOT
from fisherkron.repro import cold


def test_the_cold_run_names_every_notebook_of_the_default_profile_once():
    notebooks = {p.stem for p in (REPO_ROOT / "notebooks").glob("*.py")
                 if (REPO_ROOT / "notebooks" / "params" / f"{p.stem}.default.yaml").is_file()}
    assert len(cold.ORDER) == len(set(cold.ORDER))
    assert set(cold.ORDER) | set(cold.EXCLUDED) == notebooks and not set(cold.ORDER) & set(cold.EXCLUDED)


def _fake_make(tmp_path, fail=""):
    calls = tmp_path / "calls.txt"
    make = tmp_path / "make"
    make.write_text(f'#!/bin/sh\necho "$*|$FISHERKRON_DATA" >> {calls}\n'
                    f'case "$3" in {fail or "-none-"}) exit 3;; esac\nexit 0\n')
    make.chmod(make.stat().st_mode | stat.S_IEXEC)
    return str(make), calls


def test_run_names_each_notebook_with_its_own_data_root_and_resumes_after_a_failure(tmp_path):
    data = tmp_path / "cold"
    make, calls = _fake_make(tmp_path, fail="fig_time_algo")
    assert cold.run(cold.ORDER[:4], data, make=make) == 3  # stops at the failure
    lines = calls.read_text().splitlines()
    assert [ln.split("|")[0] for ln in lines] == [f"-W notebooks/{n}.py {n}" for n in cold.ORDER[:3]]
    assert all(ln.split("|")[1] == str(data.resolve()) for ln in lines)
    assert (data / "models").is_symlink()
    done = json.loads((data / cold.STATE).read_text())["done"]
    assert set(done) == set(cold.ORDER[:2])
    make, calls = _fake_make(tmp_path)  # the next call: the finished ones are skipped
    calls.unlink()
    assert cold.run(cold.ORDER[:4], data, make=make) == 0
    assert [ln.split("|")[0].split()[-1] for ln in calls.read_text().splitlines()] == list(cold.ORDER[2:4])
    assert cold.plan(cold.read_state(data), cold.ORDER[:4]) == []


def test_refusals_are_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("FISHERKRON_DATA", str(tmp_path / "in-use"))
    with pytest.raises(FisherkronError, match="data root in use"):
        cold.cold_data(tmp_path / "in-use")
    with pytest.raises(FisherkronError, match="no notebook named"):
        cold.plan({"done": {}}, ["fig_nothing"])
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / cold.STATE).write_text("{not json")
    with pytest.raises(FisherkronError, match="damaged"):
        cold.read_state(tmp_path / "d")
    assert cold.main(["run", "--data", str(tmp_path / "in-use"), "--dry-run"]) == 2
