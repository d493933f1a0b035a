"""Save and reload compressed models as Hugging Face folders (safetensors, no remote code).

Two forms, both written by :func:`save_compressed`:

* **factorised** (default): what ``save_pretrained`` writes, with each factorised layer
  ``x`` stored as ``x.first.weight`` (``W_1``, ``r x m``) and ``x.second.weight`` /
  ``x.second.bias`` (``W_2``, ``n x r``), so the folder is as small as the model. Plain
  ``transformers`` cannot build ``LowRankLinear`` layers and would initialise them at
  random, so ``config.json`` names the model type ``fisherkron-compressed ...``: plain
  ``AutoModel*.from_pretrained`` refuses the folder with a message that names
  :func:`load_compressed`, which restores the real model type and rebuilds the layers. A
  ``SharedBasisLinear`` group stores its shared ``W_1`` once, under its first layer.
* **merged** (``merged=True``): each ``W_2 W_1`` multiplied back into a dense weight, a
  plain Hugging Face folder any tool loads correctly (no parameter saving on disk).

Beside them, ``fisherkron.json`` (the manifest) records the method, every factorised layer
(``n``, ``m``, ``r``, bias, the owner of a shared basis), the dtype the weights were written
in, the compression report, provenance, and the size, checksum and modification time of
every file the package wrote.

What is guaranteed (tests/test_saving_safety.py):

* **A save is all or nothing, in any writable folder (a mount point too).** The files are
  replaced by :mod:`fisherkron.hf.transaction`: written into a temporary folder inside the
  target, moved in with the earlier save's files set aside, committed by replacing
  ``fisherkron.json``; an error puts the earlier save back bit for bit, and a save a killed
  process left is finished or undone by the next :func:`save_compressed` or
  :func:`load_compressed` of that folder. The files get the permissions the umask gives.
* **Nothing the package did not write is replaced or deleted.** Saving onto an earlier save
  needs ``overwrite=True`` and replaces or removes only files its ``fisherkron.json`` lists.
  A file of the user's under a name a model folder uses (:data:`MODEL_FILES`, e.g. a
  ``tokenizer_config.json`` beside a save made without a tokenizer) is refused before any
  work, in one line naming it; one the new save turns out to write is refused the same way
  before the folder is touched. Other files of the user's stay.
* **A file the user edited since the earlier save is refused, not replaced.** One the
  earlier save wrote whose checksum no longer matches its manifest's (a
  ``generation_config.json`` given a temperature) makes the overwrite fail in one line that
  names it, before any work and again just before the files are swapped; pass
  ``overwrite_edited=True`` (``--overwrite-edited``) to replace it anyway.
* **The weights keep their dtype.** The files hold the dtype ``dtype=`` names (default: the
  model's own), recorded in the manifest and ``config.json``; a value that float16 cannot
  hold is refused rather than written as ``inf``.
* **SIGTERM is handled like Ctrl-C.** Either stops the save while it writes its files and
  removes the temporary folder; while files are swapped in, the signal waits until the
  folder is whole (see :mod:`fisherkron.hf.transaction`). Only a process killed outright
  (SIGKILL, a power cut) leaves a temporary folder, which the next save or load settles.
* **Nothing is read back unverified.** :func:`load_compressed` checks the manifest's fields
  (types, layer names and shapes against the architecture, plain file names), then every
  listed file's size and checksum, before anything is built, and reads only the files the
  manifest lists: another ``.safetensors`` or tokenizer file in the folder is ignored (with
  a warning), never loaded over a saved tensor.
* **Errors are one line** (:class:`~fisherkron.core.errors.FisherkronError`): a target
  that is a file, is not writable (tested by writing a file), lacks the free space the new
  save needs beside the earlier one, or is being saved into by a running process; a model
  without ``save_pretrained``; a hand-edited or damaged ``fisherkron.json``; an ``OSError``
  while writing.
"""
from __future__ import annotations

import fnmatch
import json
import logging
import shutil
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from ..core.conventions import FisherkronError
from ..core.basis_sharing import SharedBasisLinear
from ..core.lowrank import LowRankLinear
from ..env import TMP_PREFIX, file_checksum, temporary_name
from . import transaction

__all__ = ["save_compressed", "load_compressed", "merge_lowrank", "check_destination", "check_free_space",
           "save_dtype", "MANIFEST", "FORMAT", "MODEL_FILES", "SAVE_DTYPES"]

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
#: the dtypes :func:`save_compressed` writes weights in, by name
SAVE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
               "float64": torch.float64}


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


