"""Entry point of ``python -m mega_suite.training.checkpoint``: the same command line as ``mega-suite``."""

import sys

from mega_suite.cli import main

sys.exit(main(prog="python -m mega_suite.training.checkpoint"))
