"""``collect_calibration``: the public entry point, its cache, and the one-process collection into a folder.

The arguments are checked first, then the key is computed (:mod:`.keys`); a valid entry
is returned as it is (:mod:`.entry`), an interrupted one resumed (:mod:`.resume`), and
otherwise the batches are run (:mod:`.accumulate`) here or over a process group (:mod:`.ranks`).
"""
from __future__ import annotations

import contextlib
import errno
import logging
import shutil
import tempfile
import weakref
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ...core.checks import check_int, check_positive
from ...core.conventions import FisherkronError
from ...core.distributed import resolve_group
from ...core.phases import timed
from ...env import data_root, sigterm_as_interrupt, temporary_name
from .accumulate import accumulate, save_statistics
from .bounded import RECORD, bounded_config, collect_groups
from .disk import format_size, layer_disk, parse_size, plan_groups
from .entry import GRANULARITIES, METHOD_STATS, STATS, CalibrationStats, read_manifest, write_manifest
from .folders import (OWNER, PARTIAL_SUFFIX, NoSpace, no_space, owned, preallocate, read_only, reclaim,
                      release_entry, seal, wait_for_owner, writable_root)
from .keys import calibration_key, config_key
from .layers import select_layers
from .ranks import collect_on_ranks
from .resume import Checkpoint, Rows, deferred_interrupts, drop_foreign_progress, open_rows, plan_resume

__all__ = ["collect_calibration", "split_sequences", "default_loss"]

log = logging.getLogger(__name__)


def split_sequences(batches) -> list[dict]:
    """Each batch of ``B`` sequences as ``B`` batches of one (tensors split along dim 0; other values shared)."""
    out = []
    for b in batches:
        if not isinstance(b, dict):
            raise FisherkronError("granularity='sequence' needs batches that are dicts of tensors")
        sizes = {v.shape[0] for v in b.values() if isinstance(v, torch.Tensor) and v.dim() > 0}
        if len(sizes) != 1:
            raise FisherkronError(f"cannot split a batch into sequences: its tensors have first dimensions "
                                  f"{sorted(sizes)}")
        B = sizes.pop()
        out += [{key: v[j:j + 1] if isinstance(v, torch.Tensor) and v.dim() > 0 else v for key, v in b.items()}
                for j in range(B)]
    return out


def check_batches(batches: list) -> None:
    """Every calibration batch must be a dict of named inputs (``str`` keys), as :func:`fisherkron.lm_batches` gives.

    Tuples or lists of tensors are refused rather than guessed at: which tensor is the mask and
    which the labels differs between models, and the default loss calls ``model(**batch)``.
    """
    for i, b in enumerate(batches):
        if not isinstance(b, Mapping):
            what = type(b).__name__
            hint = (" (a single dict was passed as batches: pass a list of them)" if isinstance(b, str) else
                    ": name its tensors, e.g. {'input_ids': ids, 'attention_mask': mask, 'labels': ids}"
                    if isinstance(b, (tuple, list)) else "")
            raise FisherkronError(f"calibration batch {i} is a {what}; batches must be dicts of tensors (e.g. from "
                                  f"fisherkron.lm_batches or fisherkron.classification_batches){hint}")
        bad = next((key for key in b if not isinstance(key, str)), None)
        if bad is not None:
            raise FisherkronError(f"calibration batch {i} has a key {bad!r} that is not a string; batches must be "
                                  f"dicts of named tensors, the arguments of model(**batch)")


def default_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    out = model(**batch)
    if getattr(out, "loss", None) is None:
        raise FisherkronError("the model returned no loss; put 'labels' in the batches or pass loss_fn")
    return out.loss



