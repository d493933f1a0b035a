"""``fisherkron compress``: calibrate, compress, save (and optionally score) a model from the shell.

Example (embedded SmolLM2, C4 calibration, 20 % smaller, PTB perplexity before/after)::

    fisherkron compress smollm2 --method gfwsvd --ratio 0.2 --k 16 --out data/models/smollm2-gfwsvd-20 --ppl-tokens 4096
"""
from __future__ import annotations

import json

CALIBRATION = ("c4", "sst2", "boolq", "trec")


def _run(args) -> int:
    from tqdm.auto import tqdm

    from .. import hf as api

    model, tok = api.load_model(args.model)
    causal = args.data == "c4"
    if causal:
        batches = api.lm_batches(tok, api.c4_documents(), args.k, batch_size=args.batch_size,
                                 seq_len=args.seq_len, seed=args.seed)
    else:
        batches = api.classification_batches(tok, api.load_task(args.data, "train"), args.k,
                                             batch_size=args.batch_size, max_length=args.seq_len,
                                             seed=args.seed, task=args.data)
    before = None
    if args.ppl_tokens and causal:
        before = api.perplexity(model, tok, api.ptb("test"), seq_len=args.seq_len,
                                max_tokens=args.ppl_tokens).ppl
    stats = None
    if args.method != "svd":
        stats = api.collect_calibration(model, batches, args.layers, k=args.k, seed=args.seed,
                                        methods=(args.method,), progress=True)
    report = api.compress(model, args.method, stats, args.layers, rank=args.rank, ratio=args.ratio,
                          min_alpha=args.min_alpha, progress=True)
    tqdm.write(str(report))
    out = api.save_compressed(model, args.out, report=report, tokenizer=tok)
    summary = {"out": str(out), "method": args.method, "ratio": report.ratio,
               "params_before": report.params_before, "params_after": report.params_after}
    if args.ppl_tokens and causal:
        reloaded = api.load_compressed(out)
        summary["ptb_ppl_before"] = before
        summary["ptb_ppl_after"] = api.perplexity(reloaded, tok, api.ptb("test"), seq_len=args.seq_len,
                                                  max_tokens=args.ppl_tokens).ppl
    print(json.dumps(summary))
    return 0


def add_compress_command(sub) -> None:
    c = sub.add_parser("compress", help="calibrate and compress a model, save a Hugging Face folder")
    c.add_argument("model", help="smollm2 | minilm | a local HF folder | a hub name (paper profile, needs the hub)")
    c.add_argument("--method", default="gfwsvd", help="svd, fwsvd, asvd, svd_llm, gfwsvd, gfwsvd_diag, gfwsvd_offdiag")
    group = c.add_mutually_exclusive_group(required=True)
    group.add_argument("--ratio", type=float, help="target whole-model compression ratio (1 - after/before)")
    group.add_argument("--rank", type=int, help="one rank for every selected layer")
    c.add_argument("--min-alpha", type=float, default=1e-3,
                   help="floor of the regularisation alpha of the Kronecker factors (see fisherkron.regularize)")
    c.add_argument("--layers", default=None, help="regex/glob of nn.Linear names (default: the paper's layers)")
    c.add_argument("--data", default="c4", choices=CALIBRATION, help="calibration data (c4 for causal LMs)")
    c.add_argument("--k", type=int, default=16, help="calibration batches (one gradient per batch)")
    c.add_argument("--batch-size", type=int, default=4)
    c.add_argument("--seq-len", type=int, default=256)
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--out", required=True, help="output folder (config + safetensors + fisherkron manifest)")
    c.add_argument("--ppl-tokens", type=int, default=0, help="score PTB perplexity on this many tokens before/after")
    c.set_defaults(func=_run)
