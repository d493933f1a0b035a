"""Save and reload compressed models as Hugging Face folders (safetensors, no remote code).

Two forms, both written by :func:`save_compressed`:

* **factorised** (default): what ``save_pretrained`` writes, with each factorised layer
  ``x`` stored as ``x.first.weight`` (``W_1``, ``r x m``) and ``x.second.weight`` /
  ``x.second.bias`` (``W_2``, ``n x r``), so the folder is as small as the model. Plain
  ``transformers`` cannot build ``LowRankLinear`` layers and would initialise them at
  random, so ``config.json`` names the model type ``fisherkron-compressed ...``: plain
  ``AutoModel*.from_pretrained`` refuses the folder with a message that names
  :func:`load_compressed`, which restores the real model type and rebuilds the layers.
* **merged** (``merged=True``): each ``W_2 W_1`` multiplied back into a dense weight, a
  plain Hugging Face folder any tool loads correctly (no parameter saving on disk).

Beside them, ``fisherkron.json`` (the manifest) records the method, every factorised layer
(``n``, ``m``, ``r``, bias), the compression report, provenance, and the size and checksum
of every file the package wrote.

What is guaranteed (tests/test_saving_safety.py):

* **A save works in any writable folder, a mount point included, and is all or nothing.**
  Every file is written into a temporary folder *inside* the target (``.fisherkron-tmp-
  <pid>-save-*``: same file system, so no folder is ever renamed onto the target or across
  its parent), fsynced, then moved into place one by one, each file of the earlier save
  with the same name kept aside; replacing ``fisherkron.json`` (one ``os.replace`` within
  the folder) is the commit: before it the folder's manifest is the earlier save's, after
  it the new one's. Only then are the earlier save's files the new manifest does not list
  deleted. An error at any step (a full disk, a failing rename, an interrupt) puts the
  earlier save back bit for bit before the error is raised; a process killed mid-save
  leaves the temporary folder with a journal, from which the next :func:`save_compressed`
  or :func:`load_compressed` of that folder restores the earlier save (or finishes the new
  one, had its manifest been committed). A running save holds a lock in its temporary
  folder, so a second save into the same folder is refused while it runs, and a dead one's
  leftovers are recognised however its process id was reused.
* **Nothing the package did not write is replaced or deleted.** Saving onto an earlier save
  needs ``overwrite=True`` and replaces or removes only files its ``fisherkron.json`` lists.
  A file of the user's under a name a model folder uses (:data:`MODEL_FILES`, e.g. a
  ``tokenizer_config.json`` beside a save made without a tokenizer) is refused before any
  work, in one line naming it; one the new save turns out to write is refused the same way
  before the folder is touched. Other files of the user's stay.
* **Nothing is read back unverified.** :func:`load_compressed` checks the manifest's fields
  (types, layer names and shapes against the architecture, plain file names), then every
  listed file's size and checksum, before anything is built, and reads only the files the
  manifest lists: another ``.safetensors`` or tokenizer file in the folder is ignored (with
  a warning), never loaded over a saved tensor.
* **Errors are one line** (:class:`~fisherkron.core.conventions.FisherkronError`): a target
  that is a file, is not writable (tested by writing a file), lacks the free space the new
  save needs beside the earlier one, or is being saved into by a running process; a model
  without ``save_pretrained``; a hand-edited or damaged ``fisherkron.json``; an ``OSError``
  while writing.
"""
from __future__ import annotations

import errno
import fnmatch
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from ..core.conventions import FisherkronError
from ..core.basis_sharing import SharedBasisLinear
from ..core.lowrank import LowRankLinear
from ..env import TMP_PREFIX, file_checksum, stale_temporaries, temporary_name

try:
    import fcntl
except ImportError:  # Windows: a save's liveness falls back to its process id
    fcntl = None

__all__ = ["save_compressed", "load_compressed", "merge_lowrank", "check_destination", "check_free_space",
           "MANIFEST", "FORMAT", "MODEL_FILES"]

