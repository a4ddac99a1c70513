"""The preset registry (docs/recipes.md#task-hyperparameters) and the reference checkpoint format.

Every registered preset gets the same smoke test (timm style): it builds on the meta device quickly and a
meta forward gives the right output shape. Hyperparameters are checked against the docs/recipes.md#task-hyperparameters tables copied
here by hand; parameter counts against a closed formula. Reference state dicts round-trip bitwise, and a
state dict written by hand from the release's documented key list loads strictly.
"""

import re
import time

import model_oracle as tm
import pytest
import torch

from mega_suite import (
    MegalodonClassifier,
    MegalodonLM,
    count_parameters,
    create_model,
    get_config,
)
from mega_suite.models.megalodon import PRESETS as MEGALODON_PRESETS
from mega_suite.storage.checkpoints import from_reference, load_into, load_reference, to_reference

MEGALODON = sorted(
    MEGALODON_PRESETS
)  # the registry also holds the Llama sizes (tests/models/test_registry.py)


@pytest.fixture(scope="module")
def warm_meta():
    # The first meta-device normal_() in a process imports torch's reference decompositions (seconds, once);
    # that is torch's start-up cost, not the model's build time.
    create_model("megalodon_debug", device="meta")


# ----------------------------------------------------------------------------------------------------------
# every preset: same smoke test
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", MEGALODON)
def test_preset_builds_on_meta(name, warm_meta):
    elapsed = []
    while len(elapsed) < 3 and (not elapsed or elapsed[-1] >= 1.0):  # retries absorb a busy machine
        start = time.perf_counter()
        model = create_model(name, device="meta")
        elapsed.append(time.perf_counter() - start)
    assert min(elapsed) < 1.0, f"{name} took {min(elapsed):.2f} s to build on the meta device"
    cfg = model.cfg
    assert isinstance(model, MegalodonClassifier if cfg.is_classifier else MegalodonLM)
    assert all(t.is_meta for t in [*model.parameters(), *model.buffers()]), "something was allocated"
    assert count_parameters(model) > 0
    if cfg.adaptive_cutoffs:
        return  # the adaptive input dispatches tokens to bands by value: no meta forward
    shallow = create_model(name, device="meta", num_layers=1).eval()  # shapes through one block of each kind
    with torch.no_grad():
        if not cfg.is_classifier:
            out, _ = shallow(torch.zeros(2, 8, dtype=torch.long, device="meta"))
            assert out.shape == (2, 8, cfg.vocab_size)
        else:
            if cfg.input_type == "patch":
                x = torch.zeros(2, cfg.in_chans, cfg.image_size, cfg.image_size, device="meta")
            elif cfg.input_type == "scalar":
                x = torch.zeros(2, 8, device="meta")
            else:
                x = torch.zeros(2, 8, dtype=torch.long, device="meta")
            out = shallow(x, x2=x) if cfg.dual_input else shallow(x)
            assert out.shape == (2, cfg.num_classes)
    assert out.dtype == torch.float32


# ----------------------------------------------------------------------------------------------------------
# docs/recipes.md#task-hyperparameters tables
# ----------------------------------------------------------------------------------------------------------

#               layers  D     h  Z     E     FFN   swiglu C     G
LM_TABLE = {
    "megalodon_200m": (12, 1024, 1, 256, 2048, 2560, False, 2048, 32),
    "megalodon_1_3b": (24, 2048, 2, 512, 4096, 4864, False, 2048, 64),
    "megalodon_1_3b_pg19": (24, 2048, 2, 512, 4096, 3584, True, 2048, 64),
    "megalodon_7b": (32, 4096, 4, 1024, 8192, 8192, True, 4096, 64),
}
LM_FIELDS = (
    "num_layers",
    "model_dim",
    "num_heads",
    "z_dim",
    "value_dim",
    "ffn_hidden_dim",
    "swiglu",
    "chunk_size",
    "norm_num_groups",
)


@pytest.mark.parametrize("name", sorted(LM_TABLE))
def test_language_model_presets_follow_the_table(name):
    cfg = get_config(name)
    assert {f: getattr(cfg, f) for f in LM_FIELDS} == dict(zip(LM_FIELDS, LM_TABLE[name]))
    assert (cfg.cema_ndim, cfg.norm_eps, cfg.dropout, cfg.hidden_dropout, cfg.attention_dropout) == (
        16,
        1e-5,
        0,
        0,
        0,
    )
    assert (cfg.scale_emb, cfg.share_emb) == (
        (True, True) if name == "megalodon_1_3b_pg19" else (False, False)
    )
    assert cfg.rope_base == (1e5 if name == "megalodon_7b" else 1e4)
    assert not cfg.is_classifier


