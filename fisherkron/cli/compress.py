"""``fisherkron compress``: calibrate, compress, save (and optionally score) a model from the shell.

Example (embedded SmolLM2, 20 % smaller by the recommended recipe, PTB perplexity before/after)::

    fisherkron compress smollm2 --ratio 0.2 --out data/models/smollm2-20 --ppl-tokens 4096

Without ``--method`` and ``--allocation`` it runs :data:`fisherkron.hf.allocation.RECOMMENDED`
(KFAC-SVD, per-layer ranks by the KL-calibrated allocation, which measures each layer once on
held-out C4 batches) on the calibration that recipe was measured with (``--k``, ``--batch-size``,
``--seq-len`` default to it); the recipe's docstring states the rule that chose it. ``--method
gfwsvd`` runs the paper's method with the same allocation, its best in the same study.

A causal LM calibrates on C4, or on the user's own text: ``--data PATH`` names a ``.txt``
(documents separated by blank lines), ``.jsonl``, ``.json``, ``.csv`` or ``.parquet`` file, or a
``save_to_disk`` folder (:mod:`fisherkron.hf.user_data`; ``--text-field`` names the field that holds
the text). The file is read before the model is loaded, so a bad one is one line, under
``--dry-run`` too; the measured allocations hold out its last fifth (at most ``HELDOUT_DOCS``
documents), which the calibration never sees::

    fisherkron compress smollm2 --ratio 0.2 --data my-notes.jsonl --text-field body --out smollm2-notes-20

A sequence classifier (a folder whose ``config.json`` names a ``*ForSequenceClassification``,
or ``minilm``) is loaded with its head and calibrated on a classification task::

    fisherkron compress my-sst2-bert/ --data sst2 --rank 64 --out my-sst2-bert-64

The order is: check every option; check ``--out`` (a folder, writable -- tested by writing
a file --, new, empty or an earlier save with ``--overwrite``, none of whose files was edited
since, unless ``--overwrite-edited``); load the model; check ``--seq-len`` against its
positions; select the layers; plan, and count what the calibration will need (disk under
``--max-disk``, memory, forward + backward passes: :func:`fisherkron.hf.budget.calibration_needs`;
a bound too small is refused) and whether the user's text holds enough tokens (``--dry-run`` stops
here and prints all of it); check that ``--out`` has room for the planned save; only then draw the
batches, calibrate, compress and save.

``--max-disk 20GB`` bounds the disk the calibration takes: the layers are collected in groups, MFF
runs on each group's gradients and only its factors are kept
(:func:`fisherkron.collect_calibration`'s ``max_disk``), at ``k x groups`` forward + backward passes.

The plan never makes the model larger or runs out of memory where that can be told in
advance (:mod:`fisherkron.hf.budget`): a selected layer whose weight another module holds (an
``lm_head`` tied to the embeddings) is left dense with a warning (refused when ``--layers``
names it); a layer whose factors need more memory than is available (``--factor-memory-gb``)
is refused, or kept dense with ``--skip-large-layers``; a plan whose model would have more
parameters than the input is refused. The save is written in the input's dtype (``--dtype
auto``; the JSON line says which). SIGTERM is handled like Ctrl-C: one line, status 130,
nothing temporary left.

Under ``torchrun --nproc_per_node=N -m fisherkron compress ...`` (``WORLD_SIZE > 1``) every
process runs the checks, joins the process group (gloo on CPUs; NCCL with ``--device cuda``,
rank r on ``cuda:LOCAL_RANK``), calibrates its share of the batches and takes part in MFF of
every layer (``--mff-parallel batches``, data-parallel) or of its share of the layers
(``--mff-parallel layers``); see :mod:`fisherkron.hf.distributed`. Rank 0 then compresses,
saves and prints; the other ranks print nothing but errors.
"""
from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

from ..core.conventions import FisherkronError
from ..core.lowrank import compression_ratio, lowrank_params
from ..core.methods import METHODS
from ..hf.allocation import MEASURED, RECOMMENDED, describe
from . import options as opt
from .compress_parser import DEFAULT_SEQ_LEN, HELDOUT_BATCHES, HELDOUT_DOCS
from .evaluate import DEFAULT_PPL_SEQ_LEN

