"""The tables the book's hand-written pages include (fisherkron/repro/book/generated.py); no notebook runs."""
import json
from pathlib import Path

from fisherkron.env import file_checksum
from fisherkron.repro.book.generated import FOLDER, verify_table, write_generated
from fisherkron.repro.book.records import Outputs
from fisherkron.repro.verify import cpu_folder

ROOT = Path(__file__).resolve().parents[1]


def _rows(text: str) -> list[str]:
    """The body rows of the Markdown tables in ``text`` (header and rule lines left out)."""
    lines = [line for line in text.splitlines() if line.startswith("|")]
    return [line for line in lines if not line.startswith("|---") and not line.startswith("| notebook |")
            and not line.startswith("| gradients") and not line.startswith("| target |")]


def test_every_table_is_written_from_the_committed_files(tmp_path):
    written = write_generated(tmp_path, ROOT)
    folder = tmp_path / FOLDER
    assert {p.name for p in written} >= {"verify_record.md", "notebook_costs.md", "bench.md"}
    for name in ("verify_record.md", "notebook_costs.md", "bench.md"):
        text = (folder / name).read_text(encoding="utf-8")
        assert _rows(text), f"{name} holds no table row"
        assert "<!--" not in text and "/work/" not in text  # no README markers, no absolute paths
    bench = (folder / "bench.md").read_text(encoding="utf-8")
    if "fig_bench_mff.png" in bench:
        assert (folder / "fig_bench_mff.png").is_file()


def test_each_committed_verify_record_has_a_row(tmp_path):
    write_generated(tmp_path, ROOT)
    rows = _rows((tmp_path / FOLDER / "verify_record.md").read_text(encoding="utf-8"))
    records = [p.stem for p in (ROOT / "data" / "verify").glob("*/*.json")]  # one per notebook and CPU model
    assert len(rows) == len(records)
    for name in set(records):
        assert sum(f"`{name}`" in row for row in rows) == records.count(name), name


def _record(root: Path, notebook: str, result: str, failures: list[str],
            cpu: str = "Intel(R) Xeon(R) Processor") -> None:
    """A verify record of one table whose committed CSV is the one it was compared with, made on ``cpu`` from a
    committed record so that it has every field a record has."""
    (root / "figures").mkdir(exist_ok=True)
    csv = root / "figures" / f"{notebook}_t.csv"
    csv.write_text("a\n1\n", encoding="utf-8")
    rec = json.loads((ROOT / "data" / "verify" / "amd-epyc" / "fig_time_algo.json").read_text(encoding="utf-8"))
    table = dict(rec["tables"][0], name=f"{notebook}_t", sha=file_checksum(csv), worst=3.5 if failures else 0.0,
                 status=result)
    rec.update(notebook=notebook, result=result, values=7, worst=3.5 if failures else 0.0, failures=failures,
               data="fresh", finished="2030-01-02T03:04:05Z", tables=[table],
               machine={"cpu": cpu, "cpu_count": 2})
    folder = root / "data" / "verify" / cpu_folder(rec["machine"])
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{notebook}.json").write_text(json.dumps(rec), encoding="utf-8")


def test_a_failing_record_shows_fail_and_its_count(tmp_path):
    _record(tmp_path, "nb_bad", "FAIL", ["t row 1 column 'a': committed 1, now 9"])
    _record(tmp_path, "nb_good", "PASS", [])
    text = verify_table(Outputs(tmp_path / "figures"), tmp_path)
    bad, good = (next(r for r in _rows(text) if f"`{n}`" in r) for n in ("nb_bad", "nb_good"))
    assert "FAIL" in bad and "3.50" in bad and "2-core Intel Xeon" in bad and "2030-01-02" in bad
    assert "PASS" in good and "FAIL" not in good and "identical" in good
    assert "outside their tolerance in these runs: 1;" in text


