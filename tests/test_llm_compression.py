"""The decoder study (experiments.llm_compression, llm_summary): case keys, the best-allocation rule, the
transposed-GFWSVD pitfall against dense float64 references, the sweep's noise, lm-eval readers, tables,
verdicts, and the cached study end to end on a tiny random Llama."""
import math

import numpy as np
import pandas as pd
import pytest
import torch

from fisherkron.core.conventions import FisherkronError
from fisherkron.core.wsvd import decompose
from fisherkron.env import data_root
from fisherkron.experiments import llm_compression as lc
from fisherkron.experiments import llm_summary as ls
from fisherkron.hf.calibration import collect_calibration
from fisherkron.testing import FLOAT64, F64_REL
from tiny_models import tiny_llama, token_batches

#: a float32 mean of a few hundred token losses, reached by two summation orders (default_loss, token_losses)
LOSS_F32_REL = 1e-5


def _spd(d: int, seed: int) -> torch.Tensor:
    X = torch.randn(d + 3, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return X.T @ X / (d + 3) + 0.1 * torch.eye(d, dtype=torch.float64)


# ----------------------------------------------------------------------------- keys and the rule

BASE = dict(method="gfwsvd", allocation="sensitivity", ratio=0.1, kind="ppl", model="m", calibration="c", code="v",
            sweep="s", candidates=(0.1, 0.2), mff_options={"tol": 1e-4}, evaluation={"seq_len": 512, "texts": "t"})


@pytest.mark.parametrize("field,value", [
    ("method", "kfac_svd"), ("allocation", "fisher"), ("ratio", 0.15), ("kind", "heldout"), ("model", "m2"),
    ("calibration", "c2"), ("code", "v2"), ("sweep", "s2"), ("candidates", (0.1, 0.3)),
    ("mff_options", {"tol": 1e-3}), ("evaluation", {"seq_len": 256, "texts": "t"}),
    ("evaluation", {"seq_len": 512, "texts": "t", "limit": 10})])
def test_case_key_changes_with_every_input_that_matters(field, value):
    assert lc.case_key(lc.case_config(**BASE)) != lc.case_key(lc.case_config(**{**BASE, field: value}))


def test_case_key_ignores_what_does_not_matter():
    key = lambda **kw: lc.case_key(lc.case_config(**{**BASE, **kw}))  # noqa: E731
    # the sweep and its candidates only matter to the sensitivity allocation
    assert key(allocation="uniform", sweep="s2", candidates=(0.5,)) == key(allocation="uniform")
    # MFF's options only matter to the methods that run MFF
    assert key(method="svd_llm", mff_options={"tol": 1e-2}) == key(method="svd_llm")
    assert key(method="gfwsvd_diag", mff_options={"tol": 1e-2}) != key(method="gfwsvd_diag")
    # plain SVD reads no statistic; the dense model has no ratio, allocation, calibration or sweep
    assert key(method="svd", allocation="uniform", calibration="other") == key(method="svd", allocation="uniform")
    assert key(method="dense", ratio=0.3, calibration="x", sweep="y") == key(method="dense", ratio=0.1)
    # key order of an option dict, and a ratio's float round-off, change nothing
    assert key(evaluation={"texts": "t", "seq_len": 512}) == key()
    assert key(ratio=0.1 + 1e-12) == key()


def test_case_key_of_reused_ranks_is_their_content():
    r1, r2 = {"a": 3, "b": None}, {"b": None, "a": 3}
    key = lambda ranks: lc.case_key(lc.case_config(**{**BASE, "allocation": "ranks", "ranks": ranks}))  # noqa: E731
    assert key(r1) == key(r2)
    assert key(r1) != key({"a": 4, "b": None})
    assert key(r1) != key({"a": 3, "b": 2})
    with pytest.raises(FisherkronError, match="kind"):
        lc.case_config(**{**BASE, "kind": "glue"})


def test_best_allocation_picks_the_lowest_heldout_loss():
    assert lc.best_allocation({"uniform": 6.0, "fisher": 5.5, "sensitivity": 5.9}) == "fisher"
    assert lc.best_allocation({"uniform": 4.0, "fisher": 5.5, "sensitivity": 5.9}) == "uniform"
    # a tie goes to the first in the order; a non-finite loss never wins; a missing one is skipped
    assert lc.best_allocation({"uniform": 5.0, "fisher": 5.0, "sensitivity": 5.0}) == "uniform"
    assert lc.best_allocation({"uniform": float("nan"), "fisher": 9.0, "sensitivity": float("inf")}) == "fisher"
    assert lc.best_allocation({"sensitivity": 7.0}) == "sensitivity"
    with pytest.raises(FisherkronError, match="no finite"):
        lc.best_allocation({"uniform": float("nan")})


# ----------------------------------------------------------------------------- the pitfall

@pytest.mark.parametrize("n,m,r", [(7, 5, 2), (5, 8, 3)])
def test_transposed_form_equals_the_dense_reference(n, m, r):
    g = torch.Generator().manual_seed(n * m)
    W = torch.randn(n, m, generator=g, dtype=torch.float64)
    L_A, L_B = torch.linalg.cholesky(_spd(m, 1)), torch.linalg.cholesky(_spd(n, 2))
    U, S, Vh = torch.linalg.svd(L_B @ W @ L_A)  # lems: L_B W L_A, the left factor untransposed
    ref = torch.linalg.solve(L_B, U[:, :r] * S[:r]) @ Vh[:r] @ torch.linalg.inv(L_A)
    W2, W1 = lc.transposed_decomposition(W, L_A, L_B).factors(r)
    torch.testing.assert_close(W2 @ W1, ref, **FLOAT64)
    # full rank reproduces W, as Eq. (7) does
    W2, W1 = lc.transposed_decomposition(W, L_A, L_B).factors(min(n, m))
    torch.testing.assert_close(W2 @ W1, W, **FLOAT64)


def test_transposed_form_equals_gfwsvd_where_it_must_and_differs_elsewhere():
    n, m, r = 7, 5, 2
    W = torch.randn(n, m, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    L_A = torch.linalg.cholesky(_spd(m, 1))
    I_n, I_m = torch.eye(n, dtype=torch.float64), torch.eye(m, dtype=torch.float64)

    def both(LA, LB):
        a = lc.transposed_decomposition(W, LA, LB).factors(r)
        b = decompose(W, LB, LA).factors(r)  # Eq. (7): L_B^{-T} SVD_r(L_B^T W L_A) L_A^{-1}
        return a[0] @ a[1], b[0] @ b[1]

    torch.testing.assert_close(*both(I_m, I_n), **FLOAT64)  # A = B = I: plain SVD both ways
    D = torch.diag(torch.linspace(0.5, 2.0, n, dtype=torch.float64))
    torch.testing.assert_close(*both(L_A, D), **FLOAT64)  # a diagonal L_B is its own transpose
    wrong, right = both(L_A, torch.linalg.cholesky(_spd(n, 2)))
    assert torch.linalg.norm(wrong - right) > 1e-3 * torch.linalg.norm(right)


def test_each_form_is_optimal_in_its_own_metric():
    n, m, r = 7, 5, 2
    W = torch.randn(n, m, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    A, B = _spd(m, 1), _spd(n, 2)
    L_A, L_B = torch.linalg.cholesky(A), torch.linalg.cholesky(B)
    err = lambda Wr, BB: float(torch.trace((W - Wr).T @ BB @ (W - Wr) @ A))  # noqa: E731
    f = decompose(W, L_B, L_A).factors(r)
    t = lc.transposed_decomposition(W, L_A, L_B).factors(r)
    right, wrong = f[0] @ f[1], t[0] @ t[1]
    assert err(right, B) <= err(wrong, B) * (1 + F64_REL)  # Eq. (7) is optimal for A (x) B
    assert err(wrong, L_B.T @ L_B) <= err(right, L_B.T @ L_B) * (1 + F64_REL)  # the pitfall fits L_B^T L_B
    assert err(wrong, B) > err(right, B) * 1.001


# ----------------------------------------------------------------------------- the sweep's noise

def test_difference_noise_on_known_differences():
    d = torch.tensor([[1.0, 3.0], [-1.0, 1.0], [2.0, 0.0]])  # 3 sequences x 2 tokens
    r = lc.difference_noise(d)
    flat = d.reshape(-1).double()
    assert r["mean"] == pytest.approx(1.0, rel=F64_REL)
    assert r["sd_token"] == pytest.approx(float(flat.std()), rel=F64_REL)
    assert r["se_token"] == pytest.approx(float(flat.std()) / math.sqrt(6), rel=F64_REL)
    # per-sequence means 2, 0, 1: sd 1, se 1 / sqrt(3)
    assert r["se_sequence"] == pytest.approx(1 / math.sqrt(3), rel=F64_REL)
    assert (r["sequences"], r["tokens"]) == (3, 6)
    with pytest.raises(FisherkronError, match="sequences, tokens"):
        lc.difference_noise(torch.ones(4))


def test_difference_noise_converges_to_the_sampling_spread():
    g = torch.Generator().manual_seed(0)
    d = 0.01 + 0.2 * torch.randn(200, 100, generator=g, dtype=torch.float64)  # iid: both errors agree
    r = lc.difference_noise(d)
    assert r["sd_token"] == pytest.approx(0.2, rel=0.02)
    assert r["se_token"] == pytest.approx(0.2 / math.sqrt(20000), rel=0.02)
    assert r["se_sequence"] == pytest.approx(r["se_token"], rel=0.15)
    assert abs(r["mean"] - 0.01) < 4 * r["se_token"]


def _batches(k=3, B=2, T=12, seed=0):
    return token_batches(k=k, B=B, T=T, seed=seed)


def test_token_losses_average_to_the_model_loss():
    model = tiny_llama()
    batches = _batches()
    tl = lc.token_losses(model, batches)  # (6, 11)
    assert tl.shape == (6, 11) and tl.dtype == torch.float64
    with torch.no_grad():
        for i, b in enumerate(batches):
            ref = float(model(**b).loss)
            assert float(tl[2 * i:2 * i + 2].mean()) == pytest.approx(ref, rel=LOSS_F32_REL)


# ----------------------------------------------------------------------------- lm-eval readers

def test_pooled_accuracy_and_mmlu_categories():
    cats = ls.mmlu_categories()
    assert len(cats) == 57 and cats["anatomy"] == "stem" and cats["philosophy"] == "humanities"
    results = {f"mmlu_{s}": {"acc": 1.0 if c == "stem" else 0.0, "sample_len": 2} for s, c in cats.items()}
    got = ls.mmlu_scores(results, cats)
    n_stem = sum(c == "stem" for c in cats.values())
    assert got["stem"]["acc"] == 1.0 and got["stem"]["se"] == 0.0 and got["stem"]["n"] == 2 * n_stem
    assert got["humanities"]["acc"] == 0.0
    p = n_stem / 57
    assert got["average"]["acc"] == pytest.approx(p, rel=F64_REL)
    assert got["average"]["se"] == pytest.approx(math.sqrt(p * (1 - p) / (114 - 1)), rel=F64_REL)
    # a group equals one sample of its answers: lm-eval's mean_stderr of the 0/1 outcomes
    outcomes = torch.tensor([1.0] * 7 + [0.0] * 5, dtype=torch.float64)
    acc, se, n = ls.pooled_accuracy([(4 / 6, 6), (3 / 6, 6)])
    assert (acc, n) == (pytest.approx(7 / 12), 12)
    assert se == pytest.approx(float(outcomes.std() / math.sqrt(12)), rel=F64_REL)
    with pytest.raises(FisherkronError, match="mmlu_anatomy"):
        ls.mmlu_scores({k: v for k, v in results.items() if k != "mmlu_anatomy"}, cats)


def test_zero_shot_scores_read_acc_and_average_the_tasks():
    res = {t: {"acc": 0.1 * (i + 1), "acc_stderr": 0.01, "acc_norm": 0.99, "sample_len": 10}
           for i, t in enumerate(ls.ZERO_SHOT)}
    got = ls.zero_shot_scores(res)
    assert got["arc_challenge"]["acc"] == pytest.approx(0.1)  # acc, never acc_norm
    assert got["average"]["acc"] == pytest.approx(0.35)
    assert got["average"]["se"] == pytest.approx(0.01 * math.sqrt(6) / 6)
    assert got["average"]["n"] == 60


def test_paired_gap_against_a_direct_computation_and_its_use_in_compare():
    rng = np.random.default_rng(0)
    a, b = {}, {}
    for t, n in zip(ls.ZERO_SHOT, (40, 40, 40, 40, 40, 30)):
        xa = rng.integers(0, 2, n).astype(float)
        xb = np.where(rng.random(n) < 0.8, xa, 1 - xa)  # mostly the same answers: a paired gap is tight
        a[f"{t}_examples"], b[f"{t}_examples"] = list(xa), list(xb)
    g = ls.paired_gap(a, b)
    d = [np.mean(np.subtract(a[f"{t}_examples"], b[f"{t}_examples"])) for t in ls.ZERO_SHOT]
    v = [np.var(np.subtract(a[f"{t}_examples"], b[f"{t}_examples"]), ddof=1) / len(a[f"{t}_examples"])
         for t in ls.ZERO_SHOT]
    assert g["diff"] == pytest.approx(np.mean(d)) and g["se"] == pytest.approx(math.sqrt(sum(v)) / 6)
    # the independent standard error of the same two averages is larger
    se_ind = [math.sqrt(np.mean(x) * (1 - np.mean(x)) / (len(x) - 1)) for r in (a, b)
              for x in (r[f"{t}_examples"] for t in ls.ZERO_SHOT)]
    assert g["se"] < math.sqrt(sum(s_ ** 2 for s_ in se_ind)) / 6
    assert ls.paired_gap(a, {**b, "piqa_examples": b["piqa_examples"][:-1]}) is None  # other examples
    assert ls.paired_gap(a, {k: v for k, v in b.items() if k != "piqa_examples"}) is None
    rows = pd.DataFrame([{"method": m, "target": 0.1, "block": "paper", "ppl_ptb": p, "ppl_wiki": p,
                          "average": 0.5, "average_se": 0.05, **r} for m, p, r in (("gfwsvd", 1.0, a), ("svd_llm", 2.0, b))])
    rec = ls.compare(rows, [0.1], "gfwsvd", ("svd_llm",))[0]
    assert rec["acc_paired"] and rec["acc_se"] == pytest.approx(g["se"])
    rec = ls.compare(rows.drop(columns=[c for c in rows if c.endswith("_examples")]), [0.1], "gfwsvd", ("svd_llm",))[0]
    assert not rec["acc_paired"] and rec["acc_se"] == pytest.approx(math.sqrt(2) * 0.05)


# ----------------------------------------------------------------------------- tables and verdicts

def _rows():
    rows = []
    ppl = {"fwsvd": 900.0, "asvd": 300.0, "svd_llm": 200.0, "basis_sharing": 250.0, "gfwsvd": 150.0}
    for target, grow in ((0.1, 1.0), (0.2, 3.0)):
        for m, p in ppl.items():
            acc = 0.40 if m == "gfwsvd" else 0.30
            rows.append({"block": "paper", "target": target, "method": m, "allocation": "uniform", "ratio": target,
                         "layers_ratio": 1.3 * target, "ppl_wiki": p * grow * (5.0 if m == "fwsvd" else 1.0),
                         "ppl_ptb": p * grow * (5.0 if m == "fwsvd" and target > 0.1 else 1.0),
                         "average": acc, "average_se": 0.01,
                         **{t: acc for t in ls.ZERO_SHOT}, **{f"{t}_se": 0.01 for t in ls.ZERO_SHOT}})
    return pd.DataFrame(rows)


def test_compare_degradation_and_collapse_on_a_known_table():
    rows = _rows()
    got = ls.compare(rows, [0.1, 0.2])
    assert len(got) == 8 and all(r["beats"] for r in got) and all(r["acc_beyond_se"] for r in got)
    rows.loc[(rows.method == "svd_llm") & (rows.target == 0.2), "ppl_ptb"] = 1.0  # SVD-LLM wins PTB at 20 %
    got = {(r["target"], r["other"]): r for r in ls.compare(rows, [0.1, 0.2])}
    assert not got[(0.2, "svd_llm")]["beats"] and got[(0.1, "svd_llm")]["beats"]
    slopes = ls.degradation(_rows(), ["fwsvd", "asvd", "gfwsvd"])
    assert max(slopes, key=slopes.get) == "fwsvd"
    assert slopes["asvd"] == pytest.approx(math.log(3) / 0.1, rel=1e-9)
    dense = {"ppl_ptb": 100.0, "ppl_wiki": 100.0}
    hit = {(c["target"], c["method"]) for c in ls.collapsed(_rows(), dense, multiple=10)}
    assert hit == {(0.1, "fwsvd"), (0.2, "fwsvd")}
    # a gap within two standard errors is not beyond them
    assert not ls.gap(0.31, 0.01, 0.30, 0.01)["beyond"] and ls.gap(0.34, 0.01, 0.30, 0.01)["beyond"]
    assert ls.chance_level(0.27, 0.02) and not ls.chance_level(0.35, 0.02)


def test_ablation_order_holds_only_when_perplexity_falls_along_the_rows():
    order = ("fwsvd", "gfwsvd_diag", "gfwsvd_offdiag", "gfwsvd")
    rows = pd.DataFrame([{"method": m, "target": t, "ppl_wiki": 40.0 - 10 * i, "ppl_ptb": 90.0 - 20 * i}
                         for t in (0.1, 0.15) for i, m in enumerate(order)])
    assert ls.ablation_order(rows, [0.1, 0.15])["holds"]
    rows.loc[(rows.method == "gfwsvd") & (rows.target == 0.15), "ppl_ptb"] = 50.0  # Full worse than Non-diag
    got = ls.ablation_order(rows, [0.1, 0.15])
    assert not got["holds"] and got["cases"]["10%/ptb"]["holds"] and not got["cases"]["15%/ptb"]["holds"]
    table = ls.ablation_table(rows, [0.1, 0.15], dense={"ppl_wiki": 9.0, "ppl_ptb": 20.0})
    assert table.iloc[0, 0] == "Full model" and table.iloc[4]["PTB 10 %"] == "**30.00**"


def test_main_table_bolds_the_best_per_block_and_latex_sets_it():
    rows = _rows()
    rows["best"] = False
    best = rows.copy()
    best["block"] = "best"
    dense = {"ppl_wiki": 9.0, "ppl_ptb": 20.0, "average": 0.5, "average_se": 0.01, "ratio": 0.0,
             **{t: 0.5 for t in ls.ZERO_SHOT}, **{f"{t}_se": 0.01 for t in ls.ZERO_SHOT}}
    table = ls.main_table(pd.concat([rows, best]), [0.1, 0.2], dense)
    assert len(table) == 1 + 2 * 2 * 5 and table.iloc[0]["Method"] == "Full model"
    g = table[table["Method"].str.startswith("GFWSVD")]
    assert all(c.startswith("**") for c in g["PTB"]) and all(c.startswith("**") for c in g["AVG"])
    f = table[table["Method"].str.startswith("FWSVD")]
    assert not any(c.startswith("**") for c in f["PTB"])
    tex = ls.latex(table, "a caption with 10 %", "tab:x")
    assert r"\textbf{150}" in tex and r"$\pm$" in tex and r"10 \%" in tex and "**" not in tex
    mm = ls.mmlu_table(rows.assign(**{f"mmlu_{c}": 0.3 for c in ("average", *ls.MMLU_CATEGORIES)},
                                   **{f"mmlu_{c}_se": 0.02 for c in ("average", *ls.MMLU_CATEGORIES)}),
                       [0.1], {**dense, **{f"mmlu_{c}": 0.4 for c in ("average", *ls.MMLU_CATEGORIES)},
                               **{f"mmlu_{c}_se": 0.02 for c in ("average", *ls.MMLU_CATEGORIES)}})
    assert mm.iloc[1]["Method"].startswith("chance") and mm.iloc[1]["MMLU Avg"] == "0.25"


def test_decoder_tolerances_are_a_multiple_of_the_printed_standard_error():
    """The decoder tables' rule: an accuracy printed with one evaluation's standard error is held to that standard error
    (and one example of 40); a seed mean to three standard errors of the mean on top of the column's own
    tolerance. The cells are tab_llm_compression_main's and tab_extra_compression_results' own."""
    from fisherkron.repro.verify import compare_frames

    def failures(ref, new, seeds=None):
        ref, new = pd.DataFrame([ref]), pd.DataFrame([new])
        return {f.column for f in compare_frames("t", ref, new, ls.tolerances(ref, seeds)).failures}

    acc = {"Method": "SVD-LLM", "ARC-E": "0.47 ± 0.08", "OpenBook": "0.00 ± 0.00"}
    assert failures(acc, {**acc, "ARC-E": "0.55 ± 0.08", "OpenBook": "0.03 ± 0.03"}) == set()  # 3 and 1 examples
    # the two cells' standard errors together: 0.025 + sqrt(0.08^2 + 0.08^2) = 0.138, 0.025 + 0.03 = 0.055 (and half
    # a printed unit of each)
    assert failures(acc, {**acc, "ARC-E": "0.63 ± 0.08", "OpenBook": "0.07 ± 0.03"}) == {"ARC-E", "OpenBook"}
    seed = {"Method": "Dobi-GFWSVD", "PTB": "510 ± 33", "ARC-E": "0.562 ± 0.018"}
    moved = {**seed, "PTB": "561 ± 65", "ARC-E": "0.613 ± 0.053"}  # the Intel re-run of the AMD EPYC's cells
    assert failures(seed, moved, seeds=2) == set()
    # read as one run's cells: PTB beyond 5 %; ARC-E within 0.025 + sqrt(0.018^2 + 0.053^2) = 0.081
    assert failures(seed, moved) == {"PTB"}
    assert failures(seed, {**seed, "PTB": "650 ± 30", "ARC-E": "0.700 ± 0.018"}, seeds=2) == {"PTB", "ARC-E"}
    with pytest.raises(FisherkronError, match="number of seeds"):
        ls.tolerances(pd.DataFrame([seed]), seeds=0)


# ----------------------------------------------------------------------------- the study, end to end

@pytest.fixture(scope="module")
def study(tmp_path_factory):
    root = tmp_path_factory.mktemp("llm")
    mp = pytest.MonkeyPatch()
    mp.setenv("FISHERKRON_DATA", str(root))  # the sweep's cache
    model = tiny_llama()
    stats = collect_calibration(model, _batches(k=4, seed=0), None, stats=lc.study_stats(), cache_dir=root / "cal")
    proto = lc.Protocol(model_name="tiny", k=4, heldout_k=2, select_k=2, sens_ratios=(0.3, 0.6), eval_seq_len=16,
                        mff_tol=1e-3)
    ids = {"wiki": torch.randint(1, 97, (64,), generator=torch.Generator().manual_seed(5)),
           "ptb": torch.randint(1, 97, (64,), generator=torch.Generator().manual_seed(6))}
    s = lc.Study(proto, model, None, stats, _batches(k=2, seed=1), _batches(k=2, seed=2), ids, list(stats.layers),
                 "tiny-model", "test-code", root / "studies")
    yield s
    mp.undo()


def test_study_scores_are_cached_and_resume(study, monkeypatch):
    case = lc.Case("svd_llm", "uniform", 0.2)
    first = study.scores(case, ("heldout", "ppl"))
    assert set(first) == {"heldout", "ppl"} and first["heldout"]["ratio"] >= 0.2 - 1e-9
    assert 0 < first["heldout"]["layers_ratio"] and math.isfinite(first["ppl"]["ptb"])
    files = sorted(study.cache_dir.glob("*.json"))
    assert len(files) == 2

    def no_build(*a, **k):
        raise AssertionError("a cached case was compressed again")

    monkeypatch.setattr(study, "build", no_build)
    assert study.scores(case, ("heldout", "ppl")) == first
    with pytest.raises(AssertionError, match="compressed again"):  # another ratio is another case
        study.scores(lc.Case("svd_llm", "uniform", 0.25), ("heldout",))


def test_study_selection_ranks_reuse_and_the_pitfall(study):
    sel = study.selection("gfwsvd", 0.2)
    assert set(sel["losses"]) == set(lc.ALLOCATIONS)
    assert sel["best"] == lc.best_allocation(sel["losses"])
    ranks = study.scores(lc.Case("gfwsvd", "sensitivity", 0.2))["heldout"]["ranks"]
    diag = study.scores(lc.Case("gfwsvd_diag", "ranks", 0.2, source=("gfwsvd", "sensitivity")))
    assert diag["heldout"]["ranks"] == ranks  # the ablation's rows share GFWSVD's ranks
    full = study.scores(lc.Case("gfwsvd", "sensitivity", 0.2), ("heldout", "ppl"))
    wrong = study.scores(lc.Case("gfwsvd_transposed", "ranks", 0.2, source=("gfwsvd", "sensitivity")),
                         ("heldout", "ppl"))
    assert wrong["heldout"]["ranks"] == ranks
    assert wrong["heldout"]["ratio"] == pytest.approx(full["heldout"]["ratio"], rel=1e-12)
    assert wrong["heldout"]["loss"] != full["heldout"]["loss"]
    bs = study.scores(lc.Case("basis_sharing", "own", 0.2))
    assert bs["heldout"]["ratio"] >= 0.2 - 1e-9
    sweeps = lambda: sorted(p.name for p in (data_root() / "cache" / "allocation").glob("sensitivity-*"))  # noqa: E731
    before = sweeps()
    study.scores(lc.Case("asvd", "sensitivity", 0.2))
    assert len(sweeps()) == len(before) + 1
    rows = lc.sweep_noise(study, "asvd", n_layers=3)
    assert len(sweeps()) == len(before) + 1  # the noise check read the same sweep: no new entry
    assert len(rows) == 3 and all(math.isfinite(r["delta"]) and r["sd_token"] > 0 for r in rows)
    assert all(r["se_token_sweep"] == pytest.approx(r["sd_token"] / math.sqrt(2 * 2 * 11)) for r in rows)
    deltas = [r["delta_sweep"] for r in rows]
    assert deltas == sorted(deltas)  # the least sensitive first


def test_paper_models_offline_stop_with_one_line_naming_the_embedded_profile(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FisherkronError, match="PROFILE=default") as e:
        lc.check_reachable("meta-llama/Llama-2-7b-chat-hf", "tab_llm_compression_main")
    assert "\n" not in str(e.value)
    lc.check_reachable("smollm2", "tab_llm_compression_main")  # embedded: nothing to check


def test_mmlu_scores_of_a_few_subjects():
    cats = ls.mmlu_categories()
    res = {"mmlu_anatomy": {"acc": 0.5, "sample_len": 2}, "mmlu_philosophy": {"acc": 1.0, "sample_len": 1}}
    got = ls.mmlu_scores(res, cats, subjects=["anatomy", "philosophy"])
    assert got["stem"]["acc"] == 0.5 and got["humanities"]["acc"] == 1.0 and math.isnan(got["other"]["acc"])
    assert got["average"]["acc"] == pytest.approx(2 / 3) and got["average"]["n"] == 3
    with pytest.raises(FisherkronError, match="no MMLU subject"):
        ls.mmlu_scores(res, cats, subjects=["astrology"])


def test_run_table_gives_two_blocks_with_the_paper_and_the_chosen_allocations(study):
    rows, sel = lc.run_table(study, ["svd_llm", "basis_sharing", "gfwsvd"], [0.2], ("heldout", "ppl"),
                             extra=["kfac_svd"], progress=False)
    got = {(r["block"], r["method"]): r["allocation"] for r in rows}
    assert got[("paper", "svd_llm")] == "uniform" and got[("paper", "gfwsvd")] == "sensitivity"
    assert got[("paper", "basis_sharing")] == got[("best", "basis_sharing")] == "own"
    assert ("paper", "kfac_svd") not in got  # not in the paper: the best block only
    for m in ("svd_llm", "gfwsvd", "kfac_svd"):
        assert got[("best", m)] == sel[m][0.2]["best"] == lc.best_allocation(sel[m][0.2]["losses"])
    assert all(math.isfinite(r["ppl_ptb"]) and r["ratio"] >= 0.2 - 1e-9 for r in rows)


def test_first_tokens_tokenise_a_prefix_and_agree_with_the_whole_text():
    seen = []

    class Words:  # splits on spaces, like a pre-tokenizer; a word cut at the end becomes another token
        def __call__(self, text, add_special_tokens=False):
            seen.append(len(text))
            return {"input_ids": [hash(w) % 1000 for w in text.split(" ")]}

    text = " ".join(f"w{i % 37}" for i in range(20000))  # about 80,000 characters
    full = lc.first_tokens(Words(), text, 0)
    assert len(full) == 20000 and seen[-1] == len(text)
    seen.clear()
    got = lc.first_tokens(Words(), text, 100, margin=16)
    assert torch.equal(got, full[:100]) and max(seen) < len(text) // 10
    short = torch.tensor(Words()(text[:300])["input_ids"])  # fewer than 100 tokens: all of them
    assert torch.equal(lc.first_tokens(Words(), text[:300], 100), short) and len(short) < 100


def test_a_ratio_beyond_the_sweeps_reach_is_out_of_reach_for_the_sensitivity_allocation(study):
    from fisherkron.hf.budget import count_params

    reach = study.sensitivity_reach()
    assert 0.2 < reach < 0.6  # 60 % of the linear layers at most, minus the embeddings' share
    above = math.ceil(100 * reach) / 100 + 0.02
    assert study.feasible("sensitivity", 0.2) and not study.feasible("sensitivity", above)
    assert study.feasible("uniform", above) and study.feasible("fisher", above)
    # the reach is what the threshold search can remove: just below it the allocation exists
    got = study.scores(lc.Case("asvd", "sensitivity", math.floor(1000 * reach) / 1000))["heldout"]
    assert got["ratio"] <= reach + 1.0 / count_params(study.model)
    sel = study.selection("asvd", above)
    assert sel["infeasible"] == ["sensitivity"] and set(sel["losses"]) == {"uniform", "fisher"}
    rows, _ = lc.run_table(study, ["asvd"], [above], ("heldout", "ppl"), progress=False)
    paper = [r for r in rows if r["block"] == "paper"][0]
    assert paper["infeasible"] and "ppl_ptb" not in paper
    df = pd.DataFrame(rows)
    table = ls.main_table(df.assign(**{t: 0.3 for t in ls.ZERO_SHOT}, **{f"{t}_se": 0.01 for t in ls.ZERO_SHOT},
                                    average=0.3, average_se=0.01), [above],
                          {"ppl_wiki": 9.0, "ppl_ptb": 20.0, "average": 0.5, "average_se": 0.01,
                           **{t: 0.5 for t in ls.ZERO_SHOT}, **{f"{t}_se": 0.01 for t in ls.ZERO_SHOT}})
    assert table.iloc[1]["Method"].endswith("out of reach") and table.iloc[1]["PTB"] == "n/a"
    assert ls.compare(df, [above], "asvd", ["asvd"]) == []  # no scores, no comparison


def test_plain_svd_keys_the_calibration_only_where_its_allocation_reads_it():
    kw = dict(method="svd", ratio=0.1, kind="ppl", model="m", calibration="c", code="v", sweep="s")
    assert lc.case_config(allocation="uniform", **kw)["calibration"] is None
    assert lc.case_config(allocation="sensitivity", **kw)["calibration"] is None
    for allocation in ("fisher", "calibrated", "calibrated_kl"):  # Theorem 1's curves in the calibration's Fisher
        assert lc.case_config(allocation=allocation, **kw)["calibration"] == "c"


def test_first_measured_seconds_are_the_same_whether_scores_are_computed_or_read_back():
    store = {}

    def read(cfg):
        return store.get(lc.case_key(cfg))

    def write(cfg, result, seconds):
        store[lc.case_key(cfg)] = {"result": result, "seconds": seconds}

    def build():
        return object(), {"compress_seconds": 2.5}

    def configs(method):
        return {k: {"method": method, "kind": k} for k in ("heldout", "ppl")}

    timings, cached, first = {}, {}, {}
    for m in ("a", "b", "a"):  # the case of method "a" is used twice: it counts once
        lc.scored(configs(m), build, lambda model, k: {"v": 1.0}, read=read, write=write, timings=timings,
                  cached=cached, first=first)
    computed = lc.first_seconds(first)
    assert computed["compress"] == pytest.approx(5.0) and set(computed) == {"compress", "heldout", "ppl"}
    assert computed["ppl"] == pytest.approx(sum(r["seconds"] for c, r in store.items()) - computed["heldout"])
    # a rerun reads every score back and recovers the same first-measured costs, though it computes nothing
    timings2, cached2, first2 = {}, {}, {}
    for m in ("a", "b"):
        lc.scored(configs(m), build, None, read=read, write=write, timings=timings2, cached=cached2, first=first2)
    assert timings2 == {} and cached2 == {"heldout": 2, "ppl": 2}
    assert lc.first_seconds(first2) == pytest.approx(computed)
