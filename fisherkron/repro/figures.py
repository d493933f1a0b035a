"""Writing the paper's figures and tables: atomic files with a provenance record.

Notebooks (``notebooks/``) call these helpers so that every artefact in
``figures/`` is written the same way:

* a figure ``<name>`` becomes ``<name>.png`` and ``<name>.pdf``;
* a table ``<name>`` becomes ``<name>.csv``, ``<name>.md`` and ``<name>.tex``;
* next to either, ``<name>.provenance.json`` records the git commit, the
  notebook parameters, the machine, the library versions and the wall time,
  and for a table the tolerance of each column that the notebook declared
  (``save_table(..., tolerances=...)``, read by ``make verify``).

:func:`read_provenance` and :func:`read_table` read them back for the tools that render or compare
from committed outputs (``make readme``, ``make verify``, ``make book``): a damaged file is one error
naming it and what to do (:func:`fisherkron.env.read_committed`).

Every file is written to a temporary name in the destination folder and moved
into place (:func:`fisherkron.env.atomic_write`), so an interrupted run never leaves a
half-written artefact behind. Relative output folders are resolved against the
repository root (the folder holding ``pyproject.toml``), so a notebook gives
the same paths whether it runs from the repository root (``make``) or from
``notebooks/`` (Jupyter).
"""
from __future__ import annotations

import json
import math
import os
import platform
import re
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..core.errors import FisherkronError
from ..core import phases
from ..env import REPO_ROOT, atomic_write, csv_rows, json_object, read_committed, shown
from . import tolerance

__all__ = ["repo_root", "output_dir", "save_figure", "save_table", "provenance",
           "write_provenance", "read_provenance", "read_table", "latex_table", "machine_info", "cpu_name", "cpu_isa",
           "cpu_kernels", "cpu_model", "machine_label", "git_commit"]

_T0 = time.perf_counter()  # import time of this module: the start of a notebook's clock by default


def repo_root(start: str | os.PathLike | None = None) -> Path:
    """The nearest folder at or above ``start`` (default: the cwd) holding ``pyproject.toml``.

    Falls back to the package's parent folder when no such folder is found.
    """
    here = Path(start or os.getcwd()).resolve()
    for d in (here, *here.parents):
        if (d / "pyproject.toml").is_file() and (d / "fisherkron").is_dir():
            return d
    return REPO_ROOT


def output_dir(path: str | os.PathLike) -> Path:
    """``path`` made absolute against :func:`repo_root` (if relative) and created."""
    p = Path(path)
    if not p.is_absolute():
        p = repo_root() / p
    p.mkdir(parents=True, exist_ok=True)
    return p


def _write_text(path: Path, text: str) -> Path:
    def w(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(text)
    return atomic_write(path, w)


# -- provenance ------------------------------------------------------------------
#: the folders of generated outputs (rewritten by the runs themselves): not part of a run's "dirty" source state
GENERATED = ("figures", "notebooks/executed")


def git_commit(root: Path | None = None) -> dict[str, Any]:
    """``{"commit": sha or None, "dirty": bool or None}`` of the repository at ``root``.

    ``dirty``: a tracked file differs from the commit, the generated outputs aside (:data:`GENERATED`): a notebook
    that rewrites its committed figures one after another would otherwise record its own first outputs as
    uncommitted changes in the provenance of its later ones."""
    root = root or repo_root()
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                             timeout=10).stdout.strip() or None
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".",
                                 *(f":(exclude){g}" for g in GENERATED)], cwd=root,
                                capture_output=True, text=True, timeout=10)
        dirty = bool(status.stdout.strip()) if status.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        sha, dirty = None, None
    return {"commit": sha, "dirty": dirty}


def _cpuinfo(field: str) -> str | None:
    """The value of the first ``field`` line of ``/proc/cpuinfo``, or ``None`` where there is none."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            return next((line.split(":", 1)[1].strip() for line in fh if line.lower().startswith(field)), None)
    except OSError:
        return None


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), or what :mod:`platform` says."""
    return _cpuinfo("model name") or platform.processor() or "unknown"


#: the vector extensions that set a CPU's matrix-product rate, as /proc/cpuinfo flags them, and their names
ISA = (("avx2", "AVX2"), ("avx512f", "AVX-512"), ("avx512_bf16", "AVX-512 BF16"), ("amx_tile", "AMX"))


