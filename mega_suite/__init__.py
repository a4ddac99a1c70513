"""mega-suite: Megalodon models, configurations and Lightning glue."""

from mega_suite.config import MegalodonConfig
from mega_suite.model import MegalodonClassifier, MegalodonLM, build_model
from mega_suite.presets import count_parameters, create_model, get_config, list_models

__all__ = [
    "MegalodonClassifier",
    "MegalodonConfig",
    "MegalodonLM",
    "build_model",
    "count_parameters",
    "create_model",
    "get_config",
    "list_models",
]
