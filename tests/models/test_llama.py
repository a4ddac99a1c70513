"""The Llama-2 baseline against a float64 oracle written from its equations (mega_suite/models/llama/model.py docstring):

    h = x + W_o softmax(RoPE(Q) RoPE(K)^T / sqrt(d) + causal) V,   Q, K, V = RMSNorm(x) W_{q,k,v}
    out = h + W_2 (SiLU(W_1 v) ⊙ W_3 v),                            v = RMSNorm(h)

RMSNorm(x) = x / sqrt(mean(x²) + eps) · w; RoPE rotates the interleaved pairs (x_2i, x_2i+1) of each head by
position · base^(-2i/d). The oracle loops over heads, query rows and pairs and reads only parameters.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from mega_suite.models.llama import LlamaConfig, LlamaLM
from mega_suite.models.llama.decode import LlamaDecoder

CFG = dict(num_layers=2, model_dim=16, num_heads=2, ffn_hidden_dim=24, vocab_size=40, max_seq_len=12)
F64 = dict(rtol=1e-10, atol=1e-10)


def make(seed=0, dtype=torch.float64, **kw):
    torch.manual_seed(seed)
    model = LlamaLM(LlamaConfig(**{**CFG, **kw})).to(dtype)
    with torch.no_grad():  # non-trivial norm weights
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
    return model


def tokens(b, length, seed=1):
    return torch.randint(0, CFG["vocab_size"], (b, length), generator=torch.Generator().manual_seed(seed))


# ----------------------------------------------------------------------------------------------------------
# oracle
# ----------------------------------------------------------------------------------------------------------


def rms(x, w, eps):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def rope_pairs(x, base):
    """x [L, d]: pair i of row t rotated by t * base^(-2i/d)."""
    length, d = x.shape
    out = torch.empty_like(x)
    for t in range(length):
        for i in range(d // 2):
            a = t * base ** (-2 * i / d)
            x0, x1 = x[t, 2 * i], x[t, 2 * i + 1]
            out[t, 2 * i] = x0 * math.cos(a) - x1 * math.sin(a)
            out[t, 2 * i + 1] = x0 * math.sin(a) + x1 * math.cos(a)
    return out


def oracle_block(block, x, cfg):
    """One block, batch row by batch row, head by head."""
    p = dict(block.named_parameters())
    eps, h, hd = cfg.norm_eps, cfg.num_heads, cfg.model_dim // cfg.num_heads
    outs = []
    for row in x:
        u = rms(row, p["attention_norm.weight"], eps)
        q, k, v = (u @ p[f"attention.{n}.weight"].T for n in ("wq", "wk", "wv"))
        heads = []
        for j in range(h):
            sl = slice(j * hd, (j + 1) * hd)
            qj, kj = rope_pairs(q[:, sl], cfg.rope_base), rope_pairs(k[:, sl], cfg.rope_base)
            rows = []
            for t in range(row.shape[0]):
                s = (kj[: t + 1] @ qj[t]) / math.sqrt(hd)
                a = torch.exp(s - s.max())
                rows.append((a / a.sum()) @ v[: t + 1, sl])
            heads.append(torch.stack(rows))
        hid = row + torch.cat(heads, -1) @ p["attention.wo.weight"].T
        f = rms(hid, p["ffn_norm.weight"], eps)
        g = torch.nn.functional.silu(f @ p["feed_forward.w1.weight"].T) * (f @ p["feed_forward.w3.weight"].T)
        outs.append(hid + g @ p["feed_forward.w2.weight"].T)
    return torch.stack(outs)


def oracle_hidden(model, toks):
    cfg = model.cfg
    x = model.embed.weight[toks]
    for block in model.layers:
        x = oracle_block(block, x, cfg)
    return rms(x, model.final_norm.weight, cfg.norm_eps)


# ----------------------------------------------------------------------------------------------------------
# tests
# ----------------------------------------------------------------------------------------------------------


def test_block_and_gradients_match_oracle():
    model = make()
    block, cfg = model.layers[0], model.cfg
    x = torch.randn(2, 9, cfg.model_dim, dtype=torch.float64, requires_grad=True)
    got = block(x)
    want = oracle_block(block, x, cfg)
    torch.testing.assert_close(got, want, **F64)
    cot = torch.randn_like(got)
    params = [x, *block.parameters()]
    g_got = torch.autograd.grad(got, params, cot)
    g_want = torch.autograd.grad(want, params, cot)
    for name, a, b in zip(["x"] + [n for n, _ in block.named_parameters()], g_got, g_want):
        torch.testing.assert_close(a, b, **F64, msg=name)


@pytest.mark.parametrize("share_emb", [False, True])
def test_lm_logits_match_oracle(share_emb):
    model = make(share_emb=share_emb)
    toks = tokens(2, 10)
    logits, _ = model(toks)
    torch.testing.assert_close(logits, oracle_hidden(model, toks) @ model.output.weight.T, **F64)
    if share_emb:
        assert model.output.weight is model.embed.weight


def test_sliding_window_stream_matches_oracle_and_any_split():
    """Each token p of block [b, b + S) (b a multiple of the stride S) is encoded after the W - S tokens
    before b: its hidden state is that of a fresh pass over tokens[max(0, b - (W - S)) : p + 1]."""
    model = make(max_seq_len=8, eval_stride=3)
    w, s = 8, 3
    toks = tokens(1, 23)
    want = []
    for p in range(toks.shape[1]):
        lo = max(0, p // s * s - (w - s))
        want.append(oracle_hidden(model, toks[:, lo : p + 1])[:, -1])
    want = torch.stack(want, 1)
    full, _ = model.forward_hidden(toks, use_cache=True)
    torch.testing.assert_close(full, want, **F64)
    for sizes in ([1] * 23, [5, 1, 9, 8], [2, 7, 14]):
        cache, outs, start = None, [], 0
        for n in sizes:
            out, cache = model.forward_hidden(toks[:, start : start + n], cache, use_cache=True)
            outs.append(out)
            start += n
        torch.testing.assert_close(torch.cat(outs, 1), want, **F64)
        assert cache.tokens.shape[1] == w - 1 and cache.position == 23


def test_window_is_enforced_and_config_errors():
    model = make()
    with pytest.raises(ValueError, match="max_seq_len=12"):
        model(tokens(1, 13))
    with pytest.raises(ValueError, match="model.model_dim=16"):
        LlamaConfig(model_dim=16, num_heads=3)
    with pytest.raises(ValueError, match="model.eval_stride"):
        LlamaConfig(max_seq_len=8, eval_stride=8)


def test_meta_build_and_init_weights():
    with torch.device("meta"):
        model = LlamaLM(LlamaConfig(**CFG, share_emb=True))
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights()
    assert model.output.weight is model.embed.weight
    assert all(torch.isfinite(p).all() for p in model.parameters())
    torch.testing.assert_close(model.final_norm.weight, torch.ones(16))
    # depth-scaled output projections: layer 1's W_o std 0.02 / 2
    big = LlamaLM(LlamaConfig(num_layers=2, model_dim=256, num_heads=4, ffn_hidden_dim=512, vocab_size=8))
    assert abs(float(big.layers[1].attention.wo.weight.detach().std()) - 0.01) < 1e-3
    assert (
        abs(float(big.layers[0].attention.wq.weight.detach().std()) - 0.02 * 0.98) < 1.5e-3
    )  # trunc at 3 sigma


def test_autocast_keeps_logits_and_norms_float32(monkeypatch):
    model = make(dtype=torch.float32).train()
    seen = []
    orig = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, **kw):
        seen.append((q.dtype, k.dtype, v.dtype))
        return orig(q, k, v, **kw)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    norms = []
    for m in model.modules():
        if type(m).__name__ == "RMSNorm":
            m.register_forward_hook(lambda m, i, o: norms.append(o.dtype))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits, _ = model(tokens(2, 10))
    logits.float().mean().backward()
    assert logits.dtype == torch.float32
    assert set(norms) == {torch.float32}
    assert seen and all(d == (torch.bfloat16,) * 3 for d in seen)


def test_autocast_linears_share_one_stored_input():
    """Under bf16 autocast W_q, W_k, W_v store one bf16 copy of the attention norm's output and W_1, W_3 one
    of the FFN norm's (each Linear cast its input itself before: five copies per block, not two), the same
    single cast as Megalodon's blocks (a fair memory comparison). The third D-wide input is W_o's."""
    from mega_suite.tools.memory import stored_for_backward

    model = make(dtype=torch.float32, num_layers=1).train()
    x = tokens(2, 12)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        hidden = model.hidden_states(x)
    stored = stored_for_backward(hidden, exclude=list(model.parameters()))
    linear_inputs = sum(
        n for (node, attr, shape, dtype), n in stored.items()
        if node == "MmBackward0" and attr == "self" and dtype == "torch.bfloat16" and shape[-1] == CFG["model_dim"]
    )  # fmt: skip
    assert linear_inputs == 3 * x.numel() * CFG["model_dim"] * 2, stored.most_common()


def test_tied_initial_loss_is_near_uniform():
    """With tied embeddings the last hidden state starts close to the input token's own embedding, so the
    init must keep that token's logit small: the initial loss is ≈ ln V (GPT-2's std 0.02; D^-1/2 gave 13.9
    nats at V = 4096, D = 256)."""
    torch.manual_seed(0)
    cfg = LlamaConfig(
        num_layers=2, model_dim=256, num_heads=4, ffn_hidden_dim=512, vocab_size=4096, share_emb=True
    )
    model = LlamaLM(cfg)
    toks = torch.randint(0, 4096, (2, 65), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits, _ = model(toks[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), toks[:, 1:].flatten())
    assert abs(float(loss) - math.log(4096)) < 0.5, float(loss)


@pytest.mark.parametrize("stride, prompt", [(3, 1), (3, 4), (3, 11), (4, 2)])
def test_every_cached_step_is_the_float64_forward_over_the_window_it_keeps(stride, prompt):
    """The float32 decoder, prompt in one call then one token per call past the window: the logits at position
    t are a float64 full forward's last position over exactly tokens[lo(t) : t + 1], lo(t) = max(0, t // S * S
    - (W - S)) (docs/long_context.md#decoding), to float32 rounding. A RoPE position off by one in the cached
    step or a cache rebuild one token late changes them (the argmax of a tiny random model need not move)."""
    w = 8
    model = make(dtype=torch.float32, max_seq_len=w, eval_stride=stride).eval()
    full = copy.deepcopy(model).double()
    toks = tokens(2, 30)
    dec = LlamaDecoder(model)
    got, cache = dec(toks[:, :prompt])
    outs, states = [got], []
    for t in range(prompt, toks.shape[1]):
        got, cache = dec(toks[:, t : t + 1], cache)
        outs.append(got)
        states.append((t, cache.lo, cache.position))
    got = torch.cat(outs, 1)
    assert got.dtype == torch.float32
    seen, starts = set(), set()
    with torch.no_grad():
        for t in range(toks.shape[1]):
            lo = max(0, t // stride * stride - (w - stride))
            seen.add(t + 1 - lo)
            starts.add(lo)
            want = full(toks[:, lo : t + 1])[0][:, -1]
            torch.testing.assert_close(
                got[:, t].double(),
                want,
                rtol=0,
                atol=2e-6 * want.abs().max(),
                msg=lambda m, t=t: f"position {t}: {m}",
            )
    assert states == [(t, max(0, t // stride * stride - (w - stride)), t + 1) for t in range(prompt, 30)]
    assert max(seen) == w and len(starts) >= 5  # the whole window, and at least four rebuilds past it
