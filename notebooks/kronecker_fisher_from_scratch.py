# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Kronecker-factored Fisher from scratch
#
# **Claims.** For one linear layer $W$ ($n \times m$, out $\times$ in) with per-batch gradients $G_i$:
#
# 1. **MFF** (Sec. 4, Alg. 1): power iteration on the rearranged Fisher $\mathcal R(F)$, two small GEMMs a step, finds the best $A \otimes B$ without forming $F$.
# 2. **Size:** $F$ has $(nm)^2$ entries, the factors $m^2 + n^2$: terabytes against megabytes for a BERT-base layer.
# 3. **Matrix-variate normal** (Sec. 3.2): a Kronecker-structured curvature is the Hessian of its log-likelihood.
# 4. **Theorem 1:** the best rank-$r$ compression is $\widehat W_r = L_B^{-\top}\mathrm{SVD}_r(L_B^\top W L_A) L_A^{-1}$ (GFWSVD).
# 5. **One family** (Sec. 5.1, App. E): SVD, FWSVD and GFWSVD are pairs $(L_B, L_A)$ in $\widetilde W = L_B^\top W L_A$.
# 6. **The loss link** (Eq. (1)-(2)): $\tfrac12\,\mathrm{tr}(\Delta W^\top B\,\Delta W A)$ predicts the loss increase of a move $\Delta W$.
#
# **Result.** The verdict and figure just below come from the experiment of claim 6 (Section 9 shows
# how it is measured, and its caveats: the empirical Fisher stands in for the Hessian only near a
# minimum, and the quadratic model holds only for small $\Delta W$). Sections 1-8 then build
# everything from scratch, in the order of a lecture.
#
# **How to read.** Sections 1-7 work on a layer with $n = 4$ outputs and $m = 3$ inputs, small enough
# to write every matrix down in float64. Each section states a fact in LaTeX and the code below it
# checks the fact with an `assert`: if the notebook runs to the end, every statement in it held on this
# example. Facts that need many random draws (a Monte Carlo covariance, thousands of random
# competitors, restarts of a local optimiser) are checked in `tests/test_teaching_checks.py`, not
# here. Sections 8 and 9 use real layers of the embedded all-MiniLM-L6-v2 (the paper's BERT role).
# Sections 3 and 9 end with **Try it** prompts: change a parameter and re-run.
#
# **Conventions** (`fisherkron.core.conventions`): $W$ and gradients $G_i$ are $n\times m$ (out $\times$
# in); $\mathrm{vec}$ stacks *columns*; $A$ is $m\times m$ (input side), $B$ is $n\times n$
# (output side), and
# $$\mathrm{vec}(\Delta W)^\top (A\otimes B)\,\mathrm{vec}(\Delta W) = \mathrm{tr}(\Delta W^\top B\,\Delta W A).$$

# %% tags=["parameters", "hide-input"]
# Each value: the embedded default (`make all`); the "paper" profile uses the same values (this is
# a teaching notebook: it has no paper-scale counterpart); `make smoke` lowers the sample counts.
output_dir = "figures"  # where the figures are written (Make passes it); paper: "figures/paper"
profile = "default"  # name of the parameter profile (recorded in the provenance)
n = 4  # outputs of the tiny layer (rows of W); paper: 4
m = 3  # inputs of the tiny layer (columns of W); paper: 3
T = 8  # examples per batch; paper: 8
k = 32  # batches, i.e. per-batch gradients G_i; paper: 32
seed = 0  # random seed of data, weights and checks; paper: 0
rank = 1  # rank r of the compressed weight in the Theorem 1 check; paper: 1
alpha = 0.01  # regularisation A + alpha diag(A) of the factors before Cholesky (Sec. 5); paper: 0.01
power_tol = 1e-12  # the dozen-line MFF stops when B changes by less than this (float64); paper: 1e-12
sweep_sizes = [[4, 3], [16, 12], [64, 48], [128, 96], [256, 192]]  # (n, m) of the products-vs-size sweep; paper: same
sweep_k = 16  # synthetic gradients per layer in that sweep; paper: 16
sweep_tol = 1e-8  # stopping tolerance of both MFF variants in that sweep; paper: 1e-8
real_model = "minilm"  # Secs. 8-9: the embedded all-MiniLM-L6-v2 (the paper's BERT role); paper: "minilm"
real_layer = "bert.encoder.layer.3.intermediate.dense"  # its layer drawn in Sec. 8 (1536 x 384); paper: same
real_k = 16  # SST-2 training batches whose gradients give that layer's factors; paper: 16
real_batch_size = 8  # sentences per batch; paper: 8
crop = 64  # each transformation matrix is drawn as its leading crop x crop block; paper: 64
link_layer = "attention.output.dense"  # Sec. 9: the last block's layer perturbed (384 x 384); paper: same
link_calibration = 256  # SST-2 training sentences whose per-sentence gradients give the Fisher; paper: 256
link_heldout = 256  # SST-2 validation sentences on which the loss change is measured; paper: 256
link_batch_size = 32  # sentences per forward pass when collecting them; paper: 32
link_sizes = [0.01, 0.03, 0.1]  # perturbation sizes ||dW||_F / ||W||_F; paper: same
link_draws = 2  # random directions of each of the four shapes; paper: 2
link_rank = 64  # rank of the SVD / FWSVD / GFWSVD compressions whose error directions are tried; paper: 64
head_l2 = 0.001  # ridge penalty of the classifier head fitted on the calibration sentences; paper: 0.001

# %% tags=["hide-input"]
import fisherkron as fk  # first: it sets OpenMP's wait policy before torch loads (see fisherkron/__init__.py)

import time

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import torch
import transformers
from torch import nn

from fisherkron import hf
from fisherkron.repro import figures
from fisherkron.experiments import teaching as tc
from fisherkron.experiments.synthetic_gradients import synthetic_gradients
from fisherkron.testing import FLOAT64  # exact identities, up to float64 round-off

transformers.logging.set_verbosity_error()  # no load reports in the page
transformers.utils.logging.disable_progress_bar()
started = time.perf_counter()
params = dict(profile=profile, n=n, m=m, T=T, k=k, seed=seed, rank=rank, alpha=alpha, power_tol=power_tol,
              sweep_sizes=sweep_sizes, sweep_k=sweep_k, sweep_tol=sweep_tol, real_model=real_model,
              real_layer=real_layer, real_k=real_k, real_batch_size=real_batch_size, crop=crop,
              link_layer=link_layer, link_calibration=link_calibration, link_heldout=link_heldout,
              link_batch_size=link_batch_size, link_sizes=link_sizes, link_draws=link_draws, link_rank=link_rank,
              head_l2=head_l2)
NOTEBOOK = "notebooks/kronecker_fisher_from_scratch.py"
torch.manual_seed(seed)
f64 = torch.float64
ITERATIVE = dict(rtol=1e-7, atol=1e-10)  # MFF (float64) stops at an estimated error of 1e-10 in A (x) B
CLS_PATH = 1e-5  # float64 [CLS] path against the model's float32 logits: float32 round-off of a forward pass


def close(a, b, tol=FLOAT64):
    """``torch.allclose`` for tensors, with a named tolerance."""
    return torch.allclose(torch.as_tensor(a, dtype=f64), torch.as_tensor(b, dtype=f64), **tol)


# %% [markdown]
# ## Result: does $\tfrac12\mathrm{tr}(\Delta W^\top B\,\Delta W A)$ predict the loss?
#
# One real layer of MiniLM's last block (`link_layer`), under a classifier head fitted on SST-2.
# Its Fisher comes from `link_calibration` training sentences; the loss is measured on
# `link_heldout` validation sentences after moving $W$ along random and compression-error
# directions by several sizes. The dashed line is "measured = predicted"; the printed lines are the
# verdict, computed from the measurements.

# %% tags=["hide-input"]
model, tok = hf.load_model(real_model)  # a sequence classifier; its head drawn with a fixed seed


def sst2_batches(split, sentences):
    """SST-2 sentences of one split, drawn with the notebook's seed, in batches of similar length."""
    return tc.sorted_batches(tok, hf.load_task("sst2", split), sentences, batch_size=link_batch_size, seed=seed)


