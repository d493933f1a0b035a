"""Saving and loading lose nothing and read nothing unverified.

Each case is a regression test on tiny random models (tests/tiny_models.py):

1. a save works into any writable folder, a mount point included (simulated: renaming the
   folder, or anything across its boundary, fails as the kernel makes it fail, with
   ``EBUSY`` / ``EXDEV``), and a failure at any step -- or a killed process -- leaves the
   earlier save bit for bit as it was; SIGTERM is handled like Ctrl-C and leaves no
   temporary behind;
2. an overwrite never replaces a file of the user's, nor one the save wrote and the user
   edited since;
3. a load reads only the files the manifest lists;
4. a model without ``save_pretrained``, a hand-edited manifest and a read-only folder are
   one-line errors.
"""
import errno
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from tiny_models import tiny_bert, tiny_llama

import fisherkron.hf as api
import fisherkron.hf.saving as saving
import fisherkron.hf.transaction as transaction
from fisherkron.cli import main
from fisherkron.core.conventions import FisherkronError
from fisherkron.core.lowrank import LowRankLinear
from fisherkron.env import TMP_PREFIX, sigterm_as_interrupt
from fisherkron.hf.saving import MANIFEST, load_compressed, save_compressed
from fisherkron.hf.surgery import compress

UP = "model.layers.0.mlp.up_proj"  # a factorised layer of the tiny Llama (n=40, m=24, rank 2)


def _one_line(err) -> str:
    msg = str(getattr(err, "value", err))
    assert "\n" not in msg, msg
    return msg


def _compressed(seed=0):
    model = tiny_llama(seed=seed)
    compress(model, "svd", None, rank=2)
    return model


def _tokenizer():
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(vocab), eos_token="a")


def _snapshot(folder: Path) -> dict:
    """Every entry of ``folder``: a file's bytes, or ``"<dir>"``."""
    return {p.name: p.read_bytes() if p.is_file() else "<dir>" for p in sorted(folder.iterdir())}


def _run(argv) -> int:
    try:
        return main([str(a) for a in argv])
    except SystemExit as exc:
        return exc.code


def _restore(folder: Path, snap: dict) -> None:
    for p in folder.iterdir():
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    for name, data in snap.items():
        (folder / name).write_bytes(data)


def _assert_same_weights(model, ref) -> None:
    got, want = model.state_dict(), ref.state_dict()
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k


def _no_temporaries(folder: Path) -> bool:
    return not [p for p in folder.iterdir() if p.name.startswith(TMP_PREFIX)]


@pytest.fixture
def earlier(tmp_path):
    """An earlier save (model and tokenizer) in ``tmp_path/out``, its snapshot, and another model to save over it."""
    model = _compressed(seed=0)
    out = save_compressed(model, tmp_path / "out", tokenizer=_tokenizer())
    return model, out, _snapshot(out), _compressed(seed=1)


# ---------------------------------------------------------------------------- 1. mount points, failures, crashes

@pytest.fixture
def mount_point(monkeypatch):
    """Make folders behave as mount points: they cannot be renamed, replaced or removed, and
    nothing is renamed into or out of them (what the kernel answers for a Docker volume)."""
    points = []
    real_rename, real_replace, real_rmdir = os.rename, os.replace, os.rmdir

    def inside(p, m):
        return p == m or p.startswith(m + os.sep)

    def check(src, dst, kw):
        if kw.get("src_dir_fd") is not None or kw.get("dst_dir_fd") is not None:
            return
        s, d = os.path.abspath(src), os.path.abspath(dst)
        for m in points:
            if m in (s, d):
                raise OSError(errno.EBUSY, "Device or resource busy", s)
            if inside(s, m) != inside(d, m):
                raise OSError(errno.EXDEV, "Invalid cross-device link", s, None, d)

    def rename(src, dst, **kw):
        check(src, dst, kw)
        return real_rename(src, dst, **kw)

    def replace(src, dst, **kw):
        check(src, dst, kw)
        return real_replace(src, dst, **kw)

    def rmdir(path, **kw):
        if kw.get("dir_fd") is None and os.path.abspath(path) in points:
            raise OSError(errno.EBUSY, "Device or resource busy", str(path))
        return real_rmdir(path, **kw)

    monkeypatch.setattr(os, "rename", rename)
    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(os, "rmdir", rmdir)
    return lambda folder: points.append(os.path.abspath(folder))


