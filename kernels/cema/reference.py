"""Complex exponential moving average (CEMA), docs/architecture.md#cema, in plain PyTorch.

Three exact methods that agree to rounding:

- ``sequential``: the recurrence h_t = p x_t + q h_{t-1}, one step at a time (decoding, tiny L, oracle-like).
- ``fft``: y = k * x with the kernel k_l = Re(sum_n gamma_n p_n q_n^l), as one FFT convolution.
- ``chunked``: intra-chunk Toeplitz matmuls plus state passing between chunks.

Powers of q are always exp(l * log q). Long power tables (D, N, L) are never built: every
"sum over n of c_n q_n^l" is evaluated blockwise as l = a*T + b, i.e. one batched matmul of a
(A x N) table of q^{aT} against an (N x T) table of q^b per channel (a Vandermonde product).
"""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

from kernels.recompute import recompute

__all__ = ["cema_coefficients", "cema", "cema_kernel", "cema_step"]


def _compute_dtype(t: Tensor) -> torch.dtype:
    # CEMA math stays in float32 under bf16/fp16 and in float64 for float64 models (docs/architecture.md#the-block).
    return torch.float64 if t.dtype in (torch.float64, torch.complex128) else torch.float32


def cema_coefficients(
    alpha: Tensor, delta: Tensor, theta: Tensor, gamma: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """Raw CEMA parameters -> (p [D,N] real, q [D,N] complex, gamma [D,N] complex).

    alpha, delta: [D, N, 1]; theta: [D, 1, 1]; gamma: [D, N, 2] (real, imaginary parts).
    p = sigmoid(alpha); |q| = 1 - sigmoid(alpha) sigmoid(delta); arg q_n = n * sigmoid(theta) 2pi/N.
    """
    dtype = _compute_dtype(alpha)
    d, n, _ = alpha.shape
    p = torch.sigmoid(alpha.to(dtype)).squeeze(-1)
    magnitude = 1.0 - p * torch.sigmoid(delta.to(dtype)).squeeze(-1)
    base = torch.sigmoid(theta.to(dtype)).reshape(d, 1) * (2 * math.pi / n)
    phase = base * torch.arange(1, n + 1, dtype=dtype, device=alpha.device)
    q = torch.complex(magnitude * torch.cos(phase), magnitude * torch.sin(phase))
    g = gamma.to(dtype) / math.sqrt(n)
    return p, q, torch.complex(g[..., 0], g[..., 1])


def _log(q: Tensor) -> Tensor:
    """log q in complex128: powers q^l = exp(l log q) amplify the phase error of log q by l, so a complex64
    log loses ~l * 1e-7 rad (1e-3 at l = 4096). The power tables are small ([D, N] x sqrt(L)).
    Written as log|q| + i arg q = ½ log(Re² + Im²) + i atan2(Im, Re) in float64 (|q| < 1: no overflow, and
    |q| = 1 - σ(α)σ(δ) is far above float64's underflow):
    the same value to 5e-16 as complex ``torch.log``, which is not vectorised on CPU (0.09 vs 0.57 ms at
    [512, 16], 1 thread)."""
    re, im = q.real.to(torch.float64), q.imag.to(torch.float64)
    return torch.complex(0.5 * torch.log(re * re + im * im), torch.atan2(im, re))


def _steps(count: int, device) -> Tensor:
    """A float64 scalar tensor holding ``count``, filled on the device: ``torch.tensor(count, device=...)``
    would copy from host memory, which a CUDA graph capture refuses (trainer.compile_mode=reduce-overhead)."""
    return torch.full((), float(count), dtype=torch.float64, device=device)


def _powers(log_q: Tensor, steps: Tensor, like: Tensor) -> Tensor:
    """exp(log_q * steps) in float64 (magnitude and phase as real tensors: complex exp is not vectorised on
    the CPU), returned in the complex dtype of ``like``: |q|^s (cos sθ + i sin sθ), written out because
    ``torch.polar`` is slower than the two vectorised products on the CPU
    (bench/reports/2026-11-24-cema-power-tables.md)."""
    steps = steps.to(torch.float64)
    rdt = torch.float64 if like.dtype == torch.complex128 else torch.float32
    # reduced mod 2π in float64 (then exact enough in float32) as x - 2π floor(x / 2π): the same to 1e-12
    # rad for the phases here, and faster than torch.remainder on the CPU
    angle = log_q.imag * steps
    phase = (angle - (2 * math.pi) * torch.floor(angle * (0.5 / math.pi))).to(rdt)
    magnitude = torch.exp(log_q.real * steps).to(rdt)
    return torch.complex(magnitude * torch.cos(phase), magnitude * torch.sin(phase))


def _block_size(length: int) -> int:
    return max(1, math.ceil(math.sqrt(length)))


def _vandermonde_real(c: Tensor, log_q: Tensor, length: int, offset: int = 0) -> Tensor:
    """out[m, d, l] = Re(sum_n c[m, d, n] * q[d, n]^(l + offset)) for l < length.

    c: [M, D, N] complex; log_q: [D, N] complex. Returns [M, D, length] real.
    """
    m, d, n = c.shape
    t = _block_size(length)
    a = math.ceil(length / t)
    dev, rdt = c.device, c.real.dtype
    steps_a = torch.arange(a, device=dev, dtype=rdt) * t + offset
    steps_b = torch.arange(t, device=dev, dtype=rdt)
    q_at = _powers(log_q.unsqueeze(1), steps_a.view(1, a, 1), c)  # [D, A, N]
    q_b = _powers(log_q.unsqueeze(-1), steps_b.view(1, 1, t), c)  # [D, N, T]
    left = c.permute(1, 0, 2).unsqueeze(2) * q_at.unsqueeze(1)  # [D, M, A, N]
    left = left.reshape(d, m * a, n)
    # Re(L R) = Lr Rr - Li Ri as one real matmul of width 2N.
    lhs = torch.cat([left.real, -left.imag], dim=-1)  # [D, M*A, 2N]
    rhs = torch.cat([q_b.real, q_b.imag], dim=1)  # [D, 2N, T]
    out = torch.bmm(lhs, rhs).reshape(d, m, a * t)[..., :length]
    return out.permute(1, 0, 2)


def cema_kernel(p: Tensor, q: Tensor, gamma: Tensor, length: int) -> Tensor:
    """k[d, l] = Re(sum_n gamma_n p_n q_n^l), l = 0..length-1. Returns [D, length]."""
    return _vandermonde_real((gamma * p).unsqueeze(0), _log(q), length)[0]


def _complex_bmm(x: Tensor, w: Tensor) -> Tensor:
    """Real [G, M, K] @ complex [G, K, N] -> complex [G, M, N] as one real bmm against [Re w, Im w].

    ``w.real`` / ``w.imag`` are stride-2 views; bmm on them takes a much slower non-contiguous path on the
    CPU, so the two halves are packed contiguously first."""
    n = w.shape[-1]
    out = torch.bmm(x, torch.cat([w.real, w.imag], dim=-1))
    return torch.complex(out[..., :n], out[..., n:])


def _final_state(x: Tensor, p: Tensor, q: Tensor, h0: Tensor | None) -> Tensor:
    """h_{L-1} = sum_s q^{L-1-s} p x_s + q^L h0. x: [B, D, L] real -> [B, D, N] complex."""
    b, d, length = x.shape
    n = q.shape[-1]
    t = _block_size(length)
    a = math.ceil(length / t)
    log_q = _log(q)
    # r = L-1-s = a*T + j: reverse time, pad the far past with zeros.
    x_rev = torch.flip(x, dims=[-1])
    x_rev = torch.nn.functional.pad(x_rev, (0, a * t - length)).reshape(b, d, a, t)
    x_rev = x_rev.permute(1, 0, 2, 3).reshape(d, b * a, t)
    q_j = _powers(log_q.unsqueeze(1), torch.arange(t, device=x.device).view(1, t, 1), q)  # [D, T, N]
    inner = _complex_bmm(x_rev, q_j).reshape(d, b, a, n)
    q_at = _powers(log_q.unsqueeze(1), (torch.arange(a, device=x.device) * t).view(1, a, 1), q)
    h = (inner * q_at.unsqueeze(1)).sum(2) * p.unsqueeze(1)  # [D, B, N]
    h = h.permute(1, 0, 2)
    if h0 is not None:
        h = h + _powers(log_q, _steps(length, x.device), q) * h0
    return h


def _fft_length(length: int) -> int:
    return 1 << max(0, (2 * length - 1) - 1).bit_length()


class _FFTConv(torch.autograd.Function):
    """y = irfft(rfft(x) * S)[:L] with S = rfft(k_fwd) (+ conj(rfft(k_bwd)) bidirectionally), zero-padded
    to n >= 2L - 1 so the circular convolution is the linear one.

    Autograd would keep the padded input and both spectra ([B, D, n] real and [B, D, n/2+1] complex per
    layer); this keeps x (a view of a tensor the caller keeps anyway) and the kernel k, and recomputes
    rfft(x) and S in backward. With G = rfft(g), X = rfft(x) and C = sum_b G conj(X):
    dL/dx = irfft(G conj(S))[:L]; dL/dk_fwd[j] = sum g_t x_{t-j} = irfft(C)[j]; dL/dk_bwd[j] = sum g_t x_{t+j}
    = irfft(conj C)[j].
    x: [B, D, L] real; k: [D, L] or [2D, L] (forward rows first). Returns [B, D, L].
    """

    @staticmethod
    def forward(ctx, x: Tensor, k: Tensor, bidirectional: bool) -> Tensor:
        n_fft = _fft_length(x.shape[-1])
        y = torch.fft.irfft(torch.fft.rfft(x, n=n_fft) * _spectrum(k, x.shape[1], n_fft), n=n_fft)
        ctx.save_for_backward(x, k)
        return y[..., : x.shape[-1]]

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, k = ctx.saved_tensors
        d, length = x.shape[1], x.shape[-1]
        n_fft = _fft_length(length)
        g = torch.fft.rfft(grad, n=n_fft)
        grad_x = grad_k = None
        if ctx.needs_input_grad[0]:
            grad_x = torch.fft.irfft(g * _spectrum(k, d, n_fft).conj(), n=n_fft)[..., :length]
        if ctx.needs_input_grad[1]:
            c = (g * torch.fft.rfft(x, n=n_fft).conj()).sum(0)
            grad_k = torch.fft.irfft(c, n=n_fft)[..., :length]
            if k.shape[0] > d:  # bidirectional
                grad_k = torch.cat([grad_k, torch.fft.irfft(c.conj(), n=n_fft)[..., :length]])
        return grad_x, grad_k, None


def _spectrum(k: Tensor, d: int, n_fft: int) -> Tensor:
    """rfft of the forward kernel rows, plus the conjugate spectrum of the backward rows if any: the sum
    over s >= t of kb_{s-t} x_s is a correlation, and time reversal of a real kernel conjugates its spectrum."""
    spectrum = torch.fft.rfft(k[:d], n=n_fft)
    return spectrum + torch.fft.rfft(k[d:], n=n_fft).conj() if k.shape[0] > d else spectrum


def _cema_fft(x: Tensor, p: Tensor, q: Tensor, gamma: Tensor, bidirectional: bool) -> Tensor:
    """x: [B, D, L] -> the convolution part of y, [B, D, L]. The kernel's power tables (float64 exp and
    polar of [D, N, sqrt L]) are recomputed in backward rather than stored."""
    k = recompute(functools.partial(cema_kernel, length=x.shape[-1]), p, q, gamma)
    return _FFTConv.apply(x, k, bidirectional)


def _cema_chunked(x: Tensor, p: Tensor, q: Tensor, gamma: Tensor, h0: Tensor | None, chunk: int) -> Tensor:
    """Intra-chunk Toeplitz matmul + inter-chunk state passing. x: [B, D, L] -> [B, D, L]."""
    b, d, length = x.shape
    n = q.shape[-1]
    t = min(chunk, length)
    a = math.ceil(length / t)
    xp = torch.nn.functional.pad(x, (0, a * t - length)).reshape(b, d, a, t)
    k = cema_kernel(p, q, gamma, t)  # [D, T]
    idx = torch.arange(t, device=x.device)
    lag = idx.view(t, 1) - idx.view(1, t)
    toeplitz = k[:, lag.clamp(min=0)] * (lag >= 0)  # [D, T(i), T(j)]
    xc = xp.permute(1, 3, 0, 2).reshape(d, t, b * a)  # [D, T, B*A]
    y = torch.bmm(toeplitz, xc).reshape(d, t, b, a).permute(2, 0, 3, 1)  # [B, D, A, T]
    # State at the end of each chunk from inside the chunk only: sum_j p q^{T-1-j} x_j.
    log_q = _log(q)
    w = _powers(log_q.unsqueeze(1), (t - 1 - idx).view(1, t, 1), q) * p.unsqueeze(1)  # [D, T, N]
    xl = xc.transpose(1, 2)  # [D, B*A, T]
    local = _complex_bmm(xl, w).reshape(d, b, a, n)
    decay = _powers(log_q, _steps(t, x.device), q)  # q^T
    h = h0.permute(1, 0, 2) if h0 is not None else torch.zeros_like(local[:, :, 0])
    starts = []
    for local_i in local.unbind(2):  # unbind, not local[:, :, i]: each select's backward zero-fills all
        starts.append(h)
        h = decay.unsqueeze(1) * h + local_i
    h_start = torch.stack(starts, dim=2)  # [D, B, A, N]
    # Carried-in state seen from step i of the chunk: Re(sum_n gamma q^{i+1} h_start).
    c = (gamma * q).unsqueeze(1).unsqueeze(1) * h_start  # [D, B, A, N]
    c = c.permute(1, 2, 0, 3).reshape(b * a, d, n)
    inter = _vandermonde_real(c, log_q, t).reshape(b, a, d, t).permute(0, 2, 1, 3)
    if h0 is not None or a > 1:
        y = y + inter
    return y.reshape(b, d, a * t)[..., :length]


def cema_step(x: Tensor, p: Tensor, q: Tensor, gamma: Tensor, omega: Tensor, h: Tensor | None):
    """The recurrence over time, step by step. x: [B, L, D] -> (y [B, L, D], h_last [B, D, N])."""
    b, length, d = x.shape
    if h is None:
        h = torch.zeros(b, d, q.shape[-1], dtype=q.dtype, device=x.device)
    ys = []
    for i in range(length):
        h = p * x[:, i, :, None] + q * h
        ys.append((gamma * h).real.sum(-1))
    y = torch.stack(ys, dim=1) if ys else x.new_zeros(b, 0, d)
    return y + omega * x, h


def check_cema_args(x, p, q, gamma, h0, bidirectional, padding_mask, return_state) -> None:
    """Shape checks shared by every CEMA implementation; errors name the offending shapes."""
    if x.dim() != 3:
        raise ValueError(f"cema expects x of shape [B, L, D], got {tuple(x.shape)}")
    b, length, d = x.shape
    rows = 2 * d if bidirectional else d
    if p.shape[0] != rows or q.shape != p.shape or gamma.shape != p.shape:
        raise ValueError(
            f"cema coefficients must be [{rows}, N] for D={d} (bidirectional={bidirectional}); "
            f"got p {tuple(p.shape)}, q {tuple(q.shape)}, gamma {tuple(gamma.shape)}"
        )
    if bidirectional and (h0 is not None or return_state):
        raise ValueError("bidirectional CEMA has no carried state: h0 must be None and return_state False")
    if padding_mask is not None and padding_mask.shape != (b, length):
        raise ValueError(f"padding_mask must be [B, L] = {(b, length)}, got {tuple(padding_mask.shape)}")


def cema(
    x: Tensor,
    p: Tensor,
    q: Tensor,
    gamma: Tensor,
    omega: Tensor,
    h0: Tensor | None = None,
    bidirectional: bool = False,
    padding_mask: Tensor | None = None,
    method: str = "auto",
    return_state: bool = False,
    chunk_size: int = 64,
) -> tuple[Tensor, Tensor | None]:
    """Complex EMA over the time axis.

    Args:
        x: [B, L, D] real input (the TimestepNorm output).
        p: [D, N] real (bidirectional: [2D, N], forward rows first).
        q: [D, N] complex, |q| < 1 (bidirectional: [2D, N]).
        gamma: [D, N] complex output projection (bidirectional: [2D, N]).
        omega: [D] real skip weight.
        h0: [B, D, N] complex carried state, or None for zeros (causal only).
        padding_mask: [B, L] bool, True = padding; padded inputs are zeroed first.
        method: "auto" | "fft" | "chunked" | "sequential".
        return_state: also return h_{L-1} [B, D, N] (causal only).

    Returns:
        y [B, L, D] in x's dtype, and h_last [B, D, N] complex or None.
    """
    check_cema_args(x, p, q, gamma, h0, bidirectional, padding_mask, return_state)
    b, length, d = x.shape
    if method not in ("auto", "fft", "chunked", "sequential"):
        raise ValueError(f"cema method must be one of auto, fft, chunked, sequential; got {method!r}")
    out_dtype = x.dtype
    dtype = _compute_dtype(p)
    xf = x.to(dtype)
    if padding_mask is not None:
        xf = xf.masked_fill(padding_mask.unsqueeze(-1), 0.0)
    omega = omega.to(dtype)
    if method == "auto":
        method = "sequential" if length <= 16 and not bidirectional else "fft"
    if method == "sequential":
        if bidirectional:
            yf, _ = cema_step(xf, p[:d], q[:d], gamma[:d], omega, None)
            yb, _ = cema_step(xf.flip(1), p[d:], q[d:], gamma[d:], torch.zeros_like(omega), None)
            return (yf + yb.flip(1)).to(out_dtype), None
        y, h = cema_step(xf, p, q, gamma, omega, h0)
        return y.to(out_dtype), (h if return_state else None)
    xt = xf.transpose(1, 2)  # [B, D, L]: time last for the FFT / matmuls
    if method == "fft" or bidirectional:
        if bidirectional and method == "chunked":
            yf = _cema_chunked(xt, p[:d], q[:d], gamma[:d], None, chunk_size)
            yb = _cema_chunked(xt.flip(-1), p[d:], q[d:], gamma[d:], None, chunk_size).flip(-1)
            y = yf + yb
        else:
            y = _cema_fft(xt, p, q, gamma, bidirectional)
            if h0 is not None:
                y = y + _vandermonde_real(gamma * q * h0, _log(q), length)
    else:
        y = _cema_chunked(xt, p, q, gamma, h0, chunk_size)
    y = (omega * xf).add_(y.transpose(1, 2))  # [B, L, D] contiguous, as every Linear that reads it needs
    h_last = _final_state(xt, p, q, h0) if return_state else None
    return y.to(out_dtype), h_last
