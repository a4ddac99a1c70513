"""Q and K from Z (kernels/qk_norm_rope): both fused Triton kernels (the ``heads`` and ``rows`` variants) under
the interpreter and the PyTorch reference, against a float64 oracle written here from
docs/architecture.md#normalised-attention: per-head RMS normalisation, (1 + γ) / sqrt(zd) and β, RoPE on
interleaved pairs at (start + l) mod C. Forward and every gradient (dZ, dγ, dβ) with random cotangents; fp32 and
fp16; ragged widths, head counts and row counts; outputs pre-filled with NaN."""

from __future__ import annotations

import math

import pytest
import torch
from triton_support import DEVICE, nan_allocations, needs_device

from kernels.qk_norm_rope import qk_norm_rope, reference

BASE, EPS = 10000.0, 1e-5


def oracle(z, gamma, beta, base, eps, chunk, start):
    """float64, per element as written in the docs (autograd supplies the gradients)."""
    z, gamma, beta = z.double(), gamma.double(), beta.double()
    b, length, h, zd = z.shape
    z_hat = z / torch.sqrt((z * z).mean(-1, keepdim=True) + eps)
    pos = ((torch.arange(length) + start) % chunk).double().view(1, length, 1)
    outs = []
    for row in range(2):
        pre = z_hat * (1 + gamma[row].view(h, zd)) / math.sqrt(zd) + beta[row].view(h, zd)
        cols = []
        for i in range(zd // 2):
            angle = pos * base ** (-(2 * i) / zd)
            a0, a1 = pre[..., 2 * i], pre[..., 2 * i + 1]
            cols += [
                a0 * torch.cos(angle) - a1 * torch.sin(angle),
                a0 * torch.sin(angle) + a1 * torch.cos(angle),
            ]
        outs.append(torch.stack(cols, -1))
    return outs[0], outs[1]


def inputs(b, length, h, zd, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    z = (torch.randn(b, length, h, zd, generator=gen) * 2 + 0.5).to(dtype)
    gamma = torch.randn(2, h * zd, generator=gen) * 0.3
    beta = torch.randn(2, h * zd, generator=gen) * 0.3
    return z, gamma, beta


def run(fn, z, gamma, beta, chunk, start, out_dtype, cot):
    z, gamma, beta = (t.detach().clone().requires_grad_() for t in (z, gamma, beta))
    q, k = fn(z, gamma, beta, chunk, start, out_dtype)
    cot = [c.to(q.device) for c in cot]
    ((q.double() * cot[0]).sum() + (k.double() * cot[1]).sum()).backward()
    return [t.detach().double() for t in (q, k, z.grad, gamma.grad, beta.grad)]


def fused_fn(z, gamma, beta, chunk, start, out_dtype):
    from kernels.qk_norm_rope import _inv_freq
    from kernels.qk_norm_rope import triton as fused

    inv = _inv_freq(z.shape[-1], BASE, z.device)
    return fused.qk_norm_rope(z, gamma, beta, inv, EPS, chunk, start, out_dtype)


def rows_fn(z, gamma, beta, chunk, start, out_dtype):
    from kernels.qk_norm_rope import triton as fused

    table = fused.cos_sin_table(z.shape[-1], BASE, chunk, z.device)
    return fused.qk_norm_rope_rows(z, gamma, beta, table, EPS, chunk, start, out_dtype)


VARIANTS = {"heads": fused_fn, "rows": rows_fn}


def reference_fn(z, gamma, beta, chunk, start, out_dtype):
    return qk_norm_rope(z, gamma, beta, BASE, EPS, chunk, start, out_dtype)


def oracle_fn(z, gamma, beta, chunk, start, out_dtype):
    return oracle(z, gamma, beta, BASE, EPS, chunk, start)


def max_errors(got, want):
    return [float((g - w).abs().max() / w.abs().max().clamp(min=1e-12)) for g, w in zip(got, want)]


@needs_device
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize(
    "b, length, h, zd, chunk, start",
    [(2, 13, 2, 8, 5, 0), (1, 70, 1, 12, 16, 3), (2, 9, 3, 6, 4, 2), (1, 33, 1, 64, 33, 0)],
)
def test_fused_fp32_forward_and_gradients_equal_the_float64_oracle(b, length, h, zd, chunk, start, variant):
    """Rows not a multiple of the row block, half-widths not a power of two (zd 12, 6), head counts not a
    power of two (3), chunks restarting inside the sequence, a stream offset."""
    z, gamma, beta = inputs(b, length, h, zd, torch.float32)
    gen = torch.Generator().manual_seed(7)
    cot = [torch.randn(b, length, h, zd, generator=gen, dtype=torch.float64) for _ in range(2)]
    want = run(oracle_fn, z, gamma, beta, chunk, start, None, cot)
    with nan_allocations():
        got = run(
            VARIANTS[variant],
            z.to(DEVICE),
            gamma.to(DEVICE),
            beta.to(DEVICE),
            chunk,
            start,
            torch.float32,
            cot,
        )
    for name, err in zip(("q", "k", "dz", "dgamma", "dbeta"), max_errors([g.cpu() for g in got], want)):
        assert err < 2e-5, f"{name}: relative error {err:.2e}"


@needs_device
@pytest.mark.parametrize("variant", VARIANTS)
def test_fused_fp16_is_as_close_as_the_reference_in_fp16(variant):
    """fp16 Z, Q and K: within twice the error of the same PyTorch code in fp16, plus a small atol."""
    z, gamma, beta = inputs(2, 24, 2, 16, torch.float16, seed=3)
    gen = torch.Generator().manual_seed(8)
    cot = [torch.randn(2, 24, 2, 16, generator=gen, dtype=torch.float64) for _ in range(2)]
    want = run(oracle_fn, z, gamma, beta, 8, 0, None, cot)
    ref = max_errors(run(reference_fn, z, gamma, beta, 8, 0, torch.float16, cot), want)
    got = max_errors(
        [
            g.cpu()
            for g in run(
                VARIANTS[variant], z.to(DEVICE), gamma.to(DEVICE), beta.to(DEVICE), 8, 0, torch.float16, cot
            )
        ],
        want,
    )
    for name, g, r in zip(("q", "k", "dz", "dgamma", "dbeta"), got, ref):
        assert g <= 2 * r + 1e-3, f"{name}: fused {g:.2e} against the fp16 reference's {r:.2e}"


def test_reference_equals_the_float64_oracle_and_stores_only_z():
    """The CPU path: float64 inputs give the oracle to rounding, gradients included; under autograd only Z
    (and the parameters) are kept for backward (``kernels.recompute``)."""
    z, gamma, beta = inputs(2, 11, 2, 8, torch.float64, seed=5)
    gen = torch.Generator().manual_seed(9)
    cot = [torch.randn(2, 11, 2, 8, generator=gen, dtype=torch.float64) for _ in range(2)]
    got = run(reference_fn, z, gamma, beta, 4, 1, None, cot)
    want = run(oracle_fn, z, gamma, beta, 4, 1, None, cot)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)
    saved = []
    zz = z.clone().requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t):
        reference.qk_norm_rope  # noqa: B018  (the module the dispatcher wraps)
        qk_norm_rope(zz, gamma.requires_grad_(), beta.requires_grad_(), BASE, EPS, 4)
    assert all(s in (zz.shape, gamma.shape) for s in saved), saved


