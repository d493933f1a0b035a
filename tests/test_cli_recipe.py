"""``fisherkron compress`` runs the recommended recipe by default, says what it runs, and scores as the studies do.

* ``compress MODEL --ratio R`` with nothing else runs KFAC-SVD with the KL-calibrated allocation on
  the recipe's calibration (32 batches of 2 x 256 tokens, at most the model's positions), collects
  only the K-FAC factors, labels its measurements as the calibrated allocation's, and says all of
  it in its JSON line;
* ``--ppl-tokens N`` scores PTB as the studies do: the first N test tokens in ``--ppl-seq-len``
  windows (default 512, at most the model's positions), the same call on the same windows as
  :meth:`fisherkron.experiments.llm_compression.Study.evaluate`, and the JSON line says which;
* where the calibrated allocation does not apply (``--rank``, a classifier, ``svd``) the default
  is the uniform one; ``--method gfwsvd`` alone keeps the calibrated allocation, its best;
* ``--help`` shows the options in groups, each default, and three example commands.

The models are tiny random Llama / BERT folders with a character-level tokenizer.
"""
import json
import math
import re
from pathlib import Path

import pytest
from test_cli_robustness import _save, tiny_classifier
from tiny_models import tiny_llama

import fisherkron.hf as api
from fisherkron.cli import build_parser, main
from fisherkron.cli.compress import DEFAULT_PPL_SEQ_LEN, HELDOUT_BATCHES
from fisherkron.hf.allocation import RECOMMENDED

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {"llama": _save(tiny_llama(), root / "llama"), "bert": _save(tiny_classifier(), root / "bert")}


@pytest.fixture(autouse=True)
def data_root(tmp_path, monkeypatch):
    monkeypatch.setenv("FISHERKRON_DATA", str(tmp_path / "data"))
    monkeypatch.delenv("WORLD_SIZE", raising=False)


def run(argv, capsys) -> tuple[int, str, str]:
    """``(exit status, stdout, stderr)`` of ``fisherkron argv``."""
    try:
        code = main([str(a) for a in argv])
    except SystemExit as exc:
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_the_default_command_runs_the_recommended_recipe(models, tmp_path, monkeypatch, capsys):
    seen = {}
    real = api.collect_calibration

    def spy(model, batches, *a, **k):
        seen["batches"], seen["methods"] = list(batches), tuple(k["methods"])
        seen["stats"] = real(model, batches, *a, **k)
        return seen["stats"]
    monkeypatch.setattr(api, "collect_calibration", spy)
    out = tmp_path / "out"
    code, text, err = run(["compress", models["llama"], "--ratio", "0.2", "--out", out, "--no-cache",
                           "--ppl-tokens", "256"], capsys)
    assert code == 0, err
    summary = json.loads(text.strip().splitlines()[-1])
    assert (summary["method"], summary["allocation"], summary["recipe"]) == ("kfac_svd", "calibrated", "recommended")
    assert summary["allocation_details"]["calibrate_metric"] == "kl" and summary["ratio"] >= 0.2
    assert summary["allocation_cost"]["evaluations"] > 0
    # the recipe's calibration, the sequence cut to the tiny model's 64 positions; K-FAC statistics only
    assert summary["calibration"] == {"data": "c4", "k": RECOMMENDED.k, "batch_size": RECOMMENDED.batch_size,
                                      "seq_len": 64, "seed": 0, "heldout_batches": RECOMMENDED.heldout_batches}
    assert len(seen["batches"]) == 32 and seen["batches"][0]["input_ids"].shape == (2, 64)
    assert seen["methods"] == ("kfac_svd",) and set(seen["stats"].stats) == {"kfac"}
    # what runs is said before it runs, and the measurements are labelled as the calibrated allocation's
    assert "kfac_svd with the calibrated allocation (one KL point per layer), the recommended recipe" in err
    assert "calibrating (kfac_svd, one KL point per layer)" in err and "sensitivity (" not in err
    # the perplexity: its window and tokens, and the studies' evaluation of the same model
    assert (summary["ptb_seq_len"], summary["ptb_first_tokens"], summary["ptb_scored_tokens"]) == (64, 256, 4 * 63)
    from fisherkron.experiments.llm_compression import first_tokens
    from fisherkron.hf.evaluate import perplexity

    model, tok = api.load_compressed(out, return_tokenizer=True)
    study = perplexity(model, None, first_tokens(tok, api.ptb("test"), 256), seq_len=64)
    assert math.isfinite(summary["ptb_ppl_after"])
    assert summary["ptb_ppl_after"] == pytest.approx(study.ppl, rel=1e-6) and study.tokens == 4 * 63


