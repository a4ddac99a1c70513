"""transformers configuration of a mega-suite bundle: the suite's own model config (``suite_config``, the
fields of the architecture named by ``arch``) carried inside a ``PreTrainedConfig``.

Imports transformers only: this file is copied into every bundle (docs/after_training.md#shareable-weights)."""

from __future__ import annotations

from transformers import PreTrainedConfig


class MegaSuiteConfig(PreTrainedConfig):
    model_type = "mega_suite"

    def __init__(
        self,
        arch: str = "megalodon",
        suite_config: dict | None = None,
        tied_weights: dict | None = None,
        mega_suite_format: int = 1,
        vocab_size: int = 32000,
        **kwargs,
    ):
        self.arch = arch
        self.suite_config = dict(suite_config or {})
        self.tied_weights = dict(tied_weights or {})
        self.mega_suite_format = mega_suite_format
        self.vocab_size = vocab_size
        kwargs.setdefault("use_cache", True)  # generate() decodes one token per step with the model's cache
        super().__init__(**kwargs)
