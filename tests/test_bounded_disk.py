"""Calibration under a bound on disk (``max_disk``), and the estimates of a dry run.

1. a bounded collection (at least three groups of layers) gives MFF factors and statistics equal
   to the unbounded collection's, bit for bit (same batches, same order, same machine), and the
   cache folder never held more than the bound, measured at every write;
2. compression from a bounded entry equals compression from an unbounded one; other MFF
   options, or reading gradients, are refused in one line;
3. an interrupted bounded collection resumes from the groups it finished (a damaged finished
   file is collected again); an unbounded entry is reused; a bound that holds everything changes
   nothing; a bound too small is refused in one line naming the layer, the need and the bound;
4. :func:`fisherkron.hf.budget.calibration_needs` against the files of a real run, and
   :func:`~fisherkron.hf.calibration.disk.parse_size`.
"""
import copy
import functools
import json
import logging
import os
import re
import signal
from pathlib import Path

import numpy as np
import pytest
import torch
from tiny_models import tiny_llama, token_batches

import fisherkron as fk
from fisherkron.core.conventions import FisherkronError
from fisherkron.hf.budget import calibration_needs
from fisherkron.hf.calibration import collect_calibration, parse_size
from fisherkron.hf.calibration import collect as collect_module
from fisherkron.hf.calibration import disk
from fisherkron.hf.calibration.bounded import RECORD, folder_bytes
from fisherkron.hf.calibration.disk import format_size, layer_disk, plan_groups

K = 4


def _sizes(model, methods, k=K, grad_dtype="float32"):
    from fisherkron.hf.calibration.entry import METHOD_STATS, STATS

    stats = tuple(s for s in STATS if any(s in METHOD_STATS[m] for m in methods))
    mods = dict(model.named_modules())
    names = fk.select_layers(model)
    return {n: layer_disk(mods[n].out_features, mods[n].in_features, k=k, stats=stats, grad_dtype=grad_dtype)
            for n in names}


def _bound(model, methods, **kw):
    """A bound with room for the finished entry and a third of the gradients (and their checkpoints)."""
    plan = plan_groups(_sizes(model, methods, **kw), None)
    return plan.fixed + (plan.unbounded_peak - plan.fixed) // 3


@pytest.fixture
def disk_log(monkeypatch):
    """Record the bytes under the cache root at every point a calibration adds to it: after a gradient file's
    space is reserved, after each ``np.save`` and just before every atomic rename (the temporary and the file
    it replaces both exist then). The manifest's margin shrinks to what a tiny model's needs (its manifest
    is 15 kB), so that the bound is tight enough for a file left out of the plan to break it."""
    monkeypatch.setattr(disk, "MANIFEST_MARGIN", 24 * 1024)
    monkeypatch.setattr(disk, "LAYER_MARGIN", 512)
    monkeypatch.setattr(disk, "TORCH_FILE_MARGIN", 3 * 1024)  # measured: 1.9-2.1 kB
    seen = {"root": None, "sizes": []}

    def record():
        if seen["root"] is not None and Path(seen["root"]).exists():
            seen["sizes"].append(folder_bytes(Path(seen["root"])))

    real_pre, real_replace, real_save = collect_module.preallocate, os.replace, np.save

    def preallocate(*a, **kw):
        real_pre(*a, **kw)
        record()

    def replace(src, dst, *a, **kw):
        record()
        return real_replace(src, dst, *a, **kw)

    def save(*a, **kw):
        real_save(*a, **kw)
        record()

    monkeypatch.setattr(collect_module, "preallocate", preallocate)
    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(np, "save", save)
    return seen


# ----------------------------------------------------------------------------- 1. same factors, under the bound

@pytest.mark.parametrize("methods,grad_dtype", [(("gfwsvd",), "float32"),
                                                (("gfwsvd", "kfac_svd", "fwsvd", "asvd"), "bfloat16")])
