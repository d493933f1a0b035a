"""``python -m fisherkron.repro.book``: the two steps Make runs.

* ``strip EXECUTED COMMITTED``: after a default-profile run, write the committed copy of the
  executed notebook without its volatile metadata (``mk/notebooks.mk``);
* ``sources OUT``: write the book's Sphinx source folder from the committed files (``make book``).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ...core.errors import FisherkronError
from .executed import write_executed
from .sources import write_sources


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fisherkron.repro.book", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    strip = sub.add_parser("strip", help="write the committed copy of an executed notebook")
    strip.add_argument("executed", type=Path)
    strip.add_argument("committed", type=Path)
    src = sub.add_parser("sources", help="write the book's Sphinx sources from the committed files")
    src.add_argument("out", type=Path)
    src.add_argument("--executed", type=Path, default=None,
                     help="folder of executed notebooks (default notebooks/executed)")
    src.add_argument("--figures", type=Path, default=None, help="committed outputs (default figures)")
    args = parser.parse_args(argv)
    try:
        if args.command == "strip":
            write_executed(args.executed, args.committed)
        else:
            book = write_sources(args.out, executed=args.executed, figures=args.figures)
            run = sum(p.executed is not None for p in book)
            print(f"[book] {len(book)} pages ({run} executed, {len(book) - run} not run yet) in {args.out}")
    except FisherkronError as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