@pytest.mark.parametrize("extra,want", [
    ([], ("kfac_svd", "calibrated", "kl", "recommended", RECOMMENDED.heldout_batches)),
    (["--method", "gfwsvd"], ("gfwsvd", "calibrated", "kl", None, RECOMMENDED.heldout_batches)),
    (["--calibrate-metric", "loss"], ("kfac_svd", "calibrated", "loss", None, RECOMMENDED.heldout_batches)),
    (["--method", "gfwsvd", "--allocation", "uniform"], ("gfwsvd", "uniform", None, None, 0)),
    (["--method", "svd"], ("svd", "uniform", None, None, 0)),  # plain SVD reads no Fisher to calibrate
    (["--allocation", "sensitivity"], ("kfac_svd", "sensitivity", None, None, RECOMMENDED.heldout_batches)),
], ids=["default", "gfwsvd", "loss", "gfwsvd-uniform", "svd", "sensitivity"])
def test_the_plan_says_which_allocation_runs(extra, want, models, capsys):
    code, text, err = run(["-q", "compress", models["llama"], "--ratio", "0.2", "--dry-run", *extra], capsys)
    assert code == 0, err
    plan = json.loads(text)
    got = (plan["method"], plan["allocation"], plan.get("calibrate_metric"), plan["recipe"],
           plan["calibration"]["heldout_batches"])
    assert got == want
    assert (plan["calibration"]["k"], plan["calibration"]["batch_size"]) == (RECOMMENDED.k, RECOMMENDED.batch_size)


def test_a_rank_or_a_classifier_gets_the_uniform_allocation(models, capsys):
    code, text, err = run(["-q", "compress", models["llama"], "--rank", "2", "--dry-run"], capsys)
    assert code == 0 and json.loads(text)["allocation"] == "uniform", err
    code, text, err = run(["-q", "compress", models["bert"], "--data", "sst2", "--ratio", "0.1", "--dry-run"], capsys)
    plan = json.loads(text)
    assert code == 0 and (plan["method"], plan["allocation"]) == ("kfac_svd", "uniform"), err
    # an option of the calibrated allocation, where it does not run, is one line saying why
    code, _, err = run(["compress", models["llama"], "--rank", "2", "--dry-run", "--calibrate-metric", "kl"], capsys)
    assert code == 2 and "drop it for the uniform allocation that runs here" in err and len(err.splitlines()) == 1


def test_the_perplexity_window_is_checked_first(models, tmp_path, capsys):
    base = ["compress", models["llama"], "--ratio", "0.2", "--out", tmp_path / "out"]
    code, _, err = run([*base, "--ppl-tokens", "256", "--ppl-seq-len", "128"], capsys)
    assert code == 2 and "--ppl-seq-len 128 exceeds the 64 positions" in err
    code, _, err = run([*base, "--ppl-seq-len", "32"], capsys)
    assert code == 2 and "give --ppl-tokens" in err
    code, _, err = run([*base, "--ppl-tokens", "40"], capsys)  # the window is 64 (the positions), not --seq-len
    assert code == 2 and "less than one window of --ppl-seq-len 64" in err
    assert not (tmp_path / "out").exists()


def _help() -> str:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices["compress"]
    return sub.format_help()


def test_help_has_groups_defaults_and_examples(monkeypatch):
    monkeypatch.setenv("COLUMNS", "120")
    text = _help()
    for group in ("model and data:", "how much:", "method:", "allocation:", "calibration:", "output:",
                  "evaluation:", "distributed:", "examples:"):
        assert f"\n{group}" in text, group
    # each option's entry, as one line: "--k K calibration batches ... (default: 32)"
    entries = {m.group(1): " ".join(m.group(0).split())
               for m in re.finditer(r"^  (--[\w-]+)(?:(?!\n  -|\n\n).)*", text, re.M | re.S)}
    r = RECOMMENDED
    for option, default in (("--k", r.k), ("--batch-size", r.batch_size), ("--seed", 0), ("--seq-len", r.seq_len),
                            ("--method", r.method), ("--allocation", r.allocation),
                            ("--calibrate-metric", r.calibrate_metric), ("--ppl-seq-len", 512), ("--dtype", "auto")):
        assert f"(default: {default}" in entries[option], entries[option]
    # every option that takes a value says its default (but the required ones: --ratio or --rank, and --out)
    valued = [o for o, entry in entries.items()
              if re.match(r"--[\w-]+ [A-Z{]", entry) and o not in ("--ratio", "--rank", "--out")]
    assert len(valued) >= 20
    for option in valued:
        assert "(default" in entries[option], entries[option]
    examples = re.findall(r"^    (fisherkron compress .*)$", text, re.M)
    assert len(examples) == 3
    assert "--method" not in examples[0] and "--allocation" not in examples[0]  # the recipe needs no flag
    assert "--method gfwsvd --allocation sensitivity" in examples[1] and "--data sst2" in examples[2]
    for command in examples:  # each parses
        build_parser().parse_args(command.split()[1:])


def test_the_command_measures_and_scores_with_the_studies_settings(monkeypatch):
    """The held-out batches are the recipe's; the perplexity's window and the example's token count the
    allocation study's (its recorded ``eval_seq_len`` and ``eval_tokens``)."""
    params = json.loads((ROOT / "figures" / "fig_allocation_cost_summary.provenance.json").read_text())["parameters"]
    assert HELDOUT_BATCHES == RECOMMENDED.heldout_batches
    assert DEFAULT_PPL_SEQ_LEN == params["eval_seq_len"]
    monkeypatch.setenv("COLUMNS", "120")
    recipe = re.search(r"^    (fisherkron compress .*)$", _help(), re.M).group(1)
    assert f"--ppl-tokens {params['eval_tokens']}" in recipe
