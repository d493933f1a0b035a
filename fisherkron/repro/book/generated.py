"""Tables of the book's hand-written pages (``book/guide.md``, ``book/reproduce.md``), rendered at build time.

A page includes them (```` ```{include} _generated/verify_record.md ``` ````), so no number in its
prose is typed by hand. :func:`write_generated` writes ``<out>/_generated/<name>.md`` from the
committed files only (:mod:`.records` reads and formats them):

* ``verify_record.md``: one row per committed ``make verify`` record (``data/verify/<cpu>/*.json``);
* ``notebook_costs.md``: each notebook's page, paper item, ``make`` target and committed run time;
* ``bench.md``: the ``make bench`` machine, table, whole-MiniLM run and speed targets
  (``figures/bench/``), with its figure copied beside it;
* ``bench_recipe.md``: the ``make bench-recipe`` table (the recommended recipe against the old
  default, as ``fisherkron compress`` runs them) with the machine that measured it;
* ``bench_decompositions.md``: the ``make bench-decompositions`` table;
* ``bench_sweep.md``: the ``make bench-sweep`` tables;
* ``bench_overheads.md``: the ``make bench-overheads`` tables (cache keys' code hashes, the disjointness check,
  the GEMM peak);
* ``cold_run.md``: the cold run's notebooks, their runs and wall time over all of them, from its committed
  runs log (``data/ledger/cold/``, :mod:`fisherkron.repro.cold`), and where each finishing run's time went
  (its record's phases).
"""
from __future__ import annotations

import shutil
from collections import Counter
from pathlib import Path

from ...env import REPO_ROOT, atomic_write
from .. import cold, ledger
from .records import (Outputs, bench_minilm, bench_minutes, bench_table, bench_targets, machine_name,
                      make_all_time, notebook_time, num, other_cpu, paused_seconds, table, verify_records)
from ..figures import cpu_model
from ..verify import changed_tables
from .sources import pages

__all__ = ["FOLDER", "verify_table", "notebook_costs", "bench", "bench_recipe", "bench_decompositions", "bench_sweep",
           "bench_overheads", "phase_shares", "phase_hours", "cold_run", "write_generated"]

#: the folder, inside the book's source folder, that the pages include from
FOLDER = "_generated"
_BENCH = "bench/bench_mff"
_BENCH_FIGURE = "fig_bench_mff.png"
_RECIPE = "bench/bench_recipe"
_DECOMPOSITIONS = "bench/bench_decompositions"
_SWEEP = "bench/bench_sweep"
_OVERHEADS = ("bench/bench_code_hashes", "bench/bench_disjoint", "bench/bench_gemm_peak")


def _page(name: str, root: Path) -> str:
    """`` `name` `` linked to its notebook's page when the notebook exists."""
    return f"[`{name}`]({name}.ipynb)" if (root / "notebooks" / f"{name}.py").is_file() else f"`{name}`"


def _pinned(machine: dict) -> str:
    """``", kernels: ATen DEFAULT"`` where a record's run used other CPU kernels than the widest its CPU has (a
    lowered ATen capability or a pinned MKL branch: :func:`fisherkron.repro.figures.cpu_kernels`), else "".

    >>> _pinned({"cpu_isa": "AVX2", "kernels": "ATen DEFAULT"}), _pinned({"cpu_isa": "AVX2", "kernels": "ATen AVX2"})
    (', kernels: ATen DEFAULT', '')
    """
    kernels, isa = machine.get("kernels"), machine.get("cpu_isa") or ""
    own = "AVX512" if "AVX-512" in isa else "AVX2" if "AVX2" in isa else None
    if not kernels or (kernels == f"ATen {own}"):
        return ""
    return f", kernels: {kernels}"


