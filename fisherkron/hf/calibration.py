r"""Calibration statistics of linear layers (paper Sec. 4-5 "Factor estimation", Sec. 6.3 protocol).

For every selected ``nn.Linear`` (``y = W x``, ``W`` is ``n x m``) and ``k``
calibration batches, one pass of forward + backward per batch records

* ``G_i = dL_i / dW`` (``n x m``), the per-batch weight gradient of Eq. (8)
  ``I_F = (1/k) sum_i vec(G_i) vec(G_i)^T`` -- written to ``<layer>.grads.npy``
  of shape ``(k, n, m)`` float32, opened with mmap by :func:`fisherkron.mff`, so
  at most one layer's ``k`` gradients are in RAM while it is factorised;
* the diagonal Fisher ``E[G o G] = (1/k) sum_i G_i o G_i`` (``n x m``; FWSVD);
* ``mean_t |x_t|`` (``m``; ASVD) and ``X X^T = sum_t x_t x_t^T`` (``m x m``; SVD-LLM);
* the K-FAC factors ``A = X X^T / T`` and ``B = (1/k) sum_t delta_t delta_t^T``
  (``delta = dL/dy``), the warm start of MFF.

With ``grad_dtype`` the gradients are stored in 16 bits; with ``granularity="sequence"``
every sequence gives one gradient, with ``"token"`` every token's rank-one ``delta_t x_t^T``
(only the inputs ``X`` and output gradients ``D`` are stored). A cached collection keeps its
progress in ``<key>.partial/`` and resumes after an interruption.

Tokens masked out by ``attention_mask`` are left out of the activation
statistics. Results are cached on disk under a key of (model weights and
config, data, layers, k, seed, code version); a cache entry is used only if
its manifest matches that key and every file's checksum, otherwise it is
recomputed.
"""
from __future__ import annotations

import contextlib
import difflib
import functools
import fnmatch
import hashlib
import json
import logging
import math
import os
import re
import shutil
import sys
import tempfile
import time
import types
import weakref
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from tqdm.auto import tqdm

from ..core.checks import check_int, check_positive
from ..core.conventions import FisherkronError
from ..core.distributed import (all_or_none, all_reduce_, broadcast_int, broadcast_object, rank_of, resolve_group,
                                world_of)
from ..core.kfac import KFACFactors
from ..core.methods import METHODS
from ..env import (atomic_directory, atomic_write, data_root, file_checksum, remove_stale_temporaries, sigterm_as_interrupt,
                   temporary_name)
from .registry import DEFAULT_LAYERS

__all__ = ["select_layers", "collect_calibration", "CalibrationStats", "CODE_VERSION", "METHOD_STATS", "GRANULARITIES",
           "split_sequences"]

log = logging.getLogger(__name__)

CODE_VERSION = "calibration-1"  # bump when the meaning of a cached file changes
STATS = ("grads", "diag_fisher", "abs_mean", "xxt", "kfac")
#: what one gradient of Eq. (8) is: a batch's (the paper's), a sequence's, or a token's (rank one)
GRANULARITIES = ("batch", "sequence", "token")
# what each compression method reads; K-FAC (the MFF warm start) and X X^T cost
# about as much as the forward + backward pass itself, so collect only what is used
METHOD_STATS = {**{name: m.needs for name, m in METHODS.items()}, "kfac": ("kfac",)}


def _linear_names(model: nn.Module) -> list[str]:
    return [name for name, mod in model.named_modules() if isinstance(mod, nn.Linear)]


def _default_pattern(model: nn.Module) -> str:
    mtype = getattr(getattr(model, "config", None), "model_type", "")
    if mtype in ("bert", "roberta", "distilbert", "electra"):
        return DEFAULT_LAYERS["encoder"]
    return DEFAULT_LAYERS["decoder"]


def _matches(pattern: str, name: str) -> bool:
    if fnmatch.fnmatchcase(name, pattern):
        return True
    try:
        return re.fullmatch(pattern, name) is not None
    except re.error:
        return False


def select_layers(model: nn.Module, layers=None) -> list[str]:
    """Names of the ``nn.Linear`` modules matched by ``layers``.

    ``layers``: a regex (full match) or glob pattern, a list of them, or
    ``None`` for the paper's choice (all linear layers of the transformer
    blocks). A pattern that matches nothing raises a one-line error listing the
    nearest linear-layer names.

    >>> m = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    >>> select_layers(m, "*"), select_layers(m, r"\\d")
    (['0', '2'], ['0', '2'])
    """
    patterns = [_default_pattern(model)] if layers is None else \
        [layers] if isinstance(layers, str) else list(layers)
    names = _linear_names(model)
    chosen: list[str] = []
    for p in patterns:
        hit = [n for n in names if _matches(p, n)]
        if not hit:
            near = difflib.get_close_matches(p, names, n=3, cutoff=0.0) or names[:3]
            raise FisherkronError(f"layer pattern {p!r} matches no nn.Linear; nearest layers: "
                                  f"{', '.join(near) or '(model has no nn.Linear)'}")
        chosen += [n for n in hit if n not in chosen]
    return [n for n in names if n in chosen]  # model order


