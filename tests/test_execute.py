"""``fisherkron.repro.execute``: the one way notebooks are run (``mk/notebooks.mk`` and ``make verify``).

An executed notebook appears under its real name only when every cell ran; a failure leaves
``<name>.failed.ipynb`` (with the failing cell) and removes an older executed copy, so a stale notebook is
never taken for a fresh one.
"""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from fisherkron.repro.execute import execute

NOTEBOOK = """# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% tags=["parameters"]
output_dir = "out"
profile = "default"
fail = False

# %%
from pathlib import Path
Path(output_dir).mkdir(parents=True, exist_ok=True)
if fail:
    raise RuntimeError("planted failure")
(Path(output_dir) / "done.txt").write_text(profile)
import sys
print("step 1 of 1", file=sys.stderr)
import warnings
warnings.warn("IProgress not found. Please update jupyter and ipywidgets.")  # what tqdm.auto says in a kernel
warnings.warn("a warning a reader should see")
"""


def _project(root: Path, fail: bool) -> None:
    (root / "notebooks" / "params").mkdir(parents=True, exist_ok=True)
    (root / "notebooks" / "nb.py").write_text(NOTEBOOK)
    (root / "notebooks" / "params" / "nb.smoke.yaml").write_text(f"fail: {str(fail).lower()}\n")


def test_a_run_lands_atomically_and_a_failure_replaces_the_executed_copy(tmp_path):
    _project(tmp_path, fail=False)
    build = tmp_path / "build"
    ok, wall, _ = execute("nb", tmp_path / "figs", build, profile="smoke", root=tmp_path, log=tmp_path / "a.log")
    assert ok and wall > 0
    assert (tmp_path / "figs" / "done.txt").read_text() == "smoke"  # the profile and output_dir reached it
    assert sorted(p.name for p in build.iterdir()) == ["nb.ipynb", "nb.progress.log"]  # no .src / .tmp left
    assert "step 1 of 1" in (build / "nb.progress.log").read_text()  # stderr streamed while it ran
    executed = "".join("".join(o.get("text", "")) for c in json.loads((build / "nb.ipynb").read_text())["cells"]
                       for o in c.get("outputs", []))
    # tqdm's fallback notice (with this machine's paths) is filtered in the kernel, other warnings are not
    assert "IProgress" not in executed and "a warning a reader should see" in executed

    _project(tmp_path, fail=True)
    ok, _, _ = execute("nb", tmp_path / "figs", build, profile="smoke", root=tmp_path, log=tmp_path / "b.log")
    assert not ok
    assert sorted(p.name for p in build.iterdir()) == ["nb.failed.ipynb", "nb.progress.log"]
    assert "planted failure" in (build / "nb.failed.ipynb").read_text()


def test_a_failed_make_run_of_a_notebook_deletes_none_of_its_outputs(tmp_path):
    """GNU make's .DELETE_ON_ERROR removed the unchanged members of a notebook's grouped target (its table's
    .md and .tex, its figures, its executed notebook) when the run failed; the notebook macro marks them
    .PRECIOUS. Run for real, with the notebook's command replaced by one that fails, into a scratch folder."""
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS", "MAKEOVERRIDES")}
    args = ["make", "--no-print-directory", "-o", ".venv/.fisherkron-installed", "-W", "notebooks/fig_time_algo.py",
            "fig_time_algo", f"FIGDIR={tmp_path}/figures", f"NB_BUILD={tmp_path}/nb"]
    plan = subprocess.run([*args, "-n"], cwd=root, env=env, capture_output=True, text=True, timeout=120).stdout
    outputs = [Path(f) for f in plan.split("for f in ", 1)[1].split("; do", 1)[0].split()]
    outputs.append(tmp_path / "nb" / "fig_time_algo.ipynb")  # the executed notebook make tracks beside them
    assert len(outputs) >= 4 and all(str(f).startswith(str(tmp_path)) for f in outputs), plan
    for f in outputs:
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text("the last good run")
    r = subprocess.run([*args, "PY=false"], cwd=root, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0  # the run failed ...
    assert [f.name for f in outputs if not f.is_file()] == [], r.stderr  # ... and every output is still there
    assert all(f.read_text() == "the last good run" for f in outputs)


ROOT = Path(__file__).resolve().parents[1]
EXP = ROOT / "fisherkron" / "experiments"


def _experiment_imports(path: Path) -> set[str]:
    """The ``fisherkron.experiments`` modules ``path`` imports (at any depth of its code), by file stem."""
    import ast

    inside = path.parent == EXP
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level == 1 and inside:  # from .x import y / from . import x
                found |= {module} if module else {a.name for a in node.names}
            elif node.level == 0 and module == "fisherkron.experiments":
                found |= {a.name for a in node.names}
            elif node.level == 0 and module.startswith("fisherkron.experiments."):
                found.add(module.split(".")[2])
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".")[2] for a in node.names if a.name.startswith("fisherkron.experiments.")}
    return {m for m in found if (EXP / f"{m}.py").exists()}


def test_every_experiment_module_a_notebook_runs_is_a_make_prerequisite_of_it():
    """A notebook is rerun by `make all` when code it runs changes: each experiment module it imports, directly or
    through another experiment module, is among the prerequisites of its executed copy (read from make's database,
    nothing run)."""
    db = subprocess.run(["make", "--no-print-directory", "-pq", "PROFILE=default"], cwd=ROOT, capture_output=True,
                        text=True, timeout=120).stdout
    rules = {line.split(":", 1)[0]: set(line.split(":", 1)[1].split()) for line in db.splitlines()
             if line.startswith("notebooks/executed/") and ":" in line and not line.startswith("#")}
    notebooks = sorted((ROOT / "notebooks").glob("*.py"))
    assert notebooks
    missing = {}
    for nb in notebooks:
        need, todo = set(), _experiment_imports(nb)
        while todo:
            m = todo.pop()
            need.add(m)
            todo |= _experiment_imports(EXP / f"{m}.py") - need
        prereqs = rules.get(f"notebooks/executed/{nb.stem}.ipynb")
        assert prereqs is not None, f"make has no rule for notebooks/executed/{nb.stem}.ipynb"
        lacking = sorted(f"$(EXP)/{m}.py" for m in need if f"fisherkron/experiments/{m}.py" not in prereqs)
        if lacking:
            missing[nb.stem] = lacking
    assert not missing, f"notebooks run experiment modules their make rules do not list as prerequisites: {missing}"