def test_each_cpu_model_keeps_its_row_and_the_notebooks_it_has_not_verified_are_named(tmp_path):
    _record(tmp_path, "nb_both", "PASS", [])
    _record(tmp_path, "nb_both", "PASS", [], cpu="AMD EPYC")
    _record(tmp_path, "nb_amd", "PASS", [], cpu="AMD EPYC")
    text = verify_table(Outputs(tmp_path / "figures"), tmp_path)
    both = [r for r in _rows(text) if "`nb_both`" in r]
    assert len(both) == 2 and "2-core AMD EPYC" in both[0] and "2-core Intel Xeon" in both[1]
    assert "Not yet verified on the Intel Xeon: `nb_amd`." in text and "on the AMD EPYC:" not in text


def test_a_table_regenerated_since_the_verify_is_named(tmp_path):
    _record(tmp_path, "nb", "PASS", [])
    (tmp_path / "figures" / "nb_t.csv").write_text("a\n2\n", encoding="utf-8")
    text = verify_table(Outputs(tmp_path / "figures"), tmp_path)
    assert "a table changed since" in text and "`make verify-stale` runs these again" in text


def test_the_recipe_benchmark_is_its_committed_table_or_says_it_has_not_run(tmp_path):
    from fisherkron.repro.book.generated import bench_recipe
    from fisherkron.repro.figures import save_table
    import pandas as pd

    assert "has not been run" in bench_recipe(Outputs(tmp_path / "figures"), tmp_path)
    df = pd.DataFrame({"case": ["recommended", "old default"], "ratio": [0.1, 0.1], "PTB": [68.59, 963.3]})
    save_table(df, "bench_recipe", tmp_path / "figures" / "bench", {"ratios": [0.1]})
    text = bench_recipe(Outputs(tmp_path / "figures"), tmp_path)
    assert "make bench-recipe" in text and "has not been run" not in text
    rows = _rows(text)[1:]  # below the table's header
    assert len(rows) == 2 and "68.59" in rows[0] and "963.3" in rows[1]
    assert "/work/" not in text and str(tmp_path) not in text


def test_the_cold_run_is_its_committed_runs_log_or_says_it_has_not_started(tmp_path):
    from fisherkron.repro import cold, ledger
    from fisherkron.repro.book.generated import cold_run

    out = Outputs(tmp_path / "figures")
    assert "has not started" in cold_run(out, tmp_path)
    cache, book = tmp_path / "cache", tmp_path / "data" / "ledger" / "cold"
    first, second = cold.ORDER[:2]
    for name, seconds in ((first, 1800.0), (second, 5400.0)):
        ledger.run_ended(ledger.run_started(name, "default", cache=cache), True, seconds, cache=cache)
    ledger.run_ended(ledger.run_started(cold.ORDER[2], "default", cache=cache), False, 720.0, cache=cache)
    ledger.save(cache, book)
    text = cold_run(out, tmp_path)
    rows = _rows(text)
    assert len(rows) == len(cold.ORDER)
    assert "| yes | 1 | 0.50 |" in rows[0] and "| yes | 1 | 1.50 |" in rows[1] and "| no | 1 | 0.20 |" in rows[2]
    assert "In all: 2.20 h" in text and "2 of 13 notebooks finished" in text and "-core" in text
    assert "The target, 6 h for all 13 notebooks, is 3.80 h away." in text
    assert "finishing runs" not in text  # no record carries phases: nothing claimed about them
    assert str(tmp_path) not in text
    assert "run apart" not in text
    apart = tmp_path / "apart"  # the scale study's runs log, data/ledger/runs.jsonl
    ledger.run_ended(ledger.run_started(cold.EXCLUDED[0], "default", cache=apart), True, 36000.0, cache=apart)
    ledger.run_ended(ledger.run_started(cold.EXCLUDED[0], "smoke", cache=apart), True, 60.0, cache=apart)
    ledger.save(apart, tmp_path / "data" / "ledger")
    text = cold_run(out, tmp_path)
    assert f"`{cold.EXCLUDED[0]}`" in text
    assert "run apart with a budget of its own: 10.00 h of wall time over 1 run(s), finished" in text


