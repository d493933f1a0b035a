"""The sensitivity sweep's cache file: entries that carry their checksum, read back only once verified.

:func:`fisherkron.hf.sensitivity.sensitivity_sweep` keeps its measurements (Sec. 6.3's per-layer
loss increases, or the one point per layer of the calibrated and LEMS allocations) in
``sensitivity-<key>.json``: ``{"format", "key", "method", "metric", "ratios", "base", "layers"}``,
where ``base`` is the dense model's value and ``layers[name]`` a layer's row of measurements
``{rank: increase}``, each with what it cost (``evaluations``, ``seconds``) and a ``check``: a
checksum of its content, the sweep's key and the entry's name (:func:`entry`). A value edited by
hand in valid JSON, a bit flip, a row moved to another layer or copied from another sweep fails
it; :func:`read_sweep` also requires finite numbers (no NaN, no string, no ``bool``) at exactly
the layer's candidate ranks. It returns the entries that pass and says what is wrong with each
other one, which the sweep then measures again.
"""
from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

__all__ = ["FORMAT", "entry", "entry_problem", "read_sweep"]

#: the layout of the file: every entry (the dense value, each layer's row) carries its checksum
FORMAT = 2


def entry(key: str | None, name: str, **payload) -> dict:
    """A cache entry: its ``payload`` and a checksum of it bound to the sweep's ``key`` and the entry's ``name``.

    >>> e = entry("k", "base", value=2.5, evaluations=1, seconds=0.1)
    >>> entry_problem(e, "k", "base", None) is None
    True
    >>> entry_problem({**e, "value": 2.6}, "k", "base", None)
    'fails its checksum (changed since it was written, or copied from another sweep or entry)'
    >>> entry_problem(e, "k", "model.layers.0.mlp.up_proj", None)  # moved to another entry
    'fails its checksum (changed since it was written, or copied from another sweep or entry)'
    """
    return {**payload, "check": _check(key, name, payload)}


def _check(key: str | None, name: str, payload: dict) -> str:
    return hashlib.blake2b(json.dumps([key, name, payload], sort_keys=True).encode(), digest_size=16).hexdigest()


def _number(value) -> bool:
    """A finite ``int`` or ``float`` (not a ``bool``, a string, ``None`` or NaN)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def entry_problem(got, key: str, name: str, ranks: set[str] | None) -> str | None:
    """What is wrong with one entry read from the file (``None``: nothing; it may be used).

    ``ranks``: the candidate ranks a layer's row must hold, as strings (``None``: the base entry,
    which holds one ``value``). Every number must be finite and of a number's type, the cost a
    count and a duration, and the checksum must match the content, the ``key`` and the ``name``.
    """
    field = "row" if ranks is not None else "value"
    if not isinstance(got, dict) or set(got) != {field, "evaluations", "seconds", "check"}:
        return f"is not an entry of this format (the fields {field}, evaluations, seconds, check)"
    value = got[field]
    if ranks is None:
        if not _number(value):
            return f"holds {value!r}, not a finite number"
    else:
        if not isinstance(value, dict) or set(value) != ranks:
            held = sorted(value, key=lambda r: (len(r), r)) if isinstance(value, dict) else type(value).__name__
            return f"holds the ranks {held}, not the candidate ranks {sorted(ranks, key=int)}"
        bad = next((r for r, d in value.items() if not _number(d)), None)
        if bad is not None:
            return f"holds {value[bad]!r} at rank {bad}, not a finite number"
    count, seconds = got["evaluations"], got["seconds"]
    if not (isinstance(count, int) and not isinstance(count, bool) and count >= 0 and _number(seconds)
            and seconds >= 0):
        return "holds a cost (evaluations, seconds) that is not a count and a duration"
    if got["check"] != _check(key, name, {k: v for k, v in got.items() if k != "check"}):
        return "fails its checksum (changed since it was written, or copied from another sweep or entry)"
    return None


def read_sweep(path: Path, key: str, ranks: dict[str, set[str]]
               ) -> tuple[dict | None, dict[str, dict], list[tuple[str | None, str]]]:
    """The verified entries of the file ``path``: ``(base entry or None, {layer: entry}, problems)``.

    ``ranks``: each layer's candidate ranks (as strings); entries of other layers are not read.
    An entry that fails :func:`entry_problem` is left out, and ``problems`` holds ``(entry, what
    is wrong)``, the text naming the file and the entry; a file that cannot be read, or is another
    sweep's (or another format's), gives no entries and the one problem ``(None, text)``. A
    missing file or entry (a sweep not yet run, or interrupted) is no problem.
    """
    try:
        if not path.is_file():
            return None, {}, []
        got = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        return None, {}, [(None, f"{path} is unreadable ({exc})")]
    if not isinstance(got, dict) or got.get("key") != key or got.get("format") != FORMAT:
        return None, {}, [(None, f"{path} is not this sweep's (another key, or another format of file)")]
    problems = []
    base = got.get("base")
    if base is not None:
        problem = entry_problem(base, key, "base", None)
        if problem is not None:
            problems.append(("base", f"{path}: entry 'base' (the dense model's value) {problem}"))
            base = None
    layers = got.get("layers") if isinstance(got.get("layers"), dict) else {}
    entries = {}
    for name, want in ranks.items():
        if name not in layers:
            continue
        problem = entry_problem(layers[name], key, name, want)
        if problem is None:
            entries[name] = layers[name]
        else:
            problems.append((name, f"{path}: entry {name!r} {problem}"))
    return base, entries, problems
