"""bf16-mixed precision (docs/architecture.md#the-block): what runs in bf16 under ``torch.autocast`` and what stays float32.

docs/architecture.md#the-block: CEMA coefficients and the FFT / scan, every norm's statistics (the final norms included), the
attention softmax and the logits stay float32 under bf16 autocast (float64 in a float64 model). The CPU
autocast exercises the same dtype logic as CUDA autocast, so these run in CI:

- dtypes are asserted on the tensors themselves (forward hooks), LM and classifier, train and eval mode,
  every ``cema_method``, streaming included;
- Q, K and V reach ``chunk_attention`` in one dtype that satisfies the fused kernel's dispatch predicate
  (``kernels.attention.fused_eligible``; CI has no CUDA, so the predicate itself is tested);
- the float32 islands are exact: their output under autocast equals the same module run in float32;
- end to end (mamba's rule): the error of the bf16-autocast model against the float64 model is at most
  2 x the error of the same float32 model with only its Linear layers in bf16, + atol.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

from mega_suite import MegalodonConfig
from mega_suite.models.common import RMSNorm
from mega_suite.models.megalodon.classifier import MegalodonClassifier
from mega_suite.models.megalodon.layers import ComplexEMA, LayerNorm, TimestepNorm
from mega_suite.models.megalodon.lm import MegalodonLM

BF16 = torch.bfloat16
METHODS = ("fft", "chunked", "sequential")

LM = dict(
    num_layers=2, model_dim=32, num_heads=2, z_dim=16, value_dim=32, ffn_hidden_dim=48, swiglu=True,
    cema_ndim=4, norm_num_groups=4, chunk_size=8, vocab_size=50,
)  # fmt: skip
DROPOUTS = dict(dropout=0.1, hidden_dropout=0.1, attention_dropout=0.1)


def autocast():
    return torch.autocast("cpu", dtype=BF16)


def make_lm(method="fft", seed=0, dtype=torch.float32, **kw):
    torch.manual_seed(seed)
    return MegalodonLM(MegalodonConfig(**{**LM, "cema_method": method, **kw})).to(dtype)


def make_classifier(method="fft", seed=0, dtype=torch.float32, **kw):
    torch.manual_seed(seed)
    cfg = MegalodonConfig(**{**LM, "num_classes": 5, "vocab_size": 20, "cema_method": method, **kw})
    return MegalodonClassifier(cfg).to(dtype)


def tokens(b, length, vocab, seed=1):
    return torch.randint(0, vocab, (b, length), generator=torch.Generator().manual_seed(seed))


class Recorder:
    """Forward hooks recording the dtypes of the float32 islands' outputs and of the attention inputs."""

    def __init__(self, model, monkeypatch):
        self.islands: list[tuple[str, list[torch.dtype]]] = []
        self.attention: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        for name, module in model.named_modules():
            if isinstance(module, (ComplexEMA, TimestepNorm, RMSNorm, LayerNorm)):
                module.register_forward_hook(self._hook(name))
        import mega_suite.models.megalodon.attention as attention_module

        original = attention_module.chunk_attention

        def spy(q, k, v, *args, **kwargs):
            self.attention.append((q, k, v))
            return original(q, k, v, *args, **kwargs)

        monkeypatch.setattr(attention_module, "chunk_attention", spy)

    def _hook(self, name):
        def hook(module, inputs, output):
            flat = output if isinstance(output, tuple) else (output,)
            dtypes = []
            for t in flat:
                if isinstance(t, tuple):  # a norm state (count, mean, var)
                    dtypes += [s.dtype for s in t[1:]]
                elif isinstance(t, torch.Tensor):
                    dtypes.append(t.dtype)
            self.islands.append((name, dtypes))

        return hook

    def check(self, real=torch.float32):
        """Every island output float32 (complex64 for CEMA states); Q, K, V of one fused-eligible dtype."""
        from kernels.attention import fused_eligible

        assert self.islands, "no float32 island ran"
        allowed = {real, torch.complex64 if real == torch.float32 else torch.complex128}
        for name, dtypes in self.islands:
            assert set(dtypes) <= allowed, f"{name} produced {dtypes} under autocast, expected {real}"
        assert self.attention, "chunk_attention was never called"
        for q, k, v in self.attention:
            assert q.dtype == k.dtype == v.dtype, f"chunk_attention got {(q.dtype, k.dtype, v.dtype)}"
            assert fused_eligible(q, k, v), f"{(q.dtype, tuple(q.shape), tuple(v.shape))} not fused-eligible"


# ----------------------------------------------------------------------------------------------------------
# dtypes under autocast: no crash, islands float32, Q/K/V one dtype
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_lm_autocast_dtypes(method, train, monkeypatch):
    model = make_lm(method, **DROPOUTS).train(train)
    rec = Recorder(model, monkeypatch)
    x = tokens(2, 21, LM["vocab_size"])
    torch.manual_seed(3)
    with autocast():
        logits, _ = model(x)
        loss = F.cross_entropy(logits.flatten(0, 1), x.flatten())
    assert logits.dtype == torch.float32
    loss.backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())
    rec.check()
    # The attention ran in the autocast dtype: the fused kernel would be the path taken on CUDA.
    assert rec.attention[0][0].dtype == BF16