#                  layers D    E=FFN Z    C      dropout classes input
TASK_TABLE = {
    "lra_listops": (6, 80, 160, 64, 2000, 0.1, 10, "token"),
    "lra_text": (4, 128, 256, 64, 4000, 0.1, 2, "token"),
    "lra_retrieval": (6, 128, 256, 64, 4000, 0.1, 2, "token"),
    "lra_image": (8, 160, 320, 96, 1024, 0.0, 10, "scalar"),
    "lra_pathfinder": (6, 128, 256, 64, 1024, 0.0, 2, "scalar"),
    "lra_pathx": (4, 64, 128, 32, 16384, 0.0, 2, "scalar"),
    "sc_raw": (6, 60, 120, 30, 1000, 0.0, 10, "scalar"),
    "imagenet_90m": (12, 768, 1536, 256, 196, 0.0, 1000, "patch"),
}


@pytest.mark.parametrize(
    "name", sorted(TASK_TABLE) + [f"{t}_chunk" for t in sorted(TASK_TABLE) if t.startswith("lra_")]
)
def test_task_presets_follow_the_table(name):
    base = name.removesuffix("_chunk")
    layers, d, e, z, c, drop, classes, input_type = TASK_TABLE[base]
    if name.endswith("_chunk"):
        c = 4096 if base == "lra_pathx" else 128
    cfg = get_config(name)
    got = (
        cfg.num_layers,
        cfg.model_dim,
        cfg.value_dim,
        cfg.ffn_hidden_dim,
        cfg.z_dim,
        cfg.chunk_size,
        cfg.dropout,
    )
    assert got == (layers, d, e, e, z, c, drop)
    assert (cfg.num_classes, cfg.input_type, cfg.dual_input) == (classes, input_type, base == "lra_retrieval")
    assert cfg.drop_path == (0.3 if base == "imagenet_90m" else 0.0)


def test_wikitext_preset_follows_the_table():
    cfg = get_config("megalodon_wt103")
    got = (
        cfg.num_layers,
        cfg.model_dim,
        cfg.value_dim,
        cfg.ffn_hidden_dim,
        cfg.z_dim,
        cfg.chunk_size,
        cfg.dropout,
    )
    assert got == (16, 1024, 2048, 2048, 256, 2048, 0.3)
    # adaptive input and adaptive softmax: cutoffs 20000, 60000, factor 4, V ≈ 267K
    assert list(cfg.adaptive_cutoffs) == [20000, 60000] and cfg.adaptive_factor == 4
    assert 260_000 < cfg.vocab_size < 275_000


# ----------------------------------------------------------------------------------------------------------
# parameter counts
# ----------------------------------------------------------------------------------------------------------


def formula_count(cfg):
    """Parameters from the shapes of docs/architecture.md (tied weights once)."""
    D, Z, E, F, N = cfg.model_dim, cfg.z_dim, cfg.value_dim, cfg.ffn_hidden_dim, cfg.cema_ndim
    rows = 2 * D if cfg.is_classifier else D  # bidirectional CEMA: two parameter sets
    cema = rows * N * (1 + 1 + 2) + rows + D  # alpha, delta, gamma; theta; omega
    mega = 2 * D + cema + D + (D * Z + Z) + 2 * (D * E + E) + (D * D + D) + E * D + 4 * Z
    ffn = 2 * D + D * F * (3 if cfg.swiglu else 2) + (D if cfg.layer_scale else 0)
    total = cfg.num_layers * (mega + ffn) + 2 * D  # + final norm
    if not cfg.is_classifier:
        return total + cfg.vocab_size * D * (1 if cfg.share_emb else 2)
    encoder = {"token": cfg.vocab_size * D, "scalar": 2 * D}[cfg.input_type]
    width = 2 * D if cfg.dual_input else D
    return total + encoder + (width * 2 * D + 2 * D) + 2 * D * cfg.num_classes


@pytest.mark.parametrize(
    "name",
    [n for n in MEGALODON if get_config(n).input_type != "patch" and not get_config(n).adaptive_cutoffs],
)
def test_parameter_count_matches_formula(name, warm_meta):
    assert count_parameters(create_model(name, device="meta")) == formula_count(get_config(name))


