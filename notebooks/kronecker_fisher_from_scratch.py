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
# **Claim.** For one linear layer, (i) the best Kronecker approximation $F \approx A \otimes B$ of
# the empirical Fisher in Frobenius norm is the leading singular pair of the *rearranged* Fisher
# $\mathcal R(F)$ (Van Loan & Pitsianis), which MFF (Algorithm 1) finds without forming $F$;
# (ii) a Kronecker-structured curvature is exactly the Hessian of a matrix-variate normal
# log-likelihood; (iii) under it the best rank-$r$ compression of the weight is the weighted SVD
# of Theorem 1 (GFWSVD); and (iv) FWSVD is a special case: $A = I$, $B$ diagonal as Appendix E
# states it, or $A$ diagonal, $B = I$ as the public FWSVD code (and `fk.fwsvd`) runs it; (v) so
# the whole weighted-SVD family is one formula, $\widetilde W = L_B^\top W L_A$, with a pair of
# transformation matrices that is the identity for SVD, one diagonal matrix beside an identity for
# FWSVD, and two full matrices for GFWSVD (Sec. 5.1, Fig. connection2fwsvd).
#
# **How to read.** Sections 1-6 work on a layer with $n = 4$ outputs and $m = 3$ inputs, small
# enough to write every matrix down in float64. Each section states a fact in LaTeX and the code
# below it checks the fact with an `assert`: if the notebook runs to the end, every statement in
# it held on this example. The core library (`fisherkron`) is called for what it provides
# (`vec`, `rearranged_fisher`, `mff`, `kfac_factors`, `gfwsvd`, `fwsvd`, `svd`, `regularize`);
# the dense references are written out here, since they are the point of the lesson. Section 7
# draws the transformation pairs of (v) for a real layer of the embedded MiniLM
# (`fig_connection2fwsvd`): a lone diagonal is SVD or FWSVD, a filled-in triangle (a Cholesky
# factor) is GFWSVD.
#
# **Conventions** (`fisherkron.core.conventions`): $W$ and gradients $G_i$ are $n\times m$ (out $\times$
# in); $\mathrm{vec}$ stacks *columns*; $A$ is $m\times m$ (input side), $B$ is $n\times n$
# (output side), and
# $$\mathrm{vec}(\Delta W)^\top (A\otimes B)\,\mathrm{vec}(\Delta W) = \mathrm{tr}(\Delta W^\top B\,\Delta W A).$$

# %% tags=["parameters"]
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
mc_samples = 200000  # Monte Carlo samples for the matrix-normal covariance check; paper: 200000
competitors = 2000  # random rank-r matrices that must not beat Theorem 1; paper: 2000
restarts = 10  # local optimisations of (W2, W1) that must not beat Theorem 1; paper: 10
alpha = 0.01  # regularisation A + alpha diag(A) of the factors before Cholesky (Sec. 5); paper: 0.01
real_model = "minilm"  # Sec. 7: the embedded all-MiniLM-L6-v2 (the paper's BERT role); paper: "minilm"
real_layer = "bert.encoder.layer.3.intermediate.dense"  # its layer drawn in Sec. 7 (1536 x 384); paper: same
real_k = 16  # SST-2 training batches whose gradients give that layer's factors; paper: 16
real_batch_size = 8  # sentences per batch; paper: 8
crop = 64  # each transformation matrix is drawn as its leading crop x crop block; paper: 64

# %%
import time

import matplotlib.pyplot as plt
import numpy as np
import torch
from torch import nn

import fisherkron as fk
from fisherkron.experiments import figures
from fisherkron.testing import FLOAT64  # exact identities, up to float64 round-off

started = time.perf_counter()
params = dict(profile=profile, n=n, m=m, T=T, k=k, seed=seed, rank=rank, mc_samples=mc_samples,
              competitors=competitors, restarts=restarts, alpha=alpha, real_model=real_model,
              real_layer=real_layer, real_k=real_k, real_batch_size=real_batch_size, crop=crop)
torch.manual_seed(seed)
f64 = torch.float64
ITERATIVE = dict(rtol=1e-7, atol=1e-10)  # MFF (float64) stops at an estimated error of 1e-10 in A (x) B
MONTE_CARLO = 0.05  # relative error allowed for a sample covariance of mc_samples draws


def close(a, b, tol=FLOAT64):
    """``torch.allclose`` for tensors, with a named tolerance."""
    return torch.allclose(torch.as_tensor(a, dtype=f64), torch.as_tensor(b, dtype=f64), **tol)


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
# a product that costs a few small matrix products per gradient and never forms $F$ (Eq. (12)).

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
Z = torch.randn(n, n, dtype=f64)
assert close(RF @ fk.vec(Z), fk.vec(sum(Gi.T @ Z @ Gi for Gi in G) / k)), "matvec: vec((1/k) sum G^T Z G)"
assert close(torch.from_numpy(op.matvec(fk.vec(Z).numpy())), RF @ fk.vec(Z)), "matrix-free matvec"
print(f"R(F) is {tuple(RF.shape)}: {m}^2 x {n}^2")

