"""A float64 oracle of one Megalodon block (docs/architecture.md#the-block, #classifier), written from the docs
alone with literal loops: the CEMA recurrence step by step, TimestepNorm statistics gathered from every raw
element seen so far, attention chunk by chunk with an explicit softmax, RoPE pair by pair. It reads the
block's parameters by their reference names and nothing else of mega_suite/ or kernels/. Also the tiny
model configurations and the parameter randomisation the model tests share.
"""

import math

import torch
from torch import nn

from mega_suite import MegalodonConfig

F64 = dict(rtol=1e-9, atol=1e-9)  # float64 against float64: agreement to rounding

# ----------------------------------------------------------------------------------------------------------
# float64 oracle of docs/architecture.md
# ----------------------------------------------------------------------------------------------------------


def silu(t):
    return t / (1 + torch.exp(-t))


def rms_norm(x, weight, eps):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * (1 + weight)


def layer_norm(x, weight, bias, eps):
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + eps) * (1 + weight) + bias


def timestep_norm(x, weight, bias, num_groups, eps, prefix=None):
    """docs/architecture.md#timestepnorm by brute force: at step t, mean and population variance of every element of the group over
    the raw inputs ``prefix`` [B, P, D] (earlier segments) and x[:, :t+1]."""
    B, L, D = x.shape
    dg = D // num_groups
    ys = []
    for t in range(L):
        seen = x[:, : t + 1] if prefix is None else torch.cat([prefix, x[:, : t + 1]], 1)
        g = seen.reshape(B, -1, num_groups, dg)
        mean = g.mean(dim=(1, 3))  # [B, G]
        var = ((g - mean[:, None, :, None]) ** 2).mean(dim=(1, 3))
        xt = x[:, t].reshape(B, num_groups, dg)
        y = (xt - mean[..., None]) / torch.sqrt(var[..., None] + eps)
        ys.append(y.reshape(B, D) * (1 + weight) + bias)
    return torch.stack(ys, 1)


