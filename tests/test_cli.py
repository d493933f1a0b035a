"""The command line: factorize saved gradients; bad input is one line and exit status 2."""
import json
import subprocess
import sys

import numpy as np
import torch

import fisherkron as fk
from fisherkron.cli import main
from fisherkron.testing import MFF_F64_REL, rel_error


def test_factorize_writes_factors(tmp_path, capsys):
    G = torch.randn(6, 7, 5, generator=torch.Generator().manual_seed(0))
    np.save(tmp_path / "g.npy", G.numpy())
    assert main(["factorize", str(tmp_path / "g.npy"), "--out", str(tmp_path / "f.pt"), "--float64"]) == 0
    info = json.loads(capsys.readouterr().out)
    saved = torch.load(tmp_path / "f.pt")
    ref = fk.mff(G.double(), dtype=torch.float64)
    # the same float64 MFF on the same gradients, read from a file instead of a tensor
    assert rel_error(torch.kron(saved["A"], saved["B"]), torch.kron(ref.A, ref.B)) <= MFF_F64_REL
    assert info["m"] == 5 and info["n"] == 7 and info["matvecs"] == ref.matvecs


def test_bad_input_is_one_line(tmp_path):
    np.save(tmp_path / "bad.npy", np.full((2, 3, 4), np.nan, dtype=np.float32))
    proc = subprocess.run([sys.executable, "-m", "fisherkron.cli", "factorize", str(tmp_path / "bad.npy"),
                           "--out", str(tmp_path / "f.pt")], capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "NaN/inf" in proc.stderr
    assert not (tmp_path / "f.pt").exists()
