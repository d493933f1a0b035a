"""The options of ``fisherkron compress``: its argument parser, help layout and examples.

:func:`add_compress_command` adds the ``compress`` subcommand to ``fisherkron``'s parser; every default that is
a setting of the recommended recipe (:data:`fisherkron.hf.allocation.RECOMMENDED`) is read from it, so ``--help``
states the recipe the command runs. What the command does with the options: :mod:`fisherkron.cli.compress`.
"""
from __future__ import annotations

import argparse

from ..core.methods import METHODS
from ..core.operators import ENCODINGS
from ..core.regularization import MIN_ALPHA
from ..hf.allocation import GFWSVD_RECIPE, RECOMMENDED, STRATEGIES
from . import options as opt
from .evaluate import DEFAULT_PPL_SEQ_LEN

#: calibration tokens per sequence: the recommended recipe's (at most the model's positions)
DEFAULT_SEQ_LEN = RECOMMENDED.seq_len
#: C4 documents held out of the calibration for the allocations that measure (their loss or KL is measured on them);
#: of the user's own text (--data PATH) its last fifth, at most this many (:func:`heldout_documents`)
HELDOUT_DOCS = 200
#: held-out batches (of --batch-size x --seq-len) the measured allocations evaluate: the recommended recipe's
HELDOUT_BATCHES = RECOMMENDED.heldout_batches


def _run(args) -> int:
    """``fisherkron compress``'s entry point, imported when the command runs (``--help`` does not need it)."""
    from .compress import _run as run

    return run(args)


class HelpFormatter(argparse.HelpFormatter):
    """Wraps one-paragraph texts, keeps the lines of a text that has them (the epilog), and adds
    ``(default: X)`` to an option whose help does not say its default.

    An option whose default is ``None`` (decided later, from the model or the other options) says
    what it will be in its own help text; a flag is off unless given.
    """

    def _fill_text(self, text, width, indent):
        if "\n" in text:
            return "".join(indent + line for line in text.splitlines(keepends=True))
        return super()._fill_text(text, width, indent)

    def _get_help_string(self, action):
        text = action.help or ""
        if ("(default" in text or not action.option_strings
                or any(action.default is v for v in (None, False, argparse.SUPPRESS))):
            return text
        return text + " (default: %(default)s)"


def _epilog() -> str:
    """Three example commands: the recommended recipe, the paper's GFWSVD protocol, a classifier."""
    import textwrap

    r = RECOMMENDED
    examples = [
        (f"the recommended recipe: {r.describe()}, calibrated on {r.k} C4 batches of {r.batch_size} x {r.seq_len} "
         f"tokens; PTB perplexity before and after, as the studies score it:",
         "fisherkron compress smollm2 --ratio 0.2 --out smollm2-20 --ppl-tokens 4096"),
        ("the paper's GFWSVD protocol (Sec. 6.3): MFF's Kronecker factors, ranks by ASVD's sensitivity sweep:",
         "fisherkron compress smollm2 --method gfwsvd --allocation sensitivity --ratio 0.2 --out smollm2-gfwsvd-20"),
        ("a fine-tuned classifier, one rank for every layer (the paper's BERT protocol):",
         "fisherkron compress my-sst2-bert/ --data sst2 --rank 64 --out my-sst2-bert-64"),
    ]
    lines = ["examples:"]
    for what, command in examples:
        lines += textwrap.wrap(what, 100, initial_indent="  ", subsequent_indent="  ") + ["    " + command]
    lines += ["", *textwrap.wrap("The recommended recipe, GFWSVD's best allocation and the rule that chose them "
                                 "from the package's allocation and calibration studies: "
                                 "fisherkron.hf.allocation.RECOMMENDED and GFWSVD_RECIPE.", 100)]
    return "\n".join(lines)


