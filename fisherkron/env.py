"""Where things live and how files are written: paths, offline switches, installed packages, atomic writes.

Everything above the core (the Hugging Face layer, the experiments, the command line)
takes its folders and its offline settings from here, so no module has to import the
model registry to find a path.

* :func:`data_root`: generated artefacts (``$FISHERKRON_DATA`` or ``<repo>/data``);
* :func:`set_offline_env` / :func:`hub_offline`: the Hugging Face offline switches;
* :func:`package_dir`: a package's folder, or the one error "package X is not installed";
* :func:`atomic_path`: the one temporary-name-then-rename helper, for files
  (:func:`atomic_write`) and folders (:func:`atomic_directory`);
* :func:`read_committed`: the one reader of a committed file the tools render or compare from
  (tables, provenance and verify records): a missing, empty, binary, cut-short or hand-edited file
  is one error naming it, what is wrong and what to do (:func:`json_object`, :func:`csv_rows`);
* :class:`OtherLoad`: how much of the machine other processes used while a timing ran.
"""
from __future__ import annotations

import errno
import functools
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from .core.errors import FisherkronError

__all__ = ["REPO_ROOT", "data_root", "models_root", "set_offline_env", "hub_offline", "OFFLINE_VARS", "offline_advice", "package_dir",
           "require", "code_text", "code_digest", "atomic_path", "stale_temporaries", "remove_stale_temporaries", "atomic_write", "atomic_directory", "TMP_PREFIX",
           "OtherLoad", "shown", "read_committed", "json_object", "csv_rows"]

#: The checkout this package was imported from (editable install) or its site-packages parent.
REPO_ROOT = Path(__file__).resolve().parents[1]
#: Every temporary file or folder the package writes starts with this, so stale ones can be found.
TMP_PREFIX = ".fisherkron-tmp-"
#: The switches that keep transformers, huggingface_hub and datasets off the network.
OFFLINE_VARS = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")


def data_root() -> Path:
    """Folder for generated artefacts: ``$FISHERKRON_DATA`` or ``<repo>/data``."""
    return Path(os.environ.get("FISHERKRON_DATA", REPO_ROOT / "data"))


def models_root() -> Path:
    """Folder of converted models (the dequantised decoders): ``$FISHERKRON_MODELS`` or ``data_root()/models``.

    The folder a model was loaded from is not part of any cache key (the calibration key leaves the config's
    ``_name_or_path`` out), so a model converted into another folder finds the same cached statistics."""
    env = os.environ.get("FISHERKRON_MODELS")
    return Path(env) if env else data_root() / "models"


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
        try:
            yield tmp
        except Exception as exc:  # noqa: BLE001 - a full disk is named; anything else passes unchanged
            full = _disk_full(path.parent, exc)
            if full:
                raise FisherkronError(f"cannot write {path}: {full}; nothing there was changed. Free space "
                                      f"(e.g. old folders of data/cache or build/) and run again") from exc
            raise
        os.chmod(tmp, (0o777 if directory else 0o666) & ~_umask())  # mkdtemp/mkstemp make 0700/0600
        if directory:
            _replace_directory(tmp, path, replace, prefix)
        else:
            os.replace(tmp, path)
    finally:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        elif tmp.exists():
            tmp.unlink()


def _replace_directory(tmp: Path, path: Path, replace: bool, prefix: str) -> None:
    """Rename the filled folder ``tmp`` to ``path``; an existing ``path`` is set aside first, deleted last.

    The earlier folder is renamed aside (``<prefix>old``, beside it) before the new one moves in
    and is deleted only after that succeeded, so a failing rename (``path`` is a mount point:
    EBUSY; another file system: EXDEV) leaves it as it was. It is never deleted first.
    """
    if not (replace and (path.exists() or path.is_symlink())):
        try:
            tmp.rename(path)
        except OSError as exc:
            raise _rename_error(path, exc) from None
        return
    aside = path.with_name(f"{prefix}old")
    try:
        os.rename(path, aside)
    except OSError as exc:
        raise _rename_error(path, exc) from None
    try:
        tmp.rename(path)
    except BaseException as exc:
        os.rename(aside, path)  # the earlier folder back in place
        if isinstance(exc, OSError):
            raise _rename_error(path, exc) from None
        raise
    shutil.rmtree(aside, ignore_errors=True) if aside.is_dir() else aside.unlink()


#: free bytes under which a failed write is put down to a full disk (torch.save's zip writer
#: reports one as "unexpected pos" or "iostream error", with no errno)
DISK_FULL_BYTES = 64 << 20


