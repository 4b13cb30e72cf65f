"""``python -m flashasr``: the same command line as ``flashasr``."""

import sys

from .cli import main

sys.exit(main())
