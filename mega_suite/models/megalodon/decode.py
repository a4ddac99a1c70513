"""The one-token decode step (issue 15): packed weights, folded constants, few ops.

A decode step reads every weight once per token; its floor is one GEMV over all of them. ``DecodePlan``
packs each block's Linear weights by the input they read, so a block runs five GEMVs instead of eight:

    m  -> [W_z | W_r | W_h1]      (the RMS-normalised CEMA output)
    x̂  -> W_v                     (the TimestepNorm output)
    o ⊙ r -> W_h2                 (added onto the m-pack's W_h1 part)
    u  -> [fc1 | fc3]             (the LayerNorm output)
    a  -> fc2                     (layer scale folded in, the block's residual X added by the GEMV)

and folds the norms' affine maps into the weights they feed, W (n ⊙ (1 + w) + b) = (W diag(1 + w)) n + W b,
so RMSNorm and LayerNorm become one unaffine op each. The (1 + γ)/sqrt(Z/h) Q/K scale, β, the RoPE table
and the CEMA coefficients (p, q, γ) are computed once per plan. The plan is rebuilt when any parameter
changes (its key holds every parameter's storage pointer and version counter), so no step ever reads
weights older than the model's.

Weights: float32, bfloat16 (activations cast to bf16 at each GEMV, accumulated and returned in float32) or
int8 weight-only (per-output-row scales, ``aten._weight_int8pack_mm`` with bf16 activations). Kernels for
float32 / bfloat16: ``matmul`` (float32: x @ Wᵀ with Wᵀ stored contiguous, read row by row; bfloat16:
``torch.mv`` over W [O, I] for one row), ``rows`` (W [O, I], ``torch.mv`` for one row in float32 too: what
the compiled CPU step reads, see ``StaticDecoder``) or ``mkldnn`` (oneDNN's linear with the weight reordered
once, ``mkldnn._linear_pointwise``; CPU only).

``StaticDecoder`` runs the same step on fixed buffers, for CUDA graphs and for ``torch.compile`` (the CEMA
and RoPE products in real arithmetic there, so that Inductor fuses a block's elementwise ops into a few
loops, and float32 GEMVs packed as ``rows`` on the CPU): on a 2-core CPU it is the fastest path, 1.0x the
fp32 weight-read floor 64 tokens into a chunk and 1.2x at 512 (bench/RESULTS.md §27).
"""

from __future__ import annotations

import contextlib
import functools
import math
import types

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kernels import gemv

WEIGHT_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.int8: "int8"}
GEMV_KINDS = ("matmul", "rows", "mkldnn")
KV_DTYPES = (None, torch.float32, torch.bfloat16)  # None: the keys / values kept as computed
CPU_KV_BUCKET_ROWS = 64  # the compiled CPU step's attended lengths with bf16 keys / values (``attend``)
# Inductor options of the compiled CPU step (``StaticDecoder``): a pointwise result is materialised once
# rather than inlined into the reduction that reads it (``realize_opcount_threshold``: 30 ops by default).
# With the default, a GEMV's reduction recomputed its input -- the final TimestepNorm's, in float64 --
# for every output row (the head's loop was scalar); with 1, 0.4-0.8 ms less per token at
# ``megalodon_cpu_bench`` (float32 and bf16, 64-1536 tokens into a chunk, bench/RESULTS.md §27).
CPU_COMPILE_OPTIONS = {"realize_opcount_threshold": 1}
# The compiled CUDA step's defaults: the one-row GEMV (a value of ``CUDA_ROW_GEMV``) and Inductor's options.
# H100, megalodon_7b, bf16 weights, the CUDA graph of the compiled step, ms per token (x the HBM copy floor)
# side by side in one process (bench/GPU_RESULTS.md, third lease; one run each): "triton" with the option
# 7.44 (1.50x), "cublas" 7.69 / 7.79 with it, "triton" alone 7.97; in another run "mv" 8.75, with the option
# 8.12. The option helped "mv" and "triton" by 7% each, as on the CPU.
CUDA_COMPILED_ROW_GEMV = "triton"
CUDA_COMPILE_OPTIONS = {"realize_opcount_threshold": 1}


def mkldnn_available(device: torch.device) -> bool:
    return device.type == "cpu" and torch.backends.mkldnn.is_available() and hasattr(torch.ops, "mkldnn")


