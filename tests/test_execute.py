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
from script_module import load_script

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



def test_kernels_avx2_exports_the_setting_kernel_bits_logs_and_another_value_stops_make():
    """``make KERNELS=avx2 ...`` runs with the AVX2 kernels of ATen, MKL and oneDNN (the records name them); the
    default leaves each CPU its own; a value it does not know is one line before anything runs."""
    root = Path(__file__).resolve().parents[1]
    bits = load_script("kernel_bits")
    pins = dict(bits.SETTINGS)["make KERNELS=avx2"]  # the setting whose bits kernel_bits.py logs
    drop = ("MAKEFLAGS", "MAKELEVEL", "MFLAGS", "MAKEOVERRIDES", "KERNELS", *bits.PINS)
    env = {k: v for k, v in os.environ.items() if k not in drop}

    def make(*extra):
        show = "; ".join(f"echo {v}=$${{{v}-}}" for v in bits.PINS)  # the recipes run under set -u
        return subprocess.run(["make", "--no-print-directory", "-s", "-o", ".venv/.fisherkron-installed", "verify",
                               "NB=fig_time_algo", f"PY={show}; true", *extra],
                              cwd=root, env=env, capture_output=True, text=True, timeout=120)

    assert make("KERNELS=avx2").stdout.split() == [f"{v}={pins[v]}" for v in bits.PINS]
    assert make().stdout.split() == [f"{v}=" for v in bits.PINS]
    wrong = make("KERNELS=avx512")
    assert wrong.returncode != 0 and wrong.stdout == "" and "use KERNELS=avx2" in wrong.stderr
