"""The ``transformers`` wrapper of an exported bundle (``mega_suite.models.bundle``): these two files are copied
into every bundle, so that ``AutoModelForCausalLM.from_pretrained(BUNDLE, trust_remote_code=True)`` finds them.
They import ``transformers`` (the ``eval`` dependency group) and ``mega_suite``."""