def _checked(batches, k: int | None, stats, methods, grad_dtype: str, granularity: str) -> tuple[tuple, list]:
    """:func:`collect_calibration`'s arguments checked, each bad one a one-line error: ``(stats, batches)``, the
    statistics to collect (those ``methods`` need where ``stats`` is None, else all) and the first ``k`` batches
    (split into sequences for ``granularity="sequence"``)."""
    if stats is None and methods is not None:
        methods = [methods] if isinstance(methods, str) else list(methods)
        unknown = [m for m in methods if m not in METHOD_STATS]
        if unknown:
            raise FisherkronError(f"method {unknown[0]!r} is unknown; use one of {', '.join(METHOD_STATS)}")
        stats = tuple(s for s in STATS if any(s in METHOD_STATS[m] for m in methods))
    stats = tuple(STATS if stats is None else stats)
    bad = [s for s in stats if s not in STATS]
    if bad:
        raise FisherkronError(f"unknown statistic {bad[0]!r}; choose from {', '.join(STATS)}")
    from ...core.operators import ENCODINGS

    if grad_dtype not in ENCODINGS:
        raise FisherkronError(f"grad_dtype {grad_dtype!r} is unknown; use one of {', '.join(ENCODINGS)}")
    if granularity not in GRANULARITIES:
        raise FisherkronError(f"granularity {granularity!r} is unknown; use one of {', '.join(GRANULARITIES)}")
    if granularity == "token" and grad_dtype != "float32":
        raise FisherkronError("granularity='token' stores the layers' inputs and output gradients in float32; "
                              "leave grad_dtype at 'float32'")
    if isinstance(batches, Mapping):
        raise FisherkronError("batches is one dict; pass a list of dicts of tensors (e.g. from fisherkron.lm_batches)")
    batches = list(batches)
    check_batches(batches)
    if k is not None:
        check_int(k, "k", minimum=1)
        if k > len(batches):
            raise FisherkronError(f"k={k} exceeds the {len(batches)} batches given")
        batches = batches[:k]
    if granularity == "sequence":
        batches = split_sequences(batches)
    if not batches:
        raise FisherkronError("no calibration batches were given")
    return stats, batches


def _cached(root: Path, key: str, whole: str | None, verify_cache: bool) -> CalibrationStats | None:
    """The entry ``root/key`` where it is cached and whole (its files' checksums checked with ``verify_cache``), or
    the unbounded entry ``root/whole`` of the same calibration (``whole``: the key of a bounded collection's
    unbounded twin), which makes ``max_disk`` cost nothing; None where neither is, after removing a damaged
    ``root/key`` (a read-only cache: one line)."""
    final = root / key
    man = read_manifest(final, key, verify_cache)
    if man is not None:
        if (final / OWNER).exists():  # left by an earlier version: a finished entry has no owner
            release_entry(final)
        return CalibrationStats(final, man["layers"], man["k"], key, man["config"],
                                tuple(man["config"]["stats"]), from_cache=True)
    man = read_manifest(root / whole, whole, verify_cache) if whole is not None else None
    if man is not None and not (root / whole / OWNER).exists():
        log.info("the unbounded calibration %s is cached already: it is used, and max_disk costs nothing",
                 root / whole)
        return CalibrationStats(root / whole, man["layers"], man["k"], whole, man["config"],
                                tuple(man["config"]["stats"]), from_cache=True)
    if final.exists():
        try:
            shutil.rmtree(final)
        except OSError as exc:
            raise read_only(root, True, exc.strerror or type(exc).__name__) from None
    return None


