"""The committed copy of an executed notebook: outputs kept, run-to-run noise removed.

papermill and nbclient record when every cell started and ended, where the notebook was read from
and written to, and jupytext gives every cell a random id; a re-run that computes the same numbers
would then differ on every cell. :func:`strip_volatile` keeps what a reader sees (sources, outputs,
execution counts, tags, the injected parameters) and replaces the rest by stable values, so the
diff of a re-run shows only what changed in the results. A path of the machine that ran it, left in
an output (a list of the files a cell wrote, a library's warning), is written relative to the
repository: what a reader sees does not depend on where the run happened. A cell's stderr (progress bars,
warnings) is kept settled (:func:`settled_stderr`): each bar once, at the furthest it got, and each warning once,
not the thousands of updates, cursor moves and repeats a long run writes.
"""
from __future__ import annotations

import copy
import hashlib
import itertools
import re
from pathlib import Path
from typing import Any

from ...env import atomic_write, json_object, read_committed

__all__ = ["VOLATILE_CELL_KEYS", "relative_paths", "settled_stderr", "strip_volatile", "write_executed"]

#: cell metadata written by the runners, different on every run
VOLATILE_CELL_KEYS = ("execution", "papermill", "collapsed", "scrolled")
#: notebook-level papermill keys that are kept (the rest are times and paths)
KEPT_PAPERMILL_KEYS = ("parameters",)


#: an absolute folder just above one of the repository's own top-level folders: the checkout's root
_CHECKOUT = re.compile(r"(?<![\w.~])(?:/[\w.+-]+)+/(?=(?:figures|data|notebooks|build|\.venv|fisherkron|scripts|"
                       r"tests|book|examples)/)")


def relative_paths(text: str) -> str:
    """``text`` with every absolute path into a checkout written relative to the checkout's root.

    >>> relative_paths("[PosixPath('/home/ann/fisherkron/figures/fig_x.png')] and /srv/x/data/cache/y.json")
    "[PosixPath('figures/fig_x.png')] and data/cache/y.json"
    >>> relative_paths("a ratio 1/2 and figures/ stay")
    'a ratio 1/2 and figures/ stay'
    """
    return _CHECKOUT.sub("", text)


#: where a stream's line ends (a newline or a cursor move: a nested progress bar moves up and down), and any
#: other escape sequence (a colour)
_BREAK = re.compile(r"\n|\x1b\[[0-9;]*[ABEF]")
_ESCAPE = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b")
#: a tqdm progress bar: its label (``desc``), then a percentage and bar, a count of iterations (``7it [``), or a
#: count in another unit followed by tqdm's elapsed time (``100 examples [00:00``: a line such as ``kept 3 layers
#: [0, 1, 2]`` is not a bar)
_BAR = re.compile(r"^(?P<label>.*?)[: ]*(?:\d{1,3}%\||\d+(?:\.\d+)?[kMG]?(?:it \[| [A-Za-z]+ \[\d+:\d\d))")
#: how far a bar got: ``n`` of ``| n/total``, of ``nit [`` or of ``n examples [00:00``
_DONE = re.compile(r"\|\s*(\d+)/|(\d+)(?:it \[| [A-Za-z]+ \[\d+:\d\d)")
#: a run of this many lines or more that differ in one word only is shown as its first line and a count
_ALIKE = 3