# One-row bf16 GEMV on CUDA (``Gemv``, kind "rows"):
# - "mv": torch.mv; under torch.compile Inductor rewrites it as its own Triton reduction fused with the
#   prologue (norm, SiLU, cast). H100, 7B, compiled graph: 8.39 ms per token, the GEMVs at ~2.1 TB/s;
# - "mm": x @ Wᵀ, a cuBLAS GEMM that Inductor keeps as an extern call: 8.40 ms (GPU_RESULTS.md);
# - "cublas": torch.mv behind the custom op ``mega_suite::mv`` (kernels.gemv), so that Inductor keeps the
#   cuBLAS GEMV (read at ~2.5 TB/s in the uncompiled graph) and fuses only the ops around it;
# - "triton": ``kernels.gemv``'s autotuned kernel (``mega_suite::row_gemv``), bias and residual in its
#   epilogue.
# Compiled and captured (bench/decode_gpu.py --gemv mv,cublas,triton), "triton" was the fastest: see
# ``CUDA_COMPILED_ROW_GEMV``, what a compiled StaticDecoder uses unless told. Eager decoding keeps "mv" (the
# others not measured eagerly). Read when a step is traced or captured (torch.compile guards on it); a
# StaticDecoder sets its own choice around its own compile, captures and steps (``cuda_row_gemv``).
CUDA_ROW_GEMV = "mv"
CUDA_ROW_GEMVS = ("mv", "mm", "cublas", "triton")


def _check_row_gemv(kind: str) -> str:
    if kind not in CUDA_ROW_GEMVS:
        raise ValueError(f"CUDA_ROW_GEMV must be one of {CUDA_ROW_GEMVS}, got {kind!r}")
    return kind


@contextlib.contextmanager
def cuda_row_gemv(kind: str | None):
    """``CUDA_ROW_GEMV = kind`` inside the ``with`` block (None: unchanged)."""
    global CUDA_ROW_GEMV
    if kind is None:
        yield
        return
    previous, CUDA_ROW_GEMV = CUDA_ROW_GEMV, _check_row_gemv(kind)
    try:
        yield
    finally:
        CUDA_ROW_GEMV = previous


def compiled_step_defaults(device_type: str, row_gemv: str | None, options: dict | None):
    """(one-row GEMV, Inductor options) of a compiled ``StaticDecoder`` on ``device_type`` where its
    arguments leave them None: on CUDA ``CUDA_COMPILED_ROW_GEMV`` and ``CUDA_COMPILE_OPTIONS``, on the CPU
    None (the module's ``CUDA_ROW_GEMV``, unused there) and ``CPU_COMPILE_OPTIONS``; Inductor's defaults
    elsewhere (measured on neither)."""
    if device_type == "cuda":
        return row_gemv or CUDA_COMPILED_ROW_GEMV, CUDA_COMPILE_OPTIONS if options is None else options
    if options is None:
        options = CPU_COMPILE_OPTIONS if device_type == "cpu" else {}
    return row_gemv, options


def _row_gemv_kind(x: Tensor) -> str:
    """The one-row bf16 GEMV for ``x``'s device: ``CUDA_ROW_GEMV`` on CUDA, ``torch.mv`` on the CPU."""
    return _check_row_gemv(CUDA_ROW_GEMV) if x.is_cuda else "mv"


