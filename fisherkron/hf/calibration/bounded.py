r"""Calibration under a bound on disk (``max_disk``): the layers in groups, their gradients replaced by MFF's factors.

Eq. (8) keeps ``k`` gradients ``G_i`` (``n x m``) per layer, ``k x sum(n m)`` entries for the
model: 6.8 GB in bfloat16 for SmolLM2-135M at ``k = 32``, about 1 TB for Llama-2-7B at ``k = 75``.
Under a bound the selected layers are split into consecutive groups (:func:`~.disk.plan_groups`),
and for each group in turn

1. the ``k`` batches run (forward + backward), storing that group's gradients and statistics only;
2. Algorithm 1 (MFF) runs for each of its layers and its ``A``, ``B`` go to ``mff/``, where
   :meth:`~.entry.CalibrationStats.kronecker` reads them (for its default ``init="kfac"`` and the
   ``mff_options`` given here: compression must pass the same);
3. the group's gradients are deleted and its layers recorded as done (``bounded.json``, with the
   size and checksum of every file they keep).

The statistics and factors equal an unbounded collection's bit for bit on the same machine:
each layer sees the same batches in the same order, and its gradient is the same product
(other weights not requiring a gradient change which products backward computes, not their
values), so MFF reads the same numbers. The cost is compute: each group runs the ``k`` forward
passes again (backward stops at the group's first layer), ``k x groups`` passes in all.

Interrupted (Ctrl-C, SIGTERM), the collection keeps the finished groups, the factors of the group
under way and its checkpoint (:mod:`.resume`); the same call resumes there. A finished layer whose
files no longer have their recorded size and checksum is collected again, with a warning.
"""
from __future__ import annotations

import hashlib
import json
import logging
import shutil
from collections.abc import Callable
from pathlib import Path

from ...env import atomic_write, file_checksum
from .disk import DiskPlan, format_size, gradient_files, plan_groups
from .entry import CalibrationStats, mff_settings
from .folders import NoSpace, no_space

__all__ = ["RECORD", "bounded_config", "collect_groups", "folder_bytes"]

log = logging.getLogger(__name__)

#: the layers a bounded collection has finished, with the size and checksum of each file they keep
RECORD = "bounded.json"
#: the files of a layer that hold its gradients (never in a finished bounded entry)
_GRADIENT_SUFFIXES = (".grads.npy", ".grad_scales.npy", ".X.npy", ".D.npy")
#: the statistics a layer keeps (:func:`~.accumulate.save_statistics`)
_STAT_FILES = ("diag_fisher", "abs_mean", "xxt", "ddt")


def bounded_config(config: dict, mff_options: dict | None) -> dict:
    """The configuration of a bounded entry: ``config`` and the MFF options its factors are computed with.

    ``device`` is left out (it does not change the factors). The gradients an unbounded entry keeps
    are absent here, so the two have different keys.
    """
    opts = {k: v for k, v in sorted(mff_settings(mff_options).items()) if k != "device"}
    return {**config, "bounded": {"init": "kfac", "mff_options": json.loads(json.dumps(opts, default=str))}}


def folder_bytes(folder: Path) -> int:
    """Bytes of the files under ``folder`` (what a bounded collection keeps under its bound)."""
    total = 0
    for f in folder.rglob("*"):
        try:
            if f.is_file():
                total += f.stat().st_size
        except OSError:
            continue
    return total


