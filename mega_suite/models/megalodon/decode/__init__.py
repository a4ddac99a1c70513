"""One-token decoding of a Megalodon language model (docs/long_context.md#decoding).

``Decoder`` (the packed one-token step), ``generate`` (sampling), ``StaticDecoder`` (fixed buffers for CUDA
graphs and torch.compile). The packed weights (``megalodon/pack.py``) and the one-token step
(``megalodon/step.py``) sit below the model, whose forward takes the same step. The decoder reads the model; the model never
imports the decoder.
"""

from __future__ import annotations

from mega_suite.models.megalodon.decode.decoder import Decoder
from mega_suite.models.megalodon.decode.generation import generate
from mega_suite.models.megalodon.decode.static import StaticDecoder
from mega_suite.models.megalodon.pack import (
    CPU_COMPILE_OPTIONS,
    CPU_KV_BUCKET_ROWS,
    CUDA_COMPILE_OPTIONS,
    CUDA_COMPILED_ROW_GEMV,
    CUDA_ROW_GEMVS,
    GEMV_KINDS,
    KV_DTYPES,
    WEIGHT_DTYPES,
    BlockPack,
    DecodePlan,
    Gemv,
    compiled_step_defaults,
    cuda_row_gemv,
    mkldnn_available,
)
from mega_suite.models.megalodon.step import block_step

__all__ = [
    "CPU_COMPILE_OPTIONS", "CPU_KV_BUCKET_ROWS", "CUDA_COMPILE_OPTIONS", "CUDA_COMPILED_ROW_GEMV", "CUDA_ROW_GEMVS",
    "GEMV_KINDS", "KV_DTYPES", "WEIGHT_DTYPES", "BlockPack", "DecodePlan", "Decoder", "Gemv", "StaticDecoder",
    "block_step", "compiled_step_defaults", "cuda_row_gemv", "generate", "mkldnn_available",
]  # fmt: skip
