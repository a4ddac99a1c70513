"""The one-token decode path (``decode.Decoder`` / ``decode.block_step``):
float32 decode logits equal the float64 full pass to float32 rounding, with packed and folded weights, both
GEMV kernels, across chunk boundaries, with several heads, layer scale and the plain SiLU FFN; the
windowed-statistics mode agrees with the segment path; bf16 and int8 decode weights stay within their
rounding of the float64 pass and leave the parameters untouched; the packed weights never go stale."""

import copy
import os

import model_oracle as tm
import pytest
import torch

import mega_suite.models.megalodon.lm as lm_module
import mega_suite.models.megalodon.pack as pack_module
import mega_suite.models.megalodon.step as step_module
from kernels.attention import attention_step
from mega_suite import MegalodonLM
from mega_suite.models.megalodon import decode

GEMVS = ["matmul", "rows"] + (["mkldnn"] if decode.mkldnn_available(torch.device("cpu")) else [])
# oneDNN's bf16 path needs AVX-512 (or AVX-NE-CONVERT): on an AVX2-only CPU 'mkldnn' refuses bf16 weights
BF16_GEMVS = [
    g for g in GEMVS if g != "mkldnn" or decode.mkldnn_available(torch.device("cpu"), torch.bfloat16)
]


def make_lm(seed=0, **overrides):
    cfg = tm.tiny_config(**{"chunk_size": 4, "scale_emb": True, **overrides})
    torch.manual_seed(seed)
    return tm.randomise(MegalodonLM(cfg), seed=seed).eval()


def decode_logits(dec, tokens, prompt, window_stats=False):
    """Prompt in one call, then one token per call through ``dec`` (a ``decode.Decoder``); returns the logits
    of every position [B, L, V]."""
    with torch.no_grad():
        cache = dec.model.new_cache(tokens.shape[0], window_stats)
        logits, cache = dec(tokens[:, :prompt], cache)
        outs = [logits]
        for i in range(prompt, tokens.shape[1]):
            logits, cache = dec(tokens[:, i : i + 1], cache)
            outs.append(logits)
    return torch.cat(outs, 1)


def float64_logits(model, tokens):
    with torch.no_grad():
        return model.double()(tokens)[0]


def count_steps(monkeypatch):
    calls = []
    step = step_module.block_step
    monkeypatch.setattr(step_module, "block_step", lambda *a: calls.append(1) or step(*a))
    return calls


@pytest.mark.parametrize(
    "gemv, prompt, overrides",
    [(g, 3, {"num_heads": h}) for g in GEMVS for h in (1, 2)]
    + [("matmul", 1, {"layer_scale": True}), ("matmul", 2, {"swiglu": False, "num_heads": 1})],
)
def test_fp32_decode_equals_float64_full_pass(gemv, prompt, overrides, monkeypatch):
    model = make_lm(**overrides)
    dec = decode.Decoder(model, torch.float32, gemv)
    tokens = torch.randint(0, model.cfg.vocab_size, (2, 15), generator=torch.Generator().manual_seed(1))
    calls = count_steps(monkeypatch)
    got = decode_logits(dec, tokens, prompt)  # single tokens over offsets 3, 0..3, 0..3, 0..2
    # a prompt of at most STEP_TOKENS tokens on a fresh cache steps too (the model's forward)
    steps = tokens.shape[1] - prompt + (prompt if prompt <= lm_module.STEP_TOKENS else 0)
    assert len(calls) == steps * model.cfg.num_layers  # the one-token path ran
    want = float64_logits(model, tokens)
    torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-6 * want.abs().max())


