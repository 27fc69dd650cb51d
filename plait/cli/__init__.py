"""The ``plait`` command line (``plait.cli.main``); ``python -m plait`` runs it too."""

from plait.cli.main import main

__all__ = ["main"]
