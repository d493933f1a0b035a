"""fisherkron on torch.distributed: 2 gloo processes on this CPU against one process.

Each test starts two processes (``tests/distributed_ranks.py``: forked from a preloaded
forkserver, joined in a gloo group, killed after a time limit), runs a function of this
file on both and compares what they return with a single-process run in the test itself.
Batch ``i`` goes to rank ``i % 2``; the batch counts are odd, so the ranks hold different
numbers of batches (a mean over the local instead of the global ``k`` weights them wrongly).
"""
import io
import json
import shutil
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from distributed_ranks import run_ranks

import fisherkron as fk
from fisherkron.core.distributed import product_comm_bytes
from fisherkron.testing import F64_REL, MFF_F32_REL, MFF_F64_REL, MFF_REF_TOL, MODEL_F32_REL, rel_error

HERE = Path(__file__)


def _gradients(k=7, n=9, m=6, seed=0):
    """``k`` correlated float32 gradients of an odd ``n x m`` layer (Lanczos needs several products)."""
    from fisherkron.experiments.synthetic_gradients import synthetic_gradients
    return synthetic_gradients(n, m, k, tokens=8, rho=0.5, seed=seed, dtype=torch.float64).G.float()


def _kron(A, B):
    return torch.outer(fk.vec(A), fk.vec(B))  # R(A (x) B) = vec(A) vec(B)^T


def _ok(results):
    """The values of a run in which every rank must have succeeded."""
    for rank, (ok, value) in enumerate(results):
        assert ok, f"rank {rank} failed: {value}"
    return [v for _, v in results]


# ----------------------------------------------------------------------------- one process: nothing changes

def test_without_a_process_group_nothing_changes(monkeypatch, capsys):
    from fisherkron.cli import main

    G = _gradients()
    assert not dist.is_initialized()
    ref, auto = fk.mff(G), fk.mff(G, group="auto")  # "auto" with no process group: the one-process path
    assert torch.equal(ref.A, auto.A) and auto.world_size == 1 and auto.comm_bytes == 0
    with pytest.raises(fk.FisherkronError, match="process group, 'auto' or None"):
        fk.mff(G, group="world")
    with pytest.raises(fk.FisherkronError, match="not initialised"):
        fk.mff(G, group=object())
    monkeypatch.setenv("WORLD_SIZE", "2")  # as under torchrun: only compress runs on several processes
    with pytest.raises(SystemExit) as exit_:
        main(["factorize", "g.npy", "--out", "f.pt"])
    assert exit_.value.code == 2 and "start it without torchrun" in capsys.readouterr().err


# ----------------------------------------------------------------------------- data-parallel MFF

def mff_on_ranks(rank, world, G):
    """MFF on this rank's batches ``i % world == rank``, in float32 and float64; bytes all-reduced, measured."""
    sizes = []
    real = dist.all_reduce

    def counting(t, *a, **kw):  # every all_reduce of this process: its payload in bytes
        sizes.append(t.numel() * t.element_size())
        return real(t, *a, **kw)

    dist.all_reduce = counting
    try:
        mine = G[rank::world]  # (k_p, n, m)
        r32 = fk.mff(mine, group="auto", compute_norm=False)
        measured = sum(sizes)
        r64 = fk.mff(list(mine.double()), group="auto", dtype=torch.float64, tol=MFF_REF_TOL)
    finally:
        dist.all_reduce = real
    one = fk.mff(G[:1] if rank == 0 else G[:0], group="auto", dtype=torch.float64, tol=MFF_REF_TOL)  # k = 1
    return {"r32": r32, "measured": measured, "r64": r64, "one": one}