log = logging.getLogger("fisherkron.cli")

CALIBRATION = ("c4",) + opt.CLASSIFICATION_DATA


def heldout_documents(documents: int) -> int:
    """How many of the user's ``documents`` (the last ones) a measured allocation holds out: a fifth,
    at least one and at most :data:`HELDOUT_DOCS` (C4's share)."""
    return max(1, min(HELDOUT_DOCS, documents // 5))


def _or(names) -> str:
    """``"a, b or c"``."""
    names = list(names)
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def _settings(args) -> dict:
    """Everything decided from the options and the model's ``config.json`` alone (no model loaded),
    and the user's own text (``--data PATH``) read."""
    from ..hf.data import TASKS as DATA_TASKS
    from ..hf.user_data import data_source, load_documents

    if args.out is None and not args.dry_run:
        raise FisherkronError("--out is required (unless --dry-run)")
    source = None if args.data is None else data_source(args.data, CALIBRATION)
    own = isinstance(source, Path)  # the user's own text, not a built-in set
    if args.text_field is not None and not own:
        given = "no --data was given" if args.data is None else f"{args.data} is a built-in data set"
        raise FisherkronError(f"--text-field names the text of a --data file or folder; {given}")
    info = opt.describe_model(args.model)
    if info.factorised:
        raise FisherkronError(f"{args.model} holds a model fisherkron already factorised; compress the original "
                              f"model instead (or a merged save: fisherkron compress --merged)")
    task = args.task or info.task
    notes = []  # logged once every check has passed, so that a refused command prints one line
    if args.task and args.task != info.task and info.head_labels is not None:
        notes.append((logging.WARNING, "%s holds a %s with a %d-label head; --task %s drops that head",
                      args.model, info.architecture, info.head_labels, args.task))
    num_labels = None
    if task == "causal-lm":
        data = str(source) if own else args.data or "c4"
        if not own and data != "c4":
            raise FisherkronError(f"--data {data} is a classification task, but {args.model} is compressed as a "
                                  f"causal LM, which calibrates on c4 or on your own text (--data PATH); pass "
                                  f"--task sequence-classification for a classifier")
    elif own:
        raise FisherkronError(f"--data {args.data} is your own text, which calibrates a causal LM; {args.model} is "
                              f"a sequence classifier: pass --data {_or(opt.CLASSIFICATION_DATA)}")
    else:
        if args.data in (None, "c4"):
            what = "c4 is language-modelling data for causal LMs" if args.data else "no --data was given"
            raise FisherkronError(f"{args.model} is a sequence classifier and calibrates with a classification loss "
                                  f"({what}); pass --data {', '.join(opt.CLASSIFICATION_DATA)} "
                                  f"(for a fine-tuned classifier: the task its head was trained for)")
        data = args.data
        task_labels = DATA_TASKS[data][1]
        if info.head_labels is not None and task == info.task and info.head_labels != task_labels:
            raise FisherkronError(f"{args.model} has a {info.head_labels}-label classification head but {data} has "
                                  f"{task_labels} labels; calibrate on the task the head was trained for")
        num_labels = info.head_labels if task == info.task and info.head_labels else task_labels
        if info.head_labels is None or task != info.task:
            notes.append((logging.WARNING, ("%s has no trained %d-label classification head: a new one is drawn "
                                            "(seed 0) and calibration gradients flow through it"),
                          args.model, num_labels))
        if args.ppl_tokens is not None:
            raise FisherkronError(f"--ppl-tokens scores PTB perplexity of a causal LM; {args.model} is a sequence "
                                  f"classifier (use `fisherkron evaluate --data {data}` on the saved folder)")
    metric_given = args.calibrate_metric is not None
    given = args.allocation is not None
    args.allocation, why = _allocation(args, task)
    if why:
        notes.append((logging.INFO, "--allocation left out: %s (%s)", args.allocation, why))
    running = (f"--allocation {args.allocation}" if given else
               f"the {args.allocation} allocation that runs here ({why or 'with --rank nothing is allocated'})")
    if args.ppl_seq_len is not None and args.ppl_tokens is None:
        raise FisherkronError("--ppl-seq-len sets the window of the perplexity that --ppl-tokens scores; "
                              "give --ppl-tokens")
    if args.allocation != "uniform" and args.ratio is None:
        raise FisherkronError(f"--allocation {args.allocation} chooses per-layer ranks for a target --ratio; "
                              f"give --ratio instead of --rank")
    if args.allocation in MEASURED and task != "causal-lm":
        raise FisherkronError(f"--allocation {args.allocation} measures the model on held-out C4 batches (causal "
                              f"LMs); for a classifier use --allocation fisher or uniform")
    if args.allocation in ("fisher", "calibrated") and args.method == "svd":
        raise FisherkronError(f"--allocation {args.allocation} reads the calibration's Fisher, and method svd "
                              f"collects none; use another method or --allocation sensitivity or lems")
    if metric_given and args.allocation != "calibrated":
        raise FisherkronError(f"--calibrate-metric chooses what --allocation calibrated measures; drop it for "
                              f"{running}")
    if args.calibrate_ratio is not None and args.allocation not in ("calibrated", "lems"):
        raise FisherkronError(f"--calibrate-ratio sets where --allocation calibrated or lems measures each layer; "
                              f"drop it for {running}")
    if (args.grad_dtype != "float32" or args.granularity != "batch") and not METHODS[args.method].kronecker:
        raise FisherkronError(f"--grad-dtype and --granularity shape the gradients MFF reads; method {args.method} "
                              f"does not run MFF")
    if args.tol is not None and not METHODS[args.method].kronecker:
        raise FisherkronError(f"--tol sets MFF's tolerance, and method {args.method} does not run MFF")
    if args.allocation == "calibrated" and not metric_given:
        args.calibrate_metric = RECOMMENDED.calibrate_metric
    opt.check_gradient_options(args, METHODS[args.method].kronecker)  # pairs that cannot go together; torchrun
    if args.method == "svd" and (args.cache_dir is not None or args.no_cache or args.max_disk is not None):
        notes.append((logging.INFO, "method svd needs no calibration: --cache-dir/--no-cache/--max-disk have no "
                                    "effect"))
    documents = load_documents(source, text_field=args.text_field) if own else None  # one line if it is bad
    for level, *msg in notes:
        log.log(level, *msg)
    return {"task": task, "data": data, "num_labels": num_labels, "info": info, "documents": documents}


def _allocation(args, task: str) -> tuple[str, str | None]:
    """``(the allocation that runs, why the default is not the recommended one)``.

    ``--allocation`` as given; left out, the recommended recipe's (``calibrated``) for a causal
    LM's ``--ratio``, and ``uniform`` where that allocation does not apply: with ``--rank`` (one
    rank for every layer), for a classifier (there are no held-out C4 batches to measure it on)
    and for ``svd`` (it reads no Fisher to scale).
    """
    if args.allocation is not None:
        return args.allocation, None
    if args.ratio is None:
        return "uniform", None
    if task != "causal-lm":
        return "uniform", f"the {RECOMMENDED.allocation} allocation measures on held-out C4 batches, a causal LM's"
    if args.method == "svd":
        return "uniform", f"the {RECOMMENDED.allocation} allocation scales a Fisher, which method svd does not read"
    return RECOMMENDED.allocation, None


def plan_table(model, names: list[str], plan: dict[str, int]) -> dict:
    """Per-layer and whole-model parameter counts of a rank plan (as ``compress`` would apply it).

    The whole model's count after is exact (:func:`fisherkron.hf.budget.params_after`): a weight
    another module still holds stays."""
    from ..hf.budget import count_params, params_after

    mods = dict(model.named_modules())
    rows, dense_total, after_total = [], 0, 0
    for name in names:
        lin = mods[name]
        n, m, r = lin.out_features, lin.in_features, plan[name]
        bias = lin.bias is not None
        dense = n * m + (n if bias else 0)
        low = lowrank_params(n, m, r, bias)
        after = min(dense, low)  # compress keeps a layer dense when the rank saves nothing
        rows.append({"layer": name, "n": n, "m": m, "rank": r, "params_before": dense, "params_after": after,
                     "kept_dense": low >= dense})
        dense_total += dense
        after_total += after
    before = count_params(model)
    after = params_after(model, plan)
    return {"rows": rows, "params_before": before, "params_after": after,
            "ratio": compression_ratio(before, after),
            "layer_params_before": dense_total, "layer_params_after": after_total,
            "layers_ratio": compression_ratio(dense_total, after_total) if dense_total else 0.0}


def _print_table(table: dict, file=None) -> None:
    file = file or sys.stdout
    width = max([len("layer")] + [len(r["layer"]) for r in table["rows"]])
    print(f"{'layer':<{width}}  {'n':>6}  {'m':>6}  {'rank':>5}  {'params before':>13} -> {'after':>11}", file=file)
    for r in table["rows"]:
        note = "  (kept dense: the rank saves nothing)" if r["kept_dense"] else ""
        print(f"{r['layer']:<{width}}  {r['n']:>6}  {r['m']:>6}  {r['rank']:>5}  {r['params_before']:>13,} -> "
              f"{r['params_after']:>11,}{note}", file=file)
    print(f"{len(table['rows'])} layers: {table['layer_params_before']:,} -> {table['layer_params_after']:,} params "
          f"(ratio {table['layers_ratio']:.2%}); whole model: {table['params_before']:,} -> "
          f"{table['params_after']:,} params (ratio {table['ratio']:.2%})", file=file)


def _torchrun(args):
    """This process's :class:`~fisherkron.hf.distributed.Launch` under torchrun (``args.device`` set per rank), else None."""
    if int(os.environ.get("WORLD_SIZE", "1") or 1) <= 1:
        return None
    from ..hf.distributed import join_torchrun

    launch = join_torchrun(args.device)
    args.device = launch.device
    return launch


def _methods(args) -> tuple[str, ...]:
    """What the calibration collects for: the method, and K-FAC for an allocation that reads a Kronecker Fisher."""
    fisher = args.allocation in ("fisher", "calibrated")
    return (args.method,) + (("kfac",) if fisher and not METHODS[args.method].kronecker
                             and "kfac" not in METHODS[args.method].needs else ())


def _save_dtype(args, model) -> tuple[str, str | None]:
    """``(dtype to write, the input's dtype)``: ``--dtype``, where ``auto`` is the input's (else the model's own)."""
    from ..hf.saving import _model_dtype, dtype_name

    source = opt.input_dtype(model, args.model)
    if args.dtype != "auto":
        return args.dtype, source
    if source is None:
        own = dtype_name(_model_dtype(model))
        log.info("the dtype %s is stored in is unknown: saving in %s (choose with --dtype)", args.model, own)
        return own, None
    return source, source


def _plan(api, args, model) -> tuple[list[str], dict, dict]:
    """The layers, their ranks and the table, checked: no tied weight untied, no factor beyond memory, no growth."""
    from ..hf.budget import check_factor_memory, drop_shared

    names = api.select_layers(model, args.layers)
    names = drop_shared(model, names, args.layers, option="--layers")
    limit = None if args.factor_memory_gb is None else int(args.factor_memory_gb * 1e9)
    names = check_factor_memory(model, names, _methods(args), limit=limit,
                                skip=args.skip_large_layers, skip_option="--skip-large-layers",
                                limit_option="--factor-memory-gb")
    if not names:
        raise FisherkronError("no selected layer is left to factorise (the factors of each are too large for the "
                              "memory); select smaller layers with --layers")
    plan = api.plan_ranks(model, names, rank=args.rank, ratio=args.ratio)
    table = plan_table(model, names, plan)
    if table["params_after"] > table["params_before"]:
        raise FisherkronError(f"the plan would make the model larger ({table['params_before']:,} -> "
                              f"{table['params_after']:,} params); select other layers or a smaller --rank")
    return names, plan, table


def _run(args) -> int:
    from ..env import sigterm_as_interrupt

    with sigterm_as_interrupt():  # SIGTERM (docker stop, a scheduler) stops the command as Ctrl-C does
        return _run_checked(args)


def _run_checked(args) -> int:
    from .. import hf as api

    # 1. the options and the model's config.json; 2. the output folder
    s = _settings(args)
    launch = _torchrun(args)
    if launch is None and args.mff_parallel is not None:
        log.info("--mff-parallel only matters under torchrun (WORLD_SIZE > 1); one process runs MFF layer by layer")
    if args.out is not None:
        opt.check_out_folder(args.out, overwrite=args.overwrite, overwrite_edited=args.overwrite_edited)
    if METHODS[args.method].needs and not args.dry_run:
        from ..env import data_root
        cache_dir = args.cache_dir or data_root() / "cache" / "calibration"
        if not args.no_cache and os.path.isdir(cache_dir) and not os.access(cache_dir, os.W_OK | os.X_OK):
            # a read-only shared cache: the entries it holds are used; a missing one is refused in one line
            log.info("the calibration cache %s is read-only: only what it holds can be used", cache_dir)
        else:
            opt.check_folder(cache_dir, "--cache-dir" if args.cache_dir else "the calibration cache folder")
    # 3. the model, its positions, the layers and the ranks
    model, tok = opt.load_model(api, args, s)
    seq_len = opt.resolve_seq_len(model, args.seq_len, DEFAULT_SEQ_LEN, args.model)
    ppl_seq_len = None
    if args.ppl_tokens is not None:
        ppl_seq_len = opt.resolve_seq_len(model, args.ppl_seq_len, DEFAULT_PPL_SEQ_LEN, args.model,
                                          option="--ppl-seq-len")
        if args.ppl_tokens < ppl_seq_len:
            raise FisherkronError(f"--ppl-tokens {args.ppl_tokens} is less than one window of --ppl-seq-len "
                                  f"{ppl_seq_len}; score at least {ppl_seq_len} tokens")
    names, plan, table = _plan(api, args, model)
    dtype, source = _save_dtype(args, model)
    log.info("%s loaded as %s (%s params, stored in %s); %d layers selected", args.model, s["task"],
             f"{table['params_before']:,}", source or "an unknown dtype", len(names))
    needs = _needs(args, model, names, seq_len)  # a --max-disk too small is refused here
    if s["documents"] is not None:
        _check_documents(args, s, tok, seq_len)
    if args.dry_run:
        if launch is not None and launch.rank != 0:
            return 0
        if not args.quiet:
            _print_table(table)
            print(f"fisherkron: {_describe_needs(args, needs)}", file=sys.stderr)
        if args.allocation != "uniform":
            log.warning("--allocation %s chooses the ranks after calibration; the plan shown is the uniform one "
                        "for the same ratio", args.allocation)
        print(json.dumps({"dry_run": True, "model": args.model, "task": s["task"], "data": s["data"],
                          "text_field": args.text_field, "method": args.method,
                          "allocation": args.allocation, **_metric(args), "recipe": _recipe(args),
                          "calibration": _calibration(args, s, seq_len), "max_disk": args.max_disk, "needs": needs,
                          "layers": len(names), "ranks": plan,
                          **{k: v for k, v in table.items() if k != "rows"}, "dtype": dtype, "input_dtype": source}))
        return 0
    log.info("%s", _describe_needs(args, needs))
    if source is not None and _itemsize(dtype) > _itemsize(source):
        log.warning("saving in %s, wider than the %s %s is stored in: each weight takes %d times its input size "
                    "on disk (--dtype auto keeps the input's)", dtype, source, args.model,
                    _itemsize(dtype) // _itemsize(source))
    # the output folder's free space, now that the plan says how large the save will be
    from ..hf.saving import check_free_space
    check_free_space(args.out, (table["params_before"] if args.merged else table["params_after"]) * _itemsize(dtype))
    if args.verbose:
        _print_table(table, file=sys.stderr)
    if not args.quiet and (launch is None or launch.rank == 0):
        cal = _calibration(args, s, seq_len)
        held = f" and {cal['heldout_batches']} held-out ones to measure on" if cal["heldout_batches"] else ""
        print(f"fisherkron: {describe(args.method, args.allocation, args.calibrate_metric)}"
              f"{', the recommended recipe' if _recipe(args) else ''}; calibration: {cal['k']} {cal['data']} batches "
              f"of {cal['batch_size']} x {cal['seq_len']} tokens{held}", file=sys.stderr)
    if launch is None:
        return _calibrate_compress_save(api, args, s, model, tok, seq_len, names, dtype=dtype, source=source,
                                        ppl_seq_len=ppl_seq_len)
    launch.join(args.dist_timeout)
    try:
        return _calibrate_compress_save(api, args, s, model, tok, seq_len, names, launch, dtype=dtype, source=source,
                                        ppl_seq_len=ppl_seq_len)
    finally:
        launch.close()


def _metric(args) -> dict:
    """``{"calibrate_metric": ...}`` for the calibrated allocation, else nothing."""
    return {"calibrate_metric": args.calibrate_metric} if args.allocation == "calibrated" else {}


def _recipe(args) -> str | None:
    """``"recommended"`` when the method and allocation are the recommended recipe's, else ``None``."""
    return "recommended" if RECOMMENDED.matches(args.method, args.allocation, args.calibrate_metric) else None


def _calibration(args, s: dict, seq_len: int) -> dict:
    """The calibration (and held-out) batches the command draws, as its JSON line reports them."""
    measured = args.allocation in MEASURED
    return {"data": s["data"], "k": args.k, "batch_size": args.batch_size, "seq_len": seq_len, "seed": args.seed,
            "heldout_batches": HELDOUT_BATCHES if measured else 0}


def _collects(args) -> bool:
    """Whether the command collects a calibration: the method reads one, or the allocation reads a Fisher."""
    return bool(METHODS[args.method].needs) or args.allocation in ("fisher", "calibrated")


def _needs(args, model, names: list[str], seq_len: int) -> dict | None:
    """What the calibration will take (:func:`fisherkron.hf.budget.calibration_needs` of the planned layers):
    disk (gradients, statistics, MFF's factors, the peak; under ``--max-disk`` per group), a lower bound of
    the memory and the forward + backward passes; ``None`` when nothing is collected.

    A ``--max-disk`` under the smallest bound that works is refused in one line, naming the option.
    """
    from ..hf.budget import calibration_needs
    from ..hf.calibration.disk import format_size

    if not _collects(args):
        return None
    shape = dict(k=args.k, batch_size=args.batch_size, seq_len=seq_len, grad_dtype=args.grad_dtype,
                 granularity=args.granularity)
    needs = calibration_needs(model, names, _methods(args), **shape)
    if args.max_disk is None:
        return needs
    least, bound = needs["min_max_disk"], format_size(args.max_disk)
    kept = needs["statistics_bytes"] + needs["factor_bytes"]  # on disk to the end, whatever the groups
    what = "statistics and MFF factors" if needs["gradient_bytes"] else "statistics"
    if kept >= args.max_disk:
        raise FisherkronError(f"--max-disk {bound} is too small for this calibration: the {what} of its "
                              f"{needs['layers']} layers alone take {format_size(kept)}, kept to the end; raise "
                              f"--max-disk to at least {format_size(least)} or select fewer layers (--layers)")
    if args.max_disk < least:
        raise FisherkronError(f"--max-disk {bound} is too small for this calibration: the {what} of its "
                              f"{needs['layers']} layers and the largest layer's gradients need at least "
                              f"{format_size(least)} on disk at once; raise --max-disk to at least "
                              f"{format_size(least)}, store the gradients in 16 bits (--grad-dtype bfloat16), "
                              f"lower --k, or select fewer layers (--layers)")
    return calibration_needs(model, names, _methods(args), max_disk=args.max_disk, **shape)


def _describe_needs(args, needs: dict | None) -> str:
    """One line of what the calibration will take (the dry run's, for people; its JSON has the numbers)."""
    from ..hf.calibration.disk import format_size as size

    if needs is None:
        return f"method {args.method} calibrates nothing: no calibration disk, no forward + backward passes"
    grads = size(needs["gradient_bytes"]) + ("" if needs["gradient_bytes"] else f" ({args.method} stores none)")
    bounded = ""
    if args.max_disk is not None:
        bounded = (f"; under --max-disk {size(args.max_disk)}: {needs['groups']} group(s) of layers, "
                   f"{size(needs['gradient_bytes_bounded'])} of gradients at once, at most "
                   f"{size(needs['disk_bytes_bounded'])} on disk")
    model = f" (the model: {size(needs['model_bytes'])})" if needs["model_bytes"] is not None else ""
    return (f"the calibration will need: gradients {grads}, statistics {size(needs['statistics_bytes'])}, MFF "
            f"factors {size(needs['factor_bytes'])}, at most {size(needs['disk_bytes'])} on disk without a bound"
            f"{bounded}; at least {size(needs['memory_bytes'])} of memory{model}; {needs['k']} batches x "
            f"{needs['groups']} group(s) = {needs['passes']} forward + backward passes")


def _check_documents(args, s: dict, tok, seq_len: int) -> None:
    """Refuse the user's text (``--data PATH``) when it is too short for ``--k`` batches, or, for a measured
    allocation, when its held-out last documents are too short for :data:`HELDOUT_BATCHES` batches (one
    line each, with the tokens needed and the tokens there)."""
    from ..hf.user_data import check_enough_tokens, count_tokens

    docs, data = s["documents"], s["data"]
    if args.allocation not in MEASURED:
        check_enough_tokens(tok, docs, args.k, args.batch_size, seq_len, source=data)
        return
    n = heldout_documents(len(docs))
    check_enough_tokens(tok, docs[:-n], args.k, args.batch_size, seq_len,
                        source=f"{data} (less its last {n} of {len(docs)} documents, held out for --allocation "
                               f"{args.allocation})")
    need = HELDOUT_BATCHES * args.batch_size * seq_len
    have = count_tokens(tok, docs[-n:], need)
    if have >= need:
        return
    raise FisherkronError(f"{data}: its last {n} of {len(docs)} documents, held out to measure --allocation "
                          f"{args.allocation} on {HELDOUT_BATCHES} batches, give {have} tokens, but "
                          f"{HELDOUT_BATCHES} x batch_size x seq_len = {HELDOUT_BATCHES} x {args.batch_size} x "
                          f"{seq_len} = {need} are needed: give more text (the last fifth of the documents, at most "
                          f"{HELDOUT_DOCS}, is held out), lower --batch-size or --seq-len, or use --allocation fisher "
                          f"or uniform, which measure nothing")


def _itemsize(dtype: str) -> int:
    import torch

    return torch.empty((), dtype=getattr(torch, dtype)).element_size()


def _calibrate_compress_save(api, args, s: dict, model, tok, seq_len: int, names: list[str], launch=None, *,
                             dtype: str, source: str | None, ppl_seq_len: int | None) -> int:
    """Step 4, the expensive part: data, perplexity before, calibration, (MFF over the ranks,) compression, saving."""
    progress = not args.quiet
    allocation_options = None
    if s["task"] == "causal-lm":
        docs = api.c4_documents() if s["documents"] is None else s["documents"]
        if args.allocation in MEASURED:  # the measurements use documents the calibration does not see
            n = HELDOUT_DOCS if s["documents"] is None else heldout_documents(len(docs))
            docs, held = docs[:-n], docs[-n:]
            allocation_options = {"heldout": api.lm_batches(tok, held, HELDOUT_BATCHES, batch_size=args.batch_size,
                                                            seq_len=seq_len, seed=args.seed + 1)}
            allocation_options.update({k: v for k, v in (("calibrate_metric", args.calibrate_metric),
                                                         ("calibrate_ratio", args.calibrate_ratio)) if v is not None})
        batches = api.lm_batches(tok, docs, args.k, batch_size=args.batch_size,
                                 seq_len=seq_len, seed=args.seed)
    else:
        batches = api.classification_batches(tok, api.load_task(s["data"], "train"), args.k,
                                             batch_size=args.batch_size, max_length=seq_len,
                                             seed=args.seed, task=s["data"])
    before = None
    if args.ppl_tokens and launch is None:
        before = _ptb(api, model, tok, args, ppl_seq_len, progress).ppl
    stats = None
    mff_options = {}  # MFF's options: under --max-disk the calibration runs MFF, and compression reads its factors
    if args.device is not None and launch is None:
        mff_options["device"] = args.device
    if args.tol is not None:
        mff_options["tol"] = args.tol
    if _collects(args):  # the planned layers (a tied lm_head, a layer too large left out)
        stats = api.collect_calibration(model, batches, names, k=args.k, seed=args.seed,
                                        methods=_methods(args), cache=not args.no_cache,
                                        cache_dir=args.cache_dir, progress=progress,
                                        grad_dtype=args.grad_dtype, granularity=args.granularity,
                                        group=None if launch is None else launch.group,
                                        max_disk=args.max_disk, mff_options=mff_options)
    if launch is not None:
        if METHODS[args.method].kronecker:  # the factors go to the calibration cache, where compress reads them
            from ..hf.distributed import precompute_kronecker
            precompute_kronecker(stats, names, group=launch.group, parallel=args.mff_parallel or "batches",
                                 device=args.device, progress=progress, **mff_options)
        if launch.rank != 0:
            return 0
        if args.ppl_tokens:
            before = _ptb(api, model, tok, args, ppl_seq_len, progress).ppl
    limit = None if args.factor_memory_gb is None else int(args.factor_memory_gb * 1e9)
    report = api.compress(model, args.method, stats, names, rank=args.rank, ratio=args.ratio,
                          min_alpha=args.min_alpha, mff_options=mff_options, allocation=args.allocation,
                          allocation_options=allocation_options, min_speedup=args.min_speedup,
                          factor_memory_limit=limit, progress=progress)
    if not args.quiet:
        print(str(report), file=sys.stderr)
    unconverged = [n for n, lr in report.layers.items() if lr.mff_converged is False]
    if unconverged:
        log.warning("MFF did not reach its tolerance on %d layer(s), e.g. %s", len(unconverged), unconverged[0])
    out = api.save_compressed(model, args.out, report=report, tokenizer=tok,
                              overwrite=args.overwrite or args.overwrite_edited, merged=args.merged, dtype=dtype,
                              overwrite_edited=args.overwrite_edited)
    from ..hf.saving import MANIFEST
    saved = sum(spec["size"] for spec in json.loads((out / MANIFEST).read_text())["files"].values())
    summary = {"out": str(out), "model": args.model, "task": s["task"], "data": s["data"],
               "text_field": args.text_field, "max_disk": args.max_disk, "method": args.method,
               "ratio": report.ratio, "params_before": report.params_before, "params_after": report.params_after,
               "allocation": report.allocation, "allocation_details": report.allocation_details,
               "allocation_cost": report.allocation_cost, "recipe": report.recipe,
               "calibration": _calibration(args, s, seq_len),
               "layers_kept_dense": sum(lr.skipped is not None for lr in report.layers.values()),
               "dtype": dtype, "input_dtype": source, "saved_bytes": saved}
    if args.ppl_tokens:
        reloaded = api.load_compressed(out)
        if args.device is not None:
            reloaded.to(args.device)
        after = _ptb(api, reloaded, tok, args, ppl_seq_len, progress)
        summary.update({"ptb_ppl_before": before, "ptb_ppl_after": after.ppl, "ptb_seq_len": ppl_seq_len,
                        "ptb_first_tokens": args.ppl_tokens, "ptb_scored_tokens": after.tokens})
    print(json.dumps(summary))
    return 0


def _ptb(api, model, tok, args, seq_len: int, progress: bool):
    """PTB test perplexity on its first ``--ppl-tokens`` tokens in non-overlapping ``seq_len`` windows.

    The studies' evaluation (:meth:`fisherkron.experiments.llm_compression.Study.evaluate`: the
    first ``eval_tokens`` tokens of PTB test, ``eval_seq_len`` windows, one window a forward pass):
    the same function on the same windows, so ``--ppl-tokens 4096`` (and the default
    ``--ppl-seq-len``) scores a model as their tables do.
    """
    return api.perplexity(model, tok, api.ptb("test"), seq_len=seq_len, max_tokens=args.ppl_tokens, progress=progress)