calib_inputs = tc.cls_inputs(model, sst2_batches("train", link_calibration))  # [CLS] inputs of the last block
heldout_inputs = tc.cls_inputs(model, sst2_batches("validation", link_heldout))
path = tc.CLSPath(model, link_layer)  # float64 copy of everything after the attention of the last block
calib, heldout = path.data(calib_inputs), path.data(heldout_inputs)
head_loss = path.fit_head(calib, head_l2)  # the classifier, fitted on frozen features
link = tc.loss_link(path, calib, heldout, sizes=link_sizes, rank=link_rank, draws=link_draws, seed=seed)
summary = tc.link_summary(link)
accuracy = float((path.logits(heldout).argmax(1) == heldout.y).double().mean())
emp_mff = link.fishers["data"].mff
print(f"Head fitted on {link.calibration} training sentences: training loss {head_loss:.3f}, held-out loss "
      f"{link.loss:.3f}, held-out accuracy {accuracy:.2f}. MFF on the layer's {link.shape[0] * link.shape[1]}^2 "
      f"Fisher: {emp_mff.matvecs} products, A (x) B holds {100 * emp_mff.fisher_share:.1f}% of ||F||^2.")
print("\n".join(tc.link_verdict(link, summary)))

# %% tags=["hide-input"]
def link_figure(link, summary):
    """Measured against predicted loss change (top) and the one-sided change (bottom)."""
    t = link.table
    s = summary.set_index(["fisher", "prediction"])
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 10.5), layout="constrained")
    floor = t.measured[t.measured > 0].min() / 3  # where a measured change <= 0 is drawn
    series = [("kronecker_data", "empirical (data labels)", "Kronecker (GFWSVD)", "tab:blue", "o"),
              ("kronecker_model", "model's (its own labels)", "Kronecker (GFWSVD)", "tab:green", "s"),
              ("diagonal_data", "empirical (data labels)", "diagonal (FWSVD)", "tab:orange", "^")]
    for column, fisher, name, colour, marker in series:
        row = s.loc[(fisher, name)]
        label = (f"{name}, {fisher.split(' ')[0]} Fisher: Spearman $\\rho$ = {row.spearman:.2f} (direction), "
                 f"Pearson r = {row.pearson:.2f}")
        top.scatter(t[column], t.measured.clip(lower=floor), s=28, color=colour, marker=marker, alpha=0.75,
                    label=label)
    lo, hi = min(t[[c for c, *_ in series]].min().min(), floor), max(t[[c for c, *_ in series]].max().max(),
                                                                     t.measured.max())
    top.plot([lo, hi], [lo, hi], "k--", lw=1, label="measured = predicted")
    top.set(xscale="log", yscale="log", xlabel="predicted $\\Delta L = \\frac{1}{2} \\mathrm{vec}(\\Delta W)^\\top M"
            "\\,\\mathrm{vec}(\\Delta W)$",
            ylabel="measured $\\frac{1}{2}[L(W+\\Delta W) + L(W-\\Delta W)] - L(W)$",
            title=f"{link.layer} ({link.shape[0]} x {link.shape[1]}): {t['index'].nunique()} directions x "
                  f"{t['size'].nunique()} sizes, {link.heldout} held-out sentences")
    top.legend(fontsize=8, loc="upper left", title="one point per (direction, size)", title_fontsize=8)
    top.grid(alpha=0.3)
    pred = t.kronecker_data
    bottom.scatter(pred, t.one_sided, s=28, color="tab:red", marker="x",
                   label=f"quadratic term only: r = {t.one_sided.corr(pred):.2f}")
    bottom.scatter(t.first_order + pred, t.one_sided, s=28, color="tab:blue", marker="o", alpha=0.75,
                   label=f"first-order term + quadratic term: r = {t.one_sided.corr(t.first_order + pred):.2f}")
    lim = float(max(t.one_sided.abs().max(), (t.first_order + pred).abs().max()))
    bottom.plot([-lim, lim], [-lim, lim], "k--", lw=1)
    bottom.axhline(0, color="0.7", lw=0.8)
    bottom.set(xlabel="predicted: $\\langle \\nabla L, \\Delta W\\rangle + \\frac{1}{2}\\mathrm{tr}(\\Delta W^\\top B "
               "\\Delta W A)$ (empirical Fisher)", ylabel="measured one-sided $L(W+\\Delta W) - L(W)$",
               title="The one-sided change, against the quadratic term alone and with the first-order term")
    bottom.legend(fontsize=8, loc="upper left")
    bottom.grid(alpha=0.3)
    return fig


fig = link_figure(link, summary)
figures.save_figure(fig, "kronecker_fisher_from_scratch", output_dir, params, started=started, notebook=NOTEBOOK)
plt.show()

# %% [markdown]
# ## 1. The empirical Fisher of a tiny layer
#
# A linear layer $s = W x + b$ ($W$: $n \times m$) followed by a softmax over $n$ classes and the
# mean cross-entropy over a batch of $T$ examples. With $p_t = \mathrm{softmax}(s_t)$ and one-hot
# labels $y_t$, the back-propagated error is $\delta_t = (p_t - y_t)/T$ and the batch gradient is a
# sum of outer products,
# $$G_i = \frac{\partial \mathcal L_i}{\partial W} = \sum_{t=1}^{T} \delta_t x_t^\top \in \mathbb R^{n\times m}.$$

# %%
layer = nn.Linear(m, n, dtype=f64)  # W: (n, m)
X = torch.randn(k, T, m, dtype=f64)  # (k, T, m): k batches of T inputs
Y = torch.randint(0, n, (k, T))  # (k, T) labels
G_list, deltas = [], []
for Xi, Yi in zip(X, Y):  # one batch at a time, as a training loop would
    loss = nn.functional.cross_entropy(layer(Xi), Yi)
    (Gi,) = torch.autograd.grad(loss, layer.weight)  # (n, m)
    G_list.append(Gi)
    with torch.no_grad():
        deltas.append((torch.softmax(layer(Xi), dim=1) - nn.functional.one_hot(Yi, n)) / T)  # (T, n)
G = torch.stack(G_list)  # (k, n, m)
delta = torch.stack(deltas)  # (k, T, n)
assert close(G, torch.einsum("ktn,ktm->knm", delta, X)), "G_i = sum_t delta_t x_t^T"
print("per-batch gradients G:", tuple(G.shape))

# %% [markdown]
# The empirical Fisher of the layer is the mean outer product of the vectorised gradients,
# $$F = \frac1k\sum_{i=1}^{k} \mathrm{vec}(G_i)\,\mathrm{vec}(G_i)^\top \in \mathbb R^{nm\times nm}.$$
# It is symmetric positive semidefinite and its rank is at most $k$. A Kronecker product acts on a
# perturbation $\Delta W$ as $\mathrm{vec}(\Delta W)^\top (A\otimes B)\mathrm{vec}(\Delta W) =
# \mathrm{tr}(\Delta W^\top B \Delta W A)$ (column-major $\mathrm{vec}$, $A$ on the input side,
# $A$ and $B$ symmetric), because $(A\otimes B)\,\mathrm{vec}(\Delta W) = \mathrm{vec}(B\,\Delta W A^\top)$.

# %%
g = fk.vec(G)  # (k, n m): column-major vec of each G_i
F = g.T @ g / k  # (n m, n m)
evals = torch.linalg.eigvalsh(F)
assert close(F, F.T) and evals.min() > -1e-12 * evals.max(), "F is symmetric PSD"
assert int((evals > 1e-10 * evals.max()).sum()) <= min(k, n * m), "rank F <= min(k, nm)"
assert close(fk.vec(G[0]), G[0].T.reshape(-1)), "vec stacks the columns"
A_, B_, dW = torch.randn(m, m, dtype=f64), torch.randn(n, n, dtype=f64), torch.randn(n, m, dtype=f64)
A_, B_ = A_ + A_.T, B_ + B_.T  # Fisher factors are symmetric
assert close(fk.vec(dW) @ fk.kron(A_, B_) @ fk.vec(dW), torch.trace(dW.T @ B_ @ dW @ A_)), \
    "vec(dW)^T (A (x) B) vec(dW) = tr(dW^T B dW A)"
