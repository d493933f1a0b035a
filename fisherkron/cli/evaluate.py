"""``fisherkron evaluate``: score a saved (compressed) model, a plain Hugging Face folder or an embedded model.

Causal LMs: PTB perplexity (test split) and/or lm-eval tasks (local task files, offline)::

    fisherkron evaluate data/models/smollm2-gfwsvd-20 --ppl-tokens 8192 --seq-len 512
    fisherkron evaluate smollm2 --tasks arc_easy,piqa --limit 100      # the uncompressed baseline

Sequence classifiers: accuracy, F1 and MCC on a task's validation split (``--data sst2``).
One JSON line is printed.
"""
from __future__ import annotations

import importlib.util
import json
import logging
import re
from pathlib import Path

from ..core.conventions import FisherkronError
from . import options as opt

log = logging.getLogger("fisherkron.cli")

DEFAULT_PPL_SEQ_LEN = 512
DEFAULT_CLS_SEQ_LEN = 128
CLASSIFICATION_EVAL = ("sst2", "boolq", "trec", "mrpc", "rte")


def lm_eval_tasks(text: str) -> list[str]:
    """Comma-separated lm-eval task names, each a local task (or an MMLU subject ``mmlu_<subject>``)."""
    import argparse

    from ..hf.lm_eval_tasks import LOCAL_TASKS

    tasks = [t.strip() for t in text.split(",") if t.strip()]
    if not tasks:
        raise argparse.ArgumentTypeError("expected comma-separated task names, e.g. arc_easy,piqa")
    bad = [t for t in tasks if t not in LOCAL_TASKS and not re.fullmatch(r"mmlu_[a-z_]+", t)]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown lm-eval task {bad[0]!r}; choose from "
                                         f"{', '.join(LOCAL_TASKS)} or mmlu_<subject>")
    return list(dict.fromkeys(tasks))


def _settings(args) -> dict:
    from ..hf.data import TASKS as DATA_TASKS

    info = opt.describe_model(args.model)
    if info.source == "compressed" and args.task and args.task != info.task:
        raise FisherkronError(f"{args.model} holds a saved {info.architecture}; --task {args.task} cannot change it")
    if info.source == "compressed" and not any((Path(args.model) / f).exists()
                                               for f in ("tokenizer_config.json", "tokenizer.json")):
        raise FisherkronError(f"{args.model} has no tokenizer files; save the model with its tokenizer "
                              f"(save_compressed(..., tokenizer=tok)) or copy them into the folder")
    task = args.task or info.task
    num_labels = None
    if task == "causal-lm":
        if args.data is not None:
            raise FisherkronError(f"--data {args.data} scores a sequence classifier; {args.model} is a causal LM "
                                  f"(use --ppl-tokens and/or --tasks)")
        ppl = args.ppl_tokens is not None or not args.tasks
        if args.tasks and importlib.util.find_spec("lm_eval") is None:
            raise FisherkronError("lm_eval is not installed; run `make install` or `pip install 'fisherkron[eval]'`")
    else:
        causal_only = [o for o, v in (("--ppl-tokens", args.ppl_tokens), ("--tasks", args.tasks)) if v]
        if causal_only:
            raise FisherkronError(f"{causal_only[0]} scores a causal LM; {args.model} is a sequence classifier "
                                  f"(use --data {', '.join(CLASSIFICATION_EVAL)})")
        if args.data is None:
            raise FisherkronError(f"{args.model} is a sequence classifier: pass --data "
                                  f"{', '.join(CLASSIFICATION_EVAL)} to score it on that validation split")
        task_labels = DATA_TASKS[args.data][1]
        own_head = info.head_labels is not None and task == info.task
        if own_head and info.head_labels != task_labels:
            raise FisherkronError(f"{args.model} has a {info.head_labels}-label classification head but {args.data} "
                                  f"has {task_labels} labels; score it on the task its head was trained for")
        if not own_head:
            log.warning("%s has no trained classification head: a new one is drawn, so the scores are "
                        "those of an untrained head", args.model)
        num_labels = info.head_labels if own_head else task_labels
        ppl = False
    return {"info": info, "task": task, "num_labels": num_labels, "ppl": ppl}


