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

Beside them, ``fisherkron.json`` records the method, every factorised layer (``n``, ``m``,
``r``, bias), the compression report, provenance, and the size and checksum of every file
the package wrote. :func:`load_compressed` verifies the checksums before anything is built,
so a truncated or bit-flipped file is a one-line error, not NaN logits.

Nothing the package did not write is ever deleted: saving onto an earlier save needs
``overwrite=True`` and then replaces only the files listed in its ``fisherkron.json``.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from ..core.conventions import FisherkronError
from ..core.lowrank import LowRankLinear
from ..env import atomic_directory, file_checksum, temporary_name

__all__ = ["save_compressed", "load_compressed", "merge_lowrank", "MANIFEST", "FORMAT"]

MANIFEST = "fisherkron.json"
FORMAT = "fisherkron-lowrank/2"
#: ``model_type`` written into ``config.json`` of a factorised folder: transformers shows it in its refusal.
MODEL_TYPE = "fisherkron-compressed (load this folder with fisherkron.load_compressed)"
_REAL_TYPE = "fisherkron_model_type"


def _read_manifest(d: Path) -> dict:
    try:
        meta = json.loads((d / MANIFEST).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FisherkronError(f"{d / MANIFEST} is unreadable ({type(exc).__name__}: {exc}); "
                              f"the folder is damaged: save the model again") from None
    if not isinstance(meta, dict):
        raise FisherkronError(f"{d / MANIFEST} is not a fisherkron manifest (a JSON object was expected)")
    return meta


def check_destination(directory, *, overwrite: bool = False) -> Path:
    """Where :func:`save_compressed` may write, checked before any work; raises a one-line error.

    Allowed: a new or empty folder, or an earlier fisherkron save with ``overwrite=True``.
    """
    out = Path(directory)
    if out.exists() and not out.is_dir():
        raise FisherkronError(f"{out} is a file, not a folder; choose a folder to save the model in")
    if out.is_dir() and any(out.iterdir()):
        if not (out / MANIFEST).exists():
            raise FisherkronError(f"{out} is not a fisherkron folder (it holds files fisherkron did not write); "
                                  f"choose a new or empty folder")
        if not overwrite:
            raise FisherkronError(f"{out} already holds a fisherkron save; pass overwrite=True (--overwrite) "
                                  f"to replace the files fisherkron wrote there (other files are kept)")
        _read_manifest(out)
    return out


def merge_lowrank(model: nn.Module) -> nn.Module:
    """Replace every ``LowRankLinear`` of ``model`` (in place) by a dense ``nn.Linear`` with ``W = W_2 W_1``."""
    for name, mod in list(model.named_modules()):
        if isinstance(mod, LowRankLinear):
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
    """Write ``model`` (with its ``LowRankLinear`` layers) to ``directory``.

    Args:
        model: a Hugging Face model, compressed by :func:`fisherkron.compress`.
        directory: a new or empty folder, or an earlier save (with ``overwrite=True``).
        report: the :class:`~fisherkron.CompressionReport`, stored in ``fisherkron.json``.
        tokenizer: saved beside the model when given.
        provenance: anything else worth recording.
        overwrite: replace an earlier fisherkron save in ``directory``. Only the files its
            ``fisherkron.json`` lists are replaced or removed; files the package did not
            write stay.
        merged: write the dense form (``W_2 W_1`` multiplied out; ``model`` itself is not
            changed), which plain transformers loads; default: the factorised form.

    The files are written to a temporary folder first; a new folder appears in one rename.
    """
    from .._version import __version__

    out = check_destination(directory, overwrite=overwrite)
    layers = {name: {"n": mod.out_features, "m": mod.in_features, "rank": mod.rank,
                     "bias": mod.second.bias is not None}
              for name, mod in model.named_modules() if isinstance(mod, LowRankLinear)}
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
            model.save_pretrained(folder, safe_serialization=True)
            cfg_path = folder / "config.json"
            cfg = json.loads(cfg_path.read_text())
            cfg[_REAL_TYPE], cfg["model_type"] = cfg.get("model_type"), MODEL_TYPE
            cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        if tokenizer is not None:
            tokenizer.save_pretrained(folder)
        meta["files"] = {f.name: {"size": f.stat().st_size, "blake2b": file_checksum(f)}
                         for f in sorted(folder.iterdir()) if f.is_file()}
        (folder / MANIFEST).write_text(json.dumps(meta, indent=1, default=str))

    if not out.exists() or not any(out.iterdir()):
        with atomic_directory(out) as tmp:
            write(tmp)
        return out
    # an earlier save: write everything aside first, then swap only the package's own files
    old = _read_manifest(out).get("files") or {}
    tmp = Path(tempfile.mkdtemp(prefix=temporary_name(out.name), dir=out.parent))
    try:
        write(tmp)
        (out / MANIFEST).unlink()  # from here until the last rename the folder is not a valid save
        for name in old:
            if name != MANIFEST and not (tmp / name).exists():
                (out / name).unlink(missing_ok=True)
        for f in sorted(tmp.iterdir()):
            if f.name != MANIFEST:
                os.replace(f, out / f.name)
        os.replace(tmp / MANIFEST, out / MANIFEST)  # last: the save is complete
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def verify_files(d: Path, meta: dict) -> None:
    """Check every file listed in ``meta["files"]`` for size and checksum; one-line error on a mismatch."""
    for name, want in (meta.get("files") or {}).items():
        f = d / name
        if not f.exists():
            raise FisherkronError(f"{f} is missing; the folder is incomplete: save the model again")
        size = f.stat().st_size
        if size != want.get("size"):
            raise FisherkronError(f"{f} has {size} bytes, {want.get('size')} were saved: the file is "
                                  f"truncated or was replaced; save the model again")
        if file_checksum(f) != want.get("blake2b"):
            raise FisherkronError(f"{f} does not match the checksum recorded when it was saved: the file was "
                                  f"changed or corrupted; save the model again")


def load_compressed(directory, *, dtype: torch.dtype | None = None, return_tokenizer: bool = False,
                    verify: bool = True):
    """Rebuild a model saved by :func:`save_compressed`, with its low-rank layers.

    Args:
        directory: the folder.
        dtype: parameter dtype (default: the saved one).
        return_tokenizer: also return the tokenizer (``None`` if none was saved).
        verify: check every file's size and checksum first (default; the cost is one read).

    Returns the model in ``eval()`` mode (and its tokenizer with ``return_tokenizer=True``).
    """
    import transformers
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    d = Path(directory)
    if not d.is_dir():
        raise FisherkronError(f"{d} is not a folder")
    if not (d / MANIFEST).exists():
        raise FisherkronError(f"{d} has no {MANIFEST}; it was not written (completely) by "
                              f"fisherkron.save_compressed")
    meta = _read_manifest(d)
    if meta.get("format") != FORMAT:
        raise FisherkronError(f"{d}/{MANIFEST} has format {meta.get('format')!r}, expected {FORMAT!r}; "
                              f"save the model again with this version of fisherkron")
    if verify:
        verify_files(d, meta)
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
        for name, spec in meta["layers"].items():
            model.set_submodule(name, LowRankLinear(spec["m"], spec["n"], spec["rank"], bias=spec["bias"]))
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise FisherkronError(f"{d} holds no .safetensors file")
    state = {}
    for f in files:
        try:
            state.update(load_file(str(f)))
        except (SafetensorError, OSError, ValueError) as exc:
            raise FisherkronError(f"{f} is not a readable safetensors file ({exc}); save the model again") from None
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = set()
    if getattr(config, "tie_word_embeddings", False):
        tied = {k for k in missing if k.endswith("lm_head.weight") or k.endswith("decoder.weight")}
    bad = [k for k in missing if k not in tied]
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
        tok = None
        if (d / "tokenizer_config.json").exists():
            try:
                tok = transformers.AutoTokenizer.from_pretrained(d, config=config)
            except (OSError, ValueError) as exc:
                raise FisherkronError(f"the tokenizer in {d} cannot be loaded ({exc})") from None
        return model, tok
    return model
