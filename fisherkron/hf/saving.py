"""Save and reload compressed models as plain Hugging Face folders (no ``trust_remote_code``).

A saved folder holds what ``save_pretrained`` writes (``config.json`` and
safetensors; a factorised layer ``x`` is stored as ``x.first.weight`` (``W_1``,
``r x m``) and ``x.second.weight``/``x.second.bias`` (``W_2``, ``n x r``)),
the tokenizer when given, and ``fisherkron.json``: the method, every
factorised layer with ``n``, ``m``, ``r`` and bias, the compression report and
provenance. :func:`load_compressed` builds the architecture from the config,
puts ``LowRankLinear`` modules at the listed names and loads the tensors
strictly (tied weights re-tied).
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from torch import nn

from ..core.conventions import FisherkronError
from ..core.lowrank import LowRankLinear
from ..env import atomic_directory

__all__ = ["save_compressed", "load_compressed", "MANIFEST"]

MANIFEST = "fisherkron.json"
FORMAT = "fisherkron-lowrank/1"


def save_compressed(model: nn.Module, directory, *, report=None, tokenizer=None,
                    provenance: dict | None = None) -> Path:
    """Write ``model`` (with its ``LowRankLinear`` layers) to ``directory``.

    Written under a temporary name and moved into place; an existing folder
    is replaced only if it is itself a fisherkron folder (or empty).
    """
    from .._version import __version__

    out = Path(directory)
    if out.exists() and any(out.iterdir()) and not (out / MANIFEST).exists():
        raise FisherkronError(f"{out} exists and is not a fisherkron folder; choose an empty or new directory")
    layers = {name: {"n": mod.out_features, "m": mod.in_features, "rank": mod.rank,
                     "bias": mod.second.bias is not None}
              for name, mod in model.named_modules() if isinstance(mod, LowRankLinear)}
    meta = {"format": FORMAT, "fisherkron_version": __version__, "architecture": type(model).__name__,
            "method": getattr(report, "method", None), "layers": layers,
            "report": report.to_dict() if hasattr(report, "to_dict") else report,
            "provenance": {"saved": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **(provenance or {})}}
    with atomic_directory(out) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        (tmp / MANIFEST).write_text(json.dumps(meta, indent=1, default=str))
    return out


def load_compressed(directory, *, dtype: torch.dtype | None = None, return_tokenizer: bool = False):
    """Rebuild a model saved by :func:`save_compressed`, with its low-rank layers.

    Returns the model in ``eval()`` mode (and its tokenizer with ``return_tokenizer=True``).
    """
    import transformers
    from safetensors.torch import load_file

    d = Path(directory)
    if not (d / MANIFEST).exists():
        raise FisherkronError(f"{d} has no {MANIFEST}; it was not written by fisherkron.save_compressed")
    meta = json.loads((d / MANIFEST).read_text())
    if meta.get("format") != FORMAT:
        raise FisherkronError(f"{d}/{MANIFEST} has format {meta.get('format')!r}, expected {FORMAT!r}")
    config = transformers.AutoConfig.from_pretrained(d)
    arch = (getattr(config, "architectures", None) or [meta.get("architecture")])[0]
    cls = getattr(transformers, arch, None)
    if cls is None:
        raise FisherkronError(f"architecture {arch} of {d} is not in this transformers version")
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # older transformers
        from transformers.modeling_utils import no_init_weights
    with no_init_weights():
        model = cls(config)
    for name, spec in meta["layers"].items():
        model.set_submodule(name, LowRankLinear(spec["m"], spec["n"], spec["rank"], bias=spec["bias"]))
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise FisherkronError(f"{d} holds no .safetensors file")
    state = {}
    for f in files:
        state.update(load_file(str(f)))
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
        tok = transformers.AutoTokenizer.from_pretrained(d) if (d / "tokenizer_config.json").exists() else None
        return model, tok
    return model
