"""The numbers of the book's hand-written pages, read from the committed records at build time.

``book/guide.md`` and ``book/reproduce.md`` include tables that :mod:`.generated` writes from
``figures/`` and ``data/verify/`` when the book is built: what each notebook's committed run took,
what ``make verify`` found, and the ``make bench`` run. This module reads those files (each once,
through :func:`fisherkron.env.read_committed`, so a damaged one is one line naming it) and formats
their numbers; no number in the pages is typed by hand.
"""
from __future__ import annotations

import re
import statistics
from collections.abc import Callable, Iterable
from datetime import datetime, timezone
from functools import cache
from pathlib import Path
from typing import Any

from ...core.errors import FisherkronError
from ...env import read_committed
from ..figures import cpu_model, machine_label, read_provenance, read_table

__all__ = ["Outputs", "num", "pct", "sci", "secs", "table", "machine_name", "paused_seconds", "run_seconds",
           "notebook_time", "make_all_time",
           "verify_records", "other_cpu", "bench_table", "bench_minilm", "bench_targets",
           "bench_minutes"]

MINUS = "\u2212"
WORDS = ["no", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]
#: the benchmark's targets (no output records them): speedup over the authors' approach at MFF's
#: tolerance, share of the measured GEMM peak, matvecs on real MiniLM layers from the K-FAC start,
#: minutes for the whole MiniLM, and seconds on one GPU for a Llama-2-7B MLP layer with 75 gradients
BENCH_SPEEDUP, BENCH_PEAK, BENCH_MATVECS, BENCH_MINILM_MIN, BENCH_GPU_S = 30, 0.70, 6, 3, 10
_BENCH = "bench/bench_mff"
_GPU = "bench/gpu/bench_mff"
_GPU_SHAPE = (11008, 4096, 75)


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

def num(x: float, d: int = 0) -> str:
    """Thousands separators, ``d`` decimals, a true minus sign.

    >>> num(1234.5), num(-0.74, 1), num(56.83, 1)
    ('1,234', '−0.7', '56.8')
    """
    s = f"{abs(x):,.{d}f}"
    return MINUS + s if x < 0 and s.strip("0.,") else s

def pct(x: float, d: int = 0) -> str:
    """A fraction as ``"33 %"``."""
    return f"{num(100 * x, d)} %"

def sci(x: float, d: int = 1) -> str:
    """``1.7e6``, ``5.4e-6``."""
    m, e = f"{x:.{d}e}".split("e")
    return f"{m}e{int(e)}"

def secs(s: float) -> str:
    """A duration: ``"0.8 s"``, ``"253 s"``, ``"44 min"``, ``"1 h 40 min"``."""
    if s < 10:
        return f"{s:.1f} s"
    if s < 600:
        return f"{s:.0f} s"
    m = round(s / 60)
    return f"{m} min" if m < 120 else f"{m // 60} h {m % 60} min"

def span(vals: Iterable[float], fmt: Callable[[float], str], sep: str = "-") -> str:
    """``lo-hi`` of ``vals`` in ``fmt`` (one value when both ends format alike)."""
    vals = list(vals)
    lo, hi = fmt(min(vals)), fmt(max(vals))
    return lo if lo == hi else f"{lo}{sep}{hi}"

def and_list(items: Iterable[str]) -> str:
    """``"a, b and c"``."""
    items = list(items)
    return " and ".join([", ".join(items[:-1]), items[-1]]) if len(items) > 1 else "".join(items)

def word(n: int) -> str:
    """Small counts in words (``"three"``), larger ones in digits."""
    return WORDS[n] if 0 <= n < len(WORDS) else num(n)

def table(header: list[str], rows: list[list[str]]) -> str:
    """A Markdown table."""
    return "\n".join(["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|",
                      *("| " + " | ".join(r) + " |" for r in rows)])

def cpu(out: Outputs, name: str) -> str:
    """``"2-core AMD EPYC"``: the machine a record was made on."""
    return machine_name(out.record(name).get("machine", {}))

def machine_name(m: dict) -> str:
    """``"2-core AMD EPYC"`` from a record's ``machine`` (its ``cpu`` and ``cpu_count``), with the CPU's vector
    extensions where the record has them (:func:`fisherkron.repro.figures.machine_label`).

    >>> machine_name({"cpu": "Intel(R) Xeon(R) Processor", "cpu_count": 2})
    '2-core Intel Xeon'
    >>> machine_name({"cpu": "AMD EPYC", "cpu_count": 2, "cpu_isa": "AVX2"})
    '2-core AMD EPYC (AVX2)'
    """
    return machine_label(m.get("cpu_count"), m.get("cpu"), m.get("cpu_isa"))

