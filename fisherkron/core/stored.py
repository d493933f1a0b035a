r"""Gradients as fisherkron stores them on disk, and what a gradient source may hold (paper Sec. 6.3).

The calibration (:func:`fisherkron.collect_calibration`) writes the ``k`` per-batch gradients
``G_i`` (``n x m``) of a layer to ``<entry>/<layer>.grads.npy`` (``(k, n, m)``) in one of
:data:`ENCODINGS`, and records the encoding as ``config.grad_dtype`` in ``<entry>/manifest.json``:

* ``"float32"``: the values;
* ``"bfloat16"``: the upper 16 bits of each float32, stored as ``uint16``;
* ``"float16"``: ``G_i / s_i``, with the per-gradient scales ``s_i = max |G_i|`` in
  ``<entry>/<layer>.grad_scales.npy`` (``k`` entries).

A 16-bit file alone does not say how to decode it (its ``float16`` values are scaled, its
``uint16`` values are bit patterns), so :func:`gradient_file` decodes one only inside its
calibration entry, whose manifest names the encoding and, for float16, whose scales lie beside it;
elsewhere it refuses in one line and names the way to read it. In memory,
:func:`check_gradient_dtype` refuses what cannot be a gradient of a real layer (complex or
integer values) and ``float16`` arrays, which may be the scaled encoding without its scales.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .conventions import FisherkronError

__all__ = ["ENCODINGS", "GRADS_SUFFIX", "SCALES_SUFFIX", "ENTRY_MANIFEST", "StoredGradients", "encode_gradient",
           "gradient_file", "check_gradient_dtype"]

#: encodings of stored gradients: the numpy dtype on disk (float16 keeps a per-gradient scale)
ENCODINGS = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}
#: ``<layer>.grads.npy``: the ``(k, n, m)`` gradients of a layer in a calibration entry
GRADS_SUFFIX = ".grads.npy"
#: ``<layer>.grad_scales.npy``: the ``k`` scales ``s_i`` of its float16 gradients
SCALES_SUFFIX = ".grad_scales.npy"
#: the calibration entry's manifest; ``config.grad_dtype`` names the encoding of its gradients
ENTRY_MANIFEST = "manifest.json"

#: how to read a calibration entry's gradients, named in the refusals below
READ_ENTRY = "CalibrationStats(...).gradients(layer) (what fisherkron.collect_calibration returns)"


@dataclass(frozen=True)
class StoredGradients:
    r"""A ``(k, n, m)`` ``.npy`` file of gradients in a compact encoding, read back as float32.

    * ``"float32"``: as is;
    * ``"bfloat16"``: the upper 16 bits of each float32 (stored as ``uint16``; 8 exponent bits,
      so no gradient underflows; relative rounding ``2^-8``);
    * ``"float16"``: ``G_i / s_i`` with the per-gradient scale ``s_i = max |G_i|`` kept in
      ``scales`` (float16's 5 exponent bits would flush small gradients to zero; scaled, the
      relative rounding is ``2^-12``).

    :class:`~fisherkron.core.gradient_stack.GradientStack` decodes them gradient by gradient while
    it reads, so a stack in a 16-bit encoding takes half the disk and the same work memory.
    """

    path: str
    encoding: str = "float32"
    scales: tuple | None = None

    def __post_init__(self):
        if self.encoding not in ENCODINGS:
            raise FisherkronError(f"gradient encoding {self.encoding!r} is unknown; use one of {', '.join(ENCODINGS)}")


def encode_gradient(G: torch.Tensor, encoding: str) -> tuple[np.ndarray, float]:
    """``(stored array, scale)`` of one ``(n, m)`` gradient in ``encoding`` (see :class:`StoredGradients`)."""
    G = G.detach().float().cpu()
    if encoding == "float32":
        return G.numpy(), 1.0
    if encoding == "bfloat16":
        return G.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16), 1.0
    if encoding == "float16":
        scale = float(G.abs().max())
        scale = scale if scale > 0 else 1.0
        return (G / scale).to(torch.float16).numpy(), scale
    raise FisherkronError(f"gradient encoding {encoding!r} is unknown; use one of {', '.join(ENCODINGS)}")


def _encoding_of(dtype) -> str | None:
    """The 16-bit encoding whose on-disk dtype is ``dtype`` (``None`` for any other dtype)."""
    return {np.dtype(np.float16): "float16", np.dtype(np.uint16): "bfloat16"}.get(np.dtype(dtype))


def _how_to_read(encoding: str) -> str:
    explicit = ("StoredGradients(path, 'float16', scales)" if encoding == "float16"
                else "StoredGradients(path, 'bfloat16')")
    return f"read it with {READ_ENTRY}, or pass {explicit} (fisherkron.core.stored)"


def _scales_of(path: Path, k: int, name: str) -> tuple[float, ...]:
    """The ``k`` scales ``s_i`` kept beside the float16 gradient file ``path``."""
    sp = path.with_name(path.name[: -len(GRADS_SUFFIX)] + SCALES_SUFFIX)
    try:
        s = np.load(sp)
    except (OSError, ValueError, EOFError) as exc:
        raise FisherkronError(f"{name}: {path} holds float16 gradients G_i / s_i, but their scales {sp.name} are "
                              f"missing or unreadable ({type(exc).__name__}); the calibration entry is damaged: "
                              f"delete {path.parent} and collect it again") from None
    if s.shape != (k,) or not np.issubdtype(s.dtype, np.floating) or not np.isfinite(s).all() or (s <= 0).any():
        raise FisherkronError(f"{name}: {sp} should hold {k} finite positive scales, one per gradient of {path.name}, "
                              f"but holds {s.dtype} {s.shape}; delete {path.parent} and collect it again")
    return tuple(float(x) for x in s)


def _entry_encoding(path: Path, arr: np.ndarray, name: str) -> StoredGradients:
    """A 16-bit gradient file decoded through its calibration entry, or a one-line refusal."""
    encoding = _encoding_of(arr.dtype)
    what = (f"{arr.dtype} values (fisherkron's {encoding} encoding: "
            + ("G_i / s_i, whose per-gradient scales s_i are kept beside it)" if encoding == "float16"
               else "bfloat16 bits)"))
    manifest = path.parent / ENTRY_MANIFEST
    if not path.name.endswith(GRADS_SUFFIX) or not manifest.is_file():
        raise FisherkronError(f"{name}: {path} holds {what}, but it is not inside a calibration entry "
                              f"(<entry>/<layer>{GRADS_SUFFIX} beside {ENTRY_MANIFEST}) that says how to decode it; "
                              f"{_how_to_read(encoding)}")
    try:
        man = json.loads(manifest.read_text())
        stored = man["config"].get("grad_dtype", "float32")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise FisherkronError(f"{name}: {path} holds {what}, and {manifest} is unreadable ({type(exc).__name__}); "
                              f"delete {path.parent} and collect the calibration again") from None
    if stored != encoding:
        raise FisherkronError(f"{name}: {path} holds {arr.dtype} values, but its calibration entry stores "
                              f"{stored} gradients; the file does not belong to it: delete {path.parent} and "
                              f"collect the calibration again")
    if arr.ndim != 3:
        raise FisherkronError(f"{name}: expected a (k, n, m) stack of gradients in {path}, got shape {arr.shape}")
    scales = _scales_of(path, int(arr.shape[0]), name) if encoding == "float16" else None
    return StoredGradients(str(path), encoding, scales)


def gradient_file(path, name: str = "gradients") -> np.ndarray | StoredGradients:
    """The gradients of a ``.npy`` file, ready for :class:`~fisherkron.core.gradient_stack.GradientStack`.

    A float32 or float64 file is opened memory-mapped as it is. A 16-bit file (float16 or
    ``uint16``) is fisherkron's compact encoding and is decoded only where its calibration
    entry's ``manifest.json`` names that encoding (and, for float16, its scales lie beside it):
    then it is returned as :class:`StoredGradients`. Anything else is refused in one line.
    """
    path = Path(path)
    if not path.exists():
        raise FisherkronError(f"{name}: gradient file {path} does not exist")
    try:
        arr = np.load(path, mmap_mode="r")
    except (OSError, ValueError, EOFError) as exc:  # truncated, not .npy, pickled objects
        raise FisherkronError(f"{name}: {path} is not a readable .npy array ({exc}); "
                              f"recollect the calibration") from None
    if _encoding_of(arr.dtype) is not None:
        return _entry_encoding(path, arr, name)
    if not np.issubdtype(arr.dtype, np.floating):
        raise FisherkronError(f"{name}: {path} holds {arr.dtype} values; gradients must be floats "
                              f"(float32 or float64)")
    return arr


def check_gradient_dtype(dtype, name: str = "gradients") -> None:
    """Refuse in one line an in-memory gradient dtype that cannot be read as real gradient values.

    Complex, integer, boolean and object values are no gradients of a real layer; ``float16``
    arrays may be fisherkron's scaled encoding (``G_i / s_i``) without its scales and ``uint16``
    ones its bfloat16 bits, so both are refused with the way to read them. ``bfloat16``
    tensors hold values and are accepted.
    """
    if isinstance(dtype, torch.dtype):
        if dtype.is_complex:
            raise FisherkronError(f"{name}: the gradients are complex ({dtype}); MFF factorises the real gradients "
                                  f"of a real layer: pass real tensors")
        if dtype == torch.float16:
            raise FisherkronError(f"{name}: float16 gradients may be fisherkron's scaled encoding G_i / s_i without "
                                  f"their scales; {_how_to_read('float16')}; true float16 values: pass G.float()")
        if dtype == getattr(torch, "uint16", None):
            raise FisherkronError(f"{name}: uint16 gradients are fisherkron's bfloat16 bits; "
                                  f"{_how_to_read('bfloat16')}")
        if not dtype.is_floating_point:
            raise FisherkronError(f"{name}: the gradients hold {dtype} values; gradients must be floats: "
                                  f"pass G.float()")
        return
    dtype = np.dtype(dtype)
    if np.issubdtype(dtype, np.complexfloating):
        raise FisherkronError(f"{name}: the gradients are complex ({dtype}); MFF factorises the real gradients "
                              f"of a real layer: pass real arrays")
    encoding = _encoding_of(dtype)
    if encoding == "float16":
        raise FisherkronError(f"{name}: float16 gradients may be fisherkron's scaled encoding G_i / s_i without "
                              f"their scales; {_how_to_read('float16')}; true float16 values: pass "
                              f"G.astype(np.float32)")
    if encoding == "bfloat16":
        raise FisherkronError(f"{name}: uint16 gradients are fisherkron's bfloat16 bits; {_how_to_read('bfloat16')}")
    if not np.issubdtype(dtype, np.floating):
        raise FisherkronError(f"{name}: the gradients hold {dtype} values; gradients must be floats: "
                              f"pass G.astype(np.float32)")
