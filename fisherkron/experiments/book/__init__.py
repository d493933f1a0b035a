"""The executed notebooks as a book a reader opens without running anything (issue 24, items 3-4).

The default-profile run of every notebook is committed, with its outputs, as
``notebooks/executed/<name>.ipynb`` (``make <name>`` writes it beside ``figures/``, see
``mk/notebooks.mk``), and ``make book`` renders those files into a static HTML site with Sphinx and
MyST-NB (no notebook is executed; ``book/conf.py``), its mathematics typeset by a MathJax copied
from an installed package, so the site needs no network.

=================  ====================================================================
module             what it holds
=================  ====================================================================
``executed``       the committed copy of an executed notebook: volatile metadata removed
``sources``        the book's sources: the pages in the paper's order, the index with the
                   README's reproduction table, a page for a notebook not yet run
``__main__``       ``python -m fisherkron.experiments.book strip|sources`` (used by Make)
=================  ====================================================================
"""
