"""Experiment configuration (docs/configuration.md): the schema of every key (``schema``), recipes and
overrides (``recipes``), the checks run at load (``checks``), what a run derives from it (``resolve``) and the
run plan resolved once from all of it, files included (``run_plan``).

Importing this package imports no torch: a configuration error is reported within a moment."""

from __future__ import annotations

from mega_suite.config.checks import check_cudagraph_mode, validate
from mega_suite.config.recipes import RECIPES_DIR, list_recipes, load_config, to_yaml
from mega_suite.config.resolve import (
    data_arguments,
    data_contract,
    data_module,
    data_num_classes,
    data_option,
    device_count,
    model_config,
    tokens_per_sequence,
    tokens_per_step,
)
from mega_suite.config.schema import (
    ADAMW_KERNELS,
    CHOICES,
    COMPILE_MODES,
    CUDAGRAPH_MODES,
    FLOAT32_MATMUL_PRECISIONS,
    ConfigError,
    DataSection,
    ModelSection,
    OptimSection,
    RunConfig,
    TrainerSection,
)

__all__ = [
    "ADAMW_KERNELS", "CHOICES", "COMPILE_MODES", "CUDAGRAPH_MODES", "FLOAT32_MATMUL_PRECISIONS", "RECIPES_DIR",
    "ConfigError", "DataSection", "ModelSection", "OptimSection", "RunConfig", "TrainerSection",
    "check_cudagraph_mode", "data_arguments", "data_contract", "data_module", "data_num_classes", "data_option",
    "device_count", "list_recipes", "load_config", "model_config", "to_yaml", "tokens_per_sequence",
    "tokens_per_step", "validate",
]  # fmt: skip
