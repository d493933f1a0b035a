r"""The per-batch gradients of one layer as MFF reads them: resident, memory-mapped or streamed.

:class:`GradientStack` holds the ``k`` gradients ``G_i`` (``n x m``) of a layer and yields them in
chunks of batches in the ``(n, k_c, m)`` layout of the two GEMMs that apply the rearranged Fisher
(:mod:`fisherkron.core.operators`). Whatever the source (a tensor, a ``.npy`` file opened memory-mapped,
a stored 16-bit encoding, an iterator spilled to disk once it outgrows ``memory_budget``), the chunks
are the same numbers; only what is resident changes.
"""
from __future__ import annotations

import mmap
import os
import tempfile
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import torch

from .conventions import FisherkronError
from .stored import ENCODINGS, StoredGradients, check_gradient_dtype, gradient_file

__all__ = ["GradientStack", "default_memory_budget"]


def default_memory_budget(device: torch.device) -> int:
    """Half the free memory of a CUDA device, or a quarter of physical RAM on the CPU.

    On CUDA, memory PyTorch's caching allocator holds but no tensor uses counts as free (it is
    this process's to reuse; ``mem_get_info`` reports it as taken).
    """
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        idle = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return int((free + max(idle, 0)) * 0.5)
    try:
        return int(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") * 0.25)
    except (ValueError, OSError, AttributeError):
        return 4 << 30


def _npy_file(src, encoded: bool = False) -> tuple[str, int, np.dtype] | None:
    """``(path, data offset, dtype)`` of a C-ordered memory-mapped ``.npy`` source, else None.

    Only a whole memory map qualifies (its buffer is the ``mmap`` itself): a slice of one
    (``np.load(f, mmap_mode="r")[2:5]``) keeps the file's ``offset`` attribute, which is not
    where the slice starts, so slices are read through the array instead.
    """
    if isinstance(src, np.memmap) and isinstance(src.base, mmap.mmap) and getattr(src, "filename", None) \
            and src.flags.c_contiguous and src.dtype.isnative \
            and (src.dtype in (np.float32, np.float64) or (encoded and src.dtype in (np.float16, np.uint16))):
        return str(src.filename), int(src.offset), src.dtype
    return None


class GradientStack:
    """``k`` per-batch gradients of one ``n x m`` layer, read in chunks of batches.

    Sources: a ``(k, n, m)`` tensor or array of real floats (float16 and ``uint16`` arrays,
    which may be the stored encodings without what decodes them, are refused; see
    :func:`~fisherkron.core.stored.check_gradient_dtype`); a ``.npy`` file path (opened
    memory-mapped, so it may exceed RAM; a 16-bit file through its calibration entry, see
    :func:`~fisherkron.core.stored.gradient_file`) or :class:`~fisherkron.core.stored.StoredGradients`;
    a list or any iterable of ``(n, m)``
    gradients (a one-shot iterator is consumed once and kept in memory, or
    spilled to a temporary ``.npy`` file once it outgrows ``memory_budget``).

    Chunks are yielded in the ``(n, kc, m)`` layout the GEMMs need. When the
    whole stack fits in half the budget it is converted once and kept
    resident on ``device``.

    Args:
        grads: the gradients, as above.
        dtype: compute dtype (float32 default; float64 for references).
        device: where the GEMMs run; CUDA tensors stay on their device.
        memory_budget: bytes the stack and its work buffers may use.
        name: used in error messages (e.g. the layer name).
        allow_empty: accept no gradients at all (``k = 0``): a rank of a process group that
            holds none of the batches (see :mod:`fisherkron.core.distributed`). An empty
            iterable then gives ``n = m = 0`` (the shape is learnt from the other ranks).
    """

    def __init__(self, grads, dtype: torch.dtype = torch.float32, device=None,
                 memory_budget: int | None = None, name: str = "gradients", allow_empty: bool = False):
        self.name = name
        self.allow_empty = allow_empty
        self.dtype = dtype
        self._tmpfile: str | None = None
        if isinstance(grads, GradientStack):
            grads = grads._stored or (grads._source if grads._source is not None else grads.stacked())
        if isinstance(grads, StoredGradients) and grads.encoding == "float32":
            grads = grads.path
        if isinstance(grads, (str, Path)):  # float32/64 as is; a 16-bit file only through its calibration entry
            grads = gradient_file(grads, name)
        self._stored = grads if isinstance(grads, StoredGradients) else None
        if self._stored is not None:
            try:
                grads = np.load(self._stored.path, mmap_mode="r")
            except (OSError, ValueError, EOFError) as exc:
                raise FisherkronError(f"{name}: {self._stored.path} is not a readable .npy array ({exc}); "
                                      f"recollect the calibration") from None
            if grads.dtype != ENCODINGS[self._stored.encoding] or grads.ndim != 3:
                raise FisherkronError(f"{name}: {self._stored.path} holds {grads.dtype} {grads.shape}, not "
                                      f"{self._stored.encoding} gradients")
            if self._stored.encoding == "float16" and len(self._stored.scales or ()) != grads.shape[0]:
                raise FisherkronError(f"{name}: float16 gradients need one scale per gradient")
        elif isinstance(grads, (torch.Tensor, np.ndarray)):
            check_gradient_dtype(grads.dtype, name)
        if isinstance(grads, torch.Tensor) or isinstance(grads, np.ndarray):
            src = grads
        elif isinstance(grads, Iterable):
            src = self._consume(grads, memory_budget)
        else:
            raise FisherkronError(f"{name}: expected a (k, n, m) tensor, a .npy path or an iterable of (n, m) "
                                  f"gradients, got {type(grads).__name__}")
        if src.ndim != 3:
            raise FisherkronError(f"{name}: expected a (k, n, m) stack of gradients, got shape {tuple(src.shape)}")
        self.k, self.n, self.m = (int(s) for s in src.shape)
        if (self.k < 1 and not allow_empty) or ((self.n < 1 or self.m < 1) and self.k > 0):
            raise FisherkronError(f"{name}: empty gradient stack of shape {tuple(src.shape)}")
        if device is None:
            device = src.device if isinstance(src, torch.Tensor) else torch.device("cpu")
        self.device = torch.device(device)
        self._source = src
        self.memory_budget = int(memory_budget) if memory_budget else default_memory_budget(self.device)
        itemsize = torch.finfo(dtype).bits // 8
        self.bytes_per_grad = max(1, self.n * self.m * itemsize)
        # A chunk needs itself, its (n, kc, m) copy and one work buffer of the same size.
        self.chunk_size = max(1, min(self.k, self.memory_budget // (3 * self.bytes_per_grad)))
        self._resident: list[torch.Tensor] | None = None
        self._buf: torch.Tensor | None = None  # flat storage of the reused (n, kc, m) chunks of the streamed path
        self._file = _npy_file(src, encoded=self._stored is not None)
        if self._stored is not None and self._file is None:  # pragma: no cover - np.load gives a whole map
            raise FisherkronError(f"{name}: {self._stored.path} cannot be read as a memory-mapped file")
        if self.k == 0:  # allow_empty: nothing to hold
            self._resident = []
        elif 2 * self.k * self.bytes_per_grad <= self.memory_budget:
            self._resident = list(self._load_chunks(self.k))
            self.chunk_size = self.k

    # -- construction helpers -------------------------------------------------
    def _consume(self, it: Iterable, memory_budget: int | None) -> torch.Tensor | np.ndarray:
        """Stack a one-shot iterable of (n, m) gradients, spilling to disk past the budget."""
        budget = memory_budget or default_memory_budget(torch.device("cpu"))
        store = torch.float64 if self.dtype == torch.float64 else torch.float32
        held: list[torch.Tensor] = []
        held_bytes = 0
        fh = None
        count = 0
        shape = None
        for i, g in enumerate(it):
            try:
                g = torch.as_tensor(g)
            except (TypeError, ValueError, RuntimeError) as exc:  # strings, None, ragged lists
                why = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
                raise FisherkronError(f"{self.name}: gradient {i} is a {type(g).__name__}, not an (n, m) array "
                                      f"({why}); pass a (k, n, m) tensor or (n, m) tensors") from None
            check_gradient_dtype(g.dtype, f"{self.name}: gradient {i}")
            if shape is None:
                shape = tuple(g.shape)
                if len(shape) != 2:
                    raise FisherkronError(f"{self.name}: gradient 0 has shape {shape}, expected (n, m)")
            elif tuple(g.shape) != shape:
                raise FisherkronError(f"{self.name}: gradient {i} has shape {tuple(g.shape)}, "
                                      f"expected {shape} like gradient 0")
            if not torch.isfinite(g).all():
                raise FisherkronError(f"{self.name}: gradient of batch {i} has NaN/inf entries")
            g = g.detach().to("cpu", store)
            count += 1
            if fh is None:
                held.append(g)
                held_bytes += g.numel() * g.element_size()
                if held_bytes > budget // 2:  # spill everything so far to a temporary file
                    fd, self._tmpfile = tempfile.mkstemp(suffix=".bin", prefix="fisherkron-grads-")
                    fh = os.fdopen(fd, "wb")
                    for h in held:
                        fh.write(h.numpy().tobytes())
                    held = []
            else:
                fh.write(g.numpy().tobytes())
        if count == 0:
            if self.allow_empty:
                return torch.zeros(0, 0, 0, dtype=store)
            raise FisherkronError(f"{self.name}: no gradients were given")
        if fh is None:
            return torch.stack(held)
        fh.close()
        np_store = np.float64 if store == torch.float64 else np.float32
        return np.memmap(self._tmpfile, dtype=np_store, mode="r", shape=(count, *shape))

    def _load_chunks(self, size: int, reuse: bool = False) -> Iterator[torch.Tensor]:
        """Yield ``(n, kc, m)`` chunks; with ``reuse`` every chunk is written into one buffer.

        A C-ordered ``.npy`` source is read with plain file reads, one
        gradient at a time, straight into the chunk buffer (so resident memory
        stays at about one chunk plus one gradient, unlike a memory map whose
        touched pages count against the process); other sources are sliced.
        """
        n, m = self.n, self.m
        for start in range(0, self.k, size):
            stop = min(self.k, start + size)
            kc = stop - start
            if reuse:
                if self._buf is None or self._buf.numel() < n * kc * m:
                    self._buf = torch.empty(n * size * m, dtype=self.dtype, device=self.device)
                # the first n kc m entries as a contiguous (n, kc, m) tensor, also for a shorter last chunk
                # (a slice buf[:, :kc] of an (n, size, m) buffer is not, and the products view it as (n kc, m))
                out = self._buf[: n * kc * m].view(n, kc, m)
            else:
                out = None
            if self._file is not None:
                out = self._read_file_chunk(start, stop, out)
            else:
                part = self._source[start:stop]
                if isinstance(part, np.ndarray):
                    with warnings.catch_warnings():  # a read-only memory map: these tensors are only read
                        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
                        part = torch.from_numpy(np.ascontiguousarray(part))
                part = part.to(self.device, self.dtype)  # (kc, n, m)
                self._check_chunk(part, start)
                if out is None:
                    out = part.permute(1, 0, 2).contiguous()  # (n, kc, m)
                else:
                    out.copy_(part.permute(1, 0, 2))
            yield out

    def _check_chunk(self, part: torch.Tensor, start: int) -> None:
        if torch.isfinite(part.sum()):  # one pass, no mask; the full check only if the sum is not finite
            return
        if not torch.isfinite(part).all():
            bad = (~torch.isfinite(part)).flatten(1).any(1).nonzero()[0, 0].item() + start
            raise FisherkronError(f"{self.name}: gradient of batch {bad} has NaN/inf entries")

    def _read_file_chunk(self, start: int, stop: int, out: torch.Tensor | None) -> torch.Tensor:
        path, offset, np_dtype = self._file
        n, m = self.n, self.m
        if out is None:
            out = torch.empty(n, stop - start, m, dtype=self.dtype, device=self.device)
        host = np.empty((n, m), dtype=np_dtype)  # one gradient
        host_t = torch.from_numpy(host)
        enc = self._stored.encoding if self._stored is not None else None
        if enc == "bfloat16":
            host_t = host_t.view(torch.bfloat16)  # the stored uint16 are bfloat16 bits
        nbytes = host.nbytes
        with open(path, "rb", buffering=0) as fh:
            fh.seek(offset + start * nbytes)
            for j in range(stop - start):
                if fh.readinto(memoryview(host).cast("B")) != nbytes:
                    raise FisherkronError(f"{self.name}: gradient file {path} is truncated at batch {start + j}")
                self._check_chunk(host_t[None], start + j)  # (1, n, m)
                out[:, j].copy_(host_t)  # (n, m) into the (n, kc, m) layout
                if enc == "float16":
                    out[:, j].mul_(self._stored.scales[start + j])
        return out

    def chunks(self, reuse: bool = True) -> Iterator[torch.Tensor]:
        """Yield the gradients as ``(n, kc, m)`` tensors on ``device``.

        On the streamed path the chunks share one buffer unless ``reuse=False``:
        use each chunk before asking for the next.
        """
        if self._resident is not None:
            yield from self._resident
        else:
            yield from self._load_chunks(self.chunk_size, reuse=reuse)

    @classmethod
    def of(cls, grads, dtype: torch.dtype, **kwargs) -> "GradientStack":
        """``grads`` itself when it is already a stack in ``dtype``, else a new stack over it."""
        if isinstance(grads, cls) and grads.dtype == dtype:
            return grads
        return cls(grads, dtype=dtype, **kwargs)

    @property
    def streamed(self) -> bool:
        """True when the gradients are re-read chunk by chunk on every pass."""
        return self._resident is None

    def stacked(self) -> torch.Tensor:
        """All gradients as one ``(k, n, m)`` tensor (small problems only)."""
        return torch.cat([c.permute(1, 0, 2) for c in self.chunks(reuse=False)], dim=0)

    def gram(self) -> torch.Tensor:
        """Gram matrix ``Gamma[i, j] = <G_i, G_j>`` (``k x k``, float64)."""
        K = torch.zeros(self.k, self.k, dtype=torch.float64, device=self.device)
        offs_i = 0
        for ci in self.chunks(reuse=False):
            fi = ci.permute(1, 0, 2).reshape(ci.shape[1], -1)  # (kc_i, n m)
            offs_j = 0
            for cj in self.chunks(reuse=False):
                if offs_j >= offs_i:
                    fj = cj.permute(1, 0, 2).reshape(cj.shape[1], -1)
                    blk = (fi @ fj.T).double()
                    K[offs_i:offs_i + fi.shape[0], offs_j:offs_j + fj.shape[0]] = blk
                    K[offs_j:offs_j + fj.shape[0], offs_i:offs_i + fi.shape[0]] = blk.T
                offs_j += cj.shape[1]
            offs_i += ci.shape[1]
        return K

    def fisher_norm_sq(self) -> float:
        """``||F||_F^2 = (1/k^2) sum_ij <G_i, G_j>^2`` from the ``k x k`` Gram matrix."""
        return float((self.gram() ** 2).sum() / self.k ** 2)

    def close(self) -> None:
        if self._tmpfile and os.path.exists(self._tmpfile):
            self._source = None
            os.unlink(self._tmpfile)
            self._tmpfile = None

    def __del__(self):  # pragma: no cover - best effort cleanup of spilled gradients
        try:
            self.close()
        except Exception:  # noqa: BLE001
            pass
