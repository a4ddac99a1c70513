"""``python -m mega_suite``: the ``mega-suite`` command line (``mega_suite.cli``)."""

import sys

from mega_suite.cli import main

sys.exit(main(prog="python -m mega_suite"))