def test_a_bounded_collection_gives_the_unbounded_factors_and_stays_under_its_bound(methods, grad_dtype, tmp_path,
                                                                                    disk_log):
    """Equal bit for bit: every layer's gradient is the same product of the same batch in both runs (other
    weights not requiring gradients only changes which products backward computes), and MFF reads it the
    same way. The folder size is measured at every write, with a checkpoint after every batch."""
    model, batches = tiny_llama(), token_batches(k=K)
    whole = collect_calibration(model, batches, methods=methods, grad_dtype=grad_dtype, cache_dir=tmp_path / "whole")
    bound = _bound(model, methods, grad_dtype=grad_dtype)
    disk_log["root"] = tmp_path / "bounded"
    part = collect_calibration(model, batches, methods=methods, grad_dtype=grad_dtype, max_disk=bound,
                               cache_dir=tmp_path / "bounded", checkpoint_seconds=1e-9)
    disk_log["root"] = None
    man = json.loads((part.dir / "manifest.json").read_text())
    assert len(man["groups"]) >= 3 and man["passes"] == K * len(man["groups"])
    assert part.dir != whole.dir and not part.keeps_gradients and whole.keeps_gradients
    assert not list(part.dir.glob("*.grads.npy")) and not (part.dir / RECORD).exists()
    peak = max(disk_log["sizes"])
    plan = plan_groups(_sizes(model, methods, grad_dtype=grad_dtype), bound)
    assert plan.groups == man["groups"] and peak <= plan.peak <= bound, (peak, plan.peak, bound)
    grads = max(sum(f.stat().st_size for f in whole.dir.glob(f"{n}.grads.npy")) for n in whole.layers)
    assert peak >= folder_bytes(part.dir) - 1e6 + grads  # the measurement saw a group's gradients on disk
    for n in whole.layers:
        a, b = whole.kronecker(n), part.kronecker(n)
        assert torch.equal(a["A"], b["A"]) and torch.equal(a["B"], b["B"]), n
        assert (a["fisher_share"], a["matvecs"]) == (b["fisher_share"], b["matvecs"])
    stats = sorted(f.name for f in whole.dir.glob("*.npy") if not f.name.endswith(".grads.npy"))
    assert stats == sorted(f.name for f in part.dir.glob("*.npy"))
    for name in stats:
        np.testing.assert_array_equal(np.load(whole.dir / name), np.load(part.dir / name), err_msg=name)
    assert part.layers == whole.layers


def test_per_token_gradients_are_bounded_too(tmp_path):
    """granularity="token" keeps each layer's inputs and output gradients (``T x m``, ``T x n``) per group."""
    model, batches = tiny_llama(), token_batches(k=K)
    kw = dict(methods=["gfwsvd"], granularity="token")
    whole = collect_calibration(model, batches, cache_dir=tmp_path / "whole", **kw)
    tokens = sum(int(b["attention_mask"].sum()) for b in batches)
    mods = dict(model.named_modules())
    sizes = {n: layer_disk(mods[n].out_features, mods[n].in_features, k=K, stats=("grads",), granularity="token",
                           tokens=tokens) for n in whole.layers}
    plan = plan_groups(sizes, None)
    bound = plan.fixed + (plan.unbounded_peak - plan.fixed) // 3
    part = collect_calibration(model, batches, cache_dir=tmp_path / "bounded", max_disk=bound, **kw)
    assert len(json.loads((part.dir / "manifest.json").read_text())["groups"]) >= 2
    assert not list(part.dir.glob("*.X.npy")) and not list(part.dir.glob("*.D.npy"))
    for n in whole.layers:
        assert torch.equal(whole.kronecker(n)["B"], part.kronecker(n)["B"]), n


# ----------------------------------------------------------------------------- 2. compression from a bounded entry

