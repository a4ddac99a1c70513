"""Sampling (mega_suite/models/sampling.py) against its definition, written here in float64:

    p = softmax(z / T) over the tokens kept: top-k keeps the k largest z (ties with the k-th kept); top-p then
    sorts the (top-k renormalised) p in descending order and drops a token once the tokens above it already
    hold top_p of the mass (HF's TopPLogitsWarper's rule), and renormalises.

The distribution ``sample_next`` hands to ``torch.multinomial`` is compared with it exactly (to float32
rounding) at temperatures other than 1, alone and with top-k and top-p; a seeded draw's frequencies agree with
it within five binomial standard deviations of its sample size; and generation through either architecture's
decoder samples each new token from the definition applied once to the model's own logits.
"""

from __future__ import annotations

import math

import model_oracle as tm
import pytest
import torch

import mega_suite.models.sampling as sampling
from mega_suite import MegalodonLM
from mega_suite.models.generation import generate
from mega_suite.models.llama import LlamaConfig, LlamaLM
from mega_suite.models.sampling import sample_next


def oracle(logits: torch.Tensor, temperature: float, top_k: int | None = None, top_p: float | None = None):
    """logits [B, V] -> the float64 sampling distribution [B, V], row by row from the definition above."""
    rows = []
    for z in logits.double() / temperature:
        keep = torch.ones_like(z, dtype=torch.bool)
        if top_k is not None:
            kth = sorted(z.tolist(), reverse=True)[min(top_k, len(z)) - 1]
            keep = z >= kth
        p = torch.where(keep, torch.exp(z - z[keep].max()), 0.0)
        p = p / p.sum()
        if top_p is not None:
            above = 0.0
            for i in sorted(range(len(p)), key=lambda i: -float(p[i])):
                if above >= top_p:
                    p[i] = 0.0
                above += float(p[i])
            p = p / p.sum()
        rows.append(p)
    return torch.stack(rows)


def spy_multinomial(monkeypatch) -> list[torch.Tensor]:
    """Record the probabilities every ``torch.multinomial`` call is given (and still draw from them)."""
    seen, real = [], torch.multinomial
    monkeypatch.setattr(torch, "multinomial", lambda p, *a, **k: seen.append(p.clone()) or real(p, *a, **k))
    return seen


def logits_of(seed: int, rows: int = 3, vocab: int = 11) -> torch.Tensor:
    return 2.0 * torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed))


SETTINGS = [
    dict(temperature=0.5),
    dict(temperature=2.0),
    dict(temperature=0.7, top_k=4),
    dict(temperature=1.6, top_p=0.62),
    dict(temperature=0.6, top_p=0.85),
    dict(temperature=1.3, top_k=6, top_p=0.7),
    dict(temperature=0.8, top_k=1),
    dict(temperature=3.0, top_p=1.0),
]


@pytest.mark.parametrize("settings", SETTINGS, ids=str)
def test_the_distribution_sampled_from_is_the_definition_at_any_temperature(settings, monkeypatch):
    seen = spy_multinomial(monkeypatch)
    for seed in range(4):
        logits = logits_of(seed)
        sample_next(logits, generator=torch.Generator().manual_seed(0), **settings)
        want = oracle(logits, **settings)
        assert (want > 0).sum(-1).min() >= 1
        torch.testing.assert_close(
            seen[-1].double(), want, rtol=0, atol=2e-6, msg=lambda m, seed=seed: f"logits {seed}: {m}"
        )


def test_the_definition_differs_between_these_settings():
    """The settings above tell a temperature applied twice, or top-p taken before the temperature, from the
    definition (else the test above could not fail on them)."""
    for s in SETTINGS:
        if s["temperature"] == 1.0 or s.get("top_k") == 1:
            continue
        logits = torch.cat([logits_of(seed) for seed in range(4)])
        t, k, p = s["temperature"], s.get("top_k"), s.get("top_p")
        assert (oracle(logits, t, k, p) - oracle(logits, t * t, k, p)).abs().max() > 0.01, s
    before = oracle(logits_of(0), 1.0, top_p=0.62) > 0  # top-p on softmax(z), not softmax(z / 1.6)
    assert not torch.equal(before, oracle(logits_of(0), 1.6, top_p=0.62) > 0)


