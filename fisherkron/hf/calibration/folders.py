"""The cache root on real disks and shared machines: who owns a folder, what is reclaimed, space, read-only.

* **Owner.** A ``<key>.partial/`` being filled holds ``owner.pid``: the process id, the host,
  the boot and the process's start time (field 22 of ``/proc/<pid>/stat``, or psutil's). On
  this host the marker is stale when that process is gone, or when the id now belongs to a
  process that started at another time (after a restart, or a reuse of the id); a marker of
  another host sharing the cache is not judged: the message names that host and the file to
  delete if its run has ended (:func:`owned`). A process that needs a folder another live
  process on this host is filling waits for it (:func:`wait_for_owner`, at most
  :data:`WAIT_SECONDS`) and then reads the finished entry: two notebooks started together
  (``make -j2``) collect a shared calibration once.
* **Abandoned folders** (:func:`reclaim`): temporaries of dead processes are removed
  (:func:`fisherkron.env.remove_stale_temporaries`); every other configuration's
  ``<key>.partial/`` is reported at WARNING with its size and age, and removed when no live
  process owns it and it can never resume (written by another code version, whose keys differ)
  or it was left untouched for :data:`MAX_PARTIAL_AGE` seconds.
* **Space** (:func:`preallocate`): the gradient files are given their disk blocks when they
  are created, so a full disk is one line at the start naming the folder, the bytes needed and
  free, not a ``Bus error`` (SIGBUS) from a memory map written later.
* **Read-only** (:func:`writable_root`): an entry a read-only cache holds is read as it is;
  one it lacks is one line naming the folder and what to do.
"""
from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import shutil
import socket
import time
from pathlib import Path

import numpy as np

from ...core.conventions import FisherkronError
from ...env import _pid_alive, remove_stale_temporaries
from .keys import code_version

__all__ = ["PARTIAL_SUFFIX", "OWNER", "INFO", "MAX_PARTIAL_AGE", "WAIT_SECONDS", "NoSpace", "owned", "owner_line",
           "wait_for_owner", "reclaim",
           "release_entry", "seal", "preallocate", "writable_root", "read_only", "no_space"]

log = logging.getLogger(__name__)

PARTIAL_SUFFIX = ".partial"
#: the owner marker of a folder being filled
OWNER = "owner.pid"
#: the longest a process waits for another live process on this host to finish the folder it needs, in
#: seconds (``$FISHERKRON_CALIBRATION_WAIT`` overrides it; 0 refuses at once)
WAIT_SECONDS = 6 * 3600.0
#: what a ``<key>.partial/`` was started by: its key and the code version (the keys it can resume under)
INFO = "partial.json"
#: seconds after which an untouched ``<key>.partial/`` of another configuration is removed (7 days)
MAX_PARTIAL_AGE = 7 * 24 * 3600


# ----------------------------------------------------------------------------- the owner marker

def _boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


