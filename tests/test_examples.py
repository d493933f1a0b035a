"""The examples run. The README's one-layer example shows what the README says: GFWSVD has the smallest
Fisher-weighted error. ``compress_smollm2.py`` runs the recommended recipe (here on a tiny random Llama
standing in for SmolLM2) on the recipe's calibration."""
import json
import re
import runpy
import subprocess
import sys
from pathlib import Path

import torch

import fisherkron as fk
from fisherkron.hf.allocation import RECOMMENDED

ROOT = Path(__file__).resolve().parents[1]


def test_compress_one_linear_example():
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "compress_one_linear.py")],
                         capture_output=True, text=True, check=True, cwd=ROOT).stdout
    errors = {m[0]: float(m[1]) for m in re.findall(r"^(\w+)\s+Fisher-weighted error ([0-9.e+-]+)$", out, re.M)}
    assert set(errors) == {"svd", "fwsvd", "asvd", "svd_llm", "gfwsvd"}
    assert min(errors, key=errors.get) == "gfwsvd"
    assert "MFF:" in out
    # the README shows this run's output: its numbers agree with a fresh run to float32 round-off
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    shown = readme.split("It prints", 1)[1].split("```\n", 2)[1]
    shown_errors = {m[0]: float(m[1]) for m in re.findall(r"^(\w+)\s+Fisher-weighted error ([0-9.e+-]+)$", shown, re.M)}
    assert shown_errors.keys() == errors.keys()
    for name, value in errors.items():  # rel 2 %: summation order differs between CPU models
        assert abs(shown_errors[name] - value) <= 0.02 * value, (name, shown_errors[name], value)
    assert shown.startswith("MFF: ") and "Fisher share captured" in shown.splitlines()[0]


EXAMPLE = ROOT / "examples" / "compress_smollm2.py"


def test_the_example_uses_the_recipes_calibration():
    src = EXAMPLE.read_text(encoding="utf-8")
    calls = re.findall(r"fk\.lm_batches\(tok, \w+, k=(\d+), batch_size=(\d+), seq_len=(\d+)", src)
    assert [tuple(map(int, c)) for c in calls] == [
        (RECOMMENDED.k, RECOMMENDED.batch_size, RECOMMENDED.seq_len),
        (RECOMMENDED.heldout_batches, RECOMMENDED.batch_size, RECOMMENDED.seq_len)]
    assert f'methods=["{RECOMMENDED.method}"]' in src and "fk.compress(model, stats," in src
    assert not re.search(r"#.*\d+\.\d+ ->", src)  # no result written into a comment


def test_the_example_runs_the_recipe(tmp_path, monkeypatch, capsys):
    """The example as written, with a tiny random Llama (512 positions, a character tokenizer) as SmolLM2."""
    from test_cli_robustness import _save
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=97, hidden_size=24, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=512)
    folder = _save(LlamaForCausalLM(cfg).eval(), tmp_path / "llama")
    monkeypatch.setattr(fk, "load_model", lambda name: (LlamaForCausalLM.from_pretrained(folder).eval(),
                                                        AutoTokenizer.from_pretrained(folder)))
    monkeypatch.setenv("FISHERKRON_DATA", str(tmp_path / "data"))
    monkeypatch.chdir(tmp_path)
    runpy.run_path(str(EXAMPLE), run_name="__main__")
    out = capsys.readouterr().out
    assert "kfac_svd with the calibrated allocation (one KL point per layer) (the recommended recipe)" in out
    assert re.search(r"PTB perplexity [\d.]+ -> [\d.]+ at compression ratio 2\d\.\d%", out), out
    saved = json.loads((tmp_path / "data" / "models" / "smollm2-20" / "fisherkron.json").read_text())
    assert saved["report"]["recipe"] == "recommended"