def add_compress_command(sub, verbosity_options) -> None:
    r = RECOMMENDED
    c = sub.add_parser("compress", help="calibrate and compress a model, save a Hugging Face folder",
                       formatter_class=HelpFormatter, epilog=_epilog(),
                       description=f"Calibrate, compress and save a model (and optionally score its PTB "
                                   f"perplexity). Without --method and --allocation: the recommended recipe, "
                                   f"{r.describe()}. Every option, the output folder, the layers and the ranks are "
                                   f"checked before any data is read.")
    verbosity_options(c, top=False)
    g = c.add_argument_group("model and data")
    g.add_argument("model", help="an embedded model: smollm2, gemma3-270m, qwen2.5-0.5b (decoders), minilm (encoder) | "
                                   "a local HF folder | a hub name (paper profile, needs the hub)")
    g.add_argument("--task", choices=opt.TASKS, default=None,
                   help="how to load the model (default: from its config.json architectures; "
                        "minilm: sequence-classification, smollm2: causal-lm)")
    g.add_argument("--data", default=None, metavar="NAME|PATH",
                   help="c4 (default, causal LMs); sst2, boolq or trec (classifiers); or PATH to your own text for "
                        "a causal LM: .txt (documents separated by blank lines), .jsonl, .json, .csv, .parquet, or "
                        "a save_to_disk folder")
    g.add_argument("--text-field", default=None, metavar="NAME",
                   help="the field or column of --data PATH that holds the text (default: text)")
    g.add_argument("--device", type=opt.device, default=None, help="cpu, cuda, cuda:N or mps (default: cpu)")

    g = c.add_argument_group("how much", "a whole-model ratio or one rank for every layer (exactly one), and the "
                                         "layers they apply to")
    target = g.add_mutually_exclusive_group(required=True)
    target.add_argument("--ratio", type=opt.ratio,
                        help="target whole-model compression ratio (1 - after/before), in (0, 1)")
    target.add_argument("--rank", type=opt.positive_int, help="one rank for every selected layer")
    g.add_argument("--layers", default=None,
                   help="regex/glob of nn.Linear names (default: the paper's layers)")
    g.add_argument("--min-speedup", type=opt.positive_float, default=None,
                   help="keep a layer dense unless its factorisation is measured at least this many times as "
                        "fast (e.g. 1.0); the achieved ratio may then fall below --ratio (default: off)")
    g.add_argument("--skip-large-layers", action="store_true",
                   help="keep dense (with a warning) the selected layers whose factors cannot fit in memory, "
                        "e.g. a vocabulary-sized lm_head under a Kronecker method (default: refuse them)")
    g.add_argument("--factor-memory-gb", type=opt.positive_float, default=None,
                   help="the memory one layer's factors may take, in GB (default: the memory available when the "
                        "command starts)")

    g = c.add_argument_group("method")
    g.add_argument("--method", default=r.method, choices=list(METHODS),
                   help=f"compression method; gfwsvd is the paper's, and its best allocation in the same study is "
                        f"the {GFWSVD_RECIPE.allocation} one with the {GFWSVD_RECIPE.calibrate_metric} metric too, "
                        f"which this command uses by default (default: {r.method}, the recommended recipe's)")
    g.add_argument("--min-alpha", type=opt.non_negative_float, default=MIN_ALPHA,
                   help="floor of the regularisation alpha of the Kronecker factors (see fisherkron.regularize)")
    g.add_argument("--tol", type=opt.tol, default=None,
                   help="MFF's target relative error, in (0, 1) (default: MFF's, 1e-5 in float32; GFWSVD family)")

    g = c.add_argument_group("allocation", "with --ratio, how the per-layer ranks are chosen")
    g.add_argument("--allocation", choices=STRATEGIES, default=None,
                   help=f"uniform: one ratio for every layer; sensitivity: ASVD's measured sweep, the paper's "
                        f"protocol; fisher: Theorem 1's predicted loss increase, no model evaluation; calibrated: "
                        f"those curves scaled through one measured point per layer, ranks by an exact integer "
                        f"program; lems: LEMS's allocation. The measured ones (sensitivity, calibrated, lems) evaluate "
                        f"{HELDOUT_BATCHES} held-out batches from the last {HELDOUT_DOCS} C4 documents (of --data "
                        f"PATH: its last fifth, at most {HELDOUT_DOCS}), which the calibration never sees (default: "
                        f"{r.allocation}, the recommended recipe's, for --ratio on a causal LM; uniform with --rank, "
                        f"for a classifier and for svd)")
    g.add_argument("--calibrate-metric", choices=("kl", "loss"), default=None,
                   help=f"what --allocation calibrated measures: the KL divergence from the dense model's outputs "
                        f"(kl) or the held-out loss increase (loss) (default: {r.calibrate_metric}, the recommended "
                        f"recipe's)")
    g.add_argument("--calibrate-ratio", type=opt.ratio, default=None,
                   help="--allocation calibrated / lems: the per-layer ratio at which each layer is measured alone "
                        "(default: 0.5; LEMS's 0.9, 10 %% of the rank)")

    g = c.add_argument_group("calibration", f"the batches the statistics are collected on; the defaults are the "
                                            f"setting the recommended recipe was measured at ({r.k} batches of "
                                            f"{r.batch_size} x {r.seq_len} tokens)")
    g.add_argument("--k", type=opt.positive_int, default=r.k,
                   help="calibration batches (one gradient, or one K-FAC sum, per batch)")
    g.add_argument("--batch-size", type=opt.positive_int, default=r.batch_size, help="sequences per batch")
    g.add_argument("--seq-len", type=opt.seq_len, default=None,
                   help=f"tokens per sequence (default: {DEFAULT_SEQ_LEN}, or the model's positions if fewer)")
    g.add_argument("--seed", type=opt.non_negative_int, default=0,
                   help="draws the calibration windows (the held-out ones with seed + 1)")
    g.add_argument("--grad-dtype", choices=list(ENCODINGS), default="float32",
                   help="how calibration gradients are stored (16-bit: half the disk; GFWSVD family)")
    g.add_argument("--granularity", choices=("batch", "sequence", "token"), default="batch",
                   help="what one gradient of the empirical Fisher is: a batch's (the paper's), a sequence's, or a "
                        "token's (rank one, matrix-free; GFWSVD family)")
    g.add_argument("--cache-dir", default=None, help="calibration cache folder (default: data/cache/calibration)")
    g.add_argument("--no-cache", action="store_true",
                   help="do not reuse or keep calibration results (they go to a private folder under the cache "
                        "folder, deleted afterwards)")
    g.add_argument("--max-disk", type=opt.disk_size, default=None, metavar="SIZE",
                   help="the most disk the calibration may take, e.g. 20GB, 1.5TB or 500MiB: the layers are "
                        "collected in groups, MFF runs on each group's gradients and keeps only its factors, at "
                        "k x groups forward + backward passes, which --dry-run counts (default: unbounded, "
                        "every gradient kept)")

    g = c.add_argument_group("output")
    g.add_argument("--out", default=None,
                   help="output folder: config + safetensors + fisherkron manifest (required unless --dry-run)")
    g.add_argument("--overwrite", action="store_true",
                   help="replace an earlier fisherkron save in --out (other folders are never touched)")
    g.add_argument("--overwrite-edited", action="store_true",
                   help="with an earlier save in --out, also replace the files it wrote that were edited since "
                        "(default: such a file is refused by name); implies --overwrite")
    g.add_argument("--dtype", choices=opt.DTYPES, default="auto",
                   help="the dtype the weights are saved in (default: auto, the dtype the input model is stored "
                        "in, so a bfloat16 model stays bfloat16)")
    g.add_argument("--merged", action="store_true",
                   help="save W2 W1 multiplied back into dense weights: a plain Hugging Face folder any tool "
                        "loads, no saving on disk (default: the factorised form, read by fisherkron.load_compressed)")
    g.add_argument("--dry-run", action="store_true",
                   help="load the model, plan the ranks, print them, the parameter counts and what the calibration "
                        "will need (disk, also under --max-disk, memory, forward + backward passes); check --data "
                        "PATH; calibrate nothing")

    g = c.add_argument_group("evaluation", "PTB test perplexity before and after (causal LMs), as the studies "
                                           "score it")
    g.add_argument("--ppl-tokens", type=opt.positive_int, default=None,
                   help="score the first N tokens of PTB test, in --ppl-seq-len windows (default: off; the "
                        "studies: 4096)")
    g.add_argument("--ppl-seq-len", type=opt.seq_len, default=None,
                   help=f"the perplexity's window (default: {DEFAULT_PPL_SEQ_LEN}, the studies' and fisherkron "
                        f"evaluate's, or the model's positions if fewer)")

    g = c.add_argument_group("distributed", "under torchrun --nproc_per_node=N -m fisherkron compress ...")
    g.add_argument("--mff-parallel", choices=("batches", "layers"), default=None,
                   help="MFF of every layer on all ranks, each with its batches' gradients (batches), or layer i "
                        "on rank i %% world with all its gradients (layers) (default: batches)")
    g.add_argument("--dist-timeout", type=opt.positive_float, default=1800.0,
                   help="seconds a rank waits for the others before the run stops")
    c.set_defaults(func=_run)
