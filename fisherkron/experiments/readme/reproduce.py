"""README blocks of "Reproduce the paper": each notebook's run time and their sum, from ``wall_seconds``;
what ``make verify`` found, from its committed records in ``data/verify/``.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ...env import file_checksum
from .formats import and_list, cores, cpu, cpu_model, machine_name, num, secs, table

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


# -- Reproduce the paper: what make verify found ------------------------------------------------
def verify_records(out: Outputs) -> dict[str, dict]:
    """The committed ``make verify`` records (``data/verify/<notebook>.json`` beside ``figures/``), by notebook;
    a damaged one is the one-line error of :func:`fisherkron.experiments.verify.read_record`."""
    from ..verify import read_record

    paths = sorted((out.folder.parent / "data" / "verify").glob("*.json"))
    out.seen += paths
    return {p.stem: read_record(p) for p in paths}


def _changed_since(out: Outputs, rec: dict) -> list[str]:
    """The tables of a record whose committed ``.csv`` is no longer the one it was compared with."""
    changed = []
    for t in rec["tables"]:
        p = out.folder / f"{t['name']}.csv"
        if t.get("sha") is None or not p.is_file() or file_checksum(p) != t["sha"]:
            changed.append(t["name"])
    return changed


def _other_cpu(out: Outputs, rec: dict) -> str | None:
    """``"Intel Xeon against AMD EPYC"`` when a verify ran on another CPU model than the one that wrote the
    committed tables it was compared with (their provenance records say which), else None.

    float32 results differ in the last bits between CPU models, so such a run also tests the tables'
    tolerances across them.
    """
    if not rec.get("machine"):
        return None
    here = cpu_model(rec["machine"])
    wrote = {cpu_model(out.record(t["name"]).get("machine", {})) for t in rec["tables"]
             if (out.folder / f"{t['name']}.provenance.json").is_file()}
    wrote.discard(here)
    return f"{here} against {and_list(sorted(wrote))}" if wrote else None


def verify_record(out: Outputs) -> str:
    """One row per notebook: what its latest ``make verify`` run found, on what, and how long it took.

    A run vouches for the committed tables it was compared with (their checksums are in its
    record); a table changed since makes the row say so, and a notebook never verified says
    that too.
    """
    recs = verify_records(out)
    params = out.folder.parent / "notebooks" / "params"
    notebooks = sorted(p.name[: -len(".default.yaml")] for p in params.glob("*.default.yaml"))
    rows, outside, stale, crossed = [], [], [], []
    for nb in notebooks:
        rec = recs.get(nb)
        if rec is None:
            continue
        changed = _changed_since(out, rec)
        if changed:
            stale.append(nb)
        worst = ("" if not rec["tables"] else "identical" if rec["worst"] == 0
                 else "an exact value differs" if rec["worst"] == float("inf") else num(rec["worst"], 2))
        git = rec.get("git") or {}
        commit = (git.get("commit") or "")[:7] + (" (dirty)" if git.get("dirty") else "") if git else "not recorded"
        when = (rec.get("finished") or "")[:10] or "not recorded"
        result = {"NO TABLE": "ran without error (it writes no table)"}.get(rec["result"], rec["result"])
        result += f" (since then {and_list(f'`{c}`' for c in changed)} changed)" if changed else ""
        rows.append([f"`{nb}`", result, str(len(rec["tables"])), num(rec["values"]), worst,
                     rec.get("data") or "not recorded", secs(rec["seconds"]) if rec.get("seconds") else "?",
                     cores(rec.get("others_cpu_share")),
                     machine_name(rec["machine"]) if rec.get("machine") else "not recorded", commit, when])
        outside += [f"* `{nb}`: {f}" for f in rec["failures"]]
        # only a passing run of the tables as committed vouches for them across CPU models
        if rec["result"] == "PASS" and not changed and (other := _other_cpu(out, rec)) is not None:
            crossed.append(f"`{nb}` ({other})")
    never = [nb for nb in notebooks if nb not in recs]
    lines = [table(["notebook", "result", "tables", "values checked", "worst margin", "caches", "wall time",
                    "cores", "machine", "commit", "finished"], rows) if rows else "No notebook has been verified yet."]
    lines += ["", f"Values outside their tolerance in these runs: {num(len(outside)) + ':' if outside else 'none.'}",
              *outside]
    if crossed:
        lines += ["", f"Verified on another CPU model than the one that wrote the committed tables (float32 "
                      f"results differ in their last bits between models): {and_list(crossed)}."]
    if stale:
        lines += ["", f"Verified before a table changed (verify again): {and_list(f'`{n}`' for n in stale)}."]
    if never:
        lines += ["", f"Not yet verified: {and_list(f'`{n}`' for n in never)}."]
    return "\n".join(lines)


BLOCKS = {"time": notebook_time, "make-all-time": make_all_time, "verify-record": verify_record}
