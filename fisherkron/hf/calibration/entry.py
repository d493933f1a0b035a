"""A calibration cache entry: its manifest (what it holds, every file's size and checksum) and its reader.

An entry is a folder ``<cache>/<key>/`` with one ``.npy`` per layer and statistic and a
``manifest.json`` written last. :func:`read_manifest` accepts it only if the manifest's key
matches and every listed file has its size (and, with ``verify``, its checksum);
:class:`CalibrationStats` reads the arrays on request.
"""
from __future__ import annotations

import difflib
import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ...core.conventions import FisherkronError
from ...core.distributed import all_or_none, all_reduce_, broadcast_int, rank_of, resolve_group, world_of
from ...core.kfac import KFACFactors
from ...core import shrinkage as shrink_code
from ...core.methods import METHODS
from ...env import TMP_PREFIX, atomic_write, code_digest, file_checksum, remove_stale_temporaries
from .keys import layer_fingerprint, model_difference, model_fingerprint, tensor_digest

__all__ = ["CalibrationStats", "STATS", "GRANULARITIES", "METHOD_STATS", "MFF_DTYPE", "mff_settings", "read_manifest",
           "write_manifest"]

log = logging.getLogger(__name__)

STATS = ("grads", "diag_fisher", "abs_mean", "xxt", "kfac")
#: what one gradient of Eq. (8) is: a batch's (the paper's), a sequence's, or a token's (rank one)
GRANULARITIES = ("batch", "sequence", "token")
# what each compression method reads; K-FAC (the MFF warm start) and X X^T cost
# about as much as the forward + backward pass itself, so collect only what is used
METHOD_STATS = {**{name: m.needs for name, m in METHODS.items()}, "kfac": ("kfac",),
                "basis_sharing": ("xxt",)}  # Basis Sharing: the Gram sums of a group (hf.basis_sharing)
#: the precision of MFF's products for the factors a calibration entry keeps, unless the caller names another:
#: float64 leaves the factors, and the ranks a Theorem-1 allocation reads off them, independent of the GEMMs'
#: summation order (float32's differ between CPU models and thread counts in their 4th-5th digit, which moved
#: ranks near a threshold); on a 1536 x 576 layer with k = 32 it took 1.6x float32's time
MFF_DTYPE = "float64"


