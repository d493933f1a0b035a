"""All-or-nothing replacement of the files of a folder, a mount point included.

The transaction behind :func:`fisherkron.hf.saving.save_compressed`, independent of what is
saved. A folder holds a *save*: a manifest (a file whose name the caller passes, e.g.
``fisherkron.json``) and the files that manifest lists (the caller passes how to read the
list); every other file in the folder is the user's. :func:`swap_in` replaces one save by
another:

1. the new files are written into a temporary folder *inside* the target
   (``.fisherkron-tmp-<pid>-save-*``: the same file system, so nothing is ever renamed onto
   the target or across its parent), given the permissions the umask gives
   (``0666 & ~umask``, as :func:`fisherkron.env.atomic_path` does) and fsynced;
2. a journal (the names, the checksums of the earlier and the new manifest) is written;
3. the files move in one by one, each earlier file of the same name set aside;
4. replacing the manifest (one ``os.replace`` within the folder) is the commit;
5. the earlier files the new manifest does not list are removed, then the temporary folder.

What is guaranteed (tests/test_saving_safety.py):

* **All or nothing, into any writable folder.** An error at any step before the commit (a
  full disk, a failing rename, an interrupt) puts the earlier files back bit for bit before
  it is raised; after the commit the folder is the new save, and a clean-up that fails is
  left to the next transaction.
* **Replacing the manifest is the one commit point.** Before it the folder's manifest is the
  earlier save's, after it the new one's.
* **A killed transaction is finished or undone by the next one.** Its temporary folder keeps
  the journal and the files set aside; :func:`settle_interrupted` (run by
  :func:`check_destination` and by a loader) finishes the swap if the folder's manifest is
  the new one, or undoes it if it is the earlier one. A running transaction holds a lock
  (``flock``) in its temporary folder, so a second one into the same folder is refused while
  it runs, and a dead one's leftovers are recognised however its process id was reused.
* **Only files the earlier manifest lists are replaced or removed.** A file of the user's
  that the new save would write, or whose name matches a ``reserved`` pattern (names a
  loader of the folder reads), is refused in one line naming it: by
  :func:`check_destination` before any work, by :func:`swap_in` before the folder is
  touched. Other files of the user's stay.
* **A file the earlier save wrote and the user changed since is refused, not replaced.** Its
  size or checksum no longer matches the earlier manifest's (a file whose size and
  modification time are the recorded ones is taken as unchanged without being read): the
  overwrite is refused in one line naming it, by :func:`check_destination` before any work
  and by :func:`swap_in` before the folder is touched, unless ``overwrite_edited=True``.
* **SIGTERM is handled like Ctrl-C, and no temporary outlives its process** (but one killed
  by SIGKILL or a power cut, whose leftovers the next transaction settles). While the new
  files are written, SIGINT and SIGTERM stop the save at once (``KeyboardInterrupt``; a
  SIGTERM whose action was to end the process is turned into one) and the temporary folder
  is removed; while files are swapped in or put back, and while the temporary folder is
  removed, a signal waits (milliseconds) until the folder is whole again, then acts. A
  handler the caller installed is called in the same way; an ignored signal stays ignored.
* **Checked before any work** (:func:`check_destination`, :func:`check_free_space`): the
  target is or can become a folder, is writable (tested by writing a file, which read-only
  mounts, ACLs and quotas cannot fool) and has room for the new save beside the earlier one.
"""
from __future__ import annotations

import errno
import fnmatch
import json
import logging
import os
import shutil
import signal
import tempfile
import threading
from collections.abc import Callable, Collection, Iterable, Mapping
from pathlib import Path

from ..core.conventions import FisherkronError
from ..env import TMP_PREFIX, file_checksum, stale_temporaries, temporary_name

try:
    import fcntl
except ImportError:  # Windows: a save's liveness falls back to its process id
    fcntl = None

__all__ = ["check_destination", "check_free_space", "swap_in", "settle_interrupted", "reason"]

log = logging.getLogger(__name__)

#: ``listed(folder)``: the names of the files the folder's manifest lists (a one-line error if it cannot tell);
#: a mapping ``{name: {"size", "blake2b"[, "mtime_ns"]}}`` also lets a transaction find the files changed since.
Listed = Callable[[Path], Collection[str]]