def test_window_stats_decode_equals_segment_path(monkeypatch):
    model = make_lm(chunk_size=2)
    tokens = torch.randint(0, model.cfg.vocab_size, (1, 22), generator=torch.Generator().manual_seed(2))
    fast = decode_logits(decode.Decoder(model), tokens, prompt=1, window_stats=True)  # crosses 8 chunks
    monkeypatch.setattr(decode.Decoder, "can_step", lambda self: False)
    slow = decode_logits(decode.Decoder(model), tokens, prompt=1, window_stats=True)
    torch.testing.assert_close(fast, slow, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "dtype, gemv, tol, batch",
    [(torch.bfloat16, g, 0.03, 2) for g in BF16_GEMVS] + [(torch.bfloat16, "matmul", 0.03, 1)],
)
def test_low_precision_decode_weights_are_close_and_separate(dtype, gemv, tol, batch):
    """bf16 (8 mantissa bits) weights: the logits within a few percent of the float64 pass's largest logit
    (batch 1: bf16's torch.mv branch); the parameters are not touched, and float32 again is exact. (int8:
    ``test_int8_decode_is_the_rounded_weights_up_to_bf16_activations``.)"""
    model = make_lm()
    tokens = torch.randint(0, model.cfg.vocab_size, (batch, 10), generator=torch.Generator().manual_seed(3))
    dec = decode.Decoder(model)
    ref = decode_logits(dec, tokens, prompt=2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    got = decode_logits(dec.set_weights(dtype, gemv), tokens, prompt=2)
    assert dec.plan().blocks[0].gemv_m.dtype == dtype
    assert got.dtype == torch.float32
    assert (got[:, 2:] - ref[:, 2:]).abs().max() > 1e-4  # the low-precision weights were used
    want = float64_logits(model, tokens).float()
    model.float()
    torch.testing.assert_close(got, want, rtol=0, atol=tol * want.abs().max().item())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    dec.set_weights(None)
    torch.testing.assert_close(decode_logits(dec, tokens, prompt=2), ref, rtol=0, atol=0)


def _rounded_int8(weight: torch.Tensor) -> torch.Tensor:
    """Per-output-row symmetric int8 steps of ``weight``, from the math in float64: round(W / s), s = max|W| / 127."""
    w = weight.double()
    step = w.abs().amax(1, keepdim=True).clamp(min=1e-12) / 127
    return (w / step).round().clamp(-127, 127), step


def test_int8_decode_weights_are_rounded_to_the_nearest_step():
    """The int8 packing rounds each weight to its row's nearest step (truncation toward zero would move half
    of them by one step); the per-row scale is the step in bf16."""
    weight = torch.randn(48, 40, generator=torch.Generator().manual_seed(0)) * torch.rand(48, 1) * 3
    packed = pack_module.Gemv(weight, None, torch.int8, "matmul")
    steps, step = _rounded_int8(weight)
    differ = packed.w.double() != steps
    # a float32 W / s may land on the other side of a half-step than the float64 one: at most one step, rarely
    assert (packed.w.double() - steps).abs().max() <= 1 and differ.double().mean() < 0.005, differ.sum()
    torch.testing.assert_close(packed.scale.double(), step[:, 0], rtol=2**-8, atol=0)


def _reference_int8_decoder(model, monkeypatch) -> decode.Decoder:
    """The float32 decoder whose block weights (packed and folded as the int8 plan packs them) are replaced by
    their int8 steps from ``_rounded_int8``, dequantised: the int8 weights' own error, float32 elsewhere."""
    real = pack_module.Gemv

    def dequantised(weight, bias, dtype, kind):
        steps, step = _rounded_int8(weight)
        return real((steps * step).float(), bias, dtype, kind)

    dec = decode.Decoder(copy.deepcopy(model))
    with monkeypatch.context() as m:
        m.setattr(pack_module, "Gemv", dequantised)
        m.setattr(pack_module.DecodePlan, "__init__", _blocks_only(pack_module.DecodePlan.__init__, real))
        dec.plan()
    return dec


def _blocks_only(init, real):
    """DecodePlan.__init__ with the head packed by the real Gemv (the int8 plan keeps the head float32)."""

    def wrapped(self, model, dtype, kind, kv_dtype=None):
        init(self, model, dtype, kind, kv_dtype)
        head = model.output.output
        self.head = real(head.weight.float(), None, torch.float32, kind)

    return wrapped


@pytest.mark.parametrize("seed, batch", [(0, 2), (1, 1), (2, 2)])
def test_int8_decode_is_the_rounded_weights_up_to_bf16_activations(seed, batch, monkeypatch):
    """int8 weight-only decoding = the rounded int8 weights (``_reference_int8_decoder``, float32) with
    activations and row scales rounded to bf16 at each GEMV. The tolerance is that rounding's own error,
    measured here as the bf16-weight decoder's distance from the float32 one: twice it (a fixed share of
    the largest logit let weights truncated instead of rounded pass). The parameters are not touched, and
    float32 again is exact."""
    model = make_lm(seed)
    tokens = torch.randint(0, model.cfg.vocab_size, (batch, 10), generator=torch.Generator().manual_seed(3))
    dec = decode.Decoder(model)
    exact = decode_logits(dec, tokens, prompt=2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    got = decode_logits(dec.set_weights(torch.int8, "matmul"), tokens, prompt=2)
    assert dec.plan().blocks[0].gemv_m.dtype == torch.int8 and got.dtype == torch.float32
    reference = decode_logits(_reference_int8_decoder(model, monkeypatch), tokens, prompt=2)
    bf16 = decode_logits(decode.Decoder(copy.deepcopy(model), torch.bfloat16), tokens, prompt=2)
    rounding = (bf16 - exact)[:, 2:].abs().max().item()
    assert (reference - exact)[:, 2:].abs().max() > rounding  # the int8 steps matter more than bf16's
    torch.testing.assert_close(got[:, 2:], reference[:, 2:], rtol=0, atol=2 * rounding)
    want = float64_logits(copy.deepcopy(model), tokens)
    assert (got.double() - want).abs().max() < 2 * (reference.double() - want).abs().max() + 2 * rounding
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    dec.set_weights(None)
    torch.testing.assert_close(decode_logits(dec, tokens, prompt=2), exact, rtol=0, atol=0)


def test_mkldnn_bf16_runs_or_is_refused_as_the_cpu_allows(monkeypatch):
    """oneDNN's bf16 path needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT (an AVX2-only CPU raised inside its weight
    reorder). Where the CPU has it, bf16 'mkldnn' decodes; where not, it is one clear ValueError at
    construction. Both branches run here: the refusal with the capability check answering no."""
    model = make_lm()
    tokens = torch.randint(0, model.cfg.vocab_size, (1, 6), generator=torch.Generator().manual_seed(3))
    refusal = r"gemv 'mkldnn' with bfloat16 weights needs oneDNN's bf16 path.*AVX-512.*use gemv 'rows'"
    if not decode.mkldnn_available(torch.device("cpu")):
        pytest.skip("no oneDNN in this torch build")
    if decode.mkldnn_available(torch.device("cpu"), torch.bfloat16):
        got = decode_logits(decode.Decoder(model, torch.bfloat16, "mkldnn"), tokens, prompt=2)
        want = float64_logits(copy.deepcopy(model), tokens).float()
        torch.testing.assert_close(got, want, rtol=0, atol=0.03 * want.abs().max().item())
    else:
        with pytest.raises(ValueError, match=refusal):
            decode.Decoder(model, torch.bfloat16, "mkldnn")
    monkeypatch.setattr(pack_module, "mkldnn_bf16_supported", lambda: False)
    with pytest.raises(ValueError, match=refusal):
        decode.Decoder(model, torch.bfloat16, "mkldnn")
    with pytest.raises(ValueError, match=refusal):
        decode.Decoder(model).set_weights(torch.bfloat16, "mkldnn")
    decode.Decoder(model, torch.float32, "mkldnn")  # float32 weights need no bf16 support
    assert decode.mkldnn_available(torch.device("cpu")) and not decode.mkldnn_available(
        torch.device("cpu"), torch.bfloat16
    )


@pytest.mark.parametrize("compiled", [False, True])
def test_bf16_keys_and_values_attend_in_float32(compiled, fresh_dynamo):
    """``attention_step`` over bf16 keys / values (a ``kv_dtype`` of bf16, or a prompt's cache computed under
    autocast) against softmax(q kᵀ) v written out in float64 on the same bf16-rounded keys and values, for
    the 2-D GEMV branch (one row, one head) and the batched one, with and without the mask. Eager (cast,
    float32 BLAS) and compiled batched (float32 reductions): equal to float32 rounding. Compiled, one row
    and one head (float32 scores, the product with v in bf16: the probabilities and the result rounded to
    bf16): equal to the oracle with both rounded so, but for a rounding step, and within 2⁻⁷ of the exact
    one. A bf16 product for the scores would round q and the scores (about 1e-2)."""
    attend = torch.compile(attention_step, fullgraph=True, dynamic=True) if compiled else attention_step
    gen = torch.Generator().manual_seed(11)
    for bsz, h in ((1, 1), (2, 2)):
        n, zd, ev = 7, 8, 6
        q = torch.randn(bsz, 1, h, zd, generator=gen) * 2  # scores of a few units: a peaked softmax
        keys = torch.randn(bsz, n, h, zd, generator=gen).bfloat16()
        values = torch.randn(bsz, n, h, ev, generator=gen).bfloat16()
        for mask in (None, torch.arange(n) > 4):
            got = attend(q, keys, values, mask)
            assert got.dtype == torch.float32 and got.shape == (bsz, h, 1, ev)
            s = torch.einsum("bqhd,bnhd->bhqn", q.double(), keys.double())
            if mask is not None:
                s = s.masked_fill(mask, float("-inf"))
            probs = torch.softmax(s, -1)
            exact = torch.einsum("bhqn,bnhe->bhqe", probs, values.double())
            if compiled and bsz * h == 1:
                rounded = torch.einsum("bhqn,bnhe->bhqe", probs.bfloat16().double(), values.double())
                rounded = rounded.bfloat16().double()  # oneDNN's bf16 product returns bf16
                # float32 and float64 probabilities on a rounding boundary may round apart: one bf16 step
                torch.testing.assert_close(got.double(), rounded, rtol=2**-8, atol=1e-4)
                torch.testing.assert_close(got.double(), exact, rtol=0, atol=2**-7)
            else:
                torch.testing.assert_close(got.double(), exact, rtol=0, atol=2e-6)


def bf16_matmuls(fn) -> list[str]:
    """The matmul-like aten ops ``fn`` dispatches with a bf16 operand."""
    from torch.utils._python_dispatch import TorchDispatchMode

    names = ("mm", "bmm", "addmm", "mv", "dot", "baddbmm", "addmv")
    seen = []

    class Spy(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            bf16 = any(isinstance(a, torch.Tensor) and a.dtype == torch.bfloat16 for a in args)
            if bf16 and func.overloadpacket.__name__ in names:
                seen.append(str(func))
            return func(*args, **(kwargs or {}))

    with Spy():
        fn()
    return seen


def test_bf16_kv_decode_is_close_and_never_a_bf16_matmul(monkeypatch):
    """``Decoder(model, kv_dtype=torch.bfloat16)``: the chunk's keys and values are kept in bf16 (the prompt's
    float32 cache converted at the first step, new chunks started in bf16), the logits within bf16's rounding
    of the float64 pass, and the attention over them never a bf16 matmul (on this CPU oneDNN builds a kernel
    for every new attended length). A prompt run under autocast (bf16 keys) decoded
    with the default options takes the same float32 products; ``kv_dtype=torch.float32`` converts it."""
    model = make_lm(chunk_size=8)
    tokens = torch.randint(0, model.cfg.vocab_size, (2, 21), generator=torch.Generator().manual_seed(12))
    dec = decode.Decoder(model)
    ref = decode_logits(dec, tokens, prompt=5)
    got = decode_logits(dec.set_weights(None, kv_dtype=torch.bfloat16), tokens, prompt=5)
    assert (got[:, 5:] - ref[:, 5:]).abs().max() > 1e-5  # the bf16 keys were used
    want = float64_logits(model, tokens).float()
    model.float()
    torch.testing.assert_close(got, want, rtol=0, atol=0.02 * want.abs().max().item())
    with torch.no_grad():
        _, cache = dec(tokens[:, :5])
        assert cache.layers[0].kv.k_buf.dtype == torch.float32
        _, cache = dec(tokens[:, 5:6], cache)
        assert {lc.kv.k_buf.dtype for lc in cache.layers} == {torch.bfloat16}
        assert bf16_matmuls(lambda: dec(tokens[:, 6:7], cache)) == []
        dec.set_weights(None)  # the default: keys as computed, here bf16 from an autocast prompt
        with torch.autocast("cpu", torch.bfloat16):
            _, cache = dec(tokens[:, :5])
        assert cache.layers[0].kv.k_buf.dtype == torch.bfloat16
        assert bf16_matmuls(lambda: dec(tokens[:, 5:6], cache)) == []
        dec.set_weights(None, kv_dtype=torch.float32)
        _, cache = dec(tokens[:, 5:6], cache)
        assert {lc.kv.k_buf.dtype for lc in cache.layers} == {torch.float32}


@pytest.mark.parametrize("kv_dtype, prompt_autocast", [(torch.bfloat16, False), (None, True)])
def test_a_segment_continues_a_cache_in_another_dtype(kv_dtype, prompt_autocast):
    """A multi-token segment (the full-pass path) after one-token steps that left the chunk's keys in bf16
    (``kv_dtype`` bf16, or a prompt run under autocast), in float32: the cache is converted to the segment's
    dtype (a copy; it raised a dtype mismatch before), the next steps convert back, and the logits stay within
    bf16's rounding of the float64 pass; the new chunk after the boundary starts in ``kv_dtype``."""
    model = make_lm(chunk_size=8)
    dec = decode.Decoder(model, kv_dtype=kv_dtype)
    tokens = torch.randint(0, model.cfg.vocab_size, (2, 14), generator=torch.Generator().manual_seed(14))
    with torch.no_grad():
        with torch.autocast("cpu", torch.bfloat16, enabled=prompt_autocast):
            first, cache = dec(tokens[:, :3])
        outs = [first]
        for i in range(3, 5):
            logits, cache = dec(tokens[:, i : i + 1], cache)
            outs.append(logits)
        assert cache.layers[0].kv.k_buf.dtype == torch.bfloat16
        before = cache.layers[0].kv.keys.clone()
        logits, later = dec(tokens[:, 5:8], cache)  # float32 segment, ends on the chunk boundary
        outs.append(logits)
        assert torch.equal(cache.layers[0].kv.keys, before)  # the earlier cache is untouched
        for i in range(8, 14):
            logits, later = dec(tokens[:, i : i + 1], later)
            outs.append(logits)
    if kv_dtype is not None:
        assert later.layers[0].kv.k_buf.dtype == kv_dtype  # the chunk begun at position 8
    want = float64_logits(model, tokens).float()
    model.float()
    torch.testing.assert_close(torch.cat(outs, 1), want, rtol=0, atol=0.03 * want.abs().max().item())


@pytest.mark.parametrize(
    "change", ["optimizer", "fused_adamw", "load_state_dict", "in_place", "new_parameter"]
)
def test_packed_weights_follow_parameter_changes(change):
    """Decode, change the weights (an optimizer step, a fused AdamW step, which moves no version counter, a
    state dict loaded in place, an in-place edit, a parameter replaced by a new one), decode again: the
    logits are the new weights' full pass, never the old packs'."""
    model = make_lm()
    tokens = torch.randint(0, model.cfg.vocab_size, (1, 9), generator=torch.Generator().manual_seed(4))
    dec = decode.Decoder(model)
    decode_logits(dec, tokens, prompt=2)  # builds the packs
    old_plan = dec.plan()
    if change == "optimizer":
        model.train()
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        model(tokens)[0].square().mean().backward()
        opt.step()
        model.eval()
    elif change == "fused_adamw":  # in evaluation mode throughout: no train() / eval() switch stales the plan
        opt = torch.optim.AdamW(model.parameters(), lr=0.05, fused=True)
        model(tokens)[0].square().mean().backward()
        opt.step()
    elif change == "load_state_dict":
        model.load_state_dict(make_lm(seed=5).state_dict())
    elif change == "in_place":
        with torch.no_grad():
            model.layers[1].mega.wv.weight.mul_(1.5)
    else:
        fc2 = model.layers[0].nffn.fc2
        fc2.weight = torch.nn.Parameter(fc2.weight.detach() * 1.5)
    got = decode_logits(dec, tokens, prompt=2)
    new_plan = dec.plan()
    want = float64_logits(model, tokens)
    torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-6 * want.abs().max())
    assert new_plan is not old_plan


def test_decode_options_are_checked():
    model = make_lm()
    with pytest.raises(ValueError, match="decode weight dtype must be one of"):
        decode.Decoder(model, torch.float16)
    with pytest.raises(ValueError, match="decode gemv must be one of"):
        decode.Decoder(model).set_weights(torch.float32, "cublas")
    with pytest.raises(
        ValueError,
        match=r"decode kv_dtype must be one of \[None, torch.float32, torch.bfloat16\], got torch.float16",
    ):
        decode.Decoder(model, torch.float32, kv_dtype=torch.float16)


# ------------------------------------------------------------------ StaticDecoder (the CUDA-graph step)


def static_decode_logits(source, tokens, prompt, buckets=None, dec=None, **options):
    """Prompt through the full pass, then ``decode.StaticDecoder`` (no graphs on CPU) one token at a time;
    ``source``: a model or a ``decode.Decoder``; ``dec``: an existing decoder, loaded with this prompt's
    cache."""
    model = source.model if isinstance(source, decode.Decoder) else source
    with torch.no_grad():
        logits, cache = model(tokens[:, :prompt], use_cache=True)
        if dec is None:
            dec = decode.StaticDecoder(source, cache, buckets=buckets, **options)
        else:
            dec.load(cache)
        outs = [logits] + [
            dec.step(tokens[:, i]).clone().unsqueeze(1) for i in range(prompt, tokens.shape[1])
        ]
    return torch.cat(outs, 1), dec


@pytest.mark.parametrize(
    "prompt, buckets, heads, batch", [(5, 3, 2, 2), (8, 1, 1, 2), (3, 8, 2, 2), (5, None, 1, 1)]
)
def test_static_decoder_equals_float64_full_pass(prompt, buckets, heads, batch):
    """Fixed KV buffers, a device-side chunk offset and masked attention over bucketed lengths: the same logits
    as the float64 full pass across two chunk boundaries, from a prompt that ends mid-chunk (its keys copied
    into the buffers), exactly on a boundary, with one bucket per row, and (batch 1, one head: 2-D GEMV
    attention) over exactly the rows written."""
    model = make_lm(chunk_size=8, num_heads=heads)
    tokens = torch.randint(0, model.cfg.vocab_size, (batch, 22), generator=torch.Generator().manual_seed(3))
    got, _ = static_decode_logits(model, tokens, prompt, buckets)
    want = float64_logits(model, tokens)
    torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-6 * want.abs().max())


def test_static_decoder_checks_its_inputs_and_the_weights():
    model = make_lm(chunk_size=8)
    tokens = torch.randint(0, model.cfg.vocab_size, (1, 6), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        _, cache = model(tokens, use_cache=True)
        with pytest.raises(ValueError, match="buckets must be in"):
            decode.StaticDecoder(model, cache, buckets=9)
        with pytest.raises(ValueError, match="CUDA graphs need a CUDA model"):
            decode.StaticDecoder(model, cache, graphs=True)
        with pytest.raises(ValueError, match="needs a float32"):
            decode.StaticDecoder(make_lm(chunk_size=8).double(), cache)
        dec = decode.StaticDecoder(model, cache)
        dec.step(tokens[:, 0])
        model.layers[0].mega.wv.weight.add_(1.0)  # an in-place update: the packs are stale
        with pytest.raises(RuntimeError, match="weights changed"):
            dec.step(tokens[:, 1])


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("batch, heads, buckets", [(1, 1, None), (2, 2, None), (2, 2, 2)])
def test_compiled_static_decoder_equals_float64_and_compiles_once(batch, heads, buckets, fresh_dynamo):
    """``StaticDecoder(compile=True)``: Inductor's fused step (real-arithmetic CEMA and RoPE) gives the float64
    full pass's logits across two chunk boundaries (offset 0 attends over two rows, one masked), compiled
    in the constructor only (a recompilation while decoding is an error here; with two buckets it failed
    when the warm-up took C alone), and a second prompt loaded into the same decoder (``load``) decodes
    its own sequence."""
    model = make_lm(chunk_size=8, num_heads=heads)
    gen = torch.Generator().manual_seed(5)
    first, second = (torch.randint(0, model.cfg.vocab_size, (batch, 21), generator=gen) for _ in range(2))
    with torch.no_grad():
        cache = model(first[:, :1], use_cache=True)[1]
        dec = decode.StaticDecoder(model, cache, buckets=buckets, compile=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        got, _ = static_decode_logits(model, first, 5, dec=dec)
        got2, _ = static_decode_logits(model, second, 8, dec=dec)
    for tokens, logits in ((first, got), (second, got2)):
        want = float64_logits(model, tokens)
        torch.testing.assert_close(logits.double(), want, rtol=0, atol=2e-6 * want.abs().max())
    with torch.no_grad(), pytest.raises(ValueError, match="batch size"):
        dec.load(model(first[:, :3].repeat(2, 1), use_cache=True)[1])


def test_static_decoders_keep_bf16_keys_and_values(fresh_dynamo):
    """``kv_dtype=torch.bfloat16`` in the fixed-buffer decoder, eager and compiled (batch 1, one head: the 2-D
    GEMV attention the CPU benchmark runs): bf16 buffers filled from the prompt's float32 cache, the logits
    within bf16's rounding of the float64 pass across two chunk boundaries, the compiled step within the
    rounding of its probabilities (bf16, for their product with v) of the eager one, and no bf16 matmul in
    the eager step. A cache in any dtype loads (converted)."""
    model = make_lm(chunk_size=8, num_heads=1)
    source = decode.Decoder(model, kv_dtype=torch.bfloat16)
    tokens = torch.randint(0, model.cfg.vocab_size, (1, 21), generator=torch.Generator().manual_seed(13))
    eager, dec = static_decode_logits(source, tokens, 5)
    assert {k_buf.dtype for _, _, k_buf, _ in dec.layers} == {torch.bfloat16}
    want = float64_logits(model, tokens).float()
    model.float()
    torch.testing.assert_close(eager, want, rtol=0, atol=0.02 * want.abs().max().item())
    compiled, dec = static_decode_logits(source, tokens, 5, compile=True)
    torch.testing.assert_close(compiled, want, rtol=0, atol=0.02 * want.abs().max().item())
    assert (compiled - eager).abs().max() <= 2e-3 * want.abs().max()  # the probabilities' bf16 rounding
    with torch.no_grad():
        with torch.autocast("cpu", torch.bfloat16):
            cache = model(tokens[:, :3], use_cache=True)[1]
        eager_dec = decode.StaticDecoder(source, cache)
        assert bf16_matmuls(lambda: eager_dec.step(tokens[:, 3])) == []
        dec.load(cache)  # the compiled step: one bf16 product per layer, softmax(·) v
        assert len(bf16_matmuls(lambda: dec.step(tokens[:, 3]))) == model.cfg.num_layers


def test_compiled_bf16_kv_decoder_attends_over_64_row_buckets(fresh_dynamo):
    """The compiled CPU step with bf16 keys / values attends over 64-row steps of the chunk (so that its bf16
    product repeats its shapes): for C = 128 the ends 64 and 128, no recompilation across a bucket change and
    the chunk boundary, logits within bf16's rounding of the float64 pass. Changing only ``kv_dtype``
    afterwards makes the decoder stale (its buffers are bf16): the next step raises."""
    model = make_lm(chunk_size=128, num_heads=1)
    tokens = torch.randint(0, model.cfg.vocab_size, (1, 136), generator=torch.Generator().manual_seed(15))
    want = float64_logits(model, tokens).float()
    source = decode.Decoder(model.float(), kv_dtype=torch.bfloat16)
    with torch.no_grad():
        logits, cache = model(tokens[:, :60], use_cache=True)
        dec = decode.StaticDecoder(source, cache, compile=True)
        assert dec.ends == [64, 128]
        with torch._dynamo.config.patch(error_on_recompile=True):
            got = [dec.step(tokens[:, i]).clone() for i in range(60, 135)]  # offsets 60..127, then 0..6
    torch.testing.assert_close(
        torch.stack(got, 1), want[:, 60:135], rtol=0, atol=0.02 * want.abs().max().item()
    )
    source.set_weights(None)
    with pytest.raises(RuntimeError, match="weights changed"):
        dec.step(tokens[:, 135])


def test_a_failing_compile_is_one_clear_error(monkeypatch, fresh_dynamo):
    """torch.compile failing (no C++ compiler, say) is one clear error naming the way out."""
    model = make_lm(chunk_size=8)
    with torch.no_grad():
        _, cache = model(torch.zeros(1, 3, dtype=torch.long), use_cache=True)

    def broken(fn, **kwargs):
        def call(*args):
            raise OSError("no C++ compiler")

        return call

    monkeypatch.setattr(torch, "compile", broken)
    with pytest.raises(
        RuntimeError, match=r"torch.compile of the decode step failed .*no C\+\+ compiler.*compile=False"
    ):
        decode.StaticDecoder(model, cache, compile=True)


def test_each_compiled_decoder_compiles_its_own_step(fresh_dynamo):
    """A second decoder in the same process (another model, bf16 weights: other shapes and ops) compiles its
    own graph rather than recompiling the first one's (Dynamo caches per code object: shared, the second
    compile is a recompilation and made the first's weight shapes symbolic); its bf16 logits are within
    bf16 rounding of the float64 pass."""
    tokens = torch.randint(0, 13, (1, 14), generator=torch.Generator().manual_seed(7))
    first = make_lm(chunk_size=8)
    with torch.no_grad():
        decode.StaticDecoder(first, first(tokens[:, :3], use_cache=True)[1], compile=True)
    model = make_lm(seed=1, chunk_size=8, model_dim=24, num_heads=1)
    with torch._dynamo.config.patch(error_on_recompile=True), torch.no_grad():
        logits, cache = model(tokens[:, :3], use_cache=True)
        dec = decode.StaticDecoder(decode.Decoder(model, torch.bfloat16), cache, compile=True)
        got = torch.cat([logits] + [dec.step(tokens[:, i]).clone()[:, None] for i in range(3, 14)], 1)
    want = float64_logits(model, tokens).float()
    torch.testing.assert_close(got, want, rtol=0, atol=0.03 * want.abs().max().item())


def test_the_compiled_cpu_step_is_compiled_with_the_cpu_options(monkeypatch, fresh_dynamo):
    """``StaticDecoder(compile=True)`` on the CPU passes ``decode.CPU_COMPILE_OPTIONS`` to torch.compile (with
    Inductor's default a GEMV recomputed its input's norm for every output row)."""
    seen = []
    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: seen.append(kw) or real(fn, **kw))
    model = make_lm(chunk_size=8, num_heads=1)
    tokens = torch.randint(0, model.cfg.vocab_size, (1, 6), generator=torch.Generator().manual_seed(9))
    static_decode_logits(model, tokens, 3, compile=True)
    static_decode_logits(model, tokens, 3, compile=True, compile_options={})  # Inductor's defaults
    assert seen == [{"fullgraph": True, "options": {"realize_opcount_threshold": 1}}, {"fullgraph": True}]


@pytest.mark.skipif("mkldnn" not in GEMVS, reason="needs oneDNN")
def test_a_compiled_cpu_decoder_on_an_mkldnn_model_reads_rows_packs(fresh_dynamo):
    """oneDNN's reordered weights do not compile (Inductor's lowering wants them as graph constants: the
    compile failed); the compiled CPU decoder of an ``mkldnn`` model packs ``rows`` and gives the float64
    pass's logits, while the eager path keeps oneDNN."""
    model = make_lm(chunk_size=8, num_heads=1)
    source = decode.Decoder(model, torch.float32, "mkldnn")
    tokens = torch.randint(0, model.cfg.vocab_size, (1, 9), generator=torch.Generator().manual_seed(10))
    want = float64_logits(copy.deepcopy(model), tokens)
    got, dec = static_decode_logits(source, tokens, 3, compile=True)
    assert dec.plan.options == (torch.float32, "rows", None)
    torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-6 * want.abs().max())
    decode_logits(source, tokens, prompt=3)
    assert source.plan().blocks[0].gemv_m.kind == "mkldnn"


def test_the_compiled_cpu_step_reads_rows_packs_as_inductor_reductions(fresh_dynamo):
    """Compiled on the CPU, a float32 "matmul" plan is packed as "rows" (W [O, I], one ``torch.mv`` per GEMV,
    which Inductor compiles into its own reductions: no BLAS ``addmm`` in the step, where the "matmul"
    packs ran 20 per token at ``megalodon_cpu_bench``); the logits stay the float64 pass's to float32
    rounding; the eager path keeps its own "matmul" packs; a change of the decode options, or a parameter
    replaced by a new one before ``load``, makes the decoder stale."""
    model = make_lm(chunk_size=8, num_heads=1)
    source = decode.Decoder(model)
    tokens = torch.randint(0, model.cfg.vocab_size, (1, 13), generator=torch.Generator().manual_seed(9))
    want = float64_logits(copy.deepcopy(model), tokens)
    got, dec = static_decode_logits(source, tokens, 3, compile=True)
    assert dec.plan.options[1] == "rows" and dec.plan.blocks[0].gemv_13.kind == "rows"
    torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-6 * want.abs().max())
    with torch.no_grad(), torch.profiler.profile() as prof:
        dec.step(tokens[:, 0])
    ops = {e.key: e.count for e in prof.key_averages()}
    assert "aten::addmm" not in ops and ops.get("aten::mm", 0) <= 2 * model.cfg.num_layers  # attention only
    eager = decode_logits(source, tokens, prompt=3)  # rebuilds the decoder's own packs
    assert source.plan().options[1] == "matmul" and dec.plan.options[1] == "rows"
    torch.testing.assert_close(eager.double(), want, rtol=0, atol=2e-6 * want.abs().max())
    dec.step(tokens[:, 0])  # its packs are still the model's weights
    source.set_weights(torch.float32, kv_dtype=torch.float32)
    with pytest.raises(RuntimeError, match="weights changed"):
        dec.step(tokens[:, 0])
    source.set_weights(None)
    fc2 = model.layers[0].nffn.fc2
    _, cache = model(tokens[:, :3], use_cache=True)
    with pytest.raises(ValueError, match="decode gemv must be one of"):
        decode.StaticDecoder(model, cache, gemv="blas")
    assert decode.StaticDecoder(model, cache, gemv="matmul").plan.options[1] == "matmul"  # as asked
    dec = decode.StaticDecoder(model, cache, compile=True)
    fc2.weight = torch.nn.Parameter(fc2.weight.detach() * 1.5)
    dec.load(cache)
    with pytest.raises(RuntimeError, match="weights changed"):
        dec.step(tokens[:, 3])


