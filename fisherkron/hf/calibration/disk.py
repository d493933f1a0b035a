r"""The disk a calibration takes, and the groups of layers a bound on it allows (``max_disk``).

The per-batch gradients of Eq. (8) dominate: ``k`` gradients ``G_i`` (``n x m``) per layer,
``k n m`` entries of the ``grad_dtype`` (4 or 2 bytes), so ``k x sum(n m) x bytes`` for the
model (``granularity="token"``: the layer's inputs and output gradients, ``T (n + m)`` float32).
Beside them an entry holds the statistics (:func:`~.accumulate.save_statistics`) and, once
compression has run, MFF's ``A`` (``m x m``) and ``B`` (``n x n``) in float64.

Under a bound the layers are collected in groups (:mod:`.bounded`): all statistics and factors
stay (:attr:`DiskPlan.fixed`), and only one group's gradients, and the checkpoint of its running
sums, are on disk at once. :func:`plan_groups` packs the layers, in model order, into the
fewest groups whose peak stays under the bound; every size here is an upper bound of the
file it stands for (``.npy`` headers exactly, ``torch.save`` files with a margin).
"""
from __future__ import annotations

import io
import math
import numbers
import re
from dataclasses import dataclass, field

import numpy as np

from ...core.conventions import FisherkronError

__all__ = ["parse_size", "format_size", "npy_bytes", "LayerDisk", "layer_disk", "DiskPlan", "plan_groups",
           "FACTOR_ENTRY", "gradient_files"]

#: bytes of one entry of MFF's factors as an entry keeps them (``A``, ``B`` are float64)
FACTOR_ENTRY = 8
#: a ``torch.save`` file's own bytes beyond its tensors (pickle, zip records, 64-byte alignment; measured ~2 kB)
TORCH_FILE_MARGIN = 8 * 1024
#: bytes the checkpoint spends per recorded row range of a gradient file (a CRC and two ints, pickled)
ROW_RECORD = 64
#: the manifest (the model's record, a checksum per file), the owner marker and the bookkeeping files
MANIFEST_MARGIN = 1 << 20
#: per layer, the manifest's and the group record's lines for its files
LAYER_MARGIN = 4 * 1024

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(size) -> int:
    """Bytes from a number of bytes or a string such as ``"20GB"``, ``"1.5 TB"``, ``"500MiB"``.

    ``kB, MB, GB, TB`` are powers of 1000, ``KiB, MiB, GiB, TiB`` of 1024 (a bare ``K, M, G, T``
    is decimal too).

    >>> parse_size("20GB"), parse_size("1.5 tb"), parse_size("512MiB"), parse_size(4096)
    (20000000000, 1500000000000, 536870912, 4096)
    """
    if isinstance(size, numbers.Real) and not isinstance(size, bool):
        if not math.isfinite(size) or size <= 0:
            raise FisherkronError(f"a disk size must be a positive number of bytes; got {size!r}")
        return int(size)
    if not isinstance(size, str):
        raise FisherkronError(f"a disk size is a number of bytes or a string such as '20GB'; got "
                              f"{type(size).__name__} {size!r}")
    got = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", size)
    unit = got.group(2).lower() if got else None
    if got is None or unit not in _UNITS:
        raise FisherkronError(f"cannot read the disk size {size!r}: write a number and a unit, e.g. '20GB', "
                              f"'1.5TB' or '500MiB' (kB/MB/GB/TB: powers of 1000, KiB/MiB/GiB/TiB: of 1024)")
    value = float(got.group(1)) * _UNITS[unit]
    if value < 1:
        raise FisherkronError(f"the disk size {size!r} is less than one byte")
    return int(value)


