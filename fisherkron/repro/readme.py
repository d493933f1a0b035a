"""The front page's numbers, rendered from the committed summary records so that they cannot drift.

README.md holds two generated blocks::

    <!-- generated:results -->  the paper's items: claim, paper, ours, verdict  <!-- /generated:results -->
    <!-- generated:recipe -->   the recommended recipe's measured quality         <!-- /generated:recipe -->

Each is rendered from ``figures/`` only (no notebook runs): ``results`` by :mod:`.claims`, ``recipe``
from the allocation study's summary record and, once it has run, the recipe benchmark's table
(``figures/bench/bench_recipe``: the first command timed as a user runs it). Text outside the blocks
carries no measured number.

* :func:`render` rewrites the blocks of a README text; :func:`check` names the blocks that differ;
* ``python -m fisherkron.repro.readme [--check] [README.md]`` (``make readme``, ``make readme-check``);
  ``tests/test_front_page.py`` runs the check, so ``make test`` fails while README.md and ``figures/``
  disagree.
"""
from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable
from pathlib import Path

from ..core.errors import FisherkronError
from ..env import REPO_ROOT, atomic_write, read_committed
from . import claims
from .book.records import Outputs, machine_name

__all__ = ["BLOCK", "RENDERERS", "render", "check", "main"]

#: one generated block: its name and its text
BLOCK = re.compile(r"<!-- generated:(?P<name>[\w.-]+) -->(?P<body>.*?)<!-- /generated:(?P=name) -->", re.DOTALL)


def _book_link(notebook: str) -> str:
    """The front page links each item to its committed executed notebook, the book page's content (its source
    while it has not run yet)."""
    executed = f"notebooks/executed/{notebook}.ipynb"
    return executed if (REPO_ROOT / executed).is_file() else f"notebooks/{notebook}.py"


def results_block(figures: Path) -> str:
    """The paper's items grouped as the paper groups them, each with its computed verdict."""
    return claims.results_table(claims.results(figures), link=_book_link)


def recipe_block(figures: Path) -> str:
    """What the recommended recipe (and GFWSVD beside it) measured in the allocation study, by ratio.

    Read from ``fig_allocation_cost_summary.provenance.json``: its ``rows`` (one per method,
    allocation and target ratio) and the dense model's PTB perplexity.
    """
    records = claims.load_records(figures)
    name = "fig_allocation_cost_summary"
    if name not in records:
        raise FisherkronError(f"{figures / (name + '.provenance.json')} is missing: restore it with "
                              f"`git checkout -- figures/` or regenerate it with `make fig_allocation_cost`")
    extra = records[name].get("extra") or {}
    rows, dense = extra.get("rows"), (extra.get("verdict") or {}).get("dense", {}).get("ppl_ptb")
    if not isinstance(rows, list) or not isinstance(dense, (int, float)):
        raise FisherkronError(f"{figures / (name + '.provenance.json')} has no 'rows' or dense PTB perplexity: "
                              "regenerate it with `make fig_allocation_cost`")

    def ppl(method: str, allocation: str, target: float) -> float | None:
        hit = [r for r in rows if r.get("method") == method and r.get("allocation") == allocation
               and abs(float(r.get("target", -1)) - target) < 1e-9]
        return float(hit[0]["ppl_ptb"]) if hit else None

    cells = []
    for target in (0.1, 0.2):
        kfac, gf = ppl("kfac_svd", "calibrated_kl", target), ppl("gfwsvd", "calibrated_kl", target)
        uni = ppl("gfwsvd", "uniform", target)
        if kfac is None or gf is None or uni is None:
            raise FisherkronError(f"{figures / (name + '.provenance.json')} lacks the {target:.0%} rows the front "
                                  "page quotes: regenerate it with `make fig_allocation_cost`")
        cells.append(f"| {target:.0%} | {kfac:,.1f} ({kfac / dense:.2f}x) | {gf:,.1f} ({gf / dense:.2f}x) "
                     f"| {uni:,.1f} ({uni / dense:.1f}x) |")
    k = records[name].get("parameters", {}).get("k")
    return (f"Measured by the [allocation study](notebooks/fig_allocation_cost.py) on SmolLM2-135M "
            f"(k = {k} calibration batches; PTB perplexity on its first 4,096 tokens, dense "
            f"{dense:.1f}):\n\n"
            "| ratio | KFAC-SVD, KL-calibrated | GFWSVD, KL-calibrated | GFWSVD, one ratio for every layer |\n"
            "|---|---|---|---|\n" + "\n".join(cells) + timed_line(figures))