@dataclass
class CalibrationStats:
    """Per-layer statistics on disk (``dir``); arrays are loaded on request.

    Attributes:
        dir: cache folder holding ``manifest.json`` and one file per layer and statistic.
        layers: ``{name: {"n": n, "m": m, "tokens": T}}``.
        k: number of batches (= gradients per layer).
        key: the cache key; ``config`` what it was computed from.
        from_cache: whether this object was read from an existing cache entry.
    """

    dir: Path
    layers: dict[str, dict]
    k: int
    key: str
    config: dict
    stats: tuple[str, ...]
    from_cache: bool = False

    def _file(self, name: str, stat: str) -> Path:
        if name not in self.layers:
            near = difflib.get_close_matches(name, list(self.layers), n=3, cutoff=0.0)
            raise FisherkronError(f"layer {name} has no calibration statistics; nearest: {', '.join(near)}")
        return self.dir / f"{name}.{stat}.npy"

    def _need(self, stat: str) -> None:
        have = set(self.stats) | ({"xxt"} if "kfac" in self.stats else set())
        if stat not in have:
            raise FisherkronError(f"statistic {stat!r} was not collected; pass stats including it "
                                  f"to collect_calibration")

    def grads_path(self, name: str) -> Path:
        """``.npy`` file of the ``(k, n, m)`` per-batch gradients ``G_i`` (float32, or the ``grad_dtype``
        encoding: read it through :meth:`gradients`; absent for ``granularity="token"``)."""
        self._need("grads")
        return self._file(name, "grads")

    @property
    def grad_dtype(self) -> str:
        return self.config.get("grad_dtype", "float32")

    @property
    def granularity(self) -> str:
        return self.config.get("granularity", "batch")

    def grads(self, name: str) -> np.ndarray:
        """Memory-mapped ``(k, n, m)`` float32 gradients ``G_i`` (see :meth:`gradients` for other encodings)."""
        if self.grad_dtype != "float32" or self.granularity == "token":
            raise FisherkronError(f"these gradients are stored as {self.grad_dtype} ({self.granularity}); "
                                  f"read them with stats.gradients(name)")
        return np.load(self.grads_path(name), mmap_mode="r")

    def gradients(self, name: str):
        """What :func:`fisherkron.mff` reads for layer ``name``: the stored gradients
        (:class:`~fisherkron.core.operators.StoredGradients`), or for ``granularity="token"`` the
        :class:`~fisherkron.core.operators.TokenFisher` of its inputs and output gradients."""
        from ..core.operators import StoredGradients, TokenFisher

        self._need("grads")
        if self.granularity == "token":
            return TokenFisher(self._load(name, "X"), self._load(name, "D"), name=name)
        scales = tuple(float(x) for x in self._load(name, "grad_scales")) if self.grad_dtype == "float16" else None
        return StoredGradients(str(self.grads_path(name)), self.grad_dtype, scales)

    def _load(self, name: str, stat: str) -> torch.Tensor:
        f = self._file(name, stat)
        try:
            return torch.from_numpy(np.load(f))
        except (OSError, ValueError, EOFError) as exc:
            raise FisherkronError(f"{f} is not a readable .npy array ({exc}); delete {self.dir} and "
                                  f"collect the calibration again") from None

    def check_weights(self, name: str, module: nn.Module) -> None:
        """Raise if ``module`` is not the layer the statistics of ``name`` were collected on."""
        want = self.layers.get(name, {}).get("weights")
        if want is not None and layer_fingerprint(module) != want:
            raise FisherkronError(f"the calibration statistics of layer {name} were collected on other weights "
                                  f"(another model, or this one changed since); collect them for this model")

    def diag_fisher(self, name: str) -> torch.Tensor:
        """``E[G o G]`` (``n x m``): the diagonal empirical Fisher (FWSVD)."""
        self._need("diag_fisher")
        return self._load(name, "diag_fisher")

    def input_abs_mean(self, name: str) -> torch.Tensor:
        """``mean_t |x_t|`` (``m``), ASVD's activation scale."""
        self._need("abs_mean")
        return self._load(name, "abs_mean")

    def xxt(self, name: str) -> torch.Tensor:
        """``X X^T = sum_t x_t x_t^T`` (``m x m``, float64), SVD-LLM's whitening Gram matrix."""
        self._need("xxt")
        return self._load(name, "xxt")

    def kronecker(self, name: str, *, init: str = "kfac", device=None, group=None, **mff_options) -> dict:
        """MFF's ``A (x) B`` of layer ``name`` (Algorithm 1), computed once and kept beside the statistics.

        ``init="kfac"`` starts from the layer's K-FAC factors when they were collected (else
        from MFF's default start). The result (``A``, ``B``, ``fisher_share``, ``matvecs``,
        ``converged``) is cached in ``<dir>/mff/`` under a key of the options, written
        atomically and recomputed if it cannot be read.

        ``group``: data-parallel MFF (see :func:`fisherkron.mff`): every rank of the process
        group calls this; rank ``p`` reads the gradients of its batches ``i % world == p``,
        every rank returns the same factors, and rank 0 writes them to the same cache file
        as one process would (the group is not part of the key).
        """
        self._need("grads")
        start = self.kfac(name) if init == "kfac" and "kfac" in self.stats else None
        opts = {k: mff_options[k] for k in sorted(mff_options)}
        tag = hashlib.blake2b(json.dumps([init if start is not None else "identity", opts], default=str)
                              .encode(), digest_size=8).hexdigest()
        f = self.dir / "mff" / f"{name}.{tag}.pt"
        group = resolve_group(group)
        if group is not None:
            return self._kronecker_on_ranks(name, f, start, device, group, mff_options)
        if f.exists():
            try:
                return torch.load(f, weights_only=True)
            except Exception as exc:  # noqa: BLE001 - any unreadable cache file is recomputed
                log.warning("cached MFF factors %s are unreadable (%s); recomputing", f, exc)
        from ..core.factorization import mff

        res = mff(self.gradients(name), init=start, device=device, name=name, **mff_options)
        out = {"A": res.A.cpu(), "B": res.B.cpu(), "fisher_share": float(res.fisher_share),
               "matvecs": int(res.matvecs), "converged": bool(res.converged)}
        try:
            atomic_write(f, lambda t: torch.save(out, t))
        except OSError as exc:  # a read-only cache still works, only slower
            log.warning("could not keep the MFF factors in %s (%s)", f.parent, exc)
        return out

    def _kronecker_on_ranks(self, name: str, f: Path, start, device, group, mff_options: dict) -> dict:
        """:meth:`kronecker` over a process group: rank 0 decides whether ``f`` is reused, all ranks run MFF."""
        from ..core.factorization import mff

        rank, world = rank_of(group), world_of(group)
        cached = None
        if rank == 0 and f.exists():
            try:
                cached = torch.load(f, weights_only=True)
            except Exception as exc:  # noqa: BLE001 - any unreadable cache file is recomputed
                log.warning("cached MFF factors %s are unreadable (%s); recomputing", f, exc)
        if broadcast_int(cached is not None, group):
            with all_or_none(group, f"reading the MFF factors of {name}"):
                out = cached if rank == 0 else torch.load(f, weights_only=True)
            return out
        local = None
        if self.grad_dtype != "float32" or self.granularity == "token":
            raise FisherkronError(f"data-parallel MFF reads float32 per-batch gradients; these are "
                                  f"{self.grad_dtype} ({self.granularity}): run MFF in one process")
        with all_or_none(group, f"reading the gradients of {name}"):
            local = np.load(self.grads_path(name), mmap_mode="r")[rank::world]  # (k_p, n, m): this rank's batches
        res = mff(local, init=start, device=device, name=name, group=group, **mff_options)
        out = {"A": res.A.cpu(), "B": res.B.cpu(), "fisher_share": float(res.fisher_share),
               "matvecs": int(res.matvecs), "converged": bool(res.converged)}
        if rank == 0:
            try:
                atomic_write(f, lambda t: torch.save(out, t))
            except OSError as exc:  # a read-only cache still works, only slower
                log.warning("could not keep the MFF factors in %s (%s)", f.parent, exc)
        return out

    def kfac(self, name: str) -> KFACFactors:
        """K-FAC ``A = X X^T / T`` (``m x m``) and ``B = (1/k) sum_t delta_t delta_t^T`` (``n x n``)."""
        self._need("kfac")
        A = self.xxt(name) / self.layers[name]["tokens"]
        return KFACFactors(A, self._load(name, "ddt") / self.k)


