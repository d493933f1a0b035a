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
(only the inputs ``X`` and output gradients ``D`` are stored). Tokens masked out by
``attention_mask`` are left out of the activation statistics. With ``max_disk`` the
gradients never take more than a bound: the layers are collected in groups and each
group's gradients are replaced by MFF's factors (:mod:`.bounded`).

One concern a module, read in this order:

==============  ==========================================================================
module          what it holds
==============  ==========================================================================
``layers``      :func:`select_layers`: which ``nn.Linear`` layers (patterns, the paper's default)
``keys``        fingerprints of the model, data, layers and loss; the cache key; the model's record
``entry``       a cache entry: its manifest (sizes, checksums) and the reader :class:`CalibrationStats`
``accumulate``  one forward + backward per batch: the gradients ``G_i`` and the running sums
``folders``     the cache root: owner markers, abandoned folders, disk space, read-only caches
``resume``      ``<key>.partial/``: checkpoints, the checksums of the rows they vouch for, Ctrl-C / SIGTERM
``ranks``       the same collection over a ``torch.distributed`` process group
``disk``        the bytes a calibration writes, and the groups of layers a bound on them allows
``bounded``     collection under ``max_disk``: layers in groups, MFF per group, factors kept, gradients not
``collect``     :func:`collect_calibration`: checks, the cache, and the one-process collection
==============  ==========================================================================
"""
from .collect import collect_calibration, default_loss, split_sequences
from .disk import parse_size
from .entry import GRANULARITIES, METHOD_STATS, STATS, CalibrationStats
from .keys import CODE_VERSION, data_fingerprint, layer_fingerprint, loss_key, model_fingerprint, model_record
from .layers import select_layers

__all__ = ["select_layers", "collect_calibration", "CalibrationStats", "CODE_VERSION", "METHOD_STATS", "GRANULARITIES",
           "STATS", "split_sequences", "default_loss", "model_fingerprint", "model_record", "data_fingerprint",
           "layer_fingerprint", "loss_key", "parse_size"]
