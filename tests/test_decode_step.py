"""The one-token decode path (``MegalodonLM._step_token`` / ``MegalodonBlock.step``): float32 decode logits
equal the float64 full pass to float32 rounding, across chunk boundaries and with several heads; the
windowed-statistics mode agrees with the segment path; bf16 decode weights stay close and leave the model's
parameters untouched."""

import pytest
import test_model as tm
import torch

from mega_suite import MegalodonLM
from mega_suite.models.megalodon.model import MegalodonBlock


def make_lm(seed=0, **overrides):
    cfg = tm.tiny_config(**{"chunk_size": 4, "scale_emb": True, **overrides})
    torch.manual_seed(seed)
    return tm.randomise(MegalodonLM(cfg), seed=seed).eval()


def decode_logits(model, tokens, prompt, window_stats=False):
    """Prompt in one call, then one token per call; returns the logits of every position [B, L, V]."""
    with torch.no_grad():
        cache = model.new_cache(tokens.shape[0], window_stats)
        logits, cache = model(tokens[:, :prompt], cache)
        outs = [logits]
        for i in range(prompt, tokens.shape[1]):
            logits, cache = model(tokens[:, i : i + 1], cache)
            outs.append(logits)
    return torch.cat(outs, 1)


@pytest.mark.parametrize("num_heads", [1, 2])
def test_fp32_decode_equals_float64_full_pass(num_heads, monkeypatch):
    model = make_lm(num_heads=num_heads)
    tokens = torch.randint(0, model.cfg.vocab_size, (2, 15), generator=torch.Generator().manual_seed(1))
    calls = []
    step = MegalodonBlock.step
    monkeypatch.setattr(MegalodonBlock, "step", lambda self, *a: calls.append(1) or step(self, *a))
    got = decode_logits(model, tokens, prompt=3)  # 12 single tokens over offsets 3, 0..3, 0..3, 0..2
    assert len(calls) == 12 * model.cfg.num_layers  # the one-token path ran
    with torch.no_grad():
        want, _ = model.double()(tokens)
    scale = want.abs().max()
    torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-6 * scale)


def test_window_stats_decode_equals_segment_path(monkeypatch):
    model = make_lm(chunk_size=2)
    tokens = torch.randint(0, model.cfg.vocab_size, (1, 22), generator=torch.Generator().manual_seed(2))
    fast = decode_logits(model, tokens, prompt=1, window_stats=True)  # crosses 8 chunks: windowing on
    monkeypatch.setattr(MegalodonLM, "_can_step", lambda self, cache: False)
    slow = decode_logits(model, tokens, prompt=1, window_stats=True)
    torch.testing.assert_close(fast, slow, rtol=1e-5, atol=1e-5)


def test_bf16_decode_weights_are_close_and_separate():
    model = make_lm()
    tokens = torch.randint(0, model.cfg.vocab_size, (2, 10), generator=torch.Generator().manual_seed(3))
    ref = decode_logits(model, tokens, prompt=2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model.to_decode_dtype(torch.bfloat16)
    got = decode_logits(model, tokens, prompt=2)
    assert model.layers[0].mega.wz.decode_weight.dtype == torch.bfloat16
    assert got.dtype == torch.float32
    assert (got - ref).abs().max() > 0  # the bf16 weights were used
    torch.testing.assert_close(got, ref, rtol=0, atol=0.05 * ref.abs().max().item())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    model.to_decode_dtype(None)
    torch.testing.assert_close(decode_logits(model, tokens, prompt=2), ref, rtol=0, atol=0)
