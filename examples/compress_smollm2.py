"""Compress the embedded SmolLM2 to a 20% compression ratio with GFWSVD, offline, and score PTB before/after."""
import time

import fisherkron as fk

t0 = time.time()
model, tok = fk.load_model("smollm2")          # embedded SmolLM2-135M-Instruct (Q4_1 GGUF -> fp32, converted once)
ptb = fk.ptb("test")
ppl = dict(seq_len=512, max_tokens=8192)       # CPU-sized: first 8,192 PTB tokens; drop max_tokens for the full test set
before = fk.perplexity(model, tok, ptb, **ppl).ppl

batches = fk.lm_batches(tok, fk.c4_documents(), k=4, batch_size=2, seq_len=256, seed=0)
stats = fk.collect_calibration(model, batches, methods=["gfwsvd"], seed=0, progress=True)  # cached on disk
report = fk.compress(model, "gfwsvd", stats, ratio=0.20, progress=True)
print(report)

fk.save_compressed(model, "data/models/smollm2-gfwsvd-20", report=report, tokenizer=tok, overwrite=True)
reloaded = fk.load_compressed("data/models/smollm2-gfwsvd-20")
after = fk.perplexity(reloaded, tok, ptb, **ppl).ppl
print(f"PTB perplexity {before:.2f} -> {after:.2f} at compression ratio {report.ratio:.1%} ({time.time() - t0:.0f} s)")