print(f"F is {tuple(F.shape)}, eigenvalues in [{evals.min():.2e}, {evals.max():.2e}]")

# %% [markdown]
# ## 2. The Van Loan rearrangement on a small example
#
# View $F$ as an $m \times m$ grid of $n\times n$ blocks $F_{pq}$ (for $F = A\otimes B$,
# $F_{pq} = a_{pq} B$). The rearrangement $\mathcal R$ writes block $F_{pq}$, vectorised, as row
# $p + m q$ of an $m^2 \times n^2$ matrix. It only moves entries, so it preserves the Frobenius
# norm, and it turns a Kronecker product into a rank-one matrix:
# $$\mathcal R(A\otimes B) = \mathrm{vec}(A)\,\mathrm{vec}(B)^\top, \qquad
# \lVert F - A\otimes B\rVert_F = \lVert \mathcal R(F) - \mathrm{vec}(A)\mathrm{vec}(B)^\top\rVert_F .$$
# Finding the best Kronecker product is therefore finding the best rank-one approximation of
# $\mathcal R(F)$: its leading singular triplet. For the empirical Fisher,
# $\mathcal R(\mathrm{vec}(G)\mathrm{vec}(G)^\top) = G^\top \otimes G^\top$ (with our
# $\mathrm{vec}$; the paper writes $G\otimes G$ for the transposed layout), so
# $$\mathcal R(F) = \frac1k \sum_i G_i^\top \otimes G_i^\top,\qquad
# \mathcal R(F)\,\mathrm{vec}(Z) = \mathrm{vec}\Big(\frac1k\sum_i G_i^\top Z G_i\Big)\quad (Z: n\times n),$$
# $$\mathcal R(F)^\top\mathrm{vec}(Y) = \mathrm{vec}\Big(\frac1k\sum_i G_i\, Y G_i^\top\Big)\quad (Y: m\times m),$$
# products that cost a few small matrix products per gradient and never form $F$ (Eq. (12), (23)).

# %%
def rearrange(F: torch.Tensor, n: int, m: int) -> torch.Tensor:
    """R(F): block (p, q) of the m x m grid of n x n blocks becomes row p + m q (vectorised)."""
    return F.reshape(m, n, m, n).permute(2, 0, 3, 1).reshape(m * m, n * n)  # (m^2, n^2)


A_, B_ = torch.randn(m, m, dtype=f64), torch.randn(n, n, dtype=f64)
assert close(rearrange(fk.kron(A_, B_), n, m), torch.outer(fk.vec(A_), fk.vec(B_))), \
    "R(A (x) B) = vec(A) vec(B)^T"
assert close(torch.linalg.norm(F - fk.kron(A_, B_)),
             torch.linalg.norm(rearrange(F, n, m) - torch.outer(fk.vec(A_), fk.vec(B_)))), \
    "R preserves the Frobenius distance"
RF = rearrange(F, n, m)  # (m^2, n^2)
assert close(RF, sum(torch.kron(Gi.T, Gi.T) for Gi in G) / k), "R(F) = (1/k) sum_i G_i^T (x) G_i^T"
op = fk.rearranged_fisher(G)  # the library's matrix-free operator
assert close(op.materialize(), RF), "the library's R(F) is the rearranged Fisher"
Z, Yv = torch.randn(n, n, dtype=f64), torch.randn(m, m, dtype=f64)
assert close(RF @ fk.vec(Z), fk.vec((G.mT @ Z @ G).mean(0))), "R(F) vec(Z) = vec((1/k) sum G_i^T Z G_i)"
assert close(RF.T @ fk.vec(Yv), fk.vec((G @ Yv @ G.mT).mean(0))), "R(F)^T vec(Y) = vec((1/k) sum G_i Y G_i^T)"
assert close(torch.from_numpy(op.matvec(fk.vec(Z).numpy())), RF @ fk.vec(Z)), "matrix-free matvec"
print(f"R(F) is {tuple(RF.shape)}: {m}^2 x {n}^2")

# %% [markdown]
# ## 3. MFF in a dozen lines
#
# **The dense answer.** With $\mathcal R(F) = \sum_j \sigma_j u_j v_j^\top$,
# $A = \sqrt{\sigma_1}\,\mathrm{mat}(u_1)$ ($m\times m$) and $B = \sqrt{\sigma_1}\,\mathrm{mat}(v_1)$
# ($n\times n$), signed so that $\mathrm{tr}A > 0$; by Eckart–Young the error is
# $\lVert F - A\otimes B\rVert_F^2 = \lVert F\rVert_F^2 - \sigma_1^2$.
#
# **Without forming anything.** Power iteration alternates the two products of Section 2 and
# normalises (the factors live as matrices, never as the vectors $u$, $v$):
# $$A \leftarrow \frac{\frac1k\sum_i G_i^\top B\, G_i}{\big\lVert \frac1k\sum_i G_i^\top B\, G_i\big\rVert_F}
# \;\;(= \mathcal R(F)\,v \text{ normalised}),\qquad
# \widetilde B \leftarrow \frac1k\sum_i G_i A\, G_i^\top \;\;(= \mathcal R(F)^\top u),\qquad
# \sigma \leftarrow \lVert \widetilde B\rVert_F,\quad B \leftarrow \widetilde B/\sigma .$$
# Each step costs two products, i.e. $4knm(n+m)$ flops, and multiplies the error by about
# $(\sigma_2/\sigma_1)^2$. Starting from $B = I_n$ keeps every iterate symmetric positive
# semidefinite, as the answer is for a PSD $F$. Here it is, in full:

# %%
def mff_power(G: torch.Tensor, tol: float = 1e-12, max_steps: int = 500) -> list:
    """Algorithm 1 by power iteration on R(F), through two GEMM products per step; F is never formed."""
    k, n, m = G.shape  # k gradients of an n x m layer
    B = torch.eye(n, dtype=G.dtype)  # start: B = I_n (n, n)
    steps = []  # (A, B, sigma) after each step
    for _ in range(max_steps):
        A = (G.mT @ B @ G).mean(0)  # R(F) vec(B) = vec((1/k) sum_i G_i^T B G_i)   (m, m)
        A = A / A.norm()  # u = vec(A), unit norm
        B_next = (G @ A @ G.mT).mean(0)  # R(F)^T vec(A) = vec((1/k) sum_i G_i A G_i^T)   (n, n)
        sigma = B_next.norm()  # sigma_1 = ||R(F)^T u|| once u is the top singular vector
        B_next = B_next / sigma  # v = vec(B), unit norm
        steps.append((sigma.sqrt() * A, sigma.sqrt() * B_next, sigma))  # F ~= A (x) B
        if (B_next - B).norm() < tol:
            break
        B = B_next
    return steps


# %% [markdown]
# It returns every step, so we can watch it converge. The last step must be the dense leading pair of
# the materialised $\mathcal R(F)$ and the library's `fk.mff` (which runs Lanczos on the same two
# products instead of power iteration, and stops on an error estimate). MFF is optimal among *all*
# Kronecker products, so it is at least as close to $F$ as K-FAC's
# $A = \mathbb E[x x^\top]$, $B \propto \mathbb E[\delta\delta^\top]$.

# %%
steps = mff_power(G, tol=power_tol)
A_pow, B_pow, sigma_pow = steps[-1]  # (m, m), (n, n), scalar
U_, S_, Vh_ = torch.linalg.svd(RF)  # the dense reference: R(F) materialised
A_dense = S_[0].sqrt() * fk.unvec(U_[:, 0], m, m)  # (m, m)
B_dense = S_[0].sqrt() * fk.unvec(Vh_[0], n, n)  # (n, n)
if torch.trace(A_dense) < 0:
    A_dense, B_dense = -A_dense, -B_dense
res = fk.mff(G, dtype=f64)  # the library: Lanczos on the same products
A, B = res.A, res.B
assert res.converged, "MFF converged"
assert close(sigma_pow, S_[0], ITERATIVE), "power iteration: sigma_1 of R(F)"
assert close(fk.kron(A_pow, B_pow), fk.kron(A_dense, B_dense), ITERATIVE), "power iteration finds the dense A (x) B"
assert close(fk.kron(A_pow, B_pow), fk.kron(A, B), ITERATIVE), "... and the library's"
print(f"power iteration: {2 * len(steps)} products; fk.mff (Lanczos): {res.matvecs} products; "
      f"(sigma_2 / sigma_1)^2 = {float(S_[1] / S_[0]) ** 2:.3f} per step")

