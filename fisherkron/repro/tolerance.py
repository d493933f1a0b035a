"""How far a regenerated table value may fall from the committed one (``make verify``).

A notebook declares one tolerance per table column when it saves the table::

    figures.save_table(table, "tab_synthetic_gaps", output_dir, params,
                       tolerances={"covariance": "exact", "seeds": "exact",
                                   "gap": "3*se(se)", "fisher share": "rel=1e-3"})

:func:`fisherkron.repro.figures.save_table` checks the declarations against the table
(:func:`declare`) and records them in ``<name>.provenance.json`` under ``"tolerances"``;
:mod:`fisherkron.repro.verify` reads them back and compares every value of a
regenerated table with the committed one.

The grammar of one declaration:

==========================  ==================================================================
``exact``                   equal: numbers as the CSV stores them, text letter for letter
                            (counts, ranks, configurations, flags, labels)
``timing``                  a measured time, throughput or memory, or a value decided by one:
                            reported beside the committed value, never a failure
``TERM + TERM + ...``       ``|new - committed| <= sum of the terms``, each read from the
                            committed row:
``abs=X``                   ``X``
``rel=X``                   ``X * |committed|`` (float32 results: summation order differs
                            between CPUs and thread counts, see STYLE.md item 11)
``K*se(COL)``               ``K`` times the standard error of the difference: ``COL`` of the
                            committed row and of the new one, ``K * sqrt(se_c^2 + se_n^2)``
``K*sd(COL)/sqrt(N)``       the same with ``COL / sqrt(N)``, ``COL`` a standard deviation over ``N`` seeds
``K*pm/sqrt(N)``            the same for a text cell ``"0.618 ± 0.002"``: the number after ``±``
                            is the standard deviation (of ``N`` seeds)
==========================  ==================================================================

A text cell is compared by its words exactly and by its numbers within the column's
tolerance, so ``"0.618 ± 0.002"`` and ``"5.8 %"`` are checked as numbers. Thousands
separators are part of a number (``"94,632"`` is one), markdown emphasis on a table's best
value is not compared (it follows from the values), and the spread after ``±`` is held to the
width of the mean before it, not to a tolerance of its own size.

Columns with no declaration get :func:`default` (conservative: exact for integers, flags and
text, ``rel=1e-6`` for floats, ``timing`` only for names that say so), and the verify report
lists them, so a reader sees which tolerances were chosen by nobody.
"""
from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..core.errors import FisherkronError

__all__ = ["Tolerance", "parse", "declare", "default", "looks_like_timing", "DEFAULT_FLOAT"]

#: the default of an undeclared float column: a float64 computation repeated on the same machine
DEFAULT_FLOAT = "rel=1e-6"

_NUM = r"[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?"
_SPREAD = re.compile(rf"^(?P<k>{_NUM})\*(?:(?P<kind>se|sd)\((?P<col>.+?)\)|(?P<pm>pm))"
                     rf"(?:/sqrt\((?P<n>{_NUM})\))?$")
_PLAIN = re.compile(rf"^(?P<kind>abs|rel)=(?P<x>{_NUM})$")
# Column names that are measurements of time, speed or memory. "FLOP speedup" is a ratio of
# counted FLOPs, not a measurement, so "speedup" counts only when "flop" does not precede it.
_TIMING = re.compile(r"seconds|[ _](s|ms|min)$|\bms\b|\(s\)|tokens/s|per_s|gflops|throughput|latency|wall"
                     r"|peak_rss|(?<!flop )(?<!flop_)speedup", re.IGNORECASE)


@dataclass(frozen=True)
class Spread:
    """One ``K*se(COL)``, ``K*sd(COL)/sqrt(N)`` or ``K*pm/sqrt(N)`` term."""

    k: float
    kind: str  # "se" | "sd" | "pm"
    column: str | None
    n: float = 1.0