@pytest.mark.parametrize("fresh_disk", [False, True], ids=["volume", "disk-root"])
def test_a_first_save_onto_a_mount_point_works(fresh_disk, mount_point, tmp_path):
    model = _compressed()
    vol = tmp_path / "vol"
    vol.mkdir()
    if fresh_disk:
        (vol / "lost+found").mkdir()  # what a freshly formatted disk's root holds
    mount_point(vol)
    save_compressed(model, vol, tokenizer=_tokenizer())
    _assert_same_weights(load_compressed(vol), model)
    assert _no_temporaries(vol) and (vol / "lost+found").is_dir() == fresh_disk


def test_an_overwrite_onto_a_mount_point_works(mount_point, earlier):
    model, out, before, model2 = earlier
    mount_point(out)
    save_compressed(model2, out, overwrite=True)  # no tokenizer this time: its files go
    _assert_same_weights(load_compressed(out), model2)
    assert not (out / "tokenizer.json").exists() and _no_temporaries(out)
    assert set(json.loads((out / MANIFEST).read_text())["files"]) | {MANIFEST} == set(_snapshot(out))


def _fail_kth(m, owners, k, exc, when=lambda *a, **kw: True):
    """Make the ``k``-th call (among those ``when`` selects) of ``owners``' function raise ``exc``, once."""
    real = getattr(*owners[0])
    state = {"calls": 0, "fired": False}

    def wrapper(*a, **kw):
        if not state["fired"] and when(*a, **kw):
            state["calls"] += 1
            if state["calls"] == k:
                state["fired"] = True
                raise exc
        return real(*a, **kw)
    for owner, attr in owners:
        m.setattr(owner, attr, wrapper)
    return state


def _writes_under(folder):
    def when(file, mode="r", *a, **kw):
        return any(c in mode for c in "wax+") and str(file).startswith(str(folder))
    return when


def _steps():
    import builtins

    import transformers.modeling_utils as mu
    eio, enospc = OSError(errno.EIO, "Input/output error"), OSError(errno.ENOSPC, "No space left on device")
    return {  # the calls of a save that may fail: each is made to fail at its k-th call, once
        "rename": lambda m, k, out: _fail_kth(m, [(os, "replace")], k, eio),
        "fsync": lambda m, k, out: _fail_kth(m, [(os, "fsync")], k, eio),
        "unlink": lambda m, k, out: _fail_kth(m, [(os, "unlink")], k, eio),
        "weights": lambda m, k, out: _fail_kth(m, [(mu, "safe_save_file")], k, enospc),
        "write": lambda m, k, out: _fail_kth(m, [(io, "open"), (builtins, "open")], k, enospc, _writes_under(out)),
    }


@pytest.mark.parametrize("step", ["rename", "fsync", "unlink", "weights", "write"])
def test_a_failure_at_any_step_leaves_the_earlier_save_bit_identical(step, earlier, monkeypatch):
    """Every call of each kind fails in turn (configs, journal, manifest written by Python; weights by
    safetensors): before the commit the folder is left bit for bit as it was; after it (cleaning up)
    the new save is complete and the next load tidies up."""
    model, out, before, model2 = earlier
    failed = 0
    for k in range(1, 60):
        with monkeypatch.context() as m:
            state = _steps()[step](m, k, out)
            try:
                save_compressed(model2, out, overwrite=True)
            except FisherkronError as err:
                msg = _one_line(err)
                assert state["fired"] and ("failed" in msg or "not writable" in msg), msg
                failed += 1
                for probe in out.glob(f"{TMP_PREFIX}*-probe-*"):  # the writability test's file, if unlinking it failed
                    probe.unlink()
                assert _snapshot(out) == before, f"call {k} of {step}"
                continue
        if not state["fired"]:
            break  # past the last call: the save went through
        _assert_same_weights(load_compressed(out), model2)
        assert _no_temporaries(out)
        assert set(json.loads((out / MANIFEST).read_text())["files"]) | {MANIFEST} == set(_snapshot(out))
        _restore(out, before)
    assert failed >= {"rename": 4, "fsync": 4, "unlink": 1, "weights": 1, "write": 3}[step], failed
    _assert_same_weights(load_compressed(out), model2)
    _restore(out, before)
    _assert_same_weights(load_compressed(out), model)


