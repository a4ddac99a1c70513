"""Chunk parallelism (docs/architecture.md#chunk-parallelism): the ranks of a group each hold a contiguous, chunk-aligned slice of the same
sequences, and run the Megalodon LM on it at the same time, with no pipeline bubble.

Attention needs nothing (slices start on a chunk boundary, RoPE restarts per chunk). The two recurrent
states compose associatively, so per layer each rank computes its slice from a zero state, all-gathers a
tiny summary and corrects itself with the exclusive prefix of the ranks before it:

- TimestepNorm (docs/architecture.md#timestepnorm). The statistics of a slice are (count n_s, mean m_s, population variance v_s) per
  (row, group), computed directly. The incoming state of rank r is the Chan merge of slices 0..r-1,
      n = n_a + n_b,  m = m_a + (n_b/n) (m_b - m_a),  v = (n_a/n) v_a + (n_b/n) v_b + (n_a n_b/n²)(m_b - m_a)²,
  and the slice runs once from that state (``timestep_norm(..., state=prefix)``).
- CEMA (docs/architecture.md#cema). A segment of length L maps h0 to q^L h0 + h_local, so with h_loc(s) the final state of
  slice s run from zero, the state entering rank r is
      h_in(r) = Σ_{s<r} q^(L_{s+1} + ... + L_{r-1}) h_loc(s),
  and its effect on output t of the slice is the h0 term Re(Σ_n γ_n q_n^(t+1) h_in,n), added to the
  zero-state output.

Both gathers are autograd functions whose backward all-reduces the gathered gradient and keeps this rank's
part: d(Σ_r loss_r)/d(summary_s) reaches rank s, so gradients reach every rank's inputs and, after the
gradients are summed over the group (``reduce_gradients`` or DDP/FSDP over the flattened mesh), the
parameters exactly. Every rank runs the same operations (prefixes are masked, not sliced), so the collectives
run in the same order in forward and backward on every rank.

``mode="sequential"`` is the reference release's hand-off, kept for comparison: per layer, rank r receives
the states of rank r-1 (blocking), runs its slice from them and sends its final states to r+1; the
backward sends the gradients back the same way. Same numbers, a (P-1)-layer pipeline bubble each way.

Use: ``ctx = ChunkParallelContext.from_group(group)``; ``with ctx.attached(model): loss = ...; backward()``.
Attaching swaps each causal TimestepNorm's and CEMA's class for a chunk-parallel subclass whose full pass
(no carried state) is the rank's slice, as FSDP2's ``fully_shard`` swaps classes; the model's own code knows
nothing of it. The swap lasts until detached, so activation-checkpoint recomputation in backward sees it too;
``slice_batch`` cuts a batch for a rank; ``global_mean_loss`` averages over the whole sequence;
``reduce_gradients`` sums the parameter gradients over the group.
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor, nn

from kernels.cema import cema
from kernels.timestep_norm import merge_norm_states, timestep_norm
from mega_suite.models.common import float32_island
from mega_suite.models.megalodon.layers import ComplexEMA, TimestepNorm

__all__ = [
    "ChunkParallelContext",
    "CommStats",
    "slice_batch",
    "slice_bounds",
    "global_mean_loss",
    "reduce_gradients",
]

MODES = ("parallel", "sequential")
_TAG_SPACE = 1 << 20


@dataclass
class CommStats:
    """Bytes this rank sent and received (payloads; all-reduce counted as a ring's 2(P-1)/P of the tensor)
    and seconds spent inside blocking communication (waiting for the other ranks included)."""

    bytes_sent: int = 0
    bytes_received: int = 0
    wait_s: float = 0.0
    calls: int = 0

    def reset(self) -> None:
        self.bytes_sent = self.bytes_received = self.calls = 0
        self.wait_s = 0.0


@dataclass
class ChunkParallelContext:
    """This rank's place in a chunk-parallel group.

    group: the process group of the P ranks that share sequences (None = the default group).
    rank, world: this rank's index in the group and P; rank r holds slice r (contiguous, in order).
    lengths: the slice length of every rank (tokens), or None when every rank holds the same length.
    mode: "parallel" (prefix over an all-gather, no bubble) or "sequential" (the reference's hand-off).
    """

    group: dist.ProcessGroup | None
    rank: int
    world: int
    lengths: tuple[int, ...] | None = None
    mode: str = "parallel"
    stats: CommStats = field(default_factory=CommStats)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"chunk_parallel mode must be one of {MODES}, got {self.mode!r}")
        if not 0 <= self.rank < self.world:
            raise ValueError(f"chunk-parallel rank {self.rank} is outside the group of {self.world}")
        if self.lengths is not None and len(self.lengths) != self.world:
            raise ValueError(f"lengths has {len(self.lengths)} entries for a group of {self.world} ranks")

    @classmethod
    def from_group(
        cls, group: dist.ProcessGroup | None = None, mode: str = "parallel", lengths=None
    ) -> ChunkParallelContext:
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        return cls(group, rank, world, None if lengths is None else tuple(lengths), mode)

    def with_lengths(self, lengths) -> ChunkParallelContext:
        """The same group for slices of other lengths (e.g. one long document split unevenly)."""
        return ChunkParallelContext(self.group, self.rank, self.world, tuple(lengths), self.mode, self.stats)

    def offset(self, length: int) -> int:
        """Global position of this rank's first token, its slices being ``length`` long unless ``lengths``."""
        return sum(self._lengths(length)[: self.rank])

    def _lengths(self, length: int) -> tuple[int, ...]:
        if self.lengths is None:
            return (length,) * self.world
        if self.lengths[self.rank] != length:
            raise ValueError(
                f"chunk-parallel rank {self.rank} got a slice of {length} tokens, its context says "
                f"{self.lengths[self.rank]}"
            )
        return self.lengths

    def _peer(self, rank: int) -> int:
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    def _next_tag(self) -> int:
        self.stats.calls += 1
        return (self.stats.calls * 4) % _TAG_SPACE

    # ------------------------------------------------------------------ attaching to a model

    @contextlib.contextmanager
    def attached(self, model: nn.Module) -> Iterator[ChunkParallelContext]:
        """Run every causal TimestepNorm and CEMA of ``model`` under this context while inside the block."""
        modules = attach(model, self)
        try:
            yield self
        finally:
            for m in modules:
                _detach(m)

    # ------------------------------------------------------------------ the two layers

    def timestep_norm(self, norm: nn.Module, x: Tensor, padding_mask: Tensor | None):
        """x [B, L, D] (this rank's slice) -> (y [B, L, D], state after this slice)."""
        if self.mode == "sequential":
            return self._norm_sequential(norm, x, padding_mask)
        n, m, v = slice_norm_stats(x, norm.num_groups, padding_mask)
        if padding_mask is None:  # every step counts: the counts are the slice lengths, no exchange needed
            lengths = torch.tensor(self._lengths(x.shape[1]), dtype=n.dtype, device=n.device)
            counts = lengths[:, None].expand(-1, n.shape[0])
        else:
            counts = self._gather_plain(n)  # [P, B]
        mv = _AllGather.apply(self, torch.stack([m, v]))  # [P, 2, B, G]
        acc = torch.float64
        ranks = torch.arange(self.world, device=x.device)
        # The exclusive prefix is masked, not sliced, so that every rank runs the same operations.
        before = (ranks < self.rank).to(counts.dtype)
        state = (torch.zeros_like(n), torch.zeros_like(m, dtype=acc), torch.ones_like(v, dtype=acc))
        for s in range(self.world):
            part = (counts[s] * before[s], mv[s, 0].to(acc), mv[s, 1].to(acc))
            state = merge_norm_states(state, part)
        prefix = (state[0], state[1].to(m.dtype), state[2].to(v.dtype))
        return timestep_norm(x, norm.weight, norm.bias, norm.num_groups, norm.eps, prefix, padding_mask)

    def cema(self, module: nn.Module, x: Tensor, padding_mask: Tensor | None, return_state: bool):
        """x [B, L, D] (this rank's slice) -> (y [B, L, D], state after this slice or None)."""
        p, q, gamma = module.coefficients()
        omega = module.omega.squeeze(-1)
        if self.mode == "sequential":
            return self._cema_sequential(module, x, padding_mask, p, q, gamma, omega, return_state)
        length = x.shape[1]
        lengths = self._lengths(length)
        y, h_loc = cema(x, p, q, gamma, omega, padding_mask=padding_mask, method=_method(module, length),
                        return_state=True)  # fmt: skip
        hs = torch.view_as_complex(_AllGather.apply(self, torch.view_as_real(h_loc)))  # [P, B, D, N]
        # h_in = Σ_{s<r} q^(L_{s+1}+...+L_{r-1}) h_loc(s): masked for s >= r, same ops on every rank.
        ends = [sum(lengths[s + 1 : self.rank]) if s < self.rank else 0 for s in range(self.world)]
        log_q = torch.log(q.to(torch.complex128))
        steps = torch.tensor(ends, dtype=torch.float64, device=x.device).view(-1, 1, 1)
        mask = (torch.arange(self.world, device=x.device) < self.rank).to(decay_dtype(q)).view(-1, 1, 1, 1)
        decay = _powers(log_q, steps, q.dtype)  # [P, D, N]
        h_in = (hs * decay.unsqueeze(1) * mask).sum(0)  # [B, D, N]
        y = y + _h0_term(gamma * q * h_in, log_q, length).to(y.dtype)
        h_out = None
        if return_state:
            q_len = _powers(log_q, torch.tensor(float(length), dtype=torch.float64, device=x.device), q.dtype)
            h_out = h_loc + q_len * h_in
        return y, h_out

    # ------------------------------------------------------------------ the reference's hand-off

    def _norm_sequential(self, norm: nn.Module, x: Tensor, padding_mask: Tensor | None):
        b, g = x.shape[0], norm.num_groups
        sdt = torch.float64 if x.dtype == torch.float64 else torch.float32
        tag = self._next_tag()  # the same on both ends: every rank makes the same calls
        state = None
        if self.rank > 0:
            count = self._recv(torch.empty(b, dtype=torch.int64, device=x.device), self.rank - 1, tag)
            mv = _RecvPrev.apply(self, self.rank - 1, tag + 1, x, x.new_empty(2, b, g, dtype=sdt))
            state = (count, mv[0], mv[1])
        y, final = timestep_norm(x, norm.weight, norm.bias, norm.num_groups, norm.eps, state, padding_mask)
        if self.rank < self.world - 1:
            self._send(final[0], self.rank + 1, tag)
            tie = _SendNext.apply(self, self.rank + 1, tag + 1, torch.stack([final[1], final[2]]))
            y = y + tie.to(y.dtype)
        return y, final

    def _cema_sequential(self, module, x, padding_mask, p, q, gamma, omega, return_state):
        b, length, d = x.shape
        tag = self._next_tag()
        h0 = None
        if self.rank > 0:
            rdt = torch.float64 if q.dtype == torch.complex128 else torch.float32
            buf = x.new_empty(b, d, q.shape[-1], 2, dtype=rdt)
            h0 = torch.view_as_complex(_RecvPrev.apply(self, self.rank - 1, tag, x, buf))
        y, h = cema(x, p, q, gamma, omega, h0=h0, padding_mask=padding_mask, method=_method(module, length),
                    return_state=True)  # fmt: skip
        if self.rank < self.world - 1:
            y = y + _SendNext.apply(self, self.rank + 1, tag, torch.view_as_real(h)).to(y.dtype)
        return y, (h if return_state else None)

    # ------------------------------------------------------------------ communication

    def _gather_plain(self, t: Tensor) -> Tensor:
        out = [torch.empty_like(t) for _ in range(self.world)]
        start = time.perf_counter()
        dist.all_gather(out, t.contiguous(), group=self.group)
        self.stats.wait_s += time.perf_counter() - start
        self.stats.bytes_received += _nbytes(t) * (self.world - 1)
        self.stats.bytes_sent += _nbytes(t) * (self.world - 1)
        return torch.stack(out)

    def _send(self, t: Tensor, rank: int, tag: int) -> None:
        dist.send(t.detach().contiguous(), self._peer(rank), group=self.group, tag=tag)
        self.stats.bytes_sent += _nbytes(t)

    def _recv(self, t: Tensor, rank: int, tag: int) -> Tensor:
        start = time.perf_counter()
        dist.recv(t, self._peer(rank), group=self.group, tag=tag)
        self.stats.wait_s += time.perf_counter() - start
        self.stats.bytes_received += _nbytes(t)
        return t


def decay_dtype(q: Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.complex128 else torch.float32


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


def _method(module: nn.Module, length: int) -> str:
    return "sequential" if length <= 16 else module.method


class _AllGather(torch.autograd.Function):
    """t [...] -> [P, ...] (every rank's t); backward: the sum over ranks of the gradient of row r goes to
    rank r (reduce-scatter on NCCL; all-reduce then this rank's row on gloo)."""

    @staticmethod
    def forward(ctx, cp: ChunkParallelContext, t: Tensor) -> Tensor:
        ctx.cp = cp
        return cp._gather_plain(t)

    @staticmethod
    def backward(ctx, grad: Tensor):
        cp = ctx.cp
        grad = grad.contiguous()
        if dist.get_backend(cp.group) == dist.Backend.NCCL:  # gloo has no reduce-scatter
            mine = grad.new_empty(grad.shape[1:])
            dist.reduce_scatter_tensor(mine, grad, group=cp.group)
            cp.stats.bytes_sent += _nbytes(mine) * (cp.world - 1)
            cp.stats.bytes_received += _nbytes(mine) * (cp.world - 1)
            return None, mine
        start = time.perf_counter()
        dist.all_reduce(grad, group=cp.group)
        cp.stats.wait_s += time.perf_counter() - start
        ring = _nbytes(grad) * 2 * (cp.world - 1) // cp.world  # what a ring all-reduce sends (and receives)
        cp.stats.bytes_sent += ring
        cp.stats.bytes_received += ring
        return None, grad[cp.rank]


class _RecvPrev(torch.autograd.Function):
    """Forward: receive a state from ``src``; backward: send its gradient back. ``anchor`` (the slice input)
    only puts the node in the graph so that its backward runs."""

    @staticmethod
    def forward(ctx, cp: ChunkParallelContext, src: int, tag: int, anchor: Tensor, buf: Tensor) -> Tensor:
        ctx.cp, ctx.src, ctx.tag = cp, src, tag
        return cp._recv(buf, src, tag)

    @staticmethod
    def backward(ctx, grad: Tensor):
        ctx.cp._send(grad, ctx.src, ctx.tag)
        return None, None, None, None, None


class _SendNext(torch.autograd.Function):
    """Forward: send a state to ``dst``, return a zero scalar to add to the output (it ties the node into the
    graph); backward: receive the state's gradient from ``dst``."""

    @staticmethod
    def forward(ctx, cp: ChunkParallelContext, dst: int, tag: int, state: Tensor) -> Tensor:
        ctx.cp, ctx.dst, ctx.tag = cp, dst, tag
        ctx.shape, ctx.dtype = state.shape, state.dtype
        cp._send(state, dst, tag)
        return state.new_zeros(())

    @staticmethod
    def backward(ctx, _grad: Tensor):
        grad = ctx.cp._recv(torch.empty(ctx.shape, dtype=ctx.dtype, device=_grad.device), ctx.dst, ctx.tag)
        return None, None, None, grad


# --------------------------------------------------------------------------- math helpers


def slice_norm_stats(x: Tensor, num_groups: int, padding_mask: Tensor | None = None):
    """TimestepNorm statistics of a whole slice from a zero state: (count [B] int64, mean [B, G], var [B, G]).

    count = valid steps; mean, var = mean and population variance of the group's elements over the valid
    steps (rows without a valid step: mean 0, var 1, the initial state). Float32 (float64 for float64 x).
    """
    b, length, d = x.shape
    if d % num_groups:
        raise ValueError(f"model width D={d} is not divisible by num_groups={num_groups}")
    sdt = torch.float64 if x.dtype == torch.float64 else torch.float32
    xg = x.to(sdt).reshape(b, length, num_groups, d // num_groups)
    valid = (
        torch.ones(b, length, dtype=torch.bool, device=x.device) if padding_mask is None else ~padding_mask
    )
    count = valid.sum(1)
    if padding_mask is None:
        var, mean = torch.var_mean(xg, dim=(1, 3), unbiased=False)
        return count, mean, var
    w = valid.to(sdt)[:, :, None, None]
    elems = (count.to(sdt) * (d // num_groups)).clamp(min=1)[:, None]
    mean = (xg * w).sum((1, 3)) / elems
    var = ((xg - mean[:, None, :, None]).square() * w).sum((1, 3)) / elems
    empty = (count == 0)[:, None]
    return count, torch.where(empty, 0.0, mean), torch.where(empty, 1.0, var)


def _powers(log_q: Tensor, steps: Tensor, dtype: torch.dtype) -> Tensor:
    """q^steps = exp(steps · log q) in float64 (log_q complex128 [..., N]), returned as ``dtype``."""
    steps = steps.to(torch.float64)
    phase = torch.remainder(log_q.imag * steps, 2 * math.pi)
    out = torch.polar(torch.exp(log_q.real * steps), phase)
    return out.to(dtype)


def _h0_term(c: Tensor, log_q: Tensor, length: int) -> Tensor:
    """out[b, t, d] = Re(Σ_n c[b, d, n] q[d, n]^t), t < length, without a [D, N, L] power table:
    t = a·T + j, one batched matmul of q^(aT)-scaled c against q^j (T ≈ sqrt(L)). c = γ q h_in gives the
    h0 term Re(Σ γ q^(t+1) h_in)."""
    b, d, n = c.shape
    t = max(1, math.ceil(math.sqrt(length)))
    a = math.ceil(length / t)
    dev = c.device
    q_at = _powers(log_q.unsqueeze(1), (torch.arange(a, device=dev) * t).view(1, a, 1), c.dtype)  # [D, A, N]
    q_j = _powers(log_q.unsqueeze(-1), torch.arange(t, device=dev).view(1, 1, t), c.dtype)  # [D, N, T]
    left = (c.permute(1, 0, 2).unsqueeze(2) * q_at.unsqueeze(1)).reshape(d, b * a, n)
    out = torch.bmm(left.real, q_j.real) - torch.bmm(left.imag, q_j.imag)  # [D, B*A, T]
    return out.reshape(d, b, a * t)[..., :length].permute(1, 2, 0)


# --------------------------------------------------------------------------- model, batch and loss glue


class _SliceNorm:
    """A causal TimestepNorm whose full pass (no carried state) is this rank's slice; streaming is unchanged."""

    def forward(self, x: Tensor, state=None, padding_mask: Tensor | None = None):
        if state is None:
            return self._chunk_parallel.timestep_norm(self, x, padding_mask)
        return super().forward(x, state, padding_mask)


class _SliceCEMA:
    """A causal CEMA whose full pass (no carried state, none returned) is this rank's slice; a stream, which
    carries its state, is unchanged."""

    def forward(self, x: Tensor, h0=None, padding_mask: Tensor | None = None, return_state: bool = False):
        if h0 is None and not return_state:
            return self._chunk_parallel.cema(self, x, padding_mask, return_state)
        return super().forward(x, h0, padding_mask, return_state)


@functools.cache
def _slice_class(base: type) -> type:
    mixin = _SliceNorm if issubclass(base, TimestepNorm) else _SliceCEMA
    return float32_island()(type(f"ChunkParallel{base.__name__}", (mixin, base), {}))


def _detach(module: nn.Module) -> None:
    base = module.__dict__.pop("_chunk_parallel_base", None)
    if base is not None:
        module.__class__ = base
        del module._chunk_parallel


def is_attached(module: nn.Module) -> bool:
    return "_chunk_parallel_base" in module.__dict__


def attach(model: nn.Module, cp: ChunkParallelContext | None) -> list[nn.Module]:
    """Run every causal TimestepNorm and CEMA of ``model`` as this rank's slice under ``cp`` (None: detach)."""
    modules = [
        m
        for m in model.modules()
        if (isinstance(m, TimestepNorm) and m.causal) or (isinstance(m, ComplexEMA) and not m.bidirectional)
    ]
    if cp is not None and not modules:
        raise ValueError(f"{type(model).__name__} has no causal TimestepNorm or CEMA to run chunk-parallel")
    for m in modules:
        if cp is None:
            _detach(m)
            continue
        if not is_attached(m):
            m._chunk_parallel_base = type(m)
            m.__class__ = _slice_class(type(m))
        m._chunk_parallel = cp
    return modules


def slice_bounds(length: int, world: int, chunk_size: int, even: bool = True) -> list[tuple[int, int]]:
    """[start, stop) of each rank's slice of a sequence of ``length`` tokens, every start a multiple of C.

    even=True (training): every slice is length/P tokens, a multiple of C. even=False (one long document):
    slices of ceil(length/P) rounded up to C, the last one shorter; every rank must get a token.
    """
    if world < 1 or chunk_size < 1:
        raise ValueError(f"chunk parallelism needs world >= 1 and chunk_size >= 1, got {world}, {chunk_size}")
    if even:
        if length % (world * chunk_size):
            raise ValueError(
                f"sequence length {length} must be a multiple of chunk_parallel * chunk_size = "
                f"{world} * {chunk_size} so that every rank gets the same chunk-aligned slice"
            )
        step = length // world
    else:
        step = math.ceil(math.ceil(length / world) / chunk_size) * chunk_size
        if (world - 1) * step >= length:
            raise ValueError(
                f"a document of {length} tokens cannot give each of {world} ranks a chunk-aligned slice "
                f"(C={chunk_size}): it needs more than {(world - 1) * step} tokens"
            )
    return [(r * step, min(length, (r + 1) * step)) for r in range(world)]


def slice_batch(batch: dict, rank: int, world: int, chunk_size: int) -> dict:
    """This rank's slice of every [B, L] tensor of an LM batch (``input``, ``target``; others kept)."""
    out = dict(batch)
    length = batch["input"].shape[1]
    start, stop = slice_bounds(length, world, chunk_size)[rank]
    for key, value in batch.items():
        if isinstance(value, Tensor) and value.dim() >= 2 and value.shape[1] == length:
            out[key] = value[:, start:stop]
    return out


def global_mean_loss(nll_sum: Tensor, count: Tensor, cp: ChunkParallelContext) -> Tensor:
    """This rank's share of the mean NLL over the whole sequence: nll_sum / (tokens of all ranks).

    Summing it (and its gradients) over the group gives the full-sequence mean and its gradient. DDP and
    FSDP2 average gradients over their mesh instead of summing: over a (dp x cp) mesh, multiply this loss by
    P (or set the FSDP gradient divide factor to dp) to get the mean over the data-parallel sequences.
    """
    total = count.detach().to(torch.float64 if nll_sum.dtype == torch.float64 else torch.float32).clone()
    dist.all_reduce(total, group=cp.group)
    return nll_sum / total.clamp(min=1).to(nll_sum.dtype)


def reduce_gradients(model: nn.Module, cp: ChunkParallelContext) -> None:
    """Sum every parameter gradient over the chunk-parallel group (what DDP/FSDP over the group also does,
    up to their averaging factor)."""
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, group=cp.group)