def verify_table(out: Outputs, root: Path) -> str:
    """One compact row per committed ``make verify`` record (a notebook has one per CPU model it was verified on),
    in notebook order; the notebooks not yet verified on each CPU model, and not at all.

    The values outside tolerance are counted, not listed: each record lists them in its ``failures``.
    """
    recs = verify_records(out)
    rows, outside, stale, crossed = [], 0, [], []
    for (nb, _), rec in recs.items():
        result = {"NO TABLE": "ran (writes no table)"}.get(rec["result"], rec["result"])
        if rec["tables"] and changed_tables(rec, out.folder):
            stale.append(nb)
            result += " (a table changed since)"
        elif rec["result"] == "PASS" and (other := other_cpu(out, rec)) is not None:
            crossed.append(f"`{nb}` ({other})")
        worst = ("" if not rec["tables"] else "identical" if rec["worst"] == 0
                 else "an exact value differs" if rec["worst"] == float("inf") else num(rec["worst"], 2))
        outside += len(rec["failures"])
        rows.append([_page(nb, root), f"**{result}**" if rec["result"] == "FAIL" else result,
                     num(rec["values"]), worst, rec.get("data") or "not recorded",
                     machine_name(rec["machine"]) + _pinned(rec["machine"]) if rec.get("machine") else "not recorded",
                     (rec.get("finished") or "")[:10] or "not recorded"])
    if not rows:
        return "No notebook has been verified yet: `make verify` writes the first records.\n"
    lines = [table(["notebook", "result", "values checked", "worst margin", "data mode", "machine", "finished"],
                   rows), "",
             f"Values outside their tolerance in these runs: {num(outside)}; each record in `data/verify/` "
             "lists them (table, row, column, committed and new value, tolerance)."]
    if crossed:
        lines += ["", "Passed on another CPU model than the one that wrote the committed tables (float32 results "
                      "differ in their last bits between models): " + ", ".join(crossed) + "."]
    if stale:
        lines += ["", "Verified before one of its tables was regenerated (`make verify-stale` runs these again, and "
                      "the ones not yet verified or whose record failed): "
                      + ", ".join(f"`{n}`" for n in stale) + "."]
    models = {cpu: cpu_model(r["machine"].get("cpu")) for (_, cpu), r in recs.items() if r.get("machine")}
    verified: dict[str, set[str]] = {}  # notebook -> the CPU models that verified it
    for nb, cpu in recs:
        verified.setdefault(nb, set()).add(cpu)
    never = [p.name for p in pages(root) if p.name not in verified]
    if len(models) > 1:
        for cpu, name in sorted(models.items()):
            missing = [nb for nb, on in verified.items() if cpu not in on]
            if missing:
                lines += ["", f"Not yet verified on the {name}: " + ", ".join(f"`{n}`" for n in missing) + "."]
    if never:
        lines += ["", "Not yet verified: " + ", ".join(f"`{n}`" for n in never) + "."]
    return "\n".join(lines) + "\n"


def notebook_costs(out: Outputs, root: Path) -> str:
    """Each notebook's page, paper item, ``make`` target and the wall time of its committed run, less the time it
    was stopped for other measurements (the runs logs of ``data/ledger/`` and of the cold run's ledger)."""
    ledgers = [root / "data" / "ledger", root / "data" / "ledger" / "cold"]
    rows = [[f"[{p.title}]({p.name}.ipynb)", p.paper, f"`make {p.name}`", notebook_time(out, p.name, ledgers)]
            for p in pages(root)]
    return (table(["notebook", "paper item", "target", "committed run"], rows)
            + f"\n\nIn all: {make_all_time(out, ledgers)} (time a run was stopped for other measurements left "
              "out).\n")


def bench(out: Outputs, root: Path) -> str:
    """The committed ``make bench`` run: its machine, figure, table, whole-MiniLM run and targets."""
    rec, extra = out.record(_BENCH), out.extra(_BENCH)
    peak = max(extra["gemm_peak_gflops_start"], extra["gemm_peak_gflops_end"])
    where = (f"The committed run: `make bench` on a {machine_name(rec['machine'])} (torch "
             f"{rec['machine'].get('torch', '?')}), {bench_minutes(out)} to its last table, load average "
             f"{num(extra['load_average'][0], 1)} at its end (the benchmark included), GEMM peak measured in "
             f"the run {num(peak)} GFLOP/s (the \"% of peak\" column).")
    figure = f"![MFF benchmark: time per layer, speedups, matvecs per MiniLM layer]({FOLDER}/{_BENCH_FIGURE})"
    return "\n\n".join([where, figure, bench_table(out), bench_minilm(out),
                        "The speed targets set for MFF, each met or missed by these numbers:",
                        bench_targets(out)]) + "\n"


def _bench_where(out: Outputs, stem: str, target: str) -> str:
    """The sentence naming the machine and the date of a committed benchmark record ``figures/<stem>``."""
    rec = out.record(stem)
    return (f"The committed run: `make {target}` on a {machine_name(rec['machine'])}, finished "
            f"{str(rec.get('created_utc', ''))[:10] or 'on a date not recorded'}. A wall time is an upper bound where "
            "other processes took a share of the cores (the column \"other load\" or the last one).")


def _bench_run(out: Outputs, stem: str, target: str) -> str:
    """A committed benchmark table (``figures/<stem>``) and the machine that measured it (or that it has not run)."""
    if not (out.folder / f"{stem}.provenance.json").is_file():
        return f"`make {target}` has not been run on this checkout yet.\n"
    return _bench_where(out, stem, target) + "\n\n" + out.markdown(stem).rstrip() + "\n"