@dataclass(frozen=True)
class Tolerance:
    """A parsed declaration; :attr:`spec` is the text it was parsed from."""

    spec: str
    kind: str  # "exact" | "timing" | "bound"
    abs: float = 0.0
    rel: float = 0.0
    spreads: tuple[Spread, ...] = ()

    @property
    def columns(self) -> set[str]:
        """The other columns this tolerance reads (``se(COL)`` / ``sd(COL)``)."""
        return {s.column for s in self.spreads if s.column is not None}

    def width(self, ref: float, row: Mapping[str, Any] | None = None, cell_sd: float | None = None, *,
              new_row: Mapping[str, Any] | None = None, new_cell_sd: float | None = None) -> float:
        """The allowed ``|new - ref|`` for the committed value ``ref`` in the committed ``row``.

        A spread term bounds the difference of two means, each with its own standard error: with the
        committed one ``e_c`` (from ``row`` or ``cell_sd``) and, when given, the new run's ``e_n`` (from
        ``new_row`` or ``new_cell_sd``), ``K * sqrt(e_c^2 + e_n^2)``; with ``e_c`` alone, ``K * e_c``. A few seeds
        estimate a spread poorly, so neither run's estimate is taken as the truth: a committed spread that came
        out small by chance would otherwise hold the new run to a precision its seeds never had.

        >>> parse("rel=0.01 + 2*se(se)").width(100.0, {"se": 0.5})
        2.0
        >>> parse("2*se(se)").width(1.0, {"se": 0.3}, new_row={"se": 0.4})
        1.0
        """
        if self.kind != "bound":
            return 0.0
        w = self.abs + self.rel * abs(ref)
        for s in self.spreads:
            errors = []
            for r, sd in ((row, cell_sd), (new_row, new_cell_sd)):
                v = sd if s.kind == "pm" else _number((r or {}).get(s.column))
                if v is not None and math.isfinite(v):
                    errors.append(abs(v) / (math.sqrt(s.n) if s.kind in ("sd", "pm") else 1.0))
            if errors:  # else no spread known for this value: the other terms (possibly 0) bound it
                w += s.k * math.sqrt(sum(e * e for e in errors))
        return w


def _number(v: Any) -> float | None:
    try:
        x = float(v)
    except (TypeError, ValueError):
        return None
    return x


def parse(spec: str | Tolerance) -> Tolerance:
    """A :class:`Tolerance` from its declaration (see the module docstring for the grammar).

    >>> parse("3*sd(svd std)/sqrt(10)").spreads[0]
    Spread(k=3.0, kind='sd', column='svd std', n=10.0)
    >>> parse("rel=1e-3 + abs=1e-6").rel
    0.001
    """
    if isinstance(spec, Tolerance):
        return spec
    if not isinstance(spec, str) or not spec.strip():
        raise FisherkronError(f"a tolerance is a text such as 'exact', 'timing', 'rel=1e-3' or '3*se(se)', "
                              f"got {spec!r}")
    text = " ".join(spec.split())
    if text in ("exact", "timing"):
        return Tolerance(text, text)
    a = r = 0.0
    spreads = []
    for term in re.split(r"\s+\+\s+", text):
        if m := _PLAIN.match(term):
            if m["kind"] == "abs":
                a += float(m["x"])
            else:
                r += float(m["x"])
        elif m := _SPREAD.match(term):
            kind = "pm" if m["pm"] else m["kind"]
            if kind == "se" and m["n"]:
                raise FisherkronError(f"tolerance {spec!r}: se(COL) is already a standard error; "
                                      f"write sd(COL)/sqrt(N) for a standard deviation over N seeds")
            spreads.append(Spread(float(m["k"]), kind, m["col"], float(m["n"] or 1.0)))
        else:
            raise FisherkronError(f"tolerance {spec!r}: cannot read the term {term!r}; terms are abs=X, rel=X, "
                                  f"K*se(COL), K*sd(COL)/sqrt(N) or K*pm/sqrt(N), joined by ' + ' "
                                  f"(or the whole declaration 'exact' or 'timing')")
    return Tolerance(text, "bound", a, r, tuple(spreads))


def declare(tolerances: Mapping[str, str] | None, columns) -> dict[str, str]:
    """The declarations of a table, checked against its ``columns``; ``{}`` for ``None``.

    Raises:
        FisherkronError: a declaration names a column the table does not have, or reads one
            (``se(COL)``) that it does not have, or cannot be parsed.
    """
    if not tolerances:
        return {}
    cols = [str(c) for c in columns]
    out = {}
    for col, spec in tolerances.items():
        if str(col) not in cols:
            raise FisherkronError(f"tolerance declared for column {col!r}, which the table does not have; "
                                  f"its columns: {cols}")
        tol = parse(spec)
        missing = tol.columns - set(cols)
        if missing:
            raise FisherkronError(f"tolerance {tol.spec!r} of column {col!r} reads {sorted(missing)}, "
                                  f"which the table does not have")
        out[str(col)] = tol.spec
    return out


def looks_like_timing(column: str) -> bool:
    """Whether a column's name says it is a measured time, speed or memory.

    >>> [looks_like_timing(c) for c in ("ours_s", "ms per token", "FLOP speedup", "speedup", "k")]
    [True, True, False, True, False]
    """
    return bool(_TIMING.search(str(column)))


def default(column: str, values) -> tuple[Tolerance, str]:
    """The tolerance of an undeclared column, and why: conservative, chosen from its name and type.

    ``values`` is the committed column (a pandas Series).
    """
    import pandas as pd

    if looks_like_timing(column):
        return parse("timing"), "its name says timing"
    if pd.api.types.is_float_dtype(values):
        finite = values.dropna()
        if len(finite) and (finite == finite.round()).all():
            return parse("exact"), "whole numbers"
        return parse(DEFAULT_FLOAT), "float"
    return parse("exact"), "integers, flags or text"