def _start_of(pid: int) -> tuple[str, float] | None:
    """``(clock, start)`` of process ``pid``: Linux clock ticks after boot, or psutil's create time."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()  # fields 3.. of stat
        return "ticks", float(fields[19])  # field 22: starttime
    except (OSError, ValueError, IndexError):
        pass
    try:
        import psutil

        return "psutil", float(psutil.Process(pid).create_time())
    except Exception:  # noqa: BLE001 - psutil missing, or no such process
        return None


def _me() -> dict:
    clock, start = _start_of(os.getpid()) or (None, None)
    return {"pid": os.getpid(), "host": socket.gethostname(), "boot": _boot_id(), "clock": clock, "start": start,
            "written": time.time()}


def _read_owner(marker: Path) -> dict | None:
    """The owner recorded in ``marker`` (the first version held the process id alone), or ``None``."""
    try:
        text = marker.read_text().strip()
        written = marker.stat().st_mtime
    except OSError:
        return None
    if text.isdigit():
        return {"pid": int(text), "written": written}
    try:
        got = json.loads(text)
        return got if isinstance(got, dict) and isinstance(got.get("pid"), int) else None
    except ValueError:
        return None


def _being_written(marker: Path) -> bool:
    """A marker just created (exclusively) whose owner is still writing it: unreadable and seconds old."""
    try:
        return _read_owner(marker) is None and time.time() - marker.stat().st_mtime < 5.0
    except OSError:
        return False


def _alive(owner: dict) -> bool:
    """Whether the process recorded in ``owner`` (on this host) still runs: same id, same boot, same start."""
    pid = owner["pid"]
    if owner.get("boot") and _boot_id() and owner["boot"] != _boot_id():
        return False  # the machine restarted since: that process is gone
    if not _pid_alive(pid):  # gone, or exited and not yet reaped by its parent
        return False
    if owner.get("clock") and owner.get("start") is not None:
        now = _start_of(pid)
        if now is None or now[0] != owner["clock"]:
            return _pid_alive(pid, since=owner.get("written"))
        return abs(now[1] - float(owner["start"])) < (1.0 if now[0] == "psutil" else 0.5)
    return _pid_alive(pid, since=owner.get("written"))


def owner_line(folder: Path) -> str | None:
    """Why ``folder`` is taken: a one-line message naming its live (or unjudgeable) owner, or ``None``."""
    return _taken(folder, _read_owner(folder / OWNER))


def _taken(folder: Path, owner: dict | None) -> str | None:
    """:func:`owner_line` for the ``owner`` read from ``folder``'s marker."""
    marker = folder / OWNER
    if owner is None:
        return None
    host = owner.get("host")
    if host and host != socket.gethostname():
        return (f"process {owner['pid']} on host {host} is collecting this calibration into {folder}; let it finish, "
                f"or if that run has ended, delete {marker} and run again")
    if owner["pid"] == os.getpid() or not _alive(owner):
        return None
    return (f"process {owner['pid']} is collecting this calibration into {folder}; wait for it to finish "
            f"(or stop it) and run again")


def wait_for_owner(folder: Path, poll: float = 1.0) -> float:
    """Wait while another live process on this host fills ``folder``; returns the seconds waited.

    Says once at WARNING whom it waits for (a command line shows it by default). After
    :data:`WAIT_SECONDS` (``$FISHERKRON_CALIBRATION_WAIT``; at once when it is 0) it refuses in
    :func:`owner_line`'s words; a marker of another host is not waited for (its process cannot be
    judged from here) and is left to :func:`owned` to refuse.
    """
    text = os.environ.get("FISHERKRON_CALIBRATION_WAIT", "")
    try:
        limit = float(text) if text.strip() else WAIT_SECONDS
    except ValueError:
        raise FisherkronError(f"FISHERKRON_CALIBRATION_WAIT={text!r} is not a number of seconds; set it to e.g. "
                              f"600, or 0 to refuse at once") from None
    start, pid = time.monotonic(), None
    while True:
        owner = _read_owner(folder / OWNER)
        line = _taken(folder, owner)
        if line is None or owner.get("host", socket.gethostname()) != socket.gethostname():
            waited = time.monotonic() - start
            if pid is not None:
                log.info("process %s is done with %s; waited %.0f s", pid, folder, waited)
            return waited
        if time.monotonic() - start >= limit:
            raise FisherkronError(line if pid is None else
                                  f"{line} (waited {time.monotonic() - start:.0f} s; FISHERKRON_CALIBRATION_WAIT "
                                  f"sets how long)")
        if pid is None:
            pid = owner["pid"]
            log.warning("process %s is collecting this calibration into %s: waiting for it (at most %.0f s; "
                        "Ctrl-C stops)", pid, folder, limit)
        time.sleep(poll)


