"""Where things live and how files are written: paths, offline switches, installed packages, atomic writes.

Everything above the core (the Hugging Face layer, the experiments, the command line)
takes its folders and its offline settings from here, so no module has to import the
model registry to find a path.

* :func:`data_root`: generated artefacts (``$FISHERKRON_DATA`` or ``<repo>/data``);
* :func:`set_offline_env` / :func:`hub_offline`: the Hugging Face offline switches;
* :func:`package_dir`: a package's folder, or the one error "package X is not installed";
* :func:`atomic_path`: the one temporary-name-then-rename helper, for files
  (:func:`atomic_write`) and folders (:func:`atomic_directory`).
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from .core.conventions import FisherkronError

__all__ = ["REPO_ROOT", "data_root", "set_offline_env", "hub_offline", "OFFLINE_VARS", "offline_advice", "package_dir",
           "require", "atomic_path", "stale_temporaries", "remove_stale_temporaries", "atomic_write", "atomic_directory", "TMP_PREFIX"]

#: The checkout this package was imported from (editable install) or its site-packages parent.
REPO_ROOT = Path(__file__).resolve().parents[1]
#: Every temporary file or folder the package writes starts with this, so stale ones can be found.
TMP_PREFIX = ".fisherkron-tmp-"
#: The switches that keep transformers, huggingface_hub and datasets off the network.
OFFLINE_VARS = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")


def data_root() -> Path:
    """Folder for generated artefacts: ``$FISHERKRON_DATA`` or ``<repo>/data``."""
    return Path(os.environ.get("FISHERKRON_DATA", REPO_ROOT / "data"))


def set_offline_env(hub: bool = False) -> None:
    """Default the offline switches on and ``HF_HOME`` to ``data/hf_home``.

    Only defaults are set: a user's own setting wins, and a user who switched any of the
    three off (``HF_HUB_OFFLINE=0``) asked for the hub, so the others are left unset too.
    With ``hub=True`` (the paper profile with hub access) nothing is forced offline.
    """
    os.environ.setdefault("HF_HOME", str(data_root() / "hf_home"))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    asked_for_hub = any(v in os.environ and not _truthy(os.environ[v]) for v in OFFLINE_VARS)
    if not hub and not asked_for_hub:
        for var in OFFLINE_VARS:
            os.environ.setdefault(var, "1")


def _truthy(value: str | None) -> bool:
    return (value or "0").strip().lower() in ("1", "true", "yes", "on")


def hub_offline() -> bool:
    """True when any offline switch says the Hugging Face hub must not be contacted."""
    return any(_truthy(os.environ.get(v)) for v in OFFLINE_VARS)


def offline_advice() -> str:
    """How to reach the hub from here: which switches are on, and the setting that turns all off."""
    on = [f"{v}={os.environ[v]}" for v in OFFLINE_VARS if _truthy(os.environ.get(v))]
    return (f"the hub is switched off here ({', '.join(on) or 'no switch set'}); to use it, start Python "
            f"with all three switched off: HF_HUB_OFFLINE=0 TRANSFORMERS_OFFLINE=0 HF_DATASETS_OFFLINE=0 "
            f"(with make: make <target> HF_HUB_OFFLINE=0 TRANSFORMERS_OFFLINE=0 HF_DATASETS_OFFLINE=0)")


def package_dir(module: str, install: str) -> Path:
    """Folder of an installed package, found without importing it.

    Raises the one-line "not installed" error when it is missing.
    """
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise FisherkronError(
            f"package {install.split('==')[0]} is not installed; run `make install` "
            f"(or `pip install --no-deps {install}`)")
    return Path(list(spec.submodule_search_locations)[0])


def require(module: str, extra: str) -> Any:
    """Import an optional dependency, or raise the one-line error naming the extra that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise FisherkronError(f"{module} is not installed ({exc}); run `make install` or "
                              f"`pip install 'fisherkron[{extra}]'`") from None


