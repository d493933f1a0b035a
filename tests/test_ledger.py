"""The ledger keeps a long study's finished scores and sweeps, and gives them back only where the cache lacks them."""
import json

import pytest

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


def test_runs_log_counts_every_run_interrupted_ones_up_to_their_last_sign_of_life(tmp_path):
    import os
    import time

    cache, book = tmp_path / "cache", tmp_path / "ledger"
    done = ledger.run_started("fig_a", "default", cache=cache)
    ledger.run_ended(done, True, 120.0, 200.0, cache=cache)
    # a run whose process is gone: it ends at its progress log's last write
    log = tmp_path / "fig_b.progress.log"
    log.write_text("case 3 of 24")
    lost = ledger.run_started("fig_b", "default", progress=log, cache=cache)
    events = [json.loads(x) for x in (cache / ledger.RUNS).read_text().splitlines()]
    start = next(e for e in events if e["run"] == lost)
    start["pid"] = 2 ** 22 + 12345  # no such process
    (cache / ledger.RUNS).write_text("".join(json.dumps(e) + "\n" for e in events if e["run"] != lost)
                                     + json.dumps(start) + "\n")
    os.utime(log, (start["t"] + 600, start["t"] + 600))
    # a run still going (this process): counted up to the save
    alive = ledger.run_started("fig_b", "default", cache=cache)
    smoke = ledger.run_started("fig_a", "smoke", cache=cache)  # another profile: not counted
    time.sleep(0.05)
    assert ledger.RUNS in ledger.save(cache, book)
    costs = ledger.run_costs(book)
    assert costs["fig_a"] == {"runs": 1, "seconds": 120.0, "finished": True}
    assert costs["fig_b"]["runs"] == 2 and not costs["fig_b"]["finished"]
    assert 600.0 <= costs["fig_b"]["seconds"] < 600.0 + 60
    # the live run ends; the next save merges its end, which replaces its provisional count
    ledger.run_ended(alive, True, 3000.0, cache=cache)
    ledger.run_ended(smoke, True, 1.0, cache=cache)
    ledger.save(cache, book)
    costs = ledger.run_costs(book)
    assert costs["fig_b"] == {"runs": 2, "seconds": 3600.0, "finished": True}
    # a lost run counts up to the largest of its counts (its log went quiet before an earlier save saw it alive)
    quiet = ledger.run_started("fig_d", "default", cache=cache)
    lines = (cache / ledger.RUNS).read_text().splitlines()
    start = json.loads(lines[-1])
    start["t"] -= 600  # it started ten minutes ago
    (cache / ledger.RUNS).write_text("\n".join(lines[:-1] + [json.dumps(start)]) + "\n")
    with open(book / ledger.RUNS, "a") as f:
        f.write(json.dumps(start) + "\n")
        f.write(json.dumps({"event": "alive", "run": quiet, "seconds": 500.0, "t": start["t"] + 500}) + "\n")
        f.write(json.dumps({"event": "lost", "run": quiet, "seconds": 300.0, "t": start["t"] + 300}) + "\n")
    assert ledger.run_costs(book)["fig_d"]["seconds"] == 500.0
    ledger.run_paused(quiet, 120.0, cache=cache)  # stopped two minutes for another measurement
    ledger.save(cache, book)
    assert ledger.run_costs(book)["fig_d"]["seconds"] == 380.0
    ledger.run_ended(quiet, True, 0.0, cache=cache)
    ledger.save(cache, book)
    # with every run ended, merging again changes nothing
    before = (book / ledger.RUNS).read_text()
    assert ledger.RUNS not in ledger.save(cache, book)
    assert (book / ledger.RUNS).read_text() == before
    assert ledger.restore(tmp_path / "elsewhere", book) == []  # the log is never copied back