# %% [markdown]
# The pair is optimal: its error is what Eckart–Young says, both factors are symmetric PSD, and
# K-FAC's pair is no closer.

# %%
err2 = torch.linalg.norm(F - fk.kron(A, B)) ** 2
assert close(err2, torch.linalg.norm(F) ** 2 - S_[0] ** 2, dict(rtol=1e-6, atol=1e-12)), \
    "Eckart-Young: ||F - A (x) B||^2 = ||F||^2 - sigma_1^2"
for name, M in (("A", A_pow), ("B", B_pow)):
    assert close(M, M.T) and torch.linalg.eigvalsh(M).min() > -1e-10 * torch.linalg.eigvalsh(M).max(), \
        f"{name} is symmetric PSD"
kfac = fk.kfac_factors(X, delta, num_batches=k)  # inputs (k, T, m), output errors (k, T, n)
err2_kfac = torch.linalg.norm(F - fk.kron(kfac.A, kfac.B)) ** 2
assert err2 <= err2_kfac * (1 + 1e-12), "MFF is at least as close to F as K-FAC"
print(f"A (x) B holds sigma_1^2 / ||F||^2 = {res.fisher_share:.3f} of the Fisher; relative error "
      f"||F - A(x)B|| / ||F||: MFF {float(err2.sqrt() / torch.linalg.norm(F)):.3f}, "
      f"K-FAC {float(err2_kfac.sqrt() / torch.linalg.norm(F)):.3f}")

# %% [markdown]
# **Convergence, and what it costs as layers grow.** Top: the relative error of $A\otimes B$ (against
# the dense pair; `tc.kron_distance` computes $\lVert A\otimes B - A'\otimes B'\rVert_F$ without
# forming either) and of $\sigma_1$ after each product, for the dozen lines above and for `fk.mff`.
# Bottom: the products each needs to meet a stopping tolerance of `sweep_tol` on synthetic
# Kronecker-like gradients (`fisherkron.experiments.synthetic_gradients`) of growing layers, against
# the number of entries of $F$ it never forms. (Their stopping rules differ: the power iteration
# stops when $B$ changes by less than the tolerance, `fk.mff` when its estimate of the error of
# $A\otimes B$ does.)

# %% tags=["hide-input"]
ref = float(A_dense.norm() * B_dense.norm())
power_err = [(2 * (i + 1), tc.kron_distance(a, b, A_dense, B_dense) / ref, abs(float(s / S_[0]) - 1))
             for i, (a, b, s) in enumerate(steps)]
lanczos_err = tc.lanczos_errors(G, A_dense, B_dense, max_products=2 * len(steps))
sweep = []
for n_s, m_s in sweep_sizes:
    G_s = synthetic_gradients(n_s, m_s, sweep_k, tokens=32, seed=seed, dtype=f64).G  # (k, n_s, m_s)
    sweep.append(dict(n=n_s, m=m_s, entries=(n_s * m_s) ** 2, power=2 * len(mff_power(G_s, tol=sweep_tol)),
                      lanczos=fk.mff(G_s, dtype=f64, tol=sweep_tol).matvecs))
sweep = pd.DataFrame(sweep)

FLOOR = 1e-16  # errors below float64 round-off are drawn here
fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 9), layout="constrained")
x, e, es = zip(*power_err)
top.semilogy(x, np.maximum(e, FLOOR), "o-", color="tab:blue", label="power iteration (the dozen lines): $A \\otimes B$")
top.semilogy(x, np.maximum(es, FLOOR), "o:", color="tab:blue", alpha=0.6, label="power iteration: $\\sigma_1$")
xl, el = zip(*lanczos_err)
top.semilogy(xl, np.maximum(el, FLOOR), "s-", color="tab:green", label="fk.mff (Lanczos): $A \\otimes B$")
rate = float(S_[1] / S_[0]) ** 2
top.semilogy(x, [e[0] * rate ** i for i in range(len(x))], "k--", lw=1,
             label=f"$(\\sigma_2/\\sigma_1)^2$ = {rate:.3f} per power step")
top.set(xlabel="products with $\\mathcal{R}(F)$ or $\\mathcal{R}(F)^\\top$", ylabel="relative error against the dense SVD",
        title=f"Convergence on the {n} x {m} layer (k = {k} gradients)", ylim=(FLOOR / 3, 3))
top.legend(fontsize=9)
top.grid(alpha=0.3, which="both")
bottom.semilogx(sweep.entries, sweep.power, "o-", color="tab:blue", label="power iteration (the dozen lines)")
bottom.semilogx(sweep.entries, sweep.lanczos, "s-", color="tab:green", label="fk.mff (Lanczos)")
for row in sweep.itertuples():
    bottom.annotate(f"{row.n} x {row.m}", (row.entries, max(row.power, row.lanczos)), textcoords="offset points",
                    xytext=(0, 6), ha="center", fontsize=8)
bottom.set(xlabel="entries of $F$, $(nm)^2$ (never formed)", ylabel="products to stop",
           title=f"Products against the size of F (synthetic gradients, k = {sweep_k}, tolerance {sweep_tol:g})",
           ylim=(0, 1.3 * sweep[["power", "lanczos"]].max().max()))
bottom.legend(fontsize=9, loc="lower right")
bottom.grid(alpha=0.3)
figures.save_figure(fig, "kronecker_fisher_from_scratch_mff", output_dir, params, started=started, notebook=NOTEBOOK)
plt.show()
print(f"products to stop, from {sweep.entries.min():.1e} to {sweep.entries.max():.1e} entries of F: "
      f"power iteration {sweep.power.min()}-{sweep.power.max()}, fk.mff {sweep.lanczos.min()}-{sweep.lanczos.max()}")

# %% [markdown]
# The four matrices of the tiny layer, on one colour scale: $F$, its rearrangement, the Kronecker
# fit and what the fit leaves out.

# %% tags=["hide-input"]
fig, axes = plt.subplots(2, 2, figsize=(8, 7.5), layout="constrained")
panels = [(F, "$F$ ($nm \\times nm$)"), (RF, "$\\mathcal{R}(F)$ ($m^2 \\times n^2$)"),
          (fk.kron(A, B), "MFF $A \\otimes B$"), (F - fk.kron(A, B), "$F - A \\otimes B$")]
vmax = float(F.abs().max())
for ax, (M, title) in zip(axes.flat, panels):
    im = ax.imshow(M.numpy(), cmap="RdBu_r", vmin=-vmax, vmax=vmax)
    ax.set_title(title)
    ax.set_xticks([])
    ax.set_yticks([])
fig.colorbar(im, ax=axes.ravel().tolist(), shrink=0.8)
fig.suptitle(f"Empirical Fisher of a {n} x {m} layer from k = {k} batch gradients; "
             f"A (x) B holds {100 * res.fisher_share:.0f}% of ||F||^2")
plt.show()

# %% [markdown]
# **Try it.** Set `k = 4` in the parameters (fewer gradients than the $nm = 12$ entries of a
# gradient): $F$ then has rank at most 4. Does the power iteration still converge, how many products
# does it need, and what share of $\lVert F\rVert_F^2$ does $A\otimes B$ hold?
#
# ## 4. Why never form $F$: the sizes
#
# $F$ of an $n\times m$ layer has $(nm)^2$ entries; the factors $A$ and $B$ have $m^2 + n^2$. The
# products above touch only the $k$ gradients ($knm$ numbers) and $m\times m$ or $n\times n$ matrices.