class Gemv:
    """y = x Wᵀ + b (+ add) for x [B, I] float32 -> [B, O] float32, with W stored for one kernel.

    ``weight`` [O, I] and ``bias`` [O] (or None) are float32 (already folded); the stored copy is the only
    one read at decode time: float32 ``matmul`` as Wᵀ [I, O] or, for I > O, W [O, I] (``x @ Wᵀ`` either
    way: BLAS), float32 ``rows`` and bfloat16 as W [O, I] (``torch.mv`` for one row: the faster bf16 layout
    here, and the one Inductor compiles into its own reduction; on CUDA see ``CUDA_ROW_GEMV``), int8 as
    W [O, I] with per-row scales, or oneDNN's reordered blocks.
    """

    def __init__(self, weight: Tensor, bias: Tensor | None, dtype: torch.dtype, kind: str):
        self.bias, self.dtype, self.kind = bias, dtype, kind
        self.out_features = weight.shape[0]
        if dtype == torch.int8:
            scale = weight.abs().amax(1).clamp(min=1e-12) / 127  # symmetric, one scale per output row
            self.w = (weight / scale[:, None]).round().clamp(-127, 127).to(torch.int8).contiguous()
            self.scale = scale.to(torch.bfloat16)
            self.kind = "int8pack"
        elif kind == "mkldnn":
            self.w = torch.ops.mkldnn._reorder_linear_weight(weight.to(dtype).contiguous(), 1)
            self.mk_bias = None if bias is None or dtype != torch.float32 else bias
        elif dtype == torch.bfloat16 or kind == "rows":
            # [O, I], read by torch.mv for one row: bf16 x @ Wᵀ-stored reads 1.3x slower than mv on this
            # CPU's AVX512-BF16 (bench/RESULTS.md §13, floors "bf16 mv" against "bf16 mv Wᵀ"). float32
            # "rows": under torch.compile on the CPU, torch.mv becomes Inductor's own vectorised dot products
            # (27 GB/s) where BLAS over either layout read 19 (bench/RESULTS.md §27)
            self.w = weight.to(dtype).contiguous()
            self.kind = "rows"
        else:
            # x @ Wᵀ reads W as rows: of Wᵀ [I, O] (y accumulates x_i times row i) where I <= O, of W [O, I]
            # (one dot product per output) where I > O -- the longer rows stream faster through this CPU's
            # BLAS: [1024 -> 512] 16 vs 13 GB/s stored [O, I], [512 -> 2048] 21 vs 10 GB/s stored [I, O]
            # (1 thread, cold, bench/RESULTS.md §19)
            self.dot = weight.shape[1] > weight.shape[0]
            self.w = (weight if self.dot else weight.t()).to(dtype).contiguous()

    def __call__(self, x: Tensor, add: Tensor | None = None) -> Tensor:
        """x [B, I] float32 -> [B, O] float32; ``add`` [B, O] is added (a residual folded into the GEMV)."""
        bias = self.bias
        if self.dtype == torch.float32 and self.kind == "rows":
            y = torch.mv(self.w, x[0])[None] if x.shape[0] == 1 else x @ self.w.t()
            if bias is not None:
                y = y.add_(bias)
            return y if add is None else y.add_(add)
        if self.dtype == torch.float32:
            if self.kind == "mkldnn":
                y = torch.ops.mkldnn._linear_pointwise(x, self.w, self.mk_bias, "none", [], "")
                return y if add is None else y.add_(add)
            if add is not None:
                bias = add if bias is None else add + bias
            wt = self.w.t() if self.dot else self.w  # Wᵀ [I, O], a view either way
            return x @ wt if bias is None else torch.addmm(bias, x, wt)
        one_row = x.shape[0] == 1 and self.kind == "rows"
        if one_row and _row_gemv_kind(x) == "triton":  # the rounding to bf16, bias and add in the kernel
            return gemv.row_gemv(self.w, x[0], bias, None if add is None else add[0])[None]
        xl = x.to(torch.bfloat16)
        if self.kind == "int8pack":
            y = torch.ops.aten._weight_int8pack_mm(xl, self.w, self.scale)
        elif self.kind == "mkldnn":
            y = torch.ops.mkldnn._linear_pointwise(xl, self.w, None, "none", [], "")
        else:  # "rows": W [O, I]
            row_kind = _row_gemv_kind(xl)
            if one_row and row_kind == "cublas":
                y = gemv.mv(self.w, xl[0])[None]
            elif one_row and row_kind != "mm":
                y = torch.mv(self.w, xl[0])[None]
            else:
                y = xl @ self.w.t()
        y = y.float()
        if bias is not None:
            y = y.add_(bias)
        return y if add is None else y.add_(add)