def test_a_lost_run_is_not_counted_by_the_log_a_later_run_of_its_notebook_rewrote(tmp_path, monkeypatch):
    """Every run of a notebook streams into the same progress log; once the next run has started, the log's time
    is that run's, and the lost one keeps its last count."""
    import os

    monkeypatch.setattr(ledger, "_booted", lambda: 0.0)  # the runs below started before a machine up for minutes
    cache, book = tmp_path / "cache", tmp_path / "ledger"
    log = tmp_path / "fig_e.progress.log"
    log.write_text("case 3 of 24")
    first = ledger.run_started("fig_e", "default", progress=log, cache=cache)
    events = [json.loads(x) for x in (cache / ledger.RUNS).read_text().splitlines()]
    events[0]["pid"], events[0]["t"] = 2 ** 22 + 12345, events[0]["t"] - 7200  # gone; started two hours ago
    events.append({"event": "alive", "run": first, "seconds": 1800.0, "t": events[0]["t"] + 1800})
    (cache / ledger.RUNS).write_text("".join(json.dumps(e) + "\n" for e in events))
    second = ledger.run_started("fig_e", "default", progress=log, cache=cache)  # resumed an hour later, same log
    events = [json.loads(x) for x in (cache / ledger.RUNS).read_text().splitlines()]
    events[-1]["t"] -= 3600
    (cache / ledger.RUNS).write_text("".join(json.dumps(e) + "\n" for e in events))
    log.write_text("case 20 of 24")  # the second run writes the log now
    ledger.run_ended(second, True, 3600.0, cache=cache)
    ledger.save(cache, book)
    assert ledger.run_costs(book)["fig_e"] == {"runs": 2, "seconds": 1800.0 + 3600.0, "finished": True}
    os.utime(log, (events[0]["t"] + 2000, events[0]["t"] + 2000))  # a log left by the first run alone counts
    assert ledger._close(events[0], events[-1]["t"], [events[0]])["seconds"] == 2000.0


def test_a_running_notebook_logs_a_heartbeat(tmp_path):
    import time

    cache = tmp_path / "cache"
    run = ledger.run_started("fig_f", "default", cache=cache)
    with ledger.heartbeat(run, every=0.05, cache=cache):
        time.sleep(0.3)
    beats = [json.loads(x) for x in (cache / ledger.RUNS).read_text().splitlines()][1:]
    assert len(beats) >= 2 and all(b["event"] == "alive" and b["run"] == run for b in beats)
    assert 0.0 < beats[0]["seconds"] < beats[-1]["seconds"] < 1.0
    n = len(beats)
    time.sleep(0.15)  # the block has ended: no more beats
    assert len((cache / ledger.RUNS).read_text().splitlines()) == n + 1


def test_a_run_another_machine_counted_keeps_its_last_count(tmp_path, monkeypatch):
    import time

    cache, book = tmp_path / "cache", tmp_path / "ledger"
    run = ledger.run_started("fig_c", "default", cache=cache)
    ledger.save(cache, book)  # alive: counted up to this save
    counted = ledger.run_costs(book)["fig_c"]["seconds"]
    # a new machine (its own name, an empty cache, the run's process and log gone with the old one)
    monkeypatch.setattr(ledger.socket, "gethostname", lambda: "another-machine")
    assert ledger.save(tmp_path / "new-cache", book) == []
    assert ledger.run_costs(book)["fig_c"] == {"runs": 1, "seconds": counted, "finished": False}
    # ... or a machine of the same name started after the run (a new session's machine)
    monkeypatch.undo()
    monkeypatch.setattr(ledger, "_booted", lambda: time.time())
    assert ledger.save(tmp_path / "new-cache", book) == []
    assert ledger.run_costs(book)["fig_c"]["seconds"] == counted
    assert run


