"""The README's one-layer example runs and shows what the README says: GFWSVD has the smallest Fisher-weighted error."""
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_compress_one_linear_example():
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "compress_one_linear.py")],
                         capture_output=True, text=True, check=True, cwd=ROOT).stdout
    errors = {m[0]: float(m[1]) for m in re.findall(r"^(\w+)\s+Fisher-weighted error ([0-9.e+-]+)$", out, re.M)}
    assert set(errors) == {"svd", "fwsvd", "asvd", "svd_llm", "gfwsvd"}
    assert min(errors, key=errors.get) == "gfwsvd"
    assert "MFF:" in out
    # the README shows this run's output: its numbers agree with a fresh run to float32 round-off
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    shown = readme.split("It prints", 1)[1].split("```\n", 2)[1]
    shown_errors = {m[0]: float(m[1]) for m in re.findall(r"^(\w+)\s+Fisher-weighted error ([0-9.e+-]+)$", shown, re.M)}
    assert shown_errors.keys() == errors.keys()
    for name, value in errors.items():  # rel 2 %: summation order differs between CPU models
        assert abs(shown_errors[name] - value) <= 0.02 * value, (name, shown_errors[name], value)
    assert shown.startswith("MFF: ") and "Fisher share captured" in shown.splitlines()[0]
