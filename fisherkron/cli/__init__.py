"""Command line: ``fisherkron factorize`` (MFF on saved gradients), ``compress`` (a model), ``evaluate`` (a model).

Every option is checked when it is parsed, and everything that can be checked without
data (the output path, the model's task and positions, the layers, the ranks) is checked
before any calibration starts. Bad input prints one line (``fisherkron: error: ...``) and
exits with status 2; an interruption (Ctrl-C) prints one line and exits with 130.

Top-level options: ``--version``, ``-v``/``--verbose`` (INFO; twice for DEBUG) and
``-q``/``--quiet`` (no progress bars or reports: only the final JSON line and errors).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import warnings
from pathlib import Path

from .._version import __version__
from ..core.conventions import FisherkronError
from . import options as opt

__all__ = ["build_parser", "main"]

log = logging.getLogger("fisherkron.cli")


class Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line (no usage block) with exit status 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def _factorize(args) -> int:
    import numpy as np
    import torch

    from ..core.factorization import mff
    from ..core.stored import gradient_file
    from ..env import atomic_write

    grads = Path(args.grads)
    if not grads.is_file():
        raise FisherkronError(f"{grads} does not exist" if not grads.exists() else f"{grads} is not a file")
    try:
        arr = np.load(grads, mmap_mode="r")
    except (ValueError, EOFError):
        raise FisherkronError(f"{grads} is not a .npy array file (numpy cannot read its header)") from None
    if getattr(arr, "ndim", None) != 3:
        raise FisherkronError(f"{grads} holds an array of shape {getattr(arr, 'shape', '?')}; "
                              f"expected (k, n, m) per-batch gradients")
    if args.terms > min(arr.shape[1:]) ** 2:
        raise FisherkronError(f"--terms {args.terms} exceeds the rank bound min(n, m)^2="
                              f"{min(arr.shape[1:]) ** 2} of R(F) for gradients of shape {tuple(arr.shape)}")
    del arr
    # float32/64 as is; a 16-bit file (float16 with its scales, bfloat16 bits) decoded through its calibration
    # entry's manifest, or refused here, before --out is touched
    source = gradient_file(grads, name=grads.stem)
    out = opt.check_out_file(args.out, overwrite=args.overwrite)
    res = mff(source, tol=args.tol, terms=args.terms,
              dtype=torch.float64 if args.float64 else torch.float32,
              device=args.device, memory_budget=int(args.memory_gb * (1 << 30)) if args.memory_gb else None,
              name=grads.stem)
    payload = {"A": res.A, "B": res.B, "sigma": res.sigma, "matvecs": res.matvecs,
               "fisher_share": res.fisher_share, "converged": res.converged}
    atomic_write(out, lambda tmp: torch.save(payload, tmp))
    if not res.converged:
        log.warning("MFF did not reach tol within its product budget (%d products)", res.matvecs)
    print(json.dumps({"out": str(out), "m": res.A.shape[0], "n": res.B.shape[0], "matvecs": res.matvecs,
                      "sigma": [float(s) for s in res.sigma], "fisher_share": res.fisher_share,
                      "converged": res.converged, "seconds": round(res.seconds, 3),
                      "gflops": round(res.gflops, 2)}))
    return 0


def _verbosity_options(parser: argparse.ArgumentParser, *, top: bool) -> None:
    """``-v``/``-q``; on the subcommands too (``fisherkron compress -q ...``) without resetting the top level."""
    parser.add_argument("-v", "--verbose", action="count", default=0 if top else argparse.SUPPRESS,
                        help="log progress (INFO); twice: DEBUG")
    parser.add_argument("-q", "--quiet", action="store_true", default=False if top else argparse.SUPPRESS,
                        help="no progress bars or reports: only the final JSON line and errors")


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="fisherkron", description=__doc__.splitlines()[0])
    p.add_argument("--version", action="version", version=f"fisherkron {__version__}")
    _verbosity_options(p, top=True)
    sub = p.add_subparsers(dest="command", required=True, metavar="{factorize,compress,evaluate}")
    f = sub.add_parser("factorize", help="MFF (Algorithm 1) on a (k, n, m) float32 .npy of per-batch gradients",
                       description="MFF (Algorithm 1) on a (k, n, m) .npy file of per-batch gradients: float32 or "
                                   "float64, or a 16-bit <layer>.grads.npy inside its calibration entry (decoded "
                                   "as that entry's manifest.json says, float16 with its <layer>.grad_scales.npy).")
    _verbosity_options(f, top=False)
    f.add_argument("grads", help="path to a .npy file of shape (k, n, m)")
    f.add_argument("--out", required=True, help="where to write A, B and diagnostics (torch .pt)")
    f.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    f.add_argument("--tol", type=opt.tol, default=None,
                   help="target relative error of A (x) B, in (0, 1) (estimated; default 1e-5 in float32)")
    f.add_argument("--terms", type=opt.positive_int, default=1, help="Kronecker terms (singular triplets) to compute")
    f.add_argument("--device", type=opt.device, default=None, help="cpu, cuda, cuda:N or mps (default: cpu)")
    f.add_argument("--memory-gb", type=opt.positive_float, default=None,
                   help="memory budget; larger inputs are streamed")
    f.add_argument("--float64", action="store_true", help="compute in float64 (slower, reference accuracy)")
    f.set_defaults(func=_factorize)
    from .compress_parser import add_compress_command
    from .evaluate import add_evaluate_command
    add_compress_command(sub, _verbosity_options)
    add_evaluate_command(sub, _verbosity_options)
    return p


@contextlib.contextmanager
def _output(verbose: int, quiet: bool):
    """Logging level, progress bars and warnings for one command; restored afterwards.

    The package logs to stderr as ``fisherkron: LEVEL: message``. With ``quiet``, only
    errors are logged and everything else written to ``sys.stderr`` during the command
    (progress bars of fisherkron, transformers, datasets and lm-eval; warnings) is dropped;
    stdout (the JSON line) and the final error line are untouched.
    """
    level = logging.ERROR if quiet else (logging.DEBUG if verbose >= 2 else
                                         logging.INFO if verbose == 1 else logging.WARNING)
    pkg = logging.getLogger("fisherkron")
    handler = logging.StreamHandler(sys.stderr)  # the real stderr, also when quiet swaps sys.stderr
    handler.setFormatter(logging.Formatter("fisherkron: %(levelname)s: %(message)s"))
    old = (pkg.level, pkg.propagate)
    pkg.setLevel(level)
    pkg.addHandler(handler)
    pkg.propagate = False
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(warnings.catch_warnings())
            if quiet:
                warnings.simplefilter("ignore")
                with contextlib.suppress(ImportError):
                    import transformers.utils.logging as tf_logging  # its handler holds the real stderr

                    verbosity, bars = tf_logging.get_verbosity(), tf_logging.is_progress_bar_enabled()
                    tf_logging.set_verbosity_error()
                    tf_logging.disable_progress_bar()
                    stack.callback(lambda: bars and tf_logging.enable_progress_bar())
                    stack.callback(tf_logging.set_verbosity, verbosity)
                stack.enter_context(contextlib.redirect_stderr(stack.enter_context(open(os.devnull, "w"))))
            yield
    finally:
        pkg.removeHandler(handler)
        pkg.setLevel(old[0])
        pkg.propagate = old[1]


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def _os_error_line(exc: OSError) -> str:
    what = exc.strerror or _first_line(exc)
    return f"{what}: {exc.filename}" if exc.filename is not None else what


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.quiet and args.verbose:
        parser.error("-q/--quiet and -v/--verbose contradict each other; give one")
    rank, world = _torchrun_env(parser)
    if world > 1:
        if args.command != "compress":
            parser.exit(2, f"fisherkron: error: fisherkron {args.command} runs in one process; start it without "
                           f"torchrun (only compress runs on several)\n")
        if rank != 0:  # rank 0 reports; the others print nothing but errors
            args.quiet, args.verbose = True, 0
    try:
        with _output(args.verbose, args.quiet):
            return int(args.func(args) or 0)
    except FisherkronError as exc:
        parser.exit(2, f"fisherkron: error: {_first_line(exc)}\n")
    except KeyboardInterrupt:
        parser.exit(130, "fisherkron: interrupted\n")
    except BrokenPipeError:  # stdout closed early (``fisherkron ... | head``): not an error worth a message
        with contextlib.suppress(Exception):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        parser.exit(141)
    except OSError as exc:
        parser.exit(2, f"fisherkron: error: {_os_error_line(exc)}\n")
    except _out_of_memory() as exc:
        parser.exit(1, f"fisherkron: error: out of memory ({_first_line(exc)[:200]}); "
                       f"lower --batch-size or --seq-len\n")
    return 0


def _torchrun_env(parser) -> tuple[int, int]:
    """``(RANK, WORLD_SIZE)`` as torchrun sets them; ``(0, 1)`` when started without it."""
    try:
        return int(os.environ.get("RANK", "0") or 0), int(os.environ.get("WORLD_SIZE", "1") or 1)
    except ValueError:
        parser.exit(2, f"fisherkron: error: RANK={os.environ.get('RANK')!r} and WORLD_SIZE="
                       f"{os.environ.get('WORLD_SIZE')!r} must be integers (torchrun sets them)\n")


def _out_of_memory() -> tuple[type[BaseException], ...]:
    import torch

    oom = getattr(torch, "OutOfMemoryError", None) or getattr(torch.cuda, "OutOfMemoryError", None)
    return (oom,) if oom is not None else ()