# %% [markdown]
# ## 3. MFF against the dense answer
#
# Dense answer: with $\mathcal R(F) = \sum_j \sigma_j u_j v_j^\top$,
# $A = \sqrt{\sigma_1}\,\mathrm{mat}(u_1)$ ($m\times m$) and $B = \sqrt{\sigma_1}\,\mathrm{mat}(v_1)$
# ($n\times n$), signed so that $\mathrm{tr}A > 0$; by Eckart–Young the error is
# $\lVert F - A\otimes B\rVert_F^2 = \lVert F\rVert_F^2 - \sigma_1^2$. For a PSD $F$ both factors
# are symmetric PSD. MFF (`fisherkron.mff`, Algorithm 1) gets the same pair from matrix-free
# products with $\mathcal R(F)$ and $\mathcal R(F)^\top$ only; it is optimal among *all*
# Kronecker products, so it is at least as close to $F$ as K-FAC's
# $A = \mathbb E[x x^\top]$, $B \propto \mathbb E[\delta\delta^\top]$.

# %%
U_, S_, Vh_ = torch.linalg.svd(RF)
A_dense = S_[0].sqrt() * fk.unvec(U_[:, 0], m, m)  # (m, m)
B_dense = S_[0].sqrt() * fk.unvec(Vh_[0], n, n)  # (n, n)
if torch.trace(A_dense) < 0:
    A_dense, B_dense = -A_dense, -B_dense
res = fk.mff(G, dtype=f64)
A, B = res.A, res.B
assert res.converged, "MFF converged"
assert close(fk.kron(A, B), fk.kron(A_dense, B_dense), ITERATIVE), "MFF finds the dense A (x) B"
assert close(res.sigma[0], S_[0], ITERATIVE), "sigma_1 of R(F)"
err2 = torch.linalg.norm(F - fk.kron(A, B)) ** 2
assert close(err2, torch.linalg.norm(F) ** 2 - S_[0] ** 2, dict(rtol=1e-6, atol=1e-12)), \
    "Eckart-Young: ||F - A (x) B||^2 = ||F||^2 - sigma_1^2"
for name, M in (("A", A), ("B", B)):
    assert close(M, M.T) and torch.linalg.eigvalsh(M).min() > -1e-10 * torch.linalg.eigvalsh(M).max(), \
        f"{name} is symmetric PSD"
kfac = fk.kfac_factors(X, delta, num_batches=k)  # inputs (k, T, m), output errors (k, T, n)
err2_kfac = torch.linalg.norm(F - fk.kron(kfac.A, kfac.B)) ** 2
assert err2 <= err2_kfac * (1 + 1e-12), "MFF is at least as close to F as K-FAC"
print(f"MFF: {res.matvecs} products with R(F); sigma_1^2/||F||^2 = {res.fisher_share:.3f} of the Fisher captured")
print(f"relative error ||F - A(x)B||/||F||: MFF {float(err2.sqrt() / torch.linalg.norm(F)):.3f}, "
      f"K-FAC {float(err2_kfac.sqrt() / torch.linalg.norm(F)):.3f}")

# %%
fig, axes = plt.subplots(1, 4, figsize=(15, 3.6))
panels = [(F, "$F$ ($nm \\times nm$)"), (RF, "$\\mathcal{R}(F)$ ($m^2 \\times n^2$)"),
          (fk.kron(A, B), "MFF $A \\otimes B$"), (F - fk.kron(A, B), "$F - A \\otimes B$")]
vmax = float(F.abs().max())
for ax, (M, title) in zip(axes, panels):
    im = ax.imshow(M.numpy(), cmap="RdBu_r", vmin=-vmax, vmax=vmax)
    ax.set_title(title)
    ax.set_xticks([])
    ax.set_yticks([])
fig.colorbar(im, ax=axes.tolist(), shrink=0.8)
fig.suptitle(f"Empirical Fisher of a {n}x{m} layer from k={k} batch gradients; "
             f"A(x)B captures {100 * res.fisher_share:.0f}% of ||F||^2", y=1.02)
figures.save_figure(fig, "kronecker_fisher_from_scratch", output_dir, params, started=started,
                    notebook="notebooks/kronecker_fisher_from_scratch.py")
plt.show()

# %% [markdown]
# ## 4. The matrix-variate normal view: why the Hessian is $B^{-1}\otimes A^{-1}$-shaped
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
Zs = torch.randn(mc_samples, n, m, dtype=f64)
samples = fk.vec(L1 @ Zs @ L2.T)  # (mc_samples, n m): vec(X - M)
cov_mc = samples.T @ samples / mc_samples
rel = float(torch.linalg.norm(cov_mc - fk.kron(Sigma2, Sigma1)) / torch.linalg.norm(fk.kron(Sigma2, Sigma1)))
assert rel < MONTE_CARLO, f"sample covariance of vec(X) matches Sigma2 (x) Sigma1 (relative error {rel:.3f})"
print(f"regularisation alpha: A {regA.alpha:g}, B {regB.alpha:g}; Monte Carlo covariance error {rel:.3f}")

