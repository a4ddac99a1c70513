"""Chunked normalised attention (SPEC §4)."""

from kernels.attention.reference import attention_with_cache, chunk_attention

__all__ = ["chunk_attention", "attention_with_cache"]
