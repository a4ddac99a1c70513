"""Functional ops of Megalodon: readable PyTorch references (the CPU path).

One folder per op, each exporting its public functions:
- ``kernels.cema``: complex EMA (FFT convolution, chunked scan, sequential recurrence).
- ``kernels.timestep_norm``: causal TimestepNorm with carried state, whole-sequence group norm.
- ``kernels.attention``: block-diagonal chunked attention.
"""

from kernels.attention import attention_with_cache, chunk_attention
from kernels.cema import cema, cema_coefficients, cema_kernel, cema_step
from kernels.timestep_norm import group_norm, merge_norm_states, timestep_norm

__all__ = [
    "attention_with_cache",
    "cema",
    "cema_coefficients",
    "cema_kernel",
    "cema_step",
    "chunk_attention",
    "group_norm",
    "merge_norm_states",
    "timestep_norm",
]
