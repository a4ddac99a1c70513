"""Streaming inference (docs/architecture.md#streaming) of the whole language model in float64: any split of a sequence into
segments gives the logits of one full pass, the cache stays O(C), the windowed-statistics option agrees with
an oracle, and generate() / sample_next() keep to greedy, temperature, top-k, top-p and eos semantics.

The LM oracle runs the block oracle of tests/models/test_megalodon.py chunk by chunk, carrying the CEMA state and the
raw inputs of every norm (its statistics are recomputed from those inputs by brute force).
"""

import copy
import math

import model_oracle as tm
import pytest
import torch

import mega_suite.models.megalodon.lm as lm_module
import mega_suite.models.megalodon.step as step_module
from mega_suite import MegalodonLM
from mega_suite.models.megalodon.decode import generate
from mega_suite.models.sampling import sample_next

EXACT = dict(rtol=1e-10, atol=1e-10)
WINDOW_CHUNKS, WINDOW_AFTER = (
    6,
    8,
)  # docs/architecture.md#streaming: the last 6 chunks once 8 chunks have been seen


def make_lm(chunk_size=5, method="auto", seed=0, **overrides):
    cfg = tm.tiny_config(
        chunk_size=chunk_size, cema_method=method, scale_emb=True, share_emb=True, **overrides
    )
    torch.manual_seed(seed)
    return tm.randomise(MegalodonLM(cfg).double(), seed=seed).eval()


def tokens_for(model, B, L, seed):
    return torch.randint(0, model.cfg.vocab_size, (B, L), generator=torch.Generator().manual_seed(seed))


def oracle_lm(model, tokens, window=False, window_final_norm=True):
    """docs/architecture.md#language-model and docs/architecture.md#streaming from the block oracle, one chunk at a time. With ``window``, every TimestepNorm (in the
    blocks and, unless ``window_final_norm`` is False, the final one) starts chunk k >= 8 from the statistics
    of its inputs in chunks k-6..k-1. Returns logits [B, L, V] and, per norm, the list of its input chunks."""
    cfg = model.cfg
    C, D = cfg.chunk_size, cfg.model_dim
    params = [tm.params_of(layer) for layer in model.layers]
    x = model.embed.weight.detach()[tokens] * (math.sqrt(D) if cfg.scale_emb else 1.0)
    history = [[] for _ in range(len(params) + 1)]  # inputs of each block's norm, then the final norm's
    states = [None] * len(params)
    logits = []
    for k, start in enumerate(range(0, tokens.shape[1], C)):
        xc = x[:, start : start + C]

        def prefix(i, k=k):
            windowed = window and k >= WINDOW_AFTER and (window_final_norm or i != len(params))
            seen = history[i][k - WINDOW_CHUNKS : k] if windowed else history[i]
            return torch.cat(seen, 1) if seen else None

        for i, P in enumerate(params):
            out, states[i] = tm.oracle_block(P, cfg, xc, norm_prefix=prefix(i), h0=states[i])
            history[i].append(xc)
            xc = out
        fn = model.output.final_norm
        y = tm.timestep_norm(
            xc, fn.weight.detach(), fn.bias.detach(), cfg.norm_num_groups, cfg.norm_eps, prefix(len(params))
        )
        history[-1].append(xc)
        logits.append(y @ model.output.output.weight.detach().T)
    return torch.cat(logits, 1), history


def stream(model, tokens, sizes, window_stats=False):
    assert sum(sizes) == tokens.shape[1]
    cache = model.new_cache(tokens.shape[0], window_stats=window_stats)
    outs, start = [], 0
    for n in sizes:
        out, cache = model(tokens[:, start : start + n], cache)
        assert out.shape == (tokens.shape[0], n, model.cfg.vocab_size)
        assert cache.position == start + n
        outs.append(out)
        start += n
    return torch.cat(outs, 1), cache


def random_split(length, pieces, seed):
    gen = torch.Generator().manual_seed(seed)
    cuts = sorted(torch.randperm(length - 1, generator=gen)[: pieces - 1].add(1).tolist())
    return [b - a for a, b in zip([0, *cuts], [*cuts, length])]


# ----------------------------------------------------------------------------------------------------------
# full pass == oracle, full pass == any split
# ----------------------------------------------------------------------------------------------------------


def test_full_pass_matches_oracle():
    model = make_lm(chunk_size=5, seed=1)
    tokens = tokens_for(model, 2, 23, seed=2)
    logits, _ = model(tokens)
    expected, _ = oracle_lm(model, tokens)
    torch.testing.assert_close(logits, expected, **tm.F64)


@pytest.mark.parametrize("chunk_size,method", [(5, "auto"), (7, "chunked"), (5, "fft")])
def test_streaming_equals_full_pass(chunk_size, method):
    C, L = chunk_size, 41
    model = make_lm(chunk_size=C, method=method, seed=3)
    tokens = tokens_for(model, 2, L, seed=4)
    full, _ = model(tokens)
    splits = {
        "token by token": [1] * L,
        # mid-chunk starts, a segment crossing one boundary, one longer than three chunks, odd lengths
        "crafted": [3, C + 4, 1, 3 * C + 2, L - (3 + C + 4 + 1 + 3 * C + 2)],
        **{f"random {s}": random_split(L, 3 + 2 * s, seed=s) for s in range(2)},
    }
    for name, sizes in splits.items():
        out, _ = stream(model, tokens, sizes)
        torch.testing.assert_close(out, full, **EXACT, msg=lambda m, n=name, s=sizes: f"split {n} {s}: {m}")
    out, cache = model(tokens, use_cache=True)  # a stream started without a cache
    torch.testing.assert_close(out, full, **EXACT)
    assert cache.position == L


def test_cache_can_be_branched():
    """A cache is a value: continuing it twice (e.g. two candidate continuations) gives the same result."""
    model = make_lm(seed=20)
    tokens = tokens_for(model, 2, 19, seed=21)
    full, _ = model(tokens)
    _, cache = model(tokens[:, :12], use_cache=True)
    first, _ = model(tokens[:, 12:], cache)
    _, _ = model(tokens[:, 12:15].flip(0), cache)  # another branch from the same cache
    second, _ = model(tokens[:, 12:], cache)
    torch.testing.assert_close(first, full[:, 12:], **EXACT)
    assert torch.equal(first, second)


def test_streaming_empty_segment():
    model = make_lm(seed=5)
    tokens = tokens_for(model, 2, 9, seed=6)
    full, _ = model(tokens)
    out, _ = stream(model, tokens, [4, 0, 5])
    torch.testing.assert_close(out, full, **EXACT)


# ----------------------------------------------------------------------------------------------------------
# one or two tokens through the model's own forward: the packed one-token step (docs/long_context.md)
# ----------------------------------------------------------------------------------------------------------

F32 = 2e-6  # float32 rounding of a few ops in a row, relative to the largest logit (as tests/models/test_decode.py)


def float32_lm(seed, **overrides):
    cfg = tm.tiny_config(chunk_size=4, scale_emb=True, **overrides)
    torch.manual_seed(seed)
    return tm.randomise(MegalodonLM(cfg), seed=seed).eval()


def oracle32(model, tokens):
    """The float64 oracle's logits for a float32 model (its parameters in float64)."""
    return oracle_lm(copy.deepcopy(model).double(), tokens)[0]


def count_steps(monkeypatch):
    calls = []
    step = step_module.block_step
    monkeypatch.setattr(step_module, "block_step", lambda *a: calls.append(1) or step(*a))
    return calls


def assert_f32(got, want):
    torch.testing.assert_close(got.double(), want, rtol=0, atol=F32 * want.abs().max().item())


@pytest.mark.parametrize("batch, heads, hidden", [(2, 2, False), (1, 1, True), (2, 1, False)])
def test_one_and_two_token_forwards_take_the_packed_step_and_equal_the_oracle(
    batch, heads, hidden, monkeypatch
):
    """A float32 model continued by one or two tokens per call (across chunk boundaries, chunk 4) takes the
    packed step (one ``block_step`` per token and layer) through ``forward`` and through ``forward_hidden`` +
    ``logits``; its logits equal the float64 oracle's, and the general streaming pass's, to float32 rounding."""
    model = float32_lm(30, num_heads=heads, layer_scale=hidden)
    tokens = tokens_for(model, batch, 17, seed=31)
    sizes = [3, 1, 2, 1, 1, 2, 2, 1, 1, 2, 1]  # offsets 3, 0, 2, 3, 0, 1, 3, 1, 2, 3, 1
    calls = count_steps(monkeypatch)

    def run():
        cache, outs, start = None, [], 0
        with torch.no_grad():
            for n in sizes:
                piece = tokens[:, start : start + n]
                if hidden:
                    x, cache = model.forward_hidden(piece, cache, use_cache=True)
                    out = model.logits(x)
                else:
                    out, cache = model(piece, cache, use_cache=True)
                assert out.dtype == torch.float32 and cache.position == start + n
                outs.append(out)
                start += n
        return torch.cat(outs, 1)

    fast = run()
    assert len(calls) == (17 - 3) * model.cfg.num_layers  # every token after the prompt stepped
    assert_f32(fast, oracle32(model, tokens))
    monkeypatch.setattr(lm_module, "STEP_TOKENS", 0)  # the general streaming pass for every piece
    slow = run()
    assert len(calls) == (17 - 3) * model.cfg.num_layers
    assert_f32(fast, slow.double())


def test_the_packed_step_is_taken_only_where_it_applies(monkeypatch):
    """Three tokens, autograd, training mode, float64: the general streaming pass (no step), same logits."""
    model = float32_lm(32)
    tokens = tokens_for(model, 1, 8, seed=33)
    with torch.no_grad():
        _, cache = model(tokens[:, :4], use_cache=True)
    calls = count_steps(monkeypatch)
    with torch.no_grad():
        model(tokens[:, 4:7], cache)
    model(tokens[:, 4:5], cache)  # autograd on
    model.train()
    with torch.no_grad():
        model(tokens[:, 4:5], cache)
    model.eval().double()
    with torch.no_grad():
        model(tokens[:, 4:5], model(tokens[:, :4].clone(), use_cache=True)[1])
    assert calls == []
    model.float()
    with torch.no_grad():
        model(tokens[:, 4:5], cache)
    assert len(calls) == model.cfg.num_layers


def test_the_packed_step_is_float32_under_autocast():
    """A plan first packed under bf16 autocast holds float32 weights, and the step runs in float32 whatever
    the autocast: the same logits as without it."""
    model = float32_lm(36)
    other = copy.deepcopy(model)
    tokens = tokens_for(model, 2, 6, seed=37)
    outs = []
    for m, mixed in ((model, True), (other, False)):
        with torch.no_grad():
            _, cache = m(tokens[:, :4], use_cache=True)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mixed):
                outs.append(m(tokens[:, 4:6], cache)[0])
    assert outs[0].dtype == torch.float32
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)


def _change(model, how, tokens):
    """Change ``model``'s weights in place as ``how`` says."""
    if how == "fused_adamw":  # writes outside autograd's version counters; no train() / eval() switch here
        opt = torch.optim.AdamW(model.parameters(), lr=0.05, fused=True)
        model(tokens)[0].square().mean().backward()
        opt.step()
    elif how == "data_then_eval":  # p.data moves no version counter; eval() is the documented signal
        model.layers[1].mega.wv.weight.data.mul_(1.5)
        model.eval()
    elif how == "in_place":
        with torch.no_grad():
            model.layers[0].nffn.fc2.weight.mul_(1.5)
    elif how == "load_state_dict":
        model.load_state_dict(float32_lm(7).state_dict())
    else:  # a parameter replaced by a new one
        fc1 = model.layers[1].nffn.fc1
        fc1.weight = torch.nn.Parameter(fc1.weight.detach() * 1.5)


@pytest.mark.parametrize(
    "how", ["fused_adamw", "data_then_eval", "in_place", "load_state_dict", "new_parameter"]
)
def test_a_forward_after_a_weight_change_sees_the_new_weights(how, monkeypatch):
    """Stream one token at a time (the plan is packed), change the weights, stream again: the new stream's
    logits are the float64 oracle's of the new weights, never the old packs'."""
    model = float32_lm(34)
    tokens = tokens_for(model, 2, 9, seed=35)

    def one_at_a_time():
        cache, outs = None, []
        with torch.no_grad():
            for t in range(tokens.shape[1]):
                out, cache = model(tokens[:, t : t + 1], cache, use_cache=True)
                outs.append(out)
        return torch.cat(outs, 1)

    calls = count_steps(monkeypatch)
    before = one_at_a_time()
    assert_f32(before, oracle32(model, tokens))
    _change(model, how, tokens)
    after = one_at_a_time()
    assert len(calls) == 2 * 9 * model.cfg.num_layers
    want = oracle32(model, tokens)
    assert (want - before.double()).abs().max() > 1e-3  # the change moved the logits
    assert_f32(after, want)


# ----------------------------------------------------------------------------------------------------------
# bounded memory
# ----------------------------------------------------------------------------------------------------------


def test_cache_is_bounded():
    C = 5
    model = make_lm(chunk_size=C, seed=7)
    tokens = tokens_for(model, 2, 10 * C + 3, seed=8)
    cache = model.new_cache(2)
    memory = []
    for t in range(tokens.shape[1]):
        _, cache = model(tokens[:, t : t + 1], cache)
        for i, lc in enumerate(cache.layers):
            kv = 0 if lc.k is None else lc.k.shape[1]
            assert kv == (t + 1) % C <= C - 1, f"layer {i} holds {kv} cached keys at position {t + 1}"
            assert lc.v is None if lc.k is None else lc.v.shape[1] == kv
            assert lc.cema.shape == (2, model.cfg.model_dim, model.cfg.cema_ndim)
            assert [s.shape for s in lc.norm] == [(2,), (2, 4), (2, 4)]
        memory.append(cache.memory_bytes())  # memory[t] is after t + 1 tokens
    first = max(memory[3 * C - 1 : 4 * C])
    assert max(memory[3 * C - 1 : 10 * C]) <= first, "cache memory grows with the context length"
    assert memory[3 * C - 1] == memory[10 * C - 1] and memory[3 * C + 1] == memory[10 * C + 1]
    # a long segment leaves only the tail of its last chunk
    _, cache = model(tokens[:, :37], use_cache=True)
    assert all(lc.k.shape[1] == 37 % C for lc in cache.layers)


# ----------------------------------------------------------------------------------------------------------
# windowed TimestepNorm statistics (docs/architecture.md#streaming option)
# ----------------------------------------------------------------------------------------------------------


def test_window_stats_before_eight_chunks_is_the_normal_stream():
    C = 5
    model = make_lm(chunk_size=C, seed=9)
    tokens = tokens_for(model, 2, 11 * C + 2, seed=10)
    full, _ = model(tokens)
    windowed, _ = stream(model, tokens, [tokens.shape[1]], window_stats=True)
    torch.testing.assert_close(windowed[:, : 8 * C], full[:, : 8 * C], rtol=0, atol=1e-12)
    assert (windowed[:, 8 * C :] - full[:, 8 * C :]).abs().amax(-1).min() > 1e-6, "window never took effect"


def test_window_stats_block_statistics_are_those_of_the_last_six_chunks():
    C = 5
    model = make_lm(chunk_size=C, seed=11)
    tokens = tokens_for(model, 2, 10 * C, seed=12)
    _, history = oracle_lm(model, tokens, window=True)
    _, cache = stream(model, tokens, [C] * 10, window_stats=True)
    for i, lc in enumerate(cache.layers):  # after chunk 9: the statistics of chunks 4..9
        count, mean, var = tm.norm_statistics(torch.cat(history[i][4:10], 1), model.cfg.norm_num_groups)
        assert torch.equal(lc.norm[0], torch.full((2,), count)), f"layer {i}: count {lc.norm[0].tolist()}"
        torch.testing.assert_close(lc.norm[1], mean, **EXACT)
        torch.testing.assert_close(lc.norm[2], var, **EXACT)


def test_window_stats_matches_oracle():
    """Every TimestepNorm is windowed (docs/architecture.md#timestepnorm: it is used in every block and before the output; the
    reference evaluator's truncate_cache replaces the output norm's state as well)."""
    C = 5
    model = make_lm(chunk_size=C, seed=13)
    tokens = tokens_for(model, 2, 11 * C + 3, seed=14)
    expected, history = oracle_lm(model, tokens, window=True)
    sizes = [C] * 11 + [3]
    out, cache = stream(model, tokens, sizes, window_stats=True)
    count, mean, var = tm.norm_statistics(torch.cat(history[-1][5:], 1), model.cfg.norm_num_groups)
    torch.testing.assert_close(cache.final_norm[1], mean, **EXACT, msg=lambda m: f"final norm mean: {m}")
    torch.testing.assert_close(out, expected, **tm.F64)


def test_window_stats_is_independent_of_the_split():
    C = 5
    model = make_lm(chunk_size=C, seed=15)
    L = 9 * C + 2
    tokens = tokens_for(model, 2, L, seed=16)
    whole, _ = stream(model, tokens, [L], window_stats=True)
    for sizes in ([1] * L, [3, 9, 2, 17, 16]):
        out, _ = stream(model, tokens, sizes, window_stats=True)
        torch.testing.assert_close(out, whole, **EXACT, msg=lambda m, s=sizes: f"window_stats split {s}: {m}")


# ----------------------------------------------------------------------------------------------------------
# generation
# ----------------------------------------------------------------------------------------------------------


def greedy_by_full_passes(model, prompt, steps):
    seq = prompt
    for _ in range(steps):
        logits, _ = model(seq)
        seq = torch.cat([seq, logits[:, -1].argmax(-1, keepdim=True)], 1)
    return seq


@pytest.fixture(scope="module")
def gen_model():
    return make_lm(chunk_size=5, seed=17)


@pytest.fixture(scope="module")
def greedy_reference(gen_model):
    prompt = tokens_for(gen_model, 3, 7, seed=18)
    return prompt, greedy_by_full_passes(gen_model, prompt, 12)


def test_generate_greedy_equals_argmax_of_full_passes(gen_model, greedy_reference):
    prompt, expected = greedy_reference
    assert torch.equal(generate(gen_model, prompt, 12, greedy=True), expected)
    assert torch.equal(generate(gen_model, prompt, 12, temperature=0.0), expected)
    gen = torch.Generator().manual_seed(0)
    assert torch.equal(generate(gen_model, prompt, 12, top_k=1, generator=gen), expected)


def nucleus(logits, top_p):
    """The tokens whose higher-ranked tokens hold less than top_p of the probability mass."""
    probs = logits.softmax(-1)
    ranked, order = probs.sort(descending=True)
    keep = (ranked.cumsum(-1) - ranked) < top_p
    return [set(order[b][keep[b]].tolist()) for b in range(len(probs))]


@pytest.mark.parametrize("top_k,top_p", [(3, None), (None, 0.5), (4, 0.6)])
def test_generate_samples_only_allowed_tokens(gen_model, top_k, top_p):
    prompt = tokens_for(gen_model, 8, 6, seed=19)
    out = generate(gen_model, prompt, 9, top_k=top_k, top_p=top_p, generator=torch.Generator().manual_seed(1))
    logits, _ = gen_model(out)
    for t in range(prompt.shape[1], out.shape[1]):
        step = logits[:, t - 1]
        if top_k is not None:  # renormalised over the top k, as sample_next does
            kth = step.topk(top_k, -1).values[:, -1:]
            step = step.masked_fill(step < kth, -math.inf)
        allowed = nucleus(step, top_p if top_p is not None else 1.0)
        for b in range(out.shape[0]):
            assert out[b, t].item() in allowed[b], f"row {b} step {t}: {out[b, t].item()} not in {allowed[b]}"


def test_generate_stops_at_eos(gen_model, greedy_reference):
    prompt, reference = greedy_reference
    new = reference[:, prompt.shape[1] :]
    eos = new[0, 2].item()  # row 0 emits it at its third step
    first = [next((i for i, t in enumerate(row.tolist()) if t == eos), None) for row in new]
    n = new.shape[1] if None in first else max(first) + 1
    expected = new[:, :n].clone()
    for b, f in enumerate(first):
        if f is not None:
            expected[b, f:] = eos  # a finished row keeps emitting eos
    out = generate(gen_model, prompt, new.shape[1], greedy=True, eos_id=eos)
    assert torch.equal(out[:, : prompt.shape[1]], prompt)
    assert torch.equal(out[:, prompt.shape[1] :], expected)
    # when every row is done, generation stops early
    out = generate(gen_model, prompt[:1], new.shape[1], greedy=True, eos_id=eos)
    assert torch.equal(out[0, prompt.shape[1] :], new[0, : first[0] + 1])


# ----------------------------------------------------------------------------------------------------------
# sample_next with fixed logits
# ----------------------------------------------------------------------------------------------------------

PROBS = torch.tensor([0.5, 0.25, 0.15, 0.05, 0.03, 0.02])
PERM = torch.tensor([3, 0, 5, 1, 4, 2])  # token PERM[i] has probability PROBS[i]
ROWS = 4000


def fixed_logits():
    logits = torch.empty(6)
    logits[PERM] = PROBS.log() + 1.7  # an offset: logits, not log-probabilities
    return logits.expand(ROWS, -1)


def draw(**kwargs):
    return sample_next(fixed_logits(), generator=torch.Generator().manual_seed(123), **kwargs)


def frequencies(samples):
    return torch.bincount(samples, minlength=6).double() / len(samples)


@pytest.mark.parametrize(
    "kwargs,allowed_ranks",
    [
        (dict(top_k=2), [0, 1]),
        (dict(top_k=3), [0, 1, 2]),
        (dict(top_p=0.7), [0, 1]),  # 0.5 < 0.7: the second token is still needed; 0.75 >= 0.7 stops
        (dict(top_p=0.8), [0, 1, 2]),
        (dict(top_p=0.4), [0]),
        (dict(top_k=3, top_p=0.7), [0, 1]),  # after top-3: 0.556, 0.833
        (dict(top_p=1.0), [0, 1, 2, 3, 4, 5]),
        (dict(), [0, 1, 2, 3, 4, 5]),
    ],
)
def test_sample_next_allowed_set_and_frequencies(kwargs, allowed_ranks):
    freq = frequencies(draw(**kwargs))
    allowed = PERM[allowed_ranks]
    outside = torch.ones(6, dtype=torch.bool)
    outside[allowed] = False
    assert freq[outside].sum() == 0, f"{kwargs}: sampled outside {allowed.tolist()}: {freq.tolist()}"
    expected = torch.zeros(6, dtype=torch.float64)
    expected[allowed] = PROBS[allowed_ranks].double() / PROBS[allowed_ranks].sum()
    torch.testing.assert_close(freq, expected, rtol=0, atol=0.03)


def test_sample_next_temperature_and_greedy():
    logits = fixed_logits()
    assert torch.all(sample_next(logits, temperature=0.0) == PERM[0])
    assert torch.all(sample_next(logits, greedy=True, temperature=5.0) == PERM[0])
    sharp = PROBS.double() ** 2 / (PROBS.double() ** 2).sum()  # temperature 0.5 squares the probabilities
    freq = frequencies(draw(temperature=0.5))
    expected = torch.zeros(6, dtype=torch.float64)
    expected[PERM] = sharp
    torch.testing.assert_close(freq, expected, rtol=0, atol=0.03)
    assert torch.equal(draw(top_p=0.9), draw(top_p=0.9)), "a seeded generator must make sampling reproducible"


@pytest.mark.parametrize(
    "kwargs,value",
    [
        (dict(temperature=-1.0), "-1.0"),
        (dict(top_k=0), "0"),
        (dict(top_p=0.0), "0.0"),
        (dict(top_p=1.5), "1.5"),
    ],
)
def test_sample_next_rejects_bad_arguments(kwargs, value):
    name = next(iter(kwargs))
    with pytest.raises(ValueError, match=f"{name}.*{value}"):
        sample_next(fixed_logits()[:2], **kwargs)
