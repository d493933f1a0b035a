"""Allocation and surgery: cache keys cover what the value depends on; one-line errors; one-way imports.

* the sensitivity sweep's key covers the whole model (values, dtypes), the loss function, the
  held-out data, the method and every factorisation option; a folder it cannot write costs the
  cache, not the sweep;
* nothing in the sweep's cache file is used unverified: an entry that was edited (a plausible
  number in valid JSON), holds NaN, a string or other ranks, was moved from another layer or lost
  its checksum is measured again with a warning naming the file and the entry, and the result is
  the clean sweep's; a measurement that is not finite is refused in one line and never kept;
* ``allocation_options``, ``min_speedup`` and ``ratio`` are checked up front in one line;
* compressing a compressed model factorises only its dense ``nn.Linear`` layers;
* ``hf.surgery -> hf.allocation -> hf.sensitivity`` and ``hf.allocation -> hf.budget``: no circle, no
  import hidden in a function.
"""
import ast
import copy
import errno
import inspect
import json
import logging
import math
import os
from pathlib import Path

import pytest
import torch

import fisherkron as fk
from fisherkron.hf import allocation, sensitivity
from fisherkron.hf.allocation import Decompositions, allocate
from fisherkron.hf.calibration import collect_calibration, model_fingerprint
from fisherkron.hf.saving import load_compressed, save_compressed
from fisherkron.hf.sensitivity import sensitivity_sweep
from fisherkron.hf.surgery import compress
from fisherkron.testing import RELOAD
from tiny_models import tiny_llama, token_batches

LAYERS = ["model.layers.0.mlp.up_proj", "model.layers.1.self_attn.o_proj"]
RATIOS = (0.3, 0.6)
LOGGER = "fisherkron.hf.sensitivity"  # the sweep's


def _batches(k=2, seed=0, B=2, T=10):
    return token_batches(k=k, seed=seed, B=B, T=T)


def _sweep(model, cache_dir, method="svd", stats=None, **kw):
    return sensitivity_sweep(model, method, stats, LAYERS, _batches(seed=5), ratios=RATIOS, cache_dir=cache_dir, **kw)


def _one_line(exc_info) -> str:
    msg = str(exc_info.value)
    assert "\n" not in msg and isinstance(exc_info.value, fk.FisherkronError)
    return msg


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    model = tiny_llama()
    return model, collect_calibration(model, _batches(k=4), None, cache_dir=tmp_path_factory.mktemp("cal"))


# ---------------------------------------------------------------------------- the sweep's cache key

def test_sweep_cache_hits_for_the_same_configuration(tmp_path):
    """The key is a function of the configuration: an equal model and an equal loss (another object) hit."""
    model = tiny_llama()
    one = _sweep(model, tmp_path, loss_fn=lambda m, b: 2 * m(**b).loss)
    two = _sweep(copy.deepcopy(model), tmp_path, loss_fn=lambda m, b: 2 * m(**b).loss)
    assert not one["from_cache"] and two["from_cache"] and two["table"] == one["table"]
    assert two["path"] == one["path"] and Path(one["path"]).is_file()


def test_sweep_cache_key_covers_the_loss_function(tmp_path):
    model = tiny_llama()
    plain = _sweep(model, tmp_path)
    doubled = _sweep(model, tmp_path, loss_fn=lambda m, b: 2 * m(**b).loss)
    assert not doubled["from_cache"]
    assert doubled["base"] == pytest.approx(2 * plain["base"], rel=1e-6)  # measured, not the first loss served


@pytest.mark.parametrize("part", ["model.embed_tokens.weight", "model.norm.weight",
                                  "model.layers.0.self_attn.q_proj.weight"])
def test_sweep_cache_key_covers_the_whole_model(part, tmp_path):
    """Without statistics too, a model that differs outside the swept layers is measured, not served."""
    model = tiny_llama()
    first = _sweep(model, tmp_path)
    other = copy.deepcopy(model)
    with torch.no_grad():
        other.get_parameter(part).mul_(1.5)
    second = _sweep(other, tmp_path)
    assert not second["from_cache"]
    assert second["base"] != first["base"]