def test_bad_shapes_are_clear_errors():
    z, gamma, beta = inputs(1, 4, 2, 8, torch.float32)
    with pytest.raises(ValueError, match=r"zd even"):
        qk_norm_rope(z[..., :7], gamma, beta, BASE, EPS, 4)
    with pytest.raises(ValueError, match=r"gamma and beta must be \[2, 16\]"):
        qk_norm_rope(z, gamma[:, :8], beta, BASE, EPS, 4)


@needs_device
def test_the_custom_ops_pass_opcheck_and_compile_without_breaks():
    from kernels.qk_norm_rope import _inv_freq
    from kernels.qk_norm_rope import triton as fused

    z, gamma, beta = (t.to(DEVICE) for t in inputs(1, 10, 2, 8, torch.float32))
    inv = _inv_freq(8, BASE, z.device)
    torch.library.opcheck(
        torch.ops.mega_suite.qk_norm_rope_fwd, (z, gamma, beta, inv, 0, 5, EPS, torch.float32)
    )
    table = fused.cos_sin_table(8, BASE, 5, z.device)
    torch.library.opcheck(
        torch.ops.mega_suite.qk_norm_rope_rows_fwd, (z, gamma, beta, table, 0, 5, EPS, torch.float32)
    )
    dq, dk = torch.randn_like(z), torch.randn_like(z)
    torch.library.opcheck(torch.ops.mega_suite.qk_norm_rope_bwd, (dq, dk, z, gamma, inv, 0, 5, EPS))
    torch.library.opcheck(torch.ops.mega_suite.qk_norm_rope_rows_bwd, (dq, dk, z, gamma, table, 0, 5, EPS))
    for fn in VARIANTS.values():
        compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
        q, k = compiled(z, gamma, beta, 5, 0, torch.float32)
        q2, k2 = fn(z, gamma, beta, 5, 0, torch.float32)
        assert torch.equal(q, q2) and torch.equal(k, k2)


