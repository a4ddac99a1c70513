"""Functional ops of Megalodon: readable PyTorch references (the CPU path) and Triton kernels (CUDA).

One subpackage per op, each exporting its public functions (import them from there, e.g.
``from kernels.cema import cema``):
- ``kernels.cema``: complex EMA (FFT convolution, chunked scan, sequential recurrence).
- ``kernels.timestep_norm``: causal TimestepNorm with carried state, whole-sequence group norm.
- ``kernels.attention``: block-diagonal chunked attention.
- ``kernels.gemv``: the one-row GEMV of a decode step (low-precision weights, float32 sums).
- ``kernels.dispatch``: Triton for CUDA tensors, the references otherwise.
"""