def test_sweep_cache_key_covers_the_dtype_of_the_weights(tmp_path):
    """A bfloat16 model and its exact float32 copy have one value fingerprint and different losses."""
    m32 = tiny_llama()
    with torch.no_grad():
        for t in list(m32.parameters()) + [b for b in m32.buffers() if b.is_floating_point()]:
            t.copy_(t.bfloat16().float())  # values a bfloat16 holds exactly
    m16 = copy.deepcopy(m32).to(torch.bfloat16)
    assert model_fingerprint(m16) == model_fingerprint(m32)  # so only the dtype tells them apart
    _sweep(m32, tmp_path)
    assert not _sweep(m16, tmp_path)["from_cache"]


def test_sweep_cache_key_covers_the_factorisation_options(calibrated, tmp_path):
    base, st = calibrated
    one = _sweep(base, tmp_path, method="asvd", stats=st, asvd_alpha=0.5)
    two = _sweep(base, tmp_path, method="asvd", stats=st, asvd_alpha=1.0)
    assert not two["from_cache"] and two["table"] != one["table"]
    assert _sweep(base, tmp_path, method="asvd", stats=st, asvd_alpha=1.0)["from_cache"]


def test_a_loss_that_cannot_be_keyed_is_refused_in_one_line(tmp_path):
    model = tiny_llama()
    other = torch.nn.Linear(2, 2)  # an object with state: its description could not be trusted

    def loss(m, b):
        return m(**b).loss + 0.0 * other.weight.sum()

    with pytest.raises(fk.FisherkronError) as err:
        _sweep(model, tmp_path, loss_fn=loss)
    assert "loss_name" in _one_line(err) and "cache=False" in str(err.value)
    assert not _sweep(model, tmp_path, loss_fn=loss, loss_name="mine")["from_cache"]
    assert _sweep(model, tmp_path, loss_fn=loss, loss_name="mine")["from_cache"]
    assert _sweep(model, None, loss_fn=loss, cache=False)["path"] is None


def test_allocation_measures_the_factorisation_that_compress_applies(calibrated):
    """compress's own options reach the allocation: one weighted SVD per layer serves both."""
    base, st = calibrated
    cache = Decompositions()
    rep = compress(copy.deepcopy(base), "asvd", st, ratio=0.15, allocation="fisher", asvd_alpha=1.0,
                   mff_options=dict(max_matvecs=60), decompositions=cache)
    assert cache.misses == len(rep.layers) and cache.hits >= len(rep.ranks)


def test_decompositions_key_covers_the_dtype():
    lin = torch.nn.Linear(5, 7)
    with torch.no_grad():
        for t in lin.parameters():
            t.copy_(t.bfloat16().float())  # values a bfloat16 holds exactly: one value fingerprint
    cache = Decompositions()
    d32, _ = cache.get(lin, "svd", None, "x")
    d16, _ = cache.get(copy.deepcopy(lin).to(torch.bfloat16), "svd", None, "x")
    assert cache.misses == 2
    assert d32.factors(3)[0].dtype == torch.float32 and d16.factors(3)[0].dtype == torch.bfloat16


# ---------------------------------------------------------------------------- a folder the sweep cannot write

def _read_only(monkeypatch):
    def refuse(path, write):
        raise OSError(errno.EROFS, "Read-only file system", str(path))
    monkeypatch.setattr(sensitivity, "atomic_write", refuse)


@pytest.mark.parametrize("where", ["read-only", "under a file", "FISHERKRON_DATA is a file"])
def test_a_sweep_cache_that_cannot_be_written_costs_the_cache_not_the_sweep(where, tmp_path, monkeypatch, caplog):
    model = tiny_llama()
    want = _sweep(model, None, cache=False)
    blocker = tmp_path / "file"
    blocker.write_text("")
    cache_dir = tmp_path / "ro"
    if where == "read-only":
        _read_only(monkeypatch)
    elif where == "under a file":
        cache_dir = blocker / "sub"
    else:
        monkeypatch.setenv("FISHERKRON_DATA", str(blocker))
        cache_dir = None
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        got = _sweep(model, cache_dir)
    assert got["table"] == want["table"] and got["base"] == want["base"]
    assert got["path"] is None and not got["from_cache"]
    warned = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert len(warned) == 1, warned  # once, though each of the two layers was to be kept
    assert "cannot keep the sensitivity sweep" in warned[0] and "FISHERKRON_DATA" in warned[0]