log = logging.getLogger(__name__)

MANIFEST = "fisherkron.json"
FORMAT = "fisherkron-lowrank/2"
#: ``model_type`` written into ``config.json`` of a factorised folder: transformers shows it in its refusal.
MODEL_TYPE = "fisherkron-compressed (load this folder with fisherkron.load_compressed)"
_REAL_TYPE = "fisherkron_model_type"

#: Names a save (``save_pretrained`` of a model or tokenizer) may write, or a tool loading a model
#: folder may read: a user's file under such a name is refused by an overwrite, never replaced.
MODEL_FILES = ("config.json", "generation_config.json", "*.safetensors", "*.safetensors.index.json",
               "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
               "vocab.json", "vocab.txt", "merges.txt", "*.model", "*.tiktoken", "chat_template.jinja",
               "chat_template.json", "preprocessor_config.json", "processor_config.json")
#: Entries of a fresh file system's root (a mount point) that do not make a folder non-empty.
_SYSTEM_ENTRIES = ("lost+found",)
#: Free space the small files (configs, manifest) may take beyond the weights.
_SMALL_FILES = 1 << 16
# the layout of a save's temporary folder: the lock a running save holds, the new files, the
# earlier save's files moved aside, and the journal that says how to finish or undo the swap
_STAGE, _LOCK, _NEW, _OLD, _JOURNAL = "save", "lock", "new", "old", "journal.json"


# ----------------------------------------------------------------------------- the manifest

def _read_manifest(d: Path) -> dict:
    try:
        meta = json.loads((d / MANIFEST).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FisherkronError(f"{d / MANIFEST} is unreadable ({type(exc).__name__}: {exc}); "
                              f"the folder is damaged: save the model again") from None
    if not isinstance(meta, dict):
        raise FisherkronError(f"{d / MANIFEST} is not a fisherkron manifest (a JSON object was expected)")
    return meta


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _plain_name(name) -> bool:
    """A file name directly in the folder: no path, not the manifest, not a temporary."""
    return (isinstance(name, str) and name not in ("", ".", "..", MANIFEST) and not name.startswith(TMP_PREFIX)
            and not any(c in name for c in "/\\\0"))


def _manifest_files(d: Path, meta: dict) -> dict[str, dict]:
    """``meta["files"]`` checked: plain names, each with an integer size and a blake2b checksum."""
    files = meta.get("files")
    if not isinstance(files, dict) or not files:
        raise _edited(d, "'files'", f"is {'missing' if files is None else repr(files)[:40]} "
                                    f"(an object naming every file of the save was expected)")
    for name, spec in files.items():
        if not _plain_name(name):
            raise _edited(d, f"files[{name!r}]", "is not the name of a file in the folder")
        if (not isinstance(spec, dict) or not _is_int(spec.get("size")) or spec["size"] < 0
                or not isinstance(spec.get("blake2b"), str)):
            raise _edited(d, f"files[{name!r}]", "needs a size (an integer) and a blake2b checksum (a string)")
    return files


def _edited(d: Path, field: str, what: str) -> FisherkronError:
    return FisherkronError(f"{d / MANIFEST}: {field} {what}; the manifest was edited or damaged: "
                           f"save the model again")


def _check_manifest(d: Path, meta: dict) -> dict:
    """Every field :func:`load_compressed` uses, checked for presence, type and sense."""
    if meta.get("format") != FORMAT:
        raise FisherkronError(f"{d}/{MANIFEST} has format {meta.get('format')!r}, expected {FORMAT!r}; "
                              f"save the model again with this version of fisherkron")
    files = _manifest_files(d, meta)
    if "config.json" not in files:
        raise _edited(d, "'files'", "does not list config.json")
    if not any(name.endswith(".safetensors") for name in files):
        raise _edited(d, "'files'", "lists no .safetensors file")
    form = meta.get("form", "factorised")
    if form not in ("factorised", "merged"):
        raise _edited(d, "'form'", f"is {form!r} (factorised or merged was expected)")
    if not isinstance(meta.get("architecture", ""), str):
        raise _edited(d, "'architecture'", f"is {meta['architecture']!r} (a class name was expected)")
    layers = meta.get("layers")
    if not isinstance(layers, dict):
        raise _edited(d, "'layers'", f"is {repr(layers)[:40]} (an object naming each factorised layer was expected)")
    for name, spec in layers.items():
        if not isinstance(spec, dict):
            raise _edited(d, f"layers[{name!r}]", "is not an object with n, m, rank and bias")
        for key in ("n", "m", "rank"):
            if not _is_int(spec.get(key)) or spec[key] < 1:
                raise _edited(d, f"layers[{name!r}].{key}", f"is {spec.get(key)!r} (a positive integer was expected)")
        if not isinstance(spec.get("bias"), bool):
            raise _edited(d, f"layers[{name!r}].bias", f"is {spec.get('bias')!r} (true or false was expected)")
    return meta


# ----------------------------------------------------------------------------- the target folder

def _is_model_file(name: str) -> bool:
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in MODEL_FILES)


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