def _bench_runs(out: Outputs, stems: tuple[str, ...], target: str) -> str:
    """Several tables of one benchmark: the machine once, then each table under its caption."""
    if not all((out.folder / f"{s}.provenance.json").is_file() for s in stems):
        return f"`make {target}` has not been run on this checkout yet.\n"
    tables = [f"{out.record(s).get('caption') or ''}\n\n{out.markdown(s).rstrip()}" for s in stems]
    return "\n\n".join([_bench_where(out, stems[0], target), *tables]) + "\n"


def bench_recipe(out: Outputs, root: Path) -> str:
    """The committed ``make bench-recipe`` table and the machine that measured it (or that it has not run)."""
    return _bench_run(out, _RECIPE, "bench-recipe")


def bench_decompositions(out: Outputs, root: Path) -> str:
    """The committed ``make bench-decompositions`` table and the machine that measured it."""
    return _bench_run(out, _DECOMPOSITIONS, "bench-decompositions")


def bench_overheads(out: Outputs, root: Path) -> str:
    """The committed ``make bench-overheads`` tables: cache keys' code hashes, the disjointness check, the GEMM peak."""
    return _bench_runs(out, _OVERHEADS, "bench-overheads")


def bench_sweep(out: Outputs, root: Path) -> str:
    """The committed ``make bench-sweep`` tables: one sweep evaluation per block, and its CPU time by operator."""
    text = _bench_run(out, _SWEEP, "bench-sweep")
    caption = out.record(_SWEEP).get("caption") if (out.folder / f"{_SWEEP}.provenance.json").is_file() else None
    if caption:
        text += "\n" + caption + "\n"
    if (out.folder / f"{_SWEEP}_ops.provenance.json").is_file():
        text += "\n" + out.markdown(f"{_SWEEP}_ops").rstrip() + "\n"
    return text


def _finishing_record(out: Outputs, notebook: str) -> dict | None:
    """The record of ``notebook``'s committed run with the longest wall time among those with phases (the one
    that covers the run), or None."""
    recs = [r for r in (out.record(n) for n in out.records(notebook)) if r.get("phases") and r.get("wall_seconds")]
    return max(recs, key=lambda r: r["wall_seconds"]) if recs else None


def phase_hours(out: Outputs, notebooks, top: int = 4, ledgers=()) -> str:
    """The ``top`` largest phases summed over the finishing runs of ``notebooks`` (:func:`phase_shares`'s
    records), in hours, and the wall time of those runs less their pauses (:func:`paused_seconds`, from the runs
    logs of ``ledgers``): where the cold run's time went, in one line; "" when none has phases. Interrupted runs
    are not split into phases: the caches they filled were read by these. A phase is timed by the clock, so a
    pause that fell inside it is in it; the line says how much.

    >>> phase_hours(Outputs(Path("/nonexistent")), ["tab_x"])
    ''
    """
    recs = [r for r in (_finishing_record(out, n) for n in notebooks) if r is not None]
    if not recs:
        return ""
    sums: Counter[str] = Counter()
    for rec in recs:
        sums.update(rec["phases"])
    paused = sum(paused_seconds(r, ledgers) for r in recs)
    wall = sum(r["wall_seconds"] for r in recs) - paused
    parts = [f"{name} {num(sec / 3600, 2)} h" for name, sec in sums.most_common(top)]
    stopped = (f" ({num(paused / 3600, 2)} h for which a run was stopped for other measurements are left out of "
               "the total but counted in the phases they interrupted)") if paused >= 0.005 * wall else ""
    return (f"The finishing runs of the {len(recs)} finished notebooks took {num(wall / 3600, 2)} h, of which "
            + ", ".join(parts) + stopped + "; the time of interrupted runs, whose caches the finishing runs read, is "
            "not split into phases.")


def phase_shares(out: Outputs, notebook: str, top: int = 3, ledgers=()) -> str:
    """Where the committed run of ``notebook`` spent its wall time: its ``top`` largest phases (the library's
    timed steps, :mod:`fisherkron.core.phases`, exclusive of each other) as shares of the run's wall time, read
    from the record of that run with the longest wall time; "" when its records carry no phases. Where the run
    was stopped for other measurements (:func:`paused_seconds`, from the runs logs of ``ledgers``) for 5 % of
    that time or more, the share stopped is named: a phase is timed by the clock, so the phases it interrupted
    include it.

    Only the process that finished the notebook is counted: a resumed notebook's earlier runs filled caches
    that this one read.
    """
    rec = _finishing_record(out, notebook)
    if rec is None:
        return ""
    wall, shares = rec["wall_seconds"], sorted(rec["phases"].items(), key=lambda kv: -kv[1])
    parts = [f"{name} {100 * sec / wall:.0f} %" for name, sec in shares[:top] if sec >= 0.005 * wall]
    rest = wall - sum(rec["phases"].values())
    paused = paused_seconds(rec, ledgers)
    outside = [f"outside the library's phases {100 * rest / wall:.0f} %"] if rest > 0.05 * wall else []
    stopped = (f" ({100 * paused / wall:.0f} % of it stopped for other measurements, counted in the phases it "
               "interrupted)") if paused >= 0.05 * wall else ""
    return ", ".join(parts + outside) + stopped


