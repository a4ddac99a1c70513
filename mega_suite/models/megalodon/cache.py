"""What a Megalodon language model carries between segments of a stream (docs/architecture.md#streaming).

Per block: the TimestepNorm statistics, the CEMA state and the keys / values of the unfinished chunk; plus
the final norm's statistics. Memory is O(C) whatever the context length. The types are plain data: the model
(``lm.py``) fills them, the one-token decoder (``decode/``) reads and writes them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from kernels.timestep_norm import merge_norm_states

NormState = tuple[Tensor, Tensor, Tensor]  # (count [B] int64, mean [B, G], var [B, G])


@dataclass
class NormWindow:
    """Windowed-statistics mode (docs/architecture.md#streaming): the norm state at the start of the current chunk and the
    statistics of the most recent complete chunks."""

    start: NormState
    chunks: list = field(default_factory=list)


@dataclass
class ChunkKV:
    """Keys and values of the unfinished chunk, in buffers of C rows: appending a token costs O(1).

    Caches may share buffers (one cache continued twice): each reads only its first ``length`` rows, and
    appending where another cache already wrote copies the buffers first (copy on write). Under autograd the
    buffers are never written in place.
    """

    def __init__(self, k: Tensor, v: Tensor, length: int, mark: list[int]):
        self.k_buf, self.v_buf, self.length, self.mark = k, v, length, mark

    @staticmethod
    def new(k: Tensor, v: Tensor, capacity: int) -> ChunkKV:
        n = k.shape[1]
        if torch.is_grad_enabled():
            return ChunkKV(k, v, n, [n])
        kb = k.new_empty(k.shape[0], max(capacity, n), *k.shape[2:])
        vb = v.new_empty(v.shape[0], max(capacity, n), *v.shape[2:])
        kb[:, :n], vb[:, :n] = k, v
        return ChunkKV(kb, vb, n, [n])

    def append(self, k: Tensor, v: Tensor) -> ChunkKV:
        n, l = self.length, k.shape[1]
        if torch.is_grad_enabled():
            return ChunkKV(torch.cat([self.keys, k], 1), torch.cat([self.values, v], 1), n + l, [n + l])
        kb, vb, mark = self.k_buf, self.v_buf, self.mark
        if mark[0] != n or n + l > kb.shape[1]:  # shared beyond our rows, or full: copy first
            return ChunkKV.new(torch.cat([self.keys, k], 1), torch.cat([self.values, v], 1), kb.shape[1])
        kb[:, n : n + l], vb[:, n : n + l] = k, v
        mark[0] = n + l
        return ChunkKV(kb, vb, n + l, mark)

    def to(self, dtype: torch.dtype) -> ChunkKV:
        """These keys and values in ``dtype``: ``self`` if they are, else a copy in new buffers of the same
        capacity (``self`` and caches sharing its buffers unchanged)."""
        if self.k_buf.dtype == dtype:
            return self
        return ChunkKV.new(self.keys.to(dtype), self.values.to(dtype), self.k_buf.shape[1])

    @property
    def keys(self) -> Tensor:
        return self.k_buf[:, : self.length]

    @property
    def values(self) -> Tensor:
        return self.v_buf[:, : self.length]


@dataclass
class LayerCache:
    """Streaming state of one block: TimestepNorm statistics, CEMA state, KV of the unfinished chunk."""

    norm: NormState
    cema: Tensor | None  # [B, D, N] complex; None before the first token (zeros)
    kv: ChunkKV | None = None  # at most C - 1 tokens
    window: NormWindow | None = None  # windowed-statistics mode only

    @property
    def k(self) -> Tensor | None:  # [B, n < C, h, Z/h]
        return None if self.kv is None else self.kv.keys

    @property
    def v(self) -> Tensor | None:  # [B, n < C, h, E/h]
        return None if self.kv is None else self.kv.values


@dataclass
class StreamingCache:
    """Everything the LM carries between segments (docs/architecture.md#streaming): O(C) memory whatever the context length."""

    position: int  # tokens consumed so far (same for every batch row)
    layers: list[LayerCache]
    final_norm: NormState
    window_stats: bool = False  # replace norm statistics by the last 6 chunks once 8 have been seen
    final_window: NormWindow | None = None

    def memory_bytes(self) -> int:
        tensors = [t for lc in self.layers for t in (*lc.norm, lc.cema) if t is not None]
        tensors += [t for lc in self.layers if lc.kv is not None for t in (lc.kv.k_buf, lc.kv.v_buf)]
        tensors += list(self.final_norm)
        return sum(t.numel() * t.element_size() for t in tensors)


WINDOW_CHUNKS, WINDOW_AFTER = 6, 8  # statistics of the last 6 chunks once 8 have been seen


def _unmerge(total: NormState, prefix: NormState) -> NormState:
    """The statistics of the steps in ``total`` but not in ``prefix`` (inverse of the Welford merge)."""
    nt, mt, vt = (t.double() for t in total)
    np_, mp, vp = (t.double() for t in prefix)
    n = (nt - np_).clamp(min=1).unsqueeze(-1)
    s1 = nt.unsqueeze(-1) * mt - np_.unsqueeze(-1) * mp
    s2 = nt.unsqueeze(-1) * (vt + mt.square()) - np_.unsqueeze(-1) * (vp + mp.square())
    mean = s1 / n
    var = (s2 / n - mean.square()).clamp(min=0)
    return total[0] - prefix[0], mean.to(total[1].dtype), var.to(total[2].dtype)


def advance_windows(cache: StreamingCache, chunk_size: int) -> None:
    """Windowed-statistics mode, at a chunk boundary: record the chunk's statistics; once ``WINDOW_AFTER``
    chunks have been seen, every norm (the blocks' and the final one) continues from the statistics of the
    last ``WINDOW_CHUNKS`` chunks only."""
    chunks_seen = cache.position // chunk_size

    def advance(state: NormState, window: NormWindow) -> tuple[NormState, NormWindow]:
        chunks = (window.chunks + [_unmerge(state, window.start)])[-WINDOW_CHUNKS:]
        if chunks_seen >= WINDOW_AFTER:
            state = chunks[0]
            for s in chunks[1:]:
                state = merge_norm_states(state, s)
        return state, NormWindow(state, chunks)

    for lc in cache.layers:
        lc.norm, lc.window = advance(lc.norm, lc.window)
    cache.final_norm, cache.final_window = advance(cache.final_norm, cache.final_window)