def test_a_decoder_on_its_own_packs_sees_a_parameter_replaced_before_a_prompt():
    """A static decoder whose plan is not its ``Decoder``'s ("rows" packs, as the compiled CPU decoder's, beside
    the eager step's "matmul" ones) is stale after a parameter is replaced by a new one and a prompt runs
    through the decoder, as one sharing the decoder's plan is (it stepped on the old weights when only the
    eager plan re-listed the parameter objects after a full pass)."""
    model = make_lm(chunk_size=8, num_heads=1)
    source = decode.Decoder(model)
    tokens = torch.randint(0, model.cfg.vocab_size, (1, 6), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        _, cache = source(tokens[:, :3])
        dec = decode.StaticDecoder(source, cache, gemv="rows")
        dec.step(tokens[:, 3])
        source(tokens[:, 3:4], cache)  # an eager step packs the decoder's own "matmul" plan
        assert source.plan() is not dec.plan
        fc2 = model.layers[0].nffn.fc2
        fc2.weight = torch.nn.Parameter(fc2.weight.detach() * 1.5)
        source(tokens[:, :3])
        with pytest.raises(RuntimeError, match="weights changed"):
            dec.step(tokens[:, 4])


def _replace_weights(model, other, how):
    if how == "load_state_dict_assign":  # every parameter a new object
        model.load_state_dict(copy.deepcopy(other).state_dict(), assign=True)
    else:  # every block's FFN a new module
        for layer, new in zip(model.layers, other.layers):
            layer.nffn = copy.deepcopy(new.nffn)


@pytest.mark.parametrize("how", ["load_state_dict_assign", "new_module"])
def test_weights_replaced_between_two_steps_are_seen_without_a_full_pass(how):
    """Parameters or modules replaced between two single-token steps, no full pass between them: the eager
    steps after it equal those of a model given the same replacement and packs built afresh (they read the
    new embedding beside the old packs), and a ``StaticDecoder`` is stale (it stepped on the old packs)."""
    other = make_lm(seed=5)
    tokens = torch.randint(0, other.cfg.vocab_size, (1, 9), generator=torch.Generator().manual_seed(4))
    runs = []
    for fresh_packs in (False, True):
        model = make_lm()
        dec = decode.Decoder(model)
        with torch.no_grad():
            _, cache = dec(tokens[:, :2])
            outs = []
            for i in range(2, tokens.shape[1]):
                if i == 5:
                    _replace_weights(model, other, how)
                    if fresh_packs:
                        dec = decode.Decoder(model)
                logits, cache = dec(tokens[:, i : i + 1], cache)
                outs.append(logits)
        runs.append(torch.cat(outs, 1))
    assert not torch.equal(runs[1][:, :3], runs[1][:, 3:6])  # the replacement changed the logits
    torch.testing.assert_close(runs[0], runs[1], rtol=0, atol=0)
    model = make_lm()
    with torch.no_grad():
        _, cache = model(tokens[:, :3], use_cache=True)
        dec = decode.StaticDecoder(model, cache)
        dec.step(tokens[:, 3])
        _replace_weights(model, other, how)
        with pytest.raises(RuntimeError, match="weights changed"):
            dec.step(tokens[:, 4])


def test_only_the_compiled_cpu_decoder_reads_rows_packs_and_the_cpu_options(monkeypatch):
    """The packs and Inductor options each decoder is built with (torch.compile stopped at its call): compiled
    on the CPU, "rows" and ``decode.CPU_COMPILE_OPTIONS`` unless ``gemv=`` / ``compile_options=`` say
    otherwise (the bench's "baseline": "matmul" and Inductor's defaults); the eager ``StaticDecoder`` reads
    the model's own "matmul" packs, and so does the compiled one off the CPU (a model on the meta device
    stands in for CUDA here: compiled decoders are not tested on a GPU), with Inductor's defaults: "rows"
    and the CPU options were measured on the CPU only."""

    class Stop(Exception):
        pass

    seen = []

    def fake_compile(fn, **kw):  # fn: the decoder's step, bound to it
        seen.append((kw, fn.__self__.plan.options[1]))
        raise Stop

    model = make_lm(chunk_size=8, num_heads=1)
    tokens = torch.randint(0, model.cfg.vocab_size, (1, 3), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        _, cache = model(tokens, use_cache=True)
        assert decode.StaticDecoder(model, cache).plan.options[1] == "matmul"
    monkeypatch.setattr(torch, "compile", fake_compile)
    for options in ({}, {"gemv": "matmul", "compile_options": {}}):
        with pytest.raises(Stop):
            decode.StaticDecoder(model, cache, compile=True, **options)
    model.to("meta")
    with pytest.raises(Stop):
        decode.StaticDecoder(model, cache, compile=True)
    cpu = {"fullgraph": True, "options": decode.CPU_COMPILE_OPTIONS}
    assert seen == [(cpu, "rows"), ({"fullgraph": True}, "matmul"), ({"fullgraph": True}, "matmul")]


def test_a_compiled_cuda_decoder_defaults_to_the_fastest_gemv_and_options_measured_there():
    """Compiled on CUDA, a decoder not told otherwise uses the one-row GEMV and Inductor options that were
    fastest on the H100 (bench/reports/2026-11-24-gpu-results-leases.md); what it is told wins. (Its
    wiring into ``StaticDecoder`` is the CPU case of the test above: no compiled decoder is tested on a GPU.)"""
    assert decode.compiled_step_defaults("cuda", None, None) == ("triton", {"realize_opcount_threshold": 1})
    assert decode.compiled_step_defaults("cuda", "mv", {}) == ("mv", {})
    assert decode.compiled_step_defaults("cpu", None, None) == (None, decode.CPU_COMPILE_OPTIONS)
    assert decode.compiled_step_defaults("meta", None, None) == (None, {})
    assert pack_module.CUDA_ROW_GEMV == "mv"  # eager decoding on CUDA is unchanged


def test_compile_options_are_checked():
    """``compile_options`` needs ``compile=True`` (it was ignored without) and is a dict of Inductor options
    (a string failed inside torch.compile: 'str' object has no attribute 'items')."""
    model = make_lm(chunk_size=8, num_heads=1)
    tokens = torch.randint(0, model.cfg.vocab_size, (1, 3), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        _, cache = model(tokens, use_cache=True)
    with pytest.raises(ValueError, match="compile_options needs compile=True"):
        decode.StaticDecoder(model, cache, compile_options={"realize_opcount_threshold": 1})
    for bad in ("realize_opcount_threshold=1", [("realize_opcount_threshold", 1)]):
        with pytest.raises(ValueError, match="compile_options must be a dict of Inductor options"):
            decode.StaticDecoder(model, cache, compile=True, compile_options=bad)


def test_generate_through_the_static_and_compiled_step_picks_the_same_tokens(fresh_dynamo):
    """Also under ``torch.inference_mode`` (buffers built there stay normal tensors, and the compiled step
    sees one global state: stepping outside inference mode afterwards neither fails nor recompiles)."""
    model = make_lm(chunk_size=8)
    prompt = torch.randint(0, model.cfg.vocab_size, (1, 5), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        want = decode.generate(model, prompt, 14, greedy=True)  # crosses two chunk boundaries
        assert torch.equal(decode.generate(model, prompt, 14, greedy=True, static=True), want)
    with torch.inference_mode():
        assert torch.equal(decode.generate(model, prompt, 14, greedy=True, compile=True), want)
        _, cache = model(prompt, use_cache=True)
        dec = decode.StaticDecoder(model, cache, compile=True)
        first = dec.step(want[:, 5]).argmax(-1)
    with torch._dynamo.config.patch(error_on_recompile=True):
        assert torch.equal(torch.stack([first, dec.step(want[:, 6]).argmax(-1)], 1), want[:, 6:8])
    with torch.no_grad(), pytest.raises(ValueError, match="window_stats"):
        decode.generate(model, prompt, 2, static=True, window_stats=True)


def _decoder_matches_float64(device: str, compile: bool) -> None:
    model = make_lm(chunk_size=8, num_heads=1).to(device)
    tokens = torch.randint(0, model.cfg.vocab_size, (1, 21), generator=torch.Generator().manual_seed(8))
    got, _ = static_decode_logits(model, tokens.to(device), 5, compile=compile)  # CUDA: graphs, 8 buckets
    want = float64_logits(model.cpu(), tokens)  # the float64 truth from the CPU reference kernels
    torch.testing.assert_close(got.cpu().double(), want, rtol=0, atol=1e-5 * want.abs().max())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graph_decoder_equals_float64_full_pass():
    """On a GPU (``make gpu-check`` runs the ``gpu`` marker): one CUDA-graph replay per token gives the float64
    full pass's logits across two chunk boundaries. (The compiled step's graphs are checked against the eager
    step by ``python -m bench.decode_gpu --compile``: an Inductor compile would not fit the stage's budget.)"""
    _decoder_matches_float64("cuda", False)


def test_the_gpu_check_helper_on_cpu(fresh_dynamo):
    """The helper the GPU test runs, here on the CPU (no graphs), eager and compiled: it can pass."""
    _decoder_matches_float64("cpu", False)
    _decoder_matches_float64("cpu", True)


@pytest.mark.parametrize("kind", ["cublas", "triton"])
def test_row_gemv_variants_in_the_static_and_compiled_step(kind, monkeypatch, fresh_dynamo):
    """The one-row bf16 GEMV as ``decode.CUDA_ROW_GEMV`` = "cublas" (torch.mv behind ``mega_suite::mv``) or
    "triton" (``kernels.gemv.row_gemv``: bias and residual in the call; on the CPU its reference), in the
    static step (the op is called) and the compiled one (fullgraph): logits within bf16 rounding of the
    float64 pass."""
    import kernels.gemv as gemv_ops

    monkeypatch.setattr(pack_module, "_row_gemv_kind", lambda x: kind)  # on CUDA: pack.CUDA_ROW_GEMV
    model = make_lm(chunk_size=8, num_heads=1, layer_scale=True)
    source = decode.Decoder(model, torch.bfloat16)
    tokens = torch.randint(0, model.cfg.vocab_size, (1, 14), generator=torch.Generator().manual_seed(9))
    want = float64_logits(model, tokens).float()
    model.float()
    name, calls = {"cublas": "mv", "triton": "row_gemv"}[kind], []
    with monkeypatch.context() as m:
        fn = getattr(gemv_ops, name)
        m.setattr(gemv_ops, name, lambda *a: calls.append(1) or fn(*a))
        static, _ = static_decode_logits(source, tokens, 3)
    assert len(calls) == 11 * model.cfg.num_layers * 5  # five GEMVs per block per token
    compiled, _ = static_decode_logits(source, tokens, 3, compile=True)
    for got in (static, compiled):
        torch.testing.assert_close(got, want, rtol=0, atol=0.03 * want.abs().max().item())
    # Inductor may skip the float32 -> bf16 -> float32 rounding of x before the CPU reference's product
    torch.testing.assert_close(compiled, static, rtol=0, atol=0.01 * want.abs().max().item())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kind", decode.CUDA_ROW_GEMVS)
def test_cuda_row_gemvs_in_the_graph_decoder(kind):
    """On a GPU: the CUDA-graph decoder with bf16 weights and each one-row GEMV (the Triton kernel among
    them) stays within bf16 rounding of the float64 pass."""
    from kernels.gemv import triton as gemv_triton

    model = make_lm(chunk_size=8, num_heads=1).cuda()
    tokens = torch.randint(0, model.cfg.vocab_size, (1, 21), generator=torch.Generator().manual_seed(8))
    with gemv_triton.fixed_config():  # no autotuning (13 compiles and timings) in this small test
        got, _ = static_decode_logits(decode.Decoder(model, torch.bfloat16), tokens.cuda(), 5, row_gemv=kind)
    assert pack_module.CUDA_ROW_GEMV == "mv"  # the decoder set its choice only around its own calls
    want = float64_logits(model.cpu(), tokens).float()
    torch.testing.assert_close(got.cpu(), want, rtol=0, atol=0.03 * want.abs().max().item())


def test_row_gemv_choice_is_checked():
    """A misspelt GEMV is an error naming the choices, not a silent fall-back to torch.mv."""
    model = make_lm(chunk_size=8)
    with torch.no_grad():
        _, cache = model(torch.zeros(1, 3, dtype=torch.long), use_cache=True)
    with pytest.raises(ValueError, match=r"CUDA_ROW_GEMV must be one of .*'cuBLAS'"):
        decode.StaticDecoder(model, cache, row_gemv="cuBLAS")
    with pytest.raises(ValueError, match="CUDA_ROW_GEMV must be one of"):
        with decode.cuda_row_gemv("triton "):
            pass
    with decode.cuda_row_gemv("triton"):
        assert pack_module.CUDA_ROW_GEMV == "triton"
    assert pack_module.CUDA_ROW_GEMV == "mv"


def test_the_decode_sweep_benchmark_runs(capsys, fresh_dynamo):
    """``python -m bench.decode --sweep`` at toy sizes: a sweep row per 128 positions per path."""
    from bench import decode as decode_bench

    decode_bench.main(["--paths", "bf16 matmul bf16-kv", "--no-compile", "--prompt", "8", "--sweep", "130",
                       "--threads", "1"])  # fmt: skip
    out = capsys.readouterr().out
    assert "| 8-136 " in out and "| 136-138 " in out


def test_the_decode_benchmark_times_the_forward_and_checks_the_port(capsys, monkeypatch, tmp_path):
    """``bench.decode``'s ``forward`` path takes the model's packed step, ``segment`` the general pass; ``--port``
    without a checkout, or the ``port`` path without ``--port``, is refused with one line."""
    from bench import decode as decode_bench

    calls = count_steps(monkeypatch)
    decode_bench.main(["--paths", "segment", "--prompt", "4", "--sweep", "3", "--threads", "1"])
    assert calls == []
    decode_bench.main(["--paths", "forward", "--prompt", "4", "--sweep", "3", "--threads", "1"])
    assert len(calls) == 3 * 4  # megalodon_cpu_bench: 4 blocks
    assert "| 4-7 " in capsys.readouterr().out
    with pytest.raises(SystemExit, match="no megalodon-hf checkout there"):
        decode_bench.main(["--paths", "forward", "--port", str(tmp_path), "--sweep", "1", "--prompt", "2"])
    with pytest.raises(SystemExit):
        decode_bench.main(["--paths", "port", "--sweep", "1"])
    assert "--paths port needs --port PATH" in capsys.readouterr().err


@pytest.mark.parametrize("order", ["round-robin", "blocks"])
def test_the_decode_sweep_takes_turns_as_ordered(monkeypatch, capsys, order):
    """``--sweep --order blocks``: each path decodes 128 positions back to back (as ``generate()`` does,
    caches warm), then the next; round-robin alternates token by token."""
    from bench import decode as decode_bench

    calls = []
    real_next = decode_bench.Stream.next

    def next_(self):
        calls.append(id(self))
        return real_next(self)

    monkeypatch.setattr(decode_bench.Stream, "next", next_)
    decode_bench.main(["--paths", "fp32 matmul,bf16 matmul", "--no-compile", "--prompt", "4", "--sweep", "130",
                       "--threads", "1", "--order", order])  # fmt: skip
    assert len(calls) == 260 and len(set(calls)) == 2
    switches = sum(a != b for a, b in zip(calls, calls[1:]))
    # blocks: A x128, B x128, A x2, B x2; round-robin: a switch at every token
    assert switches == (3 if order == "blocks" else 259)
    assert ("every 128 tokens" in capsys.readouterr().out) == (order == "blocks")


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="CPU tensors through the interpreter")
def test_the_kernel_inside_the_static_and_compiled_decode_step(monkeypatch):
    """The Triton kernel itself (interpreter, CPU tensors, bf16 weights) as every one-row GEMV of the decode
    step, eager and inside the compiled step (fullgraph, the custom op an extern call): logits within bf16
    rounding of the float64 full pass."""
    from kernels import dispatch
    from mega_suite.models.megalodon import decode, pack

    calls = []
    from kernels.gemv import triton as fused

    launch = fused.row_gemv
    monkeypatch.setattr(fused, "row_gemv", lambda *a: calls.append(1) or launch(*a))
    monkeypatch.setattr(dispatch, "use_triton", lambda *tensors: True)
    monkeypatch.setattr(pack, "_row_gemv_kind", lambda x: "triton")
    model = make_lm(chunk_size=8, num_heads=1)
    source = decode.Decoder(model, torch.bfloat16)
    tokens = torch.randint(0, model.cfg.vocab_size, (1, 9), generator=torch.Generator().manual_seed(2))
    want = float64_logits(model, tokens).float()
    model.float()
    torch._dynamo.reset()
    try:
        for compile in (False, True):
            calls.clear()
            got, _ = static_decode_logits(source, tokens, 3, compile=compile)
            assert len(calls) >= 6 * model.cfg.num_layers * 5  # every GEMV of every token ran the kernel
            torch.testing.assert_close(got, want, rtol=0, atol=0.03 * want.abs().max().item())
    finally:
        torch._dynamo.reset()