@pytest.mark.parametrize("top_p, kept", [(0.25, 1), (0.5, 2), (0.75, 3), (0.5 + 1e-3, 3), (0.5 - 1e-3, 2)])
def test_top_p_drops_the_token_whose_betters_hold_exactly_top_p(top_p, kept, monkeypatch):
    """Four equal logits: each token holds exactly 1/4 in float32, so the boundary is exact. A token is
    dropped when the tokens ranked above it hold top_p or more (``>=``, not ``>``)."""
    seen = spy_multinomial(monkeypatch)
    sample_next(torch.full((2, 4), 0.3), temperature=0.9, top_p=top_p)
    assert ((seen[-1] > 0).sum(-1) == kept).all(), seen[-1]
    torch.testing.assert_close(seen[-1][seen[-1] > 0], torch.full((2 * kept,), 1 / kept), rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    "settings", [dict(temperature=0.5), dict(temperature=1.7, top_k=3, top_p=0.8)], ids=str
)
def test_seeded_frequencies_are_the_definition_within_five_sigma(settings):
    """N draws of one row: each token's frequency is within 5 sqrt(p (1 - p) / N) (+ 1 / N) of its
    probability; a token outside the kept set is never drawn."""
    n = 20000
    logits = logits_of(7, rows=1, vocab=6)
    draws = sample_next(logits.expand(n, -1), generator=torch.Generator().manual_seed(11), **settings)
    freq = torch.bincount(draws, minlength=6).double() / n
    p = oracle(logits, **settings)[0]
    bound = 5 * torch.sqrt(p * (1 - p) / n) + 1 / n
    assert ((freq - p).abs() <= bound).all(), (freq.tolist(), p.tolist())
    assert (freq[p == 0] == 0).all()


def tiny(arch: str):
    if arch == "megalodon":
        model = MegalodonLM(tm.tiny_config(vocab_size=17))
    else:
        model = LlamaLM(
            LlamaConfig(num_layers=2, model_dim=16, num_heads=2, ffn_hidden_dim=24, vocab_size=17)
        )
    return tm.randomise(model, seed=3, scale=0.5).eval()


@pytest.mark.parametrize("arch", ["megalodon", "llama"])
def test_generation_samples_each_token_from_the_definition_applied_once(arch, monkeypatch):
    """``generate`` at T = 0.6, top-k 3, top-p 0.9 (each binds at some step): the distribution of every new
    token is the definition applied to a full forward's last logits over the tokens so far (all of them fit
    Llama's window)."""
    model = tiny(arch)
    prompt = torch.randint(0, 17, (2, 3), generator=torch.Generator().manual_seed(5))
    seen = spy_multinomial(monkeypatch)
    settings = dict(temperature=0.6, top_k=3, top_p=0.9)
    out = generate(model, prompt, 6, generator=torch.Generator().manual_seed(2), **settings)
    assert len(seen) == 6 and out.shape == (2, 9)
    for i, got in enumerate(seen):
        with torch.no_grad():
            logits = model(out[:, : 3 + i])[0][:, -1]
        torch.testing.assert_close(got.double(), oracle(logits, **settings), rtol=0, atol=1e-5)
        assert math.isclose(float(got.sum(-1)[0]), 1.0, abs_tol=1e-5)


def test_the_loop_hands_sample_next_the_logits_unchanged(monkeypatch):
    """``sample_loop`` passes each step's raw logits and the settings to ``sample_next`` once."""
    calls = []
    real = sampling.sample_next
    monkeypatch.setattr(sampling, "sample_next", lambda *a: calls.append(a) or real(*a))
    logits = logits_of(1, rows=2)[:, None]
    sampling.sample_loop(torch.zeros(2, 1, dtype=torch.long), logits, lambda t: logits, 3, 0.4, 5, 0.8)
    assert len(calls) == 3
    for a in calls:
        assert torch.equal(a[0], logits[:, -1]) and a[1:5] == (0.4, 5, 0.8, False)