class BlockPack:
    """One block's decode constants and packed weights (see the module docstring)."""

    def __init__(self, block: nn.Module, dtype: torch.dtype, kind: str, kv_dtype: torch.dtype | None = None):
        self.kv_dtype = kv_dtype  # the chunk's keys / values stored in this dtype (None: as computed)
        att, ffn = block.mega, block.nffn
        cfg = att.cfg
        d, z, e, h = cfg.model_dim, cfg.z_dim, cfg.value_dim, cfg.num_heads
        zd = z // h
        self.d, self.z, self.e, self.h, self.zd = d, z, e, h, zd
        self.groups, self.eps, self.chunk = att.timenorm.num_groups, cfg.norm_eps, cfg.chunk_size
        self.ln_eps = ffn.norm.eps
        self.tn_w1 = 1 + att.timenorm.weight.float()
        self.tn_b = att.timenorm.bias.float()
        p, q, gamma = att.cema.coefficients()
        self.p, self.q = p, q  # [D, N]: p real, q complex
        self.gamma_c = gamma.conj().resolve_conj()  # vecdot(a, h) = Σ conj(a) h, so this gives Σ γ h
        self.q_ri, self.gamma_ri = torch.view_as_real(q).contiguous(), torch.view_as_real(gamma).contiguous()
        self.omega = att.cema.omega.squeeze(-1).float()
        rms = 1 + att.rmsnorm.weight.float()  # folded into the three GEMVs that read m
        self.rms_eps_t = torch.tensor(att.rmsnorm.eps, device=rms.device)
        self.eps_t = torch.tensor(cfg.norm_eps, device=rms.device)
        w_m = torch.cat([att.wz.weight, att.wr.weight, att.wh1.weight]).float() * rms
        b_m = torch.cat([att.wz.bias, att.wr.bias, att.wh1.bias]).float()
        self.gemv_m = Gemv(w_m, b_m, dtype, kind)
        self.gemv_v = Gemv(att.wv.weight.float(), att.wv.bias.float(), dtype, kind)
        self.gemv_h2 = Gemv(att.wh2.weight.float(), None, dtype, kind)
        self.qk_scale = ((1 + att.gamma.float()) / math.sqrt(zd)).view(2, 1, h, zd)
        self.qk_beta = att.beta.float().view(2, 1, h, zd)
        self.rope = _rope_table(zd, cfg.rope_base, cfg.chunk_size, att.gamma.device)
        self.rope_ri = torch.view_as_real(self.rope)  # [C, zd/2, 2] (cos, sin)
        ln_w1, ln_b = 1 + ffn.norm.weight.float(), ffn.norm.bias.float()
        w13 = ffn.fc1.weight if ffn.fc3 is None else torch.cat([ffn.fc1.weight, ffn.fc3.weight])
        w13 = w13.float()
        self.swiglu = ffn.fc3 is not None
        self.ffn_dim = ffn.fc1.out_features
        self.gemv_13 = Gemv(w13 * ln_w1, w13 @ ln_b, dtype, kind)
        w2 = ffn.fc2.weight.float()
        if ffn.alpha is not None:
            w2 = w2 * ffn.alpha.float()[:, None]
        self.gemv_2 = Gemv(w2, None, dtype, kind)


# Events after which a parameter object may have been replaced: a parameter or module registered in this
# process (any module: global torch.nn hooks, since a replacement registers through the module that holds
# it, not through the model, and needs no forward pass), and every full pass of a model with a cache
# (``parameters_may_have_changed``). A decode plan re-lists its model's parameter objects when this moved.
_CHANGES = [0]


def parameters_may_have_changed(*_args) -> None:
    _CHANGES[0] += 1


torch.nn.modules.module.register_module_parameter_registration_hook(parameters_may_have_changed)
torch.nn.modules.module.register_module_module_registration_hook(parameters_may_have_changed)


class DecodePlan:
    """Packed weights for every block and the head, and the key of the parameters they were built from."""

    def __init__(self, model: nn.Module, dtype: torch.dtype, kind: str, kv_dtype: torch.dtype | None = None):
        self.options = (dtype, kind, kv_dtype)
        self.kv_dtype = kv_dtype
        self.params = list(model.parameters())
        self.key = self.current_key()
        self.changes = _CHANGES[0]  # at the last comparison of the parameter objects
        self.blocks = [BlockPack(layer, dtype, kind, kv_dtype) for layer in model.layers]
        head = model.output.output
        self.head = Gemv(head.weight.float(), None, torch.float32, kind)  # float32 logits, whatever the dtype
        fn = model.output.final_norm
        self.final_w1, self.final_b = 1 + fn.weight.float(), fn.bias.float()
        self.final_groups, self.final_eps = fn.num_groups, fn.eps
        self._one_buffer()

    def _one_buffer(self) -> None:
        """Move the packed weights into one buffer per dtype, in the order a step reads them (the next
        GEMV's weights start where the last one's ended): 2-4% less time per token than separate
        allocations (fp32, 1 thread, bench/RESULTS.md §9)."""
        order = [g for b in self.blocks for g in (b.gemv_m, b.gemv_v, b.gemv_h2, b.gemv_13, b.gemv_2)]
        gemvs = [g for g in order + [self.head] if g.kind in ("matmul", "int8pack", "rows")]
        by_dtype = {}
        for g in gemvs:
            by_dtype.setdefault(g.w.dtype, []).append(g)
        for dtype, group in by_dtype.items():
            flat = torch.empty(sum(g.w.numel() for g in group), dtype=dtype, device=group[0].w.device)
            start = 0
            for g in group:
                n = g.w.numel()
                flat[start : start + n].copy_(g.w.reshape(-1))
                g.w = flat[start : start + n].view(g.w.shape)
                start += n

    def current_key(self) -> tuple:
        """Storage pointer and version counter of every parameter packed: an in-place update (optimizer
        step, ``load_state_dict``) bumps the version, a conversion (``to``) moves the storage."""
        return tuple((p.data_ptr(), p._version) for p in self.params)

    def is_current(
        self, model: nn.Module, dtype: torch.dtype, kind: str, kv_dtype: torch.dtype | None = None
    ) -> bool:
        """Whether the packs still hold the model's weights. The list of parameter objects (a parameter or a
        module replaced by a new one: ``load_state_dict(assign=True)``, ``module.weight = Parameter(...)``)
        is compared only when a parameter or module was registered anywhere, or a model ran a full pass,
        since the last comparison (``_CHANGES``): listing them costs more than the version check, at every
        token."""
        if self.options != (dtype, kind, kv_dtype):
            return False
        changes = _CHANGES[0]
        if self.changes != changes:
            current = list(model.parameters())
            if len(current) != len(self.params) or any(a is not b for a, b in zip(current, self.params)):
                return False
            self.changes = changes
        return self.key == self.current_key()


