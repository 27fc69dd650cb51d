"""``python -m plait`` is the ``plait`` command (torchrun runs workers this way)."""

import sys

from plait.cli import main

sys.exit(main())