def test_a_read_only_sweep_cache_that_holds_the_sweep_is_read(tmp_path, monkeypatch, caplog):
    model = tiny_llama()
    first = _sweep(model, tmp_path)
    _read_only(monkeypatch)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        again = _sweep(model, tmp_path)
    assert again["from_cache"] and again["table"] == first["table"] and again["path"] == first["path"]
    assert not [r for r in caplog.records if r.name == LOGGER]


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root writes into read-only folders")
def test_a_sweep_cache_folder_without_write_permission(tmp_path, caplog):
    model = tiny_llama()
    full, empty = tmp_path / "full", tmp_path / "empty"
    empty.mkdir()
    first = _sweep(model, full)
    for d in (full, empty):
        d.chmod(0o555)
    try:
        assert _sweep(model, full)["from_cache"]
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            got = _sweep(model, empty)
        assert got["table"] == first["table"] and got["path"] is None
    finally:
        for d in (full, empty):
            d.chmod(0o755)


# ---------------------------------------------------------------------------- one-line errors

def test_allocation_options_are_the_arguments_of_allocate_that_compress_leaves_open():
    params = list(inspect.signature(allocate).parameters)[4:]  # after model, method, stats, names
    assert sorted(allocation.OPTIONS + tuple(allocation.FROM_COMPRESS)) == sorted(params)
    assert set(allocation.FROM_COMPRESS.values()) <= set(inspect.signature(compress).parameters)


@pytest.mark.parametrize("options,expect", [
    ({"heldotu": []}, "did you mean 'heldout'"),
    ({"sensitivty_ratios": (0.5,)}, "did you mean 'sensitivity_ratios'"),
    ({"zzz": 1}, "the keys: heldout, loss_fn"),
    ({"min_alpha": 0.1}, "give compress min_alpha="),
    ({"strategy": "fisher"}, "give compress allocation="),
    ([("heldout", [])], "must be a dict"),
])
def test_a_wrong_allocation_option_is_one_line(options, expect):
    with pytest.raises(fk.FisherkronError) as err:
        compress(tiny_llama(), "svd", None, ratio=0.1, allocation="sensitivity", allocation_options=options)
    assert expect in _one_line(err)


@pytest.mark.parametrize("value", ["2", "fast", -1, 0, float("nan"), True])
def test_min_speedup_must_be_a_positive_number(value):
    model = tiny_llama()
    with pytest.raises(fk.FisherkronError) as err:
        compress(model, "svd", None, rank=2, min_speedup=value)
    assert "min_speedup" in _one_line(err)
    assert all(isinstance(m, torch.nn.Linear) for n, m in model.named_modules() if n.endswith("_proj"))


@pytest.mark.parametrize("value", ["0.2", 1.5, 0, None])
def test_ratio_must_be_a_number_in_0_1(value):
    with pytest.raises(fk.FisherkronError) as err:
        if value is None:
            fk.plan_ranks(tiny_llama(), LAYERS, ratio=float("inf"))
        else:
            compress(tiny_llama(), "svd", None, ratio=value)
    assert "ratio" in _one_line(err)


# ---------------------------------------------------------------------------- compressing a compressed model

def _nested(model) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, fk.LowRankLinear)
            and any(isinstance(c, fk.LowRankLinear) for c in m.modules() if c is not m)]