def format_size(n: float) -> str:
    """``n`` bytes in the decimal unit that reads best.

    >>> format_size(6.8e9), format_size(1234), format_size(12)
    ('6.80 GB', '1.23 kB', '12 bytes')
    """
    for f, unit in ((1e12, "TB"), (1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
        if n >= f:
            return f"{n / f:.2f} {unit}"
    return f"{int(n)} bytes"


def npy_bytes(dtype, shape) -> int:
    """The exact size of a ``.npy`` file of ``dtype`` and ``shape`` (its header and its data).

    >>> npy_bytes(np.float32, (32, 1536, 576))
    113246336
    """
    dtype = np.dtype(dtype)
    head = io.BytesIO()
    np.lib.format.write_array_header_1_0(head, {"descr": np.lib.format.dtype_to_descr(dtype),
                                               "fortran_order": False, "shape": tuple(int(s) for s in shape)})
    return len(head.getvalue()) + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize


def gradient_files(name: str, granularity: str) -> tuple[str, ...]:
    """The files of layer ``name`` that hold its gradients (deleted by a bounded collection once MFF ran)."""
    if granularity == "token":
        return f"{name}.X.npy", f"{name}.D.npy"
    return f"{name}.grads.npy", f"{name}.grad_scales.npy"


@dataclass(frozen=True)
class LayerDisk:
    """Bytes of one layer's files: ``gradients`` (its ``G_i``, or ``X``, ``D``), ``statistics`` (the other
    ``.npy`` files), ``factors`` (MFF's ``A``, ``B``), ``sums`` (its running sums in a checkpoint)."""

    gradients: int
    statistics: int
    factors: int
    sums: int
    rows: int  # row ranges a checkpoint records for its gradient files


def layer_disk(n: int, m: int, *, k: int, stats, grad_dtype: str = "float32", granularity: str = "batch",
               tokens: int | None = None) -> LayerDisk:
    """The files an ``n x m`` layer's calibration writes (:class:`LayerDisk`).

    ``k``: the gradients per layer (for ``granularity="sequence"`` the sequences); ``tokens``:
    the tokens the layer sees (``granularity="token"`` only).

    >>> d = layer_disk(1536, 576, k=32, stats=("grads",), grad_dtype="bfloat16")
    >>> d.gradients, d.factors > 8 * (1536**2 + 576**2)
    (56623232, True)
    """
    from ...core.stored import ENCODINGS

    stats = set(stats)
    grads = 0
    rows = 0
    if "grads" in stats:
        if granularity == "token":
            if tokens is None:
                raise FisherkronError("granularity='token' needs the token count of the batches")
            grads = npy_bytes(np.float32, (tokens, m)) + npy_bytes(np.float32, (tokens, n))
            rows = 2 * k  # one range per batch and file, at the least
        else:
            grads = npy_bytes(ENCODINGS[grad_dtype], (k, n, m))
            grads += npy_bytes(np.float64, (k,)) if grad_dtype == "float16" else 0
            rows = k
    st = 0
    sums = 0
    if "diag_fisher" in stats:
        st += npy_bytes(np.float64, (n, m))
        sums += 4 * n * m
    if "abs_mean" in stats:
        st += npy_bytes(np.float32, (m,))
        sums += 8 * m
    if "xxt" in stats or "kfac" in stats:
        st += npy_bytes(np.float64, (m, m))
        sums += 8 * m * m
    if "kfac" in stats:
        st += npy_bytes(np.float64, (n, n))
        sums += 8 * n * n
    factors = FACTOR_ENTRY * (m * m + n * n) + TORCH_FILE_MARGIN if "grads" in stats else 0
    return LayerDisk(grads, st, factors, sums, rows)


@dataclass
class DiskPlan:
    """How a calibration uses the disk under a bound.

    Attributes:
        groups: the layers, in model order, collected together (one forward + backward of
            every batch per group: ``k x len(groups)`` passes).
        fixed: bytes of the finished entry: every layer's statistics and MFF factors, and the manifest.
        peak: the most the folder holds at once, an upper bound: the statistics and factors of the
            groups done, and the group under way's own with its gradients and checkpoint.
        gradients: bytes of the gradient files of the largest group (alive at once).
        unbounded: the gradient files of all layers (what an unbounded collection keeps).
        unbounded_peak: the most an unbounded entry holds once compression has written its factors.
        minimum: the smallest bound under which every layer can be collected.
    """

    groups: list[list[str]]
    fixed: int
    peak: int
    gradients: int
    unbounded: int
    unbounded_peak: int
    minimum: int
    sizes: dict[str, LayerDisk] = field(repr=False, default_factory=dict)


def _transient(sizes: dict[str, LayerDisk], group: list[str]) -> int:
    """Bytes a group holds only while it is collected: its gradients, its checkpoint (two copies while one is
    rewritten) and a rewritten factor file beside its old copy."""
    ckpt = sum(sizes[n].sums + ROW_RECORD * sizes[n].rows for n in group) + TORCH_FILE_MARGIN
    return sum(sizes[n].gradients for n in group) + 2 * ckpt + max(sizes[n].factors for n in group)


def _kept(sizes: dict[str, LayerDisk], names) -> int:
    """Bytes the layers ``names`` keep to the end: their statistics and factors."""
    return sum(sizes[n].statistics + sizes[n].factors for n in names)


def plan_groups(sizes: dict[str, LayerDisk], max_disk: int | None, *, done=(), option: str = "max_disk") -> DiskPlan:
    """Pack the layers of ``sizes`` (model order) into consecutive groups whose peak stays under ``max_disk``.

    Greedy: a group takes layers while what is on disk then fits: the manifest's margin, the
    statistics and factors of the layers collected before it (``done`` first, they are on disk
    already) and of the group, the group's gradients, twice its checkpoint and one factor
    file's rewrite. Early groups are the largest; the factors add up as the groups go by.
    ``max_disk=None``: one group. A bound under :attr:`DiskPlan.minimum` is refused in one line
    naming the layer that needs the most, its bytes and the bound; ``option`` names the setting
    in that line (``--max-disk`` on the command line).

    >>> s = {f"l{i}": layer_disk(400, 240, k=8, stats=("grads",)) for i in range(6)}
    >>> p = plan_groups(s, None); len(p.groups), p.peak == p.unbounded_peak
    (1, True)
    >>> [len(g) for g in plan_groups(s, p.fixed + (p.peak - p.fixed) // 2).groups]  # half the gradients' room
    [3, 2, 1]
    """
    names = [n for n in sizes if n not in set(done)]
    if not sizes:
        raise FisherkronError("no layers to plan the calibration's disk for")
    margin = MANIFEST_MARGIN + LAYER_MARGIN * len(sizes)
    fixed = margin + _kept(sizes, sizes)
    unbounded = sum(s.gradients for s in sizes.values())
    unbounded_peak = fixed + _transient(sizes, list(sizes))
    before = margin + _kept(sizes, done)
    need, at = {}, before
    for n in names:  # each layer alone, after every layer before it
        at += _kept(sizes, [n])
        need[n] = at + _transient(sizes, [n])
    minimum = max(need.values(), default=fixed)
    if max_disk is None or not names:
        return DiskPlan([names] if names else [], fixed, unbounded_peak, unbounded, unbounded, unbounded_peak,
                        minimum, sizes)
    if fixed > max_disk:
        raise FisherkronError(f"the statistics and MFF factors of the {len(sizes)} selected layers alone take "
                              f"{format_size(fixed)} on disk, more than {option}={format_size(max_disk)}; raise "
                              f"{option} to at least {format_size(minimum)} or select fewer layers")
    if minimum > max_disk:
        n = max(need, key=need.get)
        raise FisherkronError(f"layer {n} needs {format_size(sizes[n].gradients)} for its gradients, "
                              f"{format_size(need[n])} with the statistics and factors kept by then, more than "
                              f"{option}={format_size(max_disk)}; raise {option} to at least "
                              f"{format_size(minimum)}, store the gradients in 16 bits (grad_dtype='bfloat16'), "
                              f"use fewer batches or leave the layer out")
    groups: list[list[str]] = []
    peaks: list[int] = []
    for n in names:
        if groups and before + _kept(sizes, groups[-1] + [n]) + _transient(sizes, groups[-1] + [n]) <= max_disk:
            groups[-1].append(n)
        else:
            if groups:
                before += _kept(sizes, groups[-1])
            groups.append([n])
        peaks[len(groups) - 1:] = [before + _kept(sizes, groups[-1]) + _transient(sizes, groups[-1])]
    biggest = max(sum(sizes[n].gradients for n in g) for g in groups)
    return DiskPlan(groups, fixed, max(peaks), biggest, unbounded, unbounded_peak, minimum, sizes)