def test_an_interrupted_undo_is_finished_by_the_next_load(earlier, monkeypatch):
    """What a killed process leaves (files half swapped, a journal): the next load restores the earlier save."""
    model, out, before, model2 = earlier
    for k in range(2, 60):  # call 1 writes the journal
        with monkeypatch.context() as m:
            state = _fail_kth(m, [(os, "replace")], k, KeyboardInterrupt())

            def no_undo(*a, **kw):
                raise OSError(errno.EIO, "I/O error")  # as if the process died before it could undo
            m.setattr(transaction, "_settle", no_undo)
            try:
                save_compressed(model2, out, overwrite=True)
            except FisherkronError as err:
                assert "restores it" in _one_line(err)
            else:
                assert not state["fired"]
                break
        assert not _no_temporaries(out)
        _assert_same_weights(load_compressed(out), model)
        assert _snapshot(out) == before, f"call {k}"
    assert k > 4


def test_a_killed_save_is_undone_by_the_next_load(earlier, tmp_path):
    """A real SIGKILL-like death (os._exit) in the middle of the swap; the lock dies with the process."""
    model, out, before, _ = earlier
    script = textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from tiny_models import tiny_llama
        from fisherkron.hf.surgery import compress
        from fisherkron.hf.saving import save_compressed
        model = tiny_llama(seed=1)
        compress(model, "svd", None, rank=2)
        real, calls = os.replace, [0]
        def replace(*a, **k):
            calls[0] += 1
            if calls[0] == 4:  # the journal, two moves of config.json, one of the next file
                os._exit(9)
            return real(*a, **k)
        os.replace = replace
        save_compressed(model, {str(out)!r}, overwrite=True)
    """)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 9, proc.stderr
    assert _snapshot(out) != before  # half swapped
    _assert_same_weights(load_compressed(out), model)
    assert _snapshot(out) == before


def _tiny_folder(folder: Path) -> Path:
    """A tiny Llama as a Hugging Face folder with a WordPiece tokenizer: what ``fisherkron compress`` reads."""
    from transformers import BertTokenizerFast

    tiny_llama().save_pretrained(folder)
    (folder / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *"abcdefgh"]))
    BertTokenizerFast(vocab_file=str(folder / "vocab.txt"), eos_token="[SEP]").save_pretrained(folder)
    return folder


def test_sigterm_during_a_save_is_handled_like_ctrl_c(tmp_path):
    """``docker stop`` in the middle of ``fisherkron compress``'s save: one line, status 130, the earlier save
    as it was and no temporary folder left (a real process, a real SIGTERM)."""
    folder, out = _tiny_folder(tmp_path / "model"), tmp_path / "out"
    model = _compressed(seed=0)
    save_compressed(model, out)
    before = _snapshot(out)
    script = textwrap.dedent(f"""
        import sys, time
        import transformers.modeling_utils as mu
        from fisherkron.cli import main
        def slow_save(*a, **k):  # the weights are being written when the signal comes
            print("writing", flush=True)
            time.sleep(120)
        mu.safe_save_file = slow_save
        sys.exit(main(["-q", "compress", {str(folder)!r}, "--method", "svd", "--rank", "2", "--k", "2",
                       "--batch-size", "2", "--seq-len", "16", "--no-cache", "--out", {str(out)!r}, "--overwrite"]))
    """)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FISHERKRON_DATA": str(tmp_path / "data")}
    env.pop("WORLD_SIZE", None)
    proc = subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "writing", proc.stderr.read()
        assert [p.name for p in out.iterdir() if p.name.startswith(TMP_PREFIX)]  # the save under way
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, (proc.returncode, err)
    assert err.strip().splitlines() == ["fisherkron: interrupted"], err
    assert _snapshot(out) == before and _no_temporaries(out)


def test_a_signal_during_the_swap_waits_until_the_folder_is_whole(earlier, monkeypatch):
    """SIGTERM at every rename of the swap (once the journal is written): the swap is not cut, nor its clean-up;
    the signal acts once the folder is a complete save, and no temporary is left."""
    model, out, before, model2 = earlier
    real, calls = os.replace, []

    def replace(*a, **k):
        calls.append(a)
        if len(calls) >= 2:  # call 1 writes the journal
            os.kill(os.getpid(), signal.SIGTERM)
        return real(*a, **k)
    monkeypatch.setattr(os, "replace", replace)
    with sigterm_as_interrupt(), pytest.raises(KeyboardInterrupt):  # SIGTERM raises here, even without the fix
        save_compressed(model2, out, overwrite=True)
    monkeypatch.undo()
    assert len(calls) > 4 and _no_temporaries(out)
    _assert_same_weights(load_compressed(out), model2)


def test_ctrl_c_while_the_files_are_written_leaves_nothing(earlier, monkeypatch):
    model, out, before, model2 = earlier
    import transformers.modeling_utils as mu

    def interrupted(*a, **k):
        signal.raise_signal(signal.SIGINT)  # to this thread: the handler runs before the next line
        for _ in range(50):  # (a signal another thread took runs its handler at the next loop step)
            time.sleep(0.1)
        pytest.fail("the signal did not stop the save")
    monkeypatch.setattr(mu, "safe_save_file", interrupted)
    found = signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C as Python handles it
    try:
        with pytest.raises(KeyboardInterrupt):
            save_compressed(model2, out, overwrite=True)
    finally:
        signal.signal(signal.SIGINT, found)
    assert _snapshot(out) == before and _no_temporaries(out)


@pytest.mark.parametrize("umask", [0o022, 0o077], ids=["umask-022", "umask-077"])
def test_the_files_of_a_save_get_the_permissions_the_umask_gives(umask, tmp_path):
    """Not safetensors' 0600: with umask 022 other users of a shared machine can read a save."""
    old = os.umask(umask)
    try:
        out = save_compressed(_compressed(), tmp_path / "out", tokenizer=_tokenizer())
    finally:
        os.umask(old)
    modes = {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()}
    assert "model.safetensors" in modes and set(modes.values()) == {0o666 & ~umask}, modes


