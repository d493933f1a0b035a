"""The executed notebooks as a book a reader opens without running anything.

The default-profile run of every notebook is committed, with its outputs, as
``notebooks/executed/<name>.ipynb`` (``make <name>`` writes it beside ``figures/``, see
``mk/notebooks.mk``), and ``make book`` renders those files, with the Markdown pages of ``book/``,
into a static HTML site with Sphinx and MyST-NB (no notebook is executed; ``book/conf.py``), its
mathematics typeset by a MathJax copied from an installed package, so the site needs no network.

=================  ====================================================================
module             what it holds
=================  ====================================================================
``executed``       the committed copy of an executed notebook: volatile metadata removed
``sources``        the book's sources: the results page, each notebook page opening with
                   its claim and result, a page for a notebook not yet run
``generated``      the tables the guide and the reproduction page include, at build time
``records``        reading and formatting the committed records those tables show
``__main__``       ``python -m fisherkron.repro.book strip|sources`` (used by Make)
=================  ====================================================================
"""
