"""Compress the embedded SmolLM2 by 20 % with the recommended recipe, offline, and score PTB before and after.

The recipe (fisherkron.hf.allocation.RECOMMENDED, and `fisherkron compress smollm2 --ratio 0.2` from the
shell): KFAC-SVD, with per-layer ranks from the calibrated allocation, which measures each layer once
as the KL divergence from the dense model's outputs on held-out batches; calibrated on 32 C4 batches of
2 x 256 tokens, the setting the package's studies measured it at.
"""
import time

import fisherkron as fk

t0 = time.time()
model, tok = fk.load_model("smollm2")          # embedded SmolLM2-135M-Instruct (Q4_1 GGUF -> fp32, converted once)
ptb = fk.ptb("test")
ppl = dict(seq_len=512, max_tokens=4096)       # the studies' score: the first 4,096 PTB test tokens, 512-token windows
before = fk.perplexity(model, tok, ptb, **ppl).ppl

docs = fk.c4_documents()
calibration, held_out = docs[:-200], docs[-200:]  # the allocation measures on documents the calibration never sees
batches = fk.lm_batches(tok, calibration, k=32, batch_size=2, seq_len=256, seed=0)
heldout = fk.lm_batches(tok, held_out, k=2, batch_size=2, seq_len=256, seed=1)
stats = fk.collect_calibration(model, batches, methods=["kfac_svd"], seed=0, progress=True)  # K-FAC only; cached
report = fk.compress(model, stats, ratio=0.20, allocation_options={"heldout": heldout}, progress=True)
print(report)

fk.save_compressed(model, "data/models/smollm2-20", report=report, tokenizer=tok, overwrite=True)
reloaded = fk.load_compressed("data/models/smollm2-20")
after = fk.perplexity(reloaded, tok, ptb, **ppl).ppl
print(f"PTB perplexity {before:.2f} -> {after:.2f} at compression ratio {report.ratio:.1%} ({time.time() - t0:.0f} s)")