def test_a_pause_that_cannot_be_is_refused_and_not_logged(tmp_path):
    from fisherkron.core.conventions import FisherkronError

    cache = tmp_path / "cache"
    run = ledger.run_started("fig_a", "default", cache=cache)
    before = (cache / ledger.RUNS).read_text()
    for seconds in (1.8e9, -1.0, float("nan"), "", None):  # an empty shell variable made `$((now - ))` a timestamp
        with pytest.raises(FisherkronError, match="pause"):
            ledger.run_paused(run, seconds, cache=cache)
    with pytest.raises(FisherkronError, match="no start"):
        ledger.run_paused("0123456789ab", 1.0, cache=cache)
    assert (cache / ledger.RUNS).read_text() == before
    ledger.run_paused(run, 0.0, cache=cache)  # a pause as long as the run so far is fine
    assert '"paused"' in (cache / ledger.RUNS).read_text()


def test_paused_within_counts_a_notebooks_pauses_inside_the_stretch_once(tmp_path):
    """A committed run's wall time less its pauses: only the overlap of each pause ``[t - s, t]`` with the stretch
    counts, another notebook's pauses do not, and a pause kept in two logs (a study's and the cold run's) counts
    once."""
    def log(folder, *events):
        folder.mkdir(parents=True, exist_ok=True)
        (folder / ledger.RUNS).write_text("".join(json.dumps(e) + "\n" for e in events))

    start = {"event": "start", "run": "r1", "notebook": "fig_a", "profile": "default", "t": 1000.0}
    other = {"event": "start", "run": "r2", "notebook": "fig_b", "profile": "default", "t": 1000.0}
    inside = {"event": "paused", "run": "r1", "seconds": 50.0, "t": 1200.0}  # [1150, 1200]
    straddling = {"event": "paused", "run": "r1", "seconds": 100.0, "t": 1550.0}  # [1450, 1550]: 50 s inside
    before = {"event": "paused", "run": "r1", "seconds": 10.0, "t": 1005.0}  # [995, 1005]: 5 s inside
    elsewhere = {"event": "paused", "run": "r2", "seconds": 70.0, "t": 1300.0}
    log(tmp_path / "a", start, other, inside, straddling, elsewhere)
    log(tmp_path / "b", start, inside, before)
    got = ledger.paused_within("fig_a", 1000.0, 1500.0, [tmp_path / "a", tmp_path / "b"])
    assert got == pytest.approx(50.0 + 50.0 + 5.0)
    assert ledger.paused_within("fig_b", 1000.0, 1500.0, [tmp_path / "a"]) == pytest.approx(70.0)
    assert ledger.paused_within("fig_a", 2000.0, 3000.0, [tmp_path / "a"]) == 0.0
    assert ledger.paused_within("fig_a", 1000.0, 1500.0, [tmp_path / "missing"]) == 0.0


def test_a_run_names_its_machine_with_the_cpus_vector_extensions(tmp_path, monkeypatch):
    from fisherkron.repro import figures

    assert figures.cpu_isa("fpu sse2 avx avx2 fma") == "AVX2"
    assert figures.cpu_isa("avx2 avx512f avx512_bf16 amx_tile amx_bf16") == "AVX2, AVX-512, AVX-512 BF16, AMX"
    assert figures.cpu_isa("fpu sse2") == "none"
    cache = tmp_path / "cache"
    monkeypatch.setattr(ledger, "cpu_name", lambda: "AMD EPYC")
    monkeypatch.setattr(ledger, "cpu_isa", lambda: "AVX2")
    monkeypatch.setattr(ledger.os, "sched_getaffinity", lambda pid: {0, 1})
    ledger.run_started("fig_f", "default", cache=cache)
    with (cache / ledger.RUNS).open("a") as f:  # a run logged before the extensions were
        f.write(json.dumps({"event": "start", "run": "old", "notebook": "fig_f", "profile": "default", "t": 1.0,
                            "cpu": "Intel Xeon", "cores": 2}) + "\n")
    assert ledger.run_machines(cache) == ["2-core AMD EPYC (AVX2)", "2-core Intel Xeon"]