@timed("calibration")
def collect_calibration(model: nn.Module, batches, layers=None, *, k: int | None = None, seed: int = 0,
                        stats=None, methods=None, loss_fn=None, loss_name: str | None = None,
                        cache: bool = True, cache_dir=None, grad_dtype: str = "float32",
                        granularity: str = "batch", checkpoint_seconds: float = 300.0,
                        verify_cache: bool = True, progress: bool = False, group=None, max_disk=None,
                        mff_options: dict | None = None) -> CalibrationStats:
    r"""Per-batch gradients ``G_i`` and baseline statistics of the selected linear layers.

    Eq. (8): ``I_F = (1/k) sum_i vec(G_i) vec(G_i)^T`` with ``G_i = dL_i/dW`` the
    gradient of the mean loss of batch ``i`` (one gradient per batch, the
    paper's protocol). See the module docstring for the other statistics.

    Args:
        model: a module whose ``loss_fn(model, batch)`` is a scalar loss
            (default: ``model(**batch).loss``).
        batches: list of dicts of tensors (e.g. from :func:`fisherkron.lm_batches`); anything else (a
            tuple or list of tensors) is refused in one line: name the tensors.
        layers: regex/glob pattern(s) of ``nn.Linear`` names; ``None`` = the paper's layers.
        k: use the first ``k`` batches (default: all).
        seed: recorded in the cache key (the seed that drew the batches).
        stats: subset of ``("grads", "diag_fisher", "abs_mean", "xxt", "kfac")``; default:
            what ``methods`` need, or all of them.
        methods: compression methods to collect for (see ``METHOD_STATS``), e.g. ``("gfwsvd",)``.
        loss_fn: ``loss_fn(model, batch) -> scalar``; default ``model(**batch).loss``. Its code,
            captured values and arguments enter the cache key (:func:`loss_key`); one that
            cannot be described (it captures an object with state) is refused when caching.
        loss_name: a name unique to ``loss_fn``, used in the cache key instead of its description.
        cache: reuse/write ``<cache_dir>/<key>``; ``cache_dir`` defaults to ``data/cache/calibration``.
        verify_cache: check file checksums before reusing a cache entry.
        grad_dtype: how the per-batch gradients are stored: ``"float32"`` (default),
            ``"bfloat16"`` (the authors' choice; half the disk, relative rounding ``2^-8``) or
            ``"float16"`` with a per-gradient scale (half the disk, rounding ``2^-11``); MFF
            reads them back as float32 (:class:`~fisherkron.core.operators.StoredGradients`).
        granularity: what one gradient of Eq. (8) is. ``"batch"`` (the paper's protocol): the
            gradient of each batch's mean loss, ``k`` of them. ``"sequence"``: each batch is
            split into its sequences and every sequence gives one gradient (``k x batch size``
            of them, same tokens). ``"token"``: every kept token ``t`` gives the rank-one
            ``G_t = delta_t x_t^T``; nothing ``n x m`` is stored, only the layer's inputs ``X``
            (``T x m``) and output gradients ``D`` (``T x n``), and MFF runs on
            :class:`~fisherkron.core.operators.TokenFisher`.
        checkpoint_seconds: a cached collection is written into ``<key>.partial/`` and keeps
            its progress there (the batches done and the sums so far) at least this often and
            when it is interrupted (Ctrl-C or SIGTERM: the batch under way is finished first;
            a second signal stops at once). Run the same call again and it resumes from the
            last batch kept, after checking the rows it resumes from (damaged batches are run
            again; see :mod:`fisherkron.hf.calibration.resume`); the folder becomes the cache
            entry when the last batch is done. The gradient files get their disk space up front:
            a full disk is a one-line error at the start. A read-only cache serves the entries
            it holds; collecting a missing one there is refused in one line.
        progress: show a tqdm bar over batches.
        group: a ``torch.distributed`` process group (or ``"auto"``: the default group when
            one is initialised with more than one process; default ``None``: this process
            alone). Every rank passes the same model and batches; batch ``i`` is run on rank
            ``i % world``, which writes its gradients into rows ``i`` of the shared
            ``<layer>.grads.npy``; the other statistics are summed over the ranks
            (``all_reduce``), so every rank returns the global ones. The cache folder must
            be on a filesystem every rank sees; the entry is the same as one process
            writes (up to the round-off of the sums) and is reused by any world size. An
            interrupted collection resumes with the same world size (each rank from its own
            checkpoint); another world size starts again.
        max_disk: a bound on the disk the collection takes, in bytes or a string such as
            ``"20GB"`` (:func:`~.disk.parse_size`): every statistic, MFF's factors and the
            gradients alive at once stay under it. When all gradients do not fit, the layers
            are collected in groups (:mod:`fisherkron.hf.calibration.bounded`): per group the
            ``k`` batches run again (``k x groups`` forward + backward passes), MFF runs on the
            group's gradients and only its factors are kept. The entry then holds the factors
            instead of the gradients; compression reads them through
            :meth:`CalibrationStats.kronecker`, with the same ``mff_options``. A layer whose
            gradients alone cannot fit is refused in one line. When everything fits, the
            collection is the usual one; an unbounded entry already cached is reused.
        mff_options: with ``max_disk``, the options of :func:`fisherkron.mff` the factors are
            computed with (``device`` says where MFF runs); compression must pass the same
            (its ``mff_options``). Ignored without ``max_disk``.

    Returns:
        :class:`CalibrationStats` backed by files (with ``cache=False`` a private folder
        under the cache root, deleted when the object is garbage-collected).
    """
    stats, batches = _checked(batches, k, stats, methods, grad_dtype, granularity)
    k = len(batches)
    names = select_layers(model, layers)
    modules = dict(model.named_modules())
    shapes = {n: (modules[n].out_features, modules[n].in_features) for n in names}

    group = resolve_group(group)
    limit = None if max_disk is None else parse_size(max_disk)
    plan = _disk_plan(limit, names, shapes, batches, stats, grad_dtype, granularity, group)
    config, key = calibration_key(model, batches, names, k=k, seed=seed, stats=stats, grad_dtype=grad_dtype,
                                  granularity=granularity, loss_fn=loss_fn, loss_name=loss_name, cache=cache)
    whole = key  # the unbounded entry of the same calibration, reused when a bounded one is asked for
    if plan is not None:
        config = bounded_config(config, mff_options)
        key = config_key(config)

    root = Path(cache_dir) if cache_dir is not None else data_root() / "cache" / "calibration"
    final = root / key
    if group is not None and (grad_dtype != "float32" or granularity == "token"):
        raise FisherkronError("over a process group the gradients are stored per batch in float32; "
                              "grad_dtype and granularity='token' are single-process options for now")
    check_positive(checkpoint_seconds, "checkpoint_seconds")
    partial = root / f"{key}{PARTIAL_SUFFIX}"
    if group is not None:
        return collect_on_ranks(model, batches, names, modules, shapes, stats, loss_fn or default_loss, progress,
                                 key=key, config=config, root=root, final=final, cache=cache,
                                 verify_cache=verify_cache, group=group, checkpoint_seconds=checkpoint_seconds)
    if cache:  # another process filling this entry: wait for it, then read what it wrote
        wait_for_owner(partial)
    reclaim(root, partial)
    if cache and (found := _cached(root, key, whole if plan is not None else None, verify_cache)) is not None:
        return found
    writable_root(root, cache)

    def write(folder: Path, checkpoint: "Checkpoint | None" = None) -> dict:
        """Collect into ``folder`` and write its manifest; returns the per-layer info."""
        def one(layers, ckpt):
            return _collect(model, batches, layers, modules, shapes, stats, loss_fn or default_loss, folder,
                            progress, grad_dtype=grad_dtype, granularity=granularity, checkpoint=ckpt)

        if plan is None:
            tokens, extra = one(names, checkpoint), None
        else:
            tokens = collect_groups(folder, plan, limit, one, key=key, config=config, k=k, shapes=shapes,
                                    stats=stats, granularity=granularity, grad_dtype=grad_dtype,
                                    mff_options=mff_options,
                                    new_checkpoint=None if checkpoint is None else lambda tag: Checkpoint(
                                        folder, tag, checkpoint_seconds, checkpoint.signals),
                                    signals=None if checkpoint is None else checkpoint.signals)
            extra = {"groups": plan.groups, "passes": k * len(plan.groups)}
        try:
            info = write_manifest(folder, key, config, k, names, shapes, tokens, world_size=1, extra=extra)
            (folder / RECORD).unlink(missing_ok=True)
            return info
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise no_space(folder, None, grad_dtype, keep=checkpoint is not None) from None
            raise

    if not cache:  # a private folder, removed when the returned object is garbage-collected
        try:
            tmp = Path(tempfile.mkdtemp(prefix=temporary_name(f"private-{key[:8]}"), dir=root))
        except PermissionError as exc:
            raise read_only(root, cache, exc.strerror or type(exc).__name__) from None
        try:
            with sigterm_as_interrupt():
                layer_info = write(tmp)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        out = CalibrationStats(tmp, layer_info, k, key, config, stats, from_cache=False)
        weakref.finalize(out, shutil.rmtree, str(tmp), True)
        return out
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(owned(partial, key))
        except OSError as exc:
            raise read_only(root, cache, exc.strerror or type(exc).__name__) from None
        signals = stack.enter_context(deferred_interrupts())
        drop_foreign_progress(partial, 1)
        try:
            layer_info = write(partial, Checkpoint(partial, key, checkpoint_seconds, signals))
        except FisherkronError as exc:  # bad data or a bad argument: nothing of it is kept
            if not (isinstance(exc, NoSpace) and exc.keep):
                shutil.rmtree(partial, ignore_errors=True)
            raise
        seal(partial, final)
    return CalibrationStats(final, layer_info, k, key, config, stats, from_cache=False)


