"""Weighted SVDs kept on disk: read back bit for bit by the next process, never stale, bounded, damage recomputed."""
import copy
import os

import pytest
import torch

from fisherkron.core.wsvd import decompose
from fisherkron.hf.calibration import collect_calibration
from fisherkron.hf.decompositions import Decompositions
from fisherkron.hf.surgery import compress
from tiny_models import tiny_llama, token_batches

METHODS = ["gfwsvd", "svd_llm", "asvd", "fwsvd"]


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    model = tiny_llama()
    st = collect_calibration(model, token_batches(k=4, seed=0, B=2, T=10), None,
                             cache_dir=tmp_path_factory.mktemp("cal"))
    return model, st


def _same(a, b):
    return (torch.equal(a.P, b.P) and torch.equal(a.S, b.S) and torch.equal(a.Q, b.Q)
            and a.out_dtype == b.out_dtype and (a.alpha_A, a.alpha_B) == (b.alpha_A, b.alpha_B))


@pytest.mark.parametrize("method", METHODS)
def test_a_new_cache_on_the_same_folder_reads_every_layer_back_exactly(method, calibrated, tmp_path):
    base, st = calibrated
    names = list(st.layers)
    first = Decompositions(tmp_path)
    computed = {n: first.get(base.get_submodule(n), method, st, n) for n in names}
    assert first.misses == len(names) and first.disk_hits == 0
    assert len(list(tmp_path.glob("*.pt"))) == len(names)
    second = Decompositions(tmp_path)  # the next notebook
    for n in names:
        info: dict = {}
        dec, given = second.get(base.get_submodule(n), method, st, n, info=info)
        assert _same(dec, computed[n][0])
        assert given.keys() == computed[n][1].keys()
        for k in given:
            assert torch.equal(torch.as_tensor(given[k]), torch.as_tensor(computed[n][1][k]))
    assert second.misses == 0 and second.disk_hits == len(names)


def test_a_compression_from_disk_equals_one_computed_afresh(calibrated, tmp_path):
    base, st = calibrated
    warm = Decompositions(tmp_path)
    compress(copy.deepcopy(base), "gfwsvd", st, ratio=0.2, allocation="fisher", decompositions=warm)
    read, fresh = copy.deepcopy(base), copy.deepcopy(base)
    cache = Decompositions(tmp_path)
    ra = compress(read, "gfwsvd", st, ratio=0.2, allocation="fisher", decompositions=cache)
    rf = compress(fresh, "gfwsvd", st, ratio=0.2, allocation="fisher")
    assert cache.misses == 0 and cache.disk_hits == len(st.layers)
    assert ra.ranks == rf.ranks
    for pa, pf in zip(read.parameters(), fresh.parameters()):
        assert torch.equal(pa, pf)


def test_a_changed_weight_or_option_is_another_file(calibrated, tmp_path):
    base, st = calibrated
    name = list(st.layers)[0]
    lin = copy.deepcopy(base.get_submodule(name))
    Decompositions(tmp_path).get(lin, "gfwsvd", st, name)
    again = Decompositions(tmp_path)
    again.get(lin, "gfwsvd", st, name, min_alpha=0.1)  # another option
    with torch.no_grad():
        lin.weight.mul_(2.0)  # another weight
    dec, _ = again.get(lin, "gfwsvd", st, name)
    assert again.misses == 2 and again.disk_hits == 0
    assert len(list(tmp_path.glob("*.pt"))) == 3
    want = decompose(lin.weight.detach(), None, None)  # the doubled weight's singular values grow with it
    assert dec.S.shape == want.S.shape


