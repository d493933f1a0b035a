"""The command line under test without a model: a ``loader`` fixture that records every attempt to load one and
stops there, and :func:`run_cli`, which runs ``fisherkron ...`` and returns its status and one-line message."""
import pytest

import fisherkron.cli.options as cli_options
import fisherkron.hf as api
from fisherkron.cli import main


@pytest.fixture
def loader(monkeypatch, tmp_path):
    """Record every attempt to load a model, and stop there (the checks under test come before it)."""
    monkeypatch.setenv("FISHERKRON_DATA", str(tmp_path / "data"))
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    calls = []

    def load(*a, **k):
        calls.append(a)
        raise KeyboardInterrupt  # the CLI reports it in one line with status 130

    monkeypatch.setattr(cli_options, "load_model", load)
    monkeypatch.setattr(api, "load_model", load)
    monkeypatch.setattr(api, "load_compressed", load)
    return calls


def run_cli(argv, capsys) -> tuple[int, str]:
    """``(exit status, stderr stripped)`` of ``fisherkron <argv>``."""
    try:
        code = main([str(a) for a in argv])
    except SystemExit as exc:
        code = exc.code
    return code, capsys.readouterr().err.strip()