@contextmanager
def atomic_path(path: str | os.PathLike, *, directory: bool = False, replace: bool = True) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success it is renamed to ``path`` in one step.

    For a file, the temporary name keeps ``path``'s suffix (matplotlib and pandas pick the
    format from it). For a folder (``directory=True``) an existing ``path`` is removed just
    before the rename when ``replace`` is true; callers decide beforehand whether that folder
    may be replaced. An error or an interruption leaves ``path`` as it was and removes the
    temporary path; one killed by SIGKILL leaves a ``.fisherkron-tmp-<pid>-*`` name behind,
    which :func:`stale_temporaries` finds once that process is gone.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    prefix = f"{TMP_PREFIX}{os.getpid()}-{path.stem if not directory else path.name}-"
    if directory:
        tmp = Path(tempfile.mkdtemp(prefix=prefix, dir=path.parent))
    else:
        fd, name = tempfile.mkstemp(prefix=prefix, suffix=path.suffix, dir=path.parent)
        os.close(fd)
        tmp = Path(name)
    try:
        yield tmp
        os.chmod(tmp, (0o777 if directory else 0o666) & ~_umask())  # mkdtemp/mkstemp make 0700/0600
        if directory:
            if path.exists() and replace:
                shutil.rmtree(path) if path.is_dir() else path.unlink()
            tmp.rename(path)
        else:
            os.replace(tmp, path)
    finally:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        elif tmp.exists():
            tmp.unlink()


def atomic_write(path: str | os.PathLike, write: Callable[[str], Any]) -> Path:
    """Call ``write(tmp_path)`` on a temporary file beside ``path``, then rename it into place.

    >>> import tempfile, pathlib
    >>> d = pathlib.Path(tempfile.mkdtemp())
    >>> p = atomic_write(d / "x.txt", lambda t: pathlib.Path(t).write_text("hi"))
    >>> p.read_text(), sorted(f.name for f in d.iterdir())
    ('hi', ['x.txt'])
    """
    with atomic_path(path) as tmp:
        write(str(tmp))
    return Path(path)


def atomic_directory(out: str | os.PathLike, *, replace: bool = True):
    """:func:`atomic_path` for a folder: fill the yielded folder; it becomes ``out`` on success."""
    return atomic_path(out, directory=True, replace=replace)


def temporary_name(stem: str) -> str:
    """The prefix of a temporary file or folder this process writes: ``.fisherkron-tmp-<pid>-<stem>-``."""
    return f"{TMP_PREFIX}{os.getpid()}-{stem}-"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def stale_temporaries(folder: str | os.PathLike) -> list[Path]:
    """The package's temporary files and folders in ``folder`` whose writing process is gone.

    Left behind only by a process killed without a chance to clean up (SIGKILL, power loss,
    a crash); the process id in the name tells a live writer's (left alone) from a dead one's.
    """
    folder = Path(folder)
    if not folder.is_dir():
        return []
    stale = []
    for p in folder.iterdir():
        if not p.name.startswith(TMP_PREFIX):
            continue
        pid = p.name[len(TMP_PREFIX):].split("-", 1)[0]
        if not pid.isdigit() or not _pid_alive(int(pid)):
            stale.append(p)
    return sorted(stale)


def remove_stale_temporaries(folder: str | os.PathLike) -> tuple[int, int]:
    """Remove :func:`stale_temporaries` of ``folder``; return ``(entries removed, bytes reclaimed)``."""
    freed, count = 0, 0
    for p in stale_temporaries(folder):
        files = [p] if p.is_file() else [f for f in p.rglob("*") if f.is_file()]
        freed += sum(f.stat().st_size for f in files if f.exists())
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
        count += 1
    return count, freed


def file_checksum(path: str | os.PathLike) -> str:
    """blake2b (20 bytes) of a file's contents, read in 8 MiB chunks."""
    h = hashlib.blake2b(digest_size=20)
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 23), b""):
            h.update(chunk)
    return h.hexdigest()


@contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Within the block, SIGTERM raises ``KeyboardInterrupt`` so ``finally`` clean-ups run.

    ``kill`` (SIGTERM, what batch schedulers and ``timeout`` send) would otherwise end the
    process at once and leave temporary folders behind. Only the main thread can install
    a handler; elsewhere the block runs unchanged.
    """
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise KeyboardInterrupt(f"terminated by signal {signum}")

    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
