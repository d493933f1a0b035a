"""The README's numbers, rendered from the committed outputs so that they cannot drift.

Every number in README.md's results and verdict sections sits in a marked block::

    <!-- generated:NAME -->
    ...text rendered from figures/...
    <!-- /generated:NAME -->

or, inside one line (a table cell), ``<!-- generated:NAME -->253 s<!-- /generated:NAME -->``.
Each ``NAME`` has a renderer in one of this package's modules (``layer_studies``, ``encoder``,
``decoder``, ``calibration``, ``reproduce``, ``studies``; number formats in ``formats``) that reads only
committed files -- the tables ``figures/*.csv``, the summary records (the ``"extra"`` of
``figures/*_summary.provenance.json``) and the ``wall_seconds`` of provenance records, and beside
``figures/`` the committed ``make verify`` records (``data/verify/``) -- and returns the block's text. A name may carry an argument after a colon (``time:fig_time_algo``).

* :func:`render` rewrites every block of a README text;
* :func:`check` lists the blocks whose text differs from what the outputs render;
* ``python -m fisherkron.experiments.readme [--check] [README.md]`` (``make readme``,
  ``make readme-check``) does either on a file. ``tests/test_readme.py`` runs the check, so
  ``make test`` fails, without running any notebook, when a hand edit of README.md or a
  regenerated table leaves the two apart.

Text outside the blocks is hand-written; in the results sections it carries no measured number.

Every committed file is read through :func:`fisherkron.experiments.figures.read_table` /
:func:`~fisherkron.experiments.figures.read_provenance` (and the verify records through
:func:`fisherkron.experiments.verify.read_record`), so a missing or damaged one is one error naming it
and what to do; a renderer that fails on what a readable file holds (a hand-edited field deep in a
summary record) names the files its block read. Either way nothing is written and the exit status is 2.
"""
from __future__ import annotations

import argparse
import difflib
import re
import sys
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

from ...core.conventions import FisherkronError
from ...env import REPO_ROOT, atomic_write, read_committed, shown
from ..figures import read_provenance, read_table

__all__ = ["Outputs", "BLOCK", "WIDTH", "renderers", "blocks", "wrap", "render", "check", "main"]

#: one generated block: its name (with an optional ``:argument``) and its text
BLOCK = re.compile(r"<!-- generated:(?P<name>[\w.-]+(?::[\w.-]+)?) -->(?P<body>.*?)<!-- /generated:(?P=name) -->",
                   re.DOTALL)
_MARKER = re.compile(r"<!-- (/?)generated:([^ ]*) -->")


class Outputs:
    """Read-only access to the committed outputs in ``folder`` (``figures/``), each file read once.

    >>> import tempfile, pathlib
    >>> d = pathlib.Path(tempfile.mkdtemp())
    >>> _ = (d / "t.csv").write_text("a,b\\n1,x\\n")
    >>> Outputs(d).table("t")
    [{'a': 1.0, 'b': 'x'}]
    """

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self._table = cache(self._read_table)
        self._record = cache(self._read_record)
        #: every file a renderer asked for, in order (repeats too): the files a failing block names
        self.seen: list[Path] = []

    def table(self, name: str) -> list[dict[str, Any]]:
        """The rows of ``<name>.csv``; cells that parse as numbers are floats, empty cells None."""
        self.seen.append(self.folder / f"{name}.csv")
        return self._table(name)

    def record(self, name: str) -> dict[str, Any]:
        """The provenance record ``<name>.provenance.json``."""
        self.seen.append(self.folder / f"{name}.provenance.json")
        return self._record(name)

    def markdown(self, name: str) -> str:
        """The text of ``<name>.md`` (a table as the notebook printed it)."""
        path = self.folder / f"{name}.md"
        self.seen.append(path)
        return read_committed(path, what="a Markdown table", remake="re-run the notebook that writes it "
                                                                    "(`make help` lists them)")

    def _read_table(self, name: str) -> list[dict[str, Any]]:
        return [{k: _cell(v) for k, v in row.items()} for row in read_table(self.folder / f"{name}.csv")]

    def _read_record(self, name: str) -> dict[str, Any]:
        return read_provenance(self.folder / f"{name}.provenance.json")

    def extra(self, name: str) -> dict[str, Any]:
        """The ``"extra"`` of a record: a notebook's computed summary and verdicts."""
        return self.record(name).get("extra", {})

    def params(self, name: str) -> dict[str, Any]:
        """The notebook parameters a record was produced with."""
        return self.record(name).get("parameters", {})

    def wall(self, name: str) -> float:
        """``wall_seconds`` of a record: from the notebook's first cell to this artefact."""
        return float(self.record(name)["wall_seconds"])

    def records(self, notebook: str) -> list[str]:
        """The names of the records in the folder written by ``notebooks/<notebook>.py``."""
        out = []
        for p in sorted(self.folder.glob("*.provenance.json")):
            rec = self.record(p.name[: -len(".provenance.json")])
            if rec.get("notebook") == f"notebooks/{notebook}.py":
                out.append(rec["name"])
        return out


