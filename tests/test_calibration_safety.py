"""The calibration cache on real disks, shared machines and interrupted runs.

One class of defect a section, each tested through its mechanism on the tiny models:

1. a resume checks what it resumes from (row checksums, file shapes, the checkpoint's digest)
   and runs damaged batches again; no zero-filled row is sealed;
2. cached MFF factors carry a checksum that covers their entry, verified on read;
3. resources: the gradient files' space is reserved up front (a full disk is one line); an owner
   marker names its process by pid, host, boot and start time; a read-only cache serves what it
   holds and refuses the rest in one line;
4. batches that are not dicts are refused in one line;
5. abandoned folders are reported and reclaimed; a finished entry holds no owner marker;
6. an interrupted collection over a process group resumes (two gloo processes).
"""
import builtins
import errno
import functools
import io
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from distributed_ranks import run_ranks
from tiny_models import slow_loss, tiny_llama, token_batches

import fisherkron as fk
from fisherkron.core.conventions import FisherkronError
from fisherkron.env import TMP_PREFIX, stale_temporaries
from fisherkron.hf.calibration import collect_calibration
from fisherkron.hf.calibration.folders import INFO, MAX_PARTIAL_AGE, OWNER
from fisherkron.hf.calibration.keys import code_version
from fisherkron.testing import MFF_F64_REL, MFF_REF_TOL, rel_error

HERE = Path(__file__)
LAYERS = r"model\.layers\.0\.mlp\..*"
UP = "model.layers.0.mlp.up_proj"
#: float64 MFF to round-off: factors computed on one process and on two agree to MFF_F64_REL
F64_MFF = {"dtype": torch.float64, "tol": MFF_REF_TOL}


def _batches(k=4, B=2, T=8, seed=0):
    return token_batches(k=k, B=B, T=T, seed=seed)


def _interrupted(folder, after=2, k=4, name="t", **kw):
    """A collection stopped by SIGTERM during batch ``after`` of ``k``: ``(run, calls, partial folder)``.

    ``run(cache_dir=...)`` repeats the same call (no signal); ``calls`` counts its loss evaluations.
    """
    model, b = tiny_llama(), _batches(k=k)
    calls, armed = [], [True]

    def loss(m, x):
        calls.append(1)
        if armed[0] and len(calls) == after:
            os.kill(os.getpid(), signal.SIGTERM)
        return m(**x).loss
    run = functools.partial(collect_calibration, model, b, LAYERS, loss_fn=loss, loss_name=name, **kw)
    with pytest.raises(KeyboardInterrupt, match=f"after batch {after} of {k}"):
        run(cache_dir=folder)
    armed[0] = False
    calls.clear()
    (partial,) = Path(folder).glob("*.partial")
    return run, calls, partial


def _same_entry(a, b):
    """Two entries hold the same ``.npy`` files, bit for bit."""
    names = sorted(p.name for p in a.dir.glob("*.npy"))
    assert names == sorted(p.name for p in b.dir.glob("*.npy"))
    for name in names:
        np.testing.assert_array_equal(np.load(a.dir / name), np.load(b.dir / name), err_msg=name)


def _row_offset(path):
    with open(path, "rb") as fh:
        np.lib.format.read_magic(fh)
        shape, _, dtype = np.lib.format.read_array_header_1_0(fh)
        return fh.tell(), int(np.prod(shape[1:])) * np.dtype(dtype).itemsize


# ----------------------------------------------------------------------------- 1. damaged partial folders

