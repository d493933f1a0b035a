"""Comparing a regenerated table with the committed one, value by value, within each column's tolerance.

:func:`compare_frames` holds two tables (pandas DataFrames) side by side: the same columns, the same rows, and
every value within its column's tolerance (:mod:`fisherkron.repro.tolerance`). A text cell such as
``"0.613 ± 0.053"`` is compared number by number, its words exactly, and a printed number stands for every value
within half a unit of its last digit. :func:`compare_table` reads both tables and the declared tolerances
(:func:`declared_tolerances`: the regenerated table's provenance record, the committed one's, then
:data:`fisherkron.repro.verify_tolerances.TOLERANCES`); :func:`compare_notebook` does so for every table of one
notebook. ``make verify`` (:mod:`fisherkron.repro.verify`) reports what they return.
"""
from __future__ import annotations

import math
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import tolerance as T

__all__ = ["Failure", "TableReport", "compare_frames", "compare_table", "compare_notebook", "tables_of",
           "declared_tolerances", "check_committed"]

#: a number in a text cell, thousands separators included ("94,632 ± 15,436" is two numbers, not four)
_NUM = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+(?:\.\d*)?|\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")
#: markdown emphasis a table puts on its best value per block: derived from the values, not compared
_EMPHASIS = re.compile(r"\*\*|__")


@dataclass
class Failure:
    """One value outside its tolerance (or a structural difference: ``column`` or ``row`` is None)."""

    table: str
    row: int | None
    label: str
    column: str | None
    committed: Any
    new: Any
    delta: float | None
    width: float | None
    spec: str

    def line(self) -> str:
        where = f"{self.table}" + (f" row {self.row} ({self.label})" if self.row is not None else "") + \
                (f" column {self.column!r}" if self.column is not None else "")
        if self.delta is None or not math.isfinite(self.delta):
            return f"{where}: committed {self.committed!r}, now {self.new!r} [{self.spec}]"
        return (f"{where}: committed {self.committed!r}, now {self.new!r}, |diff| {self.delta:.3g} > "
                f"tolerance {self.width:.3g} [{self.spec}]")


@dataclass
class TableReport:
    """The comparison of one table."""

    name: str
    notebook: str | None = None
    status: str = "PASS"  # PASS | FAIL | MISSING (not regenerated) | NEW (not committed)
    columns: int = 0  # columns checked (not timing)
    values: int = 0  # values checked
    declared: int = 0
    source: str = "none"  # where the declarations came from
    defaults: dict[str, str] = field(default_factory=dict)  # column -> "spec (reason)"
    timing: dict[str, str] = field(default_factory=dict)  # column -> "x1.08" (median new / committed)
    worst: float = 0.0
    worst_at: str = ""
    failures: list[Failure] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def line(self) -> str:
        if self.status in ("MISSING", "NEW"):
            return f"{self.status:4s} {self.name}: " + "; ".join(self.notes)
        worst = "inf" if math.isinf(self.worst) else f"{self.worst:.2f}"
        s = (f"{self.status:4s} {self.name}: {self.columns} columns, {self.values} values checked "
             f"({self.declared} columns declared [{self.source}], {len(self.defaults)} default); "
             f"worst margin {worst}" + (f" at {self.worst_at}" if self.worst_at else ""))
        if self.failures:
            s += f"; {len(self.failures)} outside tolerance"
        if self.timing:
            s += "; timing, not checked (new/committed): " + ", ".join(f"{c} {r}" for c, r in self.timing.items())
        return s


# -- reading tables and their declarations -----------------------------------------------------
#: the advice for a damaged file that a verify run wrote (not a committed one)
_RERUN = "run `make verify` again"


def _read_csv(path: Path, committed: bool = True):
    from .figures import read_table

    return read_table(path, frame=True, committed=committed, remake=None if committed else _RERUN)


def _record(folder: Path, name: str, committed: bool = True) -> dict:
    """The provenance record of table ``name`` in ``folder``; ``{}`` if it has none, an error if it is damaged."""
    from .figures import read_provenance

    p = Path(folder) / f"{name}.provenance.json"
    if not p.exists():
        return {}
    return read_provenance(p, committed=committed, remake=None if committed else _RERUN)


def declared_tolerances(name: str, new_dir: Path, ref_dir: Path | None = None) -> tuple[dict[str, str], str]:
    """The declared tolerances of table ``name`` and where they come from.

    The regenerated table's provenance record first (the notebook as it is now), then the
    committed one's, then :data:`fisherkron.repro.verify_tolerances.TOLERANCES`.
    """
    from .verify_tolerances import TOLERANCES

    for folder, source in ((new_dir, "provenance"), (ref_dir, "committed provenance")):
        if folder is not None and (tol := _record(folder, name, committed=folder == ref_dir).get("tolerances")):
            return dict(tol), source + (" (also in verify_tolerances.py: that one is ignored)"
                                        if name in TOLERANCES else "")
    if name in TOLERANCES:
        return dict(TOLERANCES[name]), "verify_tolerances.py"
    return {}, "none"