def test_data_parallel_mff_equals_one_process(tmp_path):
    G = _gradients()  # k = 7: rank 0 holds 4 gradients, rank 1 holds 3
    k, n, m = G.shape
    got = _ok(run_ranks(HERE, "mff_on_ranks", 2, tmp_path, G))
    ref32 = fk.mff(G)
    ref64 = fk.mff(G.double(), dtype=torch.float64, tol=MFF_REF_TOL)
    # Dividing each rank's sum by its own k_p instead of the global k computes R(F) of the gradients
    # sqrt(k / k_p) G_i: ~2x too large and reweighted. Its A (x) B is far outside MFF_F32_REL (checked here):
    buggy = fk.mff(torch.cat([G[p::2] * (k / G[p::2].shape[0]) ** 0.5 for p in range(2)]), dtype=torch.float64)
    assert rel_error(_kron(buggy.A, buggy.B), _kron(ref64.A, ref64.B)) > 100 * MFF_F32_REL
    for r in got:
        # float32: same factors as one process holding all k gradients, to the float32 MFF tolerance
        assert r["r32"].world_size == 2 and r["r32"].converged
        assert rel_error(_kron(r["r32"].A, r["r32"].B), _kron(ref64.A, ref64.B)) <= MFF_F32_REL
        assert rel_error(_kron(r["r32"].A, r["r32"].B), _kron(ref32.A, ref32.B)) <= MFF_F32_REL
        # float64: equal to round-off, ||F|| (exchanged across ranks) included
        assert rel_error(_kron(r["r64"].A, r["r64"].B), _kron(ref64.A, ref64.B)) <= MFF_F64_REL
        assert abs(r["r64"].fisher_share - ref64.fisher_share) <= F64_REL
        # one m x m (R(F)) or n x n (R(F)^T) float64 matrix + the failure flag per product, and nothing else
        assert r["measured"] == r["r32"].comm_bytes
        products_R = (r["r32"].matvecs + 1) // 2 if m <= n else r["r32"].matvecs // 2  # start on the B side
        assert r["r32"].comm_bytes == (products_R * product_comm_bytes(m)
                                       + (r["r32"].matvecs - products_R) * product_comm_bytes(n))
        # a rank with no batches at all (k = 1 on two ranks) still takes part
        one = fk.mff(G[:1].double(), dtype=torch.float64, tol=MFF_REF_TOL)
        assert rel_error(_kron(r["one"].A, r["one"].B), _kron(one.A, one.B)) <= MFF_F64_REL
    # both ranks ran the same products and return the same bytes
    assert got[0]["r32"].matvecs == got[1]["r32"].matvecs
    assert torch.equal(got[0]["r32"].A, got[1]["r32"].A) and torch.equal(got[0]["r64"].B, got[1]["r64"].B)


def mff_failures(rank, world, G, folder):
    """Bad input on rank 1 only, at three places; every rank must raise (and none wait)."""
    errors = []
    bad = G[rank::world].clone()
    if rank == 1:
        bad[-1, 0, 0] = float("nan")
    path = Path(folder) / f"rank{rank}.npy"
    np.save(path, bad.numpy())
    one = G.shape[1] * G.shape[2] * 4
    cases = [{"grads": bad},  # found when the stack is built
             {"grads": str(path), "memory_budget": 3 * one},  # streamed: found inside the first product
             {"grads": G[rank::world] if rank == 0 else G[1::2, :, :3]}]  # shapes disagree
    for kw in cases:
        try:
            fk.mff(group="auto", **kw)
            errors.append(None)
        except fk.FisherkronError as exc:
            errors.append(str(exc))
    return errors


def test_a_failing_rank_stops_every_rank(tmp_path):
    got = _ok(run_ranks(HERE, "mff_failures", 2, tmp_path, _gradients(), str(tmp_path), timeout=40))
    built, streamed, shapes = zip(*got)
    assert "NaN" in built[1] and "rank 1" in built[0] and "NaN" in built[0]
    assert "NaN" in streamed[1] and "other rank(s) failed" in streamed[0]
    assert shapes[0] == shapes[1] and "different shapes" in shapes[0]
    assert all("\n" not in e for e in built + streamed + shapes)


# ----------------------------------------------------------------------------- calibration and compression

#: float64 MFF to round-off, so that factors (and the compressed models built on them) agree to round-off
F64_MFF = {"dtype": torch.float64, "tol": MFF_REF_TOL}


def _calibration_setup():
    from test_calibration import CHECKED_LAYERS, lm_batches
    from tiny_models import tiny_llama
    return tiny_llama, lm_batches, CHECKED_LAYERS["llama"]


def _logits(model):
    _, lm_batches, _ = _calibration_setup()
    with torch.no_grad():
        return model(**lm_batches(1, seed=9)[0]).logits  # (B, T, vocab)