@pytest.mark.parametrize("damage,runs_again", [("delete", 2), ("truncate", 2), ("zero_row", 1)])
def test_a_resume_runs_damaged_gradient_rows_again_and_never_seals_zeros(damage, runs_again, tmp_path, caplog):
    """A deleted or truncated gradient file (an interrupted copy of the cache) or a zeroed row fails the
    checksums of the rows the checkpoint lists: those batches run again and the entry equals an
    uninterrupted one (the old code zero-filled them, or refused a truncated file)."""
    run, calls, partial = _interrupted(tmp_path)
    grads = partial / f"{UP}.grads.npy"
    if damage == "delete":
        grads.unlink()
    elif damage == "truncate":
        os.truncate(grads, grads.stat().st_size // 2)
    else:
        offset, row = _row_offset(grads)
        with open(grads, "r+b") as fh:
            fh.seek(offset + 1 * row)
            fh.write(bytes(row))  # batch 1's gradient, zero-filled
    with caplog.at_level(logging.WARNING, logger="fisherkron"):
        st = run(cache_dir=tmp_path)
    assert len(calls) == 2 + runs_again  # batches 3 and 4, and the damaged ones again
    assert "running those batches again" in caplog.text
    ref = run(cache_dir=tmp_path / "ref")
    _same_entry(st, ref)
    assert not (st.dir / "progress.pt").exists()


def test_a_float16_resume_keeps_its_scales_in_the_checkpoint(tmp_path):
    """The per-gradient scales of float16 gradients are part of the checked checkpoint (a separate
    ``grad_scales.partial.npy`` could be lost on its own: the old code then failed with a raw error)."""
    run, calls, partial = _interrupted(tmp_path, grad_dtype="float16")
    for f in partial.glob("*grad_scales*"):
        f.unlink()
    st = run(cache_dir=tmp_path)
    assert len(calls) == 2
    _same_entry(st, run(cache_dir=tmp_path / "ref"))


def test_damaged_per_token_rows_start_the_collection_again(tmp_path, caplog):
    run, calls, partial = _interrupted(tmp_path, granularity="token")
    x = partial / f"{UP}.X.npy"
    os.truncate(x, x.stat().st_size - 7)
    with caplog.at_level(logging.WARNING, logger="fisherkron"):
        st = run(cache_dir=tmp_path)
    assert len(calls) == 4 and "starts again" in caplog.text
    _same_entry(st, run(cache_dir=tmp_path / "ref"))


def test_a_checkpoint_whose_sums_were_changed_is_not_resumed(tmp_path, caplog):
    """The checkpoint's digest covers its sums: changed ones (or a damaged file) start the collection again."""
    run, calls, partial = _interrupted(tmp_path)
    state = torch.load(partial / "progress.pt", weights_only=True)
    state["acc"][UP]["g2"] *= 2
    torch.save(state, partial / "progress.pt")
    with caplog.at_level(logging.WARNING, logger="fisherkron"):
        st = run(cache_dir=tmp_path)
    assert len(calls) == 4 and "damaged" in caplog.text
    _same_entry(st, run(cache_dir=tmp_path / "ref"))


# ----------------------------------------------------------------------------- 2. cached MFF factors

def test_cached_mff_factors_that_fail_their_checksum_are_recomputed(tmp_path, caplog):
    model, b = tiny_llama(), _batches(k=3)
    st = collect_calibration(model, b, UP, stats=("grads",), cache_dir=tmp_path)
    ref = st.kronecker(UP, **F64_MFF)
    (f,) = (st.dir / "mff").glob("*.pt")
    saved = torch.load(f, weights_only=True)
    saved["A"] = saved["A"] * 2  # a changed file, its (old) checksum kept
    torch.save(saved, f)
    with caplog.at_level(logging.WARNING, logger="fisherkron"):
        again = st.kronecker(UP, **F64_MFF)
    assert "fails its checksum" in caplog.text
    assert torch.equal(again["A"], ref["A"]) and set(again) == set(ref)
    # the file of another entry (another seed: another key) is not this entry's, even unchanged
    other = collect_calibration(model, b, UP, stats=("grads",), seed=1, cache_dir=tmp_path)
    (other.dir / "mff").mkdir()
    shutil.copy(f, other.dir / "mff" / f.name)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="fisherkron"):
        other.kronecker(UP, **F64_MFF)
    assert "fails its checksum" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="fisherkron"):
        assert torch.equal(st.kronecker(UP, **F64_MFF)["A"], ref["A"])  # a verified file: no warning
    assert "MFF" not in caplog.text


