"""One model-agnostic harness over every registered size of every architecture (timm's tests/models/test_registry.py):
meta build, the interface generic code asks (FSDP units, float32 islands, no-decay names), a forward on tiny
real weights, streaming == full pass where the architecture promises it, and the Llama sizes matched to
Megalodon's by parameter count (±3%, the paper's own comparison rule)."""

from __future__ import annotations

import pytest
import torch

from mega_suite.models import ARCHS, count_parameters, create_model, get_config, list_models
from mega_suite.models.common import is_float32_island
from mega_suite.models.llama import MATCHES, count_llama_parameters, matched_config


@pytest.fixture(scope="module", autouse=True)
def warm_meta():
    create_model("megalodon_debug", device="meta")  # torch's one-off meta decompositions import


@pytest.mark.parametrize("name", list_models())
def test_every_size_builds_on_meta_and_declares_its_metadata(name):
    model = create_model(name, device="meta")
    assert all(t.is_meta for t in [*model.parameters(), *model.buffers()])
    names = {n for n, _ in model.named_parameters()}
    units = model.fsdp_units()
    assert units and all(isinstance(u, torch.nn.Module) for u in units)
    islands = model.float32_modules()
    assert islands and all(is_float32_island(m) for m in islands)
    assert any(not is_float32_island(m) for m in model.modules())  # not everything is an island
    exempt = model.no_weight_decay()
    assert exempt and exempt < names  # some, not all, parameters skip decay
    assert all(model.get_parameter(n).dim() >= 2 or n in exempt for n in names if n.endswith("bias"))


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_every_arch_has_presets_flops_and_trains_a_step(arch):
    spec = ARCHS[arch]
    debug = f"{arch}_debug"
    assert debug in spec.presets
    cfg = get_config(debug)
    assert 0 < spec.flops_per_token(cfg, 8) < spec.flops_per_token(cfg, 16)  # attention grows with context
    torch.manual_seed(0)
    model = create_model(debug)
    tokens = torch.randint(0, cfg.vocab_size, (2, 17))
    logits, _ = model(tokens[:, :-1])
    assert logits.shape == (2, 16, cfg.vocab_size) and logits.dtype == torch.float32
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())
    # Streaming evaluation interface (CausalLM and eval_context use it): any split, same hidden states as
    # one streamed pass over the whole sequence.
    model.eval()
    with torch.no_grad():
        whole, _ = model.forward_hidden(tokens, use_cache=True)
        cache, parts = None, []
        for piece in (slice(0, 5), slice(5, 6), slice(6, 17)):
            out, cache = model.forward_hidden(tokens[:, piece], cache, use_cache=True)
            parts.append(out)
    torch.testing.assert_close(torch.cat(parts, 1), whole, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("llama", sorted(MATCHES))
def test_llama_sizes_match_megalodon_within_three_percent(llama):
    megalodon = MATCHES[llama]
    target = count_parameters(create_model(megalodon, device="meta"))
    got = count_parameters(create_model(llama, device="meta"))
    assert got == count_llama_parameters(get_config(llama))
    tolerance = 0.03 if target > 1e6 else 0.05  # the 27K-parameter debug size cannot be matched as finely
    assert abs(got / target - 1) <= tolerance, (llama, got, megalodon, target)
    m = get_config(megalodon)
    again = matched_config(target, m.model_dim, m.vocab_size, m.share_emb, max_seq_len=4096)
    want = get_config(llama)
    assert (again.num_layers, again.ffn_hidden_dim, again.num_heads) == (
        want.num_layers,
        want.ffn_hidden_dim,
        want.num_heads,
    ), "the frozen preset is not what matched_config gives"


@pytest.mark.parametrize("name", ["megalodon_7b", "llama_7b"])
def test_a_meta_build_skips_initialisation_and_leaves_nn_init_as_it_was(name):
    """``build_on_meta``: the shapes of ``build_model`` on the meta device, no random draw (the global
    generator does not move), and torch.nn.init restored afterwards."""
    from mega_suite.models import build_model, build_on_meta, get_config

    cfg = get_config(name, num_layers=2)
    fills = {
        n: getattr(torch.nn.init, n) for n in ("normal_", "trunc_normal_", "uniform_", "kaiming_uniform_")
    }
    state = torch.random.get_rng_state()
    fast = build_on_meta(cfg)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert fills == {n: getattr(torch.nn.init, n) for n in fills}
    with torch.device("meta"):
        slow = build_model(cfg)
    assert {k: v.shape for k, v in fast.state_dict().items()} == {
        k: v.shape for k, v in slow.state_dict().items()
    }
    assert all(p.is_meta for p in fast.parameters())
