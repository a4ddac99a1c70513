"""CEMA's coefficients from its raw parameters by one Triton kernel each way (kernels/cema/triton.py), against
the float64 oracle written from the math (tests/support/oracles.py: p = σ(α), q = (1 − σ(α) σ(δ)) exp(i n θ),
θ = σ(θ_raw) 2π/N, n = 1..N, γ = (g0 + i g1)/sqrt(N)), values and gradients, float32 parameters; and the
coefficients feeding the Triton scan, without complex arithmetic.

Runs on CPU tensors under the Triton interpreter (TRITON_INTERPRET=1, set before Triton is imported) and on
CUDA tensors natively where there is a GPU.
"""

import os

import torch

if not torch.cuda.is_available():  # before triton is imported: run the kernels under the interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import oracles  # noqa: E402
import pytest  # noqa: E402

pytest.importorskip("triton")

from triton_support import DEVICE, nan_allocations, needs_device  # noqa: E402

import kernels.cema  # noqa: E402
from kernels.cema import reference  # noqa: E402
from kernels.cema import triton as fused  # noqa: E402

pytestmark = needs_device

COEF_TOL = 2e-7  # float64 inside, rounded once to float32
TOL = 2e-5  # the scan's float32 tolerance (tests/kernels/test_triton_cema.py)


def parameters(rows, N, seed, spread=1.0):
    """float64 parameters holding float32 values: alpha, delta [R, N, 1], theta [R, 1, 1], gamma [R, N, 2]."""
    g = torch.Generator().manual_seed(seed)
    alpha = spread * torch.randn(rows, N, 1, generator=g, dtype=torch.float64)
    delta = spread * torch.randn(rows, N, 1, generator=g, dtype=torch.float64)
    theta = spread * torch.randn(rows, 1, 1, generator=g, dtype=torch.float64)
    gamma = torch.randn(rows, N, 2, generator=g, dtype=torch.float64)
    alpha[0, 0], delta[0, -1], theta[-1] = 9.0, -9.0, 7.5  # saturated sigmoids
    return [t.float().double() for t in (alpha, delta, theta, gamma)]


def as_planes(p, q, gamma):
    """(p, q, γ) with q, γ complex -> real tensors p [R, N], q and γ as (re, im) [R, N, 2]."""
    return p, torch.view_as_real(q.resolve_conj()), torch.view_as_real(gamma.resolve_conj())


def coefficients_vjp(fn, params, seed=99):
    """(p, q, γ) as real planes and the gradients of a random linear loss on them w.r.t. the parameters."""
    leaves = [t.clone().requires_grad_() for t in params]
    outs = fn(*leaves)
    g = torch.Generator().manual_seed(seed)
    cots = [torch.randn(o.shape, generator=g, dtype=torch.float64).to(o.device, o.dtype) for o in outs]
    loss = sum((o * c).sum() for o, c in zip(outs, cots))
    return [o.detach() for o in outs], list(torch.autograd.grad(loss, leaves))


def oracle_planes(*params):
    return as_planes(*oracles.cema_coefficients(*params))


SHAPES = {"D8-N16": (8, 16), "rows-67-N5": (67, 5), "one-row-N1": (1, 1), "bidir-2x24-N16": (48, 16)}


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("api", ["real", "complex"])
def test_values_and_gradients_match_float64_oracle(shape, api):
    """Both entry points: the real planes, and complex64 views of them (the reference's contract, whose
    gradients follow PyTorch's convention G_z = ∂L/∂Re z + i ∂L/∂Im z)."""
    rows, N = SHAPES[shape]
    params = parameters(rows, N, seed=rows + N)
    if api == "real":
        fn = fused.cema_coefficients_real
    else:
        fn = lambda *ps: as_planes(*fused.cema_coefficients(*ps))  # noqa: E731
    with nan_allocations():
        out, grads = coefficients_vjp(fn, [t.to(DEVICE, torch.float32) for t in params])
    out_ref, grads_ref = coefficients_vjp(oracle_planes, params)
    for name, a, b in zip(
        ["p", "q", "gamma", "dalpha", "ddelta", "dtheta", "dgamma"], out + grads, out_ref + grads_ref
    ):
        assert a.dtype == torch.float32 and a.shape == b.shape, (name, a.dtype, a.shape)
        assert torch.isfinite(a).all(), f"{name} has non-finite (unwritten) elements"
        err = oracles.max_rel_err(a.cpu(), b)
        assert err <= COEF_TOL, f"{shape}: {name} relative error {err:.2e}"
    if api == "complex":
        p, q, gamma = fused.cema_coefficients(*(t.to(DEVICE, torch.float32) for t in params))
        assert q.dtype == gamma.dtype == torch.complex64 and q.shape == gamma.shape == (rows, N)
        assert q._base is not None and not q._base.is_complex(), "q is a view of the kernel's real output"