def kronecker_on_ranks(rank, world, folder):
    """Every rank reads the cached entry and asks for the (process-group) MFF factors of ``UP``."""
    st = fk.collect_calibration(tiny_llama(), _batches(k=3), UP, stats=("grads",), cache_dir=folder, group="auto")
    return st.kronecker(UP, group="auto", **F64_MFF)["A"]


def test_cached_mff_factors_are_checked_on_the_process_group_path_too(tmp_path):
    st = collect_calibration(tiny_llama(), _batches(k=3), UP, stats=("grads",), cache_dir=tmp_path)
    ref = st.kronecker(UP, **F64_MFF)["A"]
    (f,) = (st.dir / "mff").glob("*.pt")
    saved = torch.load(f, weights_only=True)
    saved["A"] = saved["A"] * 2
    torch.save(saved, f)
    got = run_ranks(HERE, "kronecker_on_ranks", 2, tmp_path, tmp_path, timeout=60)
    for ok, A in got:
        assert ok, A
        assert rel_error(A, ref) <= MFF_F64_REL  # recomputed over the ranks, not the changed file
    assert rel_error(st.kronecker(UP, **F64_MFF)["A"], ref) <= MFF_F64_REL  # rank 0 kept valid factors


# ----------------------------------------------------------------------------- 3. resources and shared machines

def test_a_full_disk_is_one_line_naming_the_folder_before_any_batch(tmp_path, monkeypatch):
    """The gradient files get their blocks up front; ENOSPC there (or too little free space) is one line
    naming the folder, the space needed and free, and what to do; no batch runs and nothing is left."""
    calls = []

    def loss(m, x):
        calls.append(1)
        return m(**x).loss
    run = functools.partial(collect_calibration, tiny_llama(), _batches(), LAYERS, loss_fn=loss, loss_name="d",
                            cache_dir=tmp_path)

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")
    with monkeypatch.context() as m:
        m.setattr(os, "posix_fallocate", full)
        with pytest.raises(FisherkronError) as err:
            run()
    msg = str(err.value)
    assert "\n" not in msg and f"in {tmp_path} (" in msg and "kB needed" in msg and "GB free" in msg
    assert "--cache-dir" in msg and "fewer layers" in msg and "bfloat16" in msg
    assert calls == [] and list(tmp_path.iterdir()) == []
    with monkeypatch.context() as m:  # the free space says so before anything is written
        m.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**9, 10**9 - 100, 100))
        with pytest.raises(FisherkronError, match=r"needed, 100 bytes free\).*--cache-dir"):
            run(grad_dtype="bfloat16")
    assert calls == []

    def unsupported(fd, offset, length):
        raise OSError(errno.EOPNOTSUPP, "Operation not supported")
    with monkeypatch.context() as m:  # a file system without fallocate: the blocks are written as zeros
        m.setattr(os, "posix_fallocate", unsupported)
        st = run()
    ref = run(cache_dir=tmp_path / "ref")
    _same_entry(st, ref)


def _proc_start(pid):
    return float(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])


def _owner_record(pid):
    """What a live process ``pid`` of this host writes into its owner marker."""
    boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    return {"pid": pid, "host": socket.gethostname(), "boot": boot, "clock": "ticks", "start": _proc_start(pid),
            "written": time.time()}


