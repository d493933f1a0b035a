"""What a training run guarantees, for the two trainers of paper Sec. 6.4 (learned truncation, LoRA recovery).

:func:`~fisherkron.hf.truncation.train_truncation` and :func:`~fisherkron.hf.recovery.recover`
share these helpers, so a run of either behaves the same way when something goes wrong:

* **Non-finite steps stop the run with the model as it was.** :func:`check_finite` raises
  :class:`NonFiniteTraining` at the step where the loss, a gradient or a trained parameter
  stops being finite (it names the step, the loss and what to try); the trainers then put the
  model back as it was before the call.
* **Learning rates are checked before any work.** :func:`check_rates` refuses a schedule whose
  final rate exceeds its initial one (it would anneal upward).
* **Checkpoints are written whole.** :func:`save_checkpoint` writes a temporary file and renames
  it into place, so the file is the whole new state or the earlier one; :func:`load_checkpoint`
  resumes only the run whose configuration hashes to the same key (:func:`config_key`).
* **Stale temporaries are reclaimed and unwritable folders refused up front.**
  :func:`prepare_checkpoint` removes the temporaries of writers killed outright and probes the
  folder before the run changes anything, so an unwritable folder is a one-line error then,
  not at the first checkpoint.
* **Signals are held during a step or a write.** Inside :func:`uninterrupted` (an optimiser
  step, a checkpoint write, the model put back) Ctrl-C and SIGTERM wait until the block is done;
  :func:`save_on_interrupt` keeps the state when a run is interrupted between steps.

Both trainers also draw their micro-batches the same way (:func:`batch_index`: each epoch a
seeded permutation, so a resumed run sees what the uninterrupted one saw).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import signal
import tempfile
import threading
from collections.abc import Mapping
from pathlib import Path

import torch

from ..core.checks import check_positive
from ..core.conventions import FisherkronError
from ..env import atomic_write, remove_stale_temporaries, temporary_name

__all__ = ["NonFiniteTraining", "check_rates", "first_nonfinite", "check_finite", "config_key", "prepare_checkpoint",
           "save_checkpoint", "save_on_interrupt", "load_checkpoint", "uninterrupted", "batch_index", "to_device",
           "check_batches"]

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- non-finite steps and learning rates

class NonFiniteTraining(FisherkronError):
    """A training run met a NaN or an infinity (loss, gradient or trained parameter) and stopped at that step."""


def check_rates(lr: float, min_lr: float) -> None:
    """Refuse a schedule whose final rate ``min_lr`` exceeds its initial rate ``lr`` (it would anneal upward).

    >>> check_rates(5.0, 4.0)  # Dobi-SVD's cosine from 5 down to 4
    >>> check_rates(1e-4, 1e-3)
    Traceback (most recent call last):
    ...
    fisherkron.core.errors.FisherkronError: min_lr=0.001 (the final learning rate) exceeds lr=0.0001 (the initial one), so the rate would anneal upward; pass min_lr <= lr
    """
    check_positive(lr, "lr")
    check_positive(min_lr, "min_lr", zero_ok=True)
    if min_lr > lr:
        raise FisherkronError(f"min_lr={min_lr:g} (the final learning rate) exceeds lr={lr:g} (the initial one), "
                              f"so the rate would anneal upward; pass min_lr <= lr")


def first_nonfinite(tensors: Mapping[str, torch.Tensor | None]) -> str | None:
    """The name of the first tensor holding a NaN or an infinity; ``None`` when all are finite (one sync).

    >>> first_nonfinite({"a": torch.ones(2), "b": torch.tensor([1.0, float("inf")]), "c": None})
    'b'
    """
    named = [(n, t.detach()) for n, t in tensors.items() if t is not None]
    if not named:
        return None
    device = named[0][1].device
    finite = torch.stack([torch.isfinite(t).all().to(device) for _, t in named])  # (len(named),)
    if bool(finite.all()):
        return None
    return named[int((~finite).nonzero()[0])][0]


def check_finite(what: str, step: int, total: int, loss: float, tensors: Mapping | None = None, *,
                 kind: str = "gradient", advice: str = "") -> None:
    """Stop a training run at the step where a NaN or an infinity appears.

    Raises :class:`NonFiniteTraining` naming step ``step + 1`` of ``total`` and the loss when ``loss``
    is not finite, or when one of ``tensors`` is not: the gradients before the update
    (``kind="gradient"``) or the trained parameters after it (``kind="parameter"``). The callers
    put the model back as it was before the call; ``advice`` says what to try.
    """
    if not math.isfinite(loss):
        why = f"the loss is {loss}"
    else:
        name = first_nonfinite(tensors or {})
        if name is None:
            return
        why = (f"the gradient of {name} is not finite" if kind == "gradient" else
               f"{name} is not finite after the update") + f" (loss {loss:.6g})"
    raise NonFiniteTraining(f"{what} stopped at step {step + 1} of {total}: {why}; the model is left as it was "
                            f"before the call. {advice}")


# ----------------------------------------------------------------------------- checkpoints

def config_key(config: dict) -> str:
    """A hash of a run's configuration (JSON): a checkpoint resumes only the run it belongs to."""
    return hashlib.blake2b(json.dumps(config, sort_keys=True, default=str).encode(), digest_size=16).hexdigest()


