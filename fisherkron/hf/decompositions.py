r"""Each layer's full weighted SVD, computed once per (method, layer, statistics) and sliced for every rank.

:class:`Decompositions` keeps the :class:`~fisherkron.core.wsvd.Decomposition` of Eq. (7),
``L_B^T W L_A = U S V^T`` with ``P = L_B^{-T} U``, ``S`` and ``Q = L_A^{-T} V``, of every layer a
study asks for: :func:`~fisherkron.hf.allocation.fisher_curves`, the sensitivity sweep,
:func:`~fisherkron.hf.allocation.allocate` and :func:`fisherkron.compress` take one as
``decompositions=``, so a study that compresses a model at several ratios and allocations runs
one SVD per (method, layer) instead of one per case.

Given a ``folder``, the decompositions are also kept on disk, so that the next process (the next
notebook on the same model and calibration) reads them instead of factorising again: one file per
layer, ``8 (n + m + 1) min(n, m)`` bytes in float64, written atomically, named by the hash of
everything the numbers depend on (the in-memory key below, the source of the code that computes
them and the torch version), checked against a checksum of its arrays when read (a damaged or
unreadable file is computed again and replaced) and bounded in size: past ``max_bytes`` the files
least recently used are removed. The arrays are stored exactly, so a decomposition read back equals
the one computed, bit for bit.
"""
from __future__ import annotations

import hashlib
import logging
import os
from functools import lru_cache
from pathlib import Path

import torch
from torch import nn

from .._version import __version__
from ..core.conventions import FisherkronError
from ..core.regularization import MIN_ALPHA
from ..core.wsvd import Decomposition
from ..env import TMP_PREFIX, atomic_write, code_digest, remove_stale_temporaries
from .calibration import CalibrationStats, layer_fingerprint
from .calibration.disk import parse_size
from .sensitivity import decompose_layer, layer_statistics, options_key

__all__ = ["Decompositions", "DEFAULT_MAX_BYTES", "default_max_bytes"]

log = logging.getLogger(__name__)

#: the disk a folder of decompositions may take unless ``$FISHERKRON_DECOMPOSITION_CACHE`` says otherwise
#: (SmolLM2-135M: about 1.3 GB per method and calibration)
DEFAULT_MAX_BYTES = "10GB"
FORMAT = "decomposition-1"
#: the sources whose code decides a decomposition's numbers (their text enters a file's name)
_CODE = ("core/*.py", "hf/calibration/*.py", "hf/sensitivity.py", "hf/decompositions.py")


@lru_cache(maxsize=1)
def _code_tag() -> str:
    pkg = Path(__file__).resolve().parents[1]
    files = sorted({p for pattern in _CODE for p in pkg.glob(pattern)})
    return f"{FORMAT}/{__version__}/{code_digest(files)}/torch-{torch.__version__}"


def _size(size) -> int:
    """:func:`~fisherkron.hf.calibration.disk.parse_size`, with ``0`` (keep nothing on disk) allowed."""
    return 0 if str(size).strip() == "0" else parse_size(size)


def default_max_bytes() -> int:
    """``$FISHERKRON_DECOMPOSITION_CACHE`` (a size such as ``"4GB"``; ``0`` keeps nothing on disk), else
    :data:`DEFAULT_MAX_BYTES`."""
    return _size(os.environ.get("FISHERKRON_DECOMPOSITION_CACHE") or DEFAULT_MAX_BYTES)


def _digest(arrays) -> str:
    """blake2b of the arrays' bytes (exact: independent of how a sum would be ordered)."""
    h = hashlib.blake2b(digest_size=16)
    for t in arrays:
        h.update(str(tuple(t.shape)).encode())
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def _kept(given: dict) -> dict:
    """What an entry keeps of a layer's statistics: the split-half intensities ``(lambda_A, lambda_B)``. The
    factors and Grams are left to the calibration's cache: kept for every layer they would cost
    ``8 (n^2 + m^2)`` bytes each (Qwen2.5-0.5B's K-FAC or MFF factors: about 15 GB), against the
    ``8 (n + m) min(n, m)`` of the decomposition itself."""
    return {k: v for k, v in given.items() if k == "shrinkage"}