def _disk_plan(max_disk: int | None, names, shapes, batches, stats, grad_dtype: str, granularity: str, group):
    """The groups of a collection under ``max_disk`` bytes (:func:`~.disk.plan_groups`), or ``None`` when it
    is not bounded or everything fits at once (the usual collection then stays under the bound)."""
    if max_disk is None:
        return None
    if group is not None:
        raise FisherkronError("max_disk is a single-process option for now: collect without a process group, or "
                              "without max_disk")
    T = _token_count(batches) if granularity == "token" and "grads" in stats else None
    sizes = {n: layer_disk(*shapes[n], k=len(batches), stats=stats, grad_dtype=grad_dtype, granularity=granularity,
                           tokens=T) for n in names}
    plan = plan_groups(sizes, max_disk)
    if len(plan.groups) == 1:
        log.info("the calibration fits under max_disk=%s (%s at most): collected whole", format_size(max_disk),
                 format_size(plan.peak))
        return None
    return plan


def _token_count(batches) -> int:
    """Tokens the activation hooks will see over ``batches`` (those kept by the attention mask)."""
    total = 0
    for b in batches:
        mask = b.get("attention_mask") if isinstance(b, dict) else None
        if isinstance(mask, torch.Tensor) and mask.dim() == 2:
            total += int(mask.bool().sum())
        else:
            ids = b.get("input_ids") if isinstance(b, dict) else None
            if not isinstance(ids, torch.Tensor):
                raise FisherkronError("granularity='token' needs batches with input_ids (or an attention_mask)")
            total += ids.numel()
    return total


