import torch, fisherkron as fk
torch.manual_seed(0)
layer = torch.nn.Linear(96, 64)                                   # W: n x m = 64 x 96 (out x in)
mix = torch.linalg.cholesky(0.9 ** (torch.arange(96.)[:, None] - torch.arange(96.)).abs())
X = [torch.randn(128, 96) @ mix.T for _ in range(32)]             # 32 batches of correlated inputs
G = torch.stack([torch.autograd.grad((layer(x) - x[:, :64]).pow(2).mean(), layer.weight)[0] for x in X])
f = fk.mff(G)                                                     # F ~= A (x) B, A: 96x96, B: 64x64
W, r, Xall = layer.weight.detach(), 16, torch.cat(X)
methods = {"svd": fk.svd(W, r), "fwsvd": fk.fwsvd(W, (G ** 2).mean(0), r), "asvd": fk.asvd(W, Xall.abs().mean(0), r),
           "svd_llm": fk.svd_llm(W, Xall.T @ Xall, r), "gfwsvd": fk.gfwsvd(W, f.A, f.B, r)}
print(f"MFF: {f.matvecs} matvecs, Fisher share captured {f.fisher_share:.3f}")
for name, (W2, W1) in methods.items():                            # tr(dW^T B dW A): the loss increase GFWSVD minimises
    print(f"{name:8s} Fisher-weighted error {fk.fisher_weighted_error(W, W2 @ W1, f.A, f.B):.4e}")