def tables_of(folder: Path, notebook: str | None = None, committed: bool = True) -> list[str]:
    """Tables (``<name>.csv`` with a provenance record) in ``folder``, those of ``notebook`` only if given."""
    out = []
    for csv in sorted(Path(folder).glob("*.csv")):
        rec = _record(folder, csv.stem, committed)
        if notebook is None or rec.get("notebook") == f"notebooks/{notebook}.py":
            out.append(csv.stem)
    return out


def check_committed(ref_dir: Path, notebooks: list[str]) -> int:
    """Read every committed table of ``notebooks`` and every provenance record in ``ref_dir`` (which say which
    table is whose): a damaged one raises the one-line error before anything runs. The tables read."""
    wanted, n = {f"notebooks/{nb}.py" for nb in notebooks}, 0
    for csv in sorted(Path(ref_dir).glob("*.csv")):
        if _record(ref_dir, csv.stem).get("notebook") in wanted:
            _read_csv(csv)
            n += 1
    return n


# -- comparing ------------------------------------------------------------------------------
def _missing(v: Any) -> bool:
    return v is None or (isinstance(v, float) and math.isnan(v)) or (isinstance(v, str) and not v.strip())


def _py(v: Any) -> Any:
    return v.item() if hasattr(v, "item") else v


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _unit(text: str) -> float:
    """One unit in the last printed digit of a number as a table prints it: ``"0.263"`` -> 0.001,
    ``"94,632"`` -> 1, ``"1.5e+03"`` -> 100."""
    mant, _, exp = text.replace(",", "").lower().partition("e")
    decimals = len(mant.split(".", 1)[1]) if "." in mant else 0
    return 10.0 ** (int(exp or 0) - decimals)


def _numbers(s: str) -> tuple[str, list[float], int | None, list[float]]:
    """The words of a text cell (numbers replaced by #, emphasis dropped), its numbers, the index
    among them of the number after '±' (a spread, compared within its mean's tolerance), and the
    printing unit of each number (:func:`_unit`)."""
    s = _EMPHASIS.sub("", s)
    found = list(_NUM.finditer(s))
    at = next((i for i, m in enumerate(found) if s[:m.start()].rstrip().endswith("±")), None)
    return (_NUM.sub("#", s), [float(m.group().replace(",", "")) for m in found], at,
            [_unit(m.group()) for m in found])


def _cell(ref: Any, new: Any, tol: T.Tolerance, row: Mapping[str, Any],
          new_row: Mapping[str, Any] | None = None) -> tuple[float, float | None, float | None]:
    """``(margin, |diff|, width)`` of one value; margin <= 1 passes, ``inf`` for a mismatch of kind or words."""
    ref, new = _py(ref), _py(new)
    if _missing(ref) and _missing(new):
        return 0.0, 0.0, 0.0
    if _missing(ref) or _missing(new):
        return math.inf, None, None
    if isinstance(ref, bool) or isinstance(new, bool):
        return (0.0 if ref == new else math.inf), None, None
    if _is_num(ref) and _is_num(new):
        pairs, at, ur, un = [(ref, new)], None, [0.0], [0.0]  # stored numbers: no printing unit
    else:
        if str(ref) == str(new):
            return 0.0, 0.0, 0.0
        (wr, nr, at, ur), (wn, nn, _, un) = _numbers(str(ref)), _numbers(str(new))
        if wr != wn or len(nr) != len(nn):
            return math.inf, None, None
        pairs = list(zip(nr, nn))
    # a printed number stands for every value within half a unit of its last digit, so the printed
    # difference may exceed the computed one by half a unit of each ("0.562" and "0.613" are the seed
    # means 0.5625 and 0.6125, 0.05 apart, which a tolerance of 0.05 admits); and the difference itself
    # carries float rounding (0.275 - 0.225 = 0.05000000000000002)
    slack = [0.5 * (a + b) + 4 * sys.float_info.epsilon * max(abs(x), abs(y)) for a, b, (x, y) in zip(ur, un, pairs)]
    sd = None if at is None else abs(pairs[at][0])  # the committed spread
    sd_new = None if at is None else abs(pairs[at][1])  # the new run's
    worst = (0.0, 0.0, 0.0)
    for i, (a, b) in enumerate(pairs):
        if tol.kind == "exact":
            m = (0.0, 0.0, 0.0) if a == b else (math.inf, abs(b - a), 0.0)
        else:
            # a spread "m ± sd" is held to its mean's width: a relative tolerance of the spread itself
            # would ask a seed spread to reproduce more tightly than the mean it describes
            scale = pairs[i - 1][0] if i == at and i > 0 else a
            d, w = abs(b - a), tol.width(scale, row, cell_sd=sd, new_row=new_row, new_cell_sd=sd_new)
            m = (max(d - slack[i], 0.0) / w if w > 0 else (0.0 if d == 0 else math.inf), d, w)
        worst = max(worst, m, key=lambda t: t[0])
    return worst