def settled_stderr(text: str) -> str:
    """What a reader needs of a cell's stderr ``text``: each progress bar once, at its last state, and every
    other line once, in the order they first appeared, with no control character.

    A line is what a carriage return leaves of it (the text after the last one); a newline or a cursor move
    ends it. Lines that are progress bars (tqdm's ``label: 42%|...|`` or ``label: 7it [...``) with the same
    label are one bar, shown where it first appeared at the furthest it got (the last such update): a sweep's
    bar that each case of a study opens again shows the case that did the work, not the last one, which found
    it cached. A warning repeated in every case is shown once, and a run of :data:`_ALIKE` or more lines that
    differ from the first in the same one word (a library's note about each of 57 tasks) as the first and a
    count.

    >>> settled_stderr("\\rbar: 0%|  | 0/2\\rbar: 50%|# | 1/2\\rbar: 100%|##| 2/2\\n")
    'bar: 100%|##| 2/2\\n'
    >>> settled_stderr("\\rall: 0%| | 0/2\\n\\rin: 2it [00:01]\\x1b[A\\rall: 50%| | 1/2\\nslow\\n\\rin: 0it [00:00]"
    ...                "\\x1b[A\\rall: 100%| | 2/2\\nslow\\n\\x1b[31mdone\\x1b[0m")
    'all: 100%| | 2/2\\nin: 2it [00:01]\\nslow\\ndone'
    >>> print(settled_stderr("split: 100 examples [00:00, 9.1 examples/s]\\nsplit: 135 examples [00:00, 8.0 "
    ...                      "examples/s]\\nset a to 5\\nset b to 5\\nset c to 5\\nset d to 6\\nfit (a): 0it [00:00]\\n"
    ...                      "fit (b): 0it [00:00]\\nfit (c): 0it [00:00]\\nkept 3 layers [0, 1]\\n"
    ...                      "kept 2 layers [4, 5]\\n"))
    split: 135 examples [00:00, 8.0 examples/s]
    set a to 5 (and 2 more lines like it)
    set d to 6
    fit (a): 0it [00:00]
    fit (b): 0it [00:00]
    fit (c): 0it [00:00]
    kept 3 layers [0, 1]
    kept 2 layers [4, 5]
    <BLANKLINE>
    """
    order: list[tuple[str, str]] = []
    last: dict[tuple[str, str], str] = {}
    for segment in _BREAK.split(text):
        line = _ESCAPE.sub("", segment.rsplit("\r", 1)[-1]).rstrip()
        if not line.strip():
            continue
        bar = _BAR.match(line)
        key = ("bar", bar["label"].strip()) if bar else ("line", line)
        if key not in last:
            order.append(key)
        elif bar and _done(line) < _done(last[key]):
            continue  # an earlier instance of this bar got further
        last[key] = line
    shown = _alike_runs([last[k] for k in order], bars={n for n, k in enumerate(order) if k[0] == "bar"})
    return "\n".join(shown) + ("\n" if shown and text.endswith("\n") else "")


def _alike_runs(lines: list[str], bars: set[int] = frozenset()) -> list[str]:
    """``lines`` with each run of :data:`_ALIKE` or more consecutive lines that differ from the run's first line in
    the same one word (and in nothing else) shown as that first line and how many more there were; the lines
    numbered in ``bars`` (progress bars, each its own) are never part of a run."""
    out, i = [], 0
    while i < len(lines):
        first, j, at = lines[i].split(), i + 1, None
        while j < len(lines) and i not in bars and j not in bars:
            words = lines[j].split()
            diff = [n for n, (a, b) in enumerate(zip(first, words)) if a != b]
            if len(words) != len(first) or len(diff) != 1 or (at is not None and diff[0] != at):
                break
            at, j = diff[0], j + 1
        if j - i >= _ALIKE:
            out.append(f"{lines[i]} (and {j - i - 1} more lines like it)")
        else:
            out += lines[i:j]
        i = j
    return out


def _done(line: str) -> int:
    """How many iterations the progress bar ``line`` shows (0 if it does not say)."""
    m = _DONE.search(line)
    return int(m[1] or m[2]) if m else 0


def _settle_stderr(cell: dict[str, Any]) -> None:
    """Each run of consecutive stderr outputs of ``cell`` becomes one, its :func:`settled_stderr`; an empty one
    goes."""
    outputs = []
    for stderr, run in itertools.groupby(cell["outputs"], key=lambda o: (o.get("output_type"), o.get("name"))
                                         == ("stream", "stderr")):
        if not stderr:
            outputs += run
        elif text := settled_stderr("".join(_joined(o.get("text", "")) for o in run)):
            outputs.append({"output_type": "stream", "name": "stderr", "text": text})
    cell["outputs"] = outputs