def calibrate_and_compress(rank, world, fresh, reused):
    """Calibrate on the ranks, MFF over the ranks (both layouts), compress on rank 0."""
    from fisherkron.hf.distributed import precompute_kronecker

    tiny_llama, lm_batches, layers = _calibration_setup()
    out = {}
    for folder, parallel in ((fresh, "batches"), (reused, "layers")):
        model = tiny_llama()
        stats = fk.collect_calibration(model, lm_batches(), layers, cache_dir=folder, group="auto")
        done = precompute_kronecker(stats, group="auto", parallel=parallel, **F64_MFF)
        row = {"from_cache": stats.from_cache, "dir": str(stats.dir), "k": stats.k, "done": sorted(done)}
        if rank == 0:  # finds every layer's factors in stats.dir/mff: no MFF runs here
            fk.compress(model, "gfwsvd", stats, rank=3, mff_options=F64_MFF)
            row["logits"] = _logits(model)
        out[parallel] = row
    return out


def test_distributed_calibration_and_compression_equal_one_process(tmp_path):
    from test_calibration import check_statistics_equal_autograd

    tiny_llama, lm_batches, layers = _calibration_setup()  # k = 3 batches: rank 0 runs 0 and 2, rank 1 runs 1
    single = fk.collect_calibration(tiny_llama(), lm_batches(), layers, cache_dir=tmp_path / "single")
    shutil.copytree(tmp_path / "single", tmp_path / "reused")  # an entry one process wrote, for two to reuse
    model = tiny_llama()
    fk.compress(model, "gfwsvd", single, rank=3, mff_options=F64_MFF)
    ref = _logits(model)
    got = _ok(run_ranks(HERE, "calibrate_and_compress", 2, tmp_path, tmp_path / "fresh", tmp_path / "reused"))
    names = list(single.layers)
    for r in got:
        # the same cache key (world size is not part of it): one entry serves any number of processes
        assert r["batches"]["dir"] == str(tmp_path / "fresh" / single.key) and not r["batches"]["from_cache"]
        assert r["layers"]["dir"] == str(tmp_path / "reused" / single.key) and r["layers"]["from_cache"]
        assert r["batches"]["k"] == 3 and r["batches"]["done"] == sorted(names)
    # layers spread over the ranks: layer i on rank i % 2, each exactly once
    assert got[0]["layers"]["done"] == sorted(names[0::2]) and got[1]["layers"]["done"] == sorted(names[1::2])
    # the statistics two processes wrote, read back by one (a reuse across world sizes), equal autograd's
    # with the tolerances of the single-process test (diag Fisher and K-FAC B divide by the global k = 3)
    again = fk.collect_calibration(tiny_llama(), lm_batches(), layers, cache_dir=tmp_path / "fresh")
    assert again.from_cache and json.loads((again.dir / "manifest.json").read_text())["world_size"] == 2
    check_statistics_equal_autograd("llama", None, stats=again)
    assert sorted(p.name for p in (again.dir / "mff").iterdir()) == sorted(
        p.name for p in (single.dir / "mff").iterdir())  # the same cache files compress looks for
    # the model rank 0 compressed equals the one-process model, for both layouts of MFF
    for parallel in ("batches", "layers"):
        logits = got[0][parallel]["logits"]
        assert float((logits - ref).abs().max()) <= MODEL_F32_REL * float(ref.abs().max()), parallel
        assert "logits" not in got[1][parallel]


def failing_calibration(rank, world, folder):
    """Rank 1's loss raises on its first batch; both ranks must stop with an error."""
    tiny_llama, lm_batches, _ = _calibration_setup()

    def loss(model, batch):
        if dist.get_rank() == 1:
            raise RuntimeError("the data loader of rank 1 broke")
        return model(**batch).loss

    try:
        fk.collect_calibration(tiny_llama(), lm_batches(), "model.layers.0.mlp.*", cache_dir=folder, group="auto",
                               loss_fn=loss, loss_name="breaks-on-rank-1")
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {exc}"
    return None


def test_a_failing_rank_leaves_no_cache_entry(tmp_path):
    errors = _ok(run_ranks(HERE, "failing_calibration", 2, tmp_path, tmp_path / "cache", timeout=40))
    assert errors[1] == "RuntimeError: the data loader of rank 1 broke"
    assert errors[0].startswith("FisherkronError: calibration failed on rank 1 of 2: RuntimeError: the data loader")
    assert "\n" not in errors[0]
    assert list((tmp_path / "cache").iterdir()) == []  # no entry, no temporary folder


