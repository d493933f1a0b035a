"""The book's sources, assembled from committed files only (``make book``; nothing is executed).

One page per notebook, in the paper's order (:data:`PAGES`): the committed executed notebook
``notebooks/executed/<name>.ipynb`` when there is one; otherwise the jupytext source
``notebooks/<name>.py`` without outputs, under a notice that it has not been run yet and above the
outputs its last run committed to ``figures/`` (figures, tables and the verdict lines of its summary
record, found through the ``notebook`` field of the provenance records). Every notebook page opens
with its claim and then its **result**, read at build time from the committed records: the paper's
items it regenerates with their computed verdicts (:mod:`fisherkron.repro.claims`), its key figure
and the verdict lines of its summary record; the parameter cells (the notebook's own and the one
papermill injects) are collapsed. The index is the results page: every paper item, the paper's
number and ours, the verdict, the latest ``make verify`` result, a link to its page. The pages of
``book/*.md`` (the user guide, the reproduction page) follow the notebooks.
Sphinx and MyST-NB render the folder (``book/conf.py``); MathJax 3 is copied in from the installed
``django-static-mathjax`` package so that the site typesets its mathematics offline.
"""
from __future__ import annotations

import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...core.errors import FisherkronError
from ...env import REPO_ROOT, atomic_write, read_committed
from ..figures import cpu_model, read_provenance
from ..verify import changed_tables, read_records
from .. import claims
from ..claims import table_cell as _cell  # one cell escape for every table of the book

__all__ = ["PAGES", "KEY_FIGURE", "HEADLINE", "Page", "pages", "committed_outputs", "result_markdown",
           "changed_code_cells", "write_sources"]

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
    ("fig_scale", "Model size and the noise of the factors",
     "beyond the paper: three decoders of growing size, shrunk GFWSVD"),
)


#: the one figure shown with a page's result (the others stay where the notebook draws them)
KEY_FIGURE: dict[str, str] = {
    "kronecker_fisher_from_scratch": "kronecker_fisher_from_scratch.png", "fig_time_algo": "fig_time_algo.png",
    "fig_singular_values": "fig_singular_values.png", "fig_synthetic_correlations": "fig_diag_full_synth.png",
    "tab_glue_results": "fig_bert_glue_avg.png", "tab_llm_compression_main": "fig_llm_compression.png",
    "tab_throughput": "fig_throughput.png", "fig_rank_allocation": "fig_rank_allocation.png",
    "tab_extra_compression_results": "fig_extra_compression_training.png",
    "tab_llm_compression_mmlu": "fig_mmlu_avg.png", "fig_calibration": "fig_calibration.png",
    "fig_allocation_cost": "fig_allocation_cost.png",
}
#: the figure above the results table of the index (and of the README)
HEADLINE = "fig_diag_full_synth.png"
#: pages written in MyST Markdown in ``book/``, after the notebooks in the navigation
GUIDE_PAGES = ("guide", "reproduce")


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


def committed_outputs(name: str, figures: Path) -> list[dict[str, Any]]:
    """The provenance records in ``figures`` written by notebook ``name``, sorted by output name."""
    records = []
    for path in sorted(figures.glob("*.provenance.json")):
        record = read_provenance(path)  # a damaged one: one line naming it and what to do
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
            parts.append(read_committed(figures / md, what="a Markdown table", remake=f"re-run `make {name}`").strip())
        if isinstance(lines, list) and all(isinstance(line, str) for line in lines):
            parts.append("Verdicts computed by the notebook (from its summary record):\n\n" + "\n".join(lines))
        elif isinstance(text, str):
            parts.append("Verdicts computed by the notebook (from its summary record):\n\n" + text)
    return "\n\n".join(parts)


def _summary_lines(name: str, figures: Path) -> list[str]:
    """The verdict lines of notebook ``name``'s summary record (``extra.lines``, or ``extra.text``)."""
    path = figures / f"{name}_summary.provenance.json"
    if not path.is_file():
        return []
    extra = read_provenance(path, remake=f"re-run `make {name}`").get("extra") or {}
    lines = extra.get("lines")
    if isinstance(lines, list) and all(isinstance(line, str) for line in lines):
        return lines
    return [extra["text"]] if isinstance(extra.get("text"), str) else []