@pytest.mark.parametrize("damage", ["truncate", "flip", "garbage"])
def test_a_damaged_file_is_computed_again_and_replaced(damage, calibrated, tmp_path):
    base, st = calibrated
    name = list(st.layers)[1]
    mod = base.get_submodule(name)
    want, _ = Decompositions(tmp_path).get(mod, "svd_llm", st, name)
    (path,) = tmp_path.glob("*.pt")
    raw = bytearray(path.read_bytes())
    if damage == "truncate":
        raw = raw[: len(raw) // 2]
    elif damage == "flip":  # a byte of the arrays, deep inside the file: only the checksum can tell
        raw[len(raw) // 2] ^= 0xFF
    else:
        raw = bytearray(b"not a torch file")
    path.write_bytes(bytes(raw))
    cache = Decompositions(tmp_path)
    got, _ = cache.get(mod, "svd_llm", st, name)
    assert cache.misses == 1 and cache.disk_hits == 0
    assert _same(got, want)
    again = Decompositions(tmp_path)
    again.get(mod, "svd_llm", st, name)
    assert again.disk_hits == 1  # the file was replaced by a good one


def test_the_folder_stays_within_its_bound_removing_the_least_recently_used(calibrated, tmp_path):
    base, st = calibrated
    shape = lambda n: tuple(base.get_submodule(n).weight.shape)  # noqa: E731
    names = [n for n in st.layers if shape(n) == shape(next(iter(st.layers)))]  # files of one size
    assert len(names) >= 3
    probe = tmp_path / "probe"
    Decompositions(probe).get(base.get_submodule(names[0]), "svd_llm", st, names[0])
    size = next(probe.glob("*.pt")).stat().st_size
    folder = tmp_path / "bounded"
    cache = Decompositions(folder, max_bytes=int(2.5 * size))
    for i, n in enumerate(names):
        cache.get(base.get_submodule(n), "svd_llm", st, n)
        for p in folder.glob("*.pt"):  # a clock that moves: the order of use is the order of the files' times
            os.utime(p, (p.stat().st_atime, p.stat().st_mtime - 10))
    kept = list(folder.glob("*.pt"))
    assert len(kept) == 2 and sum(p.stat().st_size for p in kept) <= 2.5 * size
    later = Decompositions(folder, max_bytes=int(2.5 * size))
    for n in names[-2:]:
        later.get(base.get_submodule(n), "svd_llm", st, n)
    assert later.disk_hits == 2 and later.misses == 0  # the last two written were the ones kept


def test_no_folder_or_a_zero_bound_keeps_nothing_on_disk(calibrated, tmp_path, monkeypatch):
    base, st = calibrated
    name = list(st.layers)[0]
    Decompositions().get(base.get_submodule(name), "gfwsvd", st, name)
    Decompositions(tmp_path / "off", max_bytes=0).get(base.get_submodule(name), "gfwsvd", st, name)
    monkeypatch.setenv("FISHERKRON_DECOMPOSITION_CACHE", "0")
    Decompositions(tmp_path / "env").get(base.get_submodule(name), "gfwsvd", st, name)
    assert not (tmp_path / "off").exists() and not (tmp_path / "env").exists()


def test_a_folder_that_cannot_be_written_costs_only_the_disk_tier(calibrated, tmp_path):
    base, st = calibrated
    name = list(st.layers)[0]
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    cache = Decompositions(blocker / "decompositions")  # under a file: nothing can be written there
    dec, _ = cache.get(base.get_submodule(name), "gfwsvd", st, name)
    assert cache.misses == 1 and len(cache) == 1 and dec.S.numel() > 0


@pytest.mark.parametrize("method", ["gfwsvd", "kfac_svd"])
def test_an_entry_keeps_no_factors_and_the_curves_read_them_again(method, calibrated):
    from fisherkron.hf.allocation import fisher_curves

    base, st = calibrated
    names = list(st.layers)
    cache = Decompositions()
    first, m1 = fisher_curves(base, method, st, names, decompositions=cache)
    for dec, kept, _ in cache._store.values():
        assert not any(torch.is_tensor(v) or hasattr(v, "A") for v in kept.values())
    again, m2 = fisher_curves(base, method, st, names, decompositions=cache)
    fresh, m3 = fisher_curves(base, method, st, names)
    assert cache.hits == len(names) and m1 == m2 == m3
    for n in names:
        assert torch.equal(first[n], again[n]) and torch.equal(first[n], fresh[n])