def _run(args) -> int:
    from .. import hf as api

    s = _settings(args)
    model, tok = opt.load_model(api, args, s)
    progress = not args.quiet
    out: dict = {"model": args.model, "task": s["task"], "params": api.count_params(model)}
    if s["task"] == "causal-lm":
        seq_len = opt.resolve_seq_len(model, args.seq_len, DEFAULT_PPL_SEQ_LEN, args.model)
        if s["ppl"] and args.ppl_tokens is not None and args.ppl_tokens < seq_len:
            raise FisherkronError(f"--ppl-tokens {args.ppl_tokens} is less than one window of --seq-len {seq_len}; "
                                  f"score at least {seq_len} tokens")
        if s["ppl"]:
            kw = {"batch_size": args.batch_size} if args.batch_size else {}
            res = api.perplexity(model, tok, api.ptb("test"), seq_len=seq_len, max_tokens=args.ppl_tokens,
                                 progress=progress, **kw)
            out.update({"ptb_ppl": res.ppl, "ptb_tokens": res.tokens, "seq_len": seq_len})
        if args.tasks:
            kw = {"batch_size": args.batch_size} if args.batch_size else {}
            out["lm_eval"] = api.run_lm_eval(model, tok, args.tasks, num_fewshot=args.num_fewshot,
                                             limit=args.limit, max_length=args.seq_len, **kw)
    else:
        seq_len = opt.resolve_seq_len(model, args.seq_len, DEFAULT_CLS_SEQ_LEN, args.model)
        kw = {"batch_size": args.batch_size} if args.batch_size else {}
        metrics = api.evaluate_classifier(model, tok, api.load_task(args.data, "validation"), task=args.data,
                                          max_length=seq_len, limit=args.limit, progress=progress, **kw)
        out["classification"] = {"data": args.data, "split": "validation", "seq_len": seq_len, **metrics}
    print(json.dumps(out))
    return 0


def add_evaluate_command(sub, verbosity_options) -> None:
    e = sub.add_parser("evaluate", help="PTB perplexity / lm-eval tasks / classification metrics of a model",
                       description="Score a model saved by `fisherkron compress`, a plain Hugging Face folder "
                                   "or an embedded model (smollm2, gemma3-270m, qwen2.5-0.5b, minilm); prints one JSON line.")
    verbosity_options(e, top=False)
    e.add_argument("model", help="a folder written by fisherkron compress | a local HF folder | an embedded model: "
                                   "smollm2, gemma3-270m, qwen2.5-0.5b, minilm")
    e.add_argument("--task", choices=opt.TASKS, default=None,
                   help="how to load a plain folder or embedded model (default: from its config.json)")
    e.add_argument("--ppl-tokens", type=opt.positive_int, default=None,
                   help="PTB test tokens to score (default: all, unless only --tasks is given)")
    e.add_argument("--seq-len", type=opt.seq_len, default=None,
                   help=f"perplexity window / lm-eval max length / classifier max length (default "
                        f"{DEFAULT_PPL_SEQ_LEN} / the model's / {DEFAULT_CLS_SEQ_LEN}, at most the model's positions)")
    e.add_argument("--tasks", type=lm_eval_tasks, default=None,
                   help="comma-separated lm-eval tasks: arc_easy, arc_challenge, piqa, hellaswag, winogrande, "
                        "openbookqa, mmlu, mmlu_<subject>")
    e.add_argument("--num-fewshot", type=opt.non_negative_int, default=0, help="lm-eval few-shot examples")
    e.add_argument("--limit", type=opt.positive_int, default=None,
                   help="examples per lm-eval task / classification rows (default: all)")
    e.add_argument("--data", choices=CLASSIFICATION_EVAL, default=None,
                   help="score a sequence classifier on this task's validation split")
    e.add_argument("--batch-size", type=opt.positive_int, default=None, help="sequences per forward pass")
    e.add_argument("--device", type=opt.device, default=None, help="cpu, cuda, cuda:N or mps (default: cpu)")
    e.set_defaults(func=_run)
