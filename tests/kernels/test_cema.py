"""CEMA (docs/architecture.md#cema) against the float64 oracles of tests/support/oracles.py: every method, odd lengths, carried and
returned state, bidirectional mode, padding, gradients and float32 precision at long length."""

import oracles
import pytest
import torch

from kernels.cema import cema, cema_coefficients

METHODS = ["fft", "chunked", "sequential", "auto"]
LENGTHS = [1, 7, 63, 65, 300]
F64 = dict(rtol=1e-9, atol=1e-9)


def raw_params(D, N, seed, long_memory=True):
    """Raw parameters as in docs/architecture.md#cema, but with a nonzero imaginary part of gamma (the init's 0 would leave
    Im(γ) untested) and wider alpha/delta so |q| spans (0, 1); the first channels get |q| ≈ 0.9997."""
    g = torch.Generator().manual_seed(seed)
    alpha = torch.randn(D, N, 1, generator=g, dtype=torch.float64)
    delta = torch.randn(D, N, 1, generator=g, dtype=torch.float64)
    if long_memory:
        alpha[: max(1, D // 4)] = -4.0 + 0.1 * alpha[: max(1, D // 4)]
        delta[: max(1, D // 4)] = -4.0 + 0.1 * delta[: max(1, D // 4)]
    perm = torch.randperm(D, generator=g).double() + 1
    theta = torch.logit(D ** (-perm / D)).reshape(D, 1, 1)
    gamma = torch.randn(D, N, 2, generator=g, dtype=torch.float64)
    omega = (0.25 * torch.randn(D, generator=g, dtype=torch.float64)).clamp(-1, 1)
    return alpha, delta, theta, gamma, omega


def coefficients(D, N, seed, long_memory=True):
    alpha, delta, theta, gamma, omega = raw_params(D, N, seed, long_memory)
    p, q, gamma_c = oracles.cema_coefficients(alpha, delta, theta, gamma)
    return p, q, gamma_c, omega


def random_state(B, D, N, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.complex(
        torch.randn(B, D, N, generator=g, dtype=torch.float64),
        torch.randn(B, D, N, generator=g, dtype=torch.float64),
    )


def random_input(B, L, D, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, L, D, generator=g, dtype=torch.float64).to(dtype)


# --------------------------------------------------------------------------------------------------------
# coefficients
# --------------------------------------------------------------------------------------------------------


def test_oracles_agree():
    """The recurrence oracle and the convolution form of docs/architecture.md#cema are the same map (checks the oracles)."""
    p, q, gamma, omega = coefficients(3, 4, seed=0)
    x = random_input(2, 40, 3, seed=1)
    h0 = random_state(2, 3, 4, seed=2)
    y, h_last = oracles.cema_recurrence(x, p, q, gamma, omega, h0)
    taps = oracles.cema_kernel_taps(p, q, gamma, 40)  # [D, L]
    t = torch.arange(40)
    conv = torch.stack([(taps[:, i - torch.arange(i + 1)].T * x[:, : i + 1]).sum(1) for i in t], 1)
    q_pow = torch.exp((t[:, None, None] + 1) * torch.log(q))  # q^{t+1}
    from_h0 = torch.einsum("dn,tdn,bdn->btd", gamma, q_pow, h0).real
    torch.testing.assert_close(y, conv + from_h0 + omega * x, **F64)
    h_conv = torch.einsum("tdn,btd->bdn", q ** (39 - t[:, None, None]) * p, x.to(torch.complex128))
    torch.testing.assert_close(h_last, h_conv + q**40 * h0, **F64)


def test_coefficients_match_spec():
    alpha, delta, theta, gamma, _ = raw_params(6, 16, seed=3)
    p, q, gamma_c = cema_coefficients(alpha, delta, theta, gamma)
    p_ref, q_ref, gamma_ref = oracles.cema_coefficients(alpha, delta, theta, gamma)
    assert p.shape == (6, 16) and q.shape == (6, 16) and gamma_c.shape == (6, 16)
    assert not p.is_complex() and p.dtype == torch.float64
    assert q.dtype == torch.complex128 and gamma_c.dtype == torch.complex128
    torch.testing.assert_close(p, p_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(q, q_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(gamma_c, gamma_ref, rtol=1e-12, atol=1e-12)
    assert (q.abs() < 1).all()


def test_coefficients_gradcheck():
    alpha, delta, theta, gamma, _ = (t.requires_grad_() for t in raw_params(2, 3, seed=4))

    def f(alpha, delta, theta, gamma):
        p, q, gamma_c = cema_coefficients(alpha, delta, theta, gamma)
        return p, torch.view_as_real(q.resolve_conj()), torch.view_as_real(gamma_c.resolve_conj())

    assert torch.autograd.gradcheck(f, (alpha, delta, theta, gamma))


# --------------------------------------------------------------------------------------------------------
# forward against the oracle
# --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("with_h0", [False, True], ids=["h0=None", "h0"])
@pytest.mark.parametrize("L", LENGTHS)
@pytest.mark.parametrize("method", METHODS)
def test_unidirectional_matches_recurrence(method, L, with_h0):
    B, D, N = 2, 5, 4
    p, q, gamma, omega = coefficients(D, N, seed=L)
    x = random_input(B, L, D, seed=100 + L)
    h0 = random_state(B, D, N, seed=200 + L) if with_h0 else None
    y_ref, h_ref = oracles.cema_recurrence(x, p, q, gamma, omega, h0)
    y, h_last = cema(x, p, q, gamma, omega, h0=h0, method=method, return_state=True)
    assert y.shape == (B, L, D) and y.dtype == torch.float64
    assert h_last.shape == (B, D, N) and h_last.dtype == torch.complex128
    torch.testing.assert_close(y, y_ref, **F64)
    torch.testing.assert_close(h_last, h_ref, **F64)


@pytest.mark.parametrize("method", METHODS)
def test_carried_state_equals_one_pass(method):
    """Three segments chained through h_last/h0 reproduce the oracle on the whole sequence."""
    B, D, N, L = 2, 4, 3, 150
    p, q, gamma, omega = coefficients(D, N, seed=7)
    x = random_input(B, L, D, seed=8)
    y_ref, h_ref = oracles.cema_recurrence(x, p, q, gamma, omega)
    h, ys = None, []
    for start, end in [(0, 37), (37, 38), (38, L)]:
        y, h = cema(x[:, start:end], p, q, gamma, omega, h0=h, method=method, return_state=True)
        ys.append(y)
    torch.testing.assert_close(torch.cat(ys, 1), y_ref, **F64)
    torch.testing.assert_close(h, h_ref, **F64)


@pytest.mark.parametrize("L", LENGTHS)
@pytest.mark.parametrize("method", METHODS)
def test_bidirectional_matches_double_sum(method, L):
    B, D, N = 2, 4, 3
    p, q, gamma, omega = coefficients(2 * D, N, seed=L + 1)
    omega = omega[:D]
    x = random_input(B, L, D, seed=300 + L)
    y, _ = cema(x, p, q, gamma, omega, bidirectional=True, method=method)
    assert y.shape == (B, L, D)
    torch.testing.assert_close(y, oracles.cema_bidirectional(x, p, q, gamma, omega), **F64)


def padding_mask(B, L, seed):
    """Random padding (True = pad) with a left-padded row, a right-padded row and scattered holes."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(B, L, generator=g) < 0.3
    mask[0, :5] = True
    mask[1, L - 9 :] = True
    return mask


@pytest.mark.parametrize("method", METHODS)
def test_unidirectional_padding_zeroes_input(method):
    """Padded x is zeroed before the op: valid outputs and h_last equal the oracle on the zeroed input,
    whatever the padded positions hold."""
    B, D, N, L = 3, 4, 3, 65
    p, q, gamma, omega = coefficients(D, N, seed=9)
    mask = padding_mask(B, L, seed=10)
    x = random_input(B, L, D, seed=11)
    x_garbage = x.masked_fill(mask[..., None], 1e3)
    h0 = random_state(B, D, N, seed=12)
    y_ref, h_ref = oracles.cema_recurrence(x.masked_fill(mask[..., None], 0), p, q, gamma, omega, h0)
    y, h_last = cema(
        x_garbage, p, q, gamma, omega, h0=h0, padding_mask=mask, method=method, return_state=True
    )
    valid = ~mask
    torch.testing.assert_close(y[valid], y_ref[valid], **F64)
    torch.testing.assert_close(h_last, h_ref, **F64)


@pytest.mark.parametrize("method", METHODS)
def test_bidirectional_padding_never_changes_valid_outputs(method):
    B, D, N, L = 3, 4, 3, 65
    p, q, gamma, omega = coefficients(2 * D, N, seed=13)
    omega = omega[:D]
    x = random_input(B, L, D, seed=14)
    # Right padding of varying length: each row's valid outputs equal the oracle on its unpadded prefix.
    lengths = [L, 40, 1]
    mask = torch.arange(L)[None, :] >= torch.tensor(lengths)[:, None]
    y, _ = cema(
        x.masked_fill(mask[..., None], -7.0),
        p,
        q,
        gamma,
        omega,
        bidirectional=True,
        padding_mask=mask,
        method=method,
    )
    for b, n in enumerate(lengths):
        ref = oracles.cema_bidirectional(x[b : b + 1, :n], p, q, gamma, omega)
        torch.testing.assert_close(y[b : b + 1, :n], ref, **F64)
    # Scattered padding: valid outputs equal the double sum over the zeroed input.
    mask = padding_mask(B, L, seed=15)
    y, _ = cema(
        x.masked_fill(mask[..., None], 5.0),
        p,
        q,
        gamma,
        omega,
        bidirectional=True,
        padding_mask=mask,
        method=method,
    )
    ref = oracles.cema_bidirectional(x.masked_fill(mask[..., None], 0), p, q, gamma, omega)
    torch.testing.assert_close(y[~mask], ref[~mask], **F64)


def test_return_state_flag_and_dtype():
    p, q, gamma, omega = coefficients(3, 2, seed=16)
    x = random_input(1, 9, 3, seed=17, dtype=torch.float32)
    y, h_last = cema(x, p.float(), q.to(torch.complex64), gamma.to(torch.complex64), omega.float())
    assert h_last is None
    assert y.dtype == torch.float32 and y.shape == (1, 9, 3)


def test_bidirectional_rejects_h0():
    p, q, gamma, omega = coefficients(4, 2, seed=18)
    x = random_input(1, 5, 2, seed=19)
    with pytest.raises((ValueError, AssertionError, RuntimeError)):
        cema(x, p, q, gamma, omega[:2], h0=random_state(1, 2, 2, seed=20), bidirectional=True)


# --------------------------------------------------------------------------------------------------------
# gradients
# --------------------------------------------------------------------------------------------------------


def _as_real(h):
    return torch.stack([h.real, h.imag], dim=-1)


@pytest.mark.parametrize("method", METHODS)
def test_gradcheck_unidirectional(method):
    """Full Jacobian check of y and h_last w.r.t. x, p, q (complex), gamma (complex), omega, h0 (complex)."""
    B, L, D, N = 1, 6, 2, 3
    p, q, gamma, omega = coefficients(D, N, seed=21, long_memory=False)
    inputs = [random_input(B, L, D, seed=22), p, q, gamma, omega, random_state(B, D, N, seed=23)]
    inputs = [t.clone().requires_grad_() for t in inputs]

    def f(x, p, q, gamma, omega, h0):
        y, h_last = cema(x, p, q, gamma, omega, h0=h0, method=method, return_state=True)
        return y, _as_real(h_last)

    assert torch.autograd.gradcheck(f, inputs)


@pytest.mark.parametrize("method", METHODS)
def test_gradcheck_bidirectional(method):
    B, L, D, N = 1, 5, 2, 2
    p, q, gamma, omega = coefficients(2 * D, N, seed=24, long_memory=False)
    mask = torch.tensor([[False, False, False, True, False]])
    inputs = [random_input(B, L, D, seed=25), p, q, gamma, omega[:D]]
    inputs = [t.clone().requires_grad_() for t in inputs]

    def f(x, p, q, gamma, omega):
        return cema(x, p, q, gamma, omega, bidirectional=True, padding_mask=mask, method=method)[0]

    assert torch.autograd.gradcheck(f, inputs)


@pytest.mark.parametrize("method", METHODS)
def test_gradients_match_oracle(method):
    """Random cotangents on y and on h_last: vector-Jacobian products equal the oracle's, at a length that
    spans several chunks and with padding."""
    B, L, D, N = 2, 130, 3, 4
    p, q, gamma, omega = coefficients(D, N, seed=26)
    x = random_input(B, L, D, seed=27)
    h0 = random_state(B, D, N, seed=28)
    mask = padding_mask(B, L, seed=29)
    g = torch.Generator().manual_seed(30)
    cot_y = torch.randn(B, L, D, generator=g, dtype=torch.float64)
    cot_h = torch.randn(B, D, N, 2, generator=g, dtype=torch.float64)

    def vjp(fn):
        leaves = [t.clone().requires_grad_() for t in (x, p, q, gamma, omega, h0)]
        y, h_last = fn(*leaves)
        loss = (y * cot_y)[~mask].sum() + (_as_real(h_last) * cot_h).sum()
        return torch.autograd.grad(loss, leaves)

    def kernel(x, p, q, gamma, omega, h0):
        return cema(x, p, q, gamma, omega, h0=h0, padding_mask=mask, method=method, return_state=True)

    def oracle(x, p, q, gamma, omega, h0):
        return oracles.cema_recurrence(x.masked_fill(mask[..., None], 0), p, q, gamma, omega, h0)

    for name, got, want in zip(["x", "p", "q", "gamma", "omega", "h0"], vjp(kernel), vjp(oracle)):
        torch.testing.assert_close(got, want, **F64, msg=lambda m, name=name: f"grad {name}: {m}")


# --------------------------------------------------------------------------------------------------------
# float32 precision at long length
# --------------------------------------------------------------------------------------------------------

_LONG = {}
MEMORY = ["init", "long"]


def float32_coefficients(D, N, seed, memory):
    """Coefficients rounded to float32 / complex64. "init": alpha, delta at the documented init scale N(0, 0.2²)
    (|q| ≈ 0.75, short memory); "long": a quarter of the channels with |q| ≈ 0.9997 (memory ≈ 3000 steps,
    phases up to 2π), as trained long-context layers have."""
    alpha, delta, theta, gamma, omega = raw_params(D, N, seed, long_memory=memory == "long")
    if memory == "init":
        alpha, delta = 0.2 * alpha, 0.2 * delta
    p, q, gamma_c = oracles.cema_coefficients(alpha, delta, theta, gamma)
    return p.float(), q.to(torch.complex64), gamma_c.to(torch.complex64), omega.float()


def _f64(*tensors):
    return [t.to(torch.complex128 if t.is_complex() else torch.float64) for t in tensors]


def _long_case(memory):
    """L = 4096, D = 8, N = 16, with a carried h0. The float64 reference runs on the float32-rounded inputs,
    so only the arithmetic of the kernel is measured."""
    if memory not in _LONG:
        B, L, D, N = 1, 4096, 8, 16
        coeffs32 = float32_coefficients(D, N, seed=31, memory=memory)
        x32 = random_input(B, L, D, seed=32, dtype=torch.float32)
        h0_32 = random_state(B, D, N, seed=33).to(torch.complex64)
        ref = oracles.cema_recurrence(*_f64(x32, *coeffs32, h0_32))
        _LONG[memory] = dict(args32=(x32, *coeffs32), h0=h0_32, ref=ref)
    return _LONG[memory]


@pytest.mark.parametrize("memory", MEMORY)
@pytest.mark.parametrize("method", METHODS)
def test_float32_long_sequence_precision(method, memory):
    """Relative error = max |err| / max |ref| over the whole output, must be ≤ 1e-5 for y and for h_last."""
    case = _long_case(memory)
    y, h_last = cema(*case["args32"], h0=case["h0"], method=method, return_state=True)
    assert y.dtype == torch.float32
    y_ref, h_ref = case["ref"]
    assert torch.isfinite(y).all()
    err_y, err_h = oracles.max_rel_err(y, y_ref), oracles.max_rel_err(h_last, h_ref)
    assert err_y <= 1e-5 and err_h <= 1e-5, f"{method}: relative error y {err_y:.2e}, h_last {err_h:.2e}"


@pytest.mark.parametrize("memory", MEMORY)
def test_float32_bidirectional_long_sequence_precision(memory):
    B, L, D, N = 1, 4096, 4, 16
    p32, q32, gamma32, omega32 = float32_coefficients(2 * D, N, seed=34, memory=memory)
    omega32 = omega32[:D]
    x32 = random_input(B, L, D, seed=35, dtype=torch.float32)
    # float64 reference of the double sum via the two recurrences (forward on x, backward on the flipped x);
    # the s = t term appears in both, as in docs/architecture.md#cema.
    x64, p64, q64, g64 = _f64(x32, p32, q32, gamma32)
    zero = torch.zeros(D, dtype=torch.float64)
    fwd, _ = oracles.cema_recurrence(x64, p64[:D], q64[:D], g64[:D], zero)
    bwd, _ = oracles.cema_recurrence(x64.flip(1), p64[D:], q64[D:], g64[D:], zero)
    ref = fwd + bwd.flip(1) + omega32.double() * x64
    y, _ = cema(x32, p32, q32, gamma32, omega32, bidirectional=True)
    assert y.dtype == torch.float32 and torch.isfinite(y).all()
    err = oracles.max_rel_err(y, ref)
    assert err <= 1e-5, f"bidirectional y relative error {err:.2e}"


@pytest.mark.parametrize("bidirectional", [False, True], ids=["causal", "bidir"])
def test_fft_convolution_function(bidirectional):
    """The FFT convolution Function (x and the kernel kept, spectra recomputed in backward) against the
    direct sums y_t = sum_{s<=t} k_{t-s} x_s (+ sum_{s>=t} kb_{s-t} x_s) and finite differences, float64."""
    from kernels.cema.reference import _FFTConv

    B, D, L = 2, 3, 7
    g = torch.Generator().manual_seed(3)
    x = torch.randn(B, D, L, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2 * D if bidirectional else D, L, generator=g, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(lambda a, b: _FFTConv.apply(a, b, bidirectional), (x, k))
    lag = torch.arange(L).view(L, 1) - torch.arange(L).view(1, L)  # t - s
    toeplitz = k[:D][:, lag.clamp(min=0)] * (lag >= 0)  # [D, t, s]
    if bidirectional:
        toeplitz = toeplitz + k[D:][:, (-lag).clamp(min=0)] * (lag <= 0)
    want = torch.einsum("dts,bds->bdt", toeplitz, x)
    got = _FFTConv.apply(x, k, bidirectional)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    cot = torch.randn(got.shape, generator=g, dtype=torch.float64)
    for a, b in zip(
        torch.autograd.grad((got * cot).sum(), (x, k)), torch.autograd.grad((want * cot).sum(), (x, k))
    ):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