def paused_seconds(rec: dict[str, Any], ledgers: Iterable[Path] = ()) -> float:
    """How long the run that wrote record ``rec`` was stopped for other measurements between its first cell and
    the record (its ``wall_seconds`` up to its ``created_utc``), as the runs logs of ``ledgers`` record
    (:func:`fisherkron.repro.ledger.paused_within`); 0 for a record without its time."""
    from .. import ledger

    try:
        end = datetime.strptime(str(rec.get("created_utc")), "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc)
    except ValueError:
        return 0.0
    wall, notebook = float(rec["wall_seconds"]), Path(str(rec.get("notebook"))).stem
    return ledger.paused_within(notebook, end.timestamp() - wall, end.timestamp(), ledgers)

def run_seconds(out: Outputs, notebook: str, ledgers: Iterable[Path] = ()) -> float:
    """The wall time of a notebook's committed run: the ``wall_seconds`` of its last record (the largest), less
    the time the run was stopped meanwhile (:func:`paused_seconds`)."""
    rec = out.record(max(out.records(notebook), key=out.wall))
    return float(rec["wall_seconds"]) - paused_seconds(rec, ledgers)

def notebook_time(out: Outputs, notebook: str, ledgers: Iterable[Path] = ()) -> str:
    """The wall time of a notebook's committed run (:func:`run_seconds`), or "not yet run"."""
    return secs(run_seconds(out, notebook, ledgers)) if out.records(notebook) else "not yet run"

def make_all_time(out: Outputs, ledgers: Iterable[Path] = ()) -> str:
    """The sum of every notebook's committed run time, and the machine when all ran on one kind."""
    recs = {out.record(p.name[: -len(".provenance.json")])["notebook"]: p for p in out.folder.glob("*.provenance.json")}
    nbs = sorted(nb for nb in recs if nb)
    total = sum(run_seconds(out, Path(nb).stem, ledgers) for nb in nbs)
    machines = {cpu(out, n) for nb in nbs for n in out.records(Path(nb).stem)}
    where = f" on the {machines.pop()}" if len(machines) == 1 else ""
    return f"{secs(total)} for the {len(nbs)} notebooks{where}"

def verify_records(out: Outputs) -> dict[tuple[str, str], dict]:
    """The committed ``make verify`` records (``data/verify/<cpu>/<notebook>.json`` beside ``figures/``), by
    (notebook, CPU model folder); a damaged one is the one-line error of
    :func:`fisherkron.repro.verify.read_record`."""
    from ..verify import read_records  # the make-verify record layout

    folder = out.folder.parent / "data" / "verify"
    out.seen += sorted(folder.glob("*/*.json"))
    return read_records(folder)

def other_cpu(out: Outputs, rec: dict) -> str | None:
    """``"Intel Xeon against AMD EPYC"`` when a verify ran on another CPU model than the one that wrote the
    committed tables it was compared with (their provenance records say which), else None.

    float32 results differ in the last bits between CPU models, so such a run also tests the tables'
    tolerances across them.
    """
    if not rec.get("machine"):
        return None
    here = cpu_model(rec["machine"].get("cpu"))
    wrote = {cpu_model(out.record(t["name"]).get("machine", {}).get("cpu")) for t in rec["tables"]
             if (out.folder / f"{t['name']}.provenance.json").is_file()}
    wrote.discard(here)
    return f"{here} against {and_list(sorted(wrote))}" if wrote else None

def _bench(out: Outputs) -> list[dict]:
    return out.table(_BENCH)

def bench_table(out: Outputs) -> str:
    """The benchmark table (``bench_mff``)."""
    body = []
    for r in _bench(out):
        n, m, k = int(r["n"]), int(r["m"]), int(r["k"])
        case = str(r["case"])
        if case.startswith("MiniLM "):
            layer = re.search(r"layer\.(\d+)\.(.*)$", case)
            case = f"MiniLM layer {layer[1]} {layer[2]}, {n}×{m}×{k} (real)"
        else:
            case = case.replace("x", "×")
        t = lambda s: f"{s:.2f} s" if s < 10 else f"{s:.1f} s" if s < 100 else f"{s:.0f} s"  # noqa: E731
        body.append([case, t(r["ours_s"]), t(r["ident_s"]), t(r["authors_s"]),
                     f"{r['speedup']:.0f}× / {r['speedup_ident']:.0f}×", t(r["authors_f32_s"]),
                     f"{r['speedup_vs_f32']:.0f}×",
                     f"{r['ours_matvecs']:.0f} / {r['ident_matvecs']:.0f} / {r['authors_matvecs']:.0f}",
                     f"{r['ours_gflops']:.0f} GFLOP/s", f"{r['ours_pct_peak']:.0f}%",
                     f"{sci(r['ours_err'])} / {sci(r['ident_err'])}"])
    return table(["gradients (n × m × k)", "ours, K-FAC start", "ours, default start",
                   "authors' (float64, as published)", "speedup K-FAC / default", "authors' in float32",
                   "speedup vs float32, K-FAC start", "matvecs K-FAC / default / authors'", "our GEMMs", "% of peak",
                   "error K-FAC / default"], body)

def _minilm(out: Outputs) -> tuple[dict, dict]:
    rows = out.table("bench/bench_minilm_layers")
    by = {}
    for r in rows:
        by.setdefault(r["start"], []).append(r)
    return by, out.extra("bench/bench_minilm_layers")

def bench_minilm(out: Outputs) -> str:
    """Whole MiniLM (``bench_minilm_layers``): times, matvecs per layer, the slow layers."""
    by, e = _minilm(out)
    k = int(by["kfac"][0]["k"])
    n = len(by["kfac"])

    def mv(rows: list[dict]) -> str:
        x = [r["matvecs"] for r in rows]
        return (f"median {statistics.median(x):g}, range {min(x):.0f}–{max(x):.0f}, ≤ {BENCH_MATVECS} on "
                f"{sum(v <= BENCH_MATVECS for v in x)} of {len(x)}")
    conv = all(r["converged"] for rows in by.values() for r in rows)
    slow = sorted(by["kfac"], key=lambda r: -r["matvecs"])[:3]
    return "\n".join([
        f"**Whole MiniLM** (all {n} linear layers, k = {k} SST-2 batch gradients):",
        f"* factorisation end to end from the `.npy` gradient files: **{num(e['end_to_end_seconds'], 1)} s** with "
        f"the K-FAC start, **{num(e['end_to_end_seconds_identity'], 1)} s** with the default start;",
        f"* matvecs per layer, K-FAC start: {mv(by['kfac'])} layers. Default start: {mv(by['identity'])} (but its "
        f"first product is cheap). {'All layers converged.' if conv else 'Not every layer converged.'}",
        f"* The error estimate is at most {sci(max(r['err_estimate'] for r in by['kfac']))} (K-FAC start) and "
        f"{sci(max(r['err_estimate'] for r in by['identity']))} (default start); errors against float64 references "
        "for every layer were measured separately (not in the committed table) and stayed below the target.",
        "* The slow layers are attention queries and keys: " + ", ".join(
            f"{r['layer'].replace('bert.encoder.layer.', 'block ').replace('.attention.self.', ' ')} "
            f"({r['matvecs']:.0f} matvecs)" for r in slow) + " with the K-FAC start."])

def bench_targets(out: Outputs) -> str:
    """The benchmark's targets, each met or missed by its numbers."""
    rows = _bench(out)
    by, e = _minilm(out)
    peak_end = out.extra(_BENCH)["gemm_peak_gflops_end"]
    real = [r for r in rows if str(r["case"]).startswith("MiniLM")]
    synth = [r for r in rows if r not in real]
    err = max(max(r["ours_err"], r["ident_err"]) for r in rows)
    ok_ident = all(r["speedup_ident"] >= BENCH_SPEEDUP for r in rows)
    ok_kfac = all(r["speedup"] >= BENCH_SPEEDUP for r in rows)
    rng = lambda xs: span(xs, lambda x: f"{x:.0f}", "–")  # noqa: E731
    kfac_words = ("met with both starts" if ok_ident and ok_kfac else
                  "met with the default start, not with the K-FAC start on synthetic data" if ok_ident else "missed")
    pct_peak = [r["ours_pct_peak"] for r in rows]
    pct_end = [100 * r["ours_gflops"] / peak_end for r in rows]
    peak_words = ("met" if min(pct_peak) >= 100 * BENCH_PEAK else
                  "missed" if max(pct_peak) < 100 * BENCH_PEAK else "borderline")
    kx = [r["matvecs"] for r in by["kfac"]]
    med_ok = statistics.median(kx) <= BENCH_MATVECS
    mv_words = ("met for every layer" if max(kx) <= BENCH_MATVECS else
                "met for the median, not for every layer" if med_ok else "missed")
    whole = (e["end_to_end_seconds"], e["end_to_end_seconds_identity"])
    body = [
        [f"≥ {BENCH_SPEEDUP}× faster than the authors' approach at ≤ {sci(out.params(_BENCH)['tol'], 0)} error",
         f"**{kfac_words}.** Default start: {rng([r['speedup_ident'] for r in rows])}× on all {word(len(rows))} "
         f"cases. K-FAC start: {rng([r['speedup'] for r in real])}× on the real MiniLM layer, "
         f"{rng([r['speedup'] for r in synth])}× on the synthetic ones. Errors ≤ {sci(err)}. Against the authors' "
         "algorithm run in float32 (faster than their scripts), the speedups are "
         f"{rng([r['speedup_vs_f32'] for r in rows])}×: that target is "
         f"**{'met' if min(r['speedup_vs_f32'] for r in rows) >= BENCH_SPEEDUP else 'missed'}**"],
        [f"≥ {pct(BENCH_PEAK)} of the measured GEMM peak",
         f"**{peak_words}**: {rng(pct_peak)}% of the best peak measured in the run ({rng(pct_end)}% of the peak "
         "measured at its end)"],
        [f"≤ {BENCH_MATVECS} matvecs with the K-FAC warm start on real MiniLM gradients",
         f"**{mv_words}**: median {statistics.median(kx):g}, ≤ {BENCH_MATVECS} on "
         f"{sum(x <= BENCH_MATVECS for x in kx)} of {len(kx)} layers, up to {max(kx):.0f} on early attention queries "
         "and keys"],
        [f"whole MiniLM ≤ {BENCH_MINILM_MIN} min",
         f"**{'met' if max(whole) <= 60 * BENCH_MINILM_MIN else 'missed'}**: {num(whole[0], 1)} s (K-FAC start), "
         f"{num(whole[1], 1)} s (default start)"],
        [f"GPU: 11008×4096 with 75 gradients ≤ {BENCH_GPU_S} s", gpu_target(out)]]
    return table(["target", "result"], body)

def _gpu(out: Outputs) -> tuple[list[dict], dict] | None:
    """The rows and provenance of the committed GPU run (``figures/bench/gpu/``), or ``None`` before one."""
    if not (out.folder / f"{_GPU}.csv").is_file():
        return None
    return out.table(_GPU), out.record(_GPU)

def gpu_target(out: Outputs) -> str:
    """The GPU row of the targets: met or missed by ``figures/bench/gpu/bench_mff``, or how to measure it."""
    g = _gpu(out)
    if g is None:
        return ("**not measured**: no GPU has run it. Run `scripts/gpu_check.sh` where one is (gradients stay "
                "on the device, timings are synchronised) and commit its tables under `figures/bench/gpu/`")
    rows, rec = g
    shape = lambda r: (int(r["n"]), int(r["m"]), int(r["k"]))  # noqa: E731
    main = [r for r in rows if shape(r) == _GPU_SHAPE]
    if not main:
        raise FisherkronError(f"figures/{_GPU}.csv has no {'x'.join(map(str, _GPU_SHAPE))} row: rerun scripts/gpu_check.sh")
    r = main[0]
    worst = max(r["ours_s"], r["ident_s"])
    m = rec.get("machine", {})
    n, mm, _ = _GPU_SHAPE
    quoted = [t["paper GPU seconds"] for t in out.table("tab_time_algo") if t["layer (n x m)"] == f"{n} x {mm}"]
    paper = (f"The paper's Fig. time_algo gives {num(quoted[0])} s for this shape on its GPU "
             f"(`figures/tab_time_algo.md`). " if quoted else "")
    others = "; ".join(f"{int(o['n'])}×{int(o['m'])}: {num(o['ours_s'], 1)} s and {num(o['ident_s'], 1)} s"
                       for o in rows if o is not r)
    return (f"**{'met' if worst <= BENCH_GPU_S else 'missed'}** on one {m.get('cuda', 'GPU')} (torch "
            f"{m.get('torch', '?')}, float32 without TF32): **{num(r['ours_s'], 1)} s** from the K-FAC start, "
            f"**{num(r['ident_s'], 1)} s** from the default start ({r['ours_matvecs']:.0f} and "
            f"{r['ident_matvecs']:.0f} products; A⊗B errors {sci(r['ours_err'])} and {sci(r['ident_err'])} against a "
            f"float64 MFF), {num(r['ours_pct_peak'])} % of the float32 GEMM peak measured there "
            f"({num(r['peak_gflops'] / 1000)} TFLOP/s). " + paper + (f"The other Llama-2-7B shapes (K-FAC and default start): {others}. " if others else "")
            + "`scripts/gpu_check.sh`, files in `figures/bench/gpu/`")

def bench_minutes(out: Outputs) -> str:
    """The benchmark run's time to its last table (inline)."""
    total = max(out.wall(_BENCH), out.wall("bench/bench_minilm_layers"))
    return f"{num(total / 60, 1)} min"
