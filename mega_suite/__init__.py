"""mega-suite: Megalodon (and a Llama baseline), configurations and Lightning glue."""

from mega_suite.models import build_model, count_parameters, create_model, get_config, list_models
from mega_suite.models.llama import LlamaConfig, LlamaLM
from mega_suite.models.megalodon import MegalodonClassifier, MegalodonConfig, MegalodonLM

__all__ = [
    "LlamaConfig",
    "LlamaLM",
    "MegalodonClassifier",
    "MegalodonConfig",
    "MegalodonLM",
    "build_model",
    "count_parameters",
    "create_model",
    "get_config",
    "list_models",
]
