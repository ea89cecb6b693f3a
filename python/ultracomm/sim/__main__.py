"""``python -m ultracomm.sim``: see :mod:`ultracomm.sim.cli`."""

import sys

from .cli import main

sys.exit(main())