def prepare_checkpoint(path: Path | None) -> None:
    """Make ready the folder of checkpoint file ``path`` before a run changes anything.

    Creates the folder, removes the temporaries that a writer killed outright (SIGKILL, a crash)
    left there (:func:`fisherkron.env.remove_stale_temporaries`: only those whose process is gone),
    and writes and removes a probe file, so that a folder the run can not write to is a one-line
    error now, not at the first checkpoint.
    """
    if path is None:
        return
    if path.is_dir():
        raise FisherkronError(f"checkpoint={path} is a folder; pass a file in it, e.g. {path / 'checkpoint.pt'}")
    folder = path.parent
    try:
        folder.mkdir(parents=True, exist_ok=True)
        count, freed = remove_stale_temporaries(folder)
        fd, probe = tempfile.mkstemp(prefix=temporary_name(path.stem), suffix=".probe", dir=folder)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise FisherkronError(f"cannot write checkpoints in {folder} ({exc.strerror or exc}); nothing was changed. "
                              f"Make the folder writable, or pass checkpoint= a file in a writable folder") from None
    if count:
        log.info("removed %d temporary file(s) of dead processes from %s (%d bytes)", count, folder, freed)


def save_checkpoint(path: Path, state: dict) -> None:
    """Write ``state`` to ``path`` atomically (a temporary file renamed into place).

    Ctrl-C and SIGTERM wait until the write is done (:func:`uninterrupted`), so the file is the
    whole new state or the earlier one and no temporary is left behind; a failed write is a
    one-line error naming the folder.
    """
    with uninterrupted():
        try:
            atomic_write(path, lambda t: torch.save(state, t))
        except OSError as exc:
            raise FisherkronError(f"cannot write the checkpoint {path} ({exc.strerror or exc}); free space in "
                                  f"{path.parent} or make it writable, or pass checkpoint= a file elsewhere") from None


def save_on_interrupt(path: Path | None, state, what: str, step: int, total: int) -> None:
    """On Ctrl-C / SIGTERM: keep the training state ``state()`` at ``path``; a failed write is logged, not raised
    (the interruption goes on)."""
    if path is None:
        return
    try:
        save_checkpoint(path, state())
    except FisherkronError as exc:
        log.warning("%s interrupted at step %d of %d; the state could not be kept: %s", what, step, total, exc)
        return
    log.warning("%s interrupted at step %d of %d; the state is in %s (run again to resume)", what, step, total, path)


def load_checkpoint(path: Path | None, key: str, what: str) -> dict | None:
    """The checkpoint at ``path`` if it belongs to the run with ``key``; ``None`` when there is none."""
    if path is None or not path.exists():
        return None
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unreadable file is the same one-line error
        raise FisherkronError(f"{path} is not a readable {what} checkpoint ({type(exc).__name__}); "
                              f"delete it to start the run again") from None
    if not isinstance(state, dict) or state.get("key") != key:
        raise FisherkronError(f"{path} is the checkpoint of another {what} run (its configuration differs); "
                              f"delete it, or pass another checkpoint= path")
    return state


# ----------------------------------------------------------------------------- signals

@contextlib.contextmanager
def uninterrupted():
    """Ctrl-C and SIGTERM wait until the block is done (an optimiser step, a checkpoint write, the model put
    back: whole or not at all).

    While the block runs, a handler notes each signal instead of acting (masking the signal would not
    do: the kernel hands a process-wide signal to any thread that does not mask it, e.g. one of
    torch's); afterwards the earlier handlers are back and the first signal noted is raised again, so it
    acts as it would have: ``KeyboardInterrupt`` for Ctrl-C and, under
    :func:`~fisherkron.env.sigterm_as_interrupt`, for SIGTERM. Only the main thread can install handlers;
    elsewhere the block runs unchanged.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []

    def note(signum, frame):
        pending.append(signum)

    old = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    old = {sig: h for sig, h in old.items() if h is not None}  # None: a handler not set from Python, left alone
    for sig in old:
        signal.signal(sig, note)
    try:
        yield
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)
        if pending:
            signal.raise_signal(pending[0])


# ----------------------------------------------------------------------------- data

def batch_index(j: int, n: int, seed: int) -> int:
    """Which of ``n`` batches is micro-batch ``j``: epoch ``j // n`` visits all in a seeded random order.

    >>> sorted(batch_index(j, 4, seed=0) for j in range(4)), sorted(batch_index(j, 4, seed=0) for j in range(4, 8))
    ([0, 1, 2, 3], [0, 1, 2, 3])
    """
    epoch, pos = divmod(j, n)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
    return int(order[pos])


def to_device(batch: Mapping, device) -> dict:
    """The batch with its tensors moved to ``device`` (other values as they are)."""
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def check_batches(batches) -> list:
    """``batches`` as a list, refused unless it is a non-empty list of dicts (one-line error)."""
    batches = list(batches)
    if not batches or not all(isinstance(b, Mapping) for b in batches):
        raise FisherkronError("batches must be a non-empty list of dicts of tensors (e.g. from lm_batches)")
    return batches