def test_compression_from_a_bounded_entry_equals_the_unbounded_one(tmp_path):
    model, batches = tiny_llama(), token_batches(k=K)
    opts = {"tol": 1e-4}
    whole = collect_calibration(model, batches, methods=["gfwsvd"], cache_dir=tmp_path)
    part = collect_calibration(model, batches, methods=["gfwsvd"], cache_dir=tmp_path / "bounded",
                               max_disk=_bound(model, ["gfwsvd"]), mff_options={**opts, "device": "cpu"})
    a, b = copy.deepcopy(model), copy.deepcopy(model)
    fk.compress(a, "gfwsvd", whole, ratio=0.2, mff_options=opts)
    fk.compress(b, "gfwsvd", part, ratio=0.2, mff_options=opts)
    for (na, pa), (nb, pb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert na == nb and torch.equal(pa, pb), na
    x = batches[0]["input_ids"]
    assert torch.equal(a(input_ids=x).logits, b(input_ids=x).logits)
    with pytest.raises(FisherkronError, match=r"keeps MFF's factors instead of gradients.*options \{'dtype': 'float64', "
                                              r"'tol': 0\.0001\}.*none for init='kfac' and options \{'dtype': 'float64'\}") as err:
        fk.compress(copy.deepcopy(model), "gfwsvd", part, ratio=0.2)
    assert "\n" not in str(err.value)
    with pytest.raises(FisherkronError, match="collected under a disk bound .*no gradient file"):
        part.grads_path(next(iter(part.layers)))
    with pytest.raises(FisherkronError, match="no gradients to read"):
        fk.mff(part.gradients(next(iter(part.layers))))


def test_a_damaged_factor_file_of_a_bounded_entry_makes_it_collected_again(tmp_path, caplog):
    """The factors stand for the gradients: the manifest lists them with their checksums."""
    model, batches = tiny_llama(), token_batches(k=K)
    run = functools.partial(collect_calibration, model, batches, methods=["gfwsvd"], cache_dir=tmp_path,
                            max_disk=_bound(model, ["gfwsvd"]))
    first = run()
    f = next((first.dir / "mff").glob("*.pt"))
    data = bytearray(f.read_bytes())
    data[-100] ^= 0xFF
    f.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING):
        again = run()
    assert not again.from_cache and "fails its checksum; recomputing" in caplog.text


# ----------------------------------------------------------------------------- 3. resume, reuse, refusals

def _interrupted(folder):
    """A bounded collection stopped by SIGTERM in the second batch of its second group:
    ``(run, calls, partial folder, groups)``; ``run()`` repeats the call, ``calls`` counts its batches."""
    model, batches = tiny_llama(), token_batches(k=K)
    calls, armed = [], [True]

    def loss(m, x):
        calls.append(1)
        if armed[0] and len(calls) == K + 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return m(**x).loss
    bound = _bound(model, ["gfwsvd"])
    run = functools.partial(collect_calibration, model, batches, methods=["gfwsvd"], loss_fn=loss, loss_name="b",
                            max_disk=bound, cache_dir=folder)
    with pytest.raises(KeyboardInterrupt, match=f"after batch 2 of {K}"):
        run()
    armed[0] = False
    calls.clear()
    (partial,) = Path(folder).glob("*.partial")
    return run, calls, partial, plan_groups(_sizes(model, ["gfwsvd"]), bound).groups


def _same_factors(st, folder):
    whole = collect_calibration(tiny_llama(), token_batches(k=K), methods=["gfwsvd"], cache_dir=folder)
    for n in whole.layers:
        assert torch.equal(whole.kronecker(n)["A"], st.kronecker(n)["A"]), n


def test_an_interrupted_bounded_collection_resumes_from_its_finished_groups(tmp_path):
    """Group 1 is kept (factors, no gradients); group 2 resumes from its checkpoint; loss calls count batches."""
    run, calls, partial, groups = _interrupted(tmp_path)
    assert len(groups) >= 3
    record = json.loads((partial / RECORD).read_text())["layers"]
    assert set(record) == set(groups[0])
    assert not any((partial / f"{n}.grads.npy").exists() for n in groups[0])  # deleted once its factors were kept
    assert all((partial / f"{n}.grads.npy").exists() for n in groups[1])
    st = run()
    assert len(calls) == (K - 2) + K * (len(groups) - 2)
    _same_factors(st, tmp_path / "whole")