def cold_run(out: Outputs, root: Path) -> str:
    """Each notebook of the cold run: finished or not, its runs and their wall time in all, where the finishing
    run's time went (:func:`phase_shares`), the machines, the total."""
    book = root / "data" / "ledger" / "cold"
    rows = cold.costs(book)
    apart = _run_apart(root)
    if not any(r["runs"] for r in rows):
        return "The cold run has not started on this checkout (`make cold-run`).\n" + apart
    body = [[_page(r["notebook"], root), "yes" if r["finished"] else "no", num(r["runs"]),
             num(r["seconds"] / 3600, 2) if r["runs"] else "",
             phase_shares(out, r["notebook"], ledgers=[book]) if r["finished"] else ""] for r in rows]
    total, finished = sum(r["seconds"] for r in rows), sum(r["finished"] for r in rows)
    target = _against_target(total / 3600, finished == len(rows), len(rows))
    spent = phase_hours(out, [r["notebook"] for r in rows if r["finished"]], ledgers=[book])
    return (table(["notebook", "finished", "runs", "hours", "where the finishing run's time went"], body)
            + f"\n\nIn all: {num(total / 3600, 2)} h of wall time, {finished} of {len(rows)} "
            f"notebooks finished, on {' and '.join(ledger.run_machines(book))} (pauses for other measurements left "
            f"out). {target}." + (f" {spent}" if spent else "") + "\n" + apart)


def _against_target(hours: float, done: bool, n: int) -> str:
    """Where a cold run of ``n`` notebooks that took ``hours`` so far (all of them ``done`` or not) stands against
    :data:`fisherkron.repro.cold.TARGET_HOURS`."""
    over = hours - cold.TARGET_HOURS
    if over > 0:
        where = f"exceeded by {num(over, 2)} h" + ("" if done else " already")
    elif done:
        where = "met"
    else:
        where = f"{num(-over, 2)} h away"
    return f"The target, {num(cold.TARGET_HOURS)} h for all {n} notebooks, is {where}"


def _run_apart(root: Path) -> str:
    """A line per notebook run apart from the cold run (:data:`fisherkron.repro.cold.EXCLUDED`): its wall time
    over all its runs at the default profile, from the studies' runs log (``data/ledger/``)."""
    got = ledger.run_costs(root / "data" / "ledger")
    lines = [f"{_page(n, root)}, run apart with a budget of its own: {num(got[n]['seconds'] / 3600, 2)} h of wall "
             f"time over {num(got[n]['runs'])} run(s), {'finished' if got[n]['finished'] else 'not finished'} "
             "(pauses for other measurements left out)." for n in cold.EXCLUDED if got.get(n, {}).get("runs")]
    return "".join(f"\n{line}\n" for line in lines)


_PAGES = {"verify_record": verify_table, "notebook_costs": notebook_costs, "bench": bench,
          "bench_recipe": bench_recipe, "bench_decompositions": bench_decompositions, "bench_sweep": bench_sweep,
          "bench_overheads": bench_overheads, "cold_run": cold_run}


def write_generated(out_dir: Path, root: Path = REPO_ROOT) -> list[Path]:
    """Write ``out_dir/_generated/<name>.md`` for every generated table (and the benchmark's figure).

    ``root`` is the repository whose committed ``figures/``, ``data/verify/`` and ``notebooks/`` are read.
    Returns the written paths.
    """
    folder = Path(out_dir) / FOLDER
    folder.mkdir(parents=True, exist_ok=True)
    out = Outputs(Path(root) / "figures")
    written = []
    for name, render in _PAGES.items():
        text = render(out, Path(root))
        path = folder / f"{name}.md"
        atomic_write(path, lambda tmp, text=text: Path(tmp).write_text(text, encoding="utf-8"))
        written.append(path)
    figure = Path(root) / "figures" / "bench" / _BENCH_FIGURE
    if figure.is_file():
        shutil.copy2(figure, folder / _BENCH_FIGURE)
        written.append(folder / _BENCH_FIGURE)
    return written
