"""README blocks of "Reproduce the paper": each notebook's run time and their sum, from ``wall_seconds``.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from .formats import cpu, secs

if TYPE_CHECKING:
    from . import Outputs


# -- Reproduce the paper: run times ------------------------------------------------------
def notebook_time(out: Outputs, notebook: str) -> str:
    """The wall time of a notebook's committed run (the latest of its records), or "not yet run"."""
    names = out.records(notebook)
    if not names:
        return "not yet run"
    return secs(max(out.wall(n) for n in names))


def make_all_time(out: Outputs) -> str:
    """The sum of every notebook's committed run time, and the machine when all ran on one kind."""
    recs = {out.record(p.name[: -len(".provenance.json")])["notebook"]: p for p in out.folder.glob("*.provenance.json")}
    nbs = sorted(nb for nb in recs if nb)
    total = sum(max(out.wall(n) for n in out.records(Path(nb).stem)) for nb in nbs)
    machines = {cpu(out, n) for nb in nbs for n in out.records(Path(nb).stem)}
    where = f" on the {machines.pop()}" if len(machines) == 1 else ""
    return f"{secs(total)} for the {len(nbs)} notebooks{where}"


BLOCKS = {"time": notebook_time, "make-all-time": make_all_time}