def test_at_least_as_accurate_as_the_float32_reference():
    """Against float64, the kernel's values and gradients are no worse than the PyTorch reference's
    (complex64 arithmetic on float32 parameters)."""
    params = parameters(64, 16, seed=5, spread=2.0)
    f32 = [t.float() for t in params]
    out, grads = coefficients_vjp(fused.cema_coefficients_real, [t.to(DEVICE) for t in f32])
    out_t, grads_t = coefficients_vjp(lambda *ps: as_planes(*reference.cema_coefficients(*ps)), f32)
    out_ref, grads_ref = coefficients_vjp(oracle_planes, params)
    for a, t, b in zip(out + grads, out_t + grads_t, out_ref + grads_ref):
        assert oracles.max_rel_err(a.cpu(), b) <= max(oracles.max_rel_err(t, b), COEF_TOL)


def test_the_dispatcher_runs_the_reference_on_cpu_and_in_float64():
    params = parameters(4, 3, seed=1)
    p, q, gamma = kernels.cema.cema_coefficients(*params)  # CPU float64: the reference
    assert q.dtype == torch.complex128
    torch.testing.assert_close(q, oracles.cema_coefficients(*params)[1], rtol=1e-12, atol=1e-12)


def test_cema_from_parameters_dispatches_to_the_reference_on_cpu():
    """``kernels.cema.cema_from_parameters`` on CPU float64 tensors: the PyTorch reference, equal to the
    float64 recurrence on the oracle's coefficients."""
    x, params, omega, mask = _cema_case(2, 9, 4, 3, False, seed=13)
    y = kernels.cema.cema_from_parameters(x, *params, omega, padding_mask=mask)
    torch.testing.assert_close(y, _oracle_cema(x, *params, omega, False, mask), rtol=1e-9, atol=1e-9)


def test_bad_parameter_shapes_are_named():
    alpha, delta, theta, gamma = (t.float().to(DEVICE) for t in parameters(4, 3, seed=2))
    with pytest.raises(ValueError, match=r"theta must be \(4, 1, 1\).*got \(4, 3, 1\)"):
        fused.cema_coefficients_real(alpha, delta, alpha, gamma)
    with pytest.raises(ValueError, match=r"gamma must be \(4, 3, 2\)"):
        fused.cema_coefficients_real(alpha, delta, theta, gamma[:, :2])


def test_custom_ops_pass_opcheck():
    tests = ("test_schema", "test_faketensor", "test_aot_dispatch_dynamic")
    alpha, delta, theta, gamma = (t.float().to(DEVICE) for t in parameters(6, 4, seed=3))
    torch.library.opcheck(torch.ops.mega_suite.cema_coefficients_fwd.default, (alpha, delta, theta, gamma),
                          test_utils=tests)  # fmt: skip
    p, q, g = torch.ops.mega_suite.cema_coefficients_fwd(alpha, delta, theta, gamma)
    cots = (torch.randn_like(p), torch.randn_like(q), torch.randn_like(g))
    torch.library.opcheck(torch.ops.mega_suite.cema_coefficients_bwd.default, (*cots, alpha, delta, theta),
                          test_utils=tests)  # fmt: skip


# ------------------------------------------------------------------------------ the coefficients in the scan


