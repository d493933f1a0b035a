"""The package's layers, checked on its import graph (read from the source, nothing imported).

core  <-  env  <-  hf  <-  experiments  <-  cli  <-  __main__      (and _version, importable from all)
                  ^-- repro --'
Each layer may import only from the layers to its left; ``repro`` (the reproduction's tooling:
running, recording and verifying notebooks, the book) sits on core and env beside hf, and only
``experiments`` may use it (to save its tables with provenance). The core needs only torch, numpy,
scipy and tqdm besides the standard library.
"""
import ast
import sys
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "fisherkron"
#: allowed fisherkron layers per layer ("top" = the top-level modules __init__ and testing)
ALLOWED = {
    "_version": set(),
    "core": {"core"},
    "env": {"core", "env"},
    "testing": {"core", "testing"},
    "hf": {"core", "env", "hf"},
    "repro": {"core", "env", "repro"},
    "experiments": {"core", "env", "hf", "repro", "experiments"},
    "cli": {"core", "env", "hf", "experiments", "cli"},
    "__main__": {"cli"},  # python -m fisherkron (and torchrun -m fisherkron): the command line, nothing else
    "__init__": {"core", "env", "hf", "__init__"},
}
CORE_THIRD_PARTY = {"torch", "numpy", "scipy", "tqdm"}


def _layer(path: Path) -> str:
    rel = path.relative_to(PKG)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _imports(path: Path, root: Path = PKG.parent):
    """``(absolute module name, line)`` of every import in ``path``, relative ones resolved."""
    package = list(path.relative_to(root).parts[:-1])
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
                if node.module is None:  # from . import x: each x may be a module
                    for a in node.names:
                        yield f"{mod}.{a.name}", node.lineno
                    continue
                yield mod, node.lineno
            else:
                yield node.module, node.lineno
                for a in node.names:  # from package import x: each x may be a module
                    yield f"{node.module}.{a.name}", node.lineno


def _fisherkron_layer(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "fisherkron":
        return None
    return parts[1] if len(parts) > 1 else "__init__"


SOURCES = sorted(PKG.rglob("*.py"))


def test_every_module_belongs_to_a_known_layer():
    assert {_layer(p) for p in SOURCES} <= set(ALLOWED)


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(PKG)))
def test_layers_import_only_downwards(path):
    layer = _layer(path)
    bad = [(mod, line) for mod, line in _imports(path)
           if (target := _fisherkron_layer(mod)) is not None and target not in ALLOWED[layer] | {"_version"}]
    assert not bad, f"{path.relative_to(PKG)} ({layer}) imports from above its layer: {bad}"


@pytest.mark.parametrize("path", sorted((PKG / "core").rglob("*.py")), ids=lambda p: p.name)
def test_core_needs_only_torch_numpy_scipy_tqdm(path):
    stdlib = set(sys.stdlib_module_names)
    bad = [(mod, line) for mod, line in _imports(path)
           if mod.split(".")[0] not in stdlib | CORE_THIRD_PARTY | {"fisherkron"}]
    assert not bad, f"core module {path.name} imports {bad}"


def test_the_layer_check_sees_a_planted_upward_import(tmp_path):
    """The graph reader is not vacuous: upward imports planted in a core file are found."""
    src = tmp_path / "fisherkron" / "core" / "x.py"
    src.parent.mkdir(parents=True)
    src.write_text("from ..hf import registry\nfrom .. import env\nimport fisherkron.cli\nfrom .wsvd import svd\n")
    got = [_fisherkron_layer(m) for m, _ in _imports(src, tmp_path)]
    assert got == ["hf", "env", "cli", "core"]


def test_no_function_shadows_a_module_of_the_same_name():
    import importlib

    import fisherkron

    for name in fisherkron.__all__:
        if name.startswith("__"):
            continue
        for sub in ("", ".core", ".hf"):
            spec = importlib.util.find_spec(f"fisherkron{sub}.{name}") if sub or name else None
            assert spec is None, f"fisherkron{sub}.{name} is both a public name and a module"


