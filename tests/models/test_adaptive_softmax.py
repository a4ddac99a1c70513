"""Adaptive input and adaptive softmax (the WikiText-103 configuration of docs/recipes.md#task-hyperparameters: two cutoffs, factor 4, tied)
against a direct float64 computation of the band probabilities and band embeddings from the weights
(tests/support/oracles.py ``adaptive_log_prob`` / ``adaptive_embed``), alone and inside the LM in train mode.

Band probabilities: P(w) = softmax(head(h))[w] for the c₀ shortlist words; for band i ≥ 1,
P(w) = P(cluster i) · softmax(out_i(proj_i(h)))[w − c_{i−1}] with P(cluster i) = softmax(head(h))[c₀ + i − 1].
"""

import math

import model_oracle as tm
import torch
from oracles import adaptive_embed, adaptive_log_prob, megalodon_lm
from test_train_mode import TIGHT, MaskRecorder, compare_with_grads, train_config

from mega_suite import MegalodonLM
from mega_suite.models.megalodon.lm import AdaptiveSoftmax

D, V, CUTOFFS, FACTOR = 32, 25, [6, 14], 4.0  # band widths 32, 8, 2 (as WikiText-103's 1024, 256, 64)


def softmax_module(seed=70):
    torch.manual_seed(seed)
    return tm.randomise(AdaptiveSoftmax(D, V, CUTOFFS, FACTOR).double(), seed=seed, scale=0.5)


def weights(module, requires_grad=False):
    P = tm.params_of(module, requires_grad)
    tails = [(P[f"tail.{i}.0.weight"], P[f"tail.{i}.1.weight"]) for i in range(len(CUTOFFS))]
    return P, P["head.weight"], tails


def every_band_tokens():
    return torch.tensor([0, 5, 6, 9, 13, 14, 20, 24, 3, 17])  # both ends of every band


def test_band_shapes_follow_the_factor():
    _, head_w, tails = weights(softmax_module())
    assert head_w.shape == (CUTOFFS[0] + len(CUTOFFS), D)  # shortlist words + one logit per tail cluster
    assert [tuple(p.shape) for p, _ in tails] == [(8, D), (2, D)]  # D / 4, D / 16
    assert [tuple(o.shape) for _, o in tails] == [(8, 8), (11, 2)]  # words of each band


def test_log_prob_matches_band_oracle():
    module = softmax_module()
    _, head_w, tails = weights(module)
    h = 2 * torch.randn(7, D, generator=torch.Generator().manual_seed(71), dtype=torch.float64)
    got = module.log_prob(h)
    want = adaptive_log_prob(h, head_w, tails, CUTOFFS)
    torch.testing.assert_close(got, want, **TIGHT)
    torch.testing.assert_close(want.exp().sum(-1), torch.ones(7, dtype=torch.float64), **TIGHT)
    # the mass of band i is the head's probability of cluster i
    head = torch.softmax(h @ head_w.T, -1)
    torch.testing.assert_close(want[:, 6:14].exp().sum(-1), head[:, 6], **TIGHT)
    torch.testing.assert_close(want[:, 14:].exp().sum(-1), head[:, 7], **TIGHT)


def test_token_nll_and_gradients_match_band_oracle():
    module = softmax_module()
    target = every_band_tokens()
    h = torch.randn(len(target), D, generator=torch.Generator().manual_seed(72), dtype=torch.float64)

    def oracle(P, h_):
        tails = [(P[f"tail.{i}.0.weight"], P[f"tail.{i}.1.weight"]) for i in range(len(CUTOFFS))]
        return -adaptive_log_prob(h_, P["head.weight"], tails, CUTOFFS).gather(1, target[:, None])[:, 0]

    compare_with_grads(lambda h_: module.token_nll(h_, target), oracle, module, [h.requires_grad_()], "NLL")