# ----------------------------------------------------------------------------- the command line

def cli_on_ranks(rank, world, argv):
    """``fisherkron compress`` as torchrun starts it: the command joins the process group itself."""
    from fisherkron.cli import main

    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        try:
            code = main([str(a) for a in argv])
        except SystemExit as exc:
            code = exc.code
    return code, out.getvalue(), err.getvalue(), dist.is_initialized()


def test_torchrun_compress_command(tmp_path):
    from test_cli_robustness import _save

    from fisherkron.cli import main
    from fisherkron.hf.saving import load_compressed

    tiny_llama, _, _ = _calibration_setup()
    folder = _save(tiny_llama(), tmp_path / "llama")
    args = [folder, "--method", "gfwsvd", "--k", "3", "--batch-size", "2", "--seq-len", "16", "--rank", "2",
            "--cache-dir", tmp_path / "cache", "--mff-parallel", "batches", "--dist-timeout", "30"]
    got = _ok(run_ranks(HERE, "cli_on_ranks", 2, tmp_path, ["compress", *args, "--out", tmp_path / "two"],
                        join=False, env={"FISHERKRON_DATA": str(tmp_path / "data")}))
    (code0, out0, err0, left0), (code1, out1, err1, left1) = got
    assert code0 == 0 and code1 == 0, (err0, err1)
    summary = json.loads(out0.strip().splitlines()[-1])  # rank 0 reports
    assert summary["out"] == str(tmp_path / "two")
    assert out1 == "" and err1 == ""  # the other rank prints nothing
    assert not left0 and not left1  # the command left the process group it joined
    # one process, reusing the calibration and the MFF factors the two processes cached
    with redirect_stdout(io.StringIO()) as out:
        assert main(["-q", "compress", *map(str, args), "--out", str(tmp_path / "one")]) == 0
    assert json.loads(out.getvalue())["params_after"] == summary["params_after"]
    two, one = load_compressed(tmp_path / "two"), load_compressed(tmp_path / "one")
    ref = _logits(one)
    assert float((_logits(two) - ref).abs().max()) <= MODEL_F32_REL * float(ref.abs().max())


def dying_calibration(rank, world, folder):
    """Rank 1 dies outright (no exception, no clean-up) on its first batch; rank 0 must not wait for ever."""
    import os

    tiny_llama, lm_batches, _ = _calibration_setup()

    def loss(model, batch):
        if dist.get_rank() == 1:
            os._exit(3)
        return model(**batch).loss

    try:
        fk.collect_calibration(tiny_llama(), lm_batches(), "model.layers.0.mlp.*", cache_dir=folder, group="auto",
                               loss_fn=loss, loss_name="dies-on-rank-1")
    except Exception as exc:  # noqa: BLE001
        return type(exc).__name__
    return None


def test_a_rank_that_dies_stops_the_others_and_leaves_no_cache_entry(tmp_path):
    (ok0, err0), (ok1, err1) = run_ranks(HERE, "dying_calibration", 2, tmp_path, tmp_path / "cache", timeout=40)
    assert ok0 and err0 is not None  # rank 0 raised (the peer closed its connection, or the collective timed out)
    assert not ok1 and "code 3" in err1
    assert list((tmp_path / "cache").iterdir()) == []  # rank 0 removed its temporary folder


@pytest.mark.slow
def test_smollm2_script_on_one_block(tmp_path):
    """scripts/distributed_smollm2.py on one block's MLP, k = 2: a table row per process, the same factors."""
    import re
    import subprocess
    import sys

    script = HERE.parents[1] / "scripts" / "distributed_smollm2.py"
    out = subprocess.run([sys.executable, str(script), "--layers", r"model\.layers\.0\.mlp\..*", "--k", "2",
                          "--cache-root", str(tmp_path)], capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [ln for ln in out.stdout.splitlines() if re.match(r"\| [12] \| [01] \|", ln)]
    assert len(rows) == 3 and all("| 3 of 3 |" in r for r in rows)
    diff = float(re.search(r"2 processes against 1: ([0-9.e+-]+)", out.stdout).group(1))
    assert diff <= MFF_F32_REL