def test_a_running_save_is_respected_and_a_dead_ones_leftovers_reclaimed(earlier):
    import fcntl

    model, out, before, model2 = earlier
    stage = out / f"{TMP_PREFIX}{os.getppid()}-save-abc"
    stage.mkdir()
    fd = os.open(stage / "lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)  # held: a save is running
    try:
        with pytest.raises(FisherkronError, match="another save into") as err:
            save_compressed(model2, out, overwrite=True)
        _one_line(err)
    finally:
        os.close(fd)  # released: its process is gone (though the pid lives: no pid reuse can block it)
    save_compressed(model2, out, overwrite=True)
    assert not stage.exists()
    _assert_same_weights(load_compressed(out), model2)


def test_the_cli_checks_that_out_is_writable_before_loading_the_model(tmp_path, monkeypatch, capsys):
    folder = tmp_path / "model"
    tiny_llama().config.save_pretrained(folder)
    ro = tmp_path / "ro"
    ro.mkdir()

    def forbidden(*a, **k):
        raise AssertionError("must not load the model")
    monkeypatch.setattr(api, "load_model", forbidden)
    real = saving.tempfile.mkstemp

    def read_only(*a, dir=None, **k):
        if dir is not None and str(dir).startswith(str(ro)):
            raise OSError(errno.EROFS, "Read-only file system", str(dir))
        return real(*a, dir=dir, **k)
    monkeypatch.setattr(saving.tempfile, "mkstemp", read_only)
    for out in (ro, ro / "new" / "deeper"):
        code = _run(["compress", str(folder), "--rank", "2", "--out", str(out)])
        lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
        assert code == 2 and len(lines) == 1 and "not writable" in lines[0] and "Read-only" in lines[0], lines
    assert not (ro / "new").exists()


def test_the_cli_checks_free_space_before_reading_data(tmp_path, monkeypatch, capsys):
    from transformers import BertTokenizerFast

    folder = tmp_path / "model"
    tiny_llama().save_pretrained(folder)
    (folder / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *"abcdefgh"]))
    BertTokenizerFast(vocab_file=str(folder / "vocab.txt"), eos_token="[SEP]").save_pretrained(folder)
    for name in ("c4_documents", "lm_batches", "collect_calibration", "compress", "save_compressed"):
        monkeypatch.setattr(api, name, lambda *a, _n=name, **k: pytest.fail(f"reached {_n}"))
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=10_000))
    code = _run(["compress", str(folder), "--rank", "2", "--out", str(tmp_path / "out")])
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip() and "it/s" not in ln]
    assert code == 2 and len(lines) == 1 and "free" in lines[0] and "needs about" in lines[0], lines