def _collect(model, batches, names, modules, shapes, stats, loss_fn, out: Path, progress: bool,
             grad_dtype: str = "float32", granularity: str = "batch", checkpoint: Checkpoint | None = None):
    """One forward + backward per batch; returns the token count per layer.

    ``grad_dtype``: how the gradients are stored (:class:`~fisherkron.core.operators.StoredGradients`);
    ``granularity="token"`` stores each layer's inputs ``X`` and output gradients ``D`` instead.
    ``checkpoint``: resume from the batches an interrupted run kept (checked first:
    :func:`~.resume.plan_resume`), and keep progress.
    """
    from ...core.operators import ENCODINGS

    k = len(batches)
    per_token = "grads" in stats and granularity == "token"
    T = _token_count(batches) if per_token else None
    layout = {}  # the gradient files: {file: (dtype, shape)}
    if per_token:
        for n in names:
            layout[f"{n}.X.npy"] = (np.float32, (T, shapes[n][1]))  # (T, m)
            layout[f"{n}.D.npy"] = (np.float32, (T, shapes[n][0]))  # (T, n)
    elif "grads" in stats:
        for n in names:
            layout[f"{n}.grads.npy"] = (ENCODINGS[grad_dtype], (k, *shapes[n]))  # (k, n, m)
    state, redo = plan_resume(checkpoint, layout, list(range(k)), per_token, names)
    done = state["done"] if state is not None else 0
    if state is not None:
        log.warning("resuming the calibration in %s at batch %d of %d", out, done, k)
    rows = state["rows"] if state is not None else Rows()
    try:
        return _fill(model, batches, names, modules, stats, loss_fn, out, progress, grad_dtype, layout, state, redo,
                     rows, checkpoint, T)
    except NoSpace as exc:
        if state is not None and not exc.keep:
            raise NoSpace(str(exc), keep=True) from None
        raise
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):  # a statistic or a checkpoint that did not fit
            raise no_space(out, None, grad_dtype, keep=checkpoint is not None
                           and checkpoint.path.exists()) from None
        raise