#: Entries of a fresh file system's root (a mount point) that do not make a folder non-empty.
_SYSTEM_ENTRIES = ("lost+found",)
#: Free space the small files (configs, manifest) may take beyond the weights.
_SMALL_FILES = 1 << 16
# the layout of a save's temporary folder: the lock a running save holds, the new files, the
# earlier save's files moved aside, and the journal that says how to finish or undo the swap
_STAGE, _LOCK, _NEW, _OLD, _JOURNAL = "save", "lock", "new", "old", "journal.json"


# ----------------------------------------------------------------------------- before any work

def check_destination(directory, manifest: str, listed: Listed, *, overwrite: bool = False,
                      reserved: Iterable[str] = (), overwrite_edited: bool = False) -> Path:
    """Where a save may write, checked before any work; raises a one-line error.

    Allowed: a new or empty folder (a mount point's ``lost+found`` does not count), or an
    earlier save (it holds ``manifest``) with ``overwrite=True`` whose other files (the
    user's) match no ``reserved`` pattern and whose own files were not changed since it was
    made (unless ``overwrite_edited=True``). The folder (or the nearest existing parent) must
    be writable, which is tested by writing a file. A transaction a killed process left is
    finished or undone first; a running one into the same folder is refused.
    """
    out = Path(directory)
    if out.exists() and not out.is_dir():
        raise FisherkronError(f"{out} is a file, not a folder; choose a folder to save the model in")
    _probe_writable(out)
    if not out.is_dir():
        return out
    settle_interrupted(out, manifest)
    entries = [p.name for p in out.iterdir()
               if p.name not in _SYSTEM_ENTRIES and not p.name.startswith(TMP_PREFIX)]
    if not entries:
        return out
    if manifest not in entries:
        raise FisherkronError(f"{out} is not a fisherkron folder (it holds files fisherkron did not write); "
                              f"choose a new or empty folder")
    if not overwrite:
        raise FisherkronError(f"{out} already holds a fisherkron save; pass overwrite=True (--overwrite) "
                              f"to replace the files fisherkron wrote there (other files are kept)")
    ours = listed(out)
    reserved = tuple(reserved)
    clash = sorted(n for n in entries if n != manifest and n not in ours
                   and any(fnmatch.fnmatchcase(n, pattern) for pattern in reserved))
    if clash:
        raise _users_files(out, clash)
    if not overwrite_edited:
        _refuse_edited(out, ours, manifest)
    return out


def _nearest_existing(path: Path) -> Path:
    p = path.absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def _probe_writable(out: Path) -> None:
    """Create and remove a file where the save will write (read-only mounts, ACLs and quotas can't fool this test)."""
    p = _nearest_existing(out)
    if not p.is_dir():
        raise FisherkronError(f"cannot create {out}: {p} is a file, not a folder")
    try:
        fd, name = tempfile.mkstemp(prefix=temporary_name("probe"), dir=p)
        os.close(fd)
        os.unlink(name)
    except OSError as exc:
        raise FisherkronError(f"cannot write to {out}: {p} is not writable ({exc.strerror or exc}); "
                              f"choose a writable folder") from None


def _users_files(out: Path, names: list[str]) -> FisherkronError:
    shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    return FisherkronError(f"{out} holds {shown}, which fisherkron did not write, under names a saved model uses "
                           f"(the save would replace them, and tools loading the folder would read them); "
                           f"move them out of the folder or choose another folder, then save again")


def edited_files(out: Path, earlier) -> list[str]:
    """The files an earlier save lists (``{name: {"size", "blake2b"[, "mtime_ns"]}}``) whose contents changed since.

    A file that is gone is not listed (nothing of the user's would be lost); one whose size
    differs is changed; one whose size and modification time are the recorded ones is taken
    as unchanged without being read; any other is read and its checksum compared.
    """
    if not isinstance(earlier, Mapping):
        return []
    changed = []
    for name, spec in earlier.items():
        f = out / name
        if not isinstance(spec, Mapping) or not f.is_file():
            continue
        st = f.stat()
        if st.st_size != spec.get("size"):
            changed.append(name)
        elif spec.get("mtime_ns") is not None and spec["mtime_ns"] == st.st_mtime_ns:
            continue
        elif file_checksum(f) != spec.get("blake2b"):
            changed.append(name)
    return sorted(changed)


