"""``fisherkron.env.OtherLoad``: the share of the cores other processes used while a timing ran."""
import json
import os

import pytest

from fisherkron import env
from fisherkron.experiments import calibration_study as cs


def _fake(monkeypatch, jiffies, own):
    """Make OtherLoad read ``jiffies`` (busy, total) and ``own`` CPU seconds, one value per call."""
    j, o = iter(jiffies), iter(own)
    monkeypatch.setattr(env, "_cpu_jiffies", lambda: next(j))
    monkeypatch.setattr(env, "_own_cpu_seconds", lambda: next(o))


@pytest.mark.parametrize("own_seconds, share", [(0.0, 0.5), (1.0, 0.25), (2.0, 0.0), (3.0, 0.0)])
def test_other_load_counts_the_cores_busy_time_less_this_process_own(monkeypatch, own_seconds, share):
    tick = os.sysconf("SC_CLK_TCK")
    # over the block: 2 s of 4 core-seconds busy (2 cores, 2 s of wall time), of which own_seconds are ours.
    # A version that forgot to subtract its own time would call a busy benchmark on idle cores "shared" (0.5).
    _fake(monkeypatch, [(10 * tick, 50 * tick), (12 * tick, 54 * tick)], [5.0, 5.0 + own_seconds])
    with env.OtherLoad() as load:
        pass
    assert load.share == pytest.approx(share)


def test_other_load_is_none_where_the_counters_cannot_be_read_or_did_not_move(monkeypatch):
    _fake(monkeypatch, [None, (1, 2)], [0.0, 0.0])
    with env.OtherLoad() as load:
        pass
    assert load.share is None
    _fake(monkeypatch, [(1, 2), (1, 2)], [0.0, 0.0])  # under one clock tick
    with env.OtherLoad() as load:
        pass
    assert load.share is None


def test_other_load_reads_this_machine_within_its_bounds():
    with env.OtherLoad() as load:
        sum(i * i for i in range(200_000))  # own work, which never counts
    assert load.share is None or 0.0 <= load.share <= 1.0


def test_a_cost_measurement_knows_the_interrupted_collections_it_would_resume(tmp_path):
    (tmp_path / "abc.partial").mkdir()
    (tmp_path / "abc.partial" / "partial.json").write_text(json.dumps({"key": "abc", "code": "x"}))
    (tmp_path / "def.partial").mkdir()  # its info file lost: its folder name still says the key
    (tmp_path / "ghi").mkdir()  # a finished collection
    assert cs._partial_keys(tmp_path) == {"abc", "def"}
    assert cs._partial_keys(tmp_path / "missing") == set()