def result_markdown(name: str, items: list[dict], figures: Path, image: str | None) -> str:
    """The result a page opens with: its paper items and their verdicts, its key figure, and the
    verdict lines its notebook computed, as one MyST admonition of class ``result``."""
    parts = []
    mine = [r for r in items if r["notebook"] == name]
    if mine:
        parts.append("| item | the paper | here | verdict |\n|---|---|---|---|\n" + "\n".join(
            f"| {_cell(r['title'])}: {_cell(r['claim'])} | {_cell(r['paper'])} | {_cell(r['ours'])} "
            f"| **{_cell(r['verdict'])}** |" for r in mine))
    if image:
        parts.append(f"![the key figure of this page]({image})")
    lines = _summary_lines(name, figures)
    if lines:
        parts.append("Verdicts computed by the notebook (its summary record, "
                     f"`figures/{name}_summary.provenance.json`):\n\n" + "\n".join(lines))
    if not parts:
        parts.append(f"This notebook has written no verdict yet: `make {name}` runs it.")
    return "::::{admonition} Result\n:class: result\n\n" + "\n\n".join(parts) + "\n::::"


def _collapse_parameters(nb: Any) -> None:
    """Collapse the parameter cells: the notebook's own (tag ``parameters``) and papermill's
    (tag ``injected-parameters``); a reader opens them to see what the run used."""
    for cell in nb.cells:
        tags = cell.get("metadata", {}).get("tags", [])
        if cell.cell_type == "code" and {"parameters", "injected-parameters"} & set(tags) \
                and not {"hide-input", "remove-input", "remove-cell"} & set(tags):
            cell.metadata["tags"] = [*tags, "hide-input"]


#: a first cell longer than this many lines holds more than the title and the claim: the result goes
#: after its first paragraph (a committed run of a notebook written before the claim cell was short)
CLAIM_LINES = 12


def _insert_result(nb: Any, page: Page, result: str) -> None:
    """The result goes right below the title and the claim: after the first markdown cell, or after
    the title and first paragraph of a first cell that holds more."""
    first = next((i for i, c in enumerate(nb.cells) if c.cell_type == "markdown"), None)
    if first is None or first > 0:
        nb.cells.insert(0, _markdown_cell(f"# {page.title}\n\n{result}"))
        return
    text = nb.cells[0].source
    if len(text.splitlines()) > CLAIM_LINES:
        paragraphs = re.split(r"\n\s*\n", text.strip())
        keep = 2 if paragraphs[0].startswith("#") and len(paragraphs) > 2 else 1
        while keep < len(paragraphs) - 1 and paragraphs[keep - 1].rstrip().endswith(":"):
            keep += 1  # a claim that introduces a list keeps its list
        nb.cells[0].source = "\n\n".join(paragraphs[:keep])
        nb.cells.insert(1, _markdown_cell("\n\n".join(paragraphs[keep:])))
    nb.cells.insert(1, _markdown_cell(result))


def changed_code_cells(executed: Any, source: Any) -> int:
    """How many code cells of the committed run ``executed`` differ from those of the notebook's ``source``
    (both nbformat notebooks; papermill's injected parameter cell left out; cells aligned as ``difflib`` aligns
    lines, so a cell added, removed or edited counts once). Prose may change without a re-run; code may not
    without the page saying so."""
    import difflib

    def code(nb: Any) -> list[str]:
        return [c.source.strip() for c in nb.cells if c.cell_type == "code"
                and "injected-parameters" not in c.get("metadata", {}).get("tags", [])]

    ops = difflib.SequenceMatcher(a=code(executed), b=code(source), autojunk=False).get_opcodes()
    return sum(max(i2 - i1, j2 - j1) for tag, i1, i2, j1, j2 in ops if tag != "equal")