@pytest.fixture
def sleeper():
    proc = subprocess.Popen(["sleep", "120"])
    time.sleep(0.05)
    yield proc
    proc.kill()
    proc.wait()


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="process start times from /proc (Linux)")
def test_an_owner_marker_names_pid_host_boot_and_start(tmp_path, sleeper, caplog, monkeypatch):
    """A marker whose process id now belongs to another process (started later, or since a restart) is stale;
    the marker's own live process is respected (refused when waiting is off); another host's is reported with
    the file to delete."""
    monkeypatch.setenv("FISHERKRON_CALIBRATION_WAIT", "0")
    pid, me = sleeper.pid, _owner_record(sleeper.pid)
    cases = [("legacy-reused", str(pid), True),  # the first version's marker: the id alone, written a day ago
             ("other-boot", json.dumps({**me, "boot": "a-boot-before-the-restart"}), True),
             ("other-start", json.dumps({**me, "start": me["start"] + 1000}), True),
             ("live", json.dumps(me), False),
             ("other-host", json.dumps({**me, "host": "node-elsewhere"}), False)]
    for name, text, stale in cases:
        run, calls, partial = _interrupted(tmp_path / name, after=1, k=2, name=name)
        marker = partial / OWNER
        marker.write_text(text)
        day_ago = time.time() - 86400
        os.utime(marker, (day_ago, day_ago))
        if stale:
            with caplog.at_level(logging.WARNING, logger="fisherkron"):
                st = run(cache_dir=tmp_path / name)
            assert len(calls) == 1 and "stale" in caplog.text, name
            assert not (st.dir / OWNER).exists()
        elif name == "live":
            with pytest.raises(FisherkronError, match=f"process {pid} is collecting this calibration"):
                run(cache_dir=tmp_path / name)
        else:
            with pytest.raises(FisherkronError) as err:
                run(cache_dir=tmp_path / name)
            assert "host node-elsewhere" in str(err.value) and f"delete {marker}" in str(err.value)
            assert "\n" not in str(err.value)


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="process start times from /proc (Linux)")
def test_a_live_owner_is_waited_for_then_its_folder_is_taken_over(tmp_path, caplog, monkeypatch):
    """A folder a live process of this host fills is waited for (said once); when that process ends without
    finishing, the folder is resumed from its checkpoint; a wait longer than the limit is refused in one line."""
    run, calls, partial = _interrupted(tmp_path, after=2, k=3)
    owner = subprocess.Popen(["sleep", "2"])
    try:
        (partial / OWNER).write_text(json.dumps(_owner_record(owner.pid)))
        monkeypatch.setenv("FISHERKRON_CALIBRATION_WAIT", "0.5")
        with pytest.raises(FisherkronError) as err:
            run(cache_dir=tmp_path)
        assert f"process {owner.pid} is collecting this calibration" in str(err.value)
        assert "waited" in str(err.value) and "FISHERKRON_CALIBRATION_WAIT" in str(err.value)
        assert "\n" not in str(err.value) and calls == []
        monkeypatch.setenv("FISHERKRON_CALIBRATION_WAIT", "60")
        caplog.clear()
        start = time.monotonic()
        with caplog.at_level(logging.INFO, logger="fisherkron"):
            st = run(cache_dir=tmp_path)
        assert owner.poll() is not None and time.monotonic() - start >= 1.0
    finally:
        owner.kill()
        owner.wait()
    assert caplog.text.count(f"process {owner.pid} is collecting this calibration") == 1
    assert f"process {owner.pid} is done with" in caplog.text
    assert len(calls) == 1 and not st.from_cache  # the interrupted run kept batches 1 and 2: batch 3 remains
    monkeypatch.setenv("FISHERKRON_CALIBRATION_WAIT", "soon")
    with pytest.raises(FisherkronError, match="FISHERKRON_CALIBRATION_WAIT='soon' is not a number of seconds"):
        run(cache_dir=tmp_path / "elsewhere")


_SLOW_COLLECTOR = """
import sys
sys.path.insert(0, {tests!r})
from tiny_models import slow_loss, tiny_llama, token_batches
from fisherkron.hf.calibration import collect_calibration

collect_calibration(tiny_llama(), token_batches(k=3, B=2, T=8, seed=0), {layers!r}, loss_fn=slow_loss,
                    loss_name="slow", cache_dir={root!r})
"""