def _disk_full(folder: Path, exc: BaseException) -> str | None:
    """Why writing in ``folder`` failed, if the disk is full (ENOSPC in ``exc``'s chain, or almost no
    free space left on the folder's file system); ``None`` otherwise."""
    seen, chain = exc, set()
    while seen is not None and id(seen) not in chain:
        if isinstance(seen, OSError) and seen.errno == errno.ENOSPC:
            return f"no space left on the device of {folder}"
        chain.add(id(seen))
        seen = seen.__cause__ or seen.__context__
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return None
    if free >= DISK_FULL_BYTES:
        return None
    return f"the disk is full ({free >> 20} MiB free on the file system of {folder})"


def _rename_error(path: Path, exc: OSError) -> FisherkronError:
    why = ("it is a mount point (or otherwise busy)" if os.path.ismount(path) or exc.errno == 16 else str(exc))
    return FisherkronError(f"cannot put a new folder at {path}: {why}; nothing there was changed. Point the "
                           f"output at a folder inside it (e.g. {path / 'out'})")


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


def _exited(pid: int) -> bool:
    """Whether ``pid`` has exited and waits for its parent to read its status (a zombie; Linux ``/proc``)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"  # field 3: state
    except (OSError, IndexError):
        return False


def _pid_alive(pid: int, since: float | None = None) -> bool:
    """Whether process ``pid`` runs on this host (one that has exited, unreaped by its parent, does not).

    ``since``: a time (seconds since the epoch) at which the process in question held ``pid``,
    e.g. when it last wrote a file. A process that started more than a minute after it is
    another one that reused the id (the writer died, or the machine restarted) and does not count.
    The start time is field 22 of ``/proc/<pid>/stat`` (clock ticks after boot, Linux) or
    psutil's; where neither tells, a live ``pid`` counts. The minute of slack absorbs clock
    steps; a reused id is then found by a later run.
    """
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):
        return False
    except PermissionError:  # another user's live process
        pass
    if _exited(pid):
        return False
    if since is None:
        return True
    started = None
    try:  # the process name (field 2) may hold spaces and parentheses: count fields after the last ')'
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        boot = next(float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime "))
        started = boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        try:
            import psutil

            started = psutil.Process(pid).create_time()
        except Exception:  # noqa: BLE001 - psutil missing, or the process just ended
            started = None
    return started is None or started <= since + 60.0


def stale_temporaries(folder: str | os.PathLike, stem: str | None = None) -> list[Path]:
    """The package's temporary files and folders in ``folder`` whose writing process is gone.

    ``stem``: only those of one kind, ``.fisherkron-tmp-<pid>-<stem>-*`` (e.g. the temporaries of
    the folder ``<stem>``); default: all of them.

    Left behind only by a process killed without a chance to clean up (SIGKILL, power loss,
    a crash); the process id in the name tells a live writer's (left alone) from a dead one's,
    and a process that started after the temporary was last written is not its writer (the id
    was reused, e.g. after a restart: see :func:`_pid_alive`).
    """
    folder = Path(folder)
    if not folder.is_dir():
        return []
    stale = []
    for p in folder.iterdir():
        if not p.name.startswith(TMP_PREFIX):
            continue
        pid, _, rest = p.name[len(TMP_PREFIX):].partition("-")
        if stem is not None and not rest.startswith(f"{stem}-"):
            continue
        try:
            written = p.lstat().st_mtime
        except OSError:  # removed meanwhile
            continue
        if not pid.isdigit() or not _pid_alive(int(pid), since=written):
            stale.append(p)
    return sorted(stale)


def remove_stale_temporaries(folder: str | os.PathLike, stem: str | None = None) -> tuple[int, int]:
    """Remove :func:`stale_temporaries` of ``folder`` (of ``stem``); return ``(entries removed, bytes reclaimed)``.

    What cannot be removed (a read-only folder) is left and not counted.
    """
    freed, count = 0, 0
    for p in stale_temporaries(folder, stem):
        try:
            files = [p] if not p.is_dir() else [f for f in p.rglob("*") if f.is_file()]
            size = sum(f.lstat().st_size for f in files)
            shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink(missing_ok=True)
        except OSError:
            continue
        freed += size
        count += 1
    return count, freed


# -- reading committed files back ---------------------------------------------------------------
_T = TypeVar("_T")


def shown(path: str | os.PathLike) -> str:
    """``path`` as a message names it: relative to the checkout when inside it (``figures/tab_x.csv``)."""
    path = Path(path)
    try:
        return path.resolve().relative_to(REPO_ROOT).as_posix()
    except ValueError:
        return str(path)


def read_committed(path: str | os.PathLike, parse: Callable[[str], _T] | None = None, *, what: str = "a text file",
                   remake: str | None = None, committed: bool = True) -> _T | str:
    """The text of ``path``, ``parse``d; or one :class:`FisherkronError` naming the file, what is wrong and what to do.

    The one reader of the files that ``make readme``, ``make verify`` and ``make book`` render or compare
    from. Missing, unreadable, empty, not UTF-8 text (a binary file), or refused by ``parse`` (cut short,
    hand-edited: any exception ``parse`` raises) all give one line ending in what to do: ``restore it from
    git (`git checkout -- FILE`)`` (``committed``), and ``remake`` if given (e.g. ``"re-run make verify NB=x"``).

    Args:
        parse: text -> value, e.g. :func:`json_object` or :func:`csv_rows`; ``None`` returns the text.
        what: what the file should be, for the message (``"a CSV table"``).

    >>> import tempfile, pathlib
    >>> p = pathlib.Path(tempfile.mkdtemp()) / "r.json"
    >>> _ = p.write_bytes(b'{"a": 1')
    >>> read_committed(p, json_object(), what="a JSON record", remake="run `make x`")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    fisherkron.core.errors.FisherkronError: .../r.json is not a JSON record (Expecting ',' delimiter: line 1 column 8 (char 7)): restore it from git (`git checkout -- .../r.json`) or run `make x`
    """
    name = shown(path)
    todo = " or ".join(([f"restore it from git (`git checkout -- {name}`)"] if committed else [])
                       + ([remake] if remake else [])) or "write it again"
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        raise FisherkronError(f"{name} is missing: {todo}") from None
    except OSError as exc:
        raise FisherkronError(f"cannot read {name} ({exc.strerror or exc}): {todo}") from None
    if not data.strip():
        raise FisherkronError(f"{name} is empty, not {what}: {todo}")
    try:
        text = data.decode("utf-8")
        if "\x00" in text:
            raise UnicodeDecodeError("utf-8", data, text.index("\x00"), text.index("\x00") + 1, "NUL byte")
    except UnicodeDecodeError as exc:
        raise FisherkronError(f"{name} is not {what}: byte {exc.start} is not text (a binary or damaged file): "
                              f"{todo}") from None
    if parse is None:
        return text
    try:
        return parse(text)
    except Exception as exc:  # noqa: BLE001 - whatever the parser refuses is a damaged file: named, not a traceback
        why = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise FisherkronError(f"{name} is not {what} ({why}): {todo}") from None


#: JSON value kinds a record field may be required to have: a name for the message and a test
_JSON_KINDS: dict[str, Callable[[Any], bool]] = {
    "object": lambda v: isinstance(v, dict),
    "list": lambda v: isinstance(v, list),
    "text": lambda v: isinstance(v, str),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "bool": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
}


def _kind(v: Any) -> str:
    return next((k for k, ok in _JSON_KINDS.items() if k != "integer" and ok(v)), type(v).__name__)


def json_object(required: dict[str, str] | None = None, optional: dict[str, str] | None = None,
                check: Callable[[dict], None] | None = None) -> Callable[[str], dict[str, Any]]:
    """A parser for :func:`read_committed`: JSON text -> an object whose fields have the kinds given.

    ``required`` / ``optional``: field -> kinds, ``"|"``-separated names of :data:`_JSON_KINDS`
    (``"number|null"``); an optional field is checked only where present. ``check(obj)`` may test more
    (raise ``ValueError`` saying what is wrong).

    >>> json_object({"worst": "number"})('{"worst": 0.5}')
    {'worst': 0.5}
    >>> json_object({"worst": "number"})('{"worst": "0.5"}')
    Traceback (most recent call last):
    ValueError: field 'worst' is text, not number
    """
    fields = [(f, k, True) for f, k in (required or {}).items()] + [(f, k, False) for f, k in (optional or {}).items()]

    def parse(text: str) -> dict[str, Any]:
        obj = json.loads(text)
        if not isinstance(obj, dict):
            raise ValueError(f"a JSON {_kind(obj)}, not a JSON object")
        for f, kinds, needed in fields:
            if f not in obj:
                if needed:
                    raise ValueError(f"field {f!r} is missing")
                continue
            if not any(_JSON_KINDS[k](obj[f]) for k in kinds.split("|")):
                raise ValueError(f"field {f!r} is {_kind(obj[f])}, not {kinds.replace('|', ' or ')}")
        if check is not None:
            check(obj)
        return obj

    return parse


def csv_rows(text: str) -> list[dict[str, str]]:
    """A parser for :func:`read_committed`: CSV text -> its rows as ``{column: cell}``, every row as long as the header.

    A table cut short ends in a row with fewer cells than the header; that, a header without columns
    or with a repeated name, is refused.

    >>> csv_rows("a,b\\n1,x\\n")
    [{'a': '1', 'b': 'x'}]
    >>> csv_rows("a,b\\n1,x\\n2")
    Traceback (most recent call last):
    ValueError: row 2 has 1 cell(s), the header 2
    """
    import csv
    import io

    lines = list(csv.reader(io.StringIO(text, newline="")))
    if not lines or not any(c.strip() for c in lines[0]):
        raise ValueError("no header line")
    header = lines[0]
    if len(set(header)) != len(header):
        raise ValueError(f"the header repeats a column: {header}")
    rows = []
    for i, cells in enumerate(lines[1:], 1):
        if not cells:  # a blank line
            continue
        if len(cells) != len(header):
            raise ValueError(f"row {i} has {len(cells)} cell(s), the header {len(header)}")
        rows.append(dict(zip(header, cells)))
    return rows


def code_text(source: str) -> str:
    """What a piece of Python source computes, without its comments, docstrings and layout: the text a cache key
    hashes, so that rewording a docstring or a comment leaves every cached result valid.

    The source is parsed and dumped again (``ast.dump``) with every docstring (a string constant standing
    alone as the first statement of a module, class or function) removed; comments and formatting never
    reach the tree.

    >>> a = code_text('def f(x):\\n    "Doc."\\n    return x + 1  # one')
    >>> a == code_text("def f(x):\\n    return (x + 1)"), a == code_text("def f(x):\\n    return x + 2")
    (True, False)

    The answer for a given text is kept for the process (parsing a module is most of a cache key's cost, and
    one notebook computes the same key many times); the text itself is the memo's key, so an edited file is
    parsed again.
    """
    return _code_text(source)


@functools.lru_cache(maxsize=512)
def _code_text(source: str) -> str:
    import ast
    import textwrap

    tree = ast.parse(textwrap.dedent(source))
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            node.body = body[1:] or [ast.Pass()]
    return ast.dump(tree, include_attributes=False)


def code_digest(paths, digest_size: int = 8) -> str:
    """blake2b of the :func:`code_text` of the Python files ``paths``, in the order given (each file's name
    included): the code part of a cache key."""
    h = hashlib.blake2b(digest_size=digest_size)
    for p in paths:
        p = Path(p)
        h.update(p.name.encode())
        h.update(code_text(p.read_text()).encode())
    return h.hexdigest()


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


def _cpu_jiffies() -> tuple[int, int] | None:
    """``(busy, total)`` clock ticks of all cores since boot, from ``/proc/stat``'s ``cpu`` line; None off Linux.

    busy = user + nice + system + irq + softirq + steal (guest time is already inside user);
    total = busy + idle + iowait.
    """
    try:
        line = Path("/proc/stat").read_text().splitlines()[0].split()
        user, nice, system, idle, iowait, irq, softirq, steal = (int(v) for v in line[1:9])
    except (OSError, ValueError, IndexError):
        return None
    busy = user + nice + system + irq + softirq + steal
    return busy, busy + idle + iowait


def _own_cpu_seconds() -> float:
    """CPU seconds of this process (every thread) and of its children it has waited for."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


