"""Float64 oracles for the functional ops, written from docs/architecture.md alone (#cema, #timestepnorm, #normalised-attention).

They are deliberately slow and literal -- loops over timesteps, chunks and query rows, statistics gathered
from the raw elements -- so that a mistake shared with the fast kernels is unlikely. Nothing here imports
`kernels/` or `mega_suite/`. Every oracle is differentiable, so gradients can be compared as well.
"""

import math

import torch

# ----------------------------------------------------------------------------------------------------------
# docs/architecture.md#cema CEMA
# ----------------------------------------------------------------------------------------------------------


def cema_coefficients(alpha, delta, theta, gamma):
    """Raw parameters alpha, delta (D, N, 1), theta (D, 1, 1), gamma (D, N, 2) -> p [D, N] real,
    q [D, N] complex128, gamma_c [D, N] complex128 (docs/architecture.md#cema "Coefficients")."""
    alpha, delta, theta, gamma = (t.double() for t in (alpha, delta, theta, gamma))
    D, N, _ = alpha.shape
    theta_d = torch.sigmoid(theta.reshape(D, 1)) * (2 * math.pi / N)
    n = torch.arange(1, N + 1, dtype=torch.float64)
    p = torch.sigmoid(alpha[..., 0])
    magnitude = 1 - torch.sigmoid(alpha[..., 0]) * torch.sigmoid(delta[..., 0])
    # (1 - σ(α)σ(δ)) · exp(i n θ_d), written out as cos + i sin
    angle = n * theta_d
    q = torch.complex(magnitude * torch.cos(angle), magnitude * torch.sin(angle))
    gamma_c = torch.complex(gamma[..., 0], gamma[..., 1]) / math.sqrt(N)
    return p, q, gamma_c


def cema_recurrence(x, p, q, gamma, omega, h0=None):
    """Unidirectional CEMA by the literal recurrence
    h_t = p x_t + q h_{t-1},  y_t = Re(Σ_n γ_n h_{t,n}) + ω x_t.

    x [B, L, D] real, p [D, N] real, q, gamma [D, N] complex, omega [D], h0 [B, D, N] complex or None.
    Returns y [B, L, D] float64 and the final state h_{L-1} [B, D, N] complex128 (h0 itself when L = 0).
    """
    x = x.double()
    B, L, D = x.shape
    N = p.shape[1]
    h = torch.zeros(B, D, N, dtype=torch.complex128) if h0 is None else h0.to(torch.complex128)
    ys = []
    for t in range(L):
        h = p * x[:, t, :, None] + q * h
        ys.append((gamma * h).sum(-1).real + omega * x[:, t])
    y = torch.stack(ys, dim=1) if ys else x.new_zeros(B, 0, D)
    return y, h


def cema_kernel_taps(p, q, gamma, L):
    """k_ℓ = Re(Σ_n γ_n p_n q_n^ℓ) for ℓ = 0..L-1, [D, L]. Powers by repeated products: exact enough in
    float64 at the oracle's short lengths, and independent of the kernels' exp(ℓ log q)."""
    power = torch.ones_like(q)
    taps = []
    for _ in range(L):
        taps.append((gamma * p * power).sum(-1).real)
        power = power * q
    return torch.stack(taps, dim=-1)


def cema_bidirectional(x, p, q, gamma, omega):
    """Bidirectional CEMA by the explicit double sum of docs/architecture.md#cema:
    y_t = Σ_{s≤t} k^f_{t-s} x_s + Σ_{s≥t} k^b_{s-t} x_s + ω x_t, with p, q, gamma [2D, N] (first D forward).
    Padding must already be zeroed in x."""
    x = x.double()
    B, L, D = x.shape
    k_fwd = cema_kernel_taps(p[:D], q[:D], gamma[:D], L)  # [D, L]
    k_bwd = cema_kernel_taps(p[D:], q[D:], gamma[D:], L)
    t = torch.arange(L)[:, None]
    s = torch.arange(L)[None, :]
    lag = (t - s).abs()  # [L, L]
    # Toeplitz matrices T[d, t, s]: forward taps below (and on) the diagonal, backward taps above (and on) it.
    toeplitz_fwd = torch.where(s <= t, k_fwd[:, lag], torch.zeros((), dtype=torch.float64))
    toeplitz_bwd = torch.where(s >= t, k_bwd[:, lag], torch.zeros((), dtype=torch.float64))
    y = torch.einsum("dts,bsd->btd", toeplitz_fwd + toeplitz_bwd, x)
    return y + omega * x