# ----------------------------------------------------------------------------- cache

def _tensor_bytes(t: torch.Tensor) -> bytes:
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        t = t.float()
    return t.numpy().tobytes()


def model_fingerprint(model: nn.Module) -> str:
    """Hash of the model class, config and every parameter and buffer (weights decide the gradients)."""
    h = hashlib.blake2b(digest_size=20)
    h.update(type(model).__name__.encode())
    cfg = getattr(model, "config", None)
    if cfg is not None and hasattr(cfg, "to_json_string"):
        h.update(cfg.to_json_string(use_diff=False).encode())
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        h.update(name.encode())
        h.update(str(tuple(t.shape)).encode())
        h.update(_tensor_bytes(t))
    return h.hexdigest()


def data_fingerprint(batches) -> str:
    """Hash of every tensor (and value) in every batch, in order."""
    h = hashlib.blake2b(digest_size=20)
    for b in batches:
        for key in sorted(b):
            v = b[key]
            h.update(key.encode())
            h.update(_tensor_bytes(v) if isinstance(v, torch.Tensor) else repr(v).encode())
    return h.hexdigest()


def layer_fingerprint(module: nn.Linear) -> str:
    """Hash of one linear layer's weight and bias: statistics belong to exactly these weights."""
    h = hashlib.blake2b(digest_size=12)
    for t in (module.weight, module.bias):
        if t is not None:
            h.update(str(tuple(t.shape)).encode())
            h.update(_tensor_bytes(t))
    return h.hexdigest()


_PLAIN = (type(None), bool, int, float, str, bytes)
_LIBRARIES = {"torch", "transformers", "numpy", "scipy", "math", "operator", "functools", "builtins"}


def _describe(value, depth: int = 0):
    """A stable, hashable description of a value a loss function depends on, or raise TypeError."""
    if depth > 6:
        raise TypeError("nested too deeply")
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, (tuple, list)):
        return [type(value).__name__, [_describe(v, depth + 1) for v in value]]
    if isinstance(value, dict):
        return {str(k): _describe(v, depth + 1) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, torch.Tensor):
        return ["tensor", str(value.dtype), list(value.shape),
                hashlib.blake2b(_tensor_bytes(value), digest_size=12).hexdigest()]
    if isinstance(value, torch.dtype):
        return str(value)
    if isinstance(value, type(functools)):  # a module
        return ["module", value.__name__]
    if isinstance(value, (types.FunctionType, types.BuiltinFunctionType, types.MethodType, functools.partial)):
        return loss_key(value, depth + 1)
    raise TypeError(f"it depends on a {type(value).__name__}")


def _code_description(code) -> list:
    consts = [_code_description(c) if hasattr(c, "co_code") else _describe(c) for c in code.co_consts]
    return [code.co_code.hex(), consts, list(code.co_names), list(code.co_varnames)]


def loss_key(loss_fn, depth: int = 0):
    """What determines ``loss_fn``'s result, for the cache key: its code, captured values and arguments.

    Functions (lambdas and closures included) are described by their bytecode, constants,
    default arguments, the values their closures capture and the global values they read;
    ``functools.partial`` by its function and arguments; tensors by their contents. Raises
    :class:`TypeError` when something it depends on cannot be described (e.g. a captured
    model or an object with state), so that it is never cached under a wrong key.
    """
    if loss_fn is None:
        return "model(**batch).loss"
    if isinstance(loss_fn, types.MethodType):
        return ["method", _describe(loss_fn.__self__, depth + 1), loss_key(loss_fn.__func__, depth + 1)]
    if not isinstance(loss_fn, (types.FunctionType, types.BuiltinFunctionType, functools.partial)):
        raise TypeError(f"it is a {type(loss_fn).__name__} object, whose state cannot be keyed")
    root = (getattr(loss_fn, "__module__", None) or "").split(".")[0]
    if root in _LIBRARIES:  # a library function: its name and the library's version determine it
        import importlib.metadata as md
        try:
            version = md.version(root)
        except md.PackageNotFoundError:
            version = None
        return ["library", loss_fn.__module__, getattr(loss_fn, "__qualname__", repr(loss_fn)), version]
    if isinstance(loss_fn, functools.partial):
        return ["partial", loss_key(loss_fn.func, depth + 1), _describe(list(loss_fn.args), depth + 1),
                _describe(dict(loss_fn.keywords), depth + 1)]
    code = getattr(loss_fn, "__code__", None)
    if code is None:  # a builtin outside the known libraries
        return ["builtin", getattr(loss_fn, "__module__", None), getattr(loss_fn, "__qualname__", None)]
    cells = [_describe(c.cell_contents, depth + 1) for c in (loss_fn.__closure__ or ())]
    glob = getattr(loss_fn, "__globals__", {})
    used = {name: _describe(glob[name], depth + 1) for name in code.co_names
            if name in glob and not isinstance(glob[name], type) and depth < 4}
    return [loss_fn.__module__, loss_fn.__qualname__, _code_description(code),
            _describe(list(loss_fn.__defaults__ or ()), depth + 1),
            _describe(dict(loss_fn.__kwdefaults__ or {}), depth + 1), cells, used]


