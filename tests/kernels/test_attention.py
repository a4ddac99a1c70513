"""chunk_attention (docs/architecture.md#normalised-attention) against the per-chunk, per-row float64 oracle of tests/support/oracles.py."""

import oracles
import pytest
import torch

from kernels.attention import chunk_attention

F64 = dict(rtol=1e-9, atol=1e-9)
# (L, chunk size): sizes that divide L, that do not, and chunks longer than the sequence.
SHAPES = [(1, 1), (1, 4), (7, 7), (7, 1), (7, 3), (7, 16), (63, 21), (63, 16), (65, 13), (65, 16), (65, 64)]


def make_qkv(B, L, H, dk, dv, seed, dtype=torch.float64):
    """q, k ~ N(0, 1.5²): logits of order dk·2, so a softmax scale other than 1.0 is clearly visible."""
    g = torch.Generator().manual_seed(seed)
    q = 1.5 * torch.randn(B, L, H, dk, generator=g, dtype=torch.float64)
    k = 1.5 * torch.randn(B, L, H, dk, generator=g, dtype=torch.float64)
    v = torch.randn(B, L, H, dv, generator=g, dtype=torch.float64)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def padding_with_empty_chunk(B, L, C, seed):
    """True = pad. Row 0: the whole second chunk is padding plus random holes; row 1: random holes with the
    first key padded (so causal row 0 of every chunk sees nothing); row 2 (if any): all padding."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(B, L, generator=g) < 0.25
    mask[0, C : 2 * C] = True
    mask[1, ::C] = True
    if B > 2:
        mask[2] = True
    return mask


@pytest.mark.parametrize("causal", [False, True], ids=["bidir", "causal"])
@pytest.mark.parametrize("L,C", SHAPES)
def test_matches_oracle(L, C, causal):
    B, H, dk, dv = 2, 2, 8, 5
    q, k, v = make_qkv(B, L, H, dk, dv, seed=L * 100 + C)
    o = chunk_attention(q, k, v, C, causal)
    assert o.shape == (B, L, H, dv) and o.dtype == torch.float64
    torch.testing.assert_close(o, oracles.chunk_attention(q, k, v, C, causal), **F64)


@pytest.mark.parametrize("causal", [False, True], ids=["bidir", "causal"])
@pytest.mark.parametrize("L,C", [(24, 8), (22, 8), (65, 16)])
def test_key_padding(L, C, causal):
    """Padded keys are ignored, rows without any admissible key (an entire chunk of padding, the first
    causal row behind a padded key, an all-padding sequence) output exactly zeros and never NaN."""
    B, H, dk, dv = 3, 2, 6, 4
    q, k, v = make_qkv(B, L, H, dk, dv, seed=L + C)
    mask = padding_with_empty_chunk(B, L, C, seed=L * C)
    o = chunk_attention(q, k, v, C, causal, key_padding_mask=mask)
    assert torch.isfinite(o).all()
    o_ref = oracles.chunk_attention(q, k, v, C, causal, key_padding_mask=mask)
    torch.testing.assert_close(o, o_ref, **F64)
    assert (o[0, C : 2 * C] == 0).all()
    assert (o[2] == 0).all()
    if causal:
        assert (o[1, ::C] == 0).all()


@pytest.mark.parametrize("causal", [False, True], ids=["bidir", "causal"])
def test_padding_does_not_leak_values(causal):
    """Changing q, k, v at padded positions changes no output of a valid row."""
    B, L, H, C = 3, 22, 2, 8
    q, k, v = make_qkv(B, L, H, 6, 4, seed=5)
    mask = padding_with_empty_chunk(B, L, C, seed=6)
    o = chunk_attention(q, k, v, C, causal, key_padding_mask=mask)
    m = mask[..., None, None]
    o2 = chunk_attention(q, k.masked_fill(m, 9.0), v.masked_fill(m, -9.0), C, causal, key_padding_mask=mask)
    torch.testing.assert_close(o2[~mask], o[~mask], **F64)


@pytest.mark.parametrize("causal", [False, True], ids=["bidir", "causal"])
@pytest.mark.parametrize("L,C,padded", [(7, 3, False), (24, 8, True), (65, 16, True)])
def test_gradients_match_oracle(L, C, causal, padded):
    B, H, dk, dv = 3, 2, 4, 3
    q, k, v = make_qkv(B, L, H, dk, dv, seed=7 + L)
    mask = padding_with_empty_chunk(B, L, C, seed=8 + L) if padded else None
    cot = torch.randn(B, L, H, dv, generator=torch.Generator().manual_seed(9), dtype=torch.float64)

    def vjp(fn):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = fn(*leaves, C, causal, key_padding_mask=mask)
        return torch.autograd.grad((out * cot).sum(), leaves)

    for name, got, want in zip("qkv", vjp(chunk_attention), vjp(oracles.chunk_attention)):
        assert torch.isfinite(got).all(), f"grad {name} has non-finite entries"
        torch.testing.assert_close(got, want, **F64, msg=lambda m, name=name: f"grad {name}: {m}")


def test_float32_matches_float64_oracle():
    B, L, H, C = 2, 65, 2, 16
    q, k, v = make_qkv(B, L, H, 8, 5, seed=10, dtype=torch.float32)
    mask = padding_with_empty_chunk(B, L, C, seed=11)
    o = chunk_attention(q, k, v, C, True, key_padding_mask=mask)
    assert o.dtype == torch.float32
    err = oracles.max_rel_err(o, oracles.chunk_attention(q, k, v, C, True, key_padding_mask=mask))
    assert err <= 1e-5, f"relative error {err:.2e}"


def test_dropout():
    """dropout_p = 0 is deterministic (and exact); dropout_p > 0 changes the output, stays finite, is
    reproducible under the same seed and differs between seeds."""
    B, L, H, C = 2, 32, 2, 8
    q, k, v = make_qkv(B, L, H, 6, 4, seed=12)
    mask = padding_with_empty_chunk(B, L, C, seed=13)
    ref = oracles.chunk_attention(q, k, v, C, False, key_padding_mask=mask)
    torch.manual_seed(0)
    o1 = chunk_attention(q, k, v, C, False, key_padding_mask=mask, dropout_p=0.0)
    torch.manual_seed(1)
    o2 = chunk_attention(q, k, v, C, False, key_padding_mask=mask, dropout_p=0.0)
    assert torch.equal(o1, o2)
    torch.testing.assert_close(o1, ref, **F64)

    torch.manual_seed(2)
    d1 = chunk_attention(q, k, v, C, False, key_padding_mask=mask, dropout_p=0.5)
    torch.manual_seed(2)
    d2 = chunk_attention(q, k, v, C, False, key_padding_mask=mask, dropout_p=0.5)
    torch.manual_seed(3)
    d3 = chunk_attention(q, k, v, C, False, key_padding_mask=mask, dropout_p=0.5)
    assert torch.isfinite(d1).all()
    assert not torch.allclose(d1, ref), "dropout_p=0.5 did not change the output"
    assert torch.equal(d1, d2), "same seed, different dropout"
    assert not torch.equal(d1, d3), "different seeds, same dropout"
    # Rows with no valid key stay zero under dropout too.
    assert (d1[0, C : 2 * C] == 0).all()


@pytest.mark.parametrize("dk,dv", [(3, 5), (5, 3), (4, 4)])
@pytest.mark.parametrize("masked", [False, True], ids=["nomask", "mask"])
@pytest.mark.parametrize("causal", [False, True], ids=["bidir", "causal"])
def test_flash_function_gradcheck(dk, dv, masked, causal):
    """The CPU flash Function (unpadded Q/K/V kept, re-padded in backward) against finite differences and
    against the per-row oracle's gradients, float64."""
    from kernels.attention.reference import _FlashAttention

    g = torch.Generator().manual_seed(dk * 10 + dv)
    q, k = (torch.randn(2, 1, 5, dk, generator=g, dtype=torch.float64, requires_grad=True) for _ in "qk")
    v = torch.randn(2, 1, 5, dv, generator=g, dtype=torch.float64, requires_grad=True)
    mask = None
    if masked:
        mask = torch.zeros(2, 1, 1, 5, dtype=torch.float64)
        mask[1, ..., 3:] = float("-inf")
    torch.autograd.gradcheck(lambda a, b, c: _FlashAttention.apply(a, b, c, mask, causal), (q, k, v))
    pad = None if mask is None else (mask[:, 0, 0] != 0)
    to_blhd = lambda t: t.transpose(1, 2)  # noqa: E731
    out = _FlashAttention.apply(q, k, v, mask, causal)
    ref = oracles.chunk_attention(to_blhd(q), to_blhd(k), to_blhd(v), 5, causal, pad).transpose(1, 2)
    torch.testing.assert_close(out, ref, **F64)
    cot = torch.randn(out.shape, generator=g, dtype=torch.float64)
    got = torch.autograd.grad((out * cot).sum(), (q, k, v))
    want = torch.autograd.grad((ref * cot).sum(), (q, k, v))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **F64)


