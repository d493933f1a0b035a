"""The book's sources, assembled from committed files only (``make book``; nothing is executed).

One page per notebook, in the paper's order (:data:`PAGES`): the committed executed notebook
``notebooks/executed/<name>.ipynb`` when there is one; otherwise the jupytext source
``notebooks/<name>.py`` without outputs, under a notice that it has not been run yet and above the
outputs its last run committed to ``figures/`` (figures, tables and the verdict lines of its summary
record, found through the ``notebook`` field of the provenance records). The index lists the pages
and repeats the README's reproduction table with its notebooks linked to their pages.
Sphinx and MyST-NB render the folder (``book/conf.py``); MathJax 3 is copied in from the installed
``django-static-mathjax`` package so that the site typesets its mathematics offline.
"""
from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...core.conventions import FisherkronError
from ...env import REPO_ROOT, atomic_write

__all__ = ["PAGES", "Page", "pages", "reproduction_table", "committed_outputs", "write_sources"]

#: every notebook, in the order of the paper's text: the teaching notebook, then the paper's items
#: by section, the appendices, and the studies beyond the paper, each as (name, title in the book's
#: navigation, paper item). A new notebook is placed here (``tests/test_book.py`` fails until it is).
PAGES: tuple[tuple[str, str, str], ...] = (
    ("kronecker_fisher_from_scratch", "Kronecker-factored Fisher from scratch",
     "Secs. 3-5, Theorem 1, App. B-E: the method from scratch (teaching); Fig. connection2fwsvd"),
    ("fig_time_algo", "MFF runtime", "Sec. 4.2: Fig. time_algo, Tab. time_algo"),
    ("fig_singular_values", "Kronecker spectrum of every layer", "Sec. 4: Fig. singular_values"),
    ("fig_synthetic_correlations", "Correlated synthetic inputs", "Sec. 6.1: Fig. corr, Fig. diag_full_synth"),
    ("tab_glue_results", "Encoder compression (GLUE)",
     "Sec. 6.2: Tab. glue_results, Fig. bert_glue_avg; App.: Tab. glue_extended"),
    ("tab_llm_compression_main", "Decoder compression at 20-50 %",
     "Sec. 6.3: Tabs. Llama31_compression_50, Llama2_chat_compression_50"),
    ("tab_throughput", "FLOPs and speed of compressed models",
     "Sec. 6.3, App. F: Tabs. throughput_fwsvd, flops_comparison, throughput_forward"),
    ("fig_rank_allocation", "Per-layer rank allocation", "Sec. 6.3 protocol: per-layer rank allocation"),
    ("tab_extra_compression_results", "Learned truncation and LoRA recovery",
     "Sec. 6.4: Tab. extra-compression-results"),
    ("tab_ablation_diag", "Diagonal and off-diagonal factor parts", "App.: Tab. ablation_diag_results"),
    ("tab_llm_compression_mmlu", "Decoder compression at 5-20 %, MMLU",
     "App.: Tabs. Llama2_compression, Llama3_compression, Fig. mmlu_avg"),
    ("fig_calibration", "Calibration at scale", "beyond the paper: calibration cost and quality against k"),
    ("fig_allocation_cost", "Rank allocation: quality against cost",
     "beyond the paper: the allocations' quality against their evaluations"),
)


@dataclass(frozen=True)
class Page:
    """One page of the book: notebook ``name``, its title in the navigation, where it sits in the
    paper, and its committed executed copy (None while the notebook has not been run)."""

    name: str
    title: str
    paper: str
    executed: Path | None

    @property
    def status(self) -> str:
        return "executed" if self.executed else "not run yet"


def pages(root: Path = REPO_ROOT, executed: Path | None = None) -> list[Page]:
    """The pages, in :data:`PAGES` order; notebooks not listed there follow, alphabetically.

    >>> [p.name for p in pages()][0]
    'kronecker_fisher_from_scratch'
    """
    executed = root / "notebooks" / "executed" if executed is None else executed
    names = sorted(p.stem for p in (root / "notebooks").glob("*.py"))
    listed = {name: (title, paper) for name, title, paper in PAGES}
    order = [n for n, _, _ in PAGES if n in names] + [n for n in names if n not in listed]
    return [Page(n, *listed.get(n, (n, "not placed in the paper's order yet")),
                 executed=(executed / f"{n}.ipynb") if (executed / f"{n}.ipynb").is_file() else None)
            for n in order]