def _cell(v: str | None) -> Any:
    if v is None or v == "":
        return None
    try:
        return float(v)
    except ValueError:
        return {"True": True, "False": False}.get(v, v)


def blocks(text: str) -> list[tuple[str, str, str]]:
    """``(name, body, indent)`` of every generated block in ``text``, checking that the markers pair up.

    ``indent`` is the white space before an opening marker that starts its line (a block inside a
    list item); the rendered lines of that block carry it.

    >>> blocks("a <!-- generated:x -->1<!-- /generated:x --> b")
    [('x', '1', '')]
    """
    found = [(m.group("name"), m.group("body"), _indent(text, m)) for m in BLOCK.finditer(text)]
    markers = _MARKER.findall(BLOCK.sub("", text))
    if markers:
        kind, name = markers[0]
        raise FisherkronError(f"unpaired README marker <!-- {kind}generated:{name} -->: every block opens with "
                              f"<!-- generated:NAME --> and closes with <!-- /generated:NAME --> of the same NAME")
    return found


def _indent(text: str, m: re.Match) -> str:
    lead = text[text.rfind("\n", 0, m.start()) + 1: m.start()]
    return lead if lead.strip() == "" else ""


def renderers() -> dict[str, Callable]:
    """Every block name and its renderer ``f(outputs)`` or, for ``NAME:ARG`` blocks, ``f(outputs, arg)``."""
    from . import calibration, decoder, encoder, layer_studies, reproduce, studies

    out: dict[str, Callable] = {}
    for mod in (layer_studies, decoder, encoder, calibration, reproduce, studies):
        out.update(mod.BLOCKS)
    return out


def _renderer(name: str) -> Callable[[Outputs], str]:
    key, _, arg = name.partition(":")
    known = renderers()
    if key not in known:
        raise FisherkronError(f"README block {name!r} has no renderer; known blocks: {', '.join(sorted(known))} "
                              "(fisherkron/experiments/readme/)")
    fn = known[key]
    return (lambda out: fn(out, arg)) if arg else fn


#: rendered prose is wrapped at this width, as the README's hand-written text is
WIDTH = 100
# a word that must not start a wrapped line: Markdown would read it as a list item, quote, heading or table
_LINE_START = re.compile(r"^(\d+[.)]|[-+*>#=|]+|`{3,})$")


def wrap(line: str, width: int = WIDTH) -> list[str]:
    """A long Markdown line (paragraph or list item) as lines of at most ``width`` characters.

    Continuation lines of a list item are indented under its text; table rows are never wrapped.

    >>> wrap("* one two three four", 12)
    ['* one two', '  three four']
    >>> wrap("a b 1. c", 5)  # "1." would open a numbered list
    ['a', 'b 1.', 'c']
    """
    body = line.lstrip(" ")
    lead = line[: len(line) - len(body)]
    if len(line) <= width or body.startswith("|"):
        return [line]
    bullet = re.match(r"([-*+]|\d+[.)]) ", body)
    cont = lead + " " * (len(bullet.group(0)) if bullet else 0)
    words, lines, cur = _words(body), [], lead
    for w in words:
        if cur.strip() and len(cur) + 1 + len(w) > width:
            head, _, last = cur.rpartition(" ")
            if _LINE_START.match(w) and head.strip() and head != cur:  # carry the previous word along
                lines.append(head)
                cur = cont + last + " " + w
                continue
            lines.append(cur)
            cur = cont + w
        else:
            cur = (cur + " " + w) if cur.strip() else cur + w
    lines.append(cur)
    return lines


