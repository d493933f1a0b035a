"""Which ``nn.Linear`` layers a calibration covers: regex or glob patterns, the paper's default choice.

The default is the paper's: every linear layer of the transformer blocks (Sec. 6), named per
model family in :data:`fisherkron.hf.registry.DEFAULT_LAYERS`; the embeddings and ``lm_head``
are never selected by it.
"""
from __future__ import annotations

import difflib
import fnmatch
import re

from torch import nn

from ...core.conventions import FisherkronError
from ..registry import DEFAULT_LAYERS

__all__ = ["select_layers"]


def _linear_names(model: nn.Module) -> list[str]:
    return [name for name, mod in model.named_modules() if isinstance(mod, nn.Linear)]


def _default_pattern(model: nn.Module) -> str:
    mtype = getattr(getattr(model, "config", None), "model_type", "")
    if mtype in ("bert", "roberta", "distilbert", "electra"):
        return DEFAULT_LAYERS["encoder"]
    return DEFAULT_LAYERS["decoder"]


def _matches(pattern: str, name: str) -> bool:
    if fnmatch.fnmatchcase(name, pattern):
        return True
    try:
        return re.fullmatch(pattern, name) is not None
    except re.error:
        return False


def select_layers(model: nn.Module, layers=None) -> list[str]:
    """Names of the ``nn.Linear`` modules matched by ``layers``.

    ``layers``: a regex (full match) or glob pattern, a list of them, or
    ``None`` for the paper's choice (all linear layers of the transformer
    blocks). A pattern that matches nothing raises a one-line error listing the
    nearest linear-layer names.

    >>> m = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    >>> select_layers(m, "*"), select_layers(m, r"\\d")
    (['0', '2'], ['0', '2'])
    """
    patterns = [_default_pattern(model)] if layers is None else \
        [layers] if isinstance(layers, str) else list(layers)
    names = _linear_names(model)
    chosen: list[str] = []
    for p in patterns:
        hit = [n for n in names if _matches(p, n)]
        if not hit:
            near = difflib.get_close_matches(p, names, n=3, cutoff=0.0) or names[:3]
            raise FisherkronError(f"layer pattern {p!r} matches no nn.Linear; nearest layers: "
                                  f"{', '.join(near) or '(model has no nn.Linear)'}")
        chosen += [n for n in hit if n not in chosen]
    return [n for n in names if n in chosen]  # model order