def test_a_finished_layer_damaged_since_is_collected_again(tmp_path, caplog):
    """The layers left (the damaged one first) are planned again under the bound, after the layers still
    done: the groups differ from the interrupted run's, so every group left runs all its batches."""
    run, calls, partial, groups = _interrupted(tmp_path)
    record = json.loads((partial / RECORD).read_text())["layers"]
    layer = groups[0][-1]
    damaged = partial / next(iter(record[layer]["files"]))
    damaged.write_bytes(damaged.read_bytes()[:-8])
    with caplog.at_level(logging.WARNING):
        st = run()
    assert f"of layer {layer} is missing or changed since it was finished" in caplog.text
    left = plan_groups(_sizes(tiny_llama(), ["gfwsvd"]), _bound(tiny_llama(), ["gfwsvd"]),
                       done=set(record) - {layer}).groups
    assert left[0][0] == layer and len(calls) == K * len(left)
    _same_factors(st, tmp_path / "whole")


def test_a_cached_unbounded_entry_is_reused_a_roomy_bound_changes_nothing_and_cache_false_works(tmp_path):
    model, batches = tiny_llama(), token_batches(k=K)
    whole = collect_calibration(model, batches, methods=["gfwsvd"], cache_dir=tmp_path)
    again = collect_calibration(model, batches, methods=["gfwsvd"], cache_dir=tmp_path,
                                max_disk=_bound(model, ["gfwsvd"]))
    assert again.from_cache and again.dir == whole.dir
    roomy = collect_calibration(model, batches, methods=["gfwsvd"], cache_dir=tmp_path / "other", max_disk="1TB")
    assert roomy.key == whole.key and roomy.keeps_gradients
    private = collect_calibration(model, batches, methods=["gfwsvd"], cache=False, cache_dir=tmp_path / "private",
                                  max_disk=_bound(model, ["gfwsvd"]))  # no checkpoints, a folder of its own
    assert not private.keeps_gradients and not private.from_cache
    n = fk.select_layers(model)[-1]
    assert torch.equal(private.kronecker(n)["A"], whole.kronecker(n)["A"])