def test_flash_function_keeps_unpadded_tensors():
    """Q/K (width 4) and V (width 6) are stored at their own widths: no [.., 6]-wide copy of Q or K."""
    from kernels.attention.reference import _FlashAttention

    q, k = (torch.randn(1, 1, 8, 4, requires_grad=True) for _ in "qk")
    v = torch.randn(1, 1, 8, 6, requires_grad=True)
    out = _FlashAttention.apply(q, k, v, None, True)
    widths = sorted(t.shape[-1] for t in out.grad_fn.saved_tensors[:4])
    assert widths == [4, 4, 6, 6], widths


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_blocked_causal_function(dtype):
    """The blocked causal Function (unequal widths; probabilities recomputed in backward, not stored) against
    the per-row oracle's output and gradients in float64, finite differences, and in bf16 to bf16 rounding."""
    from kernels.attention.reference import _BlockedCausal

    g = torch.Generator().manual_seed(21)
    q, k = (torch.randn(2, 2, 9, 3, generator=g, dtype=torch.float64) for _ in "qk")
    v = torch.randn(2, 2, 9, 5, generator=g, dtype=torch.float64)
    q, k, v = (t.to(dtype).requires_grad_() for t in (q, k, v))
    if dtype == torch.float64:
        torch.autograd.gradcheck(lambda a, b, c: _BlockedCausal.apply(a, b, c, 4), (q, k, v))
    out = _BlockedCausal.apply(q, k, v, 4)
    assert out.dtype == dtype and [t.shape[-1] for t in out.grad_fn.saved_tensors[:4]] == [3, 3, 5, 5]
    ref = oracles.chunk_attention(*(t.transpose(1, 2) for t in (q, k, v)), 9, True).transpose(1, 2)
    tol = F64 if dtype == torch.float64 else dict(rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(out.double(), ref, **tol)
    cot = torch.randn(out.shape, generator=g, dtype=torch.float64)
    got = torch.autograd.grad((out.double() * cot).sum(), (q, k, v))
    want = torch.autograd.grad((ref * cot).sum(), (q, k, v))
    for a, b in zip(got, want):
        assert a.dtype == dtype
        torch.testing.assert_close(a.double(), b.double(), **tol)


@pytest.mark.parametrize(
    "dtype, c, dk, dv, path",
    [(torch.float32, 512, 16, 64, "blocked"), (torch.float32, 2048, 64, 128, "flash"),
     (torch.bfloat16, 512, 16, 64, "blocked"), (torch.bfloat16, 1024, 16, 64, "flash")],
)  # fmt: skip
def test_causal_unequal_widths_take_the_measured_path(dtype, c, dk, dv, path, monkeypatch):
    """Causal, unpadded, dk != dv on the CPU: ``_BlockedCausal`` or Q/K padded for the flash kernel as
    ``_prefer_blocked`` decides from measured shapes (bench/diagnostics/attention_cpu.py); either way the output and the
    gradients equal the float64 oracle to the inputs' rounding (float32 / bf16)."""
    from kernels.attention import reference

    taken = []
    for name, cls in (("blocked", reference._BlockedCausal), ("flash", reference._FlashAttention)):
        apply = cls.apply
        monkeypatch.setattr(cls, "apply", lambda *a, name=name, apply=apply: taken.append(name) or apply(*a))
    q, k, v = make_qkv(1, c, 1, dk, dv, seed=c + dk)
    q, k = q * 0.3, k * 0.3  # logits of order 1: a bf16 softmax stays within its rounding
    inputs = [t.to(dtype).requires_grad_() for t in (q, k, v)]
    out = chunk_attention(*inputs, c, True)
    assert taken == [path]
    leaves = [t.detach().double().requires_grad_() for t in inputs]
    ql, kl, vl = (t[0, :, 0] for t in leaves)  # one chunk: softmax(q kᵀ, keys <= query) v in float64
    scores = (ql @ kl.T).masked_fill(torch.ones(c, c, dtype=torch.bool).triu(1), float("-inf"))
    ref = (torch.softmax(scores, -1) @ vl)[None, :, None]
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # of the largest magnitude
    cot = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    got = [out, *torch.autograd.grad((out.double() * cot).sum(), inputs)]
    want = [ref, *torch.autograd.grad((ref * cot).sum(), leaves)]
    for a, b in zip(got, want):
        assert a.dtype == dtype
        assert float((a.double() - b).abs().max()) <= tol * float(b.abs().max())
