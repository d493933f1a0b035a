"""The reproduction's tooling: how the notebooks run, record, verify and become a book.

Nothing here implements the method or an experiment; it is the machinery around them, and it
reads and writes files (tables, provenance and summary records, executed notebooks), never a model.
Only :mod:`fisherkron.experiments` may import it (to save its tables with provenance).

=====================  ================================================================
module                 what it holds
=====================  ================================================================
``figures``            ``save_figure`` / ``save_table``: atomic outputs with provenance records
``tolerance``          the grammar of a column's verify tolerance (``exact``, ``rel=``, ...)
``verify_tolerances``  tolerances of tables whose notebook declares none
``execute``            the one way a notebook runs (jupytext, then papermill; Make and verify)
``compare``            a regenerated table against the committed one, value by value, within tolerance
``verify``             ``make verify``: re-run notebooks, compare every value, keep a record
``ledger``             finished results of the long studies, committed so a study resumes elsewhere
``cold``               a cold ``make all``: every notebook from empty caches, resumable, its hours summed
``claims``             the paper's 19 items: claim, the paper's number, ours, the verdict
``readme``             the front page's generated blocks (``make readme``)
``book``               ``make book``: the results page, the notebook pages, the guide
=====================  ================================================================
"""