def _relative(value: Any) -> Any:
    """:func:`relative_paths` of an output's text, kept as a string or a list of lines as it was."""
    if isinstance(value, list):
        return [relative_paths(v) if isinstance(v, str) else v for v in value]
    return relative_paths(value) if isinstance(value, str) else value


def _relative_outputs(cell: dict[str, Any]) -> None:
    for out in cell.get("outputs", []):
        if "text" in out:  # a stream
            out["text"] = _relative(out["text"])
        for kind, value in (out.get("data") or {}).items():
            if kind.startswith("text/"):
                out["data"][kind] = _relative(value)


def _joined(text: str | list[str]) -> str:
    """A notebook's multiline string (a source, a stream's text), stored as one string or a list of lines."""
    return "".join(text) if isinstance(text, list) else text


def _source(cell: dict[str, Any]) -> str:
    return _joined(cell.get("source", ""))


def strip_volatile(nb: dict[str, Any]) -> dict[str, Any]:
    """A copy of notebook ``nb`` (nbformat 4, as a dict) without timing, paths or random ids
    (:func:`relative_paths` in its outputs), each cell's stderr settled (:func:`settled_stderr`).

    Cell ids become a hash of the cell's type and source (numbered when two cells are equal), so
    an unchanged cell keeps its id from one run to the next.

    >>> nb = {"nbformat": 4, "nbformat_minor": 5, "metadata": {"papermill": {
    ...     "duration": 3.2, "parameters": {"k": 4}, "input_path": "build/x.src.ipynb"}},
    ...     "cells": [{"cell_type": "code", "id": "f00d", "source": "1 + 1", "execution_count": 1,
    ...                "outputs": [], "metadata": {"tags": [], "execution": {"iopub.status.idle": "..."},
    ...                                            "papermill": {"duration": 0.1}}}]}
    >>> out = strip_volatile(nb)
    >>> out["metadata"], out["cells"][0]["metadata"], out["cells"][0]["id"]
    ({'papermill': {'parameters': {'k': 4}}}, {'tags': []}, 'code-7f313ac3')
    >>> strip_volatile(out) == out
    True
    """
    nb = copy.deepcopy(nb)
    meta = nb.setdefault("metadata", {})
    if "papermill" in meta:
        meta["papermill"] = {k: v for k, v in meta["papermill"].items() if k in KEPT_PAPERMILL_KEYS}
    seen: dict[str, int] = {}
    for cell in nb.get("cells", []):
        cmeta = cell.setdefault("metadata", {})
        for key in VOLATILE_CELL_KEYS:
            cmeta.pop(key, None)
        if cell.get("outputs"):
            _settle_stderr(cell)
        _relative_outputs(cell)
        if "id" in cell:  # nbformat >= 4.5
            digest = hashlib.sha1(f"{cell['cell_type']}\n{_source(cell)}".encode()).hexdigest()[:8]
            base = f"{cell['cell_type']}-{digest}"
            seen[base] = seen.get(base, 0) + 1
            cell["id"] = base if seen[base] == 1 else f"{base}-{seen[base]}"
    return nb


def write_executed(src: str | Path, dst: str | Path) -> Path:
    """Write :func:`strip_volatile` of the executed notebook ``src`` to ``dst``, atomically.

    The file is written by nbformat (one-space indent, sorted keys, sources split into lines), as
    Jupyter saves a notebook, so two versions diff line by line.
    """
    import nbformat

    nb = strip_volatile(read_committed(src, json_object(), what="an executed notebook (JSON)", committed=False,
                                       remake=f"re-run `make {Path(src).stem}`"))
    text = nbformat.writes(nbformat.from_dict(nb), version=nbformat.NO_CONVERT) + "\n"
    Path(dst).parent.mkdir(parents=True, exist_ok=True)
    return atomic_write(dst, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))