def _ratio_summary(ref, new) -> str:
    import numpy as np

    r = [float(b) / float(a) for a, b in zip(ref, new)
         if _is_num(_py(a)) and _is_num(_py(b)) and not _missing(_py(a)) and not _missing(_py(b)) and a != 0]
    if r:
        return f"x{float(np.median(r)):.2f}"
    changed = sum(str(a) != str(b) for a, b in zip(ref, new))
    return f"{changed} of {len(ref)} changed"


def compare_frames(name: str, ref, new, declared: Mapping[str, str] | None = None, *, source: str = "",
                   identical: bool = False) -> TableReport:
    """Compare a regenerated table ``new`` with the committed ``ref`` (pandas DataFrames), value by value.

    Args:
        declared: column -> tolerance (:mod:`fisherkron.repro.tolerance`); other columns get
            :func:`fisherkron.repro.tolerance.default`, listed in ``defaults``.
        identical: every column that is not timing must be equal (the determinism test).
    """
    declared = dict(declared or {})
    rep = TableReport(name, source=source or ("declared" if declared else "none"))
    for col in declared:
        if col not in ref.columns:
            rep.notes.append(f"tolerance declared for {col!r}, which the committed table lacks")
    structural = []
    for col in ref.columns:
        if col not in new.columns:
            structural.append(Failure(name, None, "", col, "(column)", "(missing)", None, None, "column removed"))
    for col in new.columns:
        if col not in ref.columns:
            structural.append(Failure(name, None, "", col, "(missing)", "(column)", None, None, "column added"))
    if len(ref) != len(new):
        structural.append(Failure(name, None, "", None, f"{len(ref)} rows", f"{len(new)} rows", None, None,
                                  "row count"))
    rep.failures += structural
    if len(ref) != len(new):
        rep.status = "FAIL"
        rep.worst = math.inf
        return rep
    labels = [", ".join(str(_py(v)) for v in r[:2]) for r in ref.itertuples(index=False)]
    rows, new_rows = ref.to_dict("records"), new.to_dict("records")
    for col in [c for c in ref.columns if c in new.columns]:
        if col in declared:
            tol = T.parse(declared[col])
            rep.declared += 1
        else:
            tol, why = T.default(col, ref[col])
            rep.defaults[col] = f"{tol.spec} ({why})"
        if tol.kind == "timing":
            rep.timing[col] = _ratio_summary(list(ref[col]), list(new[col]))
            continue
        if identical:
            tol = T.parse("exact")
        rep.columns += 1
        for i, (a, b) in enumerate(zip(ref[col], new[col])):
            rep.values += 1
            margin, d, w = _cell(a, b, tol, rows[i], new_rows[i])
            if margin > rep.worst:
                rep.worst, rep.worst_at = margin, f"{col!r} row {i + 1}"
            if margin > 1:
                rep.failures.append(Failure(name, i + 1, labels[i], col, _py(a), _py(b), d, w, tol.spec))
    if rep.failures:
        rep.status = "FAIL"
        if structural:
            rep.worst = math.inf
    return rep


def compare_table(name: str, ref_dir: Path, new_dir: Path) -> TableReport:
    """Compare ``new_dir/<name>.csv`` with ``ref_dir/<name>.csv`` within the table's tolerances."""
    ref_dir, new_dir = Path(ref_dir), Path(new_dir)
    committed = _record(ref_dir, name)
    nb = _record(new_dir, name, committed=new_dir == ref_dir).get("notebook") or committed.get("notebook")
    if not (ref_dir / f"{name}.csv").is_file():
        return TableReport(name, nb, "NEW", notes=[f"no committed {ref_dir}/{name}.csv to compare with"])
    if not (new_dir / f"{name}.csv").is_file():
        rep = TableReport(name, nb, "MISSING", notes=[f"committed, but the run did not write {new_dir}/{name}.csv"])
        rep.failures.append(Failure(name, None, "", None, "(table)", "(missing)", None, None, "table not written"))
        return rep
    declared, source = declared_tolerances(name, new_dir, ref_dir)
    rep = compare_frames(name, _read_csv(ref_dir / f"{name}.csv"),
                         _read_csv(new_dir / f"{name}.csv", committed=new_dir == ref_dir), declared, source=source)
    if source == "provenance" and (old := committed.get("tolerances")):
        # the code's rule changed after the committed table was written: its record keeps the rule of then
        moved = {c: (old.get(c, "none"), t) for c, t in declared.items() if old.get(c) != t}
        if moved:
            rep.notes.append(f"{len(moved)} column(s) declared otherwise than the committed record, which keeps "
                             f"the declarations of the code that wrote it: " +
                             "; ".join(f"{c!r} {a} -> {b}" for c, (a, b) in moved.items()))
    rep.notebook = nb
    return rep


def compare_notebook(notebook: str, ref_dir: Path, new_dir: Path) -> list[TableReport]:
    """Every table that ``notebook`` wrote to ``new_dir`` or that ``ref_dir`` holds from it, compared."""
    names = sorted(set(tables_of(new_dir, notebook, committed=new_dir == ref_dir)) | set(tables_of(ref_dir, notebook)))
    return [compare_table(n, ref_dir, new_dir) for n in names]