def test_adaptive_input_embedding_matches_band_oracle():
    module = softmax_module()
    tokens = every_band_tokens().view(2, 5)

    def oracle(P, _):
        tails = [(P[f"tail.{i}.0.weight"], P[f"tail.{i}.1.weight"]) for i in range(len(CUTOFFS))]
        return adaptive_embed(tokens, P["head.weight"], tails, CUTOFFS)

    got, want = compare_with_grads(lambda _: module.embed(tokens), oracle, module, [tokens], "embed")
    # band 0 rows are the head's rows; band 2 rows have rank 2 (width D/16 projected up)
    _, head_w, tails = weights(module)
    torch.testing.assert_close(got[0, 0], head_w[0], rtol=0, atol=0)
    assert torch.linalg.matrix_rank(adaptive_embed(torch.arange(14, 25), head_w, tails, CUTOFFS)) == 2


def adaptive_lm(seed):
    cfg = train_config(model_dim=D, vocab_size=V, adaptive_cutoffs=CUTOFFS, adaptive_factor=FACTOR,
                       scale_emb=True, norm_num_groups=4)  # fmt: skip
    torch.manual_seed(seed)
    return cfg, tm.randomise(MegalodonLM(cfg).double(), seed=seed, scale=0.3).train()


def test_adaptive_lm_train_mode_matches_oracle(monkeypatch):
    """The WikiText-103 form of docs/architecture.md#language-model in train mode: adaptive input · sqrt(D) -> dropout -> blocks -> final
    norm -> adaptive softmax log-probabilities, with the model's own masks."""
    rec = MaskRecorder(monkeypatch)
    cfg, model = adaptive_lm(73)
    tokens = torch.randint(0, V, (2, 9), generator=torch.Generator().manual_seed(74))
    torch.manual_seed(75)

    def run_model(t):
        hidden, _ = model.forward_hidden(t)
        return model.logits(hidden)

    def oracle(P, t):
        return megalodon_lm(P, cfg, t, rec, rec.dropkey(cfg.attention_dropout))

    compare_with_grads(run_model, oracle, model, [tokens], "adaptive LM")
    rec.assert_consumed()


def test_adaptive_lm_token_nll_is_float64_in_a_float64_model():
    cfg, model = adaptive_lm(76)
    model.eval()
    gen = torch.Generator().manual_seed(77)
    tokens, target = (torch.randint(0, V, (2, 7), generator=gen) for _ in range(2))
    target[0, :2] = -100
    with torch.no_grad():
        hidden, _ = model.forward_hidden(tokens)
        nll = model.token_nll(hidden, target)
        log_p = model.logits(hidden)
    want = -log_p.gather(-1, target.clamp(min=0)[..., None])[..., 0] * (target != -100)
    assert nll.dtype == torch.float64
    torch.testing.assert_close(nll, want, **TIGHT)


def test_adaptive_lm_token_nll_agrees_to_float32():
    """Meanwhile: the adaptive NLL of the LM is right to float32 rounding, and 0 at ignored targets."""
    cfg, model = adaptive_lm(76)
    model.eval()
    gen = torch.Generator().manual_seed(77)
    tokens, target = (torch.randint(0, V, (2, 7), generator=gen) for _ in range(2))
    target[0, :2] = -100
    with torch.no_grad():
        hidden, _ = model.forward_hidden(tokens)
        nll = model.token_nll(hidden, target).double()
        P, _, _ = weights(model.output.output)
        tails = [(P[f"tail.{i}.0.weight"], P[f"tail.{i}.1.weight"]) for i in range(len(CUTOFFS))]
        log_p = adaptive_log_prob(hidden.reshape(-1, D), P["head.weight"], tails, CUTOFFS).view(2, 7, V)
    want = -log_p.gather(-1, target.clamp(min=0)[..., None])[..., 0] * (target != -100)
    torch.testing.assert_close(nll, want, rtol=1e-6, atol=1e-6)
    assert (nll[0, :2] == 0).all() and math.isfinite(float(nll.sum()))
