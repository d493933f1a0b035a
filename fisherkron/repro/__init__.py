"""The reproduction's tooling: how the notebooks run, record, verify and become a book.

Nothing here implements the method or an experiment; it is the machinery around them, and it
reads only files (tables, provenance and summary records, executed notebooks), never a model.

=====================  ================================================================
module                 what it holds
=====================  ================================================================
``claims``             the paper's 19 items: claim, the paper's number, ours, the verdict
=====================  ================================================================
"""
