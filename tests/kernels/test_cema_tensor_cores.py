"""CEMA as GEMMs on the tensor cores (kernels/cema/tensor_cores.py) against the float64 oracles of
tests/support/oracles.py (the literal recurrence, the explicit bidirectional double sum, the coefficients
from the raw parameters), forward and every gradient with random cotangents on y and h_last.

Runs on CPU tensors under the Triton interpreter (TRITON_INTERPRET=1, set before Triton is imported) and on
CUDA tensors natively where there is a GPU; the module is called directly (dispatch picks the reference
for CPU tensors). Every buffer the launchers allocate is pre-filled with NaN, so an element no kernel wrote
shows up. The cases cross the kernels' boundaries: one chunk shorter than T, a ragged last chunk, the last
chunk alone in a second block of 16 chunks, channel counts not a multiple of the 4 a program owns, N < 16.
"""

import os
import types

import torch

if not torch.cuda.is_available():  # before triton is imported: run the kernels under the interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import oracles  # noqa: E402
import pytest  # noqa: E402

pytest.importorskip("triton")

from triton_support import DEVICE, INTERPRET, gpu_only, nan_allocations, needs_device, opcheck_cema_ops  # noqa: E402

import kernels.cema  # noqa: E402
from kernels.cema import reference  # noqa: E402
from kernels.cema import tensor_cores as tc  # noqa: E402

pytestmark = needs_device

# max |err| / max |ref| against float64: the interpreter multiplies in float32; a GPU in tf32x3 (three TF32
# products, float32-accurate but not bit-equal), judged as the scan's kernel tests are
TOL = 5e-6 if INTERPRET else 2e-5
F64 = (torch.float64, torch.complex128)
F32 = (torch.float32, torch.complex64)