@pytest.mark.parametrize("layers", [None, "*"])
def test_compressing_a_compressed_model_factorises_only_its_dense_layers(layers, tmp_path, caplog):
    model = tiny_llama()
    first = compress(model, "svd", None, r".*mlp\..*", rank=3)
    mlp = dict(first.ranks)
    with caplog.at_level(logging.WARNING, logger="fisherkron.hf.surgery"):
        rep = compress(model, "svd", None, layers, rank=2)
    assert rep.already_lowrank == mlp  # left as they were, with their ranks
    assert not _nested(model)
    assert all(model.get_submodule(n).rank == r for n, r in mlp.items())
    attn = [n for n in rep.ranks if "self_attn" in n]
    assert len(attn) == 8 and all(model.get_submodule(n).rank == 2 for n in attn)
    assert set(rep.layers).isdisjoint(mlp)
    warned = [r.getMessage() for r in caplog.records if r.name == "fisherkron.hf.surgery"]
    assert any("low-rank already" in w and next(iter(mlp)) in w for w in warned)
    assert "low-rank already" in str(rep)
    x = _batches(k=1)[0]["input_ids"]
    with torch.no_grad():
        torch.testing.assert_close(load_compressed(save_compressed(model, tmp_path / "m"))(x).logits,
                                   model(x).logits, **RELOAD)


@pytest.mark.parametrize("layers", [None, "model.layers.0.mlp.up_proj", "*mlp*",
                                    r"model\.layers\.\d+\.mlp\.up_proj\..*"])
def test_selecting_only_low_rank_layers_is_refused_in_one_line(layers):
    model = tiny_llama()
    compress(model, "svd", None, rank=2)
    before = {n: type(m) for n, m in model.named_modules()}
    with pytest.raises(fk.FisherkronError) as err:
        compress(model, "svd", None, layers, rank=1)
    msg = _one_line(err)
    assert "low-rank already" in msg and "compressed before" in msg
    assert {n: type(m) for n, m in model.named_modules()} == before


def test_compressing_again_with_the_statistics_is_refused_in_one_line(calibrated):
    base, st = calibrated
    model = copy.deepcopy(base)
    compress(model, "svd_llm", st, rank=2)
    with pytest.raises(fk.FisherkronError) as err:
        compress(model, "svd_llm", st, rank=1)
    assert "the layers of the statistics" in _one_line(err) and "low-rank already" in str(err.value)


# ---------------------------------------------------------------------------- the sweep's cache file: verified entries

#: a float32 held-out loss of the tiny model measured again (another replay of the same blocks)
AGAIN = dict(rel=0, abs=1e-6)
DAMAGES = ["edited value", "nan", "infinity", "string", "null", "bool", "rank renamed", "rows swapped",
           "checksum dropped", "checksum of another entry", "not an entry", "cost edited", "base edited", "base nan"]


def _damage(path: Path, how: str) -> list[str]:
    """Damage the cache file ``path`` in place (valid JSON throughout); returns the entries damaged."""
    got = json.loads(path.read_text())
    rows, first = got["layers"], LAYERS[0]
    r = next(iter(rows[first]["row"]))
    value = {"edited value": rows[first]["row"][r] + 0.5, "nan": math.nan, "infinity": math.inf, "string": "x",
             "null": None, "bool": True}.get(how)
    if how in ("edited value", "nan", "infinity", "string", "null", "bool"):
        rows[first]["row"][r] = value
    elif how == "rank renamed":
        rows[first]["row"][str(int(r) + 1)] = rows[first]["row"].pop(r)
    elif how == "rows swapped":  # each with the checksum of the other layer's entry
        rows[first], rows[LAYERS[1]] = rows[LAYERS[1]], rows[first]
    elif how == "checksum dropped":
        del rows[first]["check"]
    elif how == "checksum of another entry":
        rows[first]["check"] = rows[LAYERS[1]]["check"]
    elif how == "not an entry":
        rows[first] = [1.0, 2.0]
    elif how == "cost edited":
        rows[first]["evaluations"] += 1
    elif how == "base edited":
        got["base"]["value"] += 1.0
    elif how == "base nan":
        got["base"]["value"] = math.nan
    path.write_text(json.dumps(got))
    return ["base"] if how.startswith("base") else list(LAYERS) if how == "rows swapped" else [first]