def _page_notebook(page: Page, root: Path, figures: Path, images: Path, items: list[dict]) -> Any:
    import jupytext
    import nbformat

    source = f"notebooks/{page.name}.py"
    key = KEY_FIGURE.get(page.name)
    image = None
    if key and (figures / key).is_file():
        shutil.copy2(figures / key, images / key)
        image = f"{images.name}/{key}"
    result = result_markdown(page.name, items, figures, image)
    if page.executed is not None:
        nb = read_committed(page.executed, lambda text: nbformat.reads(text, as_version=4),
                            what="an executed notebook (JSON)", remake=f"re-run `make {page.name}`")
        changed = changed_code_cells(nb, jupytext.read(root / source))
        if changed:
            result += ("\n\n:::{admonition} The code changed since this run\n:class: warning\n"
                       f"{changed} code cell(s) of `{source}` differ from the ones this committed run executed: the "
                       f"outputs below come from the earlier code. `make {page.name}` runs it again.\n:::")
        _collapse_parameters(nb)
        _insert_result(nb, page, result)
        footer = (f"*This page is the committed run of `{source}` at the embedded default, "
                  f"`notebooks/executed/{page.name}.ipynb`; `make {page.name}` runs it again.*")
        nb.cells.append(_markdown_cell(footer))
        return nb
    nb = jupytext.read(root / source)
    _collapse_parameters(nb)
    notice = (":::{admonition} Not run yet\n:class: warning\n"
              f"This notebook has not been run since executed notebooks were committed: "
              f"`notebooks/executed/{page.name}.ipynb` does not exist yet. `make {page.name}` runs it "
              "and writes that file; until then this page shows the outputs its last run committed to "
              "`figures/`, then the notebook's source without outputs.\n:::")
    _insert_result(nb, page, result + "\n\n" + notice)
    outputs = _outputs_markdown(page.name, figures, images, images.name)
    cells = [_markdown_cell("## Committed outputs\n\n" + (outputs or "This notebook has committed no "
                                                               "outputs to `figures/` yet.")),
             _markdown_cell(f"## Source of the notebook (`{source}`, not executed)")]
    nb.cells[2:2] = cells
    return nb


def _verify_results(root: Path) -> dict[str, str]:
    """notebook -> the results of its ``make verify`` records in ``data/verify/<cpu>/`` (PASS, FAIL, ...), each
    with "out of date" where a table of the notebook was committed after the run (the record no longer vouches
    for it), and the CPU model of each (``"PASS on AMD EPYC; PASS, out of date on Intel Xeon"``)."""
    per: dict[str, list[str]] = {}
    for (nb, _), record in read_records(root / "data" / "verify").items():  # a damaged one: one line
        result = record["result"].split(" (")[0]
        result = "ran" if result == "NO TABLE" else result  # writes no table
        result += ", out of date" if changed_tables(record, root / "figures") else ""
        cpu = (record.get("machine") or {}).get("cpu")
        per.setdefault(nb, []).append(f"{result} on {cpu_model(cpu) if cpu else 'a machine not recorded'}")
    return {nb: "; ".join(res) for nb, res in per.items()}


