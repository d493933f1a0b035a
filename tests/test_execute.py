"""``fisherkron.experiments.execute``: the one way notebooks are run (``mk/notebooks.mk`` and ``make verify``).

An executed notebook appears under its real name only when every cell ran; a failure leaves
``<name>.failed.ipynb`` (with the failing cell) and removes an older executed copy, so a stale notebook is
never taken for a fresh one.
"""
from __future__ import annotations

from pathlib import Path

from fisherkron.experiments.execute import execute

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

    _project(tmp_path, fail=True)
    ok, _, _ = execute("nb", tmp_path / "figs", build, profile="smoke", root=tmp_path, log=tmp_path / "b.log")
    assert not ok
    assert sorted(p.name for p in build.iterdir()) == ["nb.failed.ipynb", "nb.progress.log"]
    assert "planted failure" in (build / "nb.failed.ipynb").read_text()