def check_destination(directory, *, overwrite: bool = False) -> Path:
    """Where :func:`save_compressed` may write, checked before any work; raises a one-line error.

    Allowed: a new or empty folder (a mount point's ``lost+found`` does not count), or an
    earlier fisherkron save with ``overwrite=True`` whose other files (the user's) have no
    name a save or a model loader uses (:data:`MODEL_FILES`). The folder (or the nearest
    existing parent) must be writable, which is tested by writing a file. A save interrupted
    by a killed process is finished or undone first (see the module docstring); a running
    save into the same folder is refused.
    """
    out = Path(directory)
    if out.exists() and not out.is_dir():
        raise FisherkronError(f"{out} is a file, not a folder; choose a folder to save the model in")
    _probe_writable(out)
    if not out.is_dir():
        return out
    _settle_interrupted(out)
    entries = [p.name for p in out.iterdir()
               if p.name not in _SYSTEM_ENTRIES and not p.name.startswith(TMP_PREFIX)]
    if not entries:
        return out
    if MANIFEST not in entries:
        raise FisherkronError(f"{out} is not a fisherkron folder (it holds files fisherkron did not write); "
                              f"choose a new or empty folder")
    if not overwrite:
        raise FisherkronError(f"{out} already holds a fisherkron save; pass overwrite=True (--overwrite) "
                              f"to replace the files fisherkron wrote there (other files are kept)")
    ours = _earlier_files(out)
    clash = sorted(n for n in entries if n != MANIFEST and n not in ours and _is_model_file(n))
    if clash:
        raise _users_files(out, clash)
    return out


def _earlier_files(out: Path) -> dict[str, dict]:
    """The files an earlier save in ``out`` wrote, from its manifest; refuses one it cannot tell from the user's."""
    try:
        return _manifest_files(out, _read_manifest(out))
    except FisherkronError as err:
        raise FisherkronError(f"{out} cannot be overwritten safely ({str(err).split('; ')[0]}): fisherkron cannot "
                              f"tell the files it wrote from yours; move what you want to keep elsewhere, empty "
                              f"the folder and save again") from None


def _users_files(out: Path, names: list[str]) -> FisherkronError:
    shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    return FisherkronError(f"{out} holds {shown}, which fisherkron did not write, under names a saved model uses "
                           f"(the save would replace them, and tools loading the folder would read them); "
                           f"move them out of the folder or choose another folder, then save again")


def _saved_bytes(model: nn.Module, *, merged: bool = False) -> int:
    """About how many bytes :func:`save_compressed` writes for ``model``: its tensors, shared ones once."""
    seen = {}
    for t in model.state_dict().values():
        seen[(t.data_ptr(), t.dtype, tuple(t.shape))] = t.numel() * t.element_size()
    total = sum(seen.values())
    if merged:  # W_2 W_1 (n x m) instead of W_1 (r x m, a shared one once) and W_2 (n x r)
        bases = set()
        for mod in model.modules():
            if isinstance(mod, (LowRankLinear, SharedBasisLinear)):
                n, m, r = mod.out_features, mod.in_features, mod.rank
                once = id(mod.first) not in bases
                bases.add(id(mod.first))
                total += (n * m - r * n - (r * m if once else 0)) * mod.first.weight.element_size()
    return total