def _read_record(out: Path, key: str) -> dict[str, dict]:
    """The finished layers of an interrupted bounded collection in ``out`` whose files still pass their checks."""
    f = out / RECORD
    if not f.exists():
        return {}
    try:
        rec = json.loads(f.read_text())
        if rec.get("key") != key:
            return {}
        layers = dict(rec["layers"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("%s is unreadable (%s); collecting every layer again", f, exc)
        return {}
    done = {}
    for name, meta in layers.items():
        try:
            bad = next((fn for fn, m in meta["files"].items()
                        if not (out / fn).is_file() or (out / fn).stat().st_size != m["size"]
                        or file_checksum(out / fn) != m["hash"]), None)
            tokens = int(meta["tokens"])
        except (OSError, KeyError, TypeError, ValueError, AttributeError):
            bad, tokens = RECORD, None
        if bad is None:
            done[name] = {"tokens": tokens, "files": meta["files"]}
        else:
            log.warning("%s: %s of layer %s is missing or changed since it was finished; collecting the layer "
                        "again", out, bad, name)
    return done


def _remove_gradients(out: Path, keep: set[str]) -> None:
    """Delete the gradient files in ``out`` other than ``keep`` (of a finished group, or of another plan)."""
    for f in out.glob("*.npy"):
        if f.name.endswith(_GRADIENT_SUFFIXES) and f.name not in keep:
            f.unlink(missing_ok=True)


def _stop_if_asked(signals, out: Path, where: str) -> None:
    if signals is not None and signals.pending is not None:
        raise KeyboardInterrupt(f"calibration stopped {where}; its progress is kept in {out}: run the same call "
                                f"again to resume")


def collect_groups(out: Path, plan: DiskPlan, max_disk: int, collect_group: Callable, *, key: str, config: dict,
                   k: int, shapes: dict, stats, granularity: str, grad_dtype: str, mff_options: dict | None = None,
                   new_checkpoint: Callable | None = None, signals=None) -> dict[str, int]:
    """Collect ``plan``'s groups into ``out`` one after the other; returns the token count per layer.

    A resumed collection plans the layers left (:func:`~.disk.plan_groups` with the layers done
    on disk already): with the same layers done the groups are the same, and the group under way
    resumes from its checkpoint.

    ``collect_group(names, checkpoint)`` runs the ``k`` batches for the layers ``names`` and writes
    their gradients and statistics into ``out`` (returns their token counts);
    ``new_checkpoint(tag)`` gives the :class:`~.resume.Checkpoint` of one group (``None``: no
    checkpoints, an uncached collection); ``signals``: the pending Ctrl-C / SIGTERM, checked between
    layers' MFF and between groups. ``mff_options``: :func:`fisherkron.mff`'s options (``device``
    says where it runs).
    """
    opts = mff_settings(mff_options)
    device = opts.pop("device", None)
    done = _read_record(out, key)
    if done:
        log.warning("resuming the bounded calibration in %s: %d of %d layers are done", out, len(done),
                    len(plan.sizes))
        plan = plan_groups(plan.sizes, max_disk, done=done)
    try:
        free = shutil.disk_usage(out).free
    except OSError:
        free = None
    need = plan.peak - folder_bytes(out)
    if free is not None and need > free:
        raise no_space(out, need, grad_dtype, keep=bool(done))
    tokens = {n: meta["tokens"] for n, meta in done.items()}
    total = len(plan.groups)
    log.info("bounded calibration in %s: %d groups of layers (left), %d forward + backward passes (k = %d per "
             "group), peak %s on disk", out, total, k * total, k, format_size(plan.peak))
    for g, group in enumerate(plan.groups, 1):
        mine = {f for n in group for f in gradient_files(n, granularity)}
        _remove_gradients(out, keep=mine)
        tag = hashlib.blake2b(json.dumps(group).encode(), digest_size=8).hexdigest()
        checkpoint = new_checkpoint(f"{key}:group-{tag}") if new_checkpoint is not None else None
        try:
            got = collect_group(group, checkpoint)
        except NoSpace as exc:
            if done and not exc.keep:
                raise NoSpace(str(exc), keep=True) from None
            raise
        tokens.update({n: got[n] for n in group})
        info = {n: {"n": shapes[n][0], "m": shapes[n][1], "tokens": tokens[n]} for n in group}
        working = {c: v for c, v in config.items() if c != "bounded"}  # its gradients are still here
        st = CalibrationStats(out, info, k, key, working, tuple(stats))
        for n in group:
            st.kronecker(n, device=device, **opts)
            _stop_if_asked(signals, out, f"after MFF of layer {n} (group {g} of {total})")
        for n in group:
            keep = [f"{n}.{s}.npy" for s in _STAT_FILES if (out / f"{n}.{s}.npy").exists()]
            keep.append(st.factors_file(n, **opts)[0].relative_to(out).as_posix())
            done[n] = {"tokens": tokens[n], "files": {fn: {"size": (out / fn).stat().st_size,
                                                           "hash": file_checksum(out / fn)} for fn in keep}}
        atomic_write(out / RECORD, lambda t: Path(t).write_text(json.dumps({"key": key, "layers": done})))
        _remove_gradients(out, keep=set())
        for f in out.glob("progress*.pt"):
            f.unlink(missing_ok=True)
        log.info("calibration group %d of %d done (%d layers)", g, total, len(group))
        if g < total:
            _stop_if_asked(signals, out, f"after group {g} of {total}")
    (out / RECORD).unlink(missing_ok=True)
    return tokens
