"""The ledger: finished results of the long studies, kept in the repository so a study resumes on another machine.

A study of several hours (the scale study, a cold ``make all``) outlives the machine it started on, and its
caches under ``data/cache/`` are not committed. The ledger keeps the small, final pieces of those caches in
``data/ledger/`` with the same relative paths:

* ``studies/**.json``: one score of one case (held-out loss, perplexity windows, lm-eval results), named by the
  hash of everything it depends on (``experiments.llm_compression.case_config``: the model's fingerprint, the
  calibration's key, the library sources, the evaluation settings);
* ``allocation/sensitivity-*.json``: the one-point and sensitivity sweeps, named by their own key
  (``hf.sensitivity.sweep_key``), written layer by layer.

Calibration statistics (gigabytes of gradients) are never kept: a resumed study calibrates again and reads the
scores and sweeps it finds. Every file is named by its key, so a ledger entry is read only where the code and data
that made it are the same; a changed source gives new keys and the entries are simply not found.

``restore`` copies ledger files into the cache where the cache lacks them (never over a file there); ``save``
copies cache files into the ledger where they are new or changed (a sweep that grew). A cold run is one without
``restore``: ``make all`` and ``make verify`` never read the ledger.

Command line::

    python -m fisherkron.repro.ledger save     # data/cache -> data/ledger
    python -m fisherkron.repro.ledger restore  # data/ledger -> data/cache
"""
from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from ..env import atomic_write, data_root

__all__ = ["KEPT", "ledger_root", "kept_files", "save", "restore", "main"]

#: the cache files the ledger keeps: (folder under ``data/cache``, file pattern searched recursively)
KEPT = (("studies", "*.json"), ("allocation", "sensitivity-*.json"))


def ledger_root() -> Path:
    """``data/ledger`` (under ``$FISHERKRON_DATA`` when set)."""
    return data_root() / "ledger"


def kept_files(root: Path) -> dict[str, Path]:
    """``{relative path: file}`` of the files under ``root`` that the ledger keeps, readable as JSON."""
    out = {}
    for folder, pattern in KEPT:
        for path in sorted((root / folder).rglob(pattern)):
            try:
                json.loads(path.read_text())
            except (OSError, ValueError):
                continue  # a file being written, or broken: not kept
            out[str(path.relative_to(root))] = path
    return out


def _copy(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(dst, lambda t: shutil.copyfile(src, t))


def save(cache: Path | None = None, ledger: Path | None = None) -> list[str]:
    """Copy the kept cache files that are new or changed into the ledger; returns their relative paths."""
    cache, ledger = Path(cache or data_root() / "cache"), Path(ledger or ledger_root())
    done = []
    for rel, src in kept_files(cache).items():
        dst = ledger / rel
        if not dst.is_file() or dst.read_bytes() != src.read_bytes():
            _copy(src, dst)
            done.append(rel)
    return done


def restore(cache: Path | None = None, ledger: Path | None = None) -> list[str]:
    """Copy the ledger's files that the cache lacks into the cache; returns their relative paths."""
    cache, ledger = Path(cache or data_root() / "cache"), Path(ledger or ledger_root())
    done = []
    for rel, src in kept_files(ledger).items():
        dst = cache / rel
        if not dst.exists():
            _copy(src, dst)
            done.append(rel)
    return done


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fisherkron.repro.ledger", description=__doc__.split("\n")[0])
    ap.add_argument("action", choices=("save", "restore"))
    args = ap.parse_args(argv)
    done = save() if args.action == "save" else restore()
    print(f"[ledger] {args.action}: {len(done)} file(s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
