#!/usr/bin/env python
r"""Where a sensitivity-sweep evaluation's seconds go, against what its matrix products allow: a benchmark.

The decoder notebooks' largest cost from empty caches is the sensitivity sweep (ASVD's procedure, the
paper's): each layer compressed alone at each candidate ratio, the held-out loss measured; 5 methods x 210
layers x 6 candidates of SmolLM2. One evaluation runs the blocks from the changed layer's on and the head
(:class:`fisherkron.hf.sensitivity.PrefixReplay` replays the blocks before it) on the protocol's held-out
sweep batches (``notebooks/params/tab_llm_compression_main.default.yaml``: 2 x 2 x 256 tokens). This script

* times one evaluation (:func:`~fisherkron.hf.sensitivity.loss_with_factors`, a rank-r truncated SVD at the
  middle candidate) for a layer in each of several blocks, the median of ``--repeats``;
* counts its matrix-product FLOPs from the shapes (``2 T`` per weight of every linear layer it runs, the
  attention products ``2 x 2 T s d`` per layer for ``T`` tokens in sequences of ``s``) and divides by the rate
  of a float32 product of the model's own shapes measured in the same process (``GEMM GFLOP/s``): the
  share of that rate an evaluation reaches;
* splits one evaluation's CPU time by operator (:mod:`torch.profiler`).

Written to ``<out>/bench_sweep.{csv,md,tex}`` and ``bench_sweep_ops.*`` with provenance (``make bench-sweep``).
No calibration is needed: the factors are plain truncated SVDs (the sweep's cost does not depend on the
method, only on the rank).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import fisherkron  # noqa: F401  (before torch: its OpenMP threads wait passively)
import pandas as pd
import torch
import yaml


def _gemm_rate(n: int, m: int, T: int, repeats: int = 20) -> float:
    """GFLOP/s of ``X (T x m) @ W^T (m x n)`` in float32, the best of ``repeats`` after a warm-up."""
    X, W = torch.randn(T, m), torch.randn(n, m)
    torch.nn.functional.linear(X, W)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        torch.nn.functional.linear(X, W)
        best = min(best, time.perf_counter() - t)
    return 2 * T * n * m / best / 1e9


def _middle_candidate(model, name: str, ratios):
    """``(r, (W2, W1))``: the truncated SVD of layer ``name`` at the sweep's middle candidate rank."""
    from fisherkron.hf.sensitivity import _candidates

    W = model.get_submodule(name).weight.detach()
    cands = _candidates(W.shape[0], W.shape[1], ratios)
    r = cands[len(cands) // 2]
    U, S, Vh = torch.linalg.svd(W.double(), full_matrices=False)
    return r, ((U[:, :r] * S[:r]).float(), Vh[:r].float())


def _flops(model, names, block: int, tokens: int, seq: int) -> float:
    """Matrix-product FLOPs of one evaluation that runs blocks ``block..L-1`` and the head."""
    cfg = model.config
    lin = sum(model.get_submodule(n).weight.numel() for n in names if int(n.split(".")[2]) >= block)
    head = model.get_output_embeddings().weight.numel()
    d = cfg.num_attention_heads * (cfg.hidden_size // cfg.num_attention_heads)
    attention = (cfg.num_hidden_layers - block) * 2 * 2 * tokens * seq * d  # Q K^T and P V, causal not skipped
    return 2 * tokens * (lin + head) + attention


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="figures/bench", help="folder for the tables (default: figures/bench)")
    ap.add_argument("--blocks", type=int, nargs="+", default=[0, 5, 10, 15, 20, 25, 29])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)

    from fisherkron import hf
    from fisherkron.env import OtherLoad
    from fisherkron.experiments import llm_compression as lc
    from fisherkron.hf.sensitivity import PrefixReplay, loss_with_factors
    from fisherkron.repro.figures import save_table

    started = time.perf_counter()
    params = yaml.safe_load(Path("notebooks/params/tab_llm_compression_main.default.yaml").read_text())
    p = lc.Protocol.from_params(params)
    model, tok = hf.load_model(p.model_name)[:2]
    model.eval()
    sweep = lc.split_batches(p, tok)[1]  # the protocol's held-out sweep batches
    tokens = sum(b["input_ids"].numel() for b in sweep)
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".layers." in n]
    replay = PrefixReplay(model, names, sweep)
    if not replay.enabled:
        raise SystemExit("block replay is off for this model: the benchmark measures the replayed sweep")
    cfg = model.config
    rate = _gemm_rate(cfg.intermediate_size, cfg.hidden_size, tokens)
    rows = []
    with OtherLoad() as load:
        for kind in ("self_attn.q_proj", "mlp.down_proj"):
            for b in args.blocks:
                name = f"model.layers.{b}.{kind}"
                r, factors = _middle_candidate(model, name, p.sens_ratios)
                times = []
                for _ in range(args.repeats):
                    t = time.perf_counter()
                    loss_with_factors(model, name, factors, sweep, replay=replay)
                    times.append(time.perf_counter() - t)
                s = statistics.median(times)
                gf = _flops(model, names, b, tokens, p.seq_len) / 1e9
                rows.append({"layer": name, "block": b, "rank": r, "seconds": s, "GFLOP": gf, "GFLOP/s": gf / s,
                             "share of GEMM rate": gf / s / rate})
                print(f"[bench-sweep] {name} rank {r}: {s:.3f} s, {gf:.0f} GFLOP, {gf / s:.0f} GFLOP/s", flush=True)
    df = pd.DataFrame(rows)
    mean_s = float(df.groupby("block")["seconds"].mean().mean())
    methods = len(params["methods"])
    sweep_min = methods * len(names) * len(p.sens_ratios) * mean_s / 60
    caption = (f"One sensitivity-sweep evaluation of SmolLM2 ({tokens} held-out tokens in sequences of {p.seq_len}, "
               f"the blocks before the layer replayed) per block, against the float32 GEMM rate of the model's "
               f"MLP shape measured in the same process ({rate:.0f} GFLOP/s). Mean over the blocks {mean_s:.2f} s: "
               f"the {methods} methods' sweeps ({len(names)} layers x {len(p.sens_ratios)} candidates) about "
               f"{sweep_min:.0f} min. "
               f"Other processes' share of the cores meanwhile {load.share:.2f}.")
    timing = {c: "timing" for c in ("seconds", "GFLOP/s", "share of GEMM rate")}
    save_table(df, "bench_sweep", args.out, {**vars(args), "gemm_gflops": rate}, started=started, floatfmt=".3g",
               caption=caption, tolerances=timing)

    from torch.profiler import ProfilerActivity, profile

    mid = f"model.layers.{args.blocks[len(args.blocks) // 2]}.mlp.down_proj"
    _, factors = _middle_candidate(model, mid, p.sens_ratios)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        loss_with_factors(model, mid, factors, sweep, replay=replay)
    ev = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in ev)
    groups = {"matrix products (mm, addmm, bmm)": ("aten::mm", "aten::addmm", "aten::bmm"),
              "attention (scaled dot product)": ("aten::_scaled_dot_product_flash_attention_for_cpu",
                                                 "aten::_scaled_dot_product_attention_math"),
              "log-softmax and loss over the vocabulary": ("aten::_log_softmax", "aten::nll_loss_forward"),
              }
    ops = []
    for label, keys in groups.items():
        ops.append({"operators": label, "share of CPU time": sum(e.self_cpu_time_total for e in ev if e.key in keys)
                    / total})
    ops.append({"operators": "everything else (norms, activations, rotary, copies)",
                "share of CPU time": 1 - sum(o["share of CPU time"] for o in ops)})
    save_table(pd.DataFrame(ops), "bench_sweep_ops", args.out, {**vars(args), "layer": mid}, started=started,
               floatfmt=".3f", caption=f"Where one sweep evaluation's CPU time goes ({mid}, torch.profiler).",
               tolerances={"share of CPU time": "timing"})
    print(df.to_string(index=False))
    print(pd.DataFrame(ops).to_string(index=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