def test_a_second_process_waits_for_the_first_and_reads_its_entry(tmp_path, caplog):
    """Two processes asking for the same calibration at once (two notebooks under ``make -j2``): the second
    waits for the first and reads the entry it sealed; nothing is collected twice."""
    code = _SLOW_COLLECTOR.format(tests=str(HERE.parent), layers=LAYERS, root=str(tmp_path))
    first = subprocess.Popen([sys.executable, "-c", code])
    run = functools.partial(collect_calibration, tiny_llama(), _batches(k=3), LAYERS, loss_fn=slow_loss,
                            loss_name="slow")
    try:
        deadline = time.monotonic() + 60
        while not list(tmp_path.glob(f"*.partial/{OWNER}")):
            assert first.poll() is None and time.monotonic() < deadline, "the first process never started"
            time.sleep(0.05)
        with caplog.at_level(logging.INFO, logger="fisherkron"):
            st = run(cache_dir=tmp_path)
        assert first.wait(timeout=60) == 0
    finally:
        first.kill()
        first.wait()
    assert st.from_cache and f"process {first.pid} is collecting this calibration" in caplog.text
    _same_entry(st, run(cache_dir=tmp_path / "ref"))


@pytest.fixture
def read_only(monkeypatch):
    """``read_only(folder)``: make ``folder`` read-only for this test.

    With chmod where it restricts; as root (where it does not) the os-level writes under the
    folder (mkdir, open for writing, rename, unlink, rmdir, and ``os.access(W_OK)``) raise
    ``PermissionError`` instead, so the test runs everywhere.
    """
    roots = []
    chmodded = []

    def inside(path, dir_fd=None) -> bool:
        if isinstance(path, int):
            return False
        p = os.fsdecode(path)
        if dir_fd is not None and not os.path.isabs(p):
            p = os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), p)
        p = os.path.abspath(p)
        return any(p == r or p.startswith(r + os.sep) for r in roots)

    def deny(path):
        raise PermissionError(errno.EACCES, "Permission denied", os.fsdecode(path))

    real = {n: getattr(os, n) for n in ("access", "mkdir", "open", "replace", "rename", "unlink", "remove", "rmdir")}
    real_open = builtins.open
    writes = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND

    def access(path, mode, *a, **kw):
        return False if mode & os.W_OK and inside(path, kw.get("dir_fd")) else real["access"](path, mode, *a, **kw)

    def mkdir(path, *a, dir_fd=None, **kw):
        if inside(path, dir_fd) and not os.path.lexists(path):
            deny(path)
        return real["mkdir"](path, *a, dir_fd=dir_fd, **kw)

    def open_(path, flags, *a, dir_fd=None, **kw):
        if flags & writes and inside(path, dir_fd):
            deny(path)
        return real["open"](path, flags, *a, dir_fd=dir_fd, **kw)

    def one(name):
        def f(path, *a, dir_fd=None, **kw):
            if inside(path, dir_fd):
                deny(path)
            return real[name](path, *a, dir_fd=dir_fd, **kw)
        return f

    def two(name):
        def f(src, dst, *a, src_dir_fd=None, dst_dir_fd=None, **kw):
            if inside(src, src_dir_fd) or inside(dst, dst_dir_fd):
                deny(src)
            return real[name](src, dst, *a, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd, **kw)
        return f

    def opener(file, mode="r", *a, **kw):
        if isinstance(file, (str, bytes, os.PathLike)) and any(c in mode for c in "wax+") and inside(file):
            deny(file)
        return real_open(file, mode, *a, **kw)

    def make(folder):
        folder = Path(folder).resolve()
        if os.geteuid() != 0:
            for p in sorted([folder, *folder.rglob("*")], reverse=True):
                chmodded.append((p, p.stat().st_mode))
                p.chmod(0o555 if p.is_dir() else 0o444)
            return
        if not roots:
            monkeypatch.setattr(os, "access", access)
            monkeypatch.setattr(os, "mkdir", mkdir)
            monkeypatch.setattr(os, "open", open_)
            for n in ("unlink", "remove", "rmdir"):
                monkeypatch.setattr(os, n, one(n))
            for n in ("replace", "rename"):
                monkeypatch.setattr(os, n, two(n))
            monkeypatch.setattr(builtins, "open", opener)
            monkeypatch.setattr(io, "open", opener)
        roots.append(str(folder))

    yield make
    for p, mode in reversed(chmodded):
        p.chmod(mode)


