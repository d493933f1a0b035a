"""What a user gets from ``pip install fisherkron`` with no extras: in a bare venv holding only
the core dependencies (torch, numpy, scipy, tqdm), the package installs (non-editable) and runs
the README's one-layer example, and the Hugging Face stack is absent (the core never needs it).

Needs pip to reach the package registry (and the local CPU torch wheel, as ``make install``);
without it this test fails and says so: it does not skip.
"""
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TORCH = "torch==2.13.0"  # the CPU build, as TORCH in the Makefile: plain `torch` may pull a CUDA build

pytestmark = pytest.mark.slow


def _env() -> dict[str, str]:
    """The caller's environment minus anything that would let the bare venv see other packages."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.update(PYTHONNOUSERSITE="1", PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1")
    return env


PIP_HINT = f" (pip needs the package registry and the local {TORCH} wheel, as for `make install`)"


def _run(cmd: list[str], what: str, cwd: Path, timeout: float = 1200, hint: str = "") -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, env=_env(), timeout=timeout)
    if r.returncode != 0:
        noise = re.compile(r"^WARNING: Location '.*' is ignored")  # harmless pip note on our machines
        err = "\n".join(line for line in (r.stderr + r.stdout).splitlines() if not noise.match(line))
        pytest.fail(f"{what} failed with exit {r.returncode}{hint}.\n$ {' '.join(cmd)}\n{err[-4000:]}",
                    pytrace=False)
    return r


def test_core_only_venv_runs_the_one_layer_example(tmp_path):
    core = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    # a copy of what the sdist holds, so the build writes nothing into the checkout
    src = tmp_path / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "build")
    shutil.copytree(ROOT / "fisherkron", src / "fisherkron", ignore=ignore)
    for f in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / f, src / f)

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], "python -m venv", cwd=tmp_path)
    py = str(venv / "bin" / "python")
    pip = [py, "-m", "pip", "install", "--quiet", "-c", str(ROOT / "constraints.txt")]
    _run(pip + [TORCH, *core], "installing the core dependencies", cwd=tmp_path, hint=PIP_HINT)
    _run(pip + ["--no-deps", str(src)], "pip install --no-deps <repo>", cwd=tmp_path, hint=PIP_HINT)
    _run([py, "-m", "pip", "check"], "pip check (the core dependencies satisfy fisherkron's metadata)",
         cwd=tmp_path)

    # the installed package, not the checkout, and none of the optional layers
    r = _run([py, "-c", "import fisherkron, sys; print(fisherkron.__file__); "
              "print(sorted(m for m in ('transformers', 'datasets', 'pandas', 'matplotlib', 'lm_eval') "
              "if m in sys.modules))"], "import fisherkron", cwd=tmp_path)
    file, loaded = r.stdout.splitlines()[-2:]
    assert Path(file).is_relative_to(venv), file
    assert loaded == "[]", f"importing fisherkron loaded optional packages: {loaded}"
    for mod in ("transformers", "pandas"):
        r = subprocess.run([py, "-c", f"import {mod}"], capture_output=True, text=True, cwd=tmp_path, env=_env())
        assert r.returncode != 0 and "ModuleNotFoundError" in r.stderr, f"{mod} is importable in the bare venv"

    r = _run([py, str(ROOT / "examples" / "compress_one_linear.py")], "examples/compress_one_linear.py",
             cwd=tmp_path, timeout=600)
    assert re.search(r"^gfwsvd\s+Fisher-weighted error [0-9.e+-]+$", r.stdout, re.M), r.stdout