def mff_settings(mff_options: dict | None) -> dict:
    """``mff_options`` with MFF's precision made explicit, by name (``dtype``: :data:`MFF_DTYPE` unless given), so a
    call that names the default and one that leaves it out find the same cached factors.

    >>> mff_settings({"tol": 1e-4}), mff_settings({"dtype": torch.float32})
    ({'tol': 0.0001, 'dtype': 'float64'}, {'dtype': 'float32'})
    """
    opts = dict(mff_options or {})
    dtype = opts.get("dtype", MFF_DTYPE)
    opts["dtype"] = str(dtype).removeprefix("torch.") if isinstance(dtype, torch.dtype) else dtype
    return opts


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

    @property
    def keeps_gradients(self) -> bool:
        """Whether the entry holds its gradients; one collected under ``max_disk`` holds MFF's factors instead."""
        return not (isinstance(self.config, dict) and self.config.get("bounded"))

    def _no_gradients(self, what: str) -> FisherkronError:
        return FisherkronError(f"the calibration in {self.dir} was collected under a disk bound (max_disk): it keeps "
                               f"MFF's factors of its layers, not their gradients, so {what}; collect again "
                               f"without max_disk to keep the gradients")

    def grads_path(self, name: str) -> Path:
        """``.npy`` file of the ``(k, n, m)`` per-batch gradients ``G_i`` (float32, or the ``grad_dtype``
        encoding: read it through :meth:`gradients`; absent for ``granularity="token"``)."""
        self._need("grads")
        if not self.keeps_gradients:
            raise self._no_gradients(f"layer {name} has no gradient file")
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
        from ...core.operators import StoredGradients, TokenFisher

        self._need("grads")
        if not self.keeps_gradients:
            raise self._no_gradients(f"layer {name} has no gradients to read")
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

    def check_model(self, model: nn.Module) -> None:
        """Raise in one line unless ``model`` is the model these statistics were collected on.

        Every parameter and buffer (the selected layers' and the others': norms, embeddings, the
        head), the class and the config fields that change what it computes
        (:func:`~fisherkron.hf.calibration.keys.model_difference`) against the record the
        statistics carry from their cache key (``config["model"]``): one hash of ``model``. Statistics
        of an earlier version carry the fingerprint alone and are checked against it; statistics
        that carry neither are refused.
        """
        want = self.config.get("model") if isinstance(self.config, dict) else None
        again = "collect them again on this model (fisherkron.collect_calibration)"
        if isinstance(want, dict):
            what = model_difference(want, model)
        elif isinstance(want, str):  # an earlier version's key: the fingerprint alone, no record of the parts
            same = model_fingerprint(model, with_location=True) == want  # as those versions computed it
            what = None if same else ("another model, one whose class, config, parameters or buffers differ from "
                                      "this one's (statistics of an earlier version record no more)")
        else:
            raise FisherkronError(f"the calibration statistics in {self.dir} do not record the model they were "
                                  f"collected on; {again}")
        if what is not None:
            raise FisherkronError(f"the calibration statistics were collected on {what}; {again}")

    def check_weights(self, name: str, module: nn.Module) -> None:
        """Raise if ``module`` is not the layer the statistics of ``name`` were collected on.

        One layer only, against the digests of the model's record (a weight tied to another
        parameter is recorded, and checked by :meth:`check_model`, under that parameter's name):
        :meth:`check_model` checks the whole model, which the statistics depend on.
        """
        record = self.config.get("model") if isinstance(self.config, dict) else None
        if isinstance(record, dict):
            tensors = record.get("tensors") or {}
            bad = any(t is not None and f"{name}.{part}" in tensors and tensor_digest(t) != tensors[f"{name}.{part}"]
                      for part, t in (("weight", module.weight), ("bias", getattr(module, "bias", None))))
        else:  # an earlier version's statistics: a fingerprint of each layer
            want = self.layers.get(name, {}).get("weights")
            bad = want is not None and layer_fingerprint(module) != want
        if bad:
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
        atomically with a checksum of its contents, of this entry's key, the layer and the
        options (:func:`_factors_check`); a file that cannot be read or fails it (changed, or
        copied from another entry) is recomputed with a warning.

        ``group``: data-parallel MFF (see :func:`fisherkron.mff`): every rank of the process
        group calls this; rank ``p`` reads the gradients of its batches ``i % world == p``,
        every rank returns the same factors, and rank 0 writes them to the same cache file
        as one process would (the group is not part of the key).

        An entry collected under a disk bound (``max_disk``) keeps no gradients: it holds these
        files for the ``init`` and options it was collected with, and refuses others in one line.
        """
        self._need("grads")
        mff_options = mff_settings(mff_options)
        f, tag = self.factors_file(name, init=init, **mff_options)
        group = resolve_group(group)
        if group is not None:
            start = self.kfac(name) if init == "kfac" and "kfac" in self.stats else None
            return self._kronecker_on_ranks(name, f, tag, start, device, group, mff_options)
        cached = self._read_factors(f, name, tag)
        if cached is not None:
            return cached
        if not self.keeps_gradients:
            kept = self.config["bounded"]
            raise FisherkronError(
                f"the calibration in {self.dir} was collected under a disk bound (max_disk) and keeps MFF's factors "
                f"instead of gradients, computed with init={kept.get('init')!r} and options "
                f"{_options_text(kept.get('mff_options') or {})}; layer {name} has none for init={init!r} and options "
                f"{_options_text(mff_options)} (or its file fails its checksum): pass the options it was collected "
                f"with (compress's mff_options), or collect again with these (collect_calibration's mff_options)")
        from ...core.factorization import mff

        start = self.kfac(name) if init == "kfac" and "kfac" in self.stats else None
        res = mff(self.gradients(name), init=start, device=device, name=name, **mff_options)
        out = {"A": res.A.cpu(), "B": res.B.cpu(), "fisher_share": float(res.fisher_share),
               "matvecs": int(res.matvecs), "converged": bool(res.converged)}
        self._keep_factors(f, name, tag, out)
        return out

    def kronecker_halves(self, name: str, *, init: str = "kfac", device=None, **mff_options) -> tuple[dict, dict]:
        """MFF's ``A (x) B`` of layer ``name`` from each half of its gradients: the even batches, the odd ones.

        What :func:`~fisherkron.core.shrinkage.split_half_intensity` compares with :meth:`kronecker`'s factors
        to estimate how noisy their off-diagonals are (method ``gfwsvd_shrunk``). Same start and options as
        :meth:`kronecker`. Not kept on disk (two more sets of factors, ``2 (m^2 + n^2)`` float64 entries per
        layer): :meth:`shrinkage` keeps the two numbers they are read for. Needs the gradients of at least two
        batches (``k >= 2``), stored per batch or per sequence; an entry collected under a disk bound keeps
        none and is refused in one line.
        """
        self._need("grads")
        if self.granularity == "token":
            raise FisherkronError(f"the calibration in {self.dir} keeps per-token statistics, not per-batch "
                                  f"gradients; split halves need granularity 'batch' or 'sequence'")
        if self.k < 2:
            raise FisherkronError(f"split halves need the gradients of at least 2 batches; the calibration in "
                                  f"{self.dir} has k = {self.k}: collect it with k >= 2 (k >= 8 gives halves "
                                  f"worth comparing)")
        if not self.keeps_gradients:
            raise self._no_gradients(f"layer {name} has no gradients to split into halves")
        from ...core.factorization import mff
        from ...core.operators import GradientStack

        mff_options = mff_settings(mff_options)
        stack = GradientStack(self.gradients(name), name=name).stacked()  # (k, n, m)
        start = self.kfac(name) if init == "kfac" and "kfac" in self.stats else None
        halves = []
        for h in (0, 1):
            res = mff(stack[h::2], init=start, device=device, name=f"{name} (half {h + 1} of 2)", **mff_options)
            halves.append({"A": res.A.cpu(), "B": res.B.cpu(), "fisher_share": float(res.fisher_share),
                           "matvecs": int(res.matvecs), "converged": bool(res.converged)})
        return halves[0], halves[1]

    def shrinkage(self, name: str, *, init: str = "kfac", device=None, **mff_options) -> tuple[float, float]:
        r"""``(lambda_A, lambda_B)``: the split-half shrinkage intensities of layer ``name``'s MFF factors.

        :func:`~fisherkron.core.shrinkage.split_half_intensity` of :meth:`kronecker`'s ``A`` and ``B`` against
        those of :meth:`kronecker_halves`, what method ``gfwsvd_shrunk`` reads. Kept beside the factors
        (``<layer>.<tag>.shrinkage.pt``, the same checksum rule, the tag extended by a digest of the code that
        computes the intensity), so the halves' MFF runs once per layer and their factors never reach the disk.
        """
        f, tag = self.factors_file(name, init=init, **mff_options)
        fs = f.with_name(f.name[: -len(".pt")] + ".shrinkage.pt")
        stag = f"{tag}/shrinkage/{code_digest([Path(shrink_code.__file__)])}"
        got = self._read_factors(fs, name, stag)
        if got is None:
            full = self.kronecker(name, init=init, device=device, **mff_options)
            h1, h2 = self.kronecker_halves(name, init=init, device=device, **mff_options)
            got = {"lambda_A": shrink_code.split_half_intensity(full["A"], h1["A"], h2["A"], f"{name}: A"),
                   "lambda_B": shrink_code.split_half_intensity(full["B"], h1["B"], h2["B"], f"{name}: B")}
            self._keep_factors(fs, name, stag, got)
        return float(got["lambda_A"]), float(got["lambda_B"])

    def factors_file(self, name: str, *, init: str = "kfac", **mff_options) -> tuple[Path, str]:
        """``(file, tag)``: where :meth:`kronecker` keeps the factors of ``name`` for ``init`` and ``mff_options``.

        The tag hashes the start actually used (``init="kfac"`` without collected K-FAC factors
        starts from the identity) and the options (``device`` is not one: it does not change them).
        """
        start = "kfac" if init == "kfac" and "kfac" in self.stats else "identity"
        mff_options = mff_settings(mff_options)
        opts = {k: mff_options[k] for k in sorted(mff_options)}
        tag = hashlib.blake2b(json.dumps([start, opts], default=str).encode(), digest_size=8).hexdigest()
        return self.dir / "mff" / f"{name}.{tag}.pt", tag

    def _read_factors(self, f: Path, name: str, tag: str) -> dict | None:
        """The cached factors in ``f`` if they pass their checksum, else ``None`` (with a warning)."""
        if not f.exists():
            return None
        try:
            got = torch.load(f, weights_only=True)
            check = got.pop("check", None)
            if check is None:
                raise ValueError("it carries no checksum (an earlier version wrote it)")
            if check != _factors_check(self.key, name, tag, got):
                raise ValueError("it fails its checksum (changed since, or not this entry's)")
            return got
        except Exception as exc:  # noqa: BLE001 - any unreadable or unverified cache file is recomputed
            log.warning("cached MFF factors %s: %s; recomputing", f, str(exc).splitlines()[0] if str(exc) else
                        type(exc).__name__)
            return None

    def _keep_factors(self, f: Path, name: str, tag: str, out: dict) -> None:
        saved = {**out, "check": _factors_check(self.key, name, tag, out)}
        try:
            remove_stale_temporaries(f.parent)  # of writes killed outright
            atomic_write(f, lambda t: torch.save(saved, t))
        except OSError as exc:  # a read-only cache still works, only slower
            log.warning("could not keep the MFF factors in %s (%s)", f.parent, exc)

    def _kronecker_on_ranks(self, name: str, f: Path, tag: str, start, device, group, mff_options: dict) -> dict:
        """:meth:`kronecker` over a process group: rank 0 decides whether ``f`` is reused, all ranks run MFF."""
        from ...core.factorization import mff

        rank, world = rank_of(group), world_of(group)
        cached = self._read_factors(f, name, tag) if rank == 0 else None
        if broadcast_int(cached is not None, group):
            out = cached if rank == 0 else self._read_factors(f, name, tag)  # every rank checks what it reads
            failed = all_reduce_(torch.tensor([float(out is None)], dtype=torch.float64), group)
            if not failed.item():
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
            self._keep_factors(f, name, tag, out)
        return out

    def kfac(self, name: str) -> KFACFactors:
        """K-FAC ``A = X X^T / T`` (``m x m``) and ``B = (1/k) sum_t delta_t delta_t^T`` (``n x n``)."""
        self._need("kfac")
        A = self.xxt(name) / self.layers[name]["tokens"]
        return KFACFactors(A, self._load(name, "ddt") / self.k)




def _options_text(options: dict) -> str:
    """MFF's options as one line: ``{}`` or ``{'tol': 1e-06}``."""
    return "{}" if not options else repr({k: options[k] for k in sorted(options)})


