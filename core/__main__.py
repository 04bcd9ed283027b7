"""``python -m rlcore`` (and ``torchrun -m rlcore``) run the ``rlcore`` command."""

import sys

from rlcore.cli import main

if __name__ == "__main__":
    sys.exit(main())