def _code_version() -> str:
    from .._version import __version__
    src = Path(__file__).read_bytes()
    return f"{__version__}/{CODE_VERSION}/{hashlib.blake2b(src, digest_size=8).hexdigest()}"


def _read_cache(path: Path, key: str, verify: bool) -> dict | None:
    """The manifest of a valid cache entry, or ``None`` (missing, corrupt or mismatched)."""
    mf = path / "manifest.json"
    if not mf.exists():
        return None
    try:
        man = json.loads(mf.read_text())
        if man.get("key") != key:
            log.warning("calibration cache %s belongs to another configuration; recomputing", path)
            return None
        for fname, meta in man["files"].items():
            f = path / fname
            if not f.exists() or f.stat().st_size != meta["size"]:
                log.warning("calibration cache %s: %s is missing or truncated; recomputing", path, fname)
                return None
            if verify and file_checksum(f) != meta["hash"]:
                log.warning("calibration cache %s: %s fails its checksum; recomputing", path, fname)
                return None
        return man
    except (OSError, ValueError, KeyError, TypeError) as err:
        log.warning("calibration cache %s is unreadable (%s); recomputing", path, err)
        return None


# ----------------------------------------------------------------------------- collection

PARTIAL_SUFFIX = ".partial"


def _reclaim(root: Path) -> None:
    """Remove the temporary folders that killed calibration runs left in ``root``, and say so."""
    if root.is_dir():
        count, freed = remove_stale_temporaries(root)
        if count:
            log.warning("removed %d temporary folder(s) left by interrupted calibration runs in %s "
                        "(%.1f MB reclaimed)", count, root, freed / 2**20)


class _Checkpoint:
    """The progress of a cached collection in its ``<key>.partial/`` folder: batches done and the sums so far.

    Saved (atomically) at a batch boundary at least every ``every`` seconds and when a signal
    asked the collection to stop; read back by the next call with the same key.
    """

    FILE = "progress.pt"

    def __init__(self, folder: Path, key: str, every: float, signals: "_Signals"):
        self.folder, self.key, self.every, self.signals = folder, key, every, signals
        self.last = time.monotonic()

    def load(self):
        """``(done, acc, tokens)`` of an earlier interrupted run, or ``None``."""
        f = self.folder / self.FILE
        if not f.exists():
            return None
        try:
            got = torch.load(f, weights_only=True)
        except Exception as exc:  # noqa: BLE001 - an unreadable checkpoint means: start again
            log.warning("calibration progress %s is unreadable (%s); starting again", f, exc)
            return None
        if got.get("key") != self.key:
            return None
        return int(got["done"]), got["acc"], dict(got["tokens"])

    def due(self) -> bool:
        return self.signals.pending is not None or time.monotonic() - self.last >= self.every

    def save(self, done: int, acc, tokens) -> None:
        state = {"key": self.key, "done": done, "acc": acc, "tokens": tokens}
        atomic_write(self.folder / self.FILE, lambda t: torch.save(state, t))
        self.last = time.monotonic()


class _Signals:
    pending: int | None = None


@contextlib.contextmanager
def _deferred_interrupts():
    """Ctrl-C and SIGTERM set ``pending`` instead of raising, so the batch under way can finish and
    the progress be kept; a second signal raises ``KeyboardInterrupt`` at once (main thread only)."""
    import signal
    import threading

    flag = _Signals()
    if threading.current_thread() is not threading.main_thread():
        yield flag
        return

    def handler(signum, frame):
        if flag.pending is not None:
            raise KeyboardInterrupt(f"terminated by signal {signum}")
        flag.pending = signum
        log.warning("signal %d: finishing the current calibration batch and keeping the progress "
                    "(send it again to stop at once)", signum)

    old = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield flag
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)


@contextlib.contextmanager
def _owned(partial: Path):
    """Create ``partial`` (or take over a dead process's); refuse one a live process is filling."""
    from ..env import _pid_alive

    partial.mkdir(parents=True, exist_ok=True)
    lock = partial / "owner.pid"
    if lock.exists():
        try:
            pid = int(lock.read_text().strip() or 0)
        except (OSError, ValueError):
            pid = 0
        if pid and pid != os.getpid() and _pid_alive(pid):
            raise FisherkronError(f"process {pid} is collecting this calibration into {partial}; wait for it "
                                  f"to finish (or stop it) and run again")
    lock.write_text(str(os.getpid()))
    try:
        yield
    finally:
        lock.unlink(missing_ok=True)


def _note_other_partials(root: Path, mine: Path) -> None:
    """Say once that interrupted collections of other configurations hold disk space."""
    others = [p for p in root.glob(f"*{PARTIAL_SUFFIX}") if p != mine and p.is_dir()]
    if others:
        size = sum(f.stat().st_size for p in others for f in p.rglob("*") if f.is_file())
        log.info("%d interrupted calibration(s) of other configurations in %s hold %.2f GB; they resume if "
                 "run again with the same arguments, or delete them", len(others), root, size / 1e9)


def split_sequences(batches) -> list[dict]:
    """Each batch of ``B`` sequences as ``B`` batches of one (tensors split along dim 0; other values shared)."""
    out = []
    for b in batches:
        if not isinstance(b, dict):
            raise FisherkronError("granularity='sequence' needs batches that are dicts of tensors")
        sizes = {v.shape[0] for v in b.values() if isinstance(v, torch.Tensor) and v.dim() > 0}
        if len(sizes) != 1:
            raise FisherkronError(f"cannot split a batch into sequences: its tensors have first dimensions {sorted(sizes)}")
        B = sizes.pop()
        out += [{key: v[j:j + 1] if isinstance(v, torch.Tensor) and v.dim() > 0 else v for key, v in b.items()}
                for j in range(B)]
    return out


def _default_loss(model: nn.Module, batch: dict) -> torch.Tensor:
    out = model(**batch)
    if getattr(out, "loss", None) is None:
        raise FisherkronError("the model returned no loss; put 'labels' in the batches or pass loss_fn")
    return out.loss


