"""Execute one notebook: the single definition of how, used by ``mk/notebooks.mk`` and by ``make verify``.

``notebooks/<name>.py`` (jupytext py:percent) becomes ``<build>/<name>.src.ipynb``; papermill runs it with
the profile's parameters ``notebooks/params/<name>.<profile>.yaml`` plus ``output_dir`` (where its figures
and tables go) and ``profile``, into ``<build>/<name>.tmp.ipynb``. On success that is moved to
``<build>/<name>.ipynb``; on an error to ``<build>/<name>.failed.ipynb`` (the cell that failed is in it), so an
executed notebook is never half-written under its real name. While it runs, everything its cells write to
stderr (the progress bars of long work, warnings) also streams into ``<build>/<name>.progress.log``, so a run of
hours can be followed with ``tail -f`` (papermill itself shows nothing until the notebook ends).

Command line (what the ``run_notebook`` macro of ``mk/notebooks.mk`` calls)::

    python -m fisherkron.repro.execute NAME --profile default --figdir figures --build build/notebooks/default

prints ``[notebook] NAME took N s`` or where the failed notebook is, and exits 1 on a failure.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

from ..env import REPO_ROOT
from . import ledger

__all__ = ["rel", "commands", "progress_log", "kernel_env", "execute", "main"]

#: warnings filters the kernel starts with (``PYTHONWARNINGS`` syntax). tqdm.auto warns that ipywidgets is
#: missing and falls back to text bars, which is what a notebook executed for a static book should draw (a
#: widget bar renders on neither a code host nor the book); the warning only put this machine's paths into
#: every executed notebook.
KERNEL_WARNINGS = ("ignore:IProgress not found",)


def rel(p: Path, root: Path) -> str:
    """``p`` relative to ``root`` when it lies inside it, else absolute (how commands and messages name paths)."""
    try:
        return str(Path(p).resolve().relative_to(Path(root).resolve()))
    except ValueError:
        return str(Path(p).resolve())


def progress_log(name: str, nb_build: Path) -> Path:
    """Where a running notebook's stderr (progress bars, warnings) streams."""
    return Path(nb_build) / f"{name}.progress.log"


def commands(name: str, figdir: Path, nb_build: Path, *, profile: str = "default",
             root: Path = REPO_ROOT) -> list[list[str]]:
    """The two commands (jupytext, papermill) that execute ``notebooks/<name>.py`` into ``nb_build``."""
    py = sys.executable
    src, tmp = Path(nb_build) / f"{name}.src.ipynb", Path(nb_build) / f"{name}.tmp.ipynb"
    return [[py, "-m", "jupytext", "--quiet", "--to", "ipynb", "--output", str(src), f"notebooks/{name}.py"],
            [py, "-m", "papermill", "--no-progress-bar", "--log-level", "WARNING", "-k", "python3",
             "--cwd", str(root), "--stderr-file", str(progress_log(name, nb_build)),
             "-f", f"notebooks/params/{name}.{profile}.yaml",
             "-p", "output_dir", rel(figdir, root), "-p", "profile", profile, str(src), str(tmp)]]


def kernel_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment a notebook's kernel runs in: ``env`` (default: this process's) with
    :data:`KERNEL_WARNINGS` added to ``PYTHONWARNINGS`` (a caller's own filters are kept).

    >>> kernel_env({"PYTHONWARNINGS": "error::DeprecationWarning"})["PYTHONWARNINGS"]
    'error::DeprecationWarning,ignore:IProgress not found'
    """
    out = dict(env or os.environ)
    have = [w for w in out.get("PYTHONWARNINGS", "").split(",") if w]
    out["PYTHONWARNINGS"] = ",".join(have + [w for w in KERNEL_WARNINGS if w not in have])
    return out


def execute(name: str, figdir: Path, nb_build: Path, *, profile: str = "default", root: Path = REPO_ROOT,
            env: Mapping[str, str] | None = None, log: Path | None = None) -> tuple[bool, float, float]:
    """Execute ``notebooks/<name>.py`` with ``profile``'s parameters, its outputs in ``figdir``.

    The executed notebook goes to ``nb_build/<name>.ipynb`` (``<name>.failed.ipynb`` on an error);
    the commands' output goes to ``log`` (default: this process's stdout). Returns ``(succeeded, wall
    seconds, CPU seconds)``; the CPU seconds (of jupytext, papermill and the kernel) over the cores
    estimate the wall time on an idle machine when other work shares the cores.
    """
    root, nb_build = Path(root), Path(nb_build)
    nb_build.mkdir(parents=True, exist_ok=True)
    Path(figdir).mkdir(parents=True, exist_ok=True)
    src, tmp = nb_build / f"{name}.src.ipynb", nb_build / f"{name}.tmp.ipynb"
    t0, cpu0 = time.perf_counter(), _children_cpu()
    ok = True
    with open(log, "w", encoding="utf-8") if log else _stdout() as out:
        for cmd in commands(name, figdir, nb_build, profile=profile, root=root):
            if subprocess.run(cmd, cwd=root, env=kernel_env(env), stdout=out,
                              stderr=subprocess.STDOUT).returncode:
                ok = False
                break
    src.unlink(missing_ok=True)
    if tmp.exists():
        done, failed = nb_build / f"{name}.ipynb", nb_build / f"{name}.failed.ipynb"
        tmp.replace(done if ok else failed)
        (failed if ok else done).unlink(missing_ok=True)  # never an old copy beside the new one
    return ok, time.perf_counter() - t0, _children_cpu() - cpu0


class _stdout:
    """``sys.stdout`` as a context manager that does not close it (flushed so the order holds)."""

    def __enter__(self):
        sys.stdout.flush()
        return None  # subprocess: inherit this process's stdout

    def __exit__(self, *exc):
        return False


def _children_cpu() -> float:
    """CPU seconds (user + system) of this process's finished descendants."""
    import resource

    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fisherkron.repro.execute", description=__doc__.split("\n")[0])
    ap.add_argument("name", help="the notebook, notebooks/<name>.py")
    ap.add_argument("--profile", default="default", help="the parameter file notebooks/params/<name>.<profile>.yaml")
    ap.add_argument("--figdir", default="figures", help="where the notebook writes its figures and tables")
    ap.add_argument("--build", default=None, help="where the executed notebook goes (build/notebooks/<profile>)")
    a = ap.parse_args(argv)
    build = Path(a.build or f"build/notebooks/{a.profile}")
    params = REPO_ROOT / "notebooks" / "params" / f"{a.name}.{a.profile}.yaml"
    if not (REPO_ROOT / "notebooks" / f"{a.name}.py").is_file() or not params.is_file():
        print(f"[notebook] {a.name}: no notebooks/{a.name}.py or no parameter file {rel(params, REPO_ROOT)}; "
              f"the notebooks are listed by `make help`", file=sys.stderr)
        return 2
    print(f"[notebook] {a.name}: its progress streams into {progress_log(a.name, build)} (tail -f)", flush=True)
    run = ledger.run_started(a.name, a.profile, progress=(REPO_ROOT / progress_log(a.name, build)).resolve())
    with ledger.heartbeat(run):  # a run that dies with its session is counted up to its last heartbeat
        ok, sec, cpu = execute(a.name, Path(a.figdir), build, profile=a.profile)
    ledger.run_ended(run, ok, sec, cpu)
    if not ok:
        print(f"[notebook] {a.name} FAILED: see {build / f'{a.name}.failed.ipynb'}", file=sys.stderr)
        return 1
    print(f"[notebook] {a.name} took {sec:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