def _cema_case(B, L, D, N, bidirectional, seed):
    g = torch.Generator().manual_seed(seed)
    rows = 2 * D if bidirectional else D
    params = parameters(rows, N, seed)
    params[0][: rows // 4] = -2.5  # long memories: |q| ≈ 0.994
    params[1][: rows // 4] = -2.5
    omega = (0.5 * torch.randn(D, generator=g, dtype=torch.float64)).float().double()
    x = torch.randn(B, L, D, generator=g, dtype=torch.float64).float().double()
    mask = torch.rand(B, L, generator=g) < 0.3
    return x, params, omega, mask


def _oracle_cema(x, alpha, delta, theta, gamma, omega, bidirectional, mask):
    p, q, g = oracles.cema_coefficients(alpha, delta, theta, gamma)
    x = x.masked_fill(mask.unsqueeze(-1), 0.0)
    if bidirectional:
        return oracles.cema_bidirectional(x, p, q, g, omega)
    return oracles.cema_recurrence(x, p, q, g, omega)[0]


@pytest.mark.parametrize("bidirectional", [False, True], ids=["causal", "bidir"])
@pytest.mark.parametrize("entry", ["from_parameters", "coefficients_then_cema"])
def test_cema_from_the_parameters_matches_float64_oracle(entry, bidirectional):
    """y and the gradients of x, the four parameters and ω: the coefficient kernel feeding the scan (the
    real path, and complex views through ``cema``) against the float64 recurrence on the oracle's
    coefficients."""
    B, L, D, N = 2, 37, 8, 4
    x, params, omega, mask = _cema_case(B, L, D, N, bidirectional, seed=11)
    cot = torch.randn(B, L, D, generator=torch.Generator().manual_seed(12), dtype=torch.float64)

    def kernel(x, alpha, delta, theta, gamma, omega):
        m = mask.to(x.device)
        if entry == "from_parameters":
            return fused.cema_from_parameters(
                x, alpha, delta, theta, gamma, omega, bidirectional, m, chunk_size=8
            )
        p, q, g = fused.cema_coefficients(alpha, delta, theta, gamma)
        return fused.cema(x, p, q, g, omega, bidirectional=bidirectional, padding_mask=m, chunk_size=8)[0]

    def vjp(fn, leaves):
        leaves = [t.clone().requires_grad_() for t in leaves]
        y = fn(*leaves)
        return [y.detach()] + list(torch.autograd.grad(y, leaves, cot.to(y.device, y.dtype)))

    with nan_allocations():
        got = vjp(kernel, [t.to(DEVICE, torch.float32) for t in (x, *params, omega)])
    want = vjp(lambda *ls: _oracle_cema(*ls, bidirectional, mask), [x, *params, omega])
    for name, a, b in zip(["y", "x", "alpha", "delta", "theta", "gamma", "omega"], got, want):
        assert torch.isfinite(a).all(), f"{name} has non-finite (unwritten) elements"
        err = oracles.max_rel_err(a.cpu(), b)
        assert err <= TOL, f"{entry}: {name} relative error {err:.2e}"


def test_interleaved_and_separate_planes_give_identical_results():
    """The scan reads q, γ in place as the halves of an interleaved tensor (stride 2) or as contiguous planes:
    bitwise the same outputs and gradients."""
    B, L, D, N = 2, 19, 6, 4
    g = torch.Generator().manual_seed(4)
    x = torch.randn(B, L, D, generator=g).to(DEVICE)
    p, q, gamma = fused.cema_coefficients(*(t.float().to(DEVICE) for t in parameters(D, N, seed=4)))
    omega = torch.randn(D, generator=g).to(DEVICE)
    qr, qi, gr, gi = q.real, q.imag, gamma.real, gamma.imag
    assert qr.stride() == (2 * N, 2)
    contiguous = [t.contiguous() for t in (qr, qi, gr, gi)]
    outs = []
    for planes in ((qr, qi, gr, gi), contiguous):
        y, h_re, h_im, states, _ = torch.ops.mega_suite.cema_fwd(
            x, p, *planes, omega, None, None, None, False, 8
        )
        gy = torch.ones_like(y)
        grads = torch.ops.mega_suite.cema_bwd(gy, None, None, x, p, *planes, omega, None, states, states[:0],
                                              False, False, 8)  # fmt: skip
        outs.append([y, h_re, h_im, *grads])
    for a, b in zip(*outs):
        if DEVICE == "cpu":
            assert torch.equal(a, b)
        else:  # compiled for other strides, the GPU code may contract its multiply-adds differently
            torch.testing.assert_close(a, b, rtol=2e-5, atol=1e-5)  # seen on an H200: 4e-6 relative


def test_one_cema_step_is_nine_kernels_and_no_pytorch_op():
    """Forward and backward of CEMA from the parameters, by either entry point: the coefficient kernel, the
    scan's three kernels, its backward's three and the fixed-order sum of its partials, the coefficient
    backward; no PyTorch device operation (no complex arithmetic, no float64 glue)."""
    from device_ops import DeviceOps, counting_launches

    B, L, D, N = 2, 16, 4, 4
    x = torch.randn(B, L, D, device=DEVICE, requires_grad=True)
    params = [t.float().to(DEVICE).requires_grad_() for t in parameters(D, N, seed=6)]
    omega = torch.randn(D, device=DEVICE, requires_grad=True)
    cot = torch.randn(B, L, D, device=DEVICE)

    def from_parameters():
        return fused.cema_from_parameters(x, *params, omega, chunk_size=8)

    def through_complex_views():
        p, q, g = fused.cema_coefficients(*params)
        return fused.cema(x, p, q, g, omega, chunk_size=8)[0]

    for step in (from_parameters, through_complex_views):
        for t in (x, *params, omega):
            t.grad = None  # (accumulating into an existing gradient would be an add per leaf)
        counter = DeviceOps()
        with counting_launches(counter), counter:
            step().backward(cot)
        kernels = {k: v for k, v in counter.ops.items() if k.startswith("triton ")}
        assert sum(kernels.values()) == 9 and kernels["triton cema._bwd_reduce"] == 1, (
            step.__name__,
            kernels,
        )
        assert counter.total == 9, (step.__name__, counter.ops)