_MARKER = re.compile(r"<!-- /?generated:[^ ]* -->")


def reproduction_table(readme: str, names: set[str] | None = None) -> str:
    """The README's reproduction table (the one headed ``| Paper item |``), notebooks linked.

    The ``generated:`` markers around its numbers are dropped and each `` `name.py` `` cell of a
    notebook in ``names`` becomes a link to that notebook's page.

    >>> text = "intro\\n\\n| Paper item | Notebook |\\n|---|---|\\n| Fig. x | `fig_x.py` |\\n\\nafter"
    >>> print(reproduction_table(text, {"fig_x"}))
    | Paper item | Notebook |
    |---|---|
    | Fig. x | [`fig_x.py`](fig_x.ipynb) |
    """
    lines = readme.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("| Paper item |")), None)
    if start is None:
        raise FisherkronError("README.md has no reproduction table (a line starting '| Paper item |'): "
                              "the book's index repeats it")
    end = start
    while end < len(lines) and lines[end].startswith("|"):
        end += 1
    table = _MARKER.sub("", "\n".join(lines[start:end]))
    if names is not None:
        table = re.sub(r"`([\w-]+)\.py`",
                       lambda m: f"[`{m[1]}.py`]({m[1]}.ipynb)" if m[1] in names else m[0], table)
    return table


def committed_outputs(name: str, figures: Path) -> list[dict[str, Any]]:
    """The provenance records in ``figures`` written by notebook ``name``, sorted by output name."""
    records = []
    for path in sorted(figures.glob("*.provenance.json")):
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise FisherkronError(f"unreadable provenance record {path}: {exc}; restore it from git") from exc
        if record.get("notebook") == f"notebooks/{name}.py":
            records.append(record)
    return records


def _markdown_cell(text: str) -> dict[str, Any]:
    import nbformat

    return nbformat.v4.new_markdown_cell(text)


def _outputs_markdown(name: str, figures: Path, images: Path, image_prefix: str) -> str:
    """Figures, tables and verdict lines of notebook ``name`` committed in ``figures``, as MyST markdown."""
    parts = []
    for record in committed_outputs(name, figures):
        files = record.get("files", [])
        when = f"written {record.get('created_utc', '?')}"
        if "wall_seconds" in record:
            when += f", {record['wall_seconds']:.0f} s"
        pngs = [f for f in files if f.endswith(".png")]
        mds = [f for f in files if f.endswith(".md")]
        extra = record.get("extra") or {}
        lines = extra.get("lines") or extra.get("verdicts")
        text = extra.get("text")
        if not (pngs or mds or lines or text):
            continue
        parts.append(f"### `{record['name']}`\n\n*`figures/{record['name']}` ({when}).*")
        for png in pngs:
            shutil.copy2(figures / png, images / png)
            parts.append(f"![{record['name']}]({image_prefix}/{png})")
        for md in mds:
            parts.append((figures / md).read_text(encoding="utf-8").strip())
        if isinstance(lines, list) and all(isinstance(line, str) for line in lines):
            parts.append("Verdicts computed by the notebook (from its summary record):\n\n" + "\n".join(lines))
        elif isinstance(text, str):
            parts.append("Verdicts computed by the notebook (from its summary record):\n\n" + text)
    return "\n\n".join(parts)