@contextlib.contextmanager
def owned(partial: Path, key: str):
    """Create ``partial`` (or take over a dead process's) and hold its marker; refuse one a live process fills.

    The marker is created exclusively (``O_EXCL``), so of two processes starting at once one wins.
    ``partial.json`` records the key and code version (what :func:`reclaim` judges it by).
    """
    partial.mkdir(parents=True, exist_ok=True)
    marker = partial / OWNER
    for _ in range(20):
        line = owner_line(partial)
        if line is not None:
            raise FisherkronError(line)
        if _being_written(marker):  # another process created it a moment ago and is writing it
            time.sleep(0.25)
            continue
        if marker.exists():
            pid = (_read_owner(marker) or {}).get("pid", "?")
            if pid != os.getpid():
                log.warning("%s: its owner marker is stale (process %s is gone, or its id was reused); taking the "
                            "folder over", partial, pid)
            marker.unlink(missing_ok=True)
        try:
            fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:  # another process took it between the check and here: judge it again
            continue
        with os.fdopen(fd, "w") as fh:
            json.dump(_me(), fh)
        break
    else:
        raise FisherkronError(f"{partial} is being taken by another process; run again in a moment")
    remove_stale_temporaries(partial)  # a checkpoint write killed outright
    info = partial / INFO
    if not info.exists():
        info.write_text(json.dumps({"key": key, "code": code_version(), "created": time.time()}))
    try:
        yield marker
    finally:
        with contextlib.suppress(OSError):
            if (_read_owner(marker) or {}).get("pid") == os.getpid():
                marker.unlink()


def release_entry(folder: Path) -> None:
    """Remove what only a folder being filled holds (owner marker, ``partial.json``) from a finished one."""
    for name in (OWNER, INFO):
        with contextlib.suppress(OSError):
            (folder / name).unlink(missing_ok=True)


def seal(partial: Path, final: Path) -> None:
    """``partial`` becomes the entry ``final`` in one rename, without its checkpoints and owner marker."""
    for f in partial.glob("progress*.pt"):
        f.unlink()
    release_entry(partial)  # before the rename: an entry never holds an owner marker
    os.replace(partial, final)  # one rename: the entry appears whole


# ----------------------------------------------------------------------------- abandoned folders

def _size_age(folder: Path) -> tuple[int, float]:
    """Bytes held by ``folder`` and seconds since anything in it was written."""
    size, newest = 0, 0.0
    for f in [folder, *folder.rglob("*")]:
        try:
            st = f.lstat()
        except OSError:
            continue
        size += st.st_size if f.is_file() else 0
        newest = max(newest, st.st_mtime)
    return size, time.time() - newest


def _bytes_text(n: float) -> str:
    return next(f"{n / f:.{d}f} {u}" for f, u, d in ((1e9, "GB", 2), (1e6, "MB", 1), (1e3, "kB", 1), (1, "bytes", 0))
                if n >= f or u == "bytes")


def _age_text(seconds: float) -> str:
    return f"{seconds / 86400:.1f} days" if seconds >= 86400 else f"{seconds / 3600:.1f} h"