def _same_sweep(got: dict, want: dict) -> None:
    assert got["base"] == pytest.approx(want["base"], **AGAIN)
    assert got["table"].keys() == want["table"].keys()
    for name, row in want["table"].items():
        assert got["table"][name].keys() == row.keys()
        assert [got["table"][name][r] for r in row] == pytest.approx(list(row.values()), **AGAIN), name


@pytest.mark.parametrize("how", DAMAGES)
def test_a_damaged_sweep_cache_entry_is_measured_again_never_used(how, tmp_path, caplog, monkeypatch):
    model = tiny_llama()
    first = _sweep(model, tmp_path)
    path = Path(first["path"])
    damaged = _damage(path, how)
    measured = []
    real = sensitivity.loss_with_factors
    monkeypatch.setattr(sensitivity, "loss_with_factors", lambda m, name, *a, **k: measured.append(name) or
                        real(m, name, *a, **k))
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        again = _sweep(model, tmp_path)
    _same_sweep(again, first)
    assert not again["from_cache"] and again["path"] == first["path"]
    assert sorted(set(measured)) == sorted(n for n in damaged if n != "base")  # only the damaged entries
    assert len(measured) == sum(len(first["table"][n]) for n in damaged if n != "base")
    warned = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert len(warned) == len(damaged), warned
    for name in damaged:
        assert any(str(path) in w and f"entry '{name}'" in w and "measuring it again" in w for w in warned), warned
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        third = _sweep(model, tmp_path)  # the file was mended
    assert third["from_cache"] and not [r for r in caplog.records if r.name == LOGGER]
    _same_sweep(third, first)
    assert third["evaluations"] == first["evaluations"]


@pytest.mark.parametrize("text", ["{ not json", "[1, 2]", '{"key": "another"}'])
def test_a_sweep_cache_file_that_is_not_this_sweeps_is_measured_again(text, tmp_path, caplog):
    model = tiny_llama()
    first = _sweep(model, tmp_path)
    Path(first["path"]).write_text(text)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        again = _sweep(model, tmp_path)
    _same_sweep(again, first)
    assert not again["from_cache"] and again["evaluations"] == first["evaluations"]
    assert any(first["path"] in r.getMessage() for r in caplog.records if r.name == LOGGER)


def test_an_interrupted_sweep_leaves_only_verified_entries_and_resumes(tmp_path, caplog, monkeypatch):
    model = tiny_llama()
    want = _sweep(model, None, cache=False)
    real = sensitivity.loss_with_factors

    def stop(m, name, *a, **k):
        if name == LAYERS[1]:
            raise KeyboardInterrupt
        return real(m, name, *a, **k)
    monkeypatch.setattr(sensitivity, "loss_with_factors", stop)
    with pytest.raises(KeyboardInterrupt):
        _sweep(model, tmp_path)
    monkeypatch.setattr(sensitivity, "loss_with_factors", real)
    (path,) = tmp_path.glob("sensitivity-*.json")
    assert set(json.loads(path.read_text())["layers"]) == {LAYERS[0]}
    assert not list(tmp_path.glob(".*")) and len(list(tmp_path.iterdir())) == 1  # no temporary left
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        got = _sweep(model, tmp_path)
    _same_sweep(got, want)
    assert not [r for r in caplog.records if r.name == LOGGER] and got["evaluations"] == want["evaluations"]


@pytest.mark.parametrize("where", ["dense", "compressed"])
@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_a_measurement_that_is_not_finite_is_refused_in_one_line_and_never_kept(where, bad, tmp_path):
    model = tiny_llama()

    def loss(m, b):
        compressed = isinstance(m.get_submodule("model.layers.1.self_attn.o_proj"), fk.LowRankLinear)
        return m(**b).loss * (bad if where == "dense" or compressed else 1.0)

    with pytest.raises(fk.FisherkronError) as err:
        _sweep(model, tmp_path, loss_fn=loss, loss_name=f"{where}-{bad}")
    msg = _one_line(err)
    assert str(bad) in msg and ("of the dense model" if where == "dense" else f"with {LAYERS[1]} at rank") in msg
    for f in tmp_path.glob("sensitivity-*.json"):
        text = f.read_text()
        assert "NaN" not in text and "Infinity" not in text
        assert set(json.loads(text)["layers"]) == ({LAYERS[0]} if where == "compressed" else set())


