"""``python -m fisherkron.experiments.readme [--check] [README.md]``: see :func:`fisherkron.experiments.readme.main`."""
from . import main

raise SystemExit(main())