def _index(book_pages: list[Page], items: list[dict], verified: dict[str, str], headline: str | None) -> str:
    names = {p.name for p in book_pages}
    rows, group = [], None
    for r in items:
        if r["group"] != group:
            group = r["group"]
            rows.append(f"| **{_cell(group)}** | | | | | |")
        link = f"[page]({r['notebook']}.ipynb)" if r["notebook"] in names else "-"
        rows.append(f"| {_cell(r['title'])}: {_cell(r['claim'])} | {_cell(r['paper'])} | {_cell(r['ours'])} "
                    f"| **{_cell(r['verdict'])}** | {verified.get(r['notebook'], 'not run')} | {link} |")
    counts = {v: sum(r["verdict"] == v for r in items) for v in claims.VERDICTS}
    tally = ", ".join(f"{n} {v}" for v, n in counts.items() if n)
    figure = ("\n:::{figure} " + headline + "\n:class: headline\n\nThe mechanism the method rests on "
              "(Sec. 6.1, [its page](fig_synthetic_correlations.ipynb)): GFWSVD (blue) pulls ahead of the "
              "diagonal Fisher (orange) and SVD as the inputs become correlated.\n:::\n") if headline else ""
    beyond = [p for p in book_pages if p.name not in {r["notebook"] for r in items}]
    toc = "\n".join(f"{p.title} <{p.name}>" for p in book_pages)
    guides = "\n".join(GUIDE_PAGES)
    return f"""# fisherkron: does the paper reproduce?

Each of the {len(items)} figures and tables of *Scalable Kronecker-Factored Fisher Approximation for Neural
Network Parameter Sensitivity* (ICML 2026) is regenerated offline on 2 CPU cores by one notebook,
with SmolLM2-135M in Llama's role and all-MiniLM-L6-v2 in BERT's, and judged by a verdict the
notebook computes from its own numbers: {tally}. *holds*: as the paper says; *holds in part*: in
some settings; *not at this scale*: the effect does not appear on our small models; *cannot tell*:
our evaluation cannot separate the rows; *does not hold*: the opposite was measured; *verify*: the
latest [`make verify`](reproduce.md), which re-runs the notebook and compares every value (*out of date*:
a table was committed after it).
{figure}
| paper item: claim | the paper | here | verdict | verify | |
|---|---|---|---|---|---|
{chr(10).join(rows)}

Beyond the paper: {", ".join(f"[{p.title}]({p.name}.ipynb)" for p in beyond)}. The
[teaching notebook](kronecker_fisher_from_scratch.ipynb) writes MFF and Theorem 1 out on a layer
small enough to print; the [user guide](guide.md) compresses your own model; the
[reproduction page](reproduce.md) regenerates and verifies every number here.

```{{toctree}}
:hidden:
:maxdepth: 1
:caption: Notebooks

{toc}
```

```{{toctree}}
:hidden:
:maxdepth: 1
:caption: Using and reproducing

{guides}
```
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
                  figures: Path | None = None) -> list[Page]:
    """Write the book's Sphinx source folder ``out`` (replaced) and return its notebook pages.

    ``executed`` and ``figures`` default to ``notebooks/executed`` and ``figures`` under ``root``.
    ``out`` holds the files of ``book/`` (``conf.py``, the Markdown pages), ``_bookstatic/`` (the
    book's CSS and script, ``book/static/``), ``index.md`` (the results page), one
    ``<name>.ipynb`` per notebook, ``_figures/`` (images shown with results and on pages not run
    yet) and ``_mathjax/mathjax`` (MathJax 3, served from the site's ``_static/mathjax``).
    """
    import nbformat

    out = Path(out)
    figures = root / "figures" if figures is None else figures
    book_pages = pages(root, executed)
    items = claims.results(figures)
    if out.exists():
        shutil.rmtree(out)
    images = out / "_figures"
    images.mkdir(parents=True)
    for path in sorted((root / "book").glob("*")):  # conf.py, the favicon, the Markdown pages
        if path.is_file() and path.suffix != ".pyc":
            shutil.copy2(path, out / path.name)
    if (root / "book" / "static").is_dir():
        shutil.copytree(root / "book" / "static", out / "_bookstatic")
    _copy_mathjax(out / "_mathjax")
    from .generated import write_generated  # it reads this module's pages: imported here, not above

    write_generated(out, root)  # the tables the Markdown pages include (verify records, costs, bench)
    for page in book_pages:
        nb = _page_notebook(page, root, figures, images, items)
        atomic_write(out / f"{page.name}.ipynb", lambda tmp, nb=nb: nbformat.write(nb, tmp))
    headline = None
    if (figures / HEADLINE).is_file():
        shutil.copy2(figures / HEADLINE, images / HEADLINE)
        headline = f"{images.name}/{HEADLINE}"
    index = _index(book_pages, items, _verify_results(root), headline)
    atomic_write(out / "index.md", lambda tmp: Path(tmp).write_text(index, encoding="utf-8"))
    return book_pages
