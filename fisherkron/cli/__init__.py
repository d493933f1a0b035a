"""Command line: ``fisherkron factorize`` (MFF on saved gradients) and ``fisherkron compress`` (a model).

Errors from bad input print one line (``fisherkron: error: ...``) and exit with status 2.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from ..core.conventions import FisherkronError

__all__ = ["main"]


def _factorize(args) -> int:
    from ..core.factorization import mff

    res = mff(args.grads, tol=args.tol, terms=args.terms,
              dtype=torch.float64 if args.float64 else torch.float32,
              device=args.device, memory_budget=int(args.memory_gb * (1 << 30)) if args.memory_gb else None,
              name=Path(args.grads).stem)
    out = Path(args.out)
    tmp = out.with_suffix(out.suffix + ".tmp")
    torch.save({"A": res.A, "B": res.B, "sigma": res.sigma, "matvecs": res.matvecs,
                "fisher_share": res.fisher_share, "converged": res.converged}, tmp)
    tmp.replace(out)
    print(json.dumps({"out": str(out), "m": res.A.shape[0], "n": res.B.shape[0], "matvecs": res.matvecs,
                      "sigma": [float(s) for s in res.sigma], "fisher_share": res.fisher_share,
                      "converged": res.converged, "seconds": round(res.seconds, 3),
                      "gflops": round(res.gflops, 2)}))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fisherkron", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    f = sub.add_parser("factorize", help="MFF (Algorithm 1) on a (k, n, m) float32 .npy of per-batch gradients")
    f.add_argument("grads", help="path to a .npy file of shape (k, n, m)")
    f.add_argument("--out", required=True, help="where to write A, B and diagnostics (torch .pt)")
    f.add_argument("--tol", type=float, default=None, help="target relative error of A (x) B (estimated; default 1e-5 in float32)")
    f.add_argument("--terms", type=int, default=1, help="Kronecker terms (singular triplets) to compute")
    f.add_argument("--device", default=None, help="cpu or cuda (default: cpu)")
    f.add_argument("--memory-gb", type=float, default=None, help="memory budget; larger inputs are streamed")
    f.add_argument("--float64", action="store_true", help="compute in float64 (slower, reference accuracy)")
    f.set_defaults(func=_factorize)
    from .compress import add_compress_command
    add_compress_command(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except FisherkronError as exc:
        parser.exit(2, f"fisherkron: error: {exc}\n")
    return 0