def _size(n: float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def check_free_space(directory, need: int) -> None:
    """One-line error unless the file system of ``directory`` has ``need`` bytes (plus the small files) free.

    An overwrite keeps the earlier save until the new one is complete, so the new save needs
    its whole size free beside it.
    """
    p = _nearest_existing(Path(directory))
    try:
        free = shutil.disk_usage(p).free
    except OSError:  # unknowable here: the save reports a full disk if it meets one
        return
    if free < need + _SMALL_FILES:
        earlier = (Path(directory) / MANIFEST).exists()
        kept = " (the earlier save there is kept until the new one is complete)" if earlier else ""
        raise FisherkronError(f"{directory} has {_size(free)} free, but the save needs about "
                              f"{_size(need + _SMALL_FILES)}{kept}; free some space or choose another folder")


# ----------------------------------------------------------------------------- saving

def _layer_specs(model: nn.Module) -> dict:
    """``{name: {n, m, rank, bias}}`` of every factorised layer; a ``SharedBasisLinear`` also names its
    group's ``basis``: the first layer (in module order) holding the shared ``first``, where it is stored."""
    layers, owner = {}, {}
    for name, mod in model.named_modules():
        if isinstance(mod, (LowRankLinear, SharedBasisLinear)):
            layers[name] = {"n": mod.out_features, "m": mod.in_features, "rank": mod.rank,
                            "bias": mod.second.bias is not None}
            if isinstance(mod, SharedBasisLinear):
                layers[name]["basis"] = owner.setdefault(id(mod.first), name)
    return layers


def _shared_once(model: nn.Module, layers: dict) -> dict:
    """The state dict with each shared basis once (under its owner): safetensors stores no aliases."""
    state = model.state_dict()
    for name, spec in layers.items():
        if spec.get("basis", name) != name:
            del state[f"{name}.first.weight"]
    return state


def merge_lowrank(model: nn.Module) -> nn.Module:
    """Replace every ``LowRankLinear`` of ``model`` (in place) by a dense ``nn.Linear`` with ``W = W_2 W_1``."""
    for name, mod in list(model.named_modules()):
        if isinstance(mod, (LowRankLinear, SharedBasisLinear)):
            W = mod.second.weight @ mod.first.weight  # (n, r) @ (r, m)
            lin = nn.Linear(mod.in_features, mod.out_features, bias=mod.second.bias is not None,
                            device=W.device, dtype=W.dtype)
            with torch.no_grad():
                lin.weight.copy_(W)
                if mod.second.bias is not None:
                    lin.bias.copy_(mod.second.bias)
            model.set_submodule(name, lin)
    return model


def save_compressed(model: nn.Module, directory, *, report=None, tokenizer=None,
                    provenance: dict | None = None, overwrite: bool = False, merged: bool = False) -> Path:
    """Write ``model`` (with its ``LowRankLinear`` layers) to ``directory``; all or nothing.

    Args:
        model: a Hugging Face model (with ``save_pretrained``), compressed by :func:`fisherkron.compress`.
        directory: a new or empty folder (a mount point too), or an earlier save (with ``overwrite=True``).
        report: the :class:`~fisherkron.CompressionReport`, stored in ``fisherkron.json``.
        tokenizer: saved beside the model when given.
        provenance: anything else worth recording.
        overwrite: replace an earlier fisherkron save in ``directory``. Only the files its
            ``fisherkron.json`` lists are replaced or removed; a file of the user's under a
            name the new save writes (or a model loader reads, :data:`MODEL_FILES`) is
            refused in one line naming it, and other files of the user's are kept.
        merged: write the dense form (``W_2 W_1`` multiplied out; ``model`` itself is not
            changed), which plain transformers loads; default: the factorised form.

    Guarantees: the destination is checked (writable, free space, whose files) before
    anything is written; the files are written into a temporary folder inside
    ``directory`` and the swap of ``fisherkron.json`` commits them, so an error at any step
    leaves the earlier save (or the empty folder) exactly as it was, and a killed process
    leaves a journal from which the next save or load restores it. An ``OSError`` (a full
    disk, a read-only folder) is raised as a one-line ``FisherkronError``.
    """
    from .._version import __version__

    if not isinstance(model, nn.Module) or not callable(getattr(model, "save_pretrained", None)):
        raise FisherkronError(f"save_compressed writes Hugging Face models (a transformers PreTrainedModel, which "
                              f"has save_pretrained); got {type(model).__name__}: save it with torch.save instead")
    if tokenizer is not None and not callable(getattr(tokenizer, "save_pretrained", None)):
        raise FisherkronError(f"tokenizer must be a Hugging Face tokenizer (with save_pretrained); "
                              f"got {type(tokenizer).__name__}")
    out = check_destination(directory, overwrite=overwrite)
    check_free_space(out, _saved_bytes(model, merged=merged))
    layers = _layer_specs(model)
    meta = {"format": FORMAT, "fisherkron_version": __version__, "architecture": type(model).__name__,
            "form": "merged" if merged else "factorised",
            "method": getattr(report, "method", None), "layers": layers,
            "report": report.to_dict() if hasattr(report, "to_dict") else report,
            "provenance": {"saved": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **(provenance or {})}}

    def write(folder: Path) -> None:
        if merged:
            import copy
            merge_lowrank(copy.deepcopy(model)).save_pretrained(folder, safe_serialization=True)
        else:
            model.save_pretrained(folder, state_dict=_shared_once(model, layers), safe_serialization=True)
            cfg_path = folder / "config.json"
            cfg = json.loads(cfg_path.read_text())
            cfg[_REAL_TYPE], cfg["model_type"] = cfg.get("model_type"), MODEL_TYPE
            cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        if tokenizer is not None:
            tokenizer.save_pretrained(folder)
        odd = [f.name for f in folder.iterdir() if not f.is_file() or f.is_symlink()]
        if odd:
            raise FisherkronError(f"saving wrote {odd[0]}, which is not a plain file; fisherkron saves flat "
                                  f"folders of files only")
        meta["files"] = {f.name: {"size": f.stat().st_size, "blake2b": file_checksum(f)}
                         for f in sorted(folder.iterdir())}
        (folder / MANIFEST).write_text(json.dumps(meta, indent=1, default=str))

    from safetensors import SafetensorError

    created = not out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
        _swap_in(out, write)
    except (OSError, SafetensorError) as exc:
        what = "nothing was saved" if created else "the folder is as it was before"
        raise FisherkronError(f"saving to {out} failed ({_reason(exc)}); {what}") from None
    finally:
        if created and out.is_dir() and not any(out.iterdir()):
            try:
                out.rmdir()
            except OSError:
                pass
    return out


def _reason(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror + (f": {exc.filename}" if exc.filename else "")
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


def _swap_in(out: Path, write: Callable[[Path], None]) -> None:
    """Write a save with ``write(folder)`` and make it ``out``'s, with ``fisherkron.json``'s rename as the commit.

    ``out`` holds nothing (or a save whose manifest lists its files). Every step before the
    commit is undone on an error; a crash is undone (or finished) from the journal by
    :func:`_settle_interrupted`.
    """
    earlier = _earlier_files(out) if (out / MANIFEST).exists() else {}
    stage = Path(tempfile.mkdtemp(prefix=temporary_name(_STAGE), dir=out))
    lock, committed, settled = None, False, False
    try:
        lock = _hold_lock(stage / _LOCK)
        new, old = stage / _NEW, stage / _OLD
        new.mkdir()
        old.mkdir()
        write(new)
        names = sorted(f.name for f in new.iterdir() if f.name != MANIFEST)
        clash = [n for n in names if os.path.lexists(out / n) and (n not in earlier or (out / n).is_dir())]
        if clash:
            raise _users_files(out, clash)
        for f in new.iterdir():
            _fsync(f)
        journal = {"old_manifest": file_checksum(out / MANIFEST) if earlier else None,
                   "new_manifest": file_checksum(new / MANIFEST), "names": names,
                   "existed": [n for n in names if (out / n).exists()],
                   "remove": sorted(n for n in earlier if n not in names)}
        try:
            _write_journal(stage, journal)
            for n in names:
                if n in journal["existed"]:
                    os.replace(out / n, old / n)  # the earlier save's file, kept aside until the commit
                os.replace(new / n, out / n)
            _fsync(out)
            os.replace(new / MANIFEST, out / MANIFEST)  # the commit: from here on the folder is the new save
        except BaseException:
            _settle(out, stage, journal)  # undo (or finish, had the commit gone through)
            settled = True
            raise
        committed = True
        try:
            _fsync(out)
            _settle(out, stage, journal)  # remove the files the new manifest does not list
            settled = True
        except OSError as exc:  # the new save is complete; the next save or load of it finishes the clean-up
            log.warning("%s is saved, but cleaning up failed (%s); the next save or load of it finishes that",
                        out, _reason(exc))
    except BaseException as exc:
        if not committed and not settled:
            if (stage / _JOURNAL).exists():  # undoing failed: the earlier save's files are in the stage
                raise FisherkronError(f"saving to {out} failed ({_reason(exc)}) and the earlier save could not be "
                                      f"put back yet: it is kept in {stage.name}, and the next save_compressed or "
                                      f"load_compressed of {out} restores it") from None
            settled = True  # nothing was moved: the stage holds only new files
        raise
    finally:
        _release_lock(lock)
        if settled:
            shutil.rmtree(stage, ignore_errors=True)


def _settle(out: Path, stage: Path, journal: dict) -> None:
    """Finish a swap whose commit went through, or undo one whose did not; then drop ``stage``."""
    cur = file_checksum(out / MANIFEST) if (out / MANIFEST).is_file() else None
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
        raise FisherkronError(f"{stage} holds an interrupted save of {out}, whose {MANIFEST} has changed since; "
                              f"compare them, keep what you need and delete {stage.name}")
    # the journal goes before the lock: a half-removed stage is still recognised, and settled again, as a dead save's
    for sub in (_NEW, _OLD):
        if (stage / sub).exists():
            shutil.rmtree(stage / sub)
    for name in (_JOURNAL + ".tmp", _JOURNAL, _LOCK):
        (stage / name).unlink(missing_ok=True)
    stage.rmdir()


def _settle_interrupted(out: Path, *, loading: bool = False) -> None:
    """Finish or undo every save into ``out`` that a killed process left; refuse a running one.

    A save runs while it holds the lock in its temporary folder (the kernel releases it when
    the process dies, so a reused process id cannot keep it); where locks are unavailable,
    while its process lives (:func:`fisherkron.env.stale_temporaries`). Loading leaves a
    save that is still writing its files alone (the earlier save is intact meanwhile) and
    refuses one that is swapping them in.
    """
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
                _settle(out, p, json.loads(journal.read_text()))
                log.warning("%s: the save that process %s left unfinished was finished or undone; the folder "
                            "holds the last complete save", out, _pid_of(p))
            else:
                shutil.rmtree(p)
        except FisherkronError:
            raise
        except (OSError, ValueError, KeyError, TypeError) as exc:
            if journal.exists():
                raise FisherkronError(f"an interrupted save left {p} ({_reason(exc)}); open {out} once with "
                                      f"write access (save_compressed or load_compressed restores the earlier "
                                      f"save from it)") from None


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


# ----------------------------------------------------------------------------- loading

def verify_files(d: Path, meta: dict, *, checksums: bool = True) -> None:
    """Check every file listed in ``meta["files"]`` for presence, size and (by default) checksum; one-line error."""
    for name, want in _manifest_files(d, meta).items():
        f = d / name
        if not f.is_file():
            raise FisherkronError(f"{f} is missing; the folder is incomplete: save the model again")
        size = f.stat().st_size
        if size != want["size"]:
            raise FisherkronError(f"{f} has {size} bytes, {want['size']} were saved: the file is "
                                  f"truncated or was replaced; save the model again")
        if checksums and file_checksum(f) != want["blake2b"]:
            raise FisherkronError(f"{f} does not match the checksum recorded when it was saved: the file was "
                                  f"changed or corrupted; save the model again")


def _place_layers(d: Path, model: nn.Module, layers: dict) -> None:
    """Rebuild each factorised layer the manifest names, where the architecture has a matching ``nn.Linear``."""
    firsts: dict[str, nn.Linear] = {}
    for name, spec in layers.items():
        try:
            lin = model.get_submodule(name)
        except AttributeError:
            lin = None
        if not isinstance(lin, nn.Linear):
            raise _edited(d, f"layers[{name!r}]", f"names no linear layer of {type(model).__name__}")
        if (lin.out_features, lin.in_features) != (spec["n"], spec["m"]):
            raise _edited(d, f"layers[{name!r}]", f"records n={spec['n']}, m={spec['m']}, but the layer is "
                                                  f"{lin.out_features} x {lin.in_features}")
        owner = spec.get("basis")
        if owner is not None:  # a shared basis: one nn.Linear for the group, built at its owner
            own = layers.get(owner) if isinstance(owner, str) else None
            if own is None or own.get("basis") != owner or (own["m"], own["rank"]) != (spec["m"], spec["rank"]):
                raise _edited(d, f"layers[{name!r}].basis", f"is {owner!r}, not a layer holding an "
                                                            f"{spec['rank']} x {spec['m']} shared basis")
            if spec["rank"] > spec["m"]:
                raise _edited(d, f"layers[{name!r}].rank", f"is {spec['rank']}, above m={spec['m']}")
            first = firsts.setdefault(owner, nn.Linear(spec["m"], spec["rank"], bias=False))
            model.set_submodule(name, SharedBasisLinear(first, spec["n"], bias=spec["bias"]))
            continue
        if spec["rank"] > min(spec["n"], spec["m"]):
            raise _edited(d, f"layers[{name!r}].rank",
                          f"is {spec['rank']}, above min(n, m)={min(spec['n'], spec['m'])}")
        model.set_submodule(name, LowRankLinear(spec["m"], spec["n"], spec["rank"], bias=spec["bias"]))


def load_compressed(directory, *, dtype: torch.dtype | None = None, return_tokenizer: bool = False,
                    verify: bool = True):
    """Rebuild a model saved by :func:`save_compressed`, with its low-rank layers.

    Args:
        directory: the folder.
        dtype: parameter dtype (default: the saved one).
        return_tokenizer: also return the tokenizer (``None`` if none was saved).
        verify: check every file's checksum first (default; the cost is one read). Presence
            and sizes are always checked.

    Only files the manifest lists are read: another ``.safetensors`` or tokenizer file in the
    folder is ignored (with a warning), never loaded over a saved tensor. A hand-edited or
    damaged manifest, a file that does not match it, or weights that do not fit the
    architecture are each a one-line ``FisherkronError``. A save that a killed process left
    half-done is first finished or undone (this needs write access to the folder).

    Returns the model in ``eval()`` mode (and its tokenizer with ``return_tokenizer=True``).
    """
    import transformers
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    d = Path(directory)
    if not d.is_dir():
        raise FisherkronError(f"{d} is not a folder")
    _settle_interrupted(d, loading=True)
    if not (d / MANIFEST).exists():
        raise FisherkronError(f"{d} has no {MANIFEST}; it was not written (completely) by "
                              f"fisherkron.save_compressed")
    meta = _check_manifest(d, _read_manifest(d))
    listed = meta["files"]
    verify_files(d, meta, checksums=verify)
    ignored = sorted(p.name for p in d.iterdir() if p.is_file() and p.name != MANIFEST
                     and p.name not in listed and _is_model_file(p.name))
    if ignored:
        log.warning("%s: ignoring %s, which fisherkron did not save there (not in %s)", d, ", ".join(ignored),
                    MANIFEST)
    try:
        cfg = json.loads((d / "config.json").read_text())
        if not isinstance(cfg, dict):
            raise TypeError("a JSON object was expected")
        if cfg.get("model_type") == MODEL_TYPE:
            cfg["model_type"] = cfg.pop(_REAL_TYPE)
        config = transformers.AutoConfig.for_model(**cfg)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise FisherkronError(f"{d}/config.json cannot be read as a transformers config "
                              f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})") from None
    arch = (getattr(config, "architectures", None) or [meta.get("architecture")])[0]
    cls = getattr(transformers, arch, None) if isinstance(arch, str) else None
    if cls is None:
        raise FisherkronError(f"architecture {arch} of {d} is not in this transformers version")
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # older transformers
        from transformers.modeling_utils import no_init_weights
    with no_init_weights():
        model = cls(config)
    if meta.get("form", "factorised") == "factorised":
        _place_layers(d, model, meta["layers"])
    state = {}
    for name in sorted(n for n in listed if n.endswith(".safetensors")):
        try:
            part = load_file(str(d / name))
        except (SafetensorError, OSError, ValueError) as exc:
            raise FisherkronError(f"{d / name} is not a readable safetensors file ({exc}); "
                                  f"save the model again") from None
        twice = next((k for k in part if k in state), None)
        if twice is not None:
            raise FisherkronError(f"{d}: tensor {twice} is stored in two files; save the model again")
        state.update(part)
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    wrong = next((k for k, v in state.items() if k in shapes and v.shape != shapes[k]), None)
    if wrong is not None:
        raise FisherkronError(f"{d}: {wrong} is saved as {tuple(state[wrong].shape)} but the architecture (with "
                              f"the layers {MANIFEST} records) needs {tuple(shapes[wrong])}; the manifest was "
                              f"edited or the weights replaced: save the model again")
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = set()
    if getattr(config, "tie_word_embeddings", False):
        tied = {k for k in missing if k.endswith("lm_head.weight") or k.endswith("decoder.weight")}
    shared = {f"{n}.first.weight" for n, spec in meta["layers"].items() if spec.get("basis", n) != n}
    bad = [k for k in missing if k not in tied and k not in shared]
    if bad or unexpected:
        what = f"missing {bad[0]}" if bad else f"unexpected {unexpected[0]}"
        raise FisherkronError(f"{d}: weights do not fit the architecture ({what}; "
                              f"{len(bad)} missing, {len(unexpected)} unexpected)")
    if tied:
        model.tie_weights()
    target = dtype or getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(target, str):
        target = getattr(torch, target)
    if isinstance(target, torch.dtype):
        model.to(target)
    model.eval()
    if return_tokenizer:
        return model, _load_tokenizer(d, listed, config) if "tokenizer_config.json" in listed else None
    return model


def _load_tokenizer(d: Path, listed: dict, config):
    """The saved tokenizer, read from a private copy of the listed (verified) files only."""
    import transformers

    with tempfile.TemporaryDirectory(prefix=temporary_name("tokenizer")) as tmp:
        for name in listed:
            if not name.endswith(".safetensors"):
                shutil.copyfile(d / name, Path(tmp) / name)
        try:
            return transformers.AutoTokenizer.from_pretrained(tmp, config=config)
        except (OSError, ValueError) as exc:
            raise FisherkronError(f"the tokenizer in {d} cannot be loaded ({exc})") from None