def collect_calibration(model: nn.Module, batches, layers=None, *, k: int | None = None, seed: int = 0,
                        stats=None, methods=None, loss_fn=None, loss_name: str | None = None,
                        cache: bool = True, cache_dir=None, grad_dtype: str = "float32",
                        granularity: str = "batch", checkpoint_seconds: float = 300.0,
                        verify_cache: bool = True, progress: bool = False, group=None) -> CalibrationStats:
    r"""Per-batch gradients ``G_i`` and baseline statistics of the selected linear layers.

    Eq. (8): ``I_F = (1/k) sum_i vec(G_i) vec(G_i)^T`` with ``G_i = dL_i/dW`` the
    gradient of the mean loss of batch ``i`` (one gradient per batch, the
    paper's protocol). See the module docstring for the other statistics.

    Args:
        model: a module whose ``loss_fn(model, batch)`` is a scalar loss
            (default: ``model(**batch).loss``).
        batches: list of dicts of tensors (e.g. from :func:`fisherkron.lm_batches`).
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
            last batch kept; the folder becomes the cache entry when the last batch is done.
        progress: show a tqdm bar over batches.
        group: a ``torch.distributed`` process group (or ``"auto"``: the default group when
            one is initialised with more than one process; default ``None``: this process
            alone). Every rank passes the same model and batches; batch ``i`` is run on rank
            ``i % world``, which writes its gradients into rows ``i`` of the shared
            ``<layer>.grads.npy``; the other statistics are summed over the ranks
            (``all_reduce``), so every rank returns the global ones. The cache folder must
            be on a filesystem every rank sees; the entry is the same as one process
            writes (up to the round-off of the sums) and is reused by any world size.

    Returns:
        :class:`CalibrationStats` backed by files (with ``cache=False`` a private folder
        under the cache root, deleted when the object is garbage-collected).
    """
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
    from ..core.operators import ENCODINGS

    if grad_dtype not in ENCODINGS:
        raise FisherkronError(f"grad_dtype {grad_dtype!r} is unknown; use one of {', '.join(ENCODINGS)}")
    if granularity not in GRANULARITIES:
        raise FisherkronError(f"granularity {granularity!r} is unknown; use one of {', '.join(GRANULARITIES)}")
    if granularity == "token" and grad_dtype != "float32":
        raise FisherkronError("granularity='token' stores the layers' inputs and output gradients in float32; "
                              "leave grad_dtype at 'float32'")
    batches = list(batches)
    if k is not None:
        check_int(k, "k", minimum=1)
        if k > len(batches):
            raise FisherkronError(f"k={k} exceeds the {len(batches)} batches given")
        batches = batches[:k]
    if granularity == "sequence":
        batches = split_sequences(batches)
    k = len(batches)
    if k == 0:
        raise FisherkronError("no calibration batches were given")
    names = select_layers(model, layers)
    modules = dict(model.named_modules())
    shapes = {n: (modules[n].out_features, modules[n].in_features) for n in names}

    if loss_name is not None:
        described = ["named", str(loss_name)]
    else:
        try:
            described = loss_key(loss_fn)
        except TypeError as exc:
            if cache:
                raise FisherkronError(f"loss_fn {getattr(loss_fn, '__qualname__', loss_fn)!r} cannot be keyed for "
                                      f"the calibration cache ({exc}); pass loss_name='a name unique to this "
                                      f"loss' or cache=False") from None
            described = None
    loss_hash = hashlib.blake2b(json.dumps(described, sort_keys=True, default=str).encode(),
                                digest_size=12).hexdigest()
    config = {"model": model_fingerprint(model), "data": data_fingerprint(batches), "layers": names,
              "k": k, "seed": seed, "stats": sorted(stats), "code": _code_version(),
              "grad_dtype": grad_dtype, "granularity": granularity,
              "loss_fn": [getattr(loss_fn, "__qualname__", None), loss_hash]}
    key = hashlib.blake2b(json.dumps(config, sort_keys=True).encode(), digest_size=16).hexdigest()

    root = Path(cache_dir) if cache_dir is not None else data_root() / "cache" / "calibration"
    final = root / key
    group = resolve_group(group)
    if group is not None and (grad_dtype != "float32" or granularity == "token"):
        raise FisherkronError("over a process group the gradients are stored per batch in float32; "
                              "grad_dtype and granularity='token' are single-process options for now")
    if group is not None:
        return _collect_on_ranks(model, batches, names, modules, shapes, stats, loss_fn or _default_loss, progress,
                                 key=key, config=config, root=root, final=final, cache=cache,
                                 verify_cache=verify_cache, group=group)
    _reclaim(root)
    if cache:
        man = _read_cache(final, key, verify_cache)
        if man is not None:
            return CalibrationStats(final, man["layers"], man["k"], key, man["config"],
                                    tuple(man["config"]["stats"]), from_cache=True)
        if final.exists():
            shutil.rmtree(final)
    root.mkdir(parents=True, exist_ok=True)

    def write(folder: Path, checkpoint: "_Checkpoint | None" = None) -> dict:
        """Collect into ``folder`` and write its manifest; returns the per-layer info."""
        tokens = _collect(model, batches, names, modules, shapes, stats, loss_fn or _default_loss,
                          folder, progress, grad_dtype=grad_dtype, granularity=granularity, checkpoint=checkpoint)
        return _write_manifest(folder, key, config, k, names, shapes, modules, tokens, world_size=1)

    if not cache:  # a private folder, removed when the returned object is garbage-collected
        tmp = Path(tempfile.mkdtemp(prefix=temporary_name(f"private-{key[:8]}"), dir=root))
        try:
            with sigterm_as_interrupt():
                layer_info = write(tmp)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        out = CalibrationStats(tmp, layer_info, k, key, config, stats, from_cache=False)
        weakref.finalize(out, shutil.rmtree, str(tmp), True)
        return out
    check_positive(checkpoint_seconds, "checkpoint_seconds")
    partial = root / f"{key}{PARTIAL_SUFFIX}"
    _note_other_partials(root, partial)
    with _owned(partial), _deferred_interrupts() as signals:
        try:
            layer_info = write(partial, _Checkpoint(partial, key, checkpoint_seconds, signals))
        except FisherkronError:  # bad data or a bad argument: nothing of it is kept
            shutil.rmtree(partial, ignore_errors=True)
            raise
        (partial / _Checkpoint.FILE).unlink(missing_ok=True)
        os.replace(partial, final)  # one rename: the entry appears whole
    return CalibrationStats(final, layer_info, k, key, config, stats, from_cache=False)