def test_a_read_only_cache_serves_its_entries_and_refuses_missing_ones_in_one_line(tmp_path, read_only, caplog):
    model, b = tiny_llama(), _batches(k=3)
    cache = tmp_path / "shared"
    made = collect_calibration(model, b, LAYERS, cache_dir=cache)
    (cache / f"{TMP_PREFIX}999999999-left-x").mkdir()  # a dead process's temporary it cannot remove
    read_only(cache)
    with caplog.at_level(logging.WARNING, logger="fisherkron"):
        st = collect_calibration(model, b, LAYERS, cache_dir=cache)
        assert st.from_cache and st.dir == made.dir
        st.kronecker(UP)  # computed, and not kept: a warning
    assert "could not keep the MFF factors" in caplog.text
    for kw in ({"k": 2}, {"k": 2, "cache": False}):
        with pytest.raises(FisherkronError) as err:
            collect_calibration(model, b, LAYERS, cache_dir=cache, **kw)
        msg = str(err.value)
        assert "\n" not in msg and str(cache) in msg and "read-only" in msg and "writable cache_dir" in msg
    assert sorted(p.name for p in cache.iterdir()) == sorted([made.key, f"{TMP_PREFIX}999999999-left-x"])


def test_the_command_line_reads_a_read_only_cache(tmp_path, read_only, monkeypatch, capsys):
    from test_cli_robustness import _save

    from fisherkron.cli import main

    monkeypatch.setenv("FISHERKRON_DATA", str(tmp_path / "data"))
    folder = _save(tiny_llama(), tmp_path / "llama")
    cache = tmp_path / "shared"
    args = [folder, "--k", "2", "--batch-size", "2", "--seq-len", "16", "--rank", "2", "--layers", LAYERS,
            "--cache-dir", cache]

    def run(*extra):
        try:
            return main(["-q", "compress", *map(str, args), *map(str, extra)])
        except SystemExit as exc:
            return exc.code
    assert run("--out", tmp_path / "one") == 0
    read_only(cache)
    capsys.readouterr()
    assert run("--out", tmp_path / "two") == 0, capsys.readouterr().err
    capsys.readouterr()
    assert run("--out", tmp_path / "three", "--seed", "1") == 2  # not in the cache: one line
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("fisherkron: error")]
    assert len(err) == 1 and str(cache) in err[0] and "--cache-dir" in err[0]


# ----------------------------------------------------------------------------- 4. batches that are not dicts

def test_batches_that_are_not_dicts_are_refused_in_one_line(tmp_path):
    model, b = tiny_llama(), _batches(k=2)
    for bad, hint in [([(x["input_ids"], x["attention_mask"]) for x in b], "tuple"),
                      ([[x["input_ids"]] for x in b], "list"), ([x["input_ids"] for x in b], "Tensor"),
                      (b[0], "one dict")]:
        with pytest.raises(FisherkronError, match=f"{hint}.*dicts of tensors|one dict; pass a list") as err:
            collect_calibration(model, bad, LAYERS, cache_dir=tmp_path)
        assert "\n" not in str(err.value)
    assert list(tmp_path.iterdir()) == []


# ----------------------------------------------------------------------------- 5. abandoned folders