def cpu_model(cpu: str | None) -> str:
    """A CPU's model name as the book writes it: trademarks and "Processor" dropped.

    >>> cpu_model("Intel(R) Xeon(R) Processor")
    'Intel Xeon'
    """
    return re.sub(r"\((R|TM)\)| Processor| CPU", "", str(cpu or "unknown CPU")).strip()


def machine_label(cores, cpu: str | None, isa: str | None = None) -> str:
    """``"2-core AMD EPYC (AVX2)"``: a machine as provenance records and the runs log name it (the extensions
    where recorded).

    >>> machine_label(2, "Intel(R) Xeon(R) Processor")
    '2-core Intel Xeon'
    >>> machine_label(2, "AMD EPYC", "AVX2")
    '2-core AMD EPYC (AVX2)'
    """
    return f"{cores if cores is not None else '?'}-core {cpu_model(cpu)}" + (f" ({isa})" if isa else "")


def cpu_isa(flags: str | None = None) -> str | None:
    """The matrix-product extensions of this CPU, comma-separated (``"AVX2"``, ``"AVX2, AVX-512, AMX"``), from
    the ``flags`` line of ``/proc/cpuinfo`` (or ``flags`` given); ``None`` where the line cannot be read.

    Two CPUs reported under one model name can differ here (AVX-512 doubles AVX2's vector width, AMX adds
    matrix units), so wall times compare only between machines with the same extensions; ``"none"`` for a CPU
    with none of :data:`ISA`."""
    if flags is None:
        flags = _cpuinfo("flags")
    if flags is None:
        return None
    have = set(flags.split())
    return ", ".join(name for flag, name in ISA if flag in have) or "none"


def cpu_kernels() -> str:
    """Which CPU kernels torch runs: ATen's vectorised code (``ATEN_CPU_CAPABILITY`` can lower it from the
    CPU's best), MKL's code branch where ``MKL_CBWR`` pins one and oneDNN's widest instructions where
    ``ONEDNN_MAX_CPU_ISA`` bounds them, e.g. ``"ATen AVX2"``, ``"ATen DEFAULT, MKL_CBWR=AVX2"``.

    Float32 results differ in their last bits between kernels of different vector widths, so two runs give the
    same bits only where this string (and the thread count) agree."""
    import torch

    out = f"ATen {torch.backends.cpu.get_cpu_capability()}"
    return out + "".join(f", {var}={os.environ[var]}" for var in ("MKL_CBWR", "ONEDNN_MAX_CPU_ISA")
                         if os.environ.get(var))


def machine_info() -> dict[str, Any]:
    """Platform, CPU model and its vector extensions, usable cores, torch threads, GPU (if any) and library
    versions."""
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "cpu": cpu_name(),
        "cpu_isa": cpu_isa(),
        "cpu_count": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
    }
    try:
        import torch
        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
        info["kernels"] = cpu_kernels()
        info["cuda"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except ImportError:  # pragma: no cover
        info["torch"] = None
    for mod in ("numpy", "scipy", "matplotlib", "pandas"):
        m = sys.modules.get(mod)
        if m is not None:
            info[mod] = getattr(m, "__version__", None)
    return info


def _jsonable(x: Any) -> Any:
    if isinstance(x, Mapping):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, (str, int, float, bool)) or x is None:
        return x
    if hasattr(x, "item") and getattr(x, "ndim", 1) == 0:  # numpy / torch scalars
        return _jsonable(x.item())
    return str(x)


