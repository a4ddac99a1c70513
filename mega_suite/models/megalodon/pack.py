"""Packed weights: what the one-token step (``step.py``) reads instead of the model's parameters.

A decode step reads every weight once per token; its floor is one GEMV over all of them. ``DecodePlan`` packs
each block's Linear weights by the input they read, so a block runs five GEMVs instead of eight:

    m  -> [W_z | W_r | W_h1]      (the RMS-normalised CEMA output)
    x̂  -> W_v                     (the TimestepNorm output)
    o ⊙ r -> W_h2                 (added onto the m-pack's W_h1 part)
    u  -> [fc1 | fc3]             (the LayerNorm output)
    a  -> fc2                     (layer scale folded in, the block's residual X added by the GEMV)

and folds the norms' affine maps into the weights they feed, W (n ⊙ (1 + w) + b) = (W diag(1 + w)) n + W b,
so RMSNorm and LayerNorm become one unaffine op each. The Q/K scale and offset, the RoPE table and the CEMA
coefficients are computed once per plan. A plan is rebuilt when any parameter may have changed (its key holds
every parameter's storage pointer and version counter; an optimizer step or a switch between training and
evaluation anywhere, which may rewrite weights without moving a version counter, stales every plan), so no
step reads weights older than the model's. The model's own forward and ``decode.Decoder`` both read these
plans; this module sits below both.

Weights: float32, bfloat16 (activations rounded to bf16 at each GEMV, accumulated and returned in float32) or
int8 weight-only (per-output-row scales). GEMV kinds: ``matmul`` (BLAS), ``rows`` (W [O, I] read by
``torch.mv``: what torch.compile turns into its own reductions) and ``mkldnn`` (oneDNN with the weight
reordered once; CPU only). docs/long_context.md#the-one-token-step explains the choices; the figures behind them are
in bench/RESULTS.md.
"""

from __future__ import annotations

import contextlib
import functools
import math

import torch
from torch import Tensor, nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from kernels import gemv

WEIGHT_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.int8: "int8"}
GEMV_KINDS = ("matmul", "rows", "mkldnn")
KV_DTYPES = (None, torch.float32, torch.bfloat16)  # None: the keys / values kept as computed
CPU_KV_BUCKET_ROWS = 64  # the compiled CPU step's attended lengths with bf16 keys / values (attention_step)
# Inductor options of the compiled CPU step: a pointwise result is materialised once rather than recomputed
# inside every reduction that reads it (the head's GEMV recomputed the final norm per output row otherwise).
CPU_COMPILE_OPTIONS = {"realize_opcount_threshold": 1}
# The compiled CUDA step's defaults: the fastest one-row GEMV and options measured on an H100
# (bench/reports/2026-11-24-gpu-results-leases.md, decode at 7B).
CUDA_COMPILED_ROW_GEMV = "triton"
CUDA_COMPILE_OPTIONS = {"realize_opcount_threshold": 1}

# One-row bf16 GEMV on CUDA (``Gemv``, kind "rows"): "mv" (torch.mv, which Inductor rewrites as its own
# reduction), "mm" (x @ Wᵀ, a cuBLAS GEMM kept as an extern call), "cublas" (torch.mv behind the custom op
# ``mega_suite::mv`` so that Inductor keeps cuBLAS's GEMV) or "triton" (``kernels.gemv``, bias and residual
# in its epilogue). Read when a step is traced or captured (torch.compile guards on it); a StaticDecoder sets
# its own choice around its compile, captures and steps (``cuda_row_gemv``). Eager decoding keeps "mv".
CUDA_ROW_GEMV = "mv"
CUDA_ROW_GEMVS = ("mv", "mm", "cublas", "triton")


def mkldnn_available(device: torch.device, dtype: torch.dtype = torch.float32) -> bool:
    """Whether the ``mkldnn`` GEMV runs ``dtype`` weights on ``device``: a CPU build with oneDNN, and for
    bfloat16 a CPU oneDNN's bf16 path supports (``mkldnn_bf16_supported``)."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available() or not hasattr(torch.ops, "mkldnn"):
        return False
    return dtype != torch.bfloat16 or mkldnn_bf16_supported()


@functools.cache
def mkldnn_bf16_supported() -> bool:
    """oneDNN's bf16 path needs AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT; on an AVX2-only CPU its weight reorder
    raises. torch's own check of exactly that, else one reorder of a tiny weight, asked once."""
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    try:
        if check is not None:
            return bool(check())
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 8, dtype=torch.bfloat16), 1)
        return True
    except RuntimeError:
        return False


