"""The package's one exception type, in a module of its own so that code which only raises or catches it
(``fisherkron.env``, the repository's tooling in ``fisherkron.repro``) imports no torch.

>>> raise FisherkronError("rank=0 is below 1; pass a rank of at least 1")
Traceback (most recent call last):
    ...
fisherkron.core.errors.FisherkronError: rank=0 is below 1; pass a rank of at least 1
"""
from __future__ import annotations

__all__ = ["FisherkronError"]


class FisherkronError(ValueError):
    """Bad input to a fisherkron routine; the message is one line and says what to do."""
