"""Fused Triton CEMA (kernels/cema/triton.py) against the float64 PyTorch reference (kernels/cema/reference.py).

Runs on CPU tensors under the Triton interpreter (TRITON_INTERPRET=1, set before Triton is imported) and on
CUDA tensors natively where there is a GPU. The Triton entry point is called directly, since dispatch picks
the reference for CPU tensors. Every buffer the launchers allocate is pre-filled with NaN, so an element no
kernel wrote shows up in the outputs or gradients. GPU-only tests (bf16, L = 32K) are skipped without CUDA.
"""

import os
import types

import torch

if not torch.cuda.is_available():  # before triton is imported: run the kernels under the interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import oracles  # noqa: E402
import pytest  # noqa: E402

pytest.importorskip("triton")

from triton_support import DEVICE, INTERPRET, gpu_only, nan_allocations, needs_device, opcheck_cema_ops  # noqa: E402,F401

from kernels.cema import reference  # noqa: E402
from kernels.cema import triton as fused  # noqa: E402

pytestmark = needs_device

TOL = 2e-5  # max |err| / max |ref| for float32 kernels against the float64 reference


def make_case(B, L, D, N, seed, bidirectional=False, h0=False, padding=False, memory=-2.5):
    """float64 tensors holding float32-representable values: (x, p, q, gamma, omega, h0, padding_mask).
    A quarter of the channels have alpha, delta ≈ ``memory`` (-2.5: |q| ≈ 0.994; -4: |q| ≈ 0.9997, a
    memory of thousands of steps), the rest |q| spread over (0, 1)."""
    g = torch.Generator().manual_seed(seed)
    rows = 2 * D if bidirectional else D
    alpha = torch.randn(rows, N, 1, generator=g, dtype=torch.float64)
    delta = torch.randn(rows, N, 1, generator=g, dtype=torch.float64)
    alpha[: max(1, rows // 4)] = memory + 0.1 * alpha[: max(1, rows // 4)]
    delta[: max(1, rows // 4)] = memory + 0.1 * delta[: max(1, rows // 4)]
    theta = torch.randn(rows, 1, 1, generator=g, dtype=torch.float64)
    gamma = torch.randn(rows, N, 2, generator=g, dtype=torch.float64)
    p, q, gamma_c = oracles.cema_coefficients(alpha, delta, theta, gamma)
    omega = 0.5 * torch.randn(D, generator=g, dtype=torch.float64)
    x = torch.randn(B, L, D, generator=g, dtype=torch.float64)
    state = None
    if h0:
        state = torch.complex(*torch.randn(2, B, D, N, generator=g, dtype=torch.float64))
    mask = None
    if padding:
        mask = torch.rand(B, L, generator=g) < 0.3
        mask[0, : min(2, L)] = True
    f32 = lambda t: None if t is None else t.to(torch.complex64 if t.is_complex() else torch.float32)
    f64 = lambda t: None if t is None else t.to(torch.complex128 if t.is_complex() else torch.float64)
    return [f64(f32(t)) for t in (x, p, q, gamma_c, omega, state)] + [mask]


def run(module, tensors, mask, bidirectional, dtype, device, **kwargs):
    """Forward + backward with random cotangents on y and h_last; returns outputs and input gradients."""
    cast = lambda t: None if t is None else t.to(device=device, dtype=dtype[t.is_complex()]).requires_grad_()
    inputs = [cast(t) for t in tensors]
    x, p, q, gamma, omega, h0 = inputs
    mask = None if mask is None else mask.to(device)
    y, h_last = module.cema(
        x, p, q, gamma, omega, h0=h0, bidirectional=bidirectional, padding_mask=mask,
        return_state=not bidirectional, **kwargs,
    )  # fmt: skip
    g = torch.Generator().manual_seed(1234)
    outputs = [y] + ([] if bidirectional else [h_last])
    cotangents = [torch.randn(y.shape, generator=g, dtype=torch.float64)]
    if not bidirectional:
        cotangents.append(torch.complex(*torch.randn(2, *h_last.shape, generator=g, dtype=torch.float64)))
    cotangents = [c.to(device=device, dtype=o.dtype) for c, o in zip(cotangents, outputs)]
    wrt = [t for t in inputs if t is not None]
    grads = torch.autograd.grad(outputs, wrt, cotangents)
    return [o.detach() for o in outputs], list(grads)


F64 = (torch.float64, torch.complex128)
F32 = (torch.float32, torch.complex64)
NAMES = ["x", "p", "q", "gamma", "omega", "h0"]

CASES = {
    # B, L, D, N, bidirectional, h0, padding, chunk_size (16 steps per loaded tile, 16 chunks per passed tile)
    "L1-h0": (2, 1, 9, 4, False, True, False, None),
    "L7-h0-pad": (2, 7, 8, 4, False, True, True, None),
    "L7-N3-two-channel-blocks": (2, 7, 40, 3, False, True, True, 4),
    "L65-h0-pad-chunk24": (2, 65, 12, 4, False, True, True, 24),
    "L65-h0-17-chunks": (2, 65, 16, 4, False, True, False, 4),
    "L65-default-chunks": (2, 65, 24, 4, False, False, False, None),
    "bidir-L7": (2, 7, 8, 4, True, False, False, None),
    "bidir-L65-pad-chunk16": (2, 65, 10, 4, True, False, True, 16),
}


@pytest.mark.parametrize("case", list(CASES))
def test_forward_backward_match_float64_reference(case):
    B, L, D, N, bidirectional, h0, padding, chunk = CASES[case]
    *tensors, mask = make_case(
        B, L, D, N, seed=len(case), bidirectional=bidirectional, h0=h0, padding=padding
    )
    ref_out, ref_grads = run(reference, tensors, mask, bidirectional, F64, "cpu")
    with nan_allocations():
        out, grads = run(fused, tensors, mask, bidirectional, F32, DEVICE, chunk_size=chunk)
    assert out[0].dtype == torch.float32 and out[0].shape == (B, L, D)
    names = ["y"] + ([] if bidirectional else ["h_last"])
    names += [n for n, t in zip(NAMES, tensors) if t is not None]
    for name, a, b in zip(names, out + grads, ref_out + ref_grads):
        assert torch.isfinite(a).all(), f"{case}: {name} has non-finite (unwritten) elements"
        err = oracles.max_rel_err(a.cpu(), b)
        assert err <= TOL, f"{case}: {name} relative error {err:.2e}"
    if padding:  # padded inputs are zeroed first: their gradient is exactly zero
        assert (grads[0].cpu()[mask] == 0).all()


def _long_memory_error(L, D, N, chunk):
    *tensors, _ = make_case(1, L, D, N, seed=21, h0=True, memory=-4.0)
    x, p, q, gamma, omega, h0 = tensors
    y_ref, h_ref = oracles.cema_recurrence(x, p, q, gamma, omega, h0)
    x, p, q, gamma, omega, h0 = (
        t.to(DEVICE, torch.complex64 if t.is_complex() else torch.float32) for t in tensors
    )
    with torch.no_grad():
        y, h = fused.cema(x, p, q, gamma, omega, h0=h0, return_state=True, chunk_size=chunk)
    return oracles.max_rel_err(y.cpu(), y_ref), oracles.max_rel_err(h.cpu(), h_ref)


def test_float32_long_memory_state_passing():
    """|q| ≈ 0.9997 across 8 chunks: q^T passed between chunks must not lose the phase (float32 arg q
    grows T-fold in exp(T log q); the powers are taken in float64)."""
    err_y, err_h = _long_memory_error(L=512, D=4, N=4, chunk=64)
    assert err_y <= 1e-5 and err_h <= 1e-5, (err_y, err_h)


def test_deterministic():
    """Two runs give bitwise-equal outputs and gradients (no atomics; fixed-order partial sums)."""
    *tensors, mask = make_case(2, 7, 8, 4, seed=5, h0=True, padding=True)
    first = run(fused, tensors, mask, False, F32, DEVICE, chunk_size=4)
    second = run(fused, tensors, mask, False, F32, DEVICE, chunk_size=4)
    for a, b in zip(first[0] + first[1], second[0] + second[1]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("case", ["L7-h0-pad", "bidir-L65-pad-chunk16"])
def test_torch_compile_keeps_one_graph(case):
    """The kernels are two custom ops with fake implementations, so torch.compile traces a call whole
    (fullgraph: no graph break) and gives the eager kernels' outputs and gradients. Before, the entry point
    was ``torch.compiler.disable``d: a compiled block on CUDA broke its graph at every CEMA."""
    B, L, D, N, bidirectional, h0, padding, chunk = CASES[case]
    *tensors, mask = make_case(B, L, D, N, seed=3, bidirectional=bidirectional, h0=h0, padding=padding)
    torch._dynamo.reset()
    compiled = types.SimpleNamespace(cema=torch.compile(fused.cema, backend="aot_eager", fullgraph=True))
    got = run(compiled, tensors, mask, bidirectional, F32, DEVICE, chunk_size=chunk)
    want = run(fused, tensors, mask, bidirectional, F32, DEVICE, chunk_size=chunk)
    for a, b in zip(got[0] + got[1], want[0] + want[1]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("bidirectional", [False, True], ids=["causal", "bidir"])
def test_custom_ops_pass_opcheck(bidirectional):
    """torch.library.opcheck of both ops: the schema, the fake shapes / dtypes / strides against the real
    outputs, and the op under AOT dispatch (a TorchDispatchMode). Under such a mode PyTorch runs the body with
    the lazy-conjugate key off, so ``gamma.conj()`` there was silently ignored and q's gradient came out as
    γ X, not conj(γ) X (found by review; the aot_dispatch check failed on that code)."""
    opcheck_cema_ops(torch.ops.mega_suite.cema_fwd, torch.ops.mega_suite.cema_bwd, bidirectional, 4)


def test_complex_gradient_convention():
    """G_z = ∂L/∂Re z + i ∂L/∂Im z (PyTorch's convention): check q's gradient by a finite difference."""
    *tensors, mask = make_case(1, 7, 3, 2, seed=9, h0=True)
    x, p, q, gamma, omega, h0 = (
        t.to(DEVICE, torch.complex64 if t.is_complex() else torch.float32) for t in tensors
    )
    q = q.requires_grad_()
    y, h = fused.cema(x, p, q, gamma, omega, h0=h0, return_state=True)
    loss = lambda y, h: y.double().square().sum() + h.abs().double().sum()
    (grad,) = torch.autograd.grad(loss(y, h), q)
    eps = 1e-3
    for direction in (1, 1j):
        dq = torch.zeros_like(q)
        dq[0, 1] = eps * direction
        up = loss(*fused.cema(x, p, q.detach() + dq, gamma, omega, h0=h0, return_state=True))
        down = loss(*fused.cema(x, p, q.detach() - dq, gamma, omega, h0=h0, return_state=True))
        numeric = ((up - down) / (2 * eps)).item()
        analytic = grad[0, 1].real.item() if direction == 1 else grad[0, 1].imag.item()
        assert abs(numeric - analytic) <= 2e-2 * max(1.0, abs(analytic)), (direction, numeric, analytic)


# ------------------------------------------------------------------------------------------ GPU only


def _errors(out, ref):
    return [oracles.max_rel_err(a.cpu(), b) for a, b in zip(out, ref)]


@gpu_only
@pytest.mark.parametrize("bidirectional", [False, True])
def test_bf16_error_within_twice_pytorch(bidirectional):
    """bf16 input (float32 parameters and state): error vs float64 <= 2x the reference's in bf16 + atol."""
    B, L, D, N = 2, 2048, 128, 16
    *tensors, mask = make_case(B, L, D, N, seed=11, bidirectional=bidirectional, h0=not bidirectional,
                               padding=True)  # fmt: skip
    ref_out, ref_grads = run(reference, tensors, mask, bidirectional, F64, "cpu")
    cast = lambda t, dt: None if t is None else t.to(device="cuda", dtype=dt[t.is_complex()]).requires_grad_()

    def go(module):
        x, p, q, gamma, omega, h0 = (cast(t, F32) for t in tensors)
        xb = x.detach().to(torch.bfloat16).requires_grad_()
        y, h = module.cema(xb, p, q, gamma, omega, h0=h0, bidirectional=bidirectional,
                           padding_mask=mask.cuda(), return_state=not bidirectional)  # fmt: skip
        g = torch.Generator().manual_seed(1234)
        outs = [y] + ([] if bidirectional else [h])
        cots = [torch.randn(y.shape, generator=g, dtype=torch.float64)]
        if not bidirectional:
            cots.append(torch.complex(*torch.randn(2, *h.shape, generator=g, dtype=torch.float64)))
        cots = [c.to(device="cuda", dtype=o.dtype) for c, o in zip(cots, outs)]
        wrt = [t for t in (xb, p, q, gamma, omega, h0) if t is not None]
        return [o.detach() for o in outs] + list(torch.autograd.grad(outs, wrt, cots))

    err_triton = _errors(go(fused), ref_out + ref_grads)
    err_torch = _errors(go(reference), ref_out + ref_grads)
    for et, er in zip(err_triton, err_torch):
        assert et <= 2 * er + 1e-5, (err_triton, err_torch)


@gpu_only
def test_float32_long_sequence_precision():
    """As tests/kernels/test_cema.py asks of every method: L = 4096, N = 16, |q| ≈ 0.9997, relative error <= 1e-5."""
    for chunk in (None, 64, 256):
        err_y, err_h = _long_memory_error(L=4096, D=8, N=16, chunk=chunk)
        assert err_y <= 1e-5 and err_h <= 1e-5, (chunk, err_y, err_h)


@gpu_only
def test_large_shape_matches_fft_reference():
    """L = 32K, D = 4096, N = 16, bf16: forward and backward run and agree with the float32 FFT reference."""
    B, L, D, N = 1, 32768, 4096, 16
    torch.manual_seed(0)
    x = torch.randn(B, L, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    alpha, delta = torch.randn(2, D, N, 1, device="cuda") * 0.2
    theta = torch.randn(D, 1, 1, device="cuda")
    gamma = torch.randn(D, N, 2, device="cuda")
    p, q, gamma_c = reference.cema_coefficients(alpha, delta, theta, gamma)
    omega = torch.randn(D, device="cuda") * 0.25
    gy = torch.randn(B, L, D, device="cuda", dtype=torch.bfloat16)
    results = []
    for module in (fused, reference):
        x.grad = None
        y, _ = module.cema(x, p, q, gamma_c, omega)
        y.backward(gy)
        results.append((y.float(), x.grad.float()))
    (y, dx), (y_ref, dx_ref) = results
    assert torch.isfinite(y).all() and torch.isfinite(dx).all()
    assert ((y - y_ref).norm() / y_ref.norm()).item() < 1e-2
    assert ((dx - dx_ref).norm() / dx_ref.norm()).item() < 1e-2
