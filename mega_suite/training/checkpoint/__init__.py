"""``python -m mega_suite.training.checkpoint export|consolidate ...``: the tools' command line under its
older name (``__main__.py`` runs ``mega-suite``'s, ``mega_suite.cli``). Reading and writing checkpoints is
``mega_suite.storage``'s."""