def test_saving_needs_free_space_for_the_whole_new_save(earlier, monkeypatch):
    model, out, before, model2 = earlier
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=10_000))
    monkeypatch.setattr(type(model2), "save_pretrained", lambda *a, **k: pytest.fail("wrote before checking"))
    with pytest.raises(FisherkronError, match="needs about") as err:
        save_compressed(model2, out, overwrite=True)
    _one_line(err)
    assert _snapshot(out) == before


# ---------------------------------------------------------------------------- 2. the user's files

@pytest.mark.parametrize("kind,name", [("llama", "tokenizer_config.json"), ("bert", "generation_config.json")])
def test_an_overwrite_refuses_the_users_files_under_model_file_names(kind, name, tmp_path, monkeypatch):
    model = _compressed() if kind == "llama" else tiny_bert()
    if kind == "bert":
        compress(model, "svd", None, rank=2)
    out = save_compressed(model, tmp_path / "out")  # no tokenizer; a BERT writes no generation config
    assert name not in json.loads((out / MANIFEST).read_text())["files"]
    (out / name).write_text('{"mine": true}')
    before = _snapshot(out)
    monkeypatch.setattr(type(model), "save_pretrained", lambda *a, **k: pytest.fail("wrote before checking"))
    with pytest.raises(FisherkronError, match=name) as err:
        save_compressed(model, out, overwrite=True, tokenizer=_tokenizer())
    assert "did not write" in _one_line(err)
    assert _snapshot(out) == before


def test_a_clash_found_only_after_writing_is_refused_and_changes_nothing(earlier, monkeypatch):
    model, out, before, model2 = earlier
    (out / "README.md").write_text("my notes")
    before = _snapshot(out)
    tok = _tokenizer()
    real = type(tok).save_pretrained

    def also_readme(self, folder, *a, **k):  # a tokenizer that writes a file of an unexpected name
        (Path(folder) / "README.md").write_text("tokenizer card")
        return real(self, folder, *a, **k)
    monkeypatch.setattr(type(tok), "save_pretrained", also_readme)
    with pytest.raises(FisherkronError, match="README.md") as err:
        save_compressed(model2, out, overwrite=True, tokenizer=tok)
    _one_line(err)
    assert _snapshot(out) == before
    _assert_same_weights(load_compressed(out), model)


def _edit_file(out: Path, name: str) -> None:
    """What a user does to a file of a save: a temperature in the generation config; one byte of the weights
    (same size: only the checksum tells)."""
    f = out / name
    if name.endswith(".json"):
        cfg = json.loads(f.read_text())
        cfg["temperature"] = 0.7
        f.write_text(json.dumps(cfg))
    else:
        data = bytearray(f.read_bytes())
        data[-1] ^= 1
        f.write_bytes(bytes(data))


@pytest.mark.parametrize("name,tokenizer", [("generation_config.json", True), ("tokenizer_config.json", False),
                                            ("model.safetensors", True)],
                         ids=["replaced", "to-be-removed", "same-size"])