def _factors_check(key: str, name: str, tag: str, factors: dict) -> str:
    """Checksum of cached MFF factors: their tensors and numbers, the entry's key, the layer and the options' tag."""
    h = hashlib.blake2b(digest_size=20)
    h.update(json.dumps([key, name, tag]).encode())
    for field in sorted(factors):
        v = factors[field]
        h.update(field.encode())
        if isinstance(v, torch.Tensor):
            t = v.detach().cpu().contiguous()
            h.update(f"{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        else:
            h.update(repr(v).encode())
    return h.hexdigest()


def read_manifest(path: Path, key: str, verify: bool) -> dict | None:
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


def write_manifest(folder: Path, key: str, config: dict, k: int, names, shapes, tokens, world_size: int,
                   extra: dict | None = None) -> dict:
    """Checksum every ``.npy`` of ``folder`` and write ``manifest.json``; returns the per-layer info.

    The layers' weights are not hashed again: ``config["model"]`` holds the record of every
    parameter and buffer (:func:`~fisherkron.hf.calibration.keys.model_record`). An entry
    collected under a disk bound (``config["bounded"]``) lists its MFF factors (``mff/*.pt``)
    too: they stand for its gradients. ``extra``: more fields of the manifest.
    """
    found = sorted(folder.glob("*.npy"))
    if isinstance(config, dict) and config.get("bounded"):
        found += sorted(f for f in (folder / "mff").glob("*.pt") if not f.name.startswith(TMP_PREFIX))
    files = {f.relative_to(folder).as_posix(): {"size": f.stat().st_size, "hash": file_checksum(f)} for f in found}
    info = {n: {"n": shapes[n][0], "m": shapes[n][1], "tokens": tokens[n]} for n in names}
    man = {"key": key, "config": config, "k": k, "layers": info, "files": files, "world_size": world_size,
           **(extra or {})}
    (folder / "manifest.json").write_text(json.dumps(man, indent=1))
    return info
