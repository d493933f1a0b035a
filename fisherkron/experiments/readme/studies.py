"""README blocks of the long SmolLM2 studies whose notebooks write their verdicts as sentences: the decoder
tables (Sec. 6.3, ``make tab_llm_compression_main``, ``tab_llm_compression_mmlu``, ``tab_ablation_diag``), the
allocation study (``make fig_allocation_cost``) and Sec. 6.4's extra compression
(``make tab_extra_compression_results``).

Each of these notebooks computes its verdicts from its own numbers and stores them, one Markdown line
each, in the ``"lines"`` of its summary record ``<notebook>_summary.provenance.json``. The blocks here only
copy what is committed:

* ``study-table:NAME``: the committed ``figures/NAME.md`` with its caption, the wall time and machine of the
  run that wrote it;
* ``study-verdicts:NAME``: the notebook's verdict lines (``NAME`` the notebook).

A study whose outputs are not committed yet renders a line saying so, with its Make target, and no
number; the README check then holds until the outputs land and ``make readme`` fills the block in.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from .formats import cpu, secs

if TYPE_CHECKING:
    from . import Outputs

#: the notebook whose Make target writes each table of these studies
NOTEBOOK = {
    "tab_llm_compression_main": "tab_llm_compression_main",
    "tab_llm_compression_mmlu": "tab_llm_compression_mmlu",
    "tab_ablation_diag": "tab_ablation_diag",
    "tab_gfwsvd_transposed": "tab_ablation_diag",
    "tab_allocation_cost": "fig_allocation_cost",
    "tab_extra_compression_results": "tab_extra_compression_results",
}


def _pending(notebook: str) -> str:
    return (f"*Not yet run: `make {notebook}` writes these outputs (its progress is in the issue notes); "
            f"this block fills in from them with `make readme`.*")


def _committed(out: Outputs, name: str, suffix: str) -> bool:
    return (out.folder / f"{name}{suffix}").is_file()


def study_table(out: Outputs, name: str) -> str:
    """The committed table ``figures/NAME.md``, its caption and the run that wrote it."""
    notebook = NOTEBOOK.get(name, name)
    if not (_committed(out, name, ".md") and _committed(out, name, ".provenance.json")):
        return _pending(notebook)
    rec = out.record(name)
    body = (out.folder / f"{name}.md").read_text(encoding="utf-8").strip()
    caption = rec.get("caption")
    head = f"`figures/{name}.md`, written by `make {notebook}` in {secs(out.wall(name))} on {cpu(out, name)}"
    lines = [f"**{head}.**" + (f" {caption}" if caption else ""), "", body]
    return "\n".join(lines)


def study_verdicts(out: Outputs, notebook: str) -> str:
    """The verdict lines the notebook computed, from its summary record."""
    summary = f"{notebook}_summary"
    if not _committed(out, summary, ".provenance.json"):
        return _pending(notebook)
    lines = out.extra(summary).get("lines") or []
    return "\n".join(lines) if lines else f"*`{summary}` records no verdicts.*"


BLOCKS = {"study-table": study_table, "study-verdicts": study_verdicts}