# ---------------------------------------------------------------------------- imports run one way

HF = Path(fk.__file__).resolve().parent / "hf"


def _module(path: Path) -> str:
    parts = list(path.relative_to(HF.parent.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(path: Path, package: list[str]):
    """``(absolute module, inside a function)`` for each fisherkron import of ``path``, a file of ``package``."""
    tree = ast.parse(path.read_text())
    local = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
             for n in ast.walk(f)}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = ".".join(package[: len(package) - node.level + 1]) if node.level else node.module
            if node.level and node.module:
                base += "." + node.module
            names = [f"{base}.{a.name}" for a in node.names] if node.module is None else [base]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        yield from ((mod, id(node) in local) for mod in names if mod.startswith("fisherkron"))


def _package(path: Path) -> list[str]:
    return _module(path).split(".") if path.name == "__init__.py" else _module(path).split(".")[:-1]


def _graph() -> dict[str, set[str]]:
    files = {_module(p): p for p in HF.rglob("*.py")}
    return {m: {t for t, _ in _imported(p, _package(p)) if t in files} for m, p in files.items()}


def _reached(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), list(graph[start])
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo += graph.get(m, ())
    return seen


@pytest.mark.parametrize("mod", ["allocation", "sensitivity", "surgery", "budget"])
def test_allocation_sensitivity_surgery_and_budget_import_one_way(mod):
    graph, start = _graph(), f"fisherkron.hf.{mod}"
    assert start not in _reached(graph, start), f"{start} imports itself through another module"
    path = HF / f"{mod}.py"
    hidden = [t for t, inside in _imported(path, _package(path)) if inside]
    assert not hidden, f"{start} imports {hidden} inside a function"


def test_the_arrows_run_surgery_allocation_sensitivity_and_budget():
    graph = _graph()
    assert graph["fisherkron.hf.surgery"] >= {"fisherkron.hf.allocation", "fisherkron.hf.budget"}
    assert graph["fisherkron.hf.allocation"] >= {"fisherkron.hf.sensitivity", "fisherkron.hf.budget"}
    above = {"fisherkron.hf.surgery", "fisherkron.hf.allocation"}
    assert not above & (graph["fisherkron.hf.sensitivity"] | graph["fisherkron.hf.budget"])
    assert not above & (_reached(graph, "fisherkron.hf.sensitivity") | _reached(graph, "fisherkron.hf.budget"))


def test_the_sweep_is_still_importable_from_allocation():
    """Callers of the first layout keep working: the sweep's names are re-exported, the same objects."""
    for name in sensitivity.__all__:
        if name in allocation.__all__:
            assert getattr(allocation, name) is getattr(sensitivity, name), name
    assert set(allocation.__all__) >= {"sensitivity_sweep", "sweep_key", "mean_loss", "loss_with_factors",
                                       "PrefixReplay", "SENSITIVITY_RATIOS", "layer_statistics"}
    assert allocation.CODE_VERSION is sensitivity.CODE_VERSION
    assert "hf/sensitivity.py" in sensitivity._SWEEP_CODE and "hf/allocation.py" in sensitivity._SWEEP_CODE


def test_the_import_reader_sees_a_circle_and_an_import_in_a_function(tmp_path):
    """The reader is not vacuous: the shape of the code before the budget module is found."""
    src = tmp_path / "allocation.py"
    src.write_text("from . import speed\nfrom ..core.lowrank import x\n\ndef allocate():\n    from .surgery import y\n")
    got = sorted(_imported(src, ["fisherkron", "hf"]))
    assert got == [("fisherkron.core.lowrank", False), ("fisherkron.hf.speed", False), ("fisherkron.hf.surgery", True)]
    assert "a" in _reached({"a": {"b"}, "b": {"a", "c"}, "c": set()}, "a")