def test_import_fisherkron_does_not_import_the_hugging_face_layer():
    import subprocess

    code = ("import sys, fisherkron; bad = [m for m in ('transformers', 'fisherkron.hf', 'datasets', "
            "'matplotlib', 'pandas') if m in sys.modules]; print(bad); sys.exit(bool(bad))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_a_bare_import_and_the_tooling_start_without_torch():
    """``import fisherkron`` and the repository's tools (one process per executed notebook, per `make verify` or
    `make book` step) import no torch: the core's names are imported on first use, and the tools need only the
    error type (``core.errors``) and ``core.phases``. Importing torch and scipy takes about 3 s of a tool's start."""
    import subprocess

    tools = ("execute", "verify", "ledger", "cold", "claims", "readme", "tolerance", "figures", "book.__main__")
    code = (f"import sys, fisherkron, fisherkron.env, {', '.join('fisherkron.repro.' + t for t in tools)}; "
            "bad = [m for m in ('torch', 'scipy', 'fisherkron.core.conventions') if m in sys.modules]; "
            "print(bad); sys.exit(bool(bad))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_every_lazily_imported_name_is_the_one_its_module_defines():
    import importlib

    import fisherkron
    import fisherkron.core as core

    assert set(fisherkron._CORE) <= set(core.__all__)
    for name in core.__all__:
        module = importlib.import_module(f"fisherkron.core.{core._MODULE_OF[name]}")
        assert getattr(core, name) is getattr(module, name), name
    for name in fisherkron._CORE:
        assert getattr(fisherkron, name) is getattr(core, name), name
    with pytest.raises(AttributeError, match="no attribute 'mf'"):
        core.mf  # noqa: B018


@pytest.mark.parametrize("package", ["core", "hf", "experiments", "repro"])
def test_each_package_table_lists_every_module(package):
    """The module table of a package's docstring (a reader's map of it) names each of its modules and subpackages."""
    import ast
    import re

    root = PKG / package
    doc = ast.get_docstring(ast.parse((root / "__init__.py").read_text())) or ""
    listed = set(re.findall(r"^``(\w+)``\s", doc, flags=re.M))
    present = {p.stem for p in root.glob("*.py") if p.stem != "__init__"} | \
        {p.parent.name for p in root.glob("*/__init__.py")}
    assert present <= listed, f"fisherkron.{package}'s docstring table lacks {sorted(present - listed)}"


def test_every_experiment_module_a_notebook_runs_is_a_make_prerequisite_of_it():
    """A notebook is rerun by `make all` when code it runs changes: each experiment module it imports, directly or
    through another experiment module, is among the prerequisites of its executed copy (read from make's database,
    nothing run)."""
    import subprocess

    root, exp = PKG.parent, PKG / "experiments"

    def experiment_imports(path: Path) -> set[str]:
        return {m.split(".")[2] for m, _ in _imports(path, root) if m.startswith("fisherkron.experiments.")
                and (exp / f"{m.split('.')[2]}.py").exists()}

    db = subprocess.run(["make", "--no-print-directory", "-pq", "PROFILE=default"], cwd=root, capture_output=True,
                        text=True, timeout=120).stdout
    rules = {line.split(":", 1)[0]: set(line.split(":", 1)[1].split()) for line in db.splitlines()
             if line.startswith("notebooks/executed/") and ":" in line and not line.startswith("#")}
    notebooks = sorted((root / "notebooks").glob("*.py"))
    assert notebooks
    missing = {}
    for nb in notebooks:
        need, todo = set(), experiment_imports(nb)
        while todo:
            m = todo.pop()
            need.add(m)
            todo |= experiment_imports(exp / f"{m}.py") - need
        prereqs = rules.get(f"notebooks/executed/{nb.stem}.ipynb")
        assert prereqs is not None, f"make has no rule for notebooks/executed/{nb.stem}.ipynb"
        lacking = sorted(f"$(EXP)/{m}.py" for m in need if f"fisherkron/experiments/{m}.py" not in prereqs)
        if lacking:
            missing[nb.stem] = lacking
    assert not missing, f"notebooks run experiment modules their make rules do not list as prerequisites: {missing}"


#: the phases a provenance record splits a notebook's time into, and the one function each times (``@timed``):
#: a helper inserted between a decorator and its function would time only itself
PHASES = {
    ("core/factorization.py", "mff"): "MFF",
    ("hf/calibration/collect.py", "collect_calibration"): "calibration",
    ("hf/sensitivity.py", "decompose_layer"): "weighted SVDs",
    ("hf/sensitivity.py", "sensitivity_sweep"): "sensitivity measurements",
    ("hf/surgery.py", "compress"): "compression",
    ("hf/basis_sharing.py", "compress_basis_sharing"): "compression",
    ("hf/truncation.py", "train_truncation"): "learned truncation",
    ("hf/recovery.py", "recover"): "LoRA recovery",
    ("hf/registry.py", "load_model"): "model loading",
    ("hf/evaluate.py", "perplexity"): "perplexity",
    ("hf/evaluate.py", "predict_classifier"): "classifier scoring",
    ("hf/evaluate.py", "run_lm_eval"): "lm-eval",
}


def _timed(path: Path, root: Path = PKG) -> dict[tuple[str, str], str]:
    """``(module path below root, function) -> phase`` of every function ``path`` decorates with
    ``@timed("phase")``."""
    out = {}
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for d in node.decorator_list:
                if isinstance(d, ast.Call) and getattr(d.func, "id", None) == "timed":
                    out[(path.relative_to(root).as_posix(), node.name)] = d.args[0].value
    return out


def test_each_phase_times_the_function_it_names():
    found = {k: v for p in sorted(PKG.rglob("*.py")) for k, v in _timed(p).items()}
    assert found == PHASES


def test_the_phase_check_sees_a_decorator_moved_onto_a_helper(tmp_path):
    planted = tmp_path / "core" / "m.py"
    planted.parent.mkdir(parents=True)
    planted.write_text('@timed("MFF")\ndef _operator():\n    pass\n\n\ndef mff():\n    pass\n')
    assert _timed(planted, tmp_path) == {("core/m.py", "_operator"): "MFF"}