def _page_notebook(page: Page, root: Path, figures: Path, images: Path) -> Any:
    import jupytext
    import nbformat

    source = f"notebooks/{page.name}.py"
    if page.executed is not None:
        nb = nbformat.read(page.executed, as_version=4)
        footer = (f"*This page is the committed run of `{source}` at the embedded default, "
                  f"`notebooks/executed/{page.name}.ipynb`; `make {page.name}` runs it again.*")
        nb.cells.append(_markdown_cell(footer))
        return nb
    nb = jupytext.read(root / source)
    notice = (":::{admonition} Not run yet\n:class: warning\n"
              f"This notebook has not been run since executed notebooks were committed: "
              f"`notebooks/executed/{page.name}.ipynb` does not exist yet. `make {page.name}` runs it "
              "and writes that file; until then this page shows the outputs its last run committed to "
              "`figures/`, then the notebook's source without outputs.\n:::")
    outputs = _outputs_markdown(page.name, figures, images, images.name)
    first = nb.cells[0] if nb.cells and nb.cells[0].cell_type == "markdown" else None
    if first is not None and first.source.startswith("# "):  # the notice goes right below the title
        title, _, rest = first.source.partition("\n")
        first.source = f"{title}\n\n{notice}\n{rest}"
    else:
        nb.cells.insert(0, _markdown_cell(f"# {page.title}\n\n{notice}"))
    cells = [_markdown_cell("## Committed outputs\n\n" + (outputs or "This notebook has committed no "
                                                               "outputs to `figures/` yet.")),
             _markdown_cell(f"## Source of the notebook (`{source}`, not executed)")]
    nb.cells[1:1] = cells
    return nb


def _index(book_pages: list[Page], readme: str) -> str:
    rows = "\n".join(f"| {i} | [{p.title}]({p.name}.ipynb) | {p.paper} | `{p.name}` | {p.status} |"
                     for i, p in enumerate(book_pages, 1))
    toc = "\n".join(f"{p.title} <{p.name}>" for p in book_pages)
    table = reproduction_table(readme, {p.name for p in book_pages})
    run = sum(p.executed is not None for p in book_pages)
    return f"""# fisherkron: the notebooks of the reproduction

These pages are the notebooks that reproduce *Scalable Kronecker-Factored Fisher Approximation for
Neural Network Parameter Sensitivity*, as their last run at the embedded default left them:
the committed executed notebooks `notebooks/executed/<name>.ipynb`, rendered without running
anything (`make book`). {run} of {len(book_pages)} notebooks have a committed run; a page without one
shows the figures and tables its notebook last wrote to `figures/`, then its source.

| | page | paper item | `make` target | run |
|---|---|---|---|---|
{rows}

```{{toctree}}
:hidden:
:maxdepth: 1

{toc}
```

## The reproduction table (from the README)

{table}
"""


def _copy_mathjax(static: Path) -> None:
    """Copy MathJax 3 (its browser components, ``es5/``) from the django-static-mathjax package."""
    import importlib.util

    spec = importlib.util.find_spec("mathjax")
    es5 = Path(spec.origin).parent / "static" / "mathjax" / "es5" if spec and spec.origin else None
    if es5 is None or not (es5 / "tex-svg.js").is_file():
        raise FisherkronError("the book needs MathJax from the package django-static-mathjax: "
                              "pip install -e '.[book]' (or make install)")
    shutil.copytree(es5, static / "mathjax")


def write_sources(out: str | Path, root: Path = REPO_ROOT, executed: Path | None = None,
                  figures: Path | None = None, readme: Path | None = None) -> list[Page]:
    """Write the book's Sphinx source folder ``out`` (replaced) and return its pages.

    ``executed``, ``figures`` and ``readme`` default to ``notebooks/executed``, ``figures`` and
    ``README.md`` under ``root``. ``out`` holds the files of ``book/`` (``conf.py``),
    ``index.md``, one ``<name>.ipynb`` per page, ``_figures/`` (images of pages not run yet) and
    ``_mathjax/mathjax`` (MathJax 3, served from the site's ``_static/mathjax``).
    """
    import nbformat

    out = Path(out)
    figures = root / "figures" if figures is None else figures
    readme = root / "README.md" if readme is None else readme
    book_pages = pages(root, executed)
    if out.exists():
        shutil.rmtree(out)
    images = out / "_figures"
    images.mkdir(parents=True)
    for path in sorted((root / "book").glob("*")):  # conf.py, the favicon
        if path.is_file() and path.suffix != ".pyc":
            shutil.copy2(path, out / path.name)
    _copy_mathjax(out / "_mathjax")
    for page in book_pages:
        nb = _page_notebook(page, root, figures, images)
        atomic_write(out / f"{page.name}.ipynb", lambda tmp, nb=nb: nbformat.write(nb, tmp))
    index = _index(book_pages, readme.read_text(encoding="utf-8"))
    atomic_write(out / "index.md", lambda tmp: Path(tmp).write_text(index, encoding="utf-8"))
    return book_pages