# %% tags=["hide-input"]
def human_bytes(b: float) -> str:
    """Bytes in the largest decimal unit that keeps the number at least 1."""
    for unit, size in (("PB", 1e15), ("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if b >= size:
            return f"{b / size:.1f} {unit}"
    return f"{b:.0f} B"


LAYERS = {  # layer -> (n, m), out x in
    "the tiny layer above": (n, m),
    "MiniLM attention.output.dense (Sec. 9)": (384, 384),
    "BERT-base intermediate.dense": (3072, 768),
    "Llama-2-7B mlp.up_proj": (11008, 4096),
}
size_table = pd.DataFrame([{"layer": name, "n x m": f"{a} x {b}", "entries of F, (nm)^2": f"{(a * b) ** 2:.2e}",
                       "F in float32": human_bytes(4 * (a * b) ** 2),
                       "entries of A and B, m^2 + n^2": f"{a * a + b * b:.2e}",
                       "A and B in float32": human_bytes(4 * (a * a + b * b)),
                       "F / (A, B)": f"{(a * b) ** 2 / (a * a + b * b):.1e}"} for name, (a, b) in LAYERS.items()])
size_table
# %% [markdown]
# ## 5. The matrix-variate normal view: why the Hessian is $B^{-1}\otimes A^{-1}$-shaped
#
# $X \sim \mathcal{MN}(M, \Sigma_1, \Sigma_2)$ ($X$: $n\times m$; $\Sigma_1$: $n\times n$ among
# rows; $\Sigma_2$: $m\times m$ among columns) means $X = M + L_1 Z L_2^\top$ with
# $\Sigma_1 = L_1L_1^\top$, $\Sigma_2 = L_2L_2^\top$, $Z$ standard normal. Since
# $\mathrm{vec}(L_1ZL_2^\top) = (L_2\otimes L_1)\mathrm{vec}(Z)$,
# $$\mathrm{Cov}(\mathrm{vec}X) = \Sigma_2\otimes\Sigma_1, \qquad
# -\log p(X) = \tfrac12\mathrm{tr}\big(\Sigma_1^{-1}(X-M)\Sigma_2^{-1}(X-M)^\top\big) + \text{const},$$
# and the Hessian of $-\log p$ in $\mathrm{vec}(X)$ is the inverse covariance
# $\Sigma_2^{-1}\otimes\Sigma_1^{-1}$ everywhere. Theorem 1 takes
# $W\sim\mathcal{MN}(W^\star, B^{-1}, A^{-1})$: the covariances are the *inverses* of the Fisher
# factors, so the Hessian is $A\otimes B$, the Kronecker-factored Fisher itself. (In the paper's
# transposed layout this reads $B^{-1}\otimes A^{-1}$ for the covariance.)
#
# The factors must be positive definite for this, and here $B$ is not: with a softmax output,
# $\sum_j \delta_{tj} = \sum_j (p_{tj} - y_{tj})/T = 0$, so every column of every $G_i$ sums to zero,
# $\mathbf 1^\top G_i = 0$, and $B\mathbf 1 = 0$. A singular factor is regularised,
# $B \leftarrow B + \alpha\,\mathrm{diag}(B)$ (`fisherkron.regularize`, Sec. 5 "Singularity").
#
# Below: the Hessian of $-\log p$ is $A\otimes B$, and the covariance of $L_1 Z L_2^\top$ is
# $\Sigma_2\otimes\Sigma_1$ in closed form. That the *sample* covariance of many draws converges to it
# is a Monte Carlo fact, checked in `tests/test_teaching_checks.py`.

# %%
assert close(G.sum(dim=1), torch.zeros(k, m, dtype=f64), dict(rtol=0, atol=1e-12)), "1^T G_i = 0 (softmax)"
ones = torch.ones(n, dtype=f64)
assert float((B @ ones).norm()) <= 1e-6 * float(B.norm()), "B 1 = 0: B is singular"
regA, regB = fk.regularize(A, alpha=alpha), fk.regularize(B, alpha=alpha)
A_pd, B_pd = regA.matrix, regB.matrix  # (m, m), (n, n): positive definite
Sigma1, Sigma2 = torch.linalg.inv(B_pd), torch.linalg.inv(A_pd)  # row (n x n) and column (m x m) covariances
W_star = layer.weight.detach().clone()  # (n, m): the mean


def neg_log_p(w):
    """-log p(W) of MN(W*, B^-1, A^-1) up to a constant, as a function of vec(W)."""
    D = fk.unvec(w, n, m) - W_star
    return 0.5 * torch.trace(torch.linalg.solve(Sigma1, D) @ torch.linalg.solve(Sigma2, D.T))


H = torch.autograd.functional.hessian(neg_log_p, fk.vec(W_star + torch.randn(n, m, dtype=f64)))  # (nm, nm)
assert close(H, fk.kron(A_pd, B_pd), dict(rtol=1e-8, atol=1e-10)), "Hessian of -log p = A (x) B"
L1, L2 = torch.linalg.cholesky(Sigma1), torch.linalg.cholesky(Sigma2)
assert close(fk.kron(L2, L1) @ fk.kron(L2, L1).T, fk.kron(Sigma2, Sigma1), dict(rtol=1e-8, atol=1e-10)), \
    "Cov(vec(L1 Z L2^T)) = Sigma2 (x) Sigma1"
print(f"regularisation alpha: A {regA.alpha:g}, B {regB.alpha:g}; the Hessian of -log p is A (x) B")

# %% [markdown]
# ## 6. Theorem 1, checked numerically
#
# With $A = L_AL_A^\top$, $B = L_BL_B^\top$ (Cholesky), the Fisher-weighted error of a
# perturbation is a plain Frobenius norm,
# $\mathrm{tr}(\Delta W^\top B\Delta W A) = \lVert L_B^\top \Delta W L_A\rVert_F^2$, so the best
# rank-$r$ $\widehat W_r$ is
# $$\widehat W_r = L_B^{-\top}\,\mathrm{SVD}_r\big(L_B^\top W L_A\big)\,L_A^{-1}
# = W_2W_1,\quad W_1 = \hat S^{1/2}\hat V^\top L_A^{-1},\; W_2 = L_B^{-\top}\hat U\hat S^{1/2},$$
# and its error is the sum of the discarded squared singular values $\sum_{j>r}\hat s_j^2$ of
# $L_B^\top W L_A$. We check the formula, and that neither plain SVD nor FWSVD does better. That no
# other rank-$r$ matrix does either -- thousands of random ones, near the optimum and far from it, and
# a local optimiser (L-BFGS on $W_2, W_1$) started from random points, which must reach the closed form
# and never beat it -- is checked in `tests/test_teaching_checks.py`.

# %%
W = layer.weight.detach()  # (n, m)
W2, W1 = fk.gfwsvd(W, regA, regB, rank)  # (n, r), (r, m)
W_r = W2 @ W1
assert torch.linalg.matrix_rank(W_r) == rank, "W2 W1 has rank r"
s_hat = torch.linalg.svdvals(regB.L.T @ W @ regA.L)
err_opt = fk.fisher_weighted_error(W, W_r, A_pd, B_pd)
assert close(err_opt, (s_hat[rank:] ** 2).sum(), dict(rtol=1e-9, atol=1e-14)), \
    "error of GFWSVD = sum of discarded squared weighted singular values"
err_svd = fk.fisher_weighted_error(W, torch.matmul(*fk.svd(W, rank)), A_pd, B_pd)
err_fw = fk.fisher_weighted_error(W, torch.matmul(*fk.fwsvd(W, (G * G).mean(0), rank)), A_pd, B_pd)
assert err_opt <= err_svd * (1 + 1e-12) and err_opt <= err_fw * (1 + 1e-12), "GFWSVD beats SVD and FWSVD"
print(f"Fisher-weighted error at rank {rank}: GFWSVD {err_opt:.4e}  SVD {err_svd:.4e}  FWSVD {err_fw:.4e}")

# %% [markdown]
# ## 7. FWSVD is a special case: a diagonal factor on one side, the identity on the other (Appendix E)
#
# Restrict the Kronecker approximation to $I_m \otimes \tilde D$ with $\tilde D$ diagonal. The
# least-squares problem $\min_d \lVert F - I_m\otimes \mathrm{diag}(d)\rVert_F$ is linear in $d$
# and its solution is
# $$d = \tfrac1m\,\mathrm{diag}\big(\mathbb E[GG^\top]\big),\qquad
# \mathbb E[GG^\top] = \tfrac1k\textstyle\sum_i G_iG_i^\top ,$$
# i.e. $\tilde D = D^2/m$ with $D_{ii} = \sqrt{\sum_j \mathbb E[G_{ij}^2]}$. Theorem 1 with
# $A = I$, $B = \tilde D$ gives $\widehat W_r = D^{-1}\mathrm{SVD}_r(DW)$: the scale $1/m$ cancels. This
# is FWSVD as Appendix E states it, weighting the output rows (`fk.fwsvd_rows`).
#
# The FWSVD code the paper's numbers came from (the authors' BERT code, ASVD4LLM's Fisher scaling)
# weights the *input columns* instead. It is the mirror case: $\mathrm{diag}(c) \otimes I_n$ with
# $c = \tfrac1n\,\mathrm{diag}\big(\mathbb E[G^\top G]\big)$, $c_j = \tfrac1n\sum_i \mathbb E[G_{ij}^2]$, and
# Theorem 1 with $A = \mathrm{diag}(c)$, $B = I$ gives $\widehat W_r = \mathrm{SVD}_r(WC)\,C^{-1}$,
# $C_{jj} = \sqrt{\sum_i \mathbb E[G_{ij}^2]}$: this is `fk.fwsvd`. With $A = I$, $B = I$ it is plain SVD.

# %% tags=["hide-input"]
basis = torch.stack([fk.vec(fk.kron(torch.eye(m, dtype=f64), torch.diag(e))) for e in torch.eye(n, dtype=f64)])
d_ls = torch.linalg.lstsq(basis.T, fk.vec(F)[:, None]).solution[:, 0]  # (n,): least squares over d
EGGt = torch.einsum("kim,kjm->ij", G, G) / k  # (n, n): E[G G^T]
assert close(d_ls, torch.diagonal(EGGt) / m), "d = diag(E[G G^T]) / m"
assert close(torch.diagonal(EGGt), (G * G).mean(0).sum(1)), "diag(E[G G^T])_i = sum_j E[G_ij^2]"
basis_in = torch.stack([fk.vec(fk.kron(torch.diag(e), torch.eye(n, dtype=f64))) for e in torch.eye(m, dtype=f64)])
c_ls = torch.linalg.lstsq(basis_in.T, fk.vec(F)[:, None]).solution[:, 0]  # (m,): least squares over c
assert close(c_ls, (G * G).mean(0).sum(0) / n), "c = diag(E[G^T G]) / n"
for r in range(1, min(n, m) + 1):
    W_rows = torch.matmul(*fk.fwsvd_rows(W, (G * G).mean(0), r))
    W_gdiag = torch.matmul(*fk.gfwsvd(W, torch.eye(m, dtype=f64), torch.diag(d_ls), r))
    W_cols = torch.matmul(*fk.fwsvd(W, (G * G).mean(0), r))
    W_gcols = torch.matmul(*fk.gfwsvd(W, torch.diag(c_ls), torch.eye(n, dtype=f64), r))
    W_svd = torch.matmul(*fk.svd(W, r))
    W_gid = torch.matmul(*fk.gfwsvd(W, torch.eye(m, dtype=f64), torch.eye(n, dtype=f64), r))
    assert close(W_gdiag, W_rows, dict(rtol=1e-9, atol=1e-12)), f"GFWSVD(I, D~) = FWSVD (App. E) at rank {r}"
    assert close(W_gcols, W_cols, dict(rtol=1e-9, atol=1e-12)), f"GFWSVD(C~, I) = FWSVD (its code) at rank {r}"
    assert close(W_gid, W_svd, dict(rtol=1e-9, atol=1e-12)), f"GFWSVD(I, I) = SVD at rank {r}"
print("FWSVD (App. E) = GFWSVD(I, diag(E[GG^T])/m), FWSVD (its code) = GFWSVD(diag(E[G^T G])/n, I), "
      "SVD = GFWSVD(I, I) at every rank")

# %% [markdown]
# ## 8. The family side by side: the transformation pairs of a real layer (Fig. connection2fwsvd)
#
# Sections 6 and 7 put every method into one formula, Eq. (7). A method is a pair of
# transformation matrices, $L_B$ ($n\times n$, output side) and $L_A$ ($m\times m$, input side);
# the weight is moved into a new space, truncated there by a plain SVD, and moved back:
# $$\widetilde W = L_B^\top W L_A,\qquad \widehat W_r = L_B^{-\top}\,\mathrm{SVD}_r(\widetilde W)\,L_A^{-1}.$$
#
# | method | $L_B$ (output side, $n\times n$) | $L_A$ (input side, $m\times m$) |
# |---|---|---|
# | SVD | $I_n$ | $I_m$ |
# | FWSVD as App. E writes it (`fk.fwsvd_rows`) | $D$, $D_{ii} = \sqrt{\sum_j \mathbb E[G_{ij}^2]}$ | $I_m$ |
# | FWSVD as its code runs it (`fk.fwsvd`) | $I_n$ | $C$, $C_{jj} = \sqrt{\sum_i \mathbb E[G_{ij}^2]}$ |
# | GFWSVD (`fk.gfwsvd`) | $L_B$ with $B = L_BL_B^\top$ | $L_A$ with $A = L_AL_A^\top$ |
#
# Here the pairs are drawn for one layer of a real model: `real_layer` of the embedded
# all-MiniLM-L6-v2 (the paper's BERT role, shipped in a package, so this runs offline). Its
# per-batch gradients $G_i$ come from `real_k` batches of SST-2 training sentences and the
# classification loss, exactly as in Section 1; the embedded model has no fine-tuned head, so the
# head is drawn with a fixed seed. FWSVD reads the diagonal Fisher $\mathbb E[G * G]$, GFWSVD
# MFF's $A\otimes B$, regularised once with `fk.regularize` as GFWSVD would regularise it (as in
# Section 5; the `alpha` each factor needed is printed below). The pairs are the library's:
# `fisherkron.experiments.teaching.transform_pair` writes out, as dense matrices, the weights that
# `fisherkron.core.methods.method_weights` hands to the one kernel.
#
# **Reading the figure.** A transformation matters only up to a positive scale: $L_B \to cL_B$
# multiplies $\widetilde W$ and its truncation by $c$, and $L_B^{-\top}$ divides it back out, so
# $\widehat W_r$ does not change (checked below, together with: these pairs give each method's
# own factors). So each matrix is divided by its largest $|\text{entry}|$ and one symmetric-log
# colour scale serves all eight heatmaps. Each heatmap shows the leading `crop` $\times$ `crop`
# block; the leading block of a Cholesky factor is the Cholesky factor of the leading block of the
# matrix it factors, so what the GFWSVD panels show does not depend on the rows cut away. The
# bottom row plots the whole diagonal of both matrices (log scale, the cropped entries shaded):
# flat at 1 for an identity, spread over more than a decade for FWSVD's $D$ and $C$ (diagonal, but
# not the identity), and far below the largest entry for GFWSVD, whose weight sits off the diagonal.

# %% tags=["hide-input"]
from fisherkron.core.methods import factorize_weight
from fisherkron.experiments.teaching import offdiagonal_share, transform_pair

model.requires_grad_(False)  # the model loaded for the Result above, its own (seeded, unfitted) head
batches = hf.classification_batches(tok, hf.load_task("sst2", "train"), real_k, batch_size=real_batch_size,
                                    seed=seed, task="sst2")
lin = model.get_submodule(real_layer)
lin.weight.requires_grad_(True)  # back-propagate only as far as this layer
G_real = torch.stack([torch.autograd.grad(model(**b).loss, lin.weight)[0] for b in batches]).to(f64)  # (k, n, m)
W_real = lin.weight.detach().to(f64)  # (n, m)
n_r, m_r = W_real.shape
mff_real = fk.mff(G_real)  # float32 products, the library's default for real layers
assert mff_real.converged, "MFF converged on the real layer"
regA_real, regB_real = fk.regularize(mff_real.A), fk.regularize(mff_real.B)  # once, as GFWSVD would (Sec. 5)
stats = dict(A=regA_real, B=regB_real, diag_fisher=(G_real * G_real).mean(0))  # A (m, m), B (n, n), E[G*G] (n, m)
COLUMNS = {  # method -> (column title, symbol of L_B, symbol of L_A)
    "svd": ("SVD", "$I_n$", "$I_m$"),
    "fwsvd_rows": ("FWSVD as App. E writes it\n(output rows, fk.fwsvd_rows)", "$D$", "$I_m$"),
    "fwsvd": ("FWSVD as its code runs it\n(input columns, fk.fwsvd)", "$I_n$", "$C$"),
    "gfwsvd": ("GFWSVD\n(MFF's $A \\otimes B$, fk.gfwsvd)", "$L_B$", "$L_A$"),
}
pairs = {name: transform_pair(name, W_real, **stats, layer=real_layer) for name in COLUMNS}  # (L_B, L_A) each

In, Im = torch.eye(n_r, dtype=f64), torch.eye(m_r, dtype=f64)
assert torch.equal(pairs["svd"].L_B, In) and torch.equal(pairs["svd"].L_A, Im), "SVD: the identity pair"
D, C = pairs["fwsvd_rows"].L_B, pairs["fwsvd"].L_A  # (n, n), (m, m)
assert torch.equal(pairs["fwsvd_rows"].L_A, Im) and torch.equal(pairs["fwsvd"].L_B, In), "FWSVD: one identity side"
assert close(D ** 2, torch.diag(torch.einsum("kim,kim->i", G_real, G_real) / real_k)), \
    "App. E: D^2 = diag(E[G G^T]), (E[G G^T])_ii = sum_j E[G_ij^2]"
assert close(C ** 2, torch.diag(torch.einsum("kni,kni->i", G_real, G_real) / real_k)), \
    "its code: C^2 = diag(E[G^T G]), (E[G^T G])_jj = sum_i E[G_ij^2]"
L_B, L_A = pairs["gfwsvd"].L_B, pairs["gfwsvd"].L_A  # (n, n), (m, m): lower triangular
assert torch.equal(L_B, L_B.tril()) and torch.equal(L_A, L_A.tril()), "GFWSVD: Cholesky factors"
assert close(L_B @ L_B.T, regB_real.matrix) and close(L_A @ L_A.T, regA_real.matrix), "B = L_B L_B^T, A = L_A L_A^T"
assert close(torch.linalg.cholesky(regB_real.matrix[:crop, :crop]), L_B[:crop, :crop], dict(rtol=1e-8, atol=1e-12)), \
    "the leading block of L_B is the Cholesky factor of the leading block of B"
SCALE_FREE = 1e-8  # relative change of W_r under a rescaled pair: round-off of the solves with L_B, L_A
for name, pair in pairs.items():
    ref = torch.matmul(*factorize_weight(name, W_real, crop, **stats, layer=real_layer))  # (n, m): the method's W_r
    got = torch.matmul(*fk.weighted_svd(W_real, crop, left=3.0 * pair.L_B, right=pair.L_A / 7.0))  # rescaled pair
    rel = float((got - ref).norm() / ref.norm())
    assert rel < SCALE_FREE, f"{name}: the rescaled pair gives the method's rank-{crop} W_r ({rel:.1e})"
share = {name: (offdiagonal_share(p.L_B), offdiagonal_share(p.L_A)) for name, p in pairs.items()}
assert min(share["gfwsvd"]) > 0.5, "GFWSVD: both transformations are full (most of their norm off the diagonal)"
print(f"{real_layer}: W is {n_r} x {m_r}; MFF from k={real_k} gradients holds "
      f"{100 * mff_real.fisher_share:.0f}% of ||F||^2; regularisation alpha_A {pairs['gfwsvd'].alpha_A:g}, "
      f"alpha_B {pairs['gfwsvd'].alpha_B:g}")
for name, (sB, sA) in share.items():
    print(f"  {name:<11s} share of ||L||_F off the diagonal: L_B {sB:.2f}, L_A {sA:.2f}")

# %% tags=["hide-input"]
from matplotlib.colors import SymLogNorm


def describe(M: torch.Tensor, symbol: str) -> str:
    """Panel title: the symbol, and whether the matrix is the identity, diagonal or full."""
    if torch.equal(M, torch.eye(M.shape[0], dtype=M.dtype)):
        return f"{symbol}: identity"
    d = torch.diagonal(M)
    if offdiagonal_share(M) == 0.0:
        return f"{symbol}: diagonal, max/min {float(d.max() / d.min()):.0f}"
    return f"{symbol}: full, {100 * offdiagonal_share(M):.1f}% of its norm off the diagonal"


LINTHRESH = 1e-3  # the colour scale is linear within +-1e-3 of the largest entry, logarithmic beyond
norm = SymLogNorm(linthresh=LINTHRESH, vmin=-1.0, vmax=1.0, base=10)
fig, axes = plt.subplots(3, len(COLUMNS), figsize=(4.1 * len(COLUMNS), 10.6), layout="constrained",
                         gridspec_kw=dict(height_ratios=[1, 1, 0.5]))
for col, (name, (title, sym_B, sym_A)) in enumerate(COLUMNS.items()):
    sides = ((pairs[name].L_B, sym_B, "output side", "tab:purple"), (pairs[name].L_A, sym_A, "input side", "tab:green"))
    for row, (M, sym, side, colour) in enumerate(sides):
        S = M / M.abs().max()  # (size, size): the scale is free (see above)
        ax = axes[row, col]
        im = ax.imshow(S[:crop, :crop].numpy(), cmap="RdBu_r", norm=norm, interpolation="nearest")
        ax.set_title(describe(M, sym), fontsize=10)
        ax.set_xticks([0, crop - 1])
        ax.set_yticks([0, crop - 1])
        ax.tick_params(labelsize=8)
        axes[2, col].semilogy(torch.diagonal(S).numpy(), color=colour, lw=1, label=f"{sym} ({side})")
    ax = axes[2, col]
    ax.axvspan(0, crop - 1, color="0.9", zorder=0)  # the entries the heatmaps above show
    if col:
        ax.sharey(axes[2, 0])  # one scale along the row, as for the heatmaps
    ax.set_ylim(1e-5, 3.0)  # room below the curves for the legend
    ax.set_xlim(0, n_r)
    ax.set_xlabel("index of the diagonal entry", fontsize=9)
    ax.tick_params(labelsize=8)
    ax.legend(fontsize=8, loc="lower center", ncols=2, frameon=False)
    axes[0, col].annotate(title, xy=(0.5, 1.13), xycoords="axes fraction", ha="center", va="bottom",
                          fontsize=11, fontweight="bold")
axes[0, 0].set_ylabel(f"output side\n$L_B$, left of $W$ ({n_r} × {n_r})", fontsize=11)
axes[1, 0].set_ylabel(f"input side\n$L_A$, right of $W$ ({m_r} × {m_r})", fontsize=11)
axes[2, 0].set_ylabel("whole diagonal\n(grey: the block above)", fontsize=11)
fig.colorbar(im, ax=axes[:2].ravel().tolist(), shrink=0.7,
             label=f"entry / largest |entry| of its matrix (symmetric log, linear within $\\pm${LINTHRESH:g})")
fig.suptitle("The weighted-SVD family as transformation pairs, $\\widetilde W = L_B^\\top W L_A$ (Eq. 7): "
             f"MiniLM-L6 {real_layer} ({n_r} × {m_r}), k = {real_k} SST-2 batches\n"
             f"heatmaps: the leading {crop} × {crop} block of each matrix; each matrix divided by its largest |entry|",
             fontsize=12)
figures.save_figure(fig, "fig_connection2fwsvd", output_dir, params, started=started, notebook=NOTEBOOK)
plt.show()

# %% [markdown]
# ## 9. The loss link, step by step (Eq. (1)-(2))
#
# The paper's starting point is the second-order expansion of the loss around an optimum
# $\theta^\star$, Eq. (1), and the compression problem it implies, Eq. (2):
# $$\Delta\mathcal L = \mathcal L(\theta) - \mathcal L(\theta^\star) \approx
# \tfrac12(\theta-\theta^\star)^\top H\,(\theta-\theta^\star),\qquad
# \min_{\mathcal C}\;(\theta^\star - \mathcal C(\theta^\star))^\top H\,(\theta^\star - \mathcal C(\theta^\star)).$$
# For one layer, with $H \approx F \approx A\otimes B$,
# $$\Delta\mathcal L \approx \tfrac12\,\mathrm{vec}(\Delta W)^\top (A\otimes B)\,\mathrm{vec}(\Delta W)
# = \tfrac12\,\mathrm{tr}(\Delta W^\top B\,\Delta W A),$$
# the quantity GFWSVD minimises. FWSVD uses the diagonal instead,
# $\tfrac12\sum_{ij}\mathbb E[G_{ij}^2]\,\Delta W_{ij}^2$, and plain SVD implicitly a multiple of the
# identity. Three approximations stand between the measured loss and these formulas; the experiment
# of the Result section takes them apart:
#
# * **Taylor.** Eq. (1) drops the first-order term $\langle\nabla\mathcal L, \Delta W\rangle$, which
#   vanishes only at a minimum. Here the encoder was trained for another objective and only the head
#   was fitted, so it does not vanish. We therefore measure the *even part*
#   $\tfrac12[\mathcal L(W+\Delta W) + \mathcal L(W-\Delta W)] - \mathcal L(W)
#   = \tfrac12\mathrm{vec}(\Delta W)^\top H\,\mathrm{vec}(\Delta W) + O(\lVert\Delta W\rVert^4)$,
#   in which every odd order cancels, and show the one-sided change beside it.
# * **Fisher for Hessian.** The Hessian of the mean cross-entropy is the Fisher of the model's own
#   predictive distribution (labels drawn from the model: the Gauss-Newton part) plus a term weighted
#   by the residuals; the *empirical* Fisher (the data's labels, the paper's choice) equals the
#   model's Fisher where the model's predictions match the data, i.e. near a good optimum. Both are
#   computed (`CLSPath.fisher_inputs`, `labels="data"` and `"model"`; for the model's Fisher the
#   expectation over the two classes is taken exactly, not sampled).
# * **Kronecker.** $A\otimes B$ only approximates $F$; the full Fisher's quadratic form is cheap to
#   evaluate exactly, $\mathrm{vec}(\Delta W)^\top F\,\mathrm{vec}(\Delta W)
#   = \frac1N\sum_t (\delta_t^\top \Delta W x_t)^2$, and is scored too.
#
# One more point is a scale, not an approximation: the Fisher here is that of *per-sentence*
# gradients, the one that matches the Hessian of the mean loss. With per-batch gradients of $T$
# sentences (the paper's protocol) $F$ shrinks by about $1/T$: the weighted SVD does not change, the
# dashed line in the figure would.
#
# **The layer.** The logits of a BERT classifier read only the first ([CLS]) token of the last block,
# and after that block's attention every step acts token by token. So for a linear layer of the last
# block the loss is a small function of each sentence's [CLS] inputs (`tc.CLSPath`, float64), and
# hundreds of loss evaluations take seconds. Its per-sentence gradient is rank one,
# $G_t = \delta_t x_t^\top$, so MFF runs on the inputs $x_t$ and output gradients $\delta_t$ directly
# (`fk.mff` on a `TokenFisher`, the products of Section 2 with $G_t^\top Z G_t = (\delta_t^\top Z\delta_t)\,x_t x_t^\top$).
# First, the path reproduces the model, and the gradient is $\delta_t x_t^\top$:

# %%
fresh = tc.CLSPath(model, link_layer)  # a second copy, with the model's own (unfitted) head
logits = fresh.logits(fresh.data(calib_inputs))  # (N, 2), float64
scale = float(calib_inputs.logits.abs().max())
assert float((logits - calib_inputs.logits).abs().max()) <= CLS_PATH * scale, "the [CLS] path gives the model's logits"
emp = link.fishers["data"]  # the empirical Fisher: X (N, m), D (N, n), MFF's A, B, the diagonal E[G * G]
first = calib._replace(X=calib.X[:1], ctx=calib.ctx[:1], y=calib.y[:1])  # one sentence
W_leaf = path.W.clone().requires_grad_()
(G_t,) = torch.autograd.grad(nn.functional.cross_entropy(path.logits(first, W_leaf), first.y), W_leaf)  # (n, m)
assert close(G_t, torch.outer(emp.D[0], emp.X[0])), "per-sentence gradient G_t = delta_t x_t^T"
assert close(emp.diag, (emp.D ** 2).T @ (emp.X ** 2) / len(emp.X)), "E[G_ij^2] = mean_t delta_ti^2 x_tj^2"
print(f"{path.layer}: W is {link.shape[0]} x {link.shape[1]}; the [CLS] path matches the model's logits; "
      f"per-sentence gradients are rank one")

# %% [markdown]
# Then the measurement and the two predictions, written out for every direction of the table
# (`tc.loss_link` computed the same numbers; the asserts say so):
# $$\text{measured} = \tfrac12[\mathcal L(W+\Delta W) + \mathcal L(W-\Delta W)] - \mathcal L(W),\qquad
# \text{Kronecker} = \tfrac12\mathrm{tr}(\Delta W^\top B\,\Delta W A),\qquad
# \text{diagonal} = \tfrac12\textstyle\sum_{ij}\mathbb E[G_{ij}^2]\,\Delta W_{ij}^2 .$$

# %%
directions = tc.perturbation_directions(path.W, A=emp.A, B=emp.B, diag_fisher=emp.diag, rank=link_rank,
                                        draws=link_draws, seed=seed)  # (kind, V): unit-norm (n, m)
t = link.table
for index, (kind, V) in enumerate(directions):
    rows = t[t["index"] == index]
    dW = [float(np.sqrt(r)) * V for r in rows.norm2]  # (n, m) each: ||dW|| = size ||W||
    kron = [0.5 * float(torch.trace(d.T @ emp.B @ d @ emp.A)) for d in dW]  # 1/2 tr(dW^T B dW A)
    diag = [0.5 * float((emp.diag * d * d).sum()) for d in dW]  # 1/2 sum_ij E[G_ij^2] dW_ij^2
    assert np.allclose(kron, rows.kronecker_data, rtol=1e-9) and np.allclose(diag, rows.diagonal_data, rtol=1e-9)
d0 = dW[0]  # one perturbation, measured again by hand
measured = (path.loss(heldout, path.W + d0) + path.loss(heldout, path.W - d0)) / 2 - path.loss(heldout)
assert abs(measured - rows.measured.iloc[0]) <= 1e-12, "the even part of the loss change"
summary.round(3)

# %% [markdown]
# `pearson` mixes the sizes, so even a prediction that knows only $\lVert\Delta W\rVert$ (the
# isotropic one) scores well; `spearman` ranks the *directions* by their curvature
# $\Delta\mathcal L/\lVert\Delta W\rVert^2$, which the size cannot explain; `ratio` is the median of
# measured / predicted (1 on the dashed line). Per direction, at the smallest size:

# %%
smallest = t[t["size"] == t["size"].min()]
per_direction = pd.DataFrame({
    "direction": smallest.direction.values,
    "measured / Kronecker (empirical)": (smallest.measured / smallest.kronecker_data).values,
    "measured / Kronecker (model's)": (smallest.measured / smallest.kronecker_model).values,
    "measured / full Fisher (empirical)": (smallest.measured / smallest.fisher_data).values,
    "measured / diagonal (empirical)": (smallest.measured / smallest.diagonal_data).values,
})
worst = per_direction.iloc[per_direction["measured / Kronecker (empirical)"].idxmax()]
print(f"The Kronecker prediction is most optimistic along the {worst.direction} direction: the loss rose "
      f"{worst['measured / Kronecker (empirical)']:.1f} x as much as predicted (the full empirical Fisher: "
      f"{worst['measured / full Fisher (empirical)']:.1f} x).")
if worst.direction == "GFWSVD error":
    print("That is the direction GFWSVD chose because the Kronecker prediction is small there (it minimises it over "
          "rank-r compressions): what A (x) B misses of the Fisher, and the Fisher of the Hessian, such a direction finds.")
per_direction.round(2)

# %% [markdown]
# **Try it.**
# * Set `link_sizes = [0.1, 0.3, 1.0]`: at which size does the quadratic model of Eq. (1) stop
#   predicting the measured change (watch `ratio` and the per-direction table)?
# * Set `link_layer = "intermediate.dense"` (the last block's $1536\times 384$ feed-forward layer, as
#   in Section 8; slower): does the Kronecker prediction still rank the directions better than the
#   diagonal one?

# %%
print(f"all checks passed in {time.perf_counter() - started:.1f} s")