def provenance(name: str, params: Mapping[str, Any] | None = None, *, files: list[str] | None = None,
               started: float | None = None, notebook: str | None = None,
               extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The provenance record of one artefact.

    Args:
        name: artefact name (e.g. ``fig_corr``).
        params: the notebook parameters that produced it.
        files: the file names written for it.
        started: ``time.perf_counter()`` at the start of the run; the wall time
            is measured from it (default: when this module was imported).
        notebook: the notebook that produced it (``notebooks/<name>.py``).
        extra: anything else worth recording (e.g. measured summary numbers).

    The record's ``phases`` are the seconds this process has spent so far in each of the library's
    timed phases (:func:`fisherkron.core.phases.seconds`: calibration, MFF, sweeps, scoring, ...).
    """
    wall = time.perf_counter() - (_T0 if started is None else started)
    if not 0.0 <= wall < 1e8:  # a time.time() (seconds since 1970) is not a perf_counter() reading
        raise FisherkronError(f"provenance of {name}: started={started!r} is not a time.perf_counter() reading "
                              f"of this process (the wall time would be {wall:.0f} s); pass time.perf_counter()")
    rec: dict[str, Any] = {
        "name": name,
        "notebook": notebook,
        "files": files or [],
        "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "wall_seconds": round(wall, 3),
        "git": git_commit(),
        "parameters": _jsonable(dict(params or {})),
        "machine": machine_info(),
        "phases": phases.seconds(),
    }
    if extra:
        rec["extra"] = _jsonable(dict(extra))
    return rec


def write_provenance(folder: str | os.PathLike, name: str, record: Mapping[str, Any]) -> Path:
    """Write ``record`` to ``<folder>/<name>.provenance.json`` atomically."""
    return _write_text(output_dir(folder) / f"{name}.provenance.json",
                       json.dumps(_jsonable(dict(record)), indent=2, sort_keys=False) + "\n")


#: the kinds of a provenance record's fields (:func:`provenance`), checked where present: records of older
#: runs and of tests lack some
PROVENANCE_FIELDS = {"name": "text", "notebook": "text|null", "files": "list", "created_utc": "text",
                     "wall_seconds": "number", "git": "object|null", "parameters": "object", "machine": "object",
                     "caption": "text", "tolerances": "object", "extra": "object", "phases": "object"}


def _tolerances_parse(record: dict) -> None:
    for spec in (record.get("tolerances") or {}).values():
        tolerance.parse(spec)  # a hand-edited declaration is refused here, naming the file


def _remake(notebook: str | None, path: Path) -> str:
    if notebook:
        return f"re-run its notebook: `rm {shown(path)} && make {Path(notebook).stem}`"
    return "re-run the notebook that writes it (`make help` lists them)"


def read_provenance(path: str | os.PathLike, *, remake: str | None = None, committed: bool = True) -> dict[str, Any]:
    """The provenance record at ``path``; a damaged one (not JSON, not an object, a field of another kind,
    an unreadable tolerance) is one :class:`FisherkronError` naming the file and what to do.

    ``committed``: the file is a committed output (the advice is ``git checkout``), not one a run just wrote;
    ``remake``: how to write it again (default: re-run the notebook that writes it).
    """
    return read_committed(path, json_object(optional=PROVENANCE_FIELDS, check=_tolerances_parse),
                          what="a provenance record (JSON)", remake=remake or _remake(None, Path(path)),
                          committed=committed)


def read_table(path: str | os.PathLike, *, notebook: str | None = None, remake: str | None = None,
               committed: bool = True, frame: bool = False):
    """The rows of the table ``path`` (``<name>.csv``) as ``{column: cell text}``, or with ``frame`` a pandas
    DataFrame (``pd.read_csv``'s types); a damaged one (empty, binary, cut short) is one
    :class:`FisherkronError` naming the file and what to do. ``notebook``: the one that writes it, for
    that advice (default: the one its provenance record names, if that is readable); ``remake``, ``committed``:
    as for :func:`read_provenance`.
    """
    path = Path(path)
    if notebook is None and remake is None:
        try:
            notebook = read_provenance(path.with_suffix(".provenance.json")).get("notebook")
        except FisherkronError:
            notebook = None

    def parse(text: str):
        rows = csv_rows(text)
        if not frame:
            return rows
        import io

        import pandas as pd

        return pd.read_csv(io.StringIO(text))

    return read_committed(path, parse, what="a CSV table", remake=remake or _remake(notebook, path),
                          committed=committed)


# -- figures ---------------------------------------------------------------------
def save_figure(fig, name: str, folder: str | os.PathLike, params: Mapping[str, Any] | None = None, *,
                started: float | None = None, notebook: str | None = None, dpi: int = 150,
                extra: Mapping[str, Any] | None = None) -> list[Path]:
    """Save a matplotlib figure as ``<folder>/<name>.png`` and ``.pdf`` plus its provenance record.

    The PDF is written without a creation date so re-running an unchanged
    notebook gives the same PDF bytes.

    Returns:
        The paths written (PNG, PDF, provenance JSON).
    """
    if not name or "/" in name:
        raise FisherkronError(f"figure name must be a plain file stem, got {name!r}")
    out = output_dir(folder)
    png = atomic_write(out / f"{name}.png", lambda t: fig.savefig(t, dpi=dpi, bbox_inches="tight",
                                                                   metadata={"Software": None}))
    pdf = atomic_write(out / f"{name}.pdf", lambda t: fig.savefig(t, bbox_inches="tight",
                                                                   metadata={"CreationDate": None,
                                                                             "Creator": None,
                                                                             "Producer": None}))
    rec = provenance(name, params, files=[png.name, pdf.name], started=started, notebook=notebook, extra=extra)
    return [png, pdf, write_provenance(out, name, rec)]


# -- tables ----------------------------------------------------------------------
def _tex_escape(s: str) -> str:
    repl = {"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_",
            "{": r"\{", "}": r"\}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}"}
    return "".join(repl.get(c, c) for c in s)


def _fmt(v: Any, floatfmt: str) -> str:
    if isinstance(v, float):
        return "" if math.isnan(v) else format(v, floatfmt)
    if hasattr(v, "item") and getattr(v, "ndim", 1) == 0:
        return _fmt(v.item(), floatfmt)
    return str(v)


def latex_table(df, *, caption: str | None = None, label: str | None = None, floatfmt: str = ".4g") -> str:
    """A booktabs ``tabular`` for a pandas DataFrame (index dropped), no jinja2 needed.

    >>> import pandas as pd
    >>> print(latex_table(pd.DataFrame({"a_b": [1.5], "c": ["x&y"]})))
    \\begin{tabular}{rl}
    \\toprule
    a\\_b & c \\\\
    \\midrule
    1.5 & x\\&y \\\\
    \\bottomrule
    \\end{tabular}
    <BLANKLINE>
    """
    import pandas as pd

    align = "".join("r" if pd.api.types.is_numeric_dtype(df[c]) else "l" for c in df.columns)
    lines = [rf"\begin{{tabular}}{{{align}}}", r"\toprule",
             " & ".join(_tex_escape(str(c)) for c in df.columns) + r" \\", r"\midrule"]
    for row in df.itertuples(index=False):
        lines.append(" & ".join(_tex_escape(_fmt(v, floatfmt)) for v in row) + r" \\")
    lines += [r"\bottomrule", r"\end{tabular}"]
    body = "\n".join(lines) + "\n"
    if caption is None and label is None:
        return body
    head = [r"\begin{table}[!htbp]", r"\centering"]
    if caption:
        head.append(rf"\caption{{{_tex_escape(caption)}}}")
    if label:
        head.append(rf"\label{{{label}}}")
    return "\n".join(head) + "\n" + body + r"\end{table}" + "\n"


def _markdown_table(df, floatfmt: str) -> str:
    cols = [str(c) for c in df.columns]
    rows = [[_fmt(v, floatfmt).replace("|", r"\|") for v in r] for r in df.itertuples(index=False)]
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def save_table(df, name: str, folder: str | os.PathLike, params: Mapping[str, Any] | None = None, *,
               caption: str | None = None, label: str | None = None, floatfmt: str = ".4g",
               started: float | None = None, notebook: str | None = None,
               extra: Mapping[str, Any] | None = None, tolerances: Mapping[str, str] | None = None) -> list[Path]:
    """Save a DataFrame as ``<folder>/<name>.csv``, ``.md`` and ``.tex`` plus its provenance record.

    The CSV keeps full precision; Markdown and LaTeX use ``floatfmt``. The
    index is not written (put what matters into columns first).

    Args:
        tolerances: column -> how far a rerun's value may fall from this one (``"exact"``,
            ``"timing"``, ``"rel=1e-3"``, ``"3*se(se)"``, ...: the grammar of
            :mod:`fisherkron.repro.tolerance`), checked against the table's columns and
            recorded in the provenance record for ``make verify``; columns left out get a
            conservative default there.

    Returns:
        The paths written (CSV, Markdown, LaTeX, provenance JSON).
    """
    if not name or "/" in name:
        raise FisherkronError(f"table name must be a plain file stem, got {name!r}")
    if len(df.columns) == 0:
        raise FisherkronError(f"table {name} has no columns")
    declared = tolerance.declare(tolerances, df.columns)  # checked before anything is written
    out = output_dir(folder)
    csv = atomic_write(out / f"{name}.csv", lambda t: df.to_csv(t, index=False))
    md = _write_text(out / f"{name}.md", _markdown_table(df, floatfmt))
    tex = _write_text(out / f"{name}.tex", latex_table(df, caption=caption, label=label, floatfmt=floatfmt))
    rec = provenance(name, params, files=[csv.name, md.name, tex.name], started=started, notebook=notebook,
                     extra=extra)
    if caption:
        rec["caption"] = caption  # the README's study blocks quote it
    if declared:
        rec["tolerances"] = declared
    return [csv, md, tex, write_provenance(out, name, rec)]