def _refuse_edited(out: Path, earlier, manifest: str) -> None:
    changed = edited_files(out, earlier)
    if changed:
        shown = ", ".join(changed[:5]) + (f" and {len(changed) - 5} more" if len(changed) > 5 else "")
        raise FisherkronError(f"{out}: {shown} changed since fisherkron saved {'them' if len(changed) > 1 else 'it'} "
                              f"there (the checksum in {manifest} differs) and the overwrite would replace or delete "
                              f"{'them' if len(changed) > 1 else 'it'}; copy what you want to keep elsewhere, or pass "
                              f"overwrite_edited=True (--overwrite-edited) to replace "
                              f"{'them' if len(changed) > 1 else 'it'} anyway")


def _size(n: float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def check_free_space(directory, need: int, manifest: str) -> None:
    """One-line error unless the file system of ``directory`` has ``need`` bytes (plus the small files) free.

    An overwrite keeps the earlier save (which holds ``manifest``) until the new one is
    complete, so the new save needs its whole size free beside it.
    """
    p = _nearest_existing(Path(directory))
    try:
        free = shutil.disk_usage(p).free
    except OSError:  # unknowable here: the save reports a full disk if it meets one
        return
    if free < need + _SMALL_FILES:
        earlier = (Path(directory) / manifest).exists()
        kept = " (the earlier save there is kept until the new one is complete)" if earlier else ""
        raise FisherkronError(f"{directory} has {_size(free)} free, but the save needs about "
                              f"{_size(need + _SMALL_FILES)}{kept}; free some space or choose another folder")


# ----------------------------------------------------------------------------- the transaction

def reason(exc: BaseException) -> str:
    """An exception in a few words, for a one-line error: ``strerror: filename`` of an ``OSError``."""
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror + (f": {exc.filename}" if exc.filename else "")
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


class _Signals:
    """SIGINT and SIGTERM while a folder's files are replaced: at once while :attr:`open`, else once it is whole.

    Entered, it installs its handler for each of the two signals that is not ignored (main
    thread only: elsewhere it does nothing). A signal that arrives while :attr:`open` is true
    acts at once; any other waits until the block is left, and then acts, unless the block is
    left by a ``KeyboardInterrupt`` already. To act is to call the handler installed before
    (Python's ``KeyboardInterrupt`` for Ctrl-C, or whatever the caller set), or, where the
    signal's action was to end the process (SIGTERM's default), to raise ``KeyboardInterrupt``
    so that the clean-ups run.
    """

    def __init__(self):
        self.open = False
        self.pending: int | None = None
        self.previous: dict = {}

    def __enter__(self) -> "_Signals":
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                old = signal.getsignal(sig)
                if old is not signal.SIG_IGN:
                    self.previous[sig] = old
                    signal.signal(sig, self._handler)
        return self

    def __exit__(self, kind, exc, tb) -> None:
        self.open = False
        for sig, old in self.previous.items():
            signal.signal(sig, old if old is not None else signal.SIG_DFL)
        if self.pending is not None and not (kind is not None and issubclass(kind, KeyboardInterrupt)):
            self._act(self.pending, None)

    def _handler(self, signum, frame) -> None:
        if self.open:
            self.open = False  # the clean-up that follows waits for a second signal
            self._act(signum, frame)
        elif self.pending is None:
            self.pending = signum

    def _act(self, signum: int, frame) -> None:
        old = self.previous.get(signum)
        if callable(old):
            old(signum, frame)
        else:  # SIG_DFL (or a handler set outside Python): it would end the process at once
            raise KeyboardInterrupt(f"terminated by signal {signum}")


def swap_in(out: Path, write: Callable[[Path], None], manifest: str, listed: Listed, *,
            overwrite_edited: bool = False) -> None:
    """Write a save with ``write(folder)`` and make it ``out``'s, with ``manifest``'s rename as the commit.

    ``write`` fills an empty folder with flat files, ``manifest`` among them. ``out`` holds
    nothing (or a save whose manifest lists its files, read by ``listed``). Every step before
    the commit is undone on an error; a crash is undone (or finished) from the journal by
    :func:`settle_interrupted`. A file of the earlier save changed since it was made is
    refused before the folder is touched, unless ``overwrite_edited``. SIGINT or SIGTERM stop
    ``write`` at once; during the swap (and its undo) they wait until the folder is whole
    (see :class:`_Signals`).
    """
    with _Signals() as signals:
        _swap_in(out, write, manifest, listed, overwrite_edited, signals)


def _swap_in(out: Path, write, manifest: str, listed: Listed, overwrite_edited: bool, signals: _Signals) -> None:
    had = (out / manifest).exists()
    earlier = listed(out) if had else ()
    stage = Path(tempfile.mkdtemp(prefix=temporary_name(_STAGE), dir=out))
    lock, committed, settled = None, False, False
    try:
        lock = _hold_lock(stage / _LOCK)
        new, old = stage / _NEW, stage / _OLD
        new.mkdir()
        old.mkdir()
        signals.open = True  # writing the new files (the long part): a signal stops it at once
        try:
            write(new)
        finally:
            signals.open = False
        names = sorted(f.name for f in new.iterdir() if f.name != manifest)
        clash = [n for n in names if os.path.lexists(out / n) and (n not in earlier or (out / n).is_dir())]
        if clash:
            raise _users_files(out, clash)
        if not overwrite_edited:  # again: the user may have edited a file while the new one was written
            _refuse_edited(out, earlier, manifest)
        mode = 0o666 & ~_umask()
        for f in new.iterdir():
            _chmod(f, mode)  # safetensors writes 0600: other users could not read the save
            _fsync(f)
        journal = {"old_manifest": file_checksum(out / manifest) if had else None,
                   "new_manifest": file_checksum(new / manifest), "names": names,
                   "existed": [n for n in names if (out / n).exists()],
                   "remove": sorted(n for n in earlier if n not in names)}
        try:
            _write_journal(stage, journal)
            for n in names:
                if n in journal["existed"]:
                    os.replace(out / n, old / n)  # the earlier save's file, kept aside until the commit
                os.replace(new / n, out / n)
            _fsync(out)
            os.replace(new / manifest, out / manifest)  # the commit: from here on the folder is the new save
        except BaseException:
            _settle(out, stage, journal, manifest)  # undo (or finish, had the commit gone through)
            settled = True
            raise
        committed = True
        try:
            _fsync(out)
            _settle(out, stage, journal, manifest)  # remove the files the new manifest does not list
            settled = True
        except OSError as exc:  # the new save is complete; the next save or load of it finishes the clean-up
            log.warning("%s is saved, but cleaning up failed (%s); the next save or load of it finishes that",
                        out, reason(exc))
    except BaseException as exc:
        if not committed and not settled:
            if (stage / _JOURNAL).exists():  # undoing failed: the earlier save's files are in the stage
                raise FisherkronError(f"saving to {out} failed ({reason(exc)}) and the earlier save could not be "
                                      f"put back yet: it is kept in {stage.name}, and the next save_compressed or "
                                      f"load_compressed of {out} restores it") from None
            settled = True  # nothing was moved: the stage holds only new files
        raise
    finally:
        _release_lock(lock)
        if settled:
            shutil.rmtree(stage, ignore_errors=True)


def _settle(out: Path, stage: Path, journal: dict, manifest: str) -> None:
    """Finish a swap whose commit went through, or undo one whose did not; then drop ``stage``."""
    cur = file_checksum(out / manifest) if (out / manifest).is_file() else None
    if cur == journal["new_manifest"]:  # committed: remove what the new manifest does not list
        for n in journal["remove"]:
            (out / n).unlink(missing_ok=True)
    elif cur == journal["old_manifest"]:  # not committed: the earlier save's files back into place
        for n in reversed(journal["names"]):
            if (stage / _OLD / n).exists():
                os.replace(stage / _OLD / n, out / n)
            elif n not in journal["existed"]:
                (out / n).unlink(missing_ok=True)
    else:
        raise FisherkronError(f"{stage} holds an interrupted save of {out}, whose {manifest} has changed since; "
                              f"compare them, keep what you need and delete {stage.name}")
    # the journal goes before the lock: a half-removed stage is still recognised, and settled again, as a dead save's
    for sub in (_NEW, _OLD):
        if (stage / sub).exists():
            shutil.rmtree(stage / sub)
    for name in (_JOURNAL + ".tmp", _JOURNAL, _LOCK):
        (stage / name).unlink(missing_ok=True)
    stage.rmdir()


def settle_interrupted(out: Path, manifest: str, *, loading: bool = False) -> None:
    """Finish or undo every save into ``out`` that a killed process left; refuse a running one.

    A save runs while it holds the lock in its temporary folder (the kernel releases it when
    the process dies, so a reused process id cannot keep it); where locks are unavailable,
    while its process lives (:func:`fisherkron.env.stale_temporaries`). Loading leaves a
    save that is still writing its files alone (the earlier save is intact meanwhile) and
    refuses one that is swapping them in. A signal waits until the folder is settled.
    """
    with _Signals():
        _settle_interrupted(out, manifest, loading)


def _settle_interrupted(out: Path, manifest: str, loading: bool) -> None:
    dead = set(stale_temporaries(out))
    for p in sorted(out.iterdir()):
        if not p.name.startswith(TMP_PREFIX):
            continue
        journal = p / _JOURNAL
        if not p.is_dir():  # the writability probe's file
            if p in dead:
                try:
                    p.unlink()
                except OSError:  # a read-only folder: the leftover is harmless
                    pass
            continue
        if _is_running(p, p not in dead):
            if not loading:
                raise FisherkronError(f"another save into {out} is running (process {_pid_of(p)}); wait for "
                                      f"it to finish, or, if none is, delete {p}")
            if journal.exists():
                raise FisherkronError(f"a save into {out} is swapping its files in (process {_pid_of(p)}); "
                                      f"load the folder when it has finished")
            continue
        try:
            if journal.exists():
                _settle(out, p, json.loads(journal.read_text()), manifest)
                log.warning("%s: the save that process %s left unfinished was finished or undone; the folder "
                            "holds the last complete save", out, _pid_of(p))
            else:
                shutil.rmtree(p)
        except FisherkronError:
            raise
        except (OSError, ValueError, KeyError, TypeError) as exc:
            if journal.exists():
                raise FisherkronError(f"an interrupted save left {p} ({reason(exc)}); open {out} once with "
                                      f"write access (save_compressed or load_compressed restores the earlier "
                                      f"save from it)") from None


# ----------------------------------------------------------------------------- locks and the disk

def _pid_of(p: Path) -> str:
    return p.name[len(TMP_PREFIX):].split("-", 1)[0]


def _hold_lock(path: Path):
    """Open ``path`` and hold an exclusive lock on it while the save runs (the kernel drops it if the process dies)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    if fcntl is not None:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # a file system without locks: liveness falls back to the process id
            pass
    return fd


def _release_lock(fd) -> None:
    if fd is None:
        return
    try:
        os.close(fd)
    except OSError:
        pass


def _is_running(p: Path, alive: bool) -> bool:
    """Whether the save that made ``p`` still runs: its lock is held; where locks do not work, ``alive``."""
    lock = p / _LOCK
    if fcntl is not None and lock.is_file():
        try:
            fd = os.open(lock, os.O_RDWR)
        except OSError:
            return alive
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return False  # nobody holds it: the writer is gone
        except BlockingIOError:
            return True
        except OSError:  # no locks on this file system
            return alive
        finally:
            os.close(fd)
    return alive


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _chmod(path: Path, mode: int) -> None:
    """Give a file ``mode``; a file system without Unix permissions (vfat, some network mounts) keeps its own."""
    try:
        os.chmod(path, mode)
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EROFS):
            raise


def _fsync(path: Path) -> None:
    """Flush a file (or a folder's entries) to the disk; a file system that cannot is left as it is."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def _write_journal(stage: Path, journal: dict) -> None:
    tmp = stage / (_JOURNAL + ".tmp")
    tmp.write_text(json.dumps(journal))
    _fsync(tmp)
    os.replace(tmp, stage / _JOURNAL)
    _fsync(stage)