@needs_device
def test_rows_backward_with_several_tiles_per_program(monkeypatch):
    """The rows variant's backward in fewer programs than tiles: each program sums its tiles' dγ and dβ
    (3 programs over 25 tiles of 2 tokens, the last one ragged)."""
    from kernels.qk_norm_rope import triton as fused

    monkeypatch.setattr(fused, "ROWS_BWD_PROGRAMS", 3)
    monkeypatch.setattr(fused, "ROWS_BWD_TILE", 64)  # 2 tokens of h 2 x zd 16 per tile
    z, gamma, beta = inputs(1, 49, 2, 16, torch.float32, seed=4)
    gen = torch.Generator().manual_seed(11)
    cot = [torch.randn(1, 49, 2, 16, generator=gen, dtype=torch.float64) for _ in range(2)]
    want = run(oracle_fn, z, gamma, beta, 7, 5, None, cot)
    assert fused._rows_shape(2, 16, fused.ROWS_BWD_TILE)["BLOCK_T"] == 2
    with nan_allocations():
        got = run(rows_fn, z.to(DEVICE), gamma.to(DEVICE), beta.to(DEVICE), 7, 5, torch.float32, cot)
    for name, err in zip(("q", "k", "dz", "dgamma", "dbeta"), max_errors([g.cpu() for g in got], want)):
        assert err < 2e-5, f"{name}: relative error {err:.2e}"


def test_the_table_is_the_float64_rotation_rounded_once():
    """cos / sin of p base^(-2j/zd) for every position of a chunk, each within float32's half ulp of the float64
    values (the float32 product p base^(-2j/zd) is off by up to 2e-4 radians at p 4095)."""
    from kernels.qk_norm_rope import triton as fused

    table = fused.cos_sin_table(8, BASE, 4096, torch.device("cpu"))
    assert table.shape == (4096, 4, 2) and table.dtype == torch.float32
    pos = torch.arange(4096, dtype=torch.float64)[:, None]
    angle = pos * torch.tensor([BASE ** (-(2 * i) / 8) for i in range(4)], dtype=torch.float64)
    want = torch.stack([torch.cos(angle), torch.sin(angle)], -1)
    assert float((table.double() - want).abs().max()) <= 2**-25


@needs_device
def test_the_dispatcher_runs_the_chosen_variant(monkeypatch):
    """``VARIANT = "rows"`` sends Triton calls to the rows kernels (one table per width, base, chunk and
    device); a chunk whose table would be too large, and the default, to the heads kernels."""
    import kernels.qk_norm_rope as dispatcher
    from kernels.qk_norm_rope import triton as fused

    assert fused.VARIANT == "heads"  # the default until a GPU measures the rows variant inside the block
    calls = []
    for name in ("qk_norm_rope", "qk_norm_rope_rows"):
        real = getattr(fused, name)
        monkeypatch.setattr(fused, name, lambda *a, _n=name, _f=real: calls.append(_n) or _f(*a))
    monkeypatch.setattr(dispatcher, "use_triton", lambda *t: True)  # CPU tensors in the interpreter
    z, gamma, beta = (t.to(DEVICE) for t in inputs(1, 6, 2, 8, torch.float32))
    heads = qk_norm_rope(z, gamma, beta, BASE, EPS, 4)
    monkeypatch.setattr(fused, "VARIANT", "rows")
    rows = qk_norm_rope(z, gamma, beta, BASE, EPS, 4)
    monkeypatch.setattr(fused, "MAX_TABLE_ENTRIES", 4 * 4 - 1)
    qk_norm_rope(z, gamma, beta, BASE, EPS, 4)
    assert calls == ["qk_norm_rope", "qk_norm_rope_rows", "qk_norm_rope"]
    for a, b in zip(heads, rows):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