@pytest.mark.parametrize("method", METHODS)
def test_lm_streaming_autocast_dtypes(method, monkeypatch):
    model = make_lm(method).eval()
    rec = Recorder(model, monkeypatch)
    x = tokens(2, 21, LM["vocab_size"])
    with torch.no_grad(), autocast():
        cache = model.new_cache(2)
        outs = []
        for piece in (slice(0, 5), slice(5, 6), slice(6, 19), slice(19, 21)):
            logits, cache = model(x[:, piece], cache)
            assert logits.dtype == torch.float32
            outs.append(logits)
    assert cache.layers[0].cema.dtype == torch.complex64
    assert all(t.dtype == torch.float32 for t in cache.final_norm[1:])
    rec.check()
    # Streaming under autocast equals the full pass under autocast to bf16 rounding of the block inputs.
    with torch.no_grad(), autocast():
        full, _ = model(x)
    torch.testing.assert_close(torch.cat(outs, 1), full, rtol=0.05, atol=0.05)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_classifier_autocast_dtypes(method, train, monkeypatch):
    model = make_classifier(method, **DROPOUTS).train(train)
    rec = Recorder(model, monkeypatch)
    x = tokens(3, 13, 20)
    pad = torch.zeros(3, 13, dtype=torch.bool)
    pad[1, 9:] = True
    torch.manual_seed(3)
    with autocast():
        logits = model(x, pad)
        loss = F.cross_entropy(logits, torch.tensor([0, 1, 4]))
    assert logits.dtype == torch.float32
    loss.backward()
    rec.check()


# ----------------------------------------------------------------------------------------------------------
# the islands are exact under autocast
# ----------------------------------------------------------------------------------------------------------


def _relative(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("method", ("fft", "chunked"))
def test_cema_is_float32_under_autocast(method):
    """The CEMA output under autocast equals the float32 computation (today's bmm in bf16: ~2e-3 off)."""
    torch.manual_seed(0)
    cema = ComplexEMA(32, 16, method=method)
    x = torch.randn(2, 300, 32)
    want, _ = cema(x)
    with autocast():
        got, _ = cema(x)
    assert got.dtype == torch.float32
    assert _relative(got, want) < 1e-6


def test_logits_are_computed_in_float32():
    """Under autocast the output projection runs in float32 (docs/architecture.md#language-model), not in bf16 and cast afterwards."""
    model = make_lm().eval()
    hidden = {}
    model.output.final_norm.register_forward_hook(lambda m, i, o: hidden.update(h=o[0]))
    x = tokens(2, 21, LM["vocab_size"])
    with torch.no_grad(), autocast():
        logits, _ = model(x)
    with torch.no_grad():
        want = model.logits(hidden["h"])
    assert _relative(logits, want) < 1e-6


# ----------------------------------------------------------------------------------------------------------
# end-to-end error: <= 2 x (float32 model with only the Linear layers in bf16) + atol, vs float64
# ----------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def linears_in_bf16():
    """Every nn.Linear as autocast would run it (inputs and weights rounded to bf16, output bf16), the
    output returned in float32 so that everything else stays float32: the baseline of the rule."""
    original = F.linear

    def linear(x, w, b=None):
        out = original(x.to(BF16), w.to(BF16), None if b is None else b.to(BF16))
        return out.to(x.dtype)

    torch.nn.functional.linear = linear
    try:
        yield
    finally:
        torch.nn.functional.linear = original


def _loss_and_grads(model, run):
    model.zero_grad()
    loss = run(model)
    loss.backward()
    return loss.detach().double(), {n: p.grad.double().clone() for n, p in model.named_parameters()}


def _errors(loss, grads, ref_loss, ref_grads):
    err = {"loss": abs(float(loss - ref_loss)) / abs(float(ref_loss))}
    for n, g in ref_grads.items():
        err[n] = float((grads[n] - g).norm() / g.norm().clamp(min=1e-30))
    return err


def _check_rule(build, run, atol=5e-3):
    ref = build(torch.float64)
    ref_loss, ref_grads = _loss_and_grads(ref, run)
    model = build(torch.float32)
    with linears_in_bf16():
        base = _errors(*_loss_and_grads(model, run), ref_loss, ref_grads)
    with autocast():
        loss, grads = _loss_and_grads(model, run)
    got = _errors(loss, grads, ref_loss, ref_grads)
    bad = {n: (got[n], base[n]) for n in got if got[n] > 2 * base[n] + atol}
    assert not bad, f"error vs float64 above 2 x (Linear-only bf16) + {atol}: {bad}"
    return got, base


@pytest.mark.parametrize("method,rebuild", [(m, "never") for m in METHODS] + [("fft", "always")])
def test_lm_bf16_error_within_twice_linear_only(method, rebuild):
    """``rebuild``: model.recompute_linears (the Linears' bf16 outputs rebuilt in backward, outside autocast)."""
    x = tokens(2, 40, LM["vocab_size"])

    def run(model):
        logits, _ = model(x[:, :-1])
        return F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())

    build = lambda dt: make_lm(method, chunk_size=16, dtype=dt, recompute_linears=rebuild).eval()  # noqa: E731
    _check_rule(build, run)


@pytest.mark.parametrize("rebuild", ["never", "always"])
def test_classifier_bf16_error_within_twice_linear_only(rebuild):
    x = tokens(3, 24, 20)
    pad = torch.zeros(3, 24, dtype=torch.bool)
    pad[2, 15:] = True

    def run(model):
        return F.cross_entropy(model(x, pad), torch.tensor([0, 3, 4]))

    _check_rule(lambda dt: make_classifier(chunk_size=16, dtype=dt, recompute_linears=rebuild).eval(), run)


def test_float64_model_stays_float64_under_autocast(monkeypatch):
    """A float64 model (the oracle tests' setting) computes every island in float64 even under autocast."""
    model = make_lm(dtype=torch.float64).eval()
    rec = Recorder(model, monkeypatch)
    with torch.no_grad(), autocast():
        logits, _ = model(tokens(2, 21, LM["vocab_size"]))
    assert logits.dtype == torch.float64
    for name, dtypes in rec.islands:
        assert set(dtypes) <= {torch.float64, torch.complex128}, (name, dtypes)