def _write_manifest(folder: Path, key: str, config: dict, k: int, names, shapes, modules, tokens,
                    world_size: int) -> dict:
    """Checksum every ``.npy`` of ``folder`` and write ``manifest.json``; returns the per-layer info."""
    files = {f.name: {"size": f.stat().st_size, "hash": file_checksum(f)} for f in sorted(folder.glob("*.npy"))}
    info = {n: {"n": shapes[n][0], "m": shapes[n][1], "tokens": tokens[n],
                "weights": layer_fingerprint(modules[n])} for n in names}
    man = {"key": key, "config": config, "k": k, "layers": info, "files": files, "world_size": world_size}
    (folder / "manifest.json").write_text(json.dumps(man, indent=1))
    return info


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


def _open_rows(path: Path, dtype, shape, resume: bool) -> np.memmap:
    """A ``.npy`` memory map to fill: the existing one when resuming (same dtype and shape), else a new one."""
    if resume and path.exists():
        try:
            mm = np.load(path, mmap_mode="r+")
            if mm.dtype == np.dtype(dtype) and mm.shape == tuple(shape):
                return mm
        except (OSError, ValueError, EOFError):
            pass
        raise FisherkronError(f"{path} does not match the interrupted collection it belongs to; delete "
                              f"{path.parent} and run again")
    return np.lib.format.open_memmap(path, mode="w+", dtype=dtype, shape=tuple(shape))


def _collect(model, batches, names, modules, shapes, stats, loss_fn, out: Path, progress: bool,
             grad_dtype: str = "float32", granularity: str = "batch", checkpoint: _Checkpoint | None = None):
    """One forward + backward per batch; returns the token count per layer.

    ``grad_dtype``: how the gradients are stored (:class:`~fisherkron.core.operators.StoredGradients`);
    ``granularity="token"`` stores each layer's inputs ``X`` and output gradients ``D`` instead.
    ``checkpoint``: resume from the batches an interrupted run kept, and keep progress.
    """
    from ..core.operators import ENCODINGS, encode_gradient

    k = len(batches)
    resumed = checkpoint.load() if checkpoint is not None else None
    done, acc0, tokens0 = resumed if resumed is not None else (0, None, None)
    if resumed is not None:
        log.warning("resuming the calibration in %s at batch %d of %d", out, done, k)
    grads_mm, scales, rows_mm, offset = {}, {}, {}, {}
    if "grads" in stats and granularity == "token":
        T = _token_count(batches)
        for n in names:
            rows_mm[("X", n)] = _open_rows(out / f"{n}.X.npy", np.float32, (T, shapes[n][1]), done > 0)  # (T, m)
            rows_mm[("D", n)] = _open_rows(out / f"{n}.D.npy", np.float32, (T, shapes[n][0]), done > 0)  # (T, n)
            offset[("X", n)] = offset[("D", n)] = tokens0[n] if tokens0 else 0
    elif "grads" in stats:
        for n in names:
            grads_mm[n] = _open_rows(out / f"{n}.grads.npy", ENCODINGS[grad_dtype], (k, *shapes[n]), done > 0)
            scales[n] = np.ones(k)
            if done > 0 and grad_dtype == "float16":
                scales[n][:done] = np.load(out / f"{n}.grad_scales.partial.npy")[:done]

    def store(n: str, i: int, G: torch.Tensor) -> None:
        if n in grads_mm:
            grads_mm[n][i], scales[n][i] = encode_gradient(G, grad_dtype)  # (n, m) into row i

    def store_rows(kind: str, n: str, r: torch.Tensor) -> None:
        mm, at = rows_mm[(kind, n)], offset[(kind, n)]
        if at + r.shape[0] > mm.shape[0]:
            raise FisherkronError(f"layer {n} saw more tokens than the batches' attention masks count; "
                                  f"granularity='token' needs one row per kept token")
        mm[at:at + r.shape[0]] = r.cpu().numpy()
        offset[(kind, n)] = at + r.shape[0]

    def flush() -> None:
        for mm in list(grads_mm.values()) + list(rows_mm.values()):
            mm.flush()
        if grad_dtype == "float16":
            for n, sc in scales.items():
                np.save(out / f"{n}.grad_scales.partial.npy", sc)

    def after_batch(i: int, acc, tokens) -> None:
        if checkpoint is None or not checkpoint.due():
            return
        flush()
        checkpoint.save(i + 1, acc, tokens)
        if checkpoint.signals.pending is not None:
            raise KeyboardInterrupt(f"calibration stopped after batch {i + 1} of {k}; its progress is kept in "
                                    f"{out}: run the same call again to resume")

    try:
        acc, tokens = _accumulate(model, batches, range(done, k), names, modules, stats, loss_fn, store, progress,
                                  store_rows=store_rows if rows_mm else None, acc=acc0, tokens=tokens0,
                                  after_batch=after_batch, total=k)
    finally:
        for mm in list(grads_mm.values()) + list(rows_mm.values()):
            mm.flush()
        grads_mm.clear()
        rows_mm.clear()
    short = [key for key, at in offset.items() if at != T] if offset else []
    if short:
        raise FisherkronError(f"layer {short[0][1]} saw {offset[short[0]]} of {T} tokens ({short[0][0]}); "
                              f"granularity='token' needs every kept token")
    if grad_dtype == "float16":
        for n, sc in scales.items():
            np.save(out / f"{n}.grad_scales.npy", sc)
            (out / f"{n}.grad_scales.partial.npy").unlink(missing_ok=True)
    _save_statistics(acc, tokens, k, names, stats, out)
    return tokens


