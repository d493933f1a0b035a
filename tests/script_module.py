"""``load_script(name)``: a repository script (``scripts/<name>.py``) as a module, for the tests that call its
functions."""
import importlib.util
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def load_script(name: str):
    """``scripts/<name>.py``, executed as the module ``name`` (registered in ``sys.modules``, where dataclasses
    look their module up)."""
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod
