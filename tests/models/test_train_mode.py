"""Train mode against the float64 oracles of tests/support/oracles.py (docs/architecture.md), with the model's own masks.

The model runs in float64 with every dropout rate distinct (dropout 0.3, hidden_dropout 0.2, attention_dropout
0.25, drop_path 0.4), so each recorded mask also names the rate it was drawn with. ``MaskRecorder`` wraps
``torch.nn.functional.dropout``, ``lean.dropout`` (as the block and the classifier call it),
``block.drop_path`` and ``attention.chunk_attention`` of ``mega_suite.models.megalodon``: the
originals run (the model's real random draws), the keep-masks and the RNG state before each attention call are
recorded, and the oracle -- which applies every dropout itself, in its documented place, with its own 1 / (1 − p)
rescaling -- takes them in data-dependency order, asserting the rate and the shape of each. The DropKey mask is
replayed from the recorded RNG state in the reference's draw layout: ``bernoulli_(p)`` on a uint8
[B · chunks, h, C, C] tensor.
"""

import math

import model_oracle as tm
import pytest
import torch
import torch.nn.functional as F
from oracles import chunk_attention_dropkey, megalodon_block, megalodon_classifier, megalodon_lm, rope_chunks

import mega_suite.models.megalodon.attention as attention_module
import mega_suite.models.megalodon.block as block_module
import mega_suite.models.megalodon.classifier as classifier_module
from kernels.attention.reference import chunk_attention as reference_attention
from mega_suite import MegalodonClassifier, MegalodonLM
from mega_suite.models.megalodon.block import MegalodonBlock

TIGHT = dict(rtol=1e-10, atol=1e-12)
RATES = dict(dropout=0.3, hidden_dropout=0.2, attention_dropout=0.25)
BLOCK_PLACES = ["M", "OR", "H", "A", "FFN"]  # data-dependency order inside a block


def train_config(**overrides):
    base = dict(value_dim=24, ffn_hidden_dim=32, **RATES)  # E, F ≠ D: every mask's shape names its place
    base.update(overrides)
    return tm.tiny_config(**base)


def replay_dropkey(state, shape, chunk_size, p):
    """The reference's DropKey draw, replayed from the RNG state before the call: [B, h, chunks · c, c] with
    dropped[b, h, i, j] for query i and key j of i's chunk (c = min(C, L))."""
    B, L, H = shape[:3]
    c = min(chunk_size, L)
    nc = math.ceil(L / c)
    gen = torch.Generator()
    gen.set_state(state)
    draw = torch.empty(B * nc, H, c, c, dtype=torch.uint8).bernoulli_(p, generator=gen).bool()
    return draw.reshape(B, nc, H, c, c).permute(0, 2, 1, 3, 4).reshape(B, H, nc * c, c)


class MaskRecorder:
    """Records the model's masks and hands them to the oracle (``mask(place, p, shape)``)."""

    def __init__(self, monkeypatch):
        self.dropouts, self.paths, self.attention, self.places = [], [], [], []
        dropout, drop_path, attention = F.dropout, block_module.drop_path, attention_module.chunk_attention

        lean_dropout = block_module.dropout  # F.dropout's draws, a bool mask stored (lean.dropout)
        inside_lean = []

        def recording_dropout(input, p=0.5, training=True, inplace=False):
            out = dropout(input, p, training, inplace)
            if not inside_lean:
                self.dropouts.append((p, training, (out != 0) | (input == 0)))
            return out

        def recording_lean_dropout(input, p, training):
            inside_lean.append(True)
            try:
                out = lean_dropout(input, p, training)
            finally:
                inside_lean.pop()
            self.dropouts.append((p, training, (out != 0) | (input == 0)))
            return out

        def recording_drop_path(x, p, training):
            out = drop_path(x, p, training)
            kept = (out != 0).flatten(1).any(1) | (x == 0).flatten(1).all(1)
            self.paths.append((p, training, kept.view(-1, *([1] * (x.dim() - 1)))))
            return out

        def recording_attention(q, k, v, chunk_size, causal, key_padding_mask=None, dropout_p=0.0):
            self.attention.append((torch.get_rng_state(), dropout_p, tuple(q.shape), chunk_size))
            return attention(q, k, v, chunk_size, causal, key_padding_mask, dropout_p)

        monkeypatch.setattr(F, "dropout", recording_dropout)
        monkeypatch.setattr(block_module, "dropout", recording_lean_dropout)
        monkeypatch.setattr(classifier_module, "dropout", recording_lean_dropout)
        monkeypatch.setattr(block_module, "drop_path", recording_drop_path)
        monkeypatch.setattr(attention_module, "chunk_attention", recording_attention)

    def __call__(self, place, p, shape):
        queue = self.paths if place.startswith("path") else self.dropouts
        assert queue, (
            f"the documented block applies dropout at {place} (p={p}); the model drew no further mask"
        )
        got_p, training, keep = queue.pop(0)
        assert (got_p, training) == (p, True), (
            f"{place}: model used p={got_p}, training={training}; documented p={p}"
        )
        assert tuple(keep.shape) == shape, (
            f"{place}: model's mask {tuple(keep.shape)}, documented tensor {shape}"
        )
        self.places.append((place, keep))
        return keep

    def dropkey(self, p):
        """One DropKey mask per recorded attention call (all must have used rate p)."""
        out = []
        for state, got_p, shape, chunk in self.attention:
            assert got_p == p, f"attention called with dropout_p={got_p}, expected {p}"
            out.append(replay_dropkey(state, shape, chunk, p))
        return out

    def assert_consumed(self):
        assert not self.dropouts, (
            f"{len(self.dropouts)} dropout(s) in the model at places the documented block does not have"
        )
        assert not self.paths, (
            f"{len(self.paths)} drop-path(s) in the model at places the documented block does not have"
        )


def compare_with_grads(run_model, run_oracle, module, inputs, what):
    """Forward both (same masks), then compare the outputs and the gradients of <out, cotangent> with respect
    to every float input and every parameter."""
    out = run_model(*inputs)
    cot = torch.randn(out.shape, generator=torch.Generator().manual_seed(99), dtype=torch.float64)
    names = [n for n, _ in module.named_parameters()]
    diff_inputs = [t for t in inputs if t.is_floating_point()]
    got = torch.autograd.grad((out * cot).sum(), [*diff_inputs, *module.parameters()])

    P = tm.params_of(module, requires_grad=True)
    oracle_inputs = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    ref = run_oracle(P, *oracle_inputs)
    torch.testing.assert_close(out, ref, **TIGHT, msg=lambda m: f"{what} output: {m}")
    diff_oracle = [t for t in oracle_inputs if t.is_floating_point()]
    want = torch.autograd.grad((ref * cot).sum(), [*diff_oracle, *(P[n] for n in names)])
    labels = [f"input{i}" for i in range(len(diff_inputs))] + names
    for name, a, b in zip(labels, got, want, strict=True):
        torch.testing.assert_close(a, b, **TIGHT, msg=lambda m, n=name: f"{what} grad of {n}: {m}")
    return out, ref


# ----------------------------------------------------------------------------------------------------------
# docs/architecture.md#the-block: one LM block, every dropout in its place
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("swiglu,layer_scale,length", [(True, True, 13), (False, False, 4)])
def test_lm_block_train_mode_matches_oracle(monkeypatch, swiglu, layer_scale, length):
    rec = MaskRecorder(monkeypatch)
    cfg = train_config(swiglu=swiglu, layer_scale=layer_scale)
    block = tm.randomise(MegalodonBlock(cfg, layer_index=1).double(), seed=31).train()
    x = tm.lm_input(2, length, cfg.model_dim, seed=32).requires_grad_()
    torch.manual_seed(33)

    def oracle(P, x_):
        (dropped,) = rec.dropkey(cfg.attention_dropout)
        return megalodon_block(P, cfg, x_, rec, layer_index=1, dropped=dropped)

    compare_with_grads(lambda t: block(t)[0], oracle, block, [x], "block")
    rec.assert_consumed()
    assert [p for p, _ in rec.places if not p.startswith("path")] == BLOCK_PLACES
    for place, keep in rec.places:
        if place.startswith("path"):  # rate 0 outside the classifier
            continue  # every mask really dropped something (else the test proves little)
        assert 0 < (~keep).sum() < keep.numel(), place
    assert rec.dropkey(cfg.attention_dropout)[0].any()


def test_lm_block_oracle_rejects_a_missing_dropout(monkeypatch):
    """Guard on the test itself: the oracle with any one place's dropout left out disagrees with the model,
    so every place is observed (a dropout moved to another place is also a missing one here)."""
    rec = MaskRecorder(monkeypatch)
    cfg = train_config()
    block = tm.randomise(MegalodonBlock(cfg, layer_index=1).double(), seed=34).train()
    x = tm.lm_input(2, 9, cfg.model_dim, seed=35)
    torch.manual_seed(36)
    with torch.no_grad():
        out, _ = block(x)
    recorded, recorded_paths = list(rec.dropouts), list(rec.paths)
    (dropped,) = rec.dropkey(cfg.attention_dropout)
    P = tm.params_of(block)
    for skipped in [*BLOCK_PLACES, "DropKey"]:
        rec.dropouts[:], rec.paths[:] = recorded, recorded_paths

        def mask(place, p, shape, skipped=skipped):
            keep = rec(place, p, shape)
            return torch.ones_like(keep) if place == skipped else keep

        ref = megalodon_block(P, cfg, x, mask, 1, None if skipped == "DropKey" else dropped)
        assert (out - ref).abs().max() > 1e-4, f"leaving out the {skipped} dropout changed nothing"


def test_eval_mode_draws_no_masks(monkeypatch):
    rec = MaskRecorder(monkeypatch)
    cfg = train_config(drop_path=0.4)
    block = tm.randomise(MegalodonBlock(cfg, layer_index=1).double(), seed=37).eval()
    x = tm.lm_input(1, 7, cfg.model_dim, seed=38)
    state = torch.get_rng_state()
    out, _ = block(x)
    assert torch.equal(torch.get_rng_state(), state), "eval mode consumed random numbers"
    assert all(not training for _, training, _ in rec.dropouts + rec.paths)
    assert [p for _, p, _, _ in rec.attention] == [0.0]
    ref, _ = tm.oracle_block(tm.params_of(block), cfg, x)
    torch.testing.assert_close(out, ref, **tm.F64)


# ----------------------------------------------------------------------------------------------------------
# docs/architecture.md#language-model: the LM (embedding dropout, every block, final norm, output projection, NLL)
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("share_emb", [True, False])
def test_lm_train_mode_matches_oracle(monkeypatch, share_emb):
    rec = MaskRecorder(monkeypatch)
    cfg = train_config(scale_emb=True, share_emb=share_emb)
    torch.manual_seed(40)
    model = tm.randomise(MegalodonLM(cfg).double(), seed=41).train()
    gen = torch.Generator().manual_seed(42)
    tokens = torch.randint(0, cfg.vocab_size, (2, 11), generator=gen)
    target = torch.randint(0, cfg.vocab_size, (2, 11), generator=gen)
    target[1, -3:] = -100
    torch.manual_seed(43)

    def run_model(t):
        hidden, _ = model.forward_hidden(t)
        return model.token_nll(hidden, target)

    def oracle(P, t):
        logits = megalodon_lm(P, cfg, t, rec, rec.dropkey(cfg.attention_dropout))
        nll = -torch.log_softmax(logits, -1).gather(-1, target.clamp(min=0)[..., None])[..., 0]
        return nll * (target != -100)

    compare_with_grads(run_model, oracle, model, [tokens], "LM")
    rec.assert_consumed()
    assert [p for p, _ in rec.places if not p.startswith("path")] == ["embed", *BLOCK_PLACES * cfg.num_layers]
    assert len(rec.attention) == cfg.num_layers
    for place, keep in rec.places:
        assert place.startswith("path") or 0 < (~keep).sum() < keep.numel(), f"{place}: a trivial mask"


# ----------------------------------------------------------------------------------------------------------
# docs/architecture.md#classifier: the classifier with drop-path (per sample, rescaled by 1 / (1 − p), rate linear over depth)
# ----------------------------------------------------------------------------------------------------------


def test_classifier_train_mode_with_drop_path_matches_oracle(monkeypatch):
    rec = MaskRecorder(monkeypatch)
    cfg = train_config(num_classes=3, num_layers=3, drop_path=0.4, input_type="scalar")
    torch.manual_seed(50)
    model = tm.randomise(MegalodonClassifier(cfg).double(), seed=51).train()
    B, L = 8, 9
    x = torch.randn(B, L, generator=torch.Generator().manual_seed(52), dtype=torch.float64).requires_grad_()
    mask = torch.arange(L)[None, :] >= torch.tensor([9, 6, 9, 3, 8, 9, 7, 9])[:, None]
    torch.manual_seed(53)

    def oracle(P, x_):
        return megalodon_classifier(P, cfg, x_, mask, rec, rec.dropkey(cfg.attention_dropout))

    compare_with_grads(lambda t: model(t, padding_mask=mask), oracle, model, [x], "classifier")
    rec.assert_consumed()
    paths = [(place, keep) for place, keep in rec.places if place.startswith("path")]
    assert [p for p, _ in paths] == ["path_H", "path_FFN"] * cfg.num_layers
    assert all(keep.all() for _, keep in paths[:2]), "block 0 has drop-path rate 0"
    assert any(keep.any() and not keep.all() for _, keep in paths[2:]), (
        "no mask kept some samples, dropped others"
    )
    assert [p for p, _ in rec.places][-1] == "head"


# ----------------------------------------------------------------------------------------------------------
# docs/architecture.md#normalised-attention: DropKey on the reference path -- logits set to −inf with probability p, no rescaling
# ----------------------------------------------------------------------------------------------------------


def qkv(B, L, H, dk, dv, seed):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, L, H, dk, generator=gen, dtype=torch.float64) for _ in range(2))
    v = torch.randn(B, L, H, dv, generator=gen, dtype=torch.float64)
    return q, k, v


def rescaled_dropout_attention(q, k, v, chunk, causal, pad, dropped, p):
    """What DropKey is NOT: softmax over all admissible keys, then the dropped probabilities zeroed and the
    rest multiplied by 1 / (1 − p) (ordinary dropout on the attention probabilities), same draws."""
    B, L, H, _ = q.shape
    out = torch.zeros(B, L, H, v.shape[-1], dtype=torch.float64)
    for start in range(0, L, chunk):
        sl = slice(start, min(start + chunk, L))
        c = sl.stop - start
        s = torch.einsum("bihd,bjhd->bhij", q[:, sl], k[:, sl])
        allowed = torch.ones(B, 1, c, c, dtype=torch.bool)
        if causal:
            allowed = allowed & torch.ones(c, c, dtype=torch.bool).tril()
        if pad is not None:
            allowed = allowed & ~pad[:, None, None, sl]
        probs = torch.softmax(s.masked_fill(~allowed, -math.inf), -1).nan_to_num(0.0)
        probs = probs * ~dropped[:, :, sl, :c] / (1 - p)
        out[:, sl] = torch.einsum("bhij,bjhd->bihd", probs, v[:, sl])
    return out


def dropkey_case(causal, seed, p=0.3):
    B, L, H, C = 2, 11, 2, 4  # three chunks, the last one short (internal padding)
    q, k, v = qkv(B, L, H, 6, 5, seed)
    pad = torch.zeros(B, L, dtype=torch.bool)
    pad[1, 6:] = True
    torch.manual_seed(seed + 1)
    state = torch.get_rng_state()
    dropped = replay_dropkey(state, (B, L, H), C, p)
    torch.set_rng_state(state)
    return (q, k, v, C, causal, pad), dropped


@pytest.mark.parametrize("causal", [True, False])
def test_dropkey_reference_matches_replayed_oracle(causal):
    args, dropped = dropkey_case(causal, seed=60)
    q, k, v = (t.requires_grad_() for t in args[:3])
    out = reference_attention(*args, dropout_p=0.3)
    ref = chunk_attention_dropkey(*args, dropped=dropped)
    torch.testing.assert_close(out, ref, **TIGHT)
    cot = torch.randn(out.shape, generator=torch.Generator().manual_seed(61), dtype=torch.float64)
    got = torch.autograd.grad((out * cot).sum(), (q, k, v))
    want = torch.autograd.grad((ref * cot).sum(), (q, k, v))
    for name, a, b in zip("qkv", got, want, strict=True):
        torch.testing.assert_close(a, b, **TIGHT, msg=lambda m, n=name: f"grad of {n}: {m}")
    # rows that lost every admissible key output exactly 0 (the oracle has such rows: the test sees them)
    empty = (ref == 0).all(-1)
    assert empty.any() and (out[empty] == 0).all()


def test_dropkey_keeps_attention_weights_summing_to_one():
    """With V ≡ 1 the output is Σ_j weights_ij: exactly 1 for every row that kept a key (no rescaling),
    exactly 0 for a row whose keys were all dropped. Holds for any draw layout."""
    B, L, H, C = 3, 16, 2, 8
    q, k, _ = qkv(B, L, H, 4, 3, seed=62)
    v = torch.ones(B, L, H, 3, dtype=torch.float64)
    torch.manual_seed(63)
    out = reference_attention(q, k, v, C, True, dropout_p=0.6)
    row = out[..., 0]
    assert torch.equal(out, row[..., None].expand_as(out))
    ones, zeros = (row - 1).abs() < 1e-12, row == 0
    assert (ones | zeros).all(), f"row sums {row[~(ones | zeros)]} are neither 1 nor 0: rescaled?"
    assert zeros.any() and ones.any()
    assert zeros[:, 0].float().mean() > 0.3, "a first row (one key) should be empty with probability 0.6"


def test_dropkey_at_rate_one_outputs_zeros():
    q, k, v = qkv(1, 9, 2, 4, 3, seed=64)
    assert (reference_attention(q, k, v, 4, False, dropout_p=1.0) == 0).all()


def test_rescaled_dropout_fails_the_dropkey_tests():
    """Guard on the tests above: ordinary dropout on the probabilities with the very same draws disagrees
    with the DropKey oracle, and its rows of V ≡ 1 do not sum to 1."""
    p = 0.3
    for causal in (True, False):
        args, dropped = dropkey_case(causal, seed=60, p=p)
        wrong = rescaled_dropout_attention(*args, dropped, p)
        assert (wrong - chunk_attention_dropkey(*args, dropped=dropped)).abs().max() > 1e-2
    q, k, v, C, causal, pad = args
    ones = torch.ones_like(v)
    row = rescaled_dropout_attention(q, k, ones, C, True, None, dropped, p)[..., 0]
    assert not (((row - 1).abs() < 1e-12) | (row == 0)).all()
    # and the oracle is the reference's DropKey: the same draws through both agree (positive control)
    torch.testing.assert_close(
        chunk_attention_dropkey(*args, dropped=dropped), reference_attention(*args, dropout_p=p), **TIGHT
    )


def test_rope_oracle_restarts_in_every_chunk():
    x = torch.randn(1, 10, 1, 4, generator=torch.Generator().manual_seed(65), dtype=torch.float64)
    y = rope_chunks(x, 4, 10000.0)
    torch.testing.assert_close(y[:, 4:8], rope_chunks(x[:, 4:8], 4, 10000.0), **TIGHT)
    torch.testing.assert_close(y[:, 0], x[:, 0], **TIGHT)  # position 0: no rotation