def test_an_overwrite_refuses_a_file_edited_since_the_save(name, tokenizer, earlier, monkeypatch):
    """The earlier save's file, edited by the user: refused by name (before any work) unless overwrite_edited."""
    _, out, _, model2 = earlier
    _edit_file(out, name)
    before = _snapshot(out)
    tok = _tokenizer() if tokenizer else None
    with monkeypatch.context() as m:
        m.setattr(type(model2), "save_pretrained", lambda *a, **k: pytest.fail("wrote before checking"))
        with pytest.raises(FisherkronError, match=f"{name} changed since fisherkron saved it") as err:
            save_compressed(model2, out, overwrite=True, tokenizer=tok)
    assert "overwrite_edited=True (--overwrite-edited)" in _one_line(err)
    assert _snapshot(out) == before
    save_compressed(model2, out, overwrite=True, tokenizer=tok, overwrite_edited=True)
    _assert_same_weights(load_compressed(out), model2)
    assert (out / name).exists() == tokenizer and _no_temporaries(out)


def test_a_file_edited_while_the_new_save_is_written_is_refused(earlier, monkeypatch):
    """Checked again just before the swap: a user may edit a file during hours of calibration and writing."""
    _, out, _, model2 = earlier
    real = type(model2).save_pretrained

    def edit_meanwhile(self, folder, *a, **k):
        _edit_file(out, "generation_config.json")
        return real(self, folder, *a, **k)
    monkeypatch.setattr(type(model2), "save_pretrained", edit_meanwhile)
    with pytest.raises(FisherkronError, match="generation_config.json changed since") as err:
        save_compressed(model2, out, overwrite=True, tokenizer=_tokenizer())
    _one_line(err)
    assert json.loads((out / "generation_config.json").read_text())["temperature"] == 0.7 and _no_temporaries(out)


def test_the_cli_refuses_an_edited_file_before_loading_the_model(tmp_path, monkeypatch, capsys):
    folder, out = _tiny_folder(tmp_path / "model"), tmp_path / "out"
    save_compressed(_compressed(), out, tokenizer=_tokenizer())
    _edit_file(out, "generation_config.json")
    monkeypatch.setenv("FISHERKRON_DATA", str(tmp_path / "data"))
    monkeypatch.setattr(api, "load_model", lambda *a, **k: pytest.fail("loaded the model"))
    capsys.readouterr()  # the progress bars of making the folders
    code = _run(["compress", folder, "--rank", "2", "--out", out, "--overwrite"])
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1 and "generation_config.json" in lines[0], lines
    assert "--overwrite-edited" in lines[0]


# ---------------------------------------------------------------------------- 3. only listed files are read

def test_an_unlisted_weight_file_is_ignored_never_loaded(earlier, caplog):
    from safetensors.torch import save_file

    model, out, _, _ = earlier
    save_file({"model.embed_tokens.weight": torch.zeros_like(model.model.embed_tokens.weight)},
              str(out / "zz-extra.safetensors"))
    for verify in (True, False):
        with caplog.at_level("WARNING", logger="fisherkron"):
            _assert_same_weights(load_compressed(out, verify=verify), model)
        assert "zz-extra.safetensors" in caplog.text


def test_an_unlisted_tokenizer_is_not_loaded(tmp_path):
    model = _compressed()
    out = save_compressed(model, tmp_path / "out")  # without a tokenizer
    _tokenizer().save_pretrained(out)  # added afterwards: not part of the save
    _, tok = load_compressed(out, return_tokenizer=True)
    assert tok is None
    out2 = save_compressed(model, tmp_path / "with", tokenizer=_tokenizer())
    _, tok = load_compressed(out2, return_tokenizer=True)
    assert tok is not None and tok.convert_tokens_to_ids("a") == 0


# ---------------------------------------------------------------------------- 4. one-line errors

