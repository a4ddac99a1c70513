"""The ``transformers`` side of an exported bundle (``mega_suite.models.bundle``).

``configuration_mega_suite.py`` and ``modeling_mega_suite.py`` are copied into every bundle, so that
``AutoModelForCausalLM.from_pretrained(BUNDLE, trust_remote_code=True)`` finds them; they import only torch
and transformers (a standalone copy of the suite's math, docs/after_training.md#shareable-weights) and nothing
in the suite imports them. ``tokenizer.py`` runs at export, in the suite: the run's tokenizer as the fast
``tokenizer.json`` and configuration files ``AutoTokenizer`` reads."""