def check_row_gemv(kind: str) -> str:
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
    previous, CUDA_ROW_GEMV = CUDA_ROW_GEMV, check_row_gemv(kind)
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
    return check_row_gemv(CUDA_ROW_GEMV) if x.is_cuda else "mv"


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
            # [O, I], read by torch.mv for one row: the faster bf16 layout on the CPU, and the one torch.compile
            # turns into its own vectorised reductions (bench/RESULTS.md, decode on CPU)
            self.w = weight.to(dtype).contiguous()
            self.kind = "rows"
        else:
            # x @ Wᵀ reads W as rows: of Wᵀ [I, O] where I <= O, of W [O, I] where I > O: the longer rows
            # stream faster through the CPU's BLAS (bench/RESULTS.md, decode on CPU)
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
        self.rope = rope_table(zd, cfg.rope_base, cfg.chunk_size, att.gamma.device)
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

# Events after which weights may have been rewritten in place without moving their version counter: any
# optimizer step (the fused AdamW kernel writes outside autograd's version tracking) and a model's switch
# between training and evaluation (``MegalodonLM.train``: after weights written through ``p.data``, say).
# Every plan built before one of them is stale. (FSDP2's all-gathers do the same; sharded models never step.)
_REWRITES = [0]


def weights_may_have_been_rewritten(*_args) -> None:
    _REWRITES[0] += 1


register_optimizer_step_post_hook(weights_may_have_been_rewritten)


class DecodePlan:
    """Packed weights for every block and the head, and the key of the parameters they were built from."""

    @torch.no_grad()
    def __init__(self, model: nn.Module, dtype: torch.dtype, kind: str, kv_dtype: torch.dtype | None = None):
        self.options = (dtype, kind, kv_dtype)
        self.kv_dtype = kv_dtype
        self.params = list(model.parameters())
        self.key = self.current_key()
        self.changes = _CHANGES[0]  # at the last comparison of the parameter objects
        self.rewrites = _REWRITES[0]
        fn = model.output.final_norm
        with torch.autocast(fn.weight.device.type, enabled=False):  # packed in float32 whoever asks
            self.blocks = [BlockPack(layer, dtype, kind, kv_dtype) for layer in model.layers]
            head = model.output.output
            self.head = Gemv(
                head.weight.float(), None, torch.float32, kind
            )  # float32 logits, whatever the dtype
            self.final_w1, self.final_b = 1 + fn.weight.float(), fn.bias.float()
        self.final_groups, self.final_eps = fn.num_groups, fn.eps
        self._one_buffer()

    def _one_buffer(self) -> None:
        """Move the packed weights into one buffer per dtype, in the order a step reads them (the next
        GEMV's weights start where the last one's ended: fewer cache and TLB misses than separate
        allocations)."""
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
        """Whether the packs still hold the model's weights: no optimizer step or train / eval switch since
        they were packed (``_REWRITES``), the same parameter objects and every one's storage and version.
        The list of parameter objects (a parameter or a module replaced by a new one:
        ``load_state_dict(assign=True)``, ``module.weight = Parameter(...)``) is compared only when a
        parameter or module was registered anywhere, or a model ran a full pass, since the last comparison
        (``_CHANGES``): listing them costs more than the version check, at every token."""
        if self.options != (dtype, kind, kv_dtype) or self.rewrites != _REWRITES[0]:
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
    if kind == "mkldnn" and dtype == torch.bfloat16 and not mkldnn_available(device, dtype):
        raise ValueError(
            "decode gemv 'mkldnn' with bfloat16 weights needs oneDNN's bf16 path, which this CPU lacks (it "
            f"needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT; torch's CPU capability here: "
            f"{torch.backends.cpu.get_cpu_capability()}): use gemv 'rows' or 'matmul' with bfloat16 weights, "
            "or float32 weights with 'mkldnn'"
        )


@functools.lru_cache(maxsize=16)
def rope_table(d: int, base: float, chunk: int, device: torch.device) -> Tensor:
    """exp(i * t * base^(-2j/d)) for chunk offsets t < C, complex64 [C, d/2]: RoPE of one token at offset t
    is the complex product of its interleaved pairs with row t (``common.rope``'s rotation)."""
    inv = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    angle = torch.arange(chunk, dtype=torch.float64).unsqueeze(-1) * inv
    return torch.polar(torch.ones_like(angle), angle).to(device, torch.complex64)