_UNIT = re.compile(r"^(%|(min|s|GB|pp|se)\b)")


def _words(text: str) -> list[str]:
    """``text`` split at spaces, but never inside a link's text or a code span, nor before a unit."""
    words: list[str] = []
    for w in text.split():
        if words and (words[-1].count("[") > words[-1].count("]") or words[-1].count("`") % 2 or _UNIT.match(w)):
            words[-1] += " " + w
        else:
            words.append(w)
    return words


#: what a renderer raises when a readable file holds something other than it expects (a hand-edited field)
_DAMAGE = (KeyError, TypeError, ValueError, IndexError, AttributeError, ZeroDivisionError)


def _rendered(name: str, body: str, indent: str, out: Outputs) -> str:
    render, start = _renderer(name), len(out.seen)
    try:
        text = render(out).strip("\n")
    except FisherkronError:
        raise
    except _DAMAGE as exc:
        read = list(dict.fromkeys(shown(p) for p in out.seen[start:])) or [shown(out.folder)]
        why = (str(exc).strip().splitlines() or [""])[0]
        raise FisherkronError(
            f"README block {name!r} cannot be rendered from {', '.join(read)} ({type(exc).__name__}: {why}): if one "
            f"of them was edited by hand or is damaged, restore it with `git checkout -- FILE` or re-run its "
            f"notebook; if none was, the block's renderer in fisherkron/experiments/readme/ needs a fix") from None
    if not body.startswith("\n"):  # inline, inside one line
        return text
    lines = [w for line in text.split("\n") for w in wrap(indent + line if line else line)]
    return "\n" + "\n".join(lines) + "\n" + indent  # a block on lines of its own


def render(text: str, folder: str | Path = REPO_ROOT / "figures") -> str:
    """``text`` with every generated block replaced by what the outputs in ``folder`` render."""
    out = Outputs(folder)
    blocks(text)  # markers pair up

    def sub(m: re.Match) -> str:
        name = m.group("name")
        body = _rendered(name, m.group("body"), _indent(text, m), out)
        return f"<!-- generated:{name} -->{body}<!-- /generated:{name} -->"

    return BLOCK.sub(sub, text)


def check(text: str, folder: str | Path = REPO_ROOT / "figures") -> list[str]:
    """One message per block of ``text`` that differs from what ``folder`` renders (empty: all agree)."""
    out = Outputs(folder)
    problems = []
    for name, body, indent in blocks(text):
        want = _rendered(name, body, indent, out)
        if want != body:
            diff = "\n".join(difflib.unified_diff(body.strip("\n").splitlines(), want.strip("\n").splitlines(),
                                                  "README.md", f"rendered from {out.folder.name}/", lineterm="", n=0))
            problems.append(f"README block {name!r} differs from the committed outputs: run `make readme`\n{diff}")
    return problems


def main(argv: list[str] | None = None) -> int:
    """The command line: rewrite the blocks of a README (or, with ``--check``, only compare)."""
    ap = argparse.ArgumentParser(prog="python -m fisherkron.experiments.readme", description=__doc__.split("\n")[0])
    ap.add_argument("readme", nargs="?", default=str(REPO_ROOT / "README.md"))
    ap.add_argument("--figures", default=None, help="the outputs folder (default: figures/ beside the README)")
    ap.add_argument("--check", action="store_true", help="only compare; exit 1 if a block differs")
    a = ap.parse_args(argv)
    path = Path(a.readme)
    folder = Path(a.figures) if a.figures else path.resolve().parent / "figures"
    try:
        text = read_committed(path, what="a Markdown text")
        if a.check:
            problems = check(text, folder)
            for p in problems:
                print(p, file=sys.stderr)
            print(f"{path}: {len(blocks(text))} generated blocks, {len(problems)} differ from {folder}")
            return 1 if problems else 0
        new = render(text, folder)
    except FisherkronError as e:
        print(f"readme: error: {e}", file=sys.stderr)
        return 2
    if new != text:
        atomic_write(path, lambda t: Path(t).write_text(new, encoding="utf-8"))
    changed = sum(a != b for a, b in zip(blocks(text), blocks(new)))
    print(f"{path}: {len(blocks(new))} generated blocks, {changed} rewritten from {folder}")
    return 0