def raw_parameters(rows, N, seed, memory=-2.5):
    """float64 alpha, delta [R, N, 1], theta [R, 1, 1], gamma [R, N, 2] holding float32 values; a quarter of
    the rows have alpha, delta ≈ ``memory`` (-2.5: |q| ≈ 0.994, -4: |q| ≈ 0.9997), the rest |q| spread over
    (0, 1); gamma with a nonzero imaginary part."""
    g = torch.Generator().manual_seed(seed)
    alpha = torch.randn(rows, N, 1, generator=g, dtype=torch.float64)
    delta = torch.randn(rows, N, 1, generator=g, dtype=torch.float64)
    alpha[: max(1, rows // 4)] = memory + 0.1 * alpha[: max(1, rows // 4)]
    delta[: max(1, rows // 4)] = memory + 0.1 * delta[: max(1, rows // 4)]
    theta = torch.randn(rows, 1, 1, generator=g, dtype=torch.float64)
    gamma = torch.randn(rows, N, 2, generator=g, dtype=torch.float64)
    return [t.float().double() for t in (alpha, delta, theta, gamma)]


def make_case(B, L, D, N, seed, bidirectional=False, h0=False, padding=False, memory=-2.5):
    """float64 tensors holding float32-representable values: [x, p, q, gamma, omega, h0], padding_mask."""
    g = torch.Generator().manual_seed(seed)
    rows = 2 * D if bidirectional else D
    p, q, gamma = oracles.cema_coefficients(*raw_parameters(rows, N, seed, memory))
    omega = 0.5 * torch.randn(D, generator=g, dtype=torch.float64)
    x = torch.randn(B, L, D, generator=g, dtype=torch.float64)
    state = torch.complex(*torch.randn(2, B, D, N, generator=g, dtype=torch.float64)) if h0 else None
    mask = None
    if padding:
        mask = torch.rand(B, L, generator=g) < 0.3
        mask[0, : min(2, L)] = True
    f32 = lambda t: None if t is None else t.to(torch.complex64 if t.is_complex() else torch.float32)
    f64 = lambda t: None if t is None else t.to(torch.complex128 if t.is_complex() else torch.float64)
    return [f64(f32(t)) for t in (x, p, q, gamma, omega, state)], mask


def cotangents(outputs, seed=1234):
    g = torch.Generator().manual_seed(seed)
    cots = []
    for o in outputs:
        c = torch.randn(2, *o.shape, generator=g, dtype=torch.float64)
        cots.append((torch.complex(c[0], c[1]) if o.is_complex() else c[0]).to(o.device, o.dtype))
    return cots


def oracle_vjp(tensors, mask, bidirectional):
    """The float64 oracle: outputs [y (, h_last)] and the gradients of x, p, q, γ, ω (, h0)."""
    leaves = [None if t is None else t.clone().requires_grad_() for t in tensors]
    x, p, q, gamma, omega, h0 = leaves
    xm = x if mask is None else x.masked_fill(mask.unsqueeze(-1), 0.0)
    if bidirectional:
        outs = [oracles.cema_bidirectional(xm, p, q, gamma, omega)]
    else:
        outs = list(oracles.cema_recurrence(xm, p, q, gamma, omega, h0))
    wrt = [t for t in leaves if t is not None]
    return [o.detach() for o in outs], list(torch.autograd.grad(outs, wrt, cotangents(outs)))


def module_vjp(module, tensors, mask, bidirectional, dtype, x_dtype=None, **kwargs):
    """``module.cema`` on ``DEVICE``: outputs [y (, h_last)] and the gradients of its inputs."""
    cast = lambda t: None if t is None else t.to(DEVICE, dtype[t.is_complex()]).requires_grad_()
    leaves = [cast(t) for t in tensors]
    if x_dtype is not None:
        leaves[0] = leaves[0].detach().to(x_dtype).requires_grad_()
    x, p, q, gamma, omega, h0 = leaves
    y, h_last = module.cema(
        x, p, q, gamma, omega, h0=h0, bidirectional=bidirectional,
        padding_mask=None if mask is None else mask.to(DEVICE), return_state=not bidirectional, **kwargs,
    )  # fmt: skip
    outs = [y] + ([] if bidirectional else [h_last])
    wrt = [t for t in leaves if t is not None]
    return [o.detach() for o in outs], list(torch.autograd.grad(outs, wrt, cotangents(outs)))


NAMES = ["x", "p", "q", "gamma", "omega", "h0"]

CASES = {
    # B, L, D, N, bidirectional, h0, padding, chunk_size
    "L1-h0": (2, 1, 5, 4, False, True, False, None),
    "L7-h0-pad-shorter-than-T32": (2, 7, 6, 3, False, True, True, 32),
    "L70-h0-pad-T16-ragged": (2, 70, 5, 4, False, True, True, 16),
    "L100-T64-no-h0": (2, 100, 5, 4, False, False, False, 64),
    "L257-h0-pad-T16-last-chunk-alone-in-block-2": (1, 257, 5, 4, False, True, True, 16),
    "bidir-L40-pad-T16": (2, 40, 5, 4, True, False, True, 16),
    "bidir-L300-pad-T16-two-blocks": (1, 300, 4, 3, True, False, True, 16),
}


@pytest.mark.parametrize("case", list(CASES))
def test_forward_and_gradients_match_float64_oracle(case):
    check_case(case)


@pytest.mark.skipif(not INTERPRET, reason="the interpreter's own padding of N")
def test_modes_padded_to_16_as_on_a_gpu(monkeypatch):
    """Under the interpreter N is padded only to a power of two (fast scans); once with the GPU's 16."""
    monkeypatch.setattr(tc, "_MIN_BN", 16)
    check_case("L70-h0-pad-T16-ragged")


def check_case(case):
    B, L, D, N, bidirectional, h0, padding, chunk = CASES[case]
    tensors, mask = make_case(B, L, D, N, seed=len(case), bidirectional=bidirectional, h0=h0, padding=padding)
    ref_out, ref_grads = oracle_vjp(tensors, mask, bidirectional)
    with nan_allocations():
        out, grads = module_vjp(tc, tensors, mask, bidirectional, F32, chunk_size=chunk)
    assert out[0].dtype == torch.float32 and out[0].shape == (B, L, D)
    names = (
        ["y"] + ([] if bidirectional else ["h_last"]) + [n for n, t in zip(NAMES, tensors) if t is not None]
    )
    for name, a, b in zip(names, out + grads, ref_out + ref_grads):
        assert torch.isfinite(a).all(), f"{case}: {name} has non-finite (unwritten) elements"
        err = oracles.max_rel_err(a.cpu(), b)
        assert err <= TOL, f"{case}: {name} relative error {err:.2e}"
    if padding:  # padded inputs are zeroed first: their gradient is exactly zero
        assert (grads[0].cpu()[mask] == 0).all()


@pytest.mark.parametrize("bidirectional", [False, True], ids=["causal", "bidir"])
def test_float16_input_within_twice_the_pytorch_error(bidirectional):
    """x in float16 (parameters, state and math float32): the errors of y and of every gradient against
    float64 are at most 2x those of the same computation in PyTorch (the reference's chunked method, x in
    float16) + atol."""
    B, L, D, N = 2, 50, 5, 4
    tensors, mask = make_case(
        B, L, D, N, seed=3, bidirectional=bidirectional, h0=not bidirectional, padding=True
    )
    ref = oracle_vjp(tensors, mask, bidirectional)
    ref = ref[0] + ref[1]
    with nan_allocations():
        out, grads = module_vjp(tc, tensors, mask, bidirectional, F32, x_dtype=torch.float16, chunk_size=16)
    assert out[0].dtype == grads[0].dtype == torch.float16
    torch_out, torch_grads = module_vjp(
        types.SimpleNamespace(cema=reference.cema), tensors, mask, bidirectional, F32, x_dtype=torch.float16,
        method="chunked", chunk_size=16,
    )  # fmt: skip
    for a, t, b in zip(out + grads, torch_out + torch_grads, ref):
        err, err_torch = oracles.max_rel_err(a.cpu(), b), oracles.max_rel_err(t.cpu(), b)
        assert err <= 2 * err_torch + 1e-5, (err, err_torch)


@pytest.mark.parametrize("bidirectional", [False, True], ids=["causal", "bidir"])
def test_from_raw_parameters_matches_float64_oracle(bidirectional):
    """``cema_from_parameters``: the coefficient kernel's real outputs feeding the GEMM form, against the
    recurrence (or the double sum) on the oracle's coefficients; gradients of x, alpha, delta, theta,
    gamma and omega."""
    B, L, D, N = 2, 37, 5, 4
    rows = 2 * D if bidirectional else D
    params = raw_parameters(rows, N, seed=11)
    g = torch.Generator().manual_seed(12)
    x = torch.randn(B, L, D, generator=g, dtype=torch.float64).float().double()
    omega = torch.randn(D, generator=g, dtype=torch.float64).float().double()
    mask = torch.rand(B, L, generator=g) < 0.3
    cot = torch.randn(B, L, D, generator=g, dtype=torch.float64)

    def oracle(x, alpha, delta, theta, gamma, omega):
        p, q, gc = oracles.cema_coefficients(alpha, delta, theta, gamma)
        xm = x.masked_fill(mask.unsqueeze(-1), 0.0)
        if bidirectional:
            return oracles.cema_bidirectional(xm, p, q, gc, omega)
        return oracles.cema_recurrence(xm, p, q, gc, omega)[0]

    def kernel(x, alpha, delta, theta, gamma, omega):
        return tc.cema_from_parameters(
            x, alpha, delta, theta, gamma, omega, bidirectional, mask.to(DEVICE), 16
        )

    def vjp(fn, leaves):
        leaves = [t.clone().requires_grad_() for t in leaves]
        y = fn(*leaves)
        return [y.detach()] + list(torch.autograd.grad(y, leaves, cot.to(y.device, y.dtype)))

    with nan_allocations():
        got = vjp(kernel, [t.to(DEVICE, torch.float32) for t in (x, *params, omega)])
    want = vjp(oracle, [x, *params, omega])
    for name, a, b in zip(["y", "x", "alpha", "delta", "theta", "gamma", "omega"], got, want):
        assert torch.isfinite(a).all(), f"{name} has non-finite (unwritten) elements"
        err = oracles.max_rel_err(a.cpu(), b)
        assert err <= TOL, f"{name} relative error {err:.2e}"


def test_float32_long_memory_state_passing():
    """|q| ≈ 0.9997 over 32 chunks of 64 steps in two blocks: the powers q^e (float64, rounded once) keep the
    phase; an error of arg q at float32 rounding would grow e-fold in q^e and again along the chunks."""
    tensors, _ = make_case(1, 2048, 4, 4, seed=21, h0=True, memory=-4.0)
    x, p, q, gamma, omega, h0 = tensors
    y_ref, h_ref = oracles.cema_recurrence(x, p, q, gamma, omega, h0)
    args = [t.to(DEVICE, torch.complex64 if t.is_complex() else torch.float32) for t in tensors]
    with torch.no_grad():
        y, h = tc.cema(*args[:5], h0=args[5], return_state=True, chunk_size=64)
    assert oracles.max_rel_err(y.cpu(), y_ref) <= 1e-5 and oracles.max_rel_err(h.cpu(), h_ref) <= 1e-5


@gpu_only
def test_deterministic():
    """Two runs give bitwise-equal outputs and gradients (no atomics; fixed-order partial sums). GPU only: the
    interpreter runs programs one after another, so there it could not fail."""
    tensors, mask = make_case(2, 20, 5, 4, seed=5, h0=True, padding=True)
    first = module_vjp(tc, tensors, mask, False, F32, chunk_size=16)
    second = module_vjp(tc, tensors, mask, False, F32, chunk_size=16)
    for a, b in zip(first[0] + first[1], second[0] + second[1]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("bidirectional", [False, True], ids=["causal", "bidir"])
def test_custom_ops_pass_opcheck(bidirectional):
    """torch.library.opcheck of both ops: the schema, the fake shapes / dtypes / strides against the real
    outputs, the op under AOT dispatch."""
    opcheck_cema_ops(torch.ops.mega_suite.cema_tc_fwd, torch.ops.mega_suite.cema_tc_bwd, bidirectional, 16)


def test_torch_compile_keeps_one_graph():
    """The kernels are two custom ops with fake implementations: torch.compile traces a caller of ``cema``
    whole (fullgraph: a graph break inside it fails) and gives the eager kernels' outputs and gradients."""
    tensors, mask = make_case(2, 7, 5, 4, seed=3, h0=True, padding=True)
    torch._dynamo.reset()

    def caller(*args, **kwargs):
        return tc.cema(*args, **kwargs)

    compiled = types.SimpleNamespace(cema=torch.compile(caller, backend="aot_eager", fullgraph=True))
    got = module_vjp(compiled, tensors, mask, False, F32, chunk_size=16)
    want = module_vjp(tc, tensors, mask, False, F32, chunk_size=16)
    for a, b in zip(got[0] + got[1], want[0] + want[1]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_bad_chunk_size_is_named():
    tensors, _ = make_case(1, 5, 2, 2, seed=1)
    args = [t.to(DEVICE, torch.complex64 if t.is_complex() else torch.float32) for t in tensors[:5]]
    with pytest.raises(ValueError, match=r"chunk_size must be one of \(16, 32, 64, 128\), got 48"):
        tc.cema(*args, chunk_size=48)


@gpu_only
@pytest.mark.parametrize("bidirectional", [False, True], ids=["causal", "bidir"])
def test_bf16_error_within_twice_pytorch(bidirectional):
    """bf16 input at a longer shape (float32 parameters and state): the errors of y and of every gradient
    against float64 are at most 2x those of the reference's chunked method with the same bf16 input + atol."""
    B, L, D, N = 2, 1024, 32, 16  # (the bidirectional oracle builds [D, L, L] Toeplitz matrices)
    tensors, mask = make_case(
        B, L, D, N, seed=11, bidirectional=bidirectional, h0=not bidirectional, padding=True
    )
    ref = oracle_vjp(tensors, mask, bidirectional)
    ref = ref[0] + ref[1]
    out = module_vjp(tc, tensors, mask, bidirectional, F32, x_dtype=torch.bfloat16)
    torch_out = module_vjp(
        types.SimpleNamespace(cema=reference.cema), tensors, mask, bidirectional, F32, x_dtype=torch.bfloat16,
        method="chunked",
    )  # fmt: skip
    for a, t, b in zip(out[0] + out[1], torch_out[0] + torch_out[1], ref):
        err, err_torch = oracles.max_rel_err(a.cpu(), b), oracles.max_rel_err(t.cpu(), b)
        assert err <= 2 * err_torch + 1e-5, (err, err_torch)


# ------------------------------------------------------------------------------------------------ dispatch


def test_method_tensor_cores_on_cpu_is_the_chunked_reference():
    """Off CUDA, ``method="tensor_cores"`` runs the reference's chunked method (the same math)."""
    tensors, mask = make_case(2, 30, 3, 4, seed=2, h0=True, padding=True)
    x, p, q, gamma, omega, h0 = tensors
    y, h = kernels.cema.cema(
        x, p, q, gamma, omega, h0, padding_mask=mask, method="tensor_cores", return_state=True
    )
    (y_ref, h_ref), _ = oracle_vjp(tensors, mask, False)
    torch.testing.assert_close(y, y_ref, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(h, h_ref, rtol=1e-9, atol=1e-9)


def test_engine_selection(monkeypatch):
    """With Triton taken (``use_triton`` patched true, so CPU tensors run the kernels in the interpreter):
    ``method="auto"`` runs the scan unless ``MEGA_SUITE_CEMA=tc`` or ``force_engine`` says otherwise;
    ``method="tensor_cores"`` always runs the GEMM form; the results equal the oracle either way."""
    from kernels.cema import triton as scan

    calls = []
    for module, name in ((tc, "tc"), (scan, "scan")):
        for fn in ("cema", "cema_from_parameters"):
            original = getattr(module, fn)
            monkeypatch.setattr(
                module, fn, lambda *a, _o=original, _n=name, **k: calls.append(_n) or _o(*a, **k)
            )
    monkeypatch.setattr(kernels.cema, "use_triton", lambda *tensors: True)
    tensors, _ = make_case(1, 20, 3, 4, seed=4)
    x, p, q, gamma, omega, _ = (None if t is None else t.to(DEVICE, F32[t.is_complex()]) for t in tensors)
    y_ref = oracles.cema_recurrence(*tensors[:5])[0]
    params = [t.float().to(DEVICE) for t in raw_parameters(3, 4, seed=4)]
    for env, method, forced, expected in [
        (None, "auto", None, "scan"),
        ("tc", "auto", None, "tc"),
        ("scan", "tensor_cores", None, "tc"),
        ("tc", "auto", "scan", "scan"),
        (None, "auto", "tensor_cores", "tc"),
    ]:
        if env is None:
            monkeypatch.delenv("MEGA_SUITE_CEMA", raising=False)
        else:
            monkeypatch.setenv("MEGA_SUITE_CEMA", env)
        kernels.cema.force_engine(forced)
        try:
            calls.clear()
            y, _ = kernels.cema.cema(x, p, q, gamma, omega, method=method)
            kernels.cema.cema_from_parameters(x, *params, omega, method=method)
        finally:
            kernels.cema.force_engine(None)
        assert calls == [expected, expected], (env, method, forced, calls)
        assert oracles.max_rel_err(y.cpu(), y_ref) <= 2e-5
    monkeypatch.setenv("MEGA_SUITE_CEMA", "gemm")
    with pytest.raises(ValueError, match="MEGA_SUITE_CEMA must be one of .* got 'gemm'"):
        kernels.cema.cema(x, p, q, gamma, omega)
    with pytest.raises(ValueError, match="CEMA engine must be one of"):
        kernels.cema.force_engine("fft")