def test_where_a_finishing_run_spent_its_time_is_read_from_its_records_phases(tmp_path):
    from fisherkron.repro.book.generated import phase_hours, phase_shares

    figs = tmp_path / "figures"
    figs.mkdir()
    nb = "notebooks/tab_x.py"

    def record(name, wall, phases, notebook=nb):
        rec = {"name": name, "notebook": notebook, "wall_seconds": wall, "created_utc": "2026-01-01T00:00:00Z",
               "files": [], "parameters": {}, "machine": {}, "git": None}
        if phases is not None:
            rec["phases"] = phases
        (figs / f"{name}.provenance.json").write_text(json.dumps(rec), encoding="utf-8")

    record("tab_x", 100.0, None)
    assert phase_shares(Outputs(figs), "tab_x") == ""  # no phases recorded: nothing claimed
    # the longest record of the run counts; shares of its wall time, largest first, the unphased rest named
    record("tab_x_first", 50.0, {"calibration": 40.0})
    record("tab_x_summary", 1000.0, {"sensitivity sweeps": 500.0, "calibration": 200.0, "scoring": 100.0,
                                     "model loading": 1.0})
    assert phase_shares(Outputs(figs), "tab_x") == ("sensitivity sweeps 50 %, calibration 20 %, scoring 10 %, "
                                                    "outside the library's phases 20 %")
    assert phase_shares(Outputs(figs), "tab_x", top=1) == "sensitivity sweeps 50 %, outside the library's phases 20 %"
    # the cold run's line sums each notebook's finishing record, in hours
    record("tab_y", 7200.0, {"calibration": 3600.0, "scoring": 1800.0}, notebook="notebooks/tab_y.py")
    assert phase_hours(Outputs(figs), ["tab_x", "tab_y"], top=2) == (
        "The finishing runs of the 2 finished notebooks took 2.28 h, of which calibration 1.06 h, scoring 0.53 h; "
        "the time of interrupted runs, whose caches the finishing runs read, is not split into phases.")


def test_a_committed_runs_pauses_are_left_out_of_its_time_and_named_in_its_phases(tmp_path):
    """A run stopped (SIGSTOP) for other measurements: its committed time (the notebook-costs table) and the
    finishing runs' total leave the pause out; the phase shares, timed by the clock, say how much of the run was
    stopped."""
    from fisherkron.repro import ledger
    from fisherkron.repro.book.generated import phase_hours, phase_shares
    from fisherkron.repro.book.records import run_seconds

    figs, book = tmp_path / "figures", tmp_path / "data" / "ledger" / "cold"
    figs.mkdir()
    rec = {"name": "tab_x", "notebook": "notebooks/tab_x.py", "wall_seconds": 4000.0, "files": [],
           "created_utc": "2026-01-01T02:00:00Z", "parameters": {}, "machine": {}, "git": None,
           "phases": {"scoring": 3000.0}}
    (figs / "tab_x.provenance.json").write_text(json.dumps(rec), encoding="utf-8")
    end = 1767232800.0  # 2026-01-01T02:00:00Z
    book.mkdir(parents=True)
    (book / ledger.RUNS).write_text("".join(json.dumps(e) + "\n" for e in [
        {"event": "start", "run": "r1", "notebook": "tab_x", "profile": "default", "t": end - 4000.0},
        {"event": "paused", "run": "r1", "seconds": 1000.0, "t": end - 1000.0}]))
    out = Outputs(figs)
    assert run_seconds(out, "tab_x") == 4000.0
    assert run_seconds(out, "tab_x", [book]) == 3000.0
    assert phase_shares(out, "tab_x", ledgers=[book]) == (
        "scoring 75 %, outside the library's phases 25 % (25 % of it stopped for other measurements, counted in the "
        "phases it interrupted)")
    assert phase_shares(out, "tab_x") == "scoring 75 %, outside the library's phases 25 %"
    line = phase_hours(out, ["tab_x"], ledgers=[book])
    assert "took 0.83 h" in line and "0.28 h for which a run was stopped" in line