def check_destination(directory, *, overwrite: bool = False, overwrite_edited: bool = False) -> Path:
    """Where :func:`save_compressed` may write, checked before any work; raises a one-line error.

    Allowed: a new or empty folder (a mount point's ``lost+found`` does not count), or an
    earlier fisherkron save with ``overwrite=True`` whose other files (the user's) have no
    name a save or a model loader uses (:data:`MODEL_FILES`), and none of whose own files was
    changed since it was saved (unless ``overwrite_edited=True``). The folder (or the nearest
    existing parent) must be writable, which is tested by writing a file. A save interrupted
    by a killed process is finished or undone first (see :mod:`fisherkron.hf.transaction`);
    a running save into the same folder is refused.
    """
    return transaction.check_destination(directory, MANIFEST, _earlier_files, overwrite=overwrite,
                                         reserved=MODEL_FILES, overwrite_edited=overwrite_edited)


def _earlier_files(out: Path) -> dict[str, dict]:
    """The files an earlier save in ``out`` wrote, from its manifest; refuses one it cannot tell from the user's."""
    try:
        return _manifest_files(out, _read_manifest(out))
    except FisherkronError as err:
        raise FisherkronError(f"{out} cannot be overwritten safely ({str(err).split('; ')[0]}): fisherkron cannot "
                              f"tell the files it wrote from yours; move what you want to keep elsewhere, empty "
                              f"the folder and save again") from None


def save_dtype(dtype) -> torch.dtype | None:
    """``dtype`` (``None``, a name of :data:`SAVE_DTYPES` or a floating torch dtype) as a torch dtype; one-line error."""
    if dtype is None or dtype in SAVE_DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype in SAVE_DTYPES:
        return SAVE_DTYPES[dtype]
    raise FisherkronError(f"dtype {dtype!r} cannot be saved; use one of {', '.join(SAVE_DTYPES)} (or None: the "
                          f"model's own)")


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def _model_dtype(model: nn.Module) -> torch.dtype:
    """The dtype most of ``model``'s floating-point parameters have (by count of values)."""
    count: dict[torch.dtype, int] = {}
    for p in model.parameters():
        if p.is_floating_point():
            count[p.dtype] = count.get(p.dtype, 0) + p.numel()
    return max(count, key=count.get) if count else torch.float32


def _saved_bytes(model: nn.Module, *, merged: bool = False, dtype: torch.dtype | None = None) -> int:
    """About how many bytes :func:`save_compressed` writes for ``model``: its tensors, shared ones once."""
    def size(t):
        return torch.empty((), dtype=dtype).element_size() if dtype is not None and t.is_floating_point() \
            else t.element_size()
    seen = {}
    for t in model.state_dict().values():
        seen[(t.data_ptr(), t.dtype, tuple(t.shape))] = t.numel() * size(t)
    total = sum(seen.values())
    if merged:  # W_2 W_1 (n x m) instead of W_1 (r x m, a shared one once) and W_2 (n x r)
        bases = set()
        for mod in model.modules():
            if isinstance(mod, (LowRankLinear, SharedBasisLinear)):
                n, m, r = mod.out_features, mod.in_features, mod.rank
                once = id(mod.first) not in bases
                bases.add(id(mod.first))
                total += (n * m - r * n - (r * m if once else 0)) * size(mod.first.weight)
    return total


def check_free_space(directory, need: int) -> None:
    """One-line error unless the file system of ``directory`` has ``need`` bytes (plus the small files) free.

    An overwrite keeps the earlier save until the new one is complete, so the new save needs
    its whole size free beside it.
    """
    transaction.check_free_space(directory, need, MANIFEST)


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


def _cast(state: dict, dtype: torch.dtype | None) -> dict:
    """``state`` with its floating-point tensors in ``dtype`` (a tensor held under two names stays one).

    A finite value that ``dtype`` cannot hold (beyond float16's 65504) is refused in one line
    rather than written as ``inf``.
    """
    if dtype is None:
        return state
    out, done = {}, {}
    for k, t in state.items():
        if not t.is_floating_point() or t.dtype == dtype:
            out[k] = t
            continue
        key = (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype)
        if key not in done:
            c = t.to(dtype)
            if not bool(torch.isfinite(c).all()) and bool(torch.isfinite(t).all()):
                big = float(t.abs().max())
                raise FisherkronError(f"{k} holds values up to {big:.3g}, beyond what {dtype_name(dtype)} can "
                                      f"hold (max {torch.finfo(dtype).max:.5g}); save in bfloat16 or float32")
            done[key] = c
        out[k] = done[key]
    return out


