"""``python -m sextant``: the same as the ``sextant`` command."""

import sys

from sextant.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
