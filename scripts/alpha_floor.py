"""Measure how the regularisation floor min_alpha affects GFWSVD: SmolLM2 MLP layers of blocks 10-19 at rank 256, PTB perplexity.

Run: .venv/bin/python scripts/alpha_floor.py (about 5 min on 2 cores). Its result set the default of compress(min_alpha=...).
"""
import time, torch, fisherkron as fk
torch.manual_seed(0)
t0 = time.time()
model, tok = fk.load_model("smollm2")
ptb = fk.ptb("test")
ppl = dict(seq_len=512, max_tokens=4096)
base = fk.perplexity(model, tok, ptb, **ppl).ppl
batches = fk.lm_batches(tok, fk.c4_documents(), k=4, batch_size=2, seq_len=256, seed=0)
pattern = r"model\.layers\.1[0-9]\.mlp\.(gate|up|down)_proj"
stats = fk.collect_calibration(model, batches, pattern, methods=["gfwsvd"], seed=0)
names = fk.select_layers(model, pattern)
mods = dict(model.named_modules())
orig = {n: mods[n] for n in names}
facs = {n: fk.mff(stats.grads_path(n), name=n) for n in names}
print(f"setup {time.time()-t0:.0f} s; base ppl {base:.2f}; {len(names)} layers; matvecs {[f.matvecs for f in facs.values()]}", flush=True)
def swap(new):
    for n, m in new.items():
        parent, _, child = n.rpartition(".")
        setattr(mods[parent], child, m)
r = 256
for label, make in [("svd", None)] + [(f"gfwsvd min_alpha={a:g}", a) for a in (0.0, 1e-4, 1e-3, 1e-2, 1e-1, 1.0)]:
    new, alphas = {}, []
    for n in names:
        W = orig[n].weight.detach()
        if make is None:
            W2, W1 = fk.svd(W, r)
        else:
            rA = fk.regularize(facs[n].A, min_alpha=make); rB = fk.regularize(facs[n].B, min_alpha=make)
            alphas += [rA.alpha, rB.alpha]
            W2, W1 = fk.gfwsvd(W, rA, rB, r)
        new[n] = fk.LowRankLinear.from_factors(W2.float(), W1.float(), orig[n].bias)
    swap(new)
    p = fk.perplexity(model, tok, ptb, **ppl).ppl
    swap(orig)
    print(f"{label:28s} PTB ppl {p:10.2f}  (alpha range {min(alphas) if alphas else 0:.0e}..{max(alphas) if alphas else 0:.0e})", flush=True)
print(f"total {time.time()-t0:.0f} s")