# %% [markdown]
# ## 5. Theorem 1, checked numerically
#
# With $A = L_AL_A^\top$, $B = L_BL_B^\top$ (Cholesky), the Fisher-weighted error of a
# perturbation is a plain Frobenius norm,
# $\mathrm{tr}(\Delta W^\top B\Delta W A) = \lVert L_B^\top \Delta W L_A\rVert_F^2$, so the best
# rank-$r$ $\widehat W_r$ is
# $$\widehat W_r = L_B^{-\top}\,\mathrm{SVD}_r\big(L_B^\top W L_A\big)\,L_A^{-1}
# = W_2W_1,\quad W_1 = \hat S^{1/2}\hat V^\top L_A^{-1},\; W_2 = L_B^{-\top}\hat U\hat S^{1/2},$$
# and its error is the sum of the discarded squared singular values $\sum_{j>r}\hat s_j^2$ of
# $L_B^\top W L_A$. We check the formula, and that no other rank-$r$ matrix does better: not plain
# SVD, not FWSVD, not thousands of random rank-$r$ matrices, and not a local optimiser started
# from random points.

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
gen = torch.Generator().manual_seed(seed)
E2 = torch.randn(competitors, n, rank, dtype=f64, generator=gen)  # (c, n, r)
E1 = torch.randn(competitors, rank, m, dtype=f64, generator=gen)  # (c, r, m)
eps = torch.logspace(-4, 0, competitors, dtype=f64)[:, None, None]  # perturbation sizes
near = (W2 + eps * E2) @ (W1 + eps * E1)  # (c, n, m): rank-r matrices near the optimum
far = E2 @ E1 * (W.norm() / (E2 @ E1).flatten(1).norm(dim=1))[:, None, None]  # (c, n, m): random rank r
P = torch.cat([near, far])  # (2c, n, m)
assert int(torch.linalg.matrix_rank(P).max()) <= rank, "competitors have rank <= r"
D = W - P  # (2c, n, m)
errs = torch.einsum("cia,ij,cjb,ba->c", D, B_pd, D, A_pd)  # tr(D^T B D A) per competitor
assert errs.min() >= err_opt * (1 - 1e-12), "no random rank-r matrix beats Theorem 1"
best_local = float("inf")
for restart in range(restarts):
    gen = torch.Generator().manual_seed(seed + 1 + restart)
    V2 = torch.randn(n, rank, dtype=f64, generator=gen).requires_grad_()
    V1 = torch.randn(rank, m, dtype=f64, generator=gen).requires_grad_()
    opt = torch.optim.LBFGS([V2, V1], max_iter=500, tolerance_grad=1e-14, tolerance_change=1e-16,
                            line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        Dw = W - V2 @ V1
        e = torch.trace(Dw.T @ B_pd @ Dw @ A_pd)
        e.backward()
        return e

    opt.step(closure)
    best_local = min(best_local, fk.fisher_weighted_error(W, (V2 @ V1).detach(), A_pd, B_pd))
assert best_local >= err_opt * (1 - 1e-9), "local optimisation does not beat Theorem 1"
assert best_local <= err_opt * (1 + 1e-4), "...and it reaches the closed-form optimum"
print(f"Fisher-weighted error at rank {rank}: GFWSVD {err_opt:.4e}  SVD {err_svd:.4e}  FWSVD {err_fw:.4e}  "
      f"best of {len(P)} random {float(errs.min()):.4e}  best local optimum {best_local:.4e}")

# %% [markdown]
# ## 6. FWSVD is a special case: a diagonal factor on one side, the identity on the other (Appendix E)
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

# %%
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
# ## 7. The family side by side: the transformation pairs of a real layer (Fig. connection2fwsvd)
#
# Sections 5 and 6 put every method into one formula, Eq. (7). A method is a pair of
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
# Section 4; the `alpha` each factor needed is printed below). The pairs are the library's:
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

# %%
from fisherkron import hf  # the Hugging Face layer is needed only from here on
from fisherkron.core.methods import factorize_weight
from fisherkron.experiments.teaching import offdiagonal_share, transform_pair

model, tok = hf.load_model(real_model)  # a sequence classifier; its head drawn with a fixed seed
batches = hf.classification_batches(tok, hf.load_task("sst2", "train"), real_k, batch_size=real_batch_size,
                                    seed=seed, task="sst2")
lin = model.get_submodule(real_layer)
model.requires_grad_(False)
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

# %%
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
figures.save_figure(fig, "fig_connection2fwsvd", output_dir, params, started=started,
                    notebook="notebooks/kronecker_fisher_from_scratch.py")
plt.show()
print(f"all checks passed in {time.perf_counter() - started:.1f} s")
