"""``scripts/cache_keys.py``: which caches a change re-keys."""
from pathlib import Path

import pytest
from script_module import load_script

ROOT = Path(__file__).resolve().parents[1]


def _script():
    return load_script("cache_keys")


def test_a_family_whose_key_code_differs_at_the_revision_is_named_re_keyed(monkeypatch, capsys):
    mod = _script()
    trees = []

    def evaluate(tree):
        trees.append(tree)
        first = next(iter(mod.FAMILIES))
        return {n: ("then" if n == first and tree != mod.ROOT else "now") for n in mod.FAMILIES}

    monkeypatch.setattr(mod, "evaluate", evaluate)
    assert mod.main(["HEAD"]) == 0
    out = capsys.readouterr().out
    assert trees[0] == mod.ROOT and trees[1] != mod.ROOT and not trees[1].exists()  # the checkout is gone
    assert out.splitlines()[0] == f"re-keyed  {next(iter(mod.FAMILIES))}"
    assert f"1 of {len(mod.FAMILIES)} caches re-keyed since HEAD" in out
    with pytest.raises(SystemExit):
        mod.main([])


def test_every_family_evaluates_in_this_tree():
    """The expressions name functions and constants that exist (about 15 s: a fresh interpreter)."""
    values = _script().evaluate(ROOT)
    assert values and not [n for n, v in values.items() if v.startswith("(cannot")]