def test_reference_parameter_counts(warm_meta):
    n7b = count_parameters(create_model("megalodon_7b", device="meta", vocab_size=32000))
    assert 7.3e9 <= n7b <= 7.4e9, n7b
    n_sc = count_parameters(create_model("sc_raw", device="meta"))
    assert abs(n_sc / 3.0e5 - 1) <= 0.10, n_sc
    n_cpu = count_parameters(create_model("megalodon_cpu_bench", device="meta"))
    assert abs(n_cpu / 14.6e6 - 1) <= 0.01, n_cpu


def test_7b_builds_quickly(warm_meta):
    start = time.perf_counter()
    create_model("megalodon_7b", device="meta")
    assert time.perf_counter() - start < 10.0


# ----------------------------------------------------------------------------------------------------------
# registry errors
# ----------------------------------------------------------------------------------------------------------


def test_unknown_preset_names_the_known_ones():
    with pytest.raises(KeyError, match="megalodon_8b") as info:
        create_model("megalodon_8b")
    assert "megalodon_7b" in str(info.value) and "lra_listops" in str(info.value)


def test_unknown_override_names_the_valid_keys():
    with pytest.raises(KeyError, match="chunk_len") as info:
        create_model("megalodon_debug", device="meta", chunk_len=8)
    assert "chunk_size" in str(info.value) and "model_dim" in str(info.value)
    assert create_model("megalodon_debug", device="meta", chunk_size=8).cfg.chunk_size == 8


# ----------------------------------------------------------------------------------------------------------
# reference state dicts
# ----------------------------------------------------------------------------------------------------------


def randomised_model(cfg, seed):
    torch.manual_seed(seed)
    model = tm.randomise(MegalodonClassifier(cfg) if cfg.is_classifier else MegalodonLM(cfg), seed).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # buffers too, so a forgotten buffer shows
        for buf in model.buffers():
            if buf.is_floating_point():
                buf.copy_(torch.randn(buf.shape, generator=gen))
    return model


def model_input(cfg):
    gen = torch.Generator().manual_seed(0)
    if cfg.is_classifier and cfg.input_type == "scalar":
        return torch.randn(2, 11, generator=gen)
    return torch.randint(0, cfg.vocab_size, (2, 11), generator=gen)


def run(model, x):
    with torch.no_grad():
        out = model(x)
    return out[0] if isinstance(out, tuple) else out


@pytest.mark.parametrize(
    "overrides",
    [
        dict(),
        dict(share_emb=True, scale_emb=True, swiglu=False),
        dict(layer_scale=True),
        dict(num_classes=3, input_type="scalar"),
    ],
)
def test_reference_round_trip(tmp_path, overrides):
    cfg = tm.tiny_config(**overrides)
    src = randomised_model(cfg, seed=1)
    sd = to_reference(src)
    dst = randomised_model(cfg, seed=2)
    load_reference(dst, sd)
    want = src.state_dict()
    got = dst.state_dict()
    assert list(got) == list(want)
    for key in want:
        assert torch.equal(got[key], want[key]), key
    x = model_input(cfg)
    assert torch.equal(run(dst, x), run(src, x))
    if cfg.share_emb:
        assert dst.output.output.weight is dst.embed.weight
    # files: a plain state dict, a {"model": ...} checkpoint, wrapper prefixes (DDP, torch.compile)
    for i, obj in enumerate(
        [sd, {"model": sd, "step": 3}, {f"module._orig_mod.{k}": v for k, v in sd.items()}]
    ):
        path = tmp_path / f"ckpt{i}.pt"
        torch.save(obj, path)
        loaded = load_into(randomised_model(cfg, seed=3 + i), str(path))
        assert torch.equal(run(loaded, x), run(src, x)), f"checkpoint form {i}"


