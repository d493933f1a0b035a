"""env.atomic_directory replaces a folder without ever deleting the earlier one first (issue 20, class 1).

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