class Decompositions:
    """Each layer's full weighted SVD by a method, computed once and sliced for every rank asked.

    An entry is keyed by the method, the layer's name, weight fingerprint, dtype and device, the
    calibration key and every option that changes the weights (regularisation, ``mff_options``,
    described by content), so a changed weight or statistic is recomputed, never served stale.
    ``folder``: also keep them on disk there (see the module's text), at most ``max_bytes``
    (bytes or a size such as ``"10GB"``; default :func:`default_max_bytes`). Without it, in memory
    only (float64: about ``8 (n + m) min(n, m)`` bytes a layer); :meth:`clear` frees the memory.
    ``hits`` / ``misses`` count memory hits and computations, ``disk_hits`` the files read.
    """

    def __init__(self, folder: str | os.PathLike | None = None, max_bytes: int | str | None = None):
        self._store: dict[tuple, tuple] = {}
        self.hits = self.misses = self.disk_hits = 0
        self._swept = False
        self.folder = Path(folder) if folder is not None else None
        self.max_bytes = default_max_bytes() if max_bytes is None else _size(max_bytes)
        if self.max_bytes == 0:
            self.folder = None

    def __len__(self) -> int:
        return len(self._store)

    def clear(self) -> None:
        self._store.clear()

    def get(self, module: nn.Linear, method: str, stats: CalibrationStats | None, name: str, *,
            mff_options: dict | None = None, alpha: float | None = None, min_alpha: float = MIN_ALPHA,
            regularization: str = "diag", asvd_alpha: float = 0.5, device=None, info: dict | None = None):
        """The :class:`~fisherkron.core.wsvd.Decomposition` of ``module`` by ``method``, and the statistics read.

        Returns ``(decomposition, given)`` where ``given`` are the statistics
        (:func:`~fisherkron.hf.sensitivity.layer_statistics`) as read for this call; an entry keeps only their
        small part (:func:`_kept`), so a memory hit's ``given`` lacks the factors and Grams, which a caller reads
        from the calibration again. ``info`` receives MFF's diagnostics for the GFWSVD family.
        """
        W = module.weight
        key = (method, name, layer_fingerprint(module), str(W.dtype), str(W.device),
               stats.key if stats is not None else None,
               options_key(alpha=alpha, min_alpha=min_alpha, regularization=regularization,
                           asvd_alpha=asvd_alpha if method == "asvd" else None, mff_options=mff_options or {}))
        hit = self._store.get(key)
        if hit is not None:
            self.hits += 1
            if info is not None:
                info.update(hit[2])
            return hit[0], hit[1]
        mff_info: dict = {}
        dec = self._read(key, W)
        if dec is not None:  # the statistics as the computation would read them; only the factorisation is saved
            given = layer_statistics(stats, method, name, mff_options, device=device, info=mff_info)
            self.disk_hits += 1
        else:
            self.misses += 1
            dec, given = decompose_layer(module, method, stats, name, mff_options=mff_options, alpha=alpha,
                                         min_alpha=min_alpha, regularization=regularization, asvd_alpha=asvd_alpha,
                                         device=device, info=mff_info)
            self._write(key, dec)
        self._store[key] = (dec, _kept(given), mff_info)
        if info is not None:
            info.update(mff_info)
        return dec, given

    # -- the disk tier
    def _path(self, key: tuple) -> Path:
        h = hashlib.blake2b(repr((key, _code_tag())).encode(), digest_size=16).hexdigest()
        return self.folder / f"{h}.pt"

    def _read(self, key: tuple, W: torch.Tensor) -> Decomposition | None:
        if self.folder is None:
            return None
        path = self._path(key)
        if not path.is_file():
            return None
        try:
            rec = torch.load(path, map_location=W.device, weights_only=True)
            P, S, Q = rec["P"], rec["S"], rec["Q"]
            ok = (rec["key"] == repr(key) and _digest((P, S, Q)) == rec["digest"]
                  and (P.shape[0], Q.shape[0]) == tuple(W.shape))
        except Exception as exc:  # noqa: BLE001 - a file cut short or damaged: computed again and replaced
            log.warning("decomposition file %s is unreadable (%s); computing it again", path.name, exc)
            ok = False
        if not ok:
            path.unlink(missing_ok=True)
            return None
        os.utime(path)  # recently used: the last to be removed
        return Decomposition(P, S, Q, getattr(torch, rec["out_dtype"]), alpha_A=rec["alpha_A"],
                             alpha_B=rec["alpha_B"])

    def _write(self, key: tuple, dec: Decomposition) -> None:
        if self.folder is None:
            return
        P, S, Q = dec.P.cpu(), dec.S.cpu(), dec.Q.cpu()
        rec = {"key": repr(key), "P": P, "S": S, "Q": Q, "out_dtype": str(dec.out_dtype).removeprefix("torch."),
               "alpha_A": dec.alpha_A, "alpha_B": dec.alpha_B, "digest": _digest((P, S, Q))}
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            if not self._swept:  # what a process killed while writing left behind
                remove_stale_temporaries(self.folder)
                self._swept = True
            atomic_write(self._path(key), lambda tmp: torch.save(rec, tmp))
            self._evict()
        except (OSError, FisherkronError) as exc:  # a full or read-only disk costs the next process a recomputation
            log.warning("decomposition not kept on disk (%s); it stays in memory", exc)

    def _evict(self) -> None:
        """Remove the least recently used files until the folder holds at most ``max_bytes``."""
        files = []
        for p in self.folder.glob("*.pt"):
            if p.name.startswith(TMP_PREFIX):  # another process's file being written
                continue
            try:
                st = p.stat()
            except FileNotFoundError:  # removed by another process meanwhile
                continue
            files.append((st.st_mtime, st.st_size, p))
        total = sum(size for _, size, _ in files)
        for _, size, p in sorted(files):
            if total <= self.max_bytes:
                break
            p.unlink(missing_ok=True)
            total -= size
