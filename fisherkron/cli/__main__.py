"""``python -m fisherkron.cli``: the same as the ``fisherkron`` command."""
import sys

from . import main

sys.exit(main())
