"""``fisherkron compress`` refuses options that cannot go together in one line, before the model is loaded.

``--grad-dtype float16 --granularity token`` and the single-process options under torchrun
(``WORLD_SIZE > 1``) were refused by the library only after the model, the data (and, under
torchrun, the process group) were loaded, or were ignored. They shape GFWSVD's gradients, so
the commands name that method (the default, KFAC-SVD, stores none).
"""
import pytest

from cli_harness import loader, run_cli  # noqa: F401 (loader: a fixture)

_run = run_cli

BASE = ["compress", "smollm2", "--method", "gfwsvd", "--rank", "2", "--k", "2"]


@pytest.mark.parametrize("world", ["1", "2"])
def test_float16_gradients_with_token_granularity_are_refused_first(world, tmp_path, loader, monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", world)
    monkeypatch.setenv("RANK", "0")
    code, err = _run([*BASE, "--out", tmp_path / "out", "--grad-dtype", "float16", "--granularity", "token"], capsys)
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "--granularity token" in err and "drop --grad-dtype float16" in err
    assert loader == [] and not (tmp_path / "out").exists()


@pytest.mark.parametrize("extra,message", [
    (["--grad-dtype", "bfloat16"], "--grad-dtype bfloat16 run in one process only"),
    (["--grad-dtype", "float16"], "--grad-dtype float16 run in one process only"),
    (["--granularity", "token"], "--granularity token run in one process only"),
    (["--method", "svd_llm", "--mff-parallel", "layers"], "method svd_llm does not run MFF; drop --mff-parallel"),
], ids=["bfloat16", "float16", "token", "mff-parallel"])
def test_single_process_options_are_refused_under_torchrun(extra, message, tmp_path, loader, monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    code, err = _run([*BASE, "--out", tmp_path / "out", *extra], capsys)
    assert code == 2 and len(err.splitlines()) == 1, err
    assert message in err, err
    assert "WORLD_SIZE=2" in err or "--mff-parallel" in extra
    assert loader == []


@pytest.mark.parametrize("world,extra", [
    ("2", ["--granularity", "sequence", "--mff-parallel", "layers"]),  # what the distributed path does support
    ("1", ["--grad-dtype", "float16", "--granularity", "sequence"]),  # one process: every encoding
    ("1", ["--method", "svd_llm", "--mff-parallel", "layers"]),  # one process: --mff-parallel is only logged
])
def test_supported_combinations_reach_the_model_loader(world, extra, tmp_path, loader, monkeypatch, capsys):
    """The refusals are exactly the combinations above: the supported ones get as far as loading the model."""
    monkeypatch.setenv("WORLD_SIZE", world)
    monkeypatch.setenv("RANK", "0")
    code, err = _run([*BASE, "--out", tmp_path / "out", *extra], capsys)
    assert code == 130 and len(loader) == 1, err