class OtherLoad:
    """How much of the machine other processes used while the block ran (was a timing taken on idle cores?).

    ``share`` = (the cores' busy seconds over the block - this process's own CPU seconds) /
    (the cores' wall seconds): 0 on an otherwise idle machine, 0.5 when another process kept one of
    two cores busy, 1 when other work filled every core. Own work never counts, however many threads
    it uses (``os.times`` includes them), nor the children it waited for inside the block. ``None``
    where ``/proc/stat`` cannot be read, or the block was too short to see (under one clock tick).

    >>> with OtherLoad() as load:
    ...     _ = sum(range(10))
    >>> load.share is None or 0.0 <= load.share <= 1.0
    True
    """

    def __init__(self) -> None:
        self.share: float | None = None

    def __enter__(self) -> "OtherLoad":
        self._start = (_cpu_jiffies(), _own_cpu_seconds())
        return self

    def __exit__(self, *exc) -> None:
        (before, own0), after, own1 = self._start, _cpu_jiffies(), _own_cpu_seconds()
        if before is None or after is None or after[1] <= before[1]:
            return
        tick = os.sysconf("SC_CLK_TCK")
        busy, total = (after[0] - before[0]) / tick, (after[1] - before[1]) / tick
        self.share = min(1.0, max(0.0, (busy - (own1 - own0)) / total))


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