def _accumulate(model, batches, indices, names, modules, stats, loss_fn, store, progress: bool, store_rows=None,
                acc=None, tokens=None, after_batch=None, total: int | None = None):
    """One forward + backward for each batch ``i`` in ``indices``; per-layer sums and token counts.

    ``store(name, i, G_i)`` keeps each gradient. Returns ``(acc, tokens)``: per layer the sums
    ``g2 = sum_i G_i o G_i``, ``abs_sum = sum_t |x_t|``, ``xxt = sum_t x_t x_t^T`` and
    ``ddt = sum_t delta_t delta_t^T`` over these batches (absent when no batch was run).
    ``store_rows(kind, name, rows)``, when given, receives each batch's layer inputs
    (``kind="X"``, ``(T_b, m)``) and output gradients (``"D"``, ``(T_b, n)``): the per-token form.
    ``acc`` / ``tokens``: sums to continue (a resumed collection); ``after_batch(i, acc, tokens)``
    runs after each batch is complete; ``total``: the number of batches the progress bar shows.
    """
    want_act = any(s in stats for s in ("abs_mean", "xxt", "kfac")) or store_rows is not None
    acc = acc if acc is not None else {n: {} for n in names}
    tokens = tokens if tokens is not None else {n: 0 for n in names}
    mask_holder: dict[str, torch.Tensor | None] = {"mask": None}
    shared_gram: dict = {}

    def rows(t: torch.Tensor) -> torch.Tensor:
        mask = mask_holder["mask"]
        if mask is not None and t.dim() == 3 and t.shape[:2] == mask.shape:
            return t[mask]  # (T_kept, features)
        return t.reshape(-1, t.shape[-1])

    def make_hook(n):
        def fwd(mod, inp, outp):
            x_in = inp[0].detach()
            x = rows(x_in).float()  # (T, m)
            a = acc[n]
            tokens[n] += x.shape[0]
            if store_rows is not None:
                store_rows("X", n, x)
            # layers fed by the same tensor (q/k/v, gate/up) share one X X^T per batch
            shared = (x_in.data_ptr(), tuple(x_in.shape), x_in._version)
            if "abs_mean" in stats:
                s = x.abs().sum(0).double()
                a["abs_sum"] = s if "abs_sum" not in a else a["abs_sum"] + s
            if "xxt" in stats or "kfac" in stats:
                if shared_gram.get("key") != shared:
                    shared_gram["key"], shared_gram["val"] = shared, (x.T @ x).double()  # (m, m)
                g = shared_gram["val"]
                a["xxt"] = g.clone() if "xxt" not in a else a["xxt"].add_(g)
            if ("kfac" in stats or store_rows is not None) and outp.requires_grad:
                def bwd(grad):
                    d = rows(grad.detach()).float()  # (T, n)
                    if store_rows is not None:
                        store_rows("D", n, d)
                    if "kfac" in stats:
                        dd = (d.T @ d).double()  # (n, n)
                        a["ddt"] = dd if "ddt" not in a else a["ddt"] + dd
                outp.register_hook(bwd)
        return fwd

    flags = {p: p.requires_grad for p in model.parameters()}
    was_training = model.training
    handles = [modules[n].register_forward_hook(make_hook(n)) for n in names] if want_act else []
    try:
        for p in model.parameters():
            p.requires_grad_(False)
        for n in names:
            modules[n].weight.requires_grad_(True)
        model.eval()
        device = next(model.parameters()).device
        indices = list(indices)
        start = total - len(indices) if total is not None else 0
        for i in tqdm(indices, desc="calibration", disable=not progress, initial=start,
                      total=total if total is not None else len(indices)):
            batch = batches[i]
            if isinstance(batch, dict):
                batch = {key: v.to(device) if isinstance(v, torch.Tensor) else v for key, v in batch.items()}
            mask = batch.get("attention_mask") if isinstance(batch, dict) else None
            mask_holder["mask"] = mask.bool() if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None
            shared_gram.clear()
            for n in names:
                modules[n].weight.grad = None
            loss = loss_fn(model, batch)
            if not torch.isfinite(loss):
                raise FisherkronError(f"loss of batch {i} is {float(loss)}; check the data (nothing was cached)")
            loss.backward()
            for n in names:
                G = modules[n].weight.grad  # (n, m)
                if G is None:
                    raise FisherkronError(f"layer {n} got no gradient in batch {i}; is it used by the loss?")
                if not torch.isfinite(G).all():
                    raise FisherkronError(f"gradient of layer {n} in batch {i} has NaN/inf entries "
                                          f"(nothing was cached)")
                if "grads" in stats:
                    store(n, i, G)
                if "diag_fisher" in stats:
                    Gf = G.detach().float()
                    if "g2" not in acc[n]:
                        acc[n]["g2"] = torch.zeros_like(Gf)  # (n, m) float32: k is small
                    acc[n]["g2"].addcmul_(Gf, Gf)
                modules[n].weight.grad = None
            if after_batch is not None:
                after_batch(i, acc, tokens)
    finally:
        for h in handles:
            h.remove()
        for p, f in flags.items():
            p.requires_grad_(f)
        model.train(was_training)
    return acc, tokens


def _save_statistics(acc, tokens, k: int, names, stats, out: Path) -> None:
    """Eq. (8)'s diagonal ``(1/k) sum_i G_i o G_i``, ``mean |x|``, ``X X^T`` and ``sum delta delta^T`` to ``out``."""
    for n in names:
        a = acc[n]
        if "diag_fisher" in stats:
            np.save(out / f"{n}.diag_fisher.npy", (a["g2"].double() / k).cpu().numpy())
        if "abs_mean" in stats:
            np.save(out / f"{n}.abs_mean.npy", (a["abs_sum"] / max(tokens[n], 1)).float().cpu().numpy())
        if "xxt" in stats or "kfac" in stats:
            np.save(out / f"{n}.xxt.npy", a["xxt"].cpu().numpy())
        if "kfac" in stats:
            if "ddt" not in a:
                raise FisherkronError(f"layer {n}: no output gradients were seen for K-FAC")
            np.save(out / f"{n}.ddt.npy", a["ddt"].cpu().numpy())


# ----------------------------------------------------------------------------- over a process group