def test_a_bound_too_small_is_refused_in_one_line(tmp_path):
    """The layer that needs the most (the last: every other layer's factors are kept by then), its gradients,
    the bound and the smallest bound that works; nothing is written."""
    model, batches = tiny_llama(), token_batches(k=K)
    plan = plan_groups(_sizes(model, ["gfwsvd"]), None)
    last = fk.select_layers(model)[-1]
    with pytest.raises(FisherkronError, match=rf"^layer {re.escape(last)} needs .* for its gradients, .* more than "
                                              rf"max_disk=.*; raise max_disk to at least "
                                              rf"{re.escape(format_size(plan.minimum))},") as err:
        collect_calibration(model, batches, methods=["gfwsvd"], cache_dir=tmp_path, max_disk=plan.minimum - 1)
    assert "\n" not in str(err.value) and not any(tmp_path.iterdir())
    with pytest.raises(FisherkronError, match=r"statistics and MFF factors of the 14 selected layers alone"):
        collect_calibration(model, batches, methods=["gfwsvd"], cache_dir=tmp_path, max_disk=plan.fixed // 2)
    with pytest.raises(FisherkronError, match="cannot read the disk size '20 parsecs'"):
        collect_calibration(model, batches, methods=["gfwsvd"], cache_dir=tmp_path, max_disk="20 parsecs")
    collect_calibration(model, batches, methods=["gfwsvd"], cache_dir=tmp_path, max_disk=plan.minimum)


# ----------------------------------------------------------------------------- 4. estimates and sizes

def test_the_estimates_match_the_files_of_a_run(tmp_path):
    model, batches = tiny_llama(), token_batches(k=K, B=2, T=10)
    methods = ["gfwsvd", "kfac_svd", "fwsvd"]
    need = calibration_needs(model, methods=methods, k=K, batch_size=2, seq_len=10)
    whole = collect_calibration(model, batches, methods=methods, cache_dir=tmp_path)
    grads = sum(f.stat().st_size for f in whole.dir.glob("*.grads.npy"))
    stats = sum(f.stat().st_size for f in whole.dir.glob("*.npy")) - grads
    assert need["gradient_bytes"] == grads and need["statistics_bytes"] == stats  # .npy sizes are exact
    for n in whole.layers:
        whole.kronecker(n)
    factors = sum(f.stat().st_size for f in (whole.dir / "mff").glob("*.pt"))
    assert factors <= need["factor_bytes"] <= factors + 8 * 1024 * len(whole.layers)
    assert need["passes"] == K and need["groups"] == 1 and need["tokens"] == K * 2 * 10
    assert need["model_bytes"] == sum(p.numel() * 4 for p in model.parameters())
    bound = _bound(model, methods)
    under = calibration_needs(model, methods=methods, k=K, batch_size=2, seq_len=10, max_disk=bound)
    part = collect_calibration(model, batches, methods=methods, cache_dir=tmp_path / "bounded", max_disk=bound)
    man = json.loads((part.dir / "manifest.json").read_text())
    assert under["groups"] == len(man["groups"]) and under["passes"] == man["passes"]
    assert folder_bytes(part.dir) <= under["disk_bytes_bounded"] <= bound


def test_the_estimate_of_llama_2_7b_at_the_papers_setting():
    """Pure arithmetic: 32 blocks of q, k, v, o (4096 x 4096), gate, up (11008 x 4096), down (4096 x 11008)."""
    shapes = {f"{i}.{p}": (4096, 4096) for i in range(32) for p in "qkvo"}
    shapes.update({f"{i}.{p}": (11008, 4096) for i in range(32) for p in ("gate", "up")})
    shapes.update({f"{i}.down": (4096, 11008) for i in range(32)})
    entries = 32 * (4 * 4096 * 4096 + 3 * 11008 * 4096)
    need = calibration_needs(shapes, k=75, batch_size=1, seq_len=4096, grad_dtype="bfloat16", max_disk="300GB",
                             params=6_738_415_616, param_bytes=2)
    assert abs(need["gradient_bytes"] - 75 * 2 * entries) < 224 * 200  # headers only
    assert abs(need["factor_bytes"] / 8 - 32 * (4 * 2 * 4096**2 + 3 * (4096**2 + 11008**2))) < 224 * 8 * 1024
    assert need["passes"] == need["groups"] * 75 and need["disk_bytes_bounded"] <= 300e9 < need["disk_bytes"]
    assert 140e9 < need["min_max_disk"] < 150e9  # the float64 factors, and the last layer's gradients
    with pytest.raises(FisherkronError, match=r"layer 31\.down needs 6\.76 GB for its gradients"):
        calibration_needs(shapes, k=75, batch_size=1, seq_len=4096, grad_dtype="bfloat16", max_disk="145GB")


@pytest.mark.parametrize("text,value", [("20GB", 20 * 10**9), ("1.5 TB", 1.5e12), ("512MiB", 2**29),
                                        ("100", 100), (" 3 gib ", 3 * 2**30), (4096, 4096), ("2e3kB", 2 * 10**6)])
def test_sizes_are_read_in_decimal_and_binary_units(text, value):
    assert parse_size(text) == int(value)


@pytest.mark.parametrize("bad", ["", "GB", "20 GBs", "-5GB", "0.1", 0, -3, float("nan"), True, [20]])
def test_a_size_that_cannot_be_read_is_refused_in_one_line(bad):
    with pytest.raises(FisherkronError) as err:
        parse_size(bad)
    assert "\n" not in str(err.value)
