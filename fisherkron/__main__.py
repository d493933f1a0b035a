"""``python -m fisherkron``: the ``fisherkron`` command (also ``torchrun --nproc_per_node=N -m fisherkron compress ...``)."""
import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