def _fill(model, batches, names, modules, stats, loss_fn, out: Path, progress: bool, grad_dtype: str,
          layout: dict, state, redo: dict, rows: Rows, checkpoint: Checkpoint | None, T: int | None):
    """:func:`_collect`'s work: open (or create and reserve) the gradient files, repair, run the batches."""
    from ...core.operators import encode_gradient

    k = len(batches)
    done = state["done"] if state is not None else 0
    mms, fresh = {}, set()
    for file, (dtype, shape) in layout.items():
        mms[file], created = open_rows(out / file, dtype, shape, keep=state is not None)
        if created:
            fresh.add(out / file)
            rows.forget(file)
    preallocate(out, [out / f for f in layout], fresh, grad_dtype)
    scales = {}
    if grad_dtype == "float16" and "grads" in stats:
        for n in names:
            scales[n] = np.ones(k)
            kept = (state or {}).get("scales", {}).get(n)
            if kept is not None:
                scales[n][:done] = kept.numpy()[:done]
    offset = {(kind, n): (state["tokens"][n] if state is not None else 0) for n in names for kind in "XD"} \
        if T is not None else {}

    def store(n: str, i: int, G: torch.Tensor, only=None) -> None:
        file = f"{n}.grads.npy"
        if file in mms and (only is None or i in only.get(file, ())):
            enc, scale = encode_gradient(G, grad_dtype)  # (n, m)
            mms[file][i] = enc
            rows.record(file, i, i + 1, enc)
            if n in scales:
                scales[n][i] = scale

    def store_rows(kind: str, n: str, r: torch.Tensor) -> None:
        file, at = f"{n}.{kind}.npy", offset[(kind, n)]
        mm = mms[file]
        if at + r.shape[0] > mm.shape[0]:
            raise FisherkronError(f"layer {n} saw more tokens than the batches' attention masks count; "
                                  f"granularity='token' needs one row per kept token")
        data = r.cpu().numpy()
        mm[at:at + r.shape[0]] = data
        rows.record(file, at, at + r.shape[0], data)
        offset[(kind, n)] = at + r.shape[0]

    def after_batch(i: int, acc, tokens) -> None:
        if checkpoint is None or not checkpoint.due():
            return
        for mm in mms.values():
            mm.flush()
        checkpoint.save(i + 1, acc, tokens, rows, scales)
        if checkpoint.signals.pending is not None:
            raise KeyboardInterrupt(f"calibration stopped after batch {i + 1} of {k}; its progress is kept in "
                                    f"{out}: run the same call again to resume")

    try:
        if redo:  # the damaged rows of batches done before: their gradients again, nothing added to the sums
            again = sorted(set().union(*redo.values()))
            accumulate(model, batches, again, names, modules, ("grads",), loss_fn,
                       lambda n, i, G: store(n, i, G, only=redo), False)
        acc, tokens = accumulate(model, batches, range(done, k), names, modules, stats, loss_fn, store, progress,
                                  store_rows=store_rows if T is not None else None,
                                  acc=state["acc"] if state is not None else None,
                                  tokens=state["tokens"] if state is not None else None,
                                  after_batch=after_batch, total=k)
    finally:
        for mm in mms.values():
            mm.flush()
        mms.clear()
    short = [key for key, at in offset.items() if at != T]
    if short:
        raise FisherkronError(f"layer {short[0][1]} saw {offset[short[0]]} of {T} tokens ({short[0][0]}); "
                              f"granularity='token' needs every kept token")
    for file in layout:  # every row written in this run or checked from an earlier one: none is sealed as zeros
        rows.require(out, file, **({"total": T} if T is not None else {"starts": range(k)}))
    if scales:
        for n, sc in scales.items():
            np.save(out / f"{n}.grad_scales.npy", sc)
    save_statistics(acc, tokens, k, names, stats, out)
    return tokens