def reference_state_dict(cfg, seed=0):
    """A state dict in the release's format, written from its documented key list and docs/architecture.md#cema shapes."""
    D, N, Z, E, F, G, V = (
        cfg.model_dim,
        cfg.cema_ndim,
        cfg.z_dim,
        cfg.value_dim,
        cfg.ffn_hidden_dim,
        cfg.norm_num_groups,
        cfg.vocab_size,
    )
    shapes = {"embed.weight": (V, D)}

    def timestep_norm(prefix):
        shapes.update({f"{prefix}.weight": (D,), f"{prefix}.bias": (D,), f"{prefix}.prior_count": "count"})
        shapes.update({f"{prefix}.prior_mean": (G,), f"{prefix}.prior_logv": (G,)})

    for i in range(cfg.num_layers):
        m, f = f"layers.{i}.mega", f"layers.{i}.nffn"
        timestep_norm(f"{m}.timenorm")
        shapes.update({
            f"{m}.cema.alpha": (D, N, 1), f"{m}.cema.delta": (D, N, 1), f"{m}.cema.theta": (D, 1, 1),
            f"{m}.cema.gamma": (D, N, 2), f"{m}.cema.omega": (D, 1),
            f"{m}.rmsnorm.weight": (D,),
            f"{m}.wz.weight": (Z, D), f"{m}.wz.bias": (Z,),
            f"{m}.wv.weight": (E, D), f"{m}.wv.bias": (E,),
            f"{m}.wr.weight": (E, D), f"{m}.wr.bias": (E,),
            f"{m}.wh1.weight": (D, D), f"{m}.wh1.bias": (D,),
            f"{m}.wh2.weight": (D, E),
            f"{m}.gamma": (2, Z), f"{m}.beta": (2, Z),
            f"{f}.norm.weight": (D,), f"{f}.norm.bias": (D,),
            f"{f}.fc1.weight": (F, D), f"{f}.fc2.weight": (D, F), f"{f}.fc3.weight": (F, D),
        })  # fmt: skip
    timestep_norm("output.final_norm")
    shapes["output.output.weight"] = (V, D)
    gen = torch.Generator().manual_seed(seed)
    return {
        k: torch.tensor(0, dtype=torch.int64) if s == "count" else torch.randn(s, generator=gen)
        for k, s in shapes.items()
    }


def test_handwritten_reference_state_dict_loads():
    cfg = tm.tiny_config(swiglu=True)
    sd = reference_state_dict(cfg)
    model = load_reference(MegalodonLM(cfg), sd)
    state = model.state_dict()
    assert set(state) == set(sd)
    for key, value in sd.items():
        assert torch.equal(state[key], value), key
    torch.testing.assert_close(model.layers[1].mega.cema.theta, sd["layers.1.mega.cema.theta"])
    logits, _ = model(torch.randint(0, cfg.vocab_size, (2, 9)))
    assert torch.isfinite(logits).all()


def test_release_rope_buffer_is_accepted():
    """The release's model holds ``self.rope = RotaryEmbedding(...)`` whose ``freqs`` (Z/h/2,) is a
    persistent buffer, so its state dicts carry ``rope.freqs``; a strict load must not reject it."""
    cfg = tm.tiny_config()
    zd = cfg.z_dim // cfg.num_heads
    sd = reference_state_dict(cfg)
    sd["rope.freqs"] = 1.0 / cfg.rope_base ** (torch.arange(0, zd, 2, dtype=torch.float32) / zd)
    model = load_reference(MegalodonLM(cfg), sd)
    assert torch.isfinite(model(torch.randint(0, cfg.vocab_size, (1, 6)))[0]).all()


def test_reference_state_dict_errors_name_the_key():
    cfg = tm.tiny_config()
    good = reference_state_dict(cfg)

    renamed = dict(good)
    renamed["layers.0.mega.wq.weight"] = renamed.pop("layers.0.mega.wz.weight")
    with pytest.raises(ValueError, match="layers.0.mega.wq.weight") as info:
        load_reference(MegalodonLM(cfg), renamed)
    assert "layers.0.mega.wz.weight" in str(info.value), "the missing key must be named too"

    missing = {k: v for k, v in good.items() if k != "layers.1.nffn.fc3.weight"}
    with pytest.raises(ValueError, match=re.escape("layers.1.nffn.fc3.weight")):
        load_reference(MegalodonLM(cfg), missing)

    reshaped = dict(good, **{"layers.1.mega.cema.gamma": torch.zeros(16, 4)})
    with pytest.raises(
        ValueError, match=re.escape("layers.1.mega.cema.gamma") + r".*\(16, 4\).*\(16, 4, 2\)"
    ):
        load_reference(MegalodonLM(cfg), reshaped)

    # a SiLU model does not silently drop the SwiGLU checkpoint's fc3
    with pytest.raises(ValueError, match="fc3"):
        from_reference(good, MegalodonLM(tm.tiny_config(swiglu=False)))
