r"""Matrix-free rearranged Fisher (paper Sec. 4.1, Eq. (12), Appendices B-C).

For per-batch gradients ``G_i`` (``n x m``) the empirical Fisher
``F = (1/k) sum_i vec(G_i) vec(G_i)^T`` is rearranged (Van Loan-Pitsianis)
into ``R(F) = (1/k) sum_i G_i^T (x) G_i^T`` (``m^2 x n^2``; see
:mod:`fisherkron.conventions`). It is applied without ever forming ``F``:

.. math::
    R(F)\,\mathrm{vec}(Z) = \mathrm{vec}\Big(\tfrac1k\sum_i G_i^\top Z G_i\Big),
    \qquad
    R(F)^\top \mathrm{vec}(Y) = \mathrm{vec}\Big(\tfrac1k\sum_i G_i Y G_i^\top\Big).

Each product is two plain GEMMs over the gradients stored in an
``(n, k, m)`` layout (no Python loop over gradients):

* matvec: ``P = Z @ G.view(n, k m)``; ``out = G.view(n k, m)^T @ P.view(n k, m)``
* rmatvec: ``P = G.view(n k, m) @ Y``; ``out = P.view(n, k m) @ G.view(n, k m)^T``

so one application costs ``2 k n m (n + m)`` flops. For symmetric ``Z`` or
``Y`` (what :func:`fisherkron.mff` uses) the result is symmetric and the second
GEMM computes only its lower block triangle (``(b + 1) / (2 b)`` of its flops
for ``b`` row blocks of ~``SYM_BLOCK`` rows), so fewer flops are executed than
the nominal count.

Gradients that do not fit
the memory budget are streamed in chunks of batches, from memory or from a
``.npy`` file opened memory-mapped.
"""
from __future__ import annotations

import mmap
import os
import tempfile
import time
import warnings
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import scipy.sparse.linalg as spla
import torch

from .conventions import FisherkronError, unvec, vec
from .stored import ENCODINGS, StoredGradients, check_gradient_dtype, encode_gradient, gradient_file

__all__ = ["GradientStack", "StoredGradients", "encode_gradient", "ENCODINGS", "RearrangedFisher", "TokenFisher", "rearranged_fisher", "matvec_flops", "default_memory_budget"]


#: Vectors with at least this many entries are updated with all threads (see :func:`_single_thread`).
THREADED_NUMEL = 1 << 20


@contextmanager
def _single_thread(device: torch.device, numel: int = 0):
    """Run the enclosed CPU tensor operations on one thread when they are small.

    Used for the memory-bound operations around the GEMMs (casts, scaling,
    Lanczos vector updates). Below ``THREADED_NUMEL`` entries one thread is as
    fast as two and free of OpenMP barrier stalls when the cores are shared;
    above it two threads halve the time on an idle machine (dot and axpy on
    3072^2 float64 entries: 9.6 and 11.8 ms on one thread, 4.6 and 4.7 ms on
    two), so ``numel`` at or above it leaves the thread count alone.
    """
    if device.type != "cpu" or torch.get_num_threads() == 1 or numel >= THREADED_NUMEL:
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


#: Target row-block size of :func:`_sym_gemm_nt` (at most ``SYM_MAX_BLOCKS`` blocks); outputs
#: smaller than two blocks use one plain GEMM. Measured on 2 cores: blocks of ~200 rows keep
#: the GEMMs efficient (0.73-0.78 of the full GEMM's time at N = 384-768, 0.65 at N = 1536).
SYM_BLOCK = 192
SYM_MAX_BLOCKS = 6