def test_abandoned_partial_folders_are_reported_and_reclaimed(tmp_path, sleeper, caplog):
    """Other configurations' partial folders: removed when they can never resume (another code version) or
    were untouched for MAX_PARTIAL_AGE and no live process owns them; the rest reported at WARNING."""
    long_ago = time.time() - MAX_PARTIAL_AGE - 3600

    def partial(name, code, age=None, owner=None):
        p = tmp_path / f"{name}.partial"
        p.mkdir()
        (p / "x.grads.npy").write_bytes(bytes(3_000_000))
        if code is not None:
            (p / INFO).write_text(json.dumps({"key": name, "code": code, "created": time.time()}))
        if owner is not None:
            (p / OWNER).write_text(owner)
        if age is not None:
            for f in [p, *p.iterdir()]:
                os.utime(f, (age, age))
        return p
    old_code = partial("a" * 32, "0.0/calibration-0/0000")
    legacy = partial("b" * 32, None)  # written before partial.json existed: an older code version
    stale = partial("c" * 32, code_version(), age=long_ago)
    resumable = partial("d" * 32, code_version())
    in_use = partial("e" * 32, "0.0/calibration-0/0000", owner=str(sleeper.pid))
    with caplog.at_level(logging.WARNING, logger="fisherkron"):
        collect_calibration(tiny_llama(), _batches(k=1), UP, stats=("diag_fisher",), cache_dir=tmp_path)
    assert not old_code.exists() and not legacy.exists() and not stale.exists()
    assert resumable.exists() and in_use.exists()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(old_code.name in w and "another version" in w for w in warnings)
    assert any(stale.name in w and "untouched for" in w for w in warnings)
    kept = [w for w in warnings if "interrupted calibration(s) of other configurations" in w]
    assert len(kept) == 1 and "hold 6.0 MB" in kept[0] and resumable.name in kept[0] and "in use" in kept[0]


def test_a_finished_entry_holds_no_owner_marker(tmp_path):
    model, b = tiny_llama(), _batches(k=2)
    st = collect_calibration(model, b, UP, stats=("diag_fisher",), cache_dir=tmp_path)
    assert sorted(p.name for p in st.dir.iterdir() if not p.name.endswith(".npy")) == ["manifest.json"]
    (st.dir / OWNER).write_text("999999999")  # left by an earlier version
    again = collect_calibration(model, b, UP, stats=("diag_fisher",), cache_dir=tmp_path)
    assert again.from_cache and not (st.dir / OWNER).exists()


def test_model_conversion_temporaries_of_dead_or_reused_processes_are_reclaimed(tmp_path, monkeypatch, caplog):
    """``smollm2_folder`` removes its conversion's temporaries that a killed process left (dead process, or
    its id reused by a process that started after they were written), and no one else's."""
    from fisherkron.hf.registry import smollm2_folder

    monkeypatch.setenv("FISHERKRON_DATA", str(tmp_path))
    models = tmp_path / "models"
    done = models / "SmolLM2-135M-Instruct-fp32"
    done.mkdir(parents=True)
    (done / "config.json").write_text("{}")
    (done / "model.safetensors").write_bytes(b"")
    stem = f"{done.name}-"
    dead = models / f"{TMP_PREFIX}999999999-{stem}abc"
    reused = models / f"{TMP_PREFIX}{os.getpid()}-{stem}def"  # this process's id, written before it started
    live = models / f"{TMP_PREFIX}{os.getpid()}-{stem}ghi"
    other = models / f"{TMP_PREFIX}999999999-my-save-jkl"  # not the conversion's: left to its owner
    for p in (dead, reused, live, other):
        p.mkdir()
        (p / "model.safetensors").write_bytes(bytes(1000))
    day_ago = time.time() - 86400
    os.utime(reused, (day_ago, day_ago))
    assert stale_temporaries(models) == sorted([dead, other, reused])
    with caplog.at_level(logging.WARNING, logger="fisherkron"):
        assert smollm2_folder() == done
    assert not dead.exists() and not reused.exists() and live.exists() and other.exists()
    assert "removed 2 temporary folder(s) of interrupted model conversions" in caplog.text