def test_a_model_without_save_pretrained_is_refused_before_writing(tmp_path):
    model = torch.nn.Sequential(LowRankLinear(5, 7, 2))
    with pytest.raises(FisherkronError, match="save_pretrained") as err:
        save_compressed(model, tmp_path / "out")
    _one_line(err)
    with pytest.raises(FisherkronError, match="tokenizer") as err:
        save_compressed(_compressed(), tmp_path / "out", tokenizer="gpt2")
    _one_line(err)
    assert not (tmp_path / "out").exists()


def _edit(meta, how):
    layer = meta["layers"][UP]
    if how == "renamed layer":
        meta["layers"][UP + "_x"] = meta["layers"].pop(UP)
    elif how == "layer renamed onto another":
        meta["layers"]["lm_head"] = meta["layers"].pop(UP)
    elif how == "changed rank":
        layer["rank"] = 3
    elif how == "rank above min(n, m)":
        layer["rank"] = 99
    elif how == "rank as a string":
        layer["rank"] = "2"
    elif how == "bias as a string":
        layer["bias"] = "no"
    elif how == "layers as a list":
        meta["layers"] = list(meta["layers"])
    elif how == "no files list":
        del meta["files"]
    elif how == "files as a list":
        meta["files"] = list(meta["files"])
    elif how == "size as a string":
        meta["files"]["config.json"]["size"] = str(meta["files"]["config.json"]["size"])
    elif how == "a path outside the folder":
        meta["files"]["../elsewhere.safetensors"] = meta["files"].pop("model.safetensors")
    elif how == "config.json not listed":
        del meta["files"]["config.json"]
    elif how == "unknown form":
        meta["form"] = "dense"
    return meta


EDITS = ["renamed layer", "layer renamed onto another", "changed rank", "rank above min(n, m)", "rank as a string",
         "bias as a string", "layers as a list", "no files list", "files as a list", "size as a string",
         "a path outside the folder", "config.json not listed", "unknown form"]


@pytest.mark.parametrize("how", EDITS + ["invalid JSON"])
def test_a_hand_edited_manifest_is_one_line_error(how, earlier):
    _, out, _, _ = earlier
    if how == "invalid JSON":
        (out / MANIFEST).write_text((out / MANIFEST).read_text()[:-3])
    else:
        (out / MANIFEST).write_text(json.dumps(_edit(json.loads((out / MANIFEST).read_text()), how)))
    with pytest.raises(FisherkronError, match=MANIFEST) as err:
        load_compressed(out)
    _one_line(err)


@pytest.mark.parametrize("how", ["no files list", "files as a list", "a path outside the folder", "invalid JSON"])
def test_an_overwrite_of_a_save_whose_file_list_is_damaged_is_refused(how, earlier, monkeypatch):
    _, out, _, model2 = earlier
    if how == "invalid JSON":
        (out / MANIFEST).write_text("{")
    else:
        (out / MANIFEST).write_text(json.dumps(_edit(json.loads((out / MANIFEST).read_text()), how)))
    before = _snapshot(out)
    monkeypatch.setattr(type(model2), "save_pretrained", lambda *a, **k: pytest.fail("wrote before checking"))
    with pytest.raises(FisherkronError, match="cannot be overwritten safely") as err:
        save_compressed(model2, out, overwrite=True)
    _one_line(err)
    assert _snapshot(out) == before


def test_a_read_only_folder_is_one_line_error(earlier, monkeypatch):
    _, out, before, model2 = earlier

    def read_only(*a, **k):
        raise OSError(errno.EROFS, "Read-only file system")
    monkeypatch.setattr(saving.tempfile, "mkstemp", read_only)
    monkeypatch.setattr(saving.tempfile, "mkdtemp", read_only)
    for target in (out, out.parent / "new"):
        with pytest.raises(FisherkronError, match="not writable") as err:
            save_compressed(model2, target, overwrite=True)
        _one_line(err)
    assert _snapshot(out) == before and not (out.parent / "new").exists()
    monkeypatch.undo()
    if os.geteuid() != 0:  # a real read-only folder (root writes anyway)
        out.chmod(0o555)
        try:
            with pytest.raises(FisherkronError, match="not writable"):
                save_compressed(model2, out, overwrite=True)
        finally:
            out.chmod(0o755)