def check_decode_options(
    dtype: torch.dtype, kind: str, device: torch.device, kv_dtype: torch.dtype | None = None
) -> None:
    if not any(kv_dtype is d for d in KV_DTYPES):
        raise ValueError(f"decode kv_dtype must be one of {list(KV_DTYPES)}, got {kv_dtype!r}")
    if dtype not in WEIGHT_DTYPES:
        raise ValueError(f"decode weight dtype must be one of {list(WEIGHT_DTYPES.values())}, got {dtype}")
    if kind not in GEMV_KINDS:
        raise ValueError(f"decode gemv must be one of {GEMV_KINDS}, got {kind!r}")
    if kind == "mkldnn" and not mkldnn_available(device):
        raise ValueError(f"decode gemv 'mkldnn' needs a CPU build with oneDNN; the model is on {device}")


def timestep_norm_step(
    x: Tensor, state: tuple[Tensor, Tensor, Tensor], w1: Tensor, b: Tensor, groups: int, eps: float
) -> tuple[Tensor, tuple[Tensor, Tensor, Tensor]]:
    """One TimestepNorm step (SPEC §3), statistics in float64: with n = n₀ + 1, δ = μ_t − M,
    M' = M + δ/n and V' = (n₀/n) V + σ²_t/n + (n₀/n²) δ² = V + (σ²_t − V)/n + (δ/n)(δ − δ/n);
    y = (x − M') / sqrt(V' + eps) · (1 + w) + b. x [B, D]."""
    count0, mean0, var0 = state
    bsz, d = x.shape
    xd = x.view(bsz, groups, d // groups).double()
    var_t, mu_t = torch.var_mean(xd, dim=-1, unbiased=False, keepdim=True)  # [B, G, 1]; serial (tiny)
    count = count0 + 1
    inv_n = count.double().reciprocal().view(bsz, 1, 1)
    delta = mu_t - mean0.unsqueeze(-1)
    step = delta * inv_n
    mean = mean0.unsqueeze(-1) + step
    var0 = var0.unsqueeze(-1)
    var = torch.addcmul(torch.addcmul(var0, var_t - var0, inv_n), step, delta - step)
    y = ((xd - mean) * torch.rsqrt(var + eps)).view(bsz, d).float()
    return torch.addcmul(b, y, w1), (count, mean.view(bsz, groups).float(), var.view(bsz, groups).float())


def rms_scale(x: Tensor, eps_t: Tensor, n: int) -> Tensor:
    """1 / sqrt(mean(x²) + eps) over the last dim, as rsqrt(eps + ‖x‖²/n) (one reduction: a norm)."""
    norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
    return torch.rsqrt(torch.addcmul(eps_t, norm, norm, value=1.0 / n))


def _block_in(pk: BlockPack, x: Tensor, norm_state, cema_state: Tensor | None, rope_row: Tensor):
    """The first half of a block's step, up to the new token's q, k, v: SPEC §2-§4 with the folded packs.
    ``rope_row`` is the RoPE rotation of the token's chunk offset, [..., zd/2] complex or (cos, sin) pairs
    [..., zd/2, 2]; ``cema_state`` [B, D, N] complex, (Re, Im) pairs [B, D, N, 2] (real arithmetic,
    ``_cema_real``; the new state comes back in the same form) or None (zeros). Returns
    (q, k [B, 1, h, zd], v [B, 1, h, E/h], r [B, E], m W_h1 + b_h1 [B, D], norm state, CEMA state)."""
    bsz, h, zd, z, e = x.shape[0], pk.h, pk.zd, pk.z, pk.e
    x_hat, norm_state = timestep_norm_step(x, norm_state, pk.tn_w1, pk.tn_b, pk.groups, pk.eps)
    px = pk.p * x_hat.unsqueeze(-1)
    if cema_state is not None and not cema_state.is_complex():  # [B, D, N, 2]: (Re, Im), see below
        cema_out, state = _cema_real(pk, px, x_hat, cema_state)
    else:
        state = px.to(pk.q.dtype) if cema_state is None else torch.addcmul(px, pk.q, cema_state)  # p x + q h
        cema_out = torch.addcmul(torch.linalg.vecdot(pk.gamma_c, state).real, pk.omega, x_hat)
    m = cema_out * rms_scale(cema_out, pk.rms_eps_t, pk.d)  # (1 + w) is in the m-pack's weights
    zrh = pk.gemv_m(m)  # [B, Z + E + D]: z, r, and m W_h1 + b_h1
    zh = zrh[:, :z].view(bsz, h, zd)
    qk = torch.addcmul(pk.qk_beta, zh, rms_scale(zh, pk.eps_t, zd) * pk.qk_scale)  # [2, B, h, zd]
    qk = qk.view(2, bsz, h, zd // 2, 2)
    if rope_row.is_complex():
        qk = torch.view_as_real(torch.view_as_complex(qk) * rope_row)
    else:  # (a + ib)(c + is) on (Re, Im) pairs
        a, b = qk.unbind(-1)
        c, s = rope_row.unbind(-1)
        qk = torch.stack((a * c - b * s, a * s + b * c), -1)
    qk = qk.view(2, bsz, 1, h, zd)
    v = F.silu(pk.gemv_v(x_hat)).view(bsz, 1, h, e // h)
    r = F.silu(zrh[:, z : z + e])
    return qk[0], qk[1], v, r, zrh[:, z + e :], norm_state, state


def _cema_real(pk: BlockPack, px: Tensor, x_hat: Tensor, state: Tensor) -> tuple[Tensor, Tensor]:
    """The CEMA step h' = p x + q h, y = Re(Σ_n γ_n h'_n) + ω x in real arithmetic on (Re, Im) pairs
    [B, D, N, 2] (compilers without complex support fuse it): with q = a + ib, γ = c + id,
    Re h' = p x + a Re h − b Im h, Im h' = a Im h + b Re h, Re(γ h') = c Re h' − d Im h'."""
    hr, hi = state.unbind(-1)
    a, b = pk.q_ri.unbind(-1)
    new_r = px + a * hr - b * hi
    new_i = a * hi + b * hr
    c, d = pk.gamma_ri.unbind(-1)
    y = (c * new_r - d * new_i).sum(-1) + pk.omega * x_hat
    return y, torch.stack((new_r, new_i), -1)


def attend(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor | None) -> Tensor:
    """softmax(q kᵀ) v of one query per row: q [B, 1, h, zd] float32 (scaled), keys [B, n, h, zd], values
    [B, n, h, E/h], ``mask`` [n] bool (True = a row not yet written: −inf) or None -> [B, h, 1, E/h] float32.

    Keys and values stored in bf16 (``kv_dtype``, or a prompt run under autocast) on the CPU: never a bf16
    matmul over a length that changes at every token -- oneDNN builds a kernel for every new shape (0.5-1.5 ms
    per product instead of 0.03-0.15 ms; ``python -m bench.kv_attention``, bench/RESULTS.md §25). Eager, the
    keys and values are cast and go to float32 BLAS. Compiled (``StaticDecoder``, whose CPU buckets make n
    one of C/64 lengths: multiples of 64 where 64 divides C), the scores are float32 reductions into which
    Inductor fuses the bf16 loads, and for one row and one head softmax(·) v is a bf16 matmul over the
    bucketed length (oneDNN reuses its kernel; accumulated in float32, the probabilities and the result
    rounded to bf16, relative 2⁻⁹: as the values themselves, and as the next GEMV rounds its input with bf16
    weights); batched, a float32 reduction too. (That branch assumes bucketed lengths: compiling the eager
    ``block_step``, whose n grows by one per token, would bring back the per-shape kernel builds.) On CUDA
    the query is rounded to the keys' dtype instead (cuBLAS, float32 accumulation).
    """
    if keys.dtype != q.dtype:
        if keys.device.type != "cpu":
            q = q.to(keys.dtype)
        elif torch.compiler.is_compiling():
            scores = (keys.float() * q).sum(-1).transpose(1, 2).unsqueeze(2)  # [B, h, 1, n] float32
            if mask is not None:
                scores = scores.masked_fill(mask, float("-inf"))
            probs = torch.softmax(scores, -1)
            if keys.shape[0] * keys.shape[2] == 1:  # a 2-D product: oneDNN's (as below)
                probs = probs.view(1, -1).to(values.dtype)
                return (probs @ values.view(values.shape[1], -1)).float().view(1, 1, 1, -1)
            # batched: Inductor decomposes a one-row bf16 bmm into bf16 arithmetic (4 ulps off); reductions
            return (probs.squeeze(2).transpose(1, 2).unsqueeze(-1) * values.float()).sum(1).unsqueeze(2)
        else:
            keys, values = keys.to(q.dtype), values.to(q.dtype)
    bsz, n, h, zd = keys.shape
    if bsz * h == 1:  # 2-D GEMVs: torch.compile keeps them BLAS calls, a one-row bmm it lowers to a loop
        scores = q.reshape(1, zd) @ keys.reshape(n, zd).t()
        if mask is not None:
            scores = scores.masked_fill(mask, float("-inf"))
        return (torch.softmax(scores, -1) @ values.reshape(n, -1)).float().view(1, 1, 1, -1)
    scores = torch.matmul(q.transpose(1, 2), keys.permute(0, 2, 3, 1))  # [B, h, 1, n]
    if mask is not None:
        scores = scores.masked_fill(mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, -1), values.transpose(1, 2)).float()


def _block_out(
    pk: BlockPack, x: Tensor, q: Tensor, keys: Tensor, values: Tensor, mask, r: Tensor, h1: Tensor
):
    """The second half: softmax(q kᵀ) v over the chunk's keys [B, n, h, zd] (``mask`` [n] True = not yet
    written, or None), the gate, the W_h2 GEMV onto m W_h1 + b_h1, the residual, then the FFN."""
    bsz = x.shape[0]
    o = attend(q, keys, values, mask)  # [B, h, 1, E/h]
    y = pk.gemv_h2((o.view(bsz, pk.e) * r), add=h1).add_(x)  # H + X
    u = F.layer_norm(y, (pk.d,), None, None, pk.ln_eps)
    g = pk.gemv_13(u)
    a = F.silu(g[:, : pk.ffn_dim]) * g[:, pk.ffn_dim :] if pk.swiglu else F.silu(g)
    return pk.gemv_2(a, add=x)


def block_step(pk: BlockPack, x: Tensor, cache, pos: int):
    """One block, one token: x [B, D] float32 at absolute position ``pos`` -> (X + FFN(LN(H + X)), cache).
    The equations of ``MegalodonBlock.forward`` with a cache (SPEC §1-§4, §7)."""
    from mega_suite.models.megalodon.model import ChunkKV, LayerCache

    offset = pos % pk.chunk
    q, k, v, r, h1, norm_state, state = _block_in(pk, x, cache.norm, cache.cema, pk.rope[offset])
    if cache.kv is None or offset == 0:
        kdt = pk.kv_dtype or k.dtype
        kv = ChunkKV.new(k.to(kdt), v.to(kdt), pk.chunk)
    else:
        # None: the chunk's dtype (bf16 when its earlier tokens ran under autocast); a prompt's cache held in
        # another dtype than ``kv_dtype`` is converted once, at the chunk's first step
        kdt = pk.kv_dtype or cache.kv.k_buf.dtype
        kv = cache.kv.to(kdt).append(k.to(kdt), v.to(kdt))
    out = _block_out(pk, x, q, kv.keys, kv.values, None, r, h1)
    full = offset + 1 == pk.chunk
    return out, LayerCache(norm_state, state, None if full else kv, cache.window)


@functools.lru_cache(maxsize=16)
def _rope_table(d: int, base: float, chunk: int, device: torch.device) -> Tensor:
    """exp(i * t * base^(-2j/d)) for chunk offsets t < C, complex64 [C, d/2]: RoPE of one token at offset t
    is the complex product of its interleaved pairs with row t (``common.rope``'s rotation)."""
    inv = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    angle = torch.arange(chunk, dtype=torch.float64).unsqueeze(-1) * inv
    return torch.polar(torch.ones_like(angle), angle).to(device, torch.complex64)


class StaticDecoder:
    """One-token decoding (logits out, no sampling) with every state in fixed buffers, so that a step has
    static shapes, reads no host value and can be captured as a CUDA graph (one launch per token instead of
    one per op) or compiled by torch.compile into a few fused loops.

        dec = StaticDecoder(model, cache)          # cache: the prompt's StreamingCache (model(prompt, use_cache=True))
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
    The model's weights are read through its decode plan (``model.to_decode_dtype``); the plan must not change
    while a decoder lives (``step`` checks, as the eager path does). ``gemv``: the GEMV kind to pack for
    (``GEMV_KINDS``); None: the model's, except that compiled on the CPU a ``matmul`` or ``mkldnn`` plan is
    packed as ``rows`` (one ``torch.mv`` per GEMV, which Inductor turns into its own reduction; oneDNN's
    reordered weights cannot be compiled: Inductor wants them as graph constants). ``compile_options``:
    Inductor's options for the compile (None: ``CPU_COMPILE_OPTIONS`` on the CPU, ``CUDA_COMPILE_OPTIONS`` on
    CUDA; ``{}``: Inductor's defaults).
    """

    @torch.inference_mode(False)  # buffers are normal tensors, updatable in and out of inference
    @torch.no_grad()
    def __init__(
        self, model: nn.Module, cache, buckets: int | None = None, graphs: bool | None = None,
        compile: bool = False, row_gemv: str | None = None, gemv: str | None = None,
        compile_options: dict | None = None,
    ):  # fmt: skip
        self.row_gemv = None if row_gemv is None else _check_row_gemv(row_gemv)
        if compile_options is not None and not compile:
            raise ValueError(f"compile_options needs compile=True, got {compile_options!r} without it")
        if compile_options is not None and not isinstance(compile_options, dict):
            raise ValueError(f"compile_options must be a dict of Inductor options, got {compile_options!r}")
        if not model._can_step(cache):  # float64, sharded or adaptive models keep the full-pass path
            raise ValueError("StaticDecoder needs a float32, unsharded, non-adaptive MegalodonLM")
        self.model, self.options = model, model._decode_options
        device = model.output.final_norm.weight.device
        kind = self.options[1] if gemv is None else gemv
        check_decode_options(self.options[0], kind, device, self.options[2])
        # Compiled on the CPU, "matmul" packs are read as "rows" (W [O, I], torch.mv): Inductor compiles each
        # into a vectorised reduction fused with its prologue, 1.4x faster per float32 token than BLAS over
        # the eager layout (bench/RESULTS.md §27). "mkldnn" too: Inductor's lowering of oneDNN's linear needs
        # the reordered weight as a graph constant, and the plan's is an input. The model keeps the plan last
        # asked for.
        if gemv is None and compile and device.type == "cpu" and kind in ("matmul", "mkldnn"):
            kind = "rows"
        self.plan = model.decode_plan(kind)
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
            # The CEMA state as (Re, Im) pairs [B, D, N, 2]: real arithmetic throughout (``_cema_real``)
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
                q, k, v, r, h1, new_norm, new_cema = _block_in(
                    pk, x, norm, cema, pk.rope_ri.index_select(0, offset)
                )
                for buf, new in zip(norm, new_norm):
                    buf.copy_(new)
                cema.copy_(new_cema)
                k_buf.index_copy_(1, offset, k.to(k_buf.dtype))
                v_buf.index_copy_(1, offset, v.to(v_buf.dtype))
                keys, values = k_buf[:, :end], v_buf[:, :end]
                x = _block_out(pk, x, q, keys, values, mask, r, h1)
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
        apart (``skip_guard_eval_unsafe``: 0.1 ms, 5% of a bf16 step on 2 cores). That is safe here
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
        if self.model._decode_options != self.options or not self.plan.is_current(
            self.model, *self.plan.options
        ):
            raise RuntimeError(
                "the model's decode weights changed (a parameter update, or to_decode_dtype) since this "
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