def reclaim(root: Path, mine: Path | None = None) -> None:
    """Remove abandoned temporaries and ``<key>.partial/`` folders of ``root``, and report the others.

    A partial folder other than ``mine`` that no live process owns is removed when its code
    version is not this one (it can never resume) or it is older than :data:`MAX_PARTIAL_AGE`;
    every other one is reported at WARNING with its size and age. Nothing is raised: a
    read-only root keeps what it holds.
    """
    if not root.is_dir():
        return
    count, freed = remove_stale_temporaries(root)
    if count:
        log.warning("removed %d temporary folder(s) left by interrupted calibration runs in %s "
                    "(%.1f MB reclaimed)", count, root, freed / 2**20)
    code = code_version()
    removed, kept = [], []
    for p in sorted(root.glob(f"*{PARTIAL_SUFFIX}")):
        if p == mine or not p.is_dir():
            continue
        size, age = _size_age(p)
        if owner_line(p) is not None:
            kept.append((p, size, age, "in use"))
            continue
        try:
            made = json.loads((p / INFO).read_text()).get("code")
        except (OSError, ValueError, AttributeError):
            made = None
        why = ("written by another version of the calibration code, it can never resume" if made != code else
               f"untouched for {_age_text(age)}" if age > MAX_PARTIAL_AGE else None)
        if why is None:
            kept.append((p, size, age, "resumable"))
            continue
        try:
            shutil.rmtree(p)
        except OSError as exc:
            log.debug("could not remove %s (%s)", p, exc)
            kept.append((p, size, age, "not removable"))
            continue
        removed.append((p, size, why))
    for p, size, why in removed:
        log.warning("removed the interrupted calibration %s (%s): %s", p, _bytes_text(size), why)
    if kept:
        total = sum(s for _, s, _, _ in kept)
        each = "; ".join(f"{p.name} {_bytes_text(s)}, {_age_text(a)} old, {what}" for p, s, a, what in kept[:3])
        log.warning("%d interrupted calibration(s) of other configurations in %s hold %s (%s%s); each resumes when "
                    "run again with the same arguments, and is removed after %d days untouched; delete them to "
                    "free the space now", len(kept), root, _bytes_text(total), each, "; ..." if len(kept) > 3 else "",
                    MAX_PARTIAL_AGE // 86400)


# ----------------------------------------------------------------------------- disk space and read-only roots

class NoSpace(FisherkronError):
    """The disk holding a calibration folder is full (``keep``: the folder holds progress worth keeping)."""

    def __init__(self, message: str, keep: bool = False):
        super().__init__(message)
        self.keep = keep


def no_space(folder: Path, need: int | None, grad_dtype: str = "float32", keep: bool = False) -> NoSpace:
    """The one-line error of a full disk under ``folder`` (a folder of the cache): space needed and free, what to do."""
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        free = None
    amounts = ", ".join(x for x in ((f"{_bytes_text(need)} needed" if need is not None else ""),
                                    (f"{_bytes_text(free)} free" if free is not None else "")) if x)
    dtype = "" if grad_dtype != "float32" else ", or store the gradients in 16 bits (grad_dtype='bfloat16', " \
                                               "--grad-dtype bfloat16: half the space)"
    kept = "; the progress so far is kept, run the same call again to resume" if keep else ""
    return NoSpace(f"not enough disk space for the calibration in {folder.parent} ({amounts}); pass a cache_dir on a "
                   f"larger disk (--cache-dir), select fewer layers{dtype}{kept}", keep=keep)


def _reserve(path: Path, fresh: bool) -> None:
    """Give ``path``'s whole length its disk blocks: ``posix_fallocate``, else (a new file) writing zeros."""
    size = path.stat().st_size
    fd = os.open(path, os.O_RDWR)
    try:
        try:
            os.posix_fallocate(fd, 0, size)
            return
        except AttributeError:  # no posix_fallocate on this platform
            pass
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                raise
        if not fresh:  # an existing file keeps its data; its blocks were reserved when it was created
            return
        zeros = bytes(1 << 22)
        at = _data_offset(path)  # the header stays
        while at < size:
            at += os.pwrite(fd, zeros[:min(len(zeros), size - at)], at)
        os.fsync(fd)
    finally:
        os.close(fd)


def _data_offset(path: Path) -> int:
    with open(path, "rb") as fh:
        version = np.lib.format.read_magic(fh)
        (np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0)(fh)
        return fh.tell()


def preallocate(folder: Path, files: list[Path], fresh: set[Path], grad_dtype: str = "float32") -> None:
    """Reserve the disk blocks of ``files`` (``.npy`` files of ``folder`` already at their full length).

    A memory map written into a sparse file on a full disk ends the process with SIGBUS; with the
    blocks reserved up front a lack of space is ``ENOSPC`` here, raised as :class:`NoSpace`.
    ``fresh``: the files just created (only they may be filled with zeros where the file system
    cannot reserve blocks).
    """
    need = sum(f.stat().st_size for f in files if f in fresh)
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        free = None
    if free is not None and need > free:
        raise no_space(folder, need, grad_dtype)
    try:
        for f in files:
            _reserve(f, f in fresh)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise no_space(folder, need, grad_dtype) from None
        raise


def writable_root(root: Path, cache: bool) -> None:
    """Create ``root`` if needed; a one-line error when it cannot be written (a read-only cache)."""
    reason = None
    try:
        root.mkdir(parents=True, exist_ok=True)
        if not os.access(root, os.W_OK | os.X_OK):
            reason = "not writable"
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
    if reason is not None:
        raise read_only(root, cache, reason)


def read_only(root: Path, cache: bool, reason: str) -> FisherkronError:
    if cache:
        return FisherkronError(f"the calibration cache {root} is read-only ({reason}) and holds no entry for this "
                               f"configuration; pass a writable cache_dir (command line: --cache-dir) to collect it")
    return FisherkronError(f"cache=False collects into a private folder under {root}, which is read-only ({reason}); "
                           f"pass a writable cache_dir (command line: --cache-dir)")