def timed_line(figures: Path, ratio: float = 0.2) -> str:
    """The recommended command at ``ratio`` as ``make bench-recipe`` timed it, or ``""`` before it has run."""
    if not (figures / "bench" / "bench_recipe.provenance.json").is_file():
        return ""
    out = Outputs(figures / "bench")
    hit = [r for r in out.table("bench_recipe") if r["case"] == "recommended" and r["ratio"] == ratio]
    if not hit:
        raise FisherkronError(f"{figures / 'bench' / 'bench_recipe.csv'} has no 'recommended' row at {ratio:g}: "
                              "run `make bench-recipe` again")
    r, machine = hit[0], machine_name(out.record("bench_recipe").get("machine", {}))
    load = r.get("others_load")
    upper = ("" if not isinstance(load, float) or load < 0.05 else
             f"; other processes took {load:.0%} of the cores meanwhile, so the time is an upper bound")
    return (f"\n\nThe first command, timed from an empty cache by `make bench-recipe` on a {machine}: PTB "
            f"{r['ppl_ptb']:,.1f} ({r['ptb_x_dense']:.2f}x dense) in {r['compress_s'] / 60:.0f} min, with at most "
            f"{r['peak_disk_gb']:.1f} GB of calibration on disk{upper}. The command calibrates and measures on "
            "other C4 documents than the study, so its perplexity is not the table's.")


#: block name -> renderer(figures folder) -> text
RENDERERS: dict[str, Callable[[Path], str]] = {"results": results_block, "recipe": recipe_block}


def render(text: str, figures: Path = REPO_ROOT / "figures") -> str:
    """``text`` with every generated block rendered again from ``figures``."""
    names = [m["name"] for m in BLOCK.finditer(text)]
    unknown = sorted(set(names) - set(RENDERERS))
    if unknown:
        raise FisherkronError(f"README block(s) {unknown} have no renderer; known: {sorted(RENDERERS)}")
    return BLOCK.sub(lambda m: f"<!-- generated:{m['name']} -->\n{RENDERERS[m['name']](figures)}\n"
                               f"<!-- /generated:{m['name']} -->", text)


def check(text: str, figures: Path = REPO_ROOT / "figures") -> list[str]:
    """One message per block whose text differs from what ``figures`` renders (empty: in step)."""
    fresh = {m["name"]: m["body"] for m in BLOCK.finditer(render(text, figures))}
    return [f"README block '{m['name']}' differs from the committed outputs: run `make readme`"
            for m in BLOCK.finditer(text) if m["body"] != fresh[m["name"]]]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fisherkron.repro.readme", description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="compare only; exit 1 when a block differs")
    parser.add_argument("readme", nargs="?", default=str(REPO_ROOT / "README.md"))
    args = parser.parse_args(argv)
    path = Path(args.readme)
    try:
        text = read_committed(path, what="the README", remake="`make readme` writes its generated blocks again")
        missing = sorted(set(RENDERERS) - {m["name"] for m in BLOCK.finditer(text)})
        if missing:
            raise FisherkronError(f"{path} has no block for {missing}: add <!-- generated:NAME --> markers")
        figures = path.parent / "figures"  # the outputs committed beside the README
        if args.check:
            problems = check(text, figures)
            for p in problems:
                print(p, file=sys.stderr)
            print(f"[readme] {len(RENDERERS)} blocks, {len(problems)} differ")
            return 1 if problems else 0
        new = render(text, figures)
        if new != text:
            atomic_write(path, lambda tmp: Path(tmp).write_text(new, encoding="utf-8"))
        print(f"[readme] {path.name}: {'rewritten' if new != text else 'already in step'}")
        return 0
    except (FisherkronError, OSError, UnicodeDecodeError) as exc:
        print(f"readme: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