def norm_statistics(inputs, num_groups):
    """(count, mean [B, G], population var [B, G]) of all elements of ``inputs`` [B, T, D] per group."""
    B, T, D = inputs.shape
    g = inputs.reshape(B, T, num_groups, D // num_groups)
    mean = g.mean(dim=(1, 3))
    var = ((g - mean[:, None, :, None]) ** 2).mean(dim=(1, 3))
    return T, mean, var


def group_norm(x, weight, bias, num_groups, eps, padding_mask=None):
    """docs/architecture.md#timestepnorm (classification): statistics over all valid steps of the row at once; padding outputs 0."""
    B, L, D = x.shape
    rows = []
    for b in range(B):
        valid = torch.ones(L, dtype=torch.bool) if padding_mask is None else ~padding_mask[b]
        _, mean, var = norm_statistics(x[b][valid][None], num_groups)
        g = x[b].reshape(L, num_groups, D // num_groups)
        y = ((g - mean[0, :, None]) / torch.sqrt(var[0, :, None] + eps)).reshape(L, D) * (1 + weight) + bias
        rows.append(y * valid[:, None])
    return torch.stack(rows)


def cema_coefficients(alpha, delta, theta, gamma):
    """docs/architecture.md#cema "Coefficients": p [R, N] real, q and γ [R, N] complex."""
    N = alpha.shape[1]
    base = torch.sigmoid(theta[:, 0, 0]) * 2 * math.pi / N  # θ_d
    n = torch.arange(1, N + 1, dtype=torch.float64)
    p = torch.sigmoid(alpha[..., 0])
    magnitude = 1 - torch.sigmoid(alpha[..., 0]) * torch.sigmoid(delta[..., 0])
    q = magnitude * torch.exp(1j * n * base[:, None])
    g = (gamma[..., 0] + 1j * gamma[..., 1]) / math.sqrt(N)
    return p, q, g


def cema_recurrence(x, p, q, g, h0=None):
    """h_t = p x_t + q h_{t-1}; returns Σ_n Re(γ_n h_{t,n}) [B, L, D] and h_{L-1} [B, D, N]."""
    B, L, D = x.shape
    h = torch.zeros(B, D, p.shape[1], dtype=torch.complex128) if h0 is None else h0
    ys = []
    for t in range(L):
        h = p * x[:, t, :, None] + q * h
        ys.append((g * h).real.sum(-1))
    return torch.stack(ys, 1), h


def rope(x, base):
    """Interleaved pairs (x[2i], x[2i+1]) rotated by position · base^(-2i/d); positions 0..len-1.
    x: [B, c, h, d] (one chunk)."""
    c, d = x.shape[1], x.shape[-1]
    pos = torch.arange(c, dtype=torch.float64)[None, :, None]
    cols = []
    for i in range(d // 2):
        angle = pos * base ** (-(2 * i) / d)
        x0, x1 = x[..., 2 * i], x[..., 2 * i + 1]
        cols += [x0 * torch.cos(angle) - x1 * torch.sin(angle), x0 * torch.sin(angle) + x1 * torch.cos(angle)]
    return torch.stack(cols, -1)


def chunk_attention(q, k, v, chunk, causal, base, key_padding=None):
    """Independent chunks (RoPE positions restarting in each), explicit softmax with scale 1.0; a query
    with no valid key outputs 0. q, k: [B, L, h, dk]; v: [B, L, h, dv]."""
    B, L = q.shape[:2]
    outs = []
    for start in range(0, L, chunk):
        sl = slice(start, min(start + chunk, L))
        qc, kc, vc = rope(q[:, sl], base), rope(k[:, sl], base), v[:, sl]
        c = qc.shape[1]
        allowed = torch.ones(B, c, c, dtype=torch.bool)
        if causal:
            allowed &= torch.ones(c, c, dtype=torch.bool).tril()
        if key_padding is not None:
            allowed &= ~key_padding[:, None, sl]
        scores = torch.einsum("bihd,bjhd->bhij", qc, kc).masked_fill(~allowed[:, None], -math.inf)
        top = scores.amax(-1, keepdim=True)
        top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
        e = torch.exp(scores - top)
        probs = e / e.sum(-1, keepdim=True).clamp(min=1e-300)
        outs.append(torch.einsum("bhij,bjhd->bihd", probs, vc))
    return torch.cat(outs, 1)


def oracle_block(P, cfg, x, classifier=False, padding_mask=None, norm_prefix=None, h0=None):
    """docs/architecture.md#the-block (LM) or #classifier (classifier) for one block; P maps reference names ("mega.wz.weight") to
    float64 tensors. In the LM form x starts on a chunk boundary, ``norm_prefix`` holds the raw inputs of
    earlier segments (the carried TimestepNorm statistics) and ``h0`` the carried CEMA state.
    Returns (out [B, L, D], h_{L-1} or None)."""
    B, L, D = x.shape
    eps, heads = cfg.norm_eps, cfg.num_heads
    zd = cfg.z_dim // heads

    def linear(t, name, bias=True):
        out = t @ P[f"{name}.weight"].T
        return out + P[f"{name}.bias"] if bias else out

    w, b = P["mega.timenorm.weight"], P["mega.timenorm.bias"]
    if classifier:
        x_hat = group_norm(x, w, b, cfg.norm_num_groups, eps, padding_mask)
    else:
        x_hat = timestep_norm(x, w, b, cfg.norm_num_groups, eps, norm_prefix)

    p, q, g = cema_coefficients(
        P["mega.cema.alpha"], P["mega.cema.delta"], P["mega.cema.theta"], P["mega.cema.gamma"]
    )
    omega = P["mega.cema.omega"][:, 0]
    xe = x_hat if padding_mask is None else x_hat * (~padding_mask)[..., None]
    if classifier:  # forward rows 0..D-1, backward rows D..2D-1 run over the reversed sequence
        yf, _ = cema_recurrence(xe, p[:D], q[:D], g[:D])
        yb, _ = cema_recurrence(xe.flip(1), p[D:], q[D:], g[D:])
        cema_out, h_last = yf + yb.flip(1) + omega * xe, None
    else:
        y, h_last = cema_recurrence(xe, p, q, g, h0)
        cema_out = y + omega * xe

    m = rms_norm(cema_out, P["mega.rmsnorm.weight"], eps)
    z = linear(m, "mega.wz").reshape(B, L, heads, zd)
    z_hat = z / torch.sqrt((z * z).mean(-1, keepdim=True) + eps)
    gamma, beta = P["mega.gamma"].reshape(2, heads, zd), P["mega.beta"].reshape(2, heads, zd)
    q_ = z_hat * (1 + gamma[0]) / math.sqrt(zd) + beta[0]
    k_ = z_hat * (1 + gamma[1]) / math.sqrt(zd) + beta[1]
    v = silu(linear(x_hat, "mega.wv")).reshape(B, L, heads, -1)
    r = silu(linear(m, "mega.wr"))
    o = chunk_attention(q_, k_, v, cfg.chunk_size, not classifier, cfg.rope_base, padding_mask)
    h = linear(m, "mega.wh1") + linear(o.reshape(B, L, -1) * r, "mega.wh2", bias=False)
    y = h + x
    u = layer_norm(y, P["nffn.norm.weight"], P["nffn.norm.bias"], eps)
    a = silu(linear(u, "nffn.fc1", bias=False))
    if cfg.swiglu:
        a = a * linear(u, "nffn.fc3", bias=False)
    ffn = linear(a, "nffn.fc2", bias=False)
    if cfg.layer_scale:
        ffn = ffn * P["nffn.alpha"]
    return x + ffn, h_last  # two-hop residual: the FFN's residual is x, not y


# ----------------------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------------------


def tiny_config(**overrides):
    base = dict(
        num_layers=2, model_dim=16, num_heads=2, z_dim=8, value_dim=16, ffn_hidden_dim=32, swiglu=True,
        cema_ndim=4, norm_num_groups=4, chunk_size=5, vocab_size=13,
    )  # fmt: skip
    base.update(overrides)
    return MegalodonConfig(**base)


@torch.no_grad()
def randomise(module: nn.Module, seed: int, scale: float = 0.3) -> nn.Module:
    """Move every parameter off its initial value, including the zero-initialised norm weights, γ, β and the
    imaginary part of the CEMA γ, so the plus-one convention and every term are exercised."""
    gen = torch.Generator().manual_seed(seed)
    for p in module.parameters():  # tied parameters are visited once
        p.add_(scale * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return module


def params_of(module: nn.Module, requires_grad=False) -> dict:
    return {n: p.detach().clone().requires_grad_(requires_grad) for n, p in module.named_parameters()}


def lm_input(B, L, D, seed):
    gen = torch.Generator().manual_seed(seed)
    # a non-zero mean and scale per channel, so the norms have something to remove
    return 1.5 * torch.randn(B, L, D, generator=gen, dtype=torch.float64) + torch.linspace(
        -2, 2, D, dtype=torch.float64
    )
