"""``StaticDecoder``: the one-token step on fixed buffers, for CUDA graphs and torch.compile."""

from __future__ import annotations

import types

import torch
from torch import Tensor, nn

from kernels.timestep_norm import timestep_norm_step
from mega_suite.models.megalodon.cache import StreamingCache
from mega_suite.models.megalodon.decode.decoder import Decoder
from mega_suite.models.megalodon.pack import (
    CPU_KV_BUCKET_ROWS,
    check_decode_options,
    check_row_gemv,
    compiled_step_defaults,
    cuda_row_gemv,
)
from mega_suite.models.megalodon.step import block_in, block_out


class StaticDecoder:
    """One-token decoding (logits out, no sampling) with every state in fixed buffers, so that a step has
    static shapes, reads no host value and can be captured as a CUDA graph (one launch per token instead of
    one per op) or compiled by torch.compile into a few fused loops.

        dec = StaticDecoder(decoder, cache)        # cache: the prompt's StreamingCache (decoder(prompt))
        logits = dec.step(tokens)                  # tokens [B] -> logits [B, V] float32 (a buffer: clone to keep)
        dec.load(other_cache)                      # another prompt, same batch size: graphs / compiled code kept

    The step is ``block_step``'s arithmetic (shared code) with four changes that keep shapes fixed: the CEMA
    state is (Re, Im) pairs [B, D, N, 2] and the CEMA and RoPE products real arithmetic; the chunk offset
    t = pos mod C is a device tensor (RoPE row and KV write index read from it); the new key / value are
    written into [B, C, ...] buffers at row t; attention runs over the first ``end`` rows of those buffers,
    where ``end`` is the smallest of ``buckets`` equal steps of C that covers t + 1, rows > t masked (−inf).
    ``buckets`` defaults to 8 with CUDA graphs (one graph per bucket, captured the first time it is needed,
    sharing one memory pool; a step reads at most C/8 rows more than the eager one), to C/64 for the compiled
    CPU step with bf16 keys and values (64-row steps, so that their bf16 matmul repeats its shapes: ``attend``)
    and to C otherwise (exactly t + 1 rows). ``row_gemv``: the one-row bf16 GEMV on CUDA for this decoder (a
    value of ``CUDA_ROW_GEMV``; None: compiled on CUDA ``CUDA_COMPILED_ROW_GEMV``, else the module's setting).
    ``compile``: the step through torch.compile,
    compiled in the constructor (see ``_compile``).
    ``source``: a ``Decoder`` (its packs' dtypes) or a ``MegalodonLM`` (float32 packs). The weights are read
    through the decoder's plan; the plan must not change while this lives (``step`` checks, as the eager
    path does). ``gemv``: the GEMV kind to pack for
    (``GEMV_KINDS``); None: the model's, except that compiled on the CPU a ``matmul`` or ``mkldnn`` plan is
    packed as ``rows`` (one ``torch.mv`` per GEMV, which Inductor turns into its own reduction; oneDNN's
    reordered weights cannot be compiled: Inductor wants them as graph constants). ``compile_options``:
    Inductor's options for the compile (None: ``CPU_COMPILE_OPTIONS`` on the CPU, ``CUDA_COMPILE_OPTIONS`` on
    CUDA; ``{}``: Inductor's defaults).
    """

    @torch.inference_mode(False)  # buffers are normal tensors, updatable in and out of inference
    @torch.no_grad()
    def __init__(
        self, source: Decoder | nn.Module, cache: StreamingCache, buckets: int | None = None, graphs: bool | None = None,
        compile: bool = False, row_gemv: str | None = None, gemv: str | None = None,
        compile_options: dict | None = None,
    ):  # fmt: skip
        self.row_gemv = None if row_gemv is None else check_row_gemv(row_gemv)
        if compile_options is not None and not compile:
            raise ValueError(f"compile_options needs compile=True, got {compile_options!r} without it")
        if compile_options is not None and not isinstance(compile_options, dict):
            raise ValueError(f"compile_options must be a dict of Inductor options, got {compile_options!r}")
        decoder = source if isinstance(source, Decoder) else Decoder(source)
        if not decoder.can_step():  # float64, sharded or adaptive models keep the full-pass path
            raise ValueError("StaticDecoder needs a float32, unsharded, non-adaptive MegalodonLM")
        model = decoder.model
        self.decoder, self.model, self.options = decoder, model, decoder.options
        device = model.output.final_norm.weight.device
        kind = self.options[1] if gemv is None else gemv
        check_decode_options(self.options[0], kind, device, self.options[2])
        # Compiled on the CPU, "matmul" packs are read as "rows" (W [O, I], torch.mv), which Inductor compiles
        # into vectorised reductions fused with their prologue; "mkldnn" too: Inductor wants oneDNN's
        # reordered weight as a graph constant, and the plan's is an input.
        if gemv is None and compile and device.type == "cpu" and kind in ("matmul", "mkldnn"):
            kind = "rows"
        self.plan = decoder.plan(kind)
        self.graphs = device.type == "cuda" if graphs is None else graphs
        if self.graphs and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA model; this one is on {device}")
        self.chunk = model.cfg.chunk_size
        first = cache.layers[0].kv  # the prompt's keys / values, in the dtype its pass computed them
        kdt = self.plan.kv_dtype or (first.k_buf.dtype if first is not None else torch.float32)
        if buckets is None:  # a graph per bucket on CUDA; without graphs, attend over exactly t + 1 rows,
            buckets = min(8, self.chunk) if self.graphs else self.chunk
            if compile and kdt == torch.bfloat16 and device.type == "cpu":  # or 64-row steps (``attend``)
                buckets = max(1, self.chunk // CPU_KV_BUCKET_ROWS)
        if not 1 <= buckets <= self.chunk:
            raise ValueError(f"buckets must be in [1, chunk_size={self.chunk}], got {buckets}")
        self.ends = sorted({-(-self.chunk * (i + 1) // buckets) for i in range(buckets)})
        self.batch = bsz = cache.final_norm[0].shape[0]
        self.tokens = torch.zeros(bsz, dtype=torch.long, device=device)
        self.pos_t = torch.zeros((), dtype=torch.long, device=device)
        self.rows = torch.arange(self.chunk, device=device)
        self.layers = []
        for pk, lc in zip(self.plan.blocks, cache.layers):
            norm = tuple(torch.empty_like(t) for t in lc.norm)
            # The CEMA state as (Re, Im) pairs [B, D, N, 2]: real arithmetic throughout
            cema = pk.q_ri.new_zeros(bsz, *pk.q_ri.shape)
            k_buf = torch.zeros(bsz, self.chunk, pk.h, pk.zd, dtype=kdt, device=device)
            v_buf = torch.zeros(bsz, self.chunk, pk.h, pk.e // pk.h, dtype=kdt, device=device)
            self.layers.append((norm, cema, k_buf, v_buf))
        self.final_norm = tuple(torch.empty_like(t) for t in cache.final_norm)
        self.load(cache)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, Tensor]] = {}  # end -> (graph, its logits)
        self._pool = None
        if compile:
            if self.chunk < 2:
                raise ValueError("compile=True needs chunk_size >= 2")
            self.ends = sorted({max(e, 2) for e in self.ends})
            self.row_gemv, compile_options = compiled_step_defaults(
                device.type, self.row_gemv, compile_options
            )
            with cuda_row_gemv(self.row_gemv):
                self._step = self._compile(compile_options)
        else:
            self._step = lambda end: self._step_rows(self.rows[:end])

    @torch.inference_mode(False)
    @torch.no_grad()
    def load(self, cache) -> StaticDecoder:
        """Continue from ``cache`` (another prompt's, same batch size): its state is copied into the fixed
        buffers, so the compiled step and the captured graphs are kept."""
        if cache.window_stats:
            raise ValueError(
                "StaticDecoder does not support window_stats caches (per-chunk host bookkeeping)"
            )
        bsz = cache.final_norm[0].shape[0]
        if bsz != self.batch:
            raise ValueError(f"this decoder holds batch size {self.batch}; the cache has {bsz}")
        if len(cache.layers) != len(self.layers):
            raise ValueError(
                f"this decoder holds {len(self.layers)} layers; the cache has {len(cache.layers)}"
            )
        kdt = self.layers[0][2].dtype
        mixed = any(lc.kv is not None and lc.kv.k_buf.dtype != kdt for lc in cache.layers)
        if mixed and self.plan.kv_dtype is None:  # with a kv_dtype, the cache's are converted (copy_)
            raise ValueError(
                f"this decoder keeps keys / values in {kdt}; the cache's differ (build a new one)"
            )
        self.position = cache.position
        for (norm, cema, k_buf, v_buf), lc in zip(self.layers, cache.layers):
            for buf, t in zip(norm, lc.norm):
                buf.copy_(t)
            cema.zero_() if lc.cema is None else cema.copy_(torch.view_as_real(lc.cema))
            k_buf.zero_()
            v_buf.zero_()
            if lc.kv is not None:
                n = lc.kv.length
                k_buf[:, :n], v_buf[:, :n] = lc.kv.keys, lc.kv.values
        for buf, t in zip(self.final_norm, cache.final_norm):
            buf.copy_(t)
        return self

    def _buffers(self) -> list[Tensor]:
        out = [self.pos_t, *self.final_norm]
        for norm, cema, k_buf, v_buf in self.layers:
            out += [*norm, cema, k_buf, v_buf]
        return out

    def _step_rows(self, rows: Tensor) -> Tensor:
        """One token from ``self.tokens`` at ``self.pos_t``, attending over ``rows`` = [0, end) of the chunk's
        key / value buffers; updates every state buffer in place. Called without autograd (``step``)."""
        end = rows.shape[0]
        offset = torch.remainder(self.pos_t, self.chunk).view(1)
        mask = rows > offset  # rows not yet written in this chunk
        with torch.autocast(self.tokens.device.type, enabled=False):
            x = self.model.embed_tokens(self.tokens).float()
            for pk, (norm, cema, k_buf, v_buf) in zip(self.plan.blocks, self.layers):
                q, k, v, r, h1, new_norm, new_cema = block_in(
                    pk, x, norm, cema, pk.rope_ri.index_select(0, offset)
                )
                for buf, new in zip(norm, new_norm):
                    buf.copy_(new)
                cema.copy_(new_cema)
                k_buf.index_copy_(1, offset, k.to(k_buf.dtype))
                v_buf.index_copy_(1, offset, v.to(v_buf.dtype))
                keys, values = k_buf[:, :end], v_buf[:, :end]
                x = block_out(pk, x, q, keys, values, mask, r, h1)
            plan = self.plan
            y, final = timestep_norm_step(
                x, self.final_norm, plan.final_w1, plan.final_b, plan.final_groups, plan.final_eps
            )
            for buf, new in zip(self.final_norm, final):
                buf.copy_(new)
            return plan.head(y)

    def _compile(self, options: dict | None):
        """torch.compile of ``_step_rows``: Inductor fuses the elementwise ops of a block into a few C++ loops
        (the CEMA and RoPE products are real arithmetic so that it can); each ``torch.mv`` GEMV ("rows" packs,
        bf16 and on the CPU float32 too) becomes a reduction fused with its prologue (norm, SiLU, casts): C++
        on the CPU, Triton on CUDA; ``x @ Wᵀ`` ("matmul" packs, a batch) stays a BLAS call. Compiled
        here, on saved-and-restored state, with the attended length dynamic (at least 2: Dynamo specialises
        a length of 1, so offset 0 attends over two rows, the second masked), so that the decoding loop never
        recompiles: one graph, or two where the batched attention's reshapes specialise the full chunk
        (warmed up on a middle length below C and on C). Every call enters the same grad / autocast state
        (a guard). After the warm-up, calls skip Dynamo's guard evaluation except what tells its graphs
        apart (``skip_guard_eval_unsafe``, a measurable share of a CPU step). That is safe here
        because a graph reads only this decoder's own buffers, never replaced or reshaped, and the plan's
        tensors, whose staleness ``step`` checks before every call. ``options``: Inductor's (None: the
        device's, ``compiled_step_defaults``)."""
        # Dynamo keeps compiled graphs per code object: a copy of the step's code per decoder gives each
        # decoder its own cache (static weight shapes, one guard set to check, no shared recompile limit).
        fn = StaticDecoder._step_rows
        own = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__)
        device = self.rows.device.type
        options = compiled_step_defaults(device, None, options)[1]
        how = {"options": options} if options else {}
        compiled = torch.compile(types.MethodType(own, self), fullgraph=True, **how)

        warm = False

        def run(end: int) -> Tensor:  # the same global state (grad mode, autocast) at every call
            rows = self.rows[:end]
            torch._dynamo.maybe_mark_dynamic(rows, 0)
            with torch.no_grad(), torch.autocast(device, enabled=False):
                with torch.compiler.set_stance("default", skip_guard_eval_unsafe=warm):
                    return compiled(rows)

        saved = [t.clone() for t in self._buffers()]
        below = [e for e in self.ends if e < self.chunk]
        try:
            for end in below[len(below) // 2 :][:1] + [self.chunk]:
                run(end)
        except Exception as err:  # e.g. no C++ compiler for Inductor's CPU code
            raise RuntimeError(
                f"torch.compile of the decode step failed ({type(err).__name__}: {err}); "
                "decode without it: compile=False"
            ) from err
        finally:
            for t, s in zip(self._buffers(), saved):
                t.copy_(s)
        warm = True
        return run

    def _capture(self, end: int) -> tuple[torch.cuda.CUDAGraph, Tensor]:
        """Warm up (cuBLAS handles, allocator) on a side stream with the state saved and restored, then
        capture one step into a graph that shares the decoder's memory pool."""
        saved = [t.clone() for t in self._buffers()]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self._step(end)
        torch.cuda.current_stream().wait_stream(side)
        for t, s in zip(self._buffers(), saved):
            t.copy_(s)
        del saved
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = self._step(end)
        self._pool = graph.pool()
        return graph, logits

    @torch.inference_mode(False)  # one global state for the compiled step, whatever the caller's
    @torch.no_grad()
    def step(self, tokens: Tensor) -> Tensor:
        """tokens [B] (the next token of every row) -> logits [B, V] float32 of the position after them."""
        if self.decoder.options != self.options or not self.plan.is_current(self.model, *self.plan.options):
            raise RuntimeError(
                "the model's decode weights changed (a parameter update, or Decoder.set_weights) since this "
                "StaticDecoder was built; build a new one"
            )
        offset = self.position % self.chunk
        end = next(e for e in self.ends if e > offset)
        self.tokens.copy_(tokens, non_blocking=True)
        self.pos_t.fill_(self.position)
        with cuda_row_gemv(self.row_gemv):  # the same choice at every trace, capture and guard check
            if self.graphs:
                if end not in self._graphs:
                    self._graphs[end] = self._capture(end)
                graph, logits = self._graphs[end]
                graph.replay()
            else:
                logits = self._step(end)
        self.position += 1
        return logits