def _sym_blocks(N: int) -> int:
    return min(SYM_MAX_BLOCKS, N // SYM_BLOCK)


def _sym_gemm_nt(L: torch.Tensor, R: torch.Tensor, symmetric: bool) -> torch.Tensor:
    """``L @ R^T`` (``N x N``) for ``L``, ``R`` of shape ``(N, K)``; symmetric results cost ~half.

    When the product is known to be symmetric, only the blocks on and below
    the diagonal are computed (row block ``I``: ``L[I] @ R[:end(I)]^T``) and
    the rest is filled in by transposition: with ``b`` blocks this does
    ``(b + 1) / (2 b)`` of the flops of the full GEMM. A symmetric result is
    exactly symmetric, so callers never need to symmetrise it again.
    """
    N = L.shape[0]
    nb = _sym_blocks(N)
    if not symmetric:
        return L @ R.T
    if nb < 2:  # small: one GEMM, made exactly symmetric like the blocked result
        out = L @ R.T
        return out.add_(out.T.clone()).mul_(0.5)
    out = torch.empty(N, N, dtype=L.dtype, device=L.device)
    edges = [round(i * N / nb) for i in range(nb + 1)]
    for i in range(nb):
        a, b = edges[i], edges[i + 1]
        torch.matmul(L[a:b], R[:b].T, out=out[a:b, :b])  # (b - a, b): row block I, columns up to its end
    for i in range(nb):
        a, b = edges[i], edges[i + 1]
        D = out[a:b, a:b]
        D.add_(D.T.clone()).mul_(0.5)  # the diagonal block, exactly symmetric
        if i:
            out[:a, a:b] = out[a:b, :a].T  # upper blocks from the lower ones
    return out


def _sym_gemm_fraction(N: int, symmetric: bool) -> float:
    """Share of the flops of an ``N x N`` output GEMM that :func:`_sym_gemm_nt` executes."""
    nb = _sym_blocks(N)
    return (nb + 1) / (2 * nb) if symmetric and nb >= 2 else 1.0


def matvec_flops(n: int, m: int, k: int) -> int:
    """Flops of one application of ``R(F)`` or ``R(F)^T``: ``2 k n m (n + m)``."""
    return 2 * k * n * m * (n + m)


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


class RearrangedFisher(spla.LinearOperator):
    r"""``R(F) = (1/k) sum_i G_i^T (x) G_i^T`` as a scipy ``LinearOperator`` (``m^2 x n^2``).

    ``matvec(vec(Z)) = vec((1/k) sum_i G_i^T Z G_i)`` (Eq. (12)) and
    ``rmatvec(vec(Y)) = vec((1/k) sum_i G_i Y G_i^T)`` (Eq. (23)), with
    column-major ``vec``. The matrix forms :meth:`apply` and
    :meth:`apply_adjoint` work on torch tensors on the gradients' device and
    are what :func:`fisherkron.mff` uses. ``num_matvecs`` counts applications.

    With a process group (``group``; see :mod:`fisherkron.core.distributed`) ``grads`` are
    this rank's ``k_p`` gradients and ``k`` is the total over the ranks: each product is the
    local sum ``sum_{i in p} G_i^T Z G_i``, one ``all_reduce`` of that ``m x m`` (or ``n x n``)
    float64 matrix, and the division by the global ``k``. ``comm_bytes`` counts the bytes
    all-reduced (``8 (m^2 + 1)`` or ``8 (n^2 + 1)`` per product); flop counts are this rank's.
    """

    def __init__(self, grads: GradientStack, group=None, k: int | None = None):
        self.grads = grads
        self.n, self.m, self.k = grads.n, grads.m, grads.k
        self.k_local = grads.k  # gradients held here: the flops; k: the mean's denominator
        self.group = group
        if k is not None:
            self.k = int(k)
        self.comm_bytes = 0  # bytes all-reduced by the products (process group only)
        self.comm_seconds = 0.0  # wall time inside those all_reduce calls
        self.num_matvecs = 0
        self.product_seconds = 0.0  # wall time inside apply/apply_adjoint (device synchronised)
        self.executed_flops = 0  # flops the GEMMs actually did (fewer than nominal for symmetric inputs)
        self.nominal_flops = 0  # flops of plain GEMMs: 2 k n m (n + m) per product; 2 k n m^2 for R(I), 2 k m n^2 for R^T(I)
        np_dtype = np.float64 if grads.dtype == torch.float64 else np.float32
        super().__init__(dtype=np_dtype, shape=(self.m ** 2, self.n ** 2))

    # -- matrix forms ---------------------------------------------------------
    def _sync(self) -> None:
        if self.grads.device.type == "cuda":
            torch.cuda.synchronize(self.grads.device)

    def _product(self, X: torch.Tensor | None, per_chunk, executed_flops: float,
                 nominal_flops: float | None = None, size: int = 0) -> torch.Tensor:
        """``(1/k) sum_chunks per_chunk(X, G_c)`` accumulated in float64, with timing and flop counts.

        With a process group the local sum goes into a flat buffer with one more entry
        (``size x size`` result + the failure flag) and is summed over the ranks.
        """
        t0 = time.perf_counter()
        dev = self.grads.device
        if X is not None:
            with _single_thread(dev, X.numel()):
                X = X.to(dev, self.grads.dtype)
        if self.group is not None:
            out = self._reduced_product(X, per_chunk, size)
        else:
            out = None
            for Gc in self.grads.chunks():  # (n, kc, m)
                part = per_chunk(X, Gc)
                with _single_thread(dev, part.numel()):
                    out = part.double() if out is None else out.add_(part)
        self.num_matvecs += 1
        self.executed_flops += int(executed_flops)
        self.nominal_flops += int(matvec_flops(self.n, self.m, self.k_local) if nominal_flops is None
                                  else nominal_flops)
        with _single_thread(dev, out.numel()):
            out = out.div_(self.k)
        self._sync()
        self.product_seconds += time.perf_counter() - t0
        return out

    def _reduced_product(self, X, per_chunk, size: int) -> torch.Tensor:
        """This rank's ``sum_chunks per_chunk(X, G_c)`` summed over the ranks (``size x size``, float64).

        A local failure (an unreadable or non-finite gradient) still takes part in the
        ``all_reduce``, with zeros and its flag set; then every rank raises.
        """
        from .distributed import all_reduce_sum, product_comm_bytes

        dev = self.grads.device
        buf = torch.zeros(size * size + 1, dtype=torch.float64, device=dev)  # (size^2 + 1,): result, flag
        out = buf[:-1].view(size, size)
        error = None
        try:
            for Gc in self.grads.chunks():  # (n, kc, m)
                part = per_chunk(X, Gc)
                with _single_thread(dev, part.numel()):
                    out.add_(part)
        except Exception as exc:  # noqa: BLE001 - shared with the other ranks through the flag
            error = exc
            out.zero_()
        t0 = time.perf_counter()
        buf, failures = all_reduce_sum(buf, self.group, failed=error is not None)
        self.comm_seconds += time.perf_counter() - t0
        self.comm_bytes += product_comm_bytes(size)
        if failures:
            if error is not None:
                raise error
            raise FisherkronError(f"{self.grads.name}: MFF stopped because {failures} other rank(s) failed "
                                  f"(see their error)")
        return out

    def apply(self, Z: torch.Tensor | None, symmetric: bool = False) -> torch.Tensor:
        """``(1/k) sum_i G_i^T Z G_i`` for ``Z`` (``n x n``) -> ``m x m`` (float64 accumulation over chunks).

        With ``symmetric=True`` (``Z`` symmetric, so is the result) only the
        lower block triangle of the second GEMM is computed (see :func:`_sym_gemm_nt`).
        ``Z=None`` means ``Z = I_n``: ``(1/k) sum_i G_i^T G_i``, one symmetric GEMM
        (``k n m^2`` flops instead of ``2 k n m (n + m)``).
        """
        n, m = self.n, self.m
        if Z is None:
            def gram(_, Gc):  # sum_i G_i^T G_i: the rows of all G_i stacked, (n kc, m)
                Gs = Gc.view(n * Gc.shape[1], m).T
                return _sym_gemm_nt(Gs, Gs, True)

            return self._product(None, gram, 2 * self.k_local * n * m * m * _sym_gemm_fraction(m, True),
                                 2 * self.k_local * n * m * m, size=m)

        def per_chunk(Z, Gc):  # Gc: (n, kc, m)
            kc = Gc.shape[1]
            P = Z @ Gc.view(n, kc * m)  # (n, kc m): Z G_i side by side
            return _sym_gemm_nt(Gc.view(n * kc, m).T, P.view(n * kc, m).T, symmetric)  # (m, m): sum G_i^T Z G_i

        return self._product(Z, per_chunk, 2 * self.k_local * n * m * (n + m * _sym_gemm_fraction(m, symmetric)),
                             size=m)

    def apply_adjoint(self, Y: torch.Tensor | None, symmetric: bool = False) -> torch.Tensor:
        """``(1/k) sum_i G_i Y G_i^T`` for ``Y`` (``m x m``) -> ``n x n`` (float64 accumulation over chunks).

        ``symmetric=True``: ``Y`` is symmetric; only the lower block triangle is computed.
        ``Y=None`` means ``Y = I_m``: ``(1/k) sum_i G_i G_i^T``, one symmetric GEMM (``k m n^2`` flops).
        """
        n, m = self.n, self.m
        if Y is None:
            def gram(_, Gc):  # sum_i G_i G_i^T: the columns of all G_i side by side, (n, kc m)
                Gs = Gc.view(n, Gc.shape[1] * m)
                return _sym_gemm_nt(Gs, Gs, True)

            return self._product(None, gram, 2 * self.k_local * n * n * m * _sym_gemm_fraction(n, True),
                                 2 * self.k_local * n * n * m, size=n)

        def per_chunk(Y, Gc):  # Gc: (n, kc, m)
            kc = Gc.shape[1]
            P = Gc.view(n * kc, m) @ Y  # (n kc, m): G_i Y stacked
            return _sym_gemm_nt(P.view(n, kc * m), Gc.view(n, kc * m), symmetric)  # (n, n): sum G_i Y G_i^T

        return self._product(Y, per_chunk, 2 * self.k_local * n * m * (m + n * _sym_gemm_fraction(n, symmetric)),
                             size=n)

    # -- scipy LinearOperator interface ----------------------------------------
    def _matvec(self, x):
        x = np.asarray(x).reshape(-1)
        Z = unvec(torch.from_numpy(np.ascontiguousarray(x)), self.n, self.n)
        return vec(self.apply(Z)).cpu().numpy().astype(self.dtype, copy=False)

    def _rmatvec(self, x):
        x = np.asarray(x).reshape(-1)
        Y = unvec(torch.from_numpy(np.ascontiguousarray(x)), self.m, self.m)
        return vec(self.apply_adjoint(Y)).cpu().numpy().astype(self.dtype, copy=False)

    def _adjoint(self):
        return _Adjoint(self)

    def materialize(self) -> torch.Tensor:
        """Dense ``R(F)`` (float64, ``m^2 x n^2``) from the gradients; for small tests only."""
        G = self.grads.stacked().double()  # (k, n, m)
        return sum(torch.kron(Gi.T.contiguous(), Gi.T.contiguous()) for Gi in G) / self.k


class _Adjoint(spla.LinearOperator):
    def __init__(self, op: RearrangedFisher):
        self.op = op
        super().__init__(dtype=op.dtype, shape=(op.shape[1], op.shape[0]))

    def _matvec(self, x):
        return self.op._rmatvec(x)

    def _rmatvec(self, x):
        return self.op._matvec(x)


def rearranged_fisher(grads, dtype: torch.dtype = torch.float64, device=None,
                      memory_budget: int | None = None) -> RearrangedFisher:
    """The rearranged Fisher ``R(F) = (1/k) sum_i G_i^T (x) G_i^T`` as a ``LinearOperator``.

    Args:
        grads: ``(k, n, m)`` tensor/array, ``.npy`` path, or iterable of ``(n, m)`` gradients.
        dtype: float64 (default, for use with scipy solvers) or float32.

    Example:
        >>> G = torch.randn(4, 3, 2, dtype=torch.float64)   # k=4 gradients of a 3 x 2 layer
        >>> R = rearranged_fisher(G)
        >>> R.shape                                           # (m^2, n^2)
        (4, 9)
        >>> bool(np.allclose(R @ np.ones(9), R.materialize().numpy() @ np.ones(9)))
        True
    """
    return RearrangedFisher(GradientStack.of(grads, dtype, device=device, memory_budget=memory_budget))


class TokenFisher:
    r"""``R(F)`` of the per-token empirical Fisher, matrix-free from a layer's inputs and output gradients.

    Each token's gradient ``G_t = delta_t x_t^T`` (``n x m``) is rank one, so the Fisher of the
    ``T`` token gradients, ``F = (1/T) sum_t vec(G_t) vec(G_t)^T``, rearranges to

    .. math::
        R(F) = \frac1T \sum_t \mathrm{vec}(x_t x_t^\top)\,\mathrm{vec}(\delta_t \delta_t^\top)^\top,

    and its products (Eq. (12) and (23) with ``G_t^T Z G_t = (delta_t^T Z delta_t) x_t x_t^T``) are

    * ``apply(Z) = (1/T) X^T diag(w) X`` with ``w_t = delta_t^T Z delta_t`` (``m x m``),
    * ``apply_adjoint(Y) = (1/T) D^T diag(v) D`` with ``v_t = x_t^T Y x_t`` (``n x n``),

    from ``X`` (``T x m``, the inputs ``x_t``) and ``D`` (``T x n``, the output gradients
    ``delta_t``): about ``2 T (n^2 + m^2)`` flops per product and no gradient matrix stored.
    K-FAC's ``E[x x^T] (x) E[delta delta^T]`` is the product of the two means; MFF on this operator
    is the best Kronecker fit of the mean of the products. :func:`fisherkron.mff` accepts it in
    place of gradients.

    Args:
        X: ``(T, m)`` layer inputs, one row per token.
        D: ``(T, n)`` gradients of the loss with respect to the layer outputs, same tokens.
        dtype: compute dtype of the GEMMs (float32 default, float64 for references).
        device: where they run (default: that of ``X``).
        name: used in error messages.
    """

    def __init__(self, X, D, dtype: torch.dtype = torch.float32, device=None, name: str = "layer"):
        from .checks import as_tensor, check_finite, check_matrix

        X, D = as_tensor(X, f"{name}: X"), as_tensor(D, f"{name}: D")
        check_matrix(X, f"{name}: X (T x m)")
        check_matrix(D, f"{name}: D (T x n)")
        if X.shape[0] != D.shape[0]:
            raise FisherkronError(f"{name}: X has {X.shape[0]} tokens and D {D.shape[0]}; they must be the same tokens")
        if X.shape[0] == 0:
            raise FisherkronError(f"{name}: no tokens were given")
        check_finite(X, f"{name}: X")
        check_finite(D, f"{name}: D")
        self.name = name
        self.device = torch.device(device) if device is not None else X.device
        self.dtype = dtype
        self.X = X.to(self.device, dtype)  # (T, m)
        self.D = D.to(self.device, dtype)  # (T, n)
        self.k, self.m = (int(s) for s in self.X.shape)
        self.n = int(self.D.shape[1])
        self.k_local = self.k
        self.comm_bytes, self.comm_seconds = 0, 0.0
        self.num_matvecs = 0
        self.product_seconds = 0.0
        self.executed_flops = self.nominal_flops = 0

    def _weighted_gram(self, M: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """``(1/T) M^T diag(w) M`` (float64) for ``M`` of shape ``(T, d)``."""
        return ((M.T * w[None, :]) @ M).double().div_(self.k)

    def _count(self, t0: float, flops: int) -> None:
        self.num_matvecs += 1
        self.executed_flops += flops
        self.nominal_flops += flops
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.product_seconds += time.perf_counter() - t0

    def _product(self, P: torch.Tensor, Q: torch.Tensor, M: torch.Tensor | None) -> torch.Tensor:
        """``(1/T) sum_t (p_t^T M p_t) q_t q_t^T`` for rows ``p_t`` of ``P`` (``T x a``), ``q_t`` of ``Q``
        (``T x b``); ``M=None`` means ``I_a``. Both products below are this with the sides swapped."""
        t0 = time.perf_counter()
        T, a = P.shape
        if M is None:
            w = (P * P).sum(1)  # (T,): |p_t|^2
            flops = 2 * T * a
        else:
            w = ((P @ M.to(self.device, self.dtype)) * P).sum(1)  # (T,): p_t^T M p_t
            flops = 2 * T * a * a + 2 * T * a
        out = self._weighted_gram(Q, w)
        self._count(t0, flops + 2 * T * Q.shape[1] ** 2)
        return out

    def apply(self, Z: torch.Tensor | None, symmetric: bool = False) -> torch.Tensor:
        """``(1/T) sum_t (delta_t^T Z delta_t) x_t x_t^T`` (``m x m``); ``Z=None`` means ``I_n``."""
        return self._product(self.D, self.X, Z)

    def apply_adjoint(self, Y: torch.Tensor | None, symmetric: bool = False) -> torch.Tensor:
        """``(1/T) sum_t (x_t^T Y x_t) delta_t delta_t^T`` (``n x n``); ``Y=None`` means ``I_m``."""
        return self._product(self.X, self.D, Y)

    def fisher_norm_sq(self, block: int = 2048) -> float:
        """``||F||_F^2 = (1/T^2) sum_{t,s} (x_t . x_s)^2 (delta_t . delta_s)^2``, in blocks of ``block`` tokens."""
        total = 0.0
        X, D = self.X.double(), self.D.double()
        for a in range(0, self.k, block):
            gx = X[a:a + block] @ X.T  # (b, T)
            gd = D[a:a + block] @ D.T
            total += float(((gx * gd) ** 2).sum())
        return total / self.k ** 2

    def gradients(self) -> torch.Tensor:
        """The ``T`` token gradients ``G_t = delta_t x_t^T`` as a ``(T, n, m)`` tensor (small tests only)."""
        return self.D[:, :, None] * self.X[:, None, :]

    def materialize(self) -> torch.Tensor:
        """Dense ``R(F)`` (float64, ``m^2 x n^2``); for small tests only."""
        X, D = self.X.double(), self.D.double()
        xx = torch.einsum("ti,tj->tji", X, X).reshape(self.k, -1)  # (T, m^2): vec(x x^T), column-major
        dd = torch.einsum("ti,tj->tji", D, D).reshape(self.k, -1)  # (T, n^2)
        return xx.T @ dd / self.k