# ----------------------------------------------------------------------------------------------------------
# docs/architecture.md#timestepnorm TimestepNorm and the classification group norm
# ----------------------------------------------------------------------------------------------------------


def _valid_mask(x, padding_mask):
    B, L, _ = x.shape
    if padding_mask is None:
        return torch.ones(B, L, dtype=torch.bool)
    return ~padding_mask.bool()


def timestep_norm(x, weight, bias, num_groups, eps=1e-5, padding_mask=None):
    """Brute-force causal group norm: for every valid step t, the group's statistics are the mean and
    population variance of all its elements over the valid steps s ≤ t (gathered, not updated).
    Padded steps output 0. Returns y [B, L, D] and the final state (count [B] int64, mean [B, G], var [B, G]);
    a row with no valid step keeps the initial state (0, 0, 1)."""
    x = x.double()
    B, L, D = x.shape
    G = num_groups
    xg = x.reshape(B, L, G, D // G)
    valid = _valid_mask(x, padding_mask)
    scale = 1 + weight.double()
    rows, counts, means, variances = [], [], [], []
    for b in range(B):
        steps = []
        for t in range(L):
            if not valid[b, t]:
                steps.append(x.new_zeros(D))
                continue
            idx = valid[b, : t + 1].nonzero().squeeze(-1)
            elems = xg[b, idx].transpose(0, 1).reshape(G, -1)  # [G, n_steps · D/G]
            mu = elems.mean(-1, keepdim=True)
            var = ((elems - mu) ** 2).mean(-1, keepdim=True)
            normed = (xg[b, t] - mu) / torch.sqrt(var + eps)
            steps.append(normed.reshape(D) * scale + bias.double())
        rows.append(torch.stack(steps) if steps else x.new_zeros(0, D))
        idx = valid[b].nonzero().squeeze(-1)
        counts.append(len(idx))
        if len(idx):
            elems = xg[b, idx].transpose(0, 1).reshape(G, -1)
            mu = elems.mean(-1)
            means.append(mu)
            variances.append(((elems - mu[:, None]) ** 2).mean(-1))
        else:
            means.append(x.new_zeros(G))
            variances.append(x.new_ones(G))
    y = torch.stack(rows)
    return y, (torch.tensor(counts, dtype=torch.int64), torch.stack(means), torch.stack(variances))


def virtual_prefix(count, mean, var, group_size):
    """Synthetic earlier steps whose statistics are exactly a given TimestepNorm state: row b gets count[b]
    valid steps (left-padded to the longest row) whose group elements alternate mean ± sqrt(var), so their
    population mean and variance are (mean, var). Prepending them to x and running `timestep_norm` gives the
    expected outputs for x under that carried state (differentiably in mean and var).
    Returns x_prefix [B, max(count), D] and its padding mask. group_size · count must be even."""
    B, G = mean.shape
    n_max = int(count.max()) if count.numel() else 0
    sign = torch.tensor([1.0, -1.0], dtype=torch.float64).repeat(n_max * group_size)[: n_max * group_size]
    sign = sign.reshape(n_max, 1, group_size)  # alternating over (step, element) of each group
    rows, masks = [], []
    for b in range(B):
        n = int(count[b])
        assert (n * group_size) % 2 == 0, "virtual_prefix needs an even number of elements per group"
        steps = mean[b, None, :, None].double() + sign[:n] * torch.sqrt(var[b, None, :, None].double())
        pad = mean.new_zeros(n_max - n, G, group_size, dtype=torch.float64)
        rows.append(torch.cat([pad, steps]).reshape(n_max, G * group_size))
        masks.append(torch.arange(n_max) < n_max - n)
    return torch.stack(rows), torch.stack(masks)


def timestep_norm_cumulative(x, weight, bias, num_groups, eps=1e-5, padding_mask=None):
    """The same quantity as `timestep_norm`, vectorised with float64 prefix sums for long sequences.
    Each (b, g) is first shifted by its own valid-element mean, so the prefix sums of x and x² do not cancel
    catastrophically (mean and variance are shift-equivariant / -invariant). Returns y only."""
    x = x.double()
    B, L, D = x.shape
    G = num_groups
    dg = D // G
    valid = _valid_mask(x, padding_mask).double()[:, :, None, None]  # [B, L, 1, 1]
    xg = x.reshape(B, L, G, dg)
    total = valid.sum(dim=(1, 3), keepdim=True).clamp_min(1) * dg
    shift = (xg * valid).sum(dim=(1, 3), keepdim=True) / total  # [B, 1, G, 1]
    xs = (xg - shift) * valid
    n = torch.cumsum(valid, dim=1) * dg  # [B, L, 1, 1]
    s1 = torch.cumsum(xs.sum(-1, keepdim=True), dim=1)
    s2 = torch.cumsum((xs**2).sum(-1, keepdim=True), dim=1)
    n_safe = n.clamp_min(1)
    mean_shifted = s1 / n_safe
    var = s2 / n_safe - mean_shifted**2
    normed = (xg - shift - mean_shifted) / torch.sqrt(var + eps)
    y = normed.reshape(B, L, D) * (1 + weight.double()) + bias.double()
    return y * valid.reshape(B, L, 1)


def group_norm(x, weight, bias, num_groups, eps=1e-5, padding_mask=None):
    """Whole-sequence group norm (docs/architecture.md#timestepnorm, classification): statistics per (b, g) over all valid timesteps;
    padded steps output 0; an all-padding row outputs 0 everywhere."""
    x = x.double()
    B, L, D = x.shape
    G = num_groups
    xg = x.reshape(B, L, G, D // G)
    valid = _valid_mask(x, padding_mask)
    scale = 1 + weight.double()
    rows = []
    for b in range(B):
        idx = valid[b].nonzero().squeeze(-1)
        if len(idx) == 0:
            rows.append(x.new_zeros(L, D))
            continue
        elems = xg[b, idx].transpose(0, 1).reshape(G, -1)
        mu = elems.mean(-1)[:, None]
        var = ((elems - mu) ** 2).mean(-1)[:, None]
        steps = []
        for t in range(L):
            if valid[b, t]:
                steps.append(((xg[b, t] - mu) / torch.sqrt(var + eps)).reshape(D) * scale + bias.double())
            else:
                steps.append(x.new_zeros(D))
        rows.append(torch.stack(steps))
    return torch.stack(rows)


# ----------------------------------------------------------------------------------------------------------
# docs/architecture.md#normalised-attention chunked attention
# ----------------------------------------------------------------------------------------------------------


def chunk_attention(q, k, v, chunk_size, causal, key_padding_mask=None):
    """Block-diagonal attention, one query row at a time: softmax scale 1.0, keys restricted to the query's
    own chunk (the last chunk may be shorter), to j ≤ i when causal, and to non-padding keys; a row with no
    admissible key outputs zeros. q, k [B, L, h, dk], v [B, L, h, dv] -> [B, L, h, dv] float64."""
    q, k, v = q.double(), k.double(), v.double()
    B, L, H, _ = q.shape
    dv = v.shape[-1]
    pad = torch.zeros(B, L, dtype=torch.bool) if key_padding_mask is None else key_padding_mask.bool()
    per_batch = []
    for b in range(B):
        per_head = []
        for h in range(H):
            out_rows = []
            for start in range(0, L, chunk_size):
                end = min(start + chunk_size, L)
                for i in range(start, end):
                    keys = [j for j in range(start, end) if (not causal or j <= i) and not pad[b, j]]
                    if not keys:
                        out_rows.append(v.new_zeros(dv))
                        continue
                    logits = k[b, keys, h] @ q[b, i, h]  # [n_keys], no 1/sqrt(dk)
                    e = torch.exp(logits - logits.max())
                    weights = e / e.sum()
                    out_rows.append((weights[:, None] * v[b, keys, h]).sum(0))
            per_head.append(torch.stack(out_rows) if out_rows else v.new_zeros(0, dv))
        per_batch.append(torch.stack(per_head, dim=1))  # [L, h, dv]
    return torch.stack(per_batch)


# ----------------------------------------------------------------------------------------------------------
# comparison helpers
# ----------------------------------------------------------------------------------------------------------


def max_rel_err(actual, expected):
    """max |actual - expected| / max |expected| (the relative error used by the precision tests)."""
    expected = expected.to(torch.complex128 if expected.is_complex() else torch.float64)
    actual = actual.to(expected.dtype)
    return ((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-300)).item()


# ----------------------------------------------------------------------------------------------------------
# The block, the LM and the classifier in train mode: RoPE, DropKey attention, adaptive input / softmax, one block, the LM, the
# classifier. Every dropout is applied here, in its documented place, from a mask the caller supplies:
# ``mask(place, p, shape) -> bool keep-mask`` (the caller may assert p and shape); the oracle does the
# rescaling t · keep / (1 − p) itself.
# ----------------------------------------------------------------------------------------------------------


def rope_chunks(x, chunk_size, base):
    """RoPE with positions restarting at 0 in every chunk (docs/architecture.md#normalised-attention): the interleaved pair (x[2i], x[2i+1])
    at position t is rotated by the angle (t mod C) · base^(−2i/d). x [B, L, h, d]."""
    L, d = x.shape[1], x.shape[-1]
    pos = (torch.arange(L) % chunk_size).double()[None, :, None]
    cols = []
    for i in range(d // 2):
        angle = pos * base ** (-(2 * i) / d)
        x0, x1 = x[..., 2 * i], x[..., 2 * i + 1]
        cols += [x0 * torch.cos(angle) - x1 * torch.sin(angle), x0 * torch.sin(angle) + x1 * torch.cos(angle)]
    return torch.stack(cols, -1)


def chunk_attention_dropkey(q, k, v, chunk_size, causal, key_padding_mask=None, dropped=None):
    """docs/architecture.md#normalised-attention DropKey, one query row at a time: the keys of the query's chunk, j ≤ i when causal, not padding,
    and not dropped; softmax with scale 1.0 over the survivors, NO rescaling; a row with no surviving key
    outputs zeros. dropped [B, h, ≥L, C] bool: dropped[b, h, i, j − chunk start] removes key j for query i.
    q, k [B, L, h, dk], v [B, L, h, dv] (RoPE already applied) -> [B, L, h, dv] float64."""
    q, k, v = q.double(), k.double(), v.double()
    B, L, H, _ = q.shape
    pad = torch.zeros(B, L, dtype=torch.bool) if key_padding_mask is None else key_padding_mask.bool()
    per_batch = []
    for b in range(B):
        per_head = []
        for h in range(H):
            rows = []
            for start in range(0, L, chunk_size):
                end = min(start + chunk_size, L)
                for i in range(start, end):
                    keys = [
                        j
                        for j in range(start, end)
                        if (not causal or j <= i)
                        and not pad[b, j]
                        and not (dropped is not None and dropped[b, h, i, j - start])
                    ]
                    if not keys:
                        rows.append(v.new_zeros(v.shape[-1]))
                        continue
                    logits = k[b, keys, h] @ q[b, i, h]
                    e = torch.exp(logits - logits.max())
                    rows.append(((e / e.sum())[:, None] * v[b, keys, h]).sum(0))
            per_head.append(torch.stack(rows))
        per_batch.append(torch.stack(per_head, dim=1))
    return torch.stack(per_batch)


def adaptive_log_prob(h, head_w, tails, cutoffs):
    """Adaptive softmax (Grave et al.), float64: h [N, D] -> log P(w | h) [N, V].
    Head logits h · head_wᵀ over [the c₀ shortlist words, one entry per tail cluster];
    band i ≥ 1 (words c_{i−1} .. c_i − 1): log P = log softmax(head)[c₀ + i − 1] + log softmax(out_i(proj_i h)),
    tails[i−1] = (proj_w [D/f^i, D], out_w [c_i − c_{i−1}, D/f^i])."""
    h = h.double()
    head = torch.log_softmax(h @ head_w.double().T, -1)
    c0 = cutoffs[0]
    parts = [head[:, :c0]]
    for i, (proj_w, out_w) in enumerate(tails):
        tail = torch.log_softmax((h @ proj_w.double().T) @ out_w.double().T, -1)
        parts.append(head[:, c0 + i, None] + tail)
    return torch.cat(parts, -1)


def adaptive_embed(tokens, head_w, tails, cutoffs):
    """Tied adaptive input (Baevski & Auli): word w of band 0 -> head_w[w]; of band i -> out_w[w − c_{i−1}]
    (width D/f^i) projected up to D with the tied projection: out_w[w − c_{i−1}] · proj_w. -> [B, L, D]."""
    bounds = [0, *cutoffs]
    rows = []
    for w in tokens.flatten().tolist():
        band = max(i for i in range(len(bounds)) if w >= bounds[i])
        if band == 0:
            rows.append(head_w.double()[w])
        else:
            proj_w, out_w = tails[band - 1]
            rows.append(out_w.double()[w - bounds[band]] @ proj_w.double())
    return torch.stack(rows).reshape(*tokens.shape, -1)


def _silu(t):
    return t / (1 + torch.exp(-t))


def _dropout(t, place, p, mask):
    """t · keep / (1 − p) with the caller's keep-mask for ``place`` (identity at p = 0)."""
    keep = mask(place, p, tuple(t.shape))
    return t if p == 0 else t * keep / (1 - p)


def _drop_path(t, place, p, mask):
    """Stochastic depth: the whole branch of a sample is kept (and scaled by 1 / (1 − p)) or zeroed."""
    keep = mask(place, p, (t.shape[0], 1, 1))
    return t if p == 0 else t * keep / (1 - p)


def megalodon_block(P, cfg, x, mask, layer_index=0, dropped=None, classifier=False, padding_mask=None):
    """docs/architecture.md#the-block (LM form) or #classifier (classifier form) of one block in train mode, float64.

    P maps the block's parameter names (reference names, e.g. "mega.wz.weight") to tensors; ``mask`` supplies
    the keep-masks (see above) of the places "M", "OR", "H", "A", "FFN" and, in the classifier, the
    drop-path places "path_H", "path_FFN" with rate drop_path · i / (layers − 1) for block i;
    ``dropped`` is the DropKey mask of ``chunk_attention_dropkey`` (None: no attention dropout).
    """
    B, L, D = x.shape
    eps, heads, G = cfg.norm_eps, cfg.num_heads, cfg.norm_num_groups
    zd = cfg.z_dim // heads
    ph, pd = cfg.hidden_dropout, cfg.dropout

    def linear(t, name, bias=True):
        out = t @ P[f"{name}.weight"].T
        return out + P[f"{name}.bias"] if bias else out

    w, b = P["mega.timenorm.weight"], P["mega.timenorm.bias"]
    p, q, gam = cema_coefficients(
        P["mega.cema.alpha"], P["mega.cema.delta"], P["mega.cema.theta"], P["mega.cema.gamma"]
    )
    omega = P["mega.cema.omega"][:, 0]
    if classifier:
        x_hat = group_norm(x, w, b, G, eps, padding_mask)  # padded steps are 0
        x_cema = cema_bidirectional(x_hat, p, q, gam, omega)
    else:
        x_hat = timestep_norm(x, w, b, G, eps)[0]
        x_cema = cema_recurrence(x_hat, p, q, gam, omega)[0]

    rms = x_cema / torch.sqrt((x_cema * x_cema).mean(-1, keepdim=True) + eps) * (1 + P["mega.rmsnorm.weight"])
    m = _dropout(rms, "M", ph, mask)  # M = dropout_h(RMSNorm(X'))
    z = linear(m, "mega.wz").reshape(B, L, heads, zd)
    z_hat = z / torch.sqrt((z * z).mean(-1, keepdim=True) + eps)
    gamma, beta = P["mega.gamma"].reshape(2, heads, zd), P["mega.beta"].reshape(2, heads, zd)
    q_ = rope_chunks(z_hat * (1 + gamma[0]) / math.sqrt(zd) + beta[0], cfg.chunk_size, cfg.rope_base)
    k_ = rope_chunks(z_hat * (1 + gamma[1]) / math.sqrt(zd) + beta[1], cfg.chunk_size, cfg.rope_base)
    v = _silu(linear(x_hat, "mega.wv")).reshape(B, L, heads, -1)  # V from the TimestepNorm output
    r = _silu(linear(m, "mega.wr"))
    o = chunk_attention_dropkey(q_, k_, v, cfg.chunk_size, not classifier, padding_mask, dropped)
    gated = _dropout(o.reshape(B, L, -1) * r, "OR", ph, mask)  # dropout_h(O ⊙ R)
    h = linear(m, "mega.wh1") + linear(gated, "mega.wh2", bias=False)

    p_path = cfg.drop_path * layer_index / max(1, cfg.num_layers - 1)
    y = _drop_path(_dropout(h, "H", pd, mask), "path_H", p_path, mask) + x  # Y = dropout(H) + X
    u = y - y.mean(-1, keepdim=True)
    u = (
        u / torch.sqrt((u * u).mean(-1, keepdim=True) + eps) * (1 + P["nffn.norm.weight"])
        + P["nffn.norm.bias"]
    )
    a = _silu(linear(u, "nffn.fc1", bias=False))
    if cfg.swiglu:
        a = a * linear(u, "nffn.fc3", bias=False)
    ffn = _drop_path(_dropout(linear(_dropout(a, "A", ph, mask), "nffn.fc2", bias=False), "FFN", pd, mask),
                     "path_FFN", p_path, mask)  # fmt: skip
    # two-hop residual: out = X + α ⊙ dropout(dropout_h(A) W_2), the FFN's residual is X, not Y
    return x + (P["nffn.alpha"] * ffn if cfg.layer_scale else ffn)


def _sub(P, prefix):
    return {n[len(prefix) :]: t for n, t in P.items() if n.startswith(prefix)}


def megalodon_lm(P, cfg, tokens, mask, dropped=None):
    """docs/architecture.md#language-model in train mode: embed (· sqrt(D) with scale_emb) -> dropout ("embed") -> blocks -> final
    TimestepNorm -> output projection (tied to the embedding with share_emb), or adaptive input / softmax
    with adaptive_cutoffs. Returns logits [B, L, V] (log-probabilities for the adaptive softmax).
    ``dropped``: a DropKey mask per layer, or None. P holds the LM's parameters by their reference names."""
    D = cfg.model_dim
    cutoffs = list(cfg.adaptive_cutoffs)
    if cutoffs:
        tails = [
            (P[f"output.output.tail.{i}.0.weight"], P[f"output.output.tail.{i}.1.weight"])
            for i in range(len(cutoffs))
        ]
        x = adaptive_embed(tokens, P["output.output.head.weight"], tails, cutoffs)
    else:
        x = P["embed.weight"][tokens]
    if cfg.scale_emb:
        x = x * math.sqrt(D)
    x = _dropout(x, "embed", cfg.dropout, mask)
    for i in range(cfg.num_layers):
        x = megalodon_block(_sub(P, f"layers.{i}."), cfg, x, mask, i, None if dropped is None else dropped[i])
    x = timestep_norm(x, P["output.final_norm.weight"], P["output.final_norm.bias"], cfg.norm_num_groups,
                      cfg.norm_eps)[0]  # fmt: skip
    if cutoffs:
        B, L, _ = x.shape
        return adaptive_log_prob(x.reshape(B * L, D), P["output.output.head.weight"], tails, cutoffs).reshape(
            B, L, -1
        )
    w_out = P["embed.weight"] if cfg.share_emb else P["output.output.weight"]
    return x @ w_out.T


def megalodon_classifier(P, cfg, x, padding_mask, mask, dropped=None):
    """docs/architecture.md#classifier in train mode (token or scalar input): encoder -> padded steps zeroed -> dropout ("embed", as
    Mega) -> blocks with drop-path -> final group norm -> masked mean -> Linear -> GELU -> dropout ("head")
    -> Linear (no bias). Returns logits [B, classes]."""
    if cfg.input_type == "token":
        h = P["encoder.embed.weight"][x] * (math.sqrt(cfg.model_dim) if cfg.scale_emb else 1.0)
    else:
        h = x.double()[..., None] * P["encoder.weight"] + P["encoder.bias"]
    valid = (~padding_mask)[..., None].double()
    h = _dropout(h * valid, "embed", cfg.dropout, mask)
    for i in range(cfg.num_layers):
        h = megalodon_block(
            _sub(P, f"layers.{i}."), cfg, h, mask, i, None if dropped is None else dropped[i],
            classifier=True, padding_mask=padding_mask,
        )  # fmt: skip
    h = group_norm(h, P["final_norm.weight"], P["final_norm.bias"], cfg.norm_num_groups, cfg.norm_eps,
                   padding_mask)  # fmt: skip
    pooled = (h * valid).sum(1) / valid.sum(1)
    a = pooled @ P["head.fc1.weight"].T + P["head.fc1.bias"]
    a = 0.5 * a * (1 + torch.erf(a / math.sqrt(2)))
    return _dropout(a, "head", cfg.dropout, mask) @ P["head.fc2.weight"].T