# ----------------------------------------------------------------------------- 6. torchrun: interrupt and resume

#: batch i on rank i % 2: rank 0 runs 0, 2, 4, 6 and rank 1 runs 1, 3, 5
K_RANKS = 7


def _counting_loss(calls, interrupt_at=None):
    """The loss of the tiny model, counted in ``calls``; SIGTERM to this process in its ``interrupt_at``-th call."""
    def loss(m, x):
        calls.append(1)
        if len(calls) == interrupt_at:
            os.kill(os.getpid(), signal.SIGTERM)
        return m(**x).loss
    return loss


def _ranks_calibration(folder, calls=None, **kw):
    calls = [] if calls is None else calls
    return collect_calibration(tiny_llama(), _batches(k=K_RANKS), LAYERS, loss_fn=_counting_loss(calls, **kw),
                               loss_name="ranks", cache_dir=folder), calls


def _ranks_run(folder, interrupt_at=None):
    """``collect_calibration`` over the process group; SIGTERM to this rank during its ``interrupt_at``-th batch."""
    calls = []
    st = fk.collect_calibration(tiny_llama(), _batches(k=K_RANKS), LAYERS, loss_fn=_counting_loss(calls, interrupt_at),
                                loss_name="ranks", cache_dir=folder, group="auto")
    return st, calls


def interrupted_ranks(rank, world, folder):
    _ranks_run(folder, interrupt_at=2)


def resumed_ranks(rank, world, folder, ref):
    st, calls = _ranks_run(folder)
    again, ref_calls = _ranks_run(ref)
    return {"dir": str(st.dir), "calls": len(calls), "ref_dir": str(again.dir), "ref_calls": len(ref_calls),
            "from_cache": st.from_cache}


def test_an_interrupted_process_group_collection_resumes(tmp_path, caplog):
    """SIGTERM (what torchrun sends every rank on Ctrl-C) keeps each rank's progress; the same world size
    resumes every rank from its own checkpoint, to the entry an uninterrupted run writes, bit for bit;
    one process starts again (another world size)."""
    cache = tmp_path / "cache"
    got = run_ranks(HERE, "interrupted_ranks", 2, tmp_path, cache, timeout=60)
    for rank, (ok, err) in enumerate(got):
        assert not ok and "KeyboardInterrupt: calibration stopped on rank" in err, err
    (partial,) = cache.glob("*.partial")
    assert {p.name for p in partial.glob("progress*")} == {"progress.rank0-of-2.pt", "progress.rank1-of-2.pt"}
    assert not (partial / OWNER).exists()
    shutil.copytree(cache, tmp_path / "other-world")
    got = run_ranks(HERE, "resumed_ranks", 2, tmp_path, cache, tmp_path / "ref", timeout=60)
    (ok0, r0), (ok1, r1) = got
    assert ok0 and ok1, (r0, r1)
    assert (r0["calls"], r1["calls"]) == (2, 1)  # batches 4, 6 and 5: the rest was kept
    assert (r0["ref_calls"], r1["ref_calls"]) == (4, 3) and not r0["from_cache"]
    st, _ = _ranks_calibration(cache)
    ref, _ = _ranks_calibration(tmp_path / "ref")
    assert st.from_cache and ref.from_cache and str(st.dir) == r0["dir"]
    _same_entry(st, ref)
    assert sorted(p.name for p in cache.iterdir()) == [st.key]
    assert not any(p.name.startswith(("progress", OWNER, INFO)) for p in st.dir.iterdir())
    # one process over the two processes' partial folder: starts again, with a warning
    with caplog.at_level(logging.WARNING, logger="fisherkron"):
        one, calls = _ranks_calibration(tmp_path / "other-world")
    assert len(calls) == K_RANKS and "another number of processes" in caplog.text
    single, _ = _ranks_calibration(tmp_path / "single")
    assert not single.from_cache
    _same_entry(one, single)
