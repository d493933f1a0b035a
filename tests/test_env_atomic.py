"""env.atomic_directory replaces a folder without ever deleting the earlier one first.

A folder that is a mount point (a Docker volume, a separate disk) cannot be renamed onto or
away: the rename fails with EBUSY. The earlier code deleted the old folder and then renamed,
so the failure lost it. Simulated by making every rename that touches the target fail.
"""
import errno
import os

import pytest

from fisherkron.core.conventions import FisherkronError
from fisherkron.env import atomic_directory


def _busy_target(monkeypatch, target):
    real = os.rename

    def rename(src, dst, *a, **k):
        if os.fspath(dst) == os.fspath(target) or os.fspath(src) == os.fspath(target):
            raise OSError(errno.EBUSY, "Device or resource busy")
        return real(src, dst, *a, **k)

    monkeypatch.setattr(os, "rename", rename)


@pytest.mark.parametrize("existing", [True, False])
def test_a_busy_target_keeps_its_contents_and_says_why(tmp_path, monkeypatch, existing):
    target = tmp_path / "volume"
    if existing:
        target.mkdir()
        (target / "old.txt").write_text("earlier")
    _busy_target(monkeypatch, target)
    with pytest.raises(FisherkronError, match="nothing there was changed"):
        with atomic_directory(target) as tmp:
            (tmp / "new.txt").write_text("new")
    if existing:
        assert (target / "old.txt").read_text() == "earlier"
    assert [p.name for p in tmp_path.iterdir() if p.name != "volume"] == []  # no temporary left


def test_a_failed_move_in_puts_the_earlier_folder_back(tmp_path, monkeypatch):
    target = tmp_path / "entry"
    target.mkdir()
    (target / "old.txt").write_text("earlier")
    real = os.rename

    def rename(src, dst, *a, **k):  # setting aside works, moving the new folder in fails
        if os.fspath(dst) == os.fspath(target) and "old" not in os.fspath(src):
            raise OSError(errno.EXDEV, "Invalid cross-device link")
        return real(src, dst, *a, **k)

    monkeypatch.setattr(os, "rename", rename)
    monkeypatch.setattr(type(target), "rename", lambda self, dst: rename(self, dst))
    with pytest.raises(FisherkronError):
        with atomic_directory(target) as tmp:
            (tmp / "new.txt").write_text("new")
    assert sorted(p.name for p in target.iterdir()) == ["old.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["entry"]


def test_a_replace_that_works_leaves_only_the_new_folder(tmp_path):
    target = tmp_path / "entry"
    target.mkdir()
    (target / "old.txt").write_text("earlier")
    with atomic_directory(target) as tmp:
        (tmp / "new.txt").write_text("new")
    assert sorted(p.name for p in target.iterdir()) == ["new.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["entry"]


def _write_fails(exc):
    def write(tmp):
        with open(tmp, "wb") as fh:
            fh.write(b"half")
        raise exc
    return write


def test_a_full_disk_is_named_and_the_earlier_file_kept(tmp_path, monkeypatch):
    """A write that fails on a full disk says so in one line; the earlier file and no temporary remain.

    torch.save's zip writer reports a full disk as "unexpected pos" with no errno (seen when a
    calibration's MFF cache filled the disk): then the free space decides.
    """
    import shutil
    from collections import namedtuple

    from fisherkron.env import DISK_FULL_BYTES, atomic_write

    target = tmp_path / "factors.pt"
    target.write_bytes(b"earlier")
    with pytest.raises(FisherkronError, match="no space left on the device") as e:
        atomic_write(target, _write_fails(OSError(errno.ENOSPC, "No space left on device")))
    assert "\n" not in str(e.value)
    usage = namedtuple("usage", "total used free")
    torch_error = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 1216 vs 1046")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10 << 30, 10 << 30, DISK_FULL_BYTES // 2))
    with pytest.raises(FisherkronError, match=r"the disk is full \(32 MiB free"):
        atomic_write(target, _write_fails(torch_error))
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10 << 30, 1 << 30, 9 << 30))
    with pytest.raises(RuntimeError, match="unexpected pos"):  # space left: the error is not ours to rename
        atomic_write(target, _write_fails(torch_error))
    assert target.read_bytes() == b"earlier" and sorted(p.name for p in tmp_path.iterdir()) == ["factors.pt"]