class _RowWriter:
    """Writes gradient ``i`` into row ``i`` of an existing ``(k, n, m)`` float32 ``.npy`` file.

    Each rank writes only the bytes of its own rows (``os.pwrite``), so ranks never touch
    each other's data, also on a shared filesystem where pages are not coherent.
    """

    def __init__(self, path: Path):
        with open(path, "rb") as fh:
            version = np.lib.format.read_magic(fh)
            read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
            shape, _, dtype = read(fh)
            self.offset = fh.tell()
        self.row_bytes = int(np.prod(shape[1:])) * np.dtype(dtype).itemsize
        self.fd = os.open(path, os.O_WRONLY)

    def write(self, i: int, G: torch.Tensor) -> None:
        data = memoryview(np.ascontiguousarray(G.detach().float().cpu().numpy())).cast("B")  # (n, m) float32
        done = 0
        while done < len(data):
            done += os.pwrite(self.fd, data[done:], self.offset + i * self.row_bytes + done)

    def close(self) -> None:
        os.close(self.fd)


def _visible(path: Path, rank: int) -> None:
    if not path.exists():
        raise FisherkronError(f"rank {rank} does not see {path}; put the calibration cache (--cache-dir) on a "
                              f"filesystem every rank sees")


def _reduce_statistics(acc, tokens, names, shapes, stats, group):
    """Sum the per-rank sums of :func:`_accumulate` over the ranks (``all_reduce``; zeros where a rank ran none)."""
    for n in names:
        a, (rows, cols) = acc[n], shapes[n]
        counts = torch.tensor([tokens[n], "ddt" in a], dtype=torch.float64)  # exact below 2^53
        all_reduce_(counts, group)
        tokens[n] = int(counts[0])
        if "diag_fisher" in stats:
            a["g2"] = all_reduce_(a.get("g2", torch.zeros(rows, cols)), group)  # (n, m) float32
        if "abs_mean" in stats:
            a["abs_sum"] = all_reduce_(a.get("abs_sum", torch.zeros(cols, dtype=torch.float64)), group)  # (m,)
        if "xxt" in stats or "kfac" in stats:
            a["xxt"] = all_reduce_(a.get("xxt", torch.zeros(cols, cols, dtype=torch.float64)), group)  # (m, m)
        if "kfac" in stats:
            a["ddt"] = all_reduce_(a.get("ddt", torch.zeros(rows, rows, dtype=torch.float64)), group)  # (n, n)
            if counts[1] == 0:  # no rank saw an output gradient
                del a["ddt"]
    return acc, tokens


def _collect_on_ranks(model, batches, names, modules, shapes, stats, loss_fn, progress, *, key, config, root, final,
                      cache, verify_cache, group) -> CalibrationStats:
    """:func:`collect_calibration` over a process group: batch ``i`` on rank ``i % world``.

    Rank 0 reads the cache, creates the (temporary) folder and the ``(k, n, m)`` gradient
    files; every rank writes the rows of its batches; the sums behind the other statistics
    are all-reduced and rank 0 writes them, the manifest (with the world size) and moves
    the folder into the cache in one rename. Each step ends in a collective that tells every
    rank whether any rank failed, so a failure anywhere stops all ranks with the same
    error, and rank 0 removes the temporary folder: no half-written entry is left.
    """
    rank, world = rank_of(group), world_of(group)
    k = len(batches)
    keys = [None] * world
    dist.all_gather_object(keys, key, group=group)
    other = next((r for r, kk in enumerate(keys) if kk != keys[0]), None)
    if other is not None:
        raise FisherkronError(f"rank {other} has another calibration configuration than rank 0 (model weights, "
                              f"batches, layers, k, seed, statistics or loss); give every rank the same")
    man = None
    with sigterm_as_interrupt():
        with all_or_none(group, "reading the calibration cache"):
            if rank == 0:
                _reclaim(root)
                if cache:
                    man = _read_cache(final, key, verify_cache)
                    if man is None and final.exists():
                        shutil.rmtree(final)
                root.mkdir(parents=True, exist_ok=True)
        man = broadcast_object(man, group)
        if man is not None:
            with all_or_none(group, "opening the cached calibration"):
                _visible(final / "manifest.json", rank)
            return CalibrationStats(final, man["layers"], man["k"], key, man["config"],
                                    tuple(man["config"]["stats"]), from_cache=True)
        entry = contextlib.ExitStack()  # rank 0: the atomic folder of the cache entry
        tmp = None
        try:
            with all_or_none(group, "creating the calibration folder"):
                if rank == 0:
                    if cache:
                        tmp = entry.enter_context(atomic_directory(final))
                    else:
                        tmp = Path(tempfile.mkdtemp(prefix=temporary_name(f"private-{key[:8]}"), dir=root))
                    if "grads" in stats:
                        for n in names:  # every rank fills its rows of these
                            np.lib.format.open_memmap(tmp / f"{n}.grads.npy", mode="w+", dtype=np.float32,
                                                      shape=(k, *shapes[n])).flush()  # (k, n, m)
            tmp = broadcast_object(tmp, group)
            with all_or_none(group, "calibration"):
                _visible(tmp, rank)
                writers = {n: _RowWriter(tmp / f"{n}.grads.npy") for n in names} if "grads" in stats else {}
                try:
                    acc, tokens = _accumulate(model, batches, range(rank, k, world), names, modules, stats, loss_fn,
                                              lambda n, i, G: writers[n].write(i, G), progress and rank == 0)
                finally:
                    for w in writers.values():
                        w.close()
            acc, tokens = _reduce_statistics(acc, tokens, names, shapes, stats, group)
            info = None
            with all_or_none(group, "writing the calibration statistics"):
                if rank == 0:
                    _save_statistics(acc, tokens, k, names, stats, tmp)
                    info = _write_manifest(tmp, key, config, k, names, shapes, modules, tokens, world_size=world)
                    entry.close()  # the temporary folder becomes the cache entry (one rename)
            info = broadcast_object(info, group)
        except BaseException:
            if rank == 0:
                with contextlib.suppress(BaseException):
                    entry.__exit__(*sys.exc_info())  # removes the temporary folder
                if not cache and tmp is not None:
                    shutil.rmtree(tmp, ignore_errors=True)
            raise
    folder = final if cache else tmp
    out = CalibrationStats(folder, info, k, key, config, stats, from_cache=False)
    if not cache and rank == 0:  # the private folder belongs to rank 0's object
        weakref.finalize(out, shutil.rmtree, str(folder), True)
    return out