def _set_config_dtype(cfg: dict, dtype: torch.dtype | None) -> None:
    """Make ``config.json``'s dtype fields say ``dtype`` (transformers reads ``dtype``, older ones ``torch_dtype``)."""
    if dtype is None:
        return
    cfg["dtype"] = dtype_name(dtype)
    if "torch_dtype" in cfg:
        cfg["torch_dtype"] = dtype_name(dtype)


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
                    provenance: dict | None = None, overwrite: bool = False, merged: bool = False,
                    dtype=None, overwrite_edited: bool = False) -> Path:
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
        dtype: the dtype the weights are written in (``"float32"``, ``"bfloat16"``,
            ``"float16"``, ``"float64"`` or a torch dtype; ``model`` itself is not changed);
            default ``None``: the model's own. A model loaded in float32 from a bfloat16
            checkpoint (as :func:`fisherkron.load_model` does) is saved at the checkpoint's
            size only with ``dtype="bfloat16"`` (the command line's ``--dtype auto`` does this).
            The manifest's ``dtype`` and ``config.json`` record what was written.
        overwrite_edited: with ``overwrite``, also replace (or remove) files the earlier save
            wrote that were changed since (their checksums differ from its manifest's);
            default: such a file is refused in one line naming it.

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
    dtype = save_dtype(dtype)
    out = check_destination(directory, overwrite=overwrite, overwrite_edited=overwrite_edited)
    check_free_space(out, _saved_bytes(model, merged=merged, dtype=dtype))
    layers = _layer_specs(model)
    meta = {"format": FORMAT, "fisherkron_version": __version__, "architecture": type(model).__name__,
            "form": "merged" if merged else "factorised", "dtype": dtype_name(dtype or _model_dtype(model)),
            "method": getattr(report, "method", None), "layers": layers,
            "report": report.to_dict() if hasattr(report, "to_dict") else report,
            "provenance": {"saved": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **(provenance or {})}}

    def write(folder: Path) -> None:
        if merged:
            import copy
            dense = merge_lowrank(copy.deepcopy(model))
            cast = {} if dtype is None else {"state_dict": _cast(dense.state_dict(), dtype)}
            dense.save_pretrained(folder, safe_serialization=True, **cast)
        else:
            model.save_pretrained(folder, state_dict=_cast(_shared_once(model, layers), dtype),
                                  safe_serialization=True)
        cfg_path = folder / "config.json"
        cfg = json.loads(cfg_path.read_text())
        if not merged:
            cfg[_REAL_TYPE], cfg["model_type"] = cfg.get("model_type"), MODEL_TYPE
        _set_config_dtype(cfg, dtype)
        cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        if tokenizer is not None:
            tokenizer.save_pretrained(folder)
        odd = [f.name for f in folder.iterdir() if not f.is_file() or f.is_symlink()]
        if odd:
            raise FisherkronError(f"saving wrote {odd[0]}, which is not a plain file; fisherkron saves flat "
                                  f"folders of files only")
        # the modification time lets an overwrite tell an untouched file without reading it (renames keep it)
        meta["files"] = {f.name: {"size": f.stat().st_size, "blake2b": file_checksum(f),
                                  "mtime_ns": f.stat().st_mtime_ns} for f in sorted(folder.iterdir())}
        (folder / MANIFEST).write_text(json.dumps(meta, indent=1, default=str))

    from safetensors import SafetensorError

    created = not out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
        transaction.swap_in(out, write, MANIFEST, _earlier_files, overwrite_edited=overwrite_edited)
    except (OSError, SafetensorError) as exc:
        what = "nothing was saved" if created else "the folder is as it was before"
        raise FisherkronError(f"saving to {out} failed ({transaction.reason(exc)}); {what}") from None
    finally:
        if created and out.is_dir() and not any(out.iterdir()):
            try:
                out.rmdir()
            except OSError:
                pass
    return out


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
    transaction.settle_interrupted(d, MANIFEST, loading=True)
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
