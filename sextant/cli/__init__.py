"""The ``sextant`` command line (``sextant compile | run | explain``); see :mod:`sextant.cli.main`."""

from sextant.cli.main import main

__all__ = ["main"]
