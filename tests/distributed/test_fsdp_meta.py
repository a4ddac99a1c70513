"""FSDP2 meta-device build (issue 11): meta -> shard -> materialise -> initialise, and the device mesh.

Spawned gloo processes on CPU. The sharded initialisation draws the random numbers one process draws, so the
full parameters equal a single-process ``to_empty`` + ``init_weights`` with the same seed, exactly.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
from spawn_support import free_port, spawn

from mega_suite.models.megalodon.config import MegalodonConfig

MEGA = dict(
    num_layers=2, model_dim=16, num_heads=2, z_dim=8, value_dim=16, ffn_hidden_dim=24, swiglu=True,
    cema_ndim=4, norm_num_groups=4, chunk_size=8, vocab_size=37,
)  # fmt: skip
LLAMA = dict(num_layers=2, model_dim=16, num_heads=2, ffn_hidden_dim=24, vocab_size=37, max_seq_len=32)
CLASSIFIER = dict(MEGA, vocab_size=11, num_classes=5)

VARIANTS = {
    "megalodon": ("megalodon", MEGA),
    "megalodon_tied": ("megalodon", dict(MEGA, share_emb=True)),
    "llama": ("llama", LLAMA),
    "llama_tied": ("llama", dict(LLAMA, share_emb=True)),
    "classifier": ("megalodon", CLASSIFIER),
}
SEED = 7


def _config(name):
    from mega_suite.models.llama import LlamaConfig

    arch, kw = VARIANTS[name]
    return MegalodonConfig(**kw) if arch == "megalodon" else LlamaConfig(**kw)


def _meta_model(name):
    from mega_suite.models import build_model

    with torch.device("meta"):
        return build_model(_config(name))


def _single_process_init(name):
    model = _meta_model(name)
    model.to_empty(device="cpu")
    torch.manual_seed(SEED)
    model.init_weights()
    return model


def _module(meta_init: bool):
    from mega_suite.training.module import CausalLM

    return CausalLM(
        _config("megalodon"), optim={}, trainer={}, total_steps=1, meta_init=meta_init, init_seed=SEED
    )


def _disturb_global_generator(k: int) -> None:
    """Leave the global generator anywhere but at ``SEED``'s start (a different place for each ``k``)."""
    torch.manual_seed(1000 + k)
    torch.rand(3 + k)


def _full_state(model):
    out = {}
    for key, value in model.state_dict().items():
        out[key] = (value.full_tensor() if hasattr(value, "full_tensor") else value).detach().clone()
    return out


def _init_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from mega_suite.distributed.fsdp import apply_fsdp, init_sharded, materialize, resident_parameter_bytes

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    result = {}
    for name in VARIANTS:
        model = _meta_model(name)
        apply_fsdp(model)
        model.to_empty(device="cpu")
        torch.manual_seed(SEED)
        init_sharded(model)
        assert all(isinstance(p, DTensor) for p in model.parameters()), name
        assert not any(b.is_meta for b in model.buffers()), name
        tied = model.output.output.weight is model.embed.weight if name == "megalodon_tied" else None
        if name == "llama_tied":
            tied = model.output.weight is model.embed.weight
        # a forward + backward runs (FSDP2's lazy init accepts the materialised parameters)
        tokens = torch.randint(0, 11, (2, 9))
        out = model(tokens)[0] if name != "classifier" else model(tokens)
        out.float().square().mean().backward()
        result[name] = dict(state=_full_state(model), bytes=resident_parameter_bytes(model), tied=tied)
    # The training module's path (configure_model -> materialize): its own init_seed, whatever each rank's
    # generator holds (the function itself: Lightning's import would double this test's time)
    model = _meta_model("megalodon")
    apply_fsdp(model)
    _disturb_global_generator(rank)
    materialize(model, "cpu", SEED, sharded=True)
    result["module"] = dict(state=_full_state(model))
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_sharded_meta_init_equals_single_process_init():
    """Full parameters and buffers after meta -> fully_shard -> to_empty -> init_sharded on 2 ranks ==
    to_empty + init_weights on one process (same seed), for both architectures, tied weights and a classifier;
    tied weights stay tied; each rank holds about 1 / world of the parameter bytes. The same through the
    training module's ``materialize`` with each rank's global generator disturbed."""
    world = 2
    with tempfile.TemporaryDirectory() as tmp:
        spawn(_init_worker, world, world, free_port(), tmp)
        ranks = [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False) for r in range(world)]
    for name in VARIANTS:
        reference = _single_process_init(name)
        expected = reference.state_dict()
        for r in range(world):
            got = ranks[r][name]["state"]
            assert set(got) == set(expected), name
            for key, value in expected.items():
                assert torch.equal(got[key], value), f"{name}: {key} differs on rank {r}"
        if name.endswith("tied"):
            assert all(ranks[r][name]["tied"] for r in range(world)), f"{name}: weights untied"
        total = sum(p.numel() * p.element_size() for p in {id(p): p for p in reference.parameters()}.values())
        per_rank = [ranks[r][name]["bytes"] for r in range(world)]
        assert sum(per_rank) >= total
        for b in per_rank:  # uneven dims (vocab 37) pad by at most one row per parameter
            assert abs(b - total / world) <= 0.1 * total / world, (name, per_rank, total)
    expected = _single_process_init("megalodon").state_dict()
    for r in range(world):  # the module seeds its initialisation: a disturbed generator changes nothing
        got = ranks[r]["module"]["state"]
        assert set(got) == set(expected)
        for key, value in expected.items():
            assert torch.equal(got[key], value), f"module: {key} differs on rank {r}"


def test_module_initialisation_draws_from_its_own_seed():
    """The training module initialises from ``init_seed`` whatever the global generator holds (Lightning's
    re-seeding before ``configure_model`` must not be what makes runs agree)."""
    expected = _single_process_init("megalodon").state_dict()
    for k in range(2):
        _disturb_global_generator(k)
        got = _module(meta_init=False).model.state_dict()
        assert set(got) == set(expected)
        for key, value in expected.items():
            assert torch.equal(got[key], value), key


def test_sharded_init_draws_differ_per_parameter():
    """A guard against a vacuous equality: two seeds give different weights."""
    a = _single_process_init("megalodon")
    torch.manual_seed(SEED + 1)
    a2 = _meta_model("megalodon")
    a2.to_empty(device="cpu")
    a2.init_weights()
    assert not torch.equal(a.layers[0].mega.wz.weight, a2.layers[0].mega.wz.weight)


# ----------------------------------------------------------------------------------------------------------
# The mesh
# ----------------------------------------------------------------------------------------------------------


@pytest.fixture
def fake_world_4():
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=3, world_size=4)
    yield
    dist.destroy_process_group()


def test_mesh_shapes(fake_world_4):
    """fsdp: one 1-D mesh over every rank of every node; hsdp on 2 nodes x 2 devices: (replicate 2, shard 2);
    rank 3 is data-parallel rank 3 of 4 under both (every rank sees different batches)."""
    from mega_suite.distributed.fsdp import build_mesh, data_parallel_rank

    fsdp = build_mesh(4, 2, "fsdp")
    assert fsdp.mesh_dim_names == ("dp_shard",) and tuple(fsdp.shape) == (4,)
    hsdp = build_mesh(4, 2, "hsdp")
    assert hsdp.mesh_dim_names == ("replicate", "shard") and tuple(hsdp.shape) == (2, 2)
    assert hsdp.mesh.tolist() == [[0, 1], [2, 3]]  # shard groups are the ranks of one node
    assert data_parallel_rank(fsdp) == (3, 4)
    assert data_parallel_rank(hsdp) == (3, 4)
    cp = build_mesh(4, 1, "fsdp", chunk_parallel=2)
    assert cp.mesh_dim_names == ("dp_shard", "cp") and data_parallel_rank(cp) == (1, 2)


def test_mesh_rejects_bad_sizes():
    from mega_suite.distributed.fsdp import mesh_shape

    with pytest.raises(ValueError, match="num_nodes=3"):
        mesh_shape(4, 3, "hsdp")
    with pytest.raises(ValueError, match="chunk_parallel=3"):
        mesh_shape(4, 1, "fsdp", chunk_parallel=3)
    with pytest.raises(ValueError, match="strategy"):
        mesh_shape(4, 1, "ddp")


def test_evaluation_samplers_split_over_every_data_parallel_rank(fake_world_4):
    """Lightning's ModelParallelStrategy on one node reports a data-parallel size of 1 (its mesh is
    (data_parallel=num_nodes, tensor_parallel=devices)), so every rank evaluated the same batches. Ours
    reports all 4 ranks under fsdp and hsdp, and the DistributedSampler Lightning builds from it gives
    disjoint validation indices."""
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.distributed.device_mesh import DeviceMesh
    from torch.utils.data import DistributedSampler

    from mega_suite.distributed.fsdp import build_mesh
    from mega_suite.training.strategy import make_strategy

    lightning_default = ModelParallelStrategy()
    lightning_default._device_mesh = DeviceMesh(
        "cpu", torch.arange(4).reshape(1, 4), mesh_dim_names=("data_parallel", "tensor_parallel")
    )
    assert lightning_default.distributed_sampler_kwargs["num_replicas"] == 1  # the bug: nothing is split
    seen = []
    for kind, nodes in (("fsdp", 1), ("hsdp", 2)):
        strategy = make_strategy(kind)
        strategy._device_mesh = build_mesh(4, nodes, kind)
        kwargs = strategy.distributed_sampler_kwargs
        assert kwargs == {"num_replicas": 4, "rank": 3}
        seen.append(list(DistributedSampler(range(10), shuffle=False, **kwargs)))
    assert seen[0] == seen[1] == [3, 7, 1]  # rank 3 of 4: every 4th index (padded to 12 by repetition)


def _load_worker(rank: int, world: int, port: int, ref_path: str, out_dir: str) -> None:
    import torch.distributed as dist

    from mega_suite.distributed.fsdp import apply_fsdp, init_sharded
    from mega_suite.storage.checkpoints import load_full_weights

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    model = _meta_model("megalodon_tied")
    apply_fsdp(model)
    model.to_empty(device="cpu")
    init_sharded(model)  # seeded differently from the file's weights
    load_full_weights(model, ref_path)
    torch.save(_full_state(model), os.path.join(out_dir, f"loaded{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_init_from_a_reference_file_into_shards():
    """init_from= / ckpt= under fsdp: rank 0 reads the file, every rank ends with the file's weights."""
    world = 2
    torch.manual_seed(123)
    reference = _single_process_init("megalodon_tied")
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(torch.randn_like(p))
    with tempfile.TemporaryDirectory() as tmp:
        ref_path = os.path.join(tmp, "ref.pt")
        torch.save(reference.state_dict(), ref_path)
        spawn(_load_worker, world, world, free_port(), ref_path, tmp)
        loaded = [torch.load(os.path.join(tmp, f"loaded{r}.pt"), weights_only=True) for r in range(world)]
    for key, value in reference.state_dict().items():
        for r in range(world):
            assert torch.equal(loaded[r][key], value), (key, r)


def test_streaming_evaluation_splits_documents_across_ranks():
    """Every document is read by exactly one rank, each rank yields the same number of segments (padded
    with empty ones: no targets, no words), and the totals over ranks equal one rank's."""
    import numpy as np

    from datamodules.text_lm import StreamSegments

    class Stream:
        def __init__(self, n):
            self.tokens = np.arange(n) % 50

        def __len__(self):
            return len(self.tokens)

        def read(self, a, b):
            return self.tokens[a:b].astype(np.int64)

    stream = Stream(200)
    docs = [(0, 60), (60, 70), (70, 150), (150, 153), (153, 200)]
    word_ends = np.ones(200, dtype=np.int64)

    def totals(segments):
        real = [s for s in segments if (s["target"] != -100).any()]
        keys = sorted((int(s["input"][0, 0]), s["input"].shape[1], bool(s["first_segment"])) for s in real)
        return (
            keys,
            sum(int((s["target"] != -100).sum()) for s in segments),
            sum(int(s["words"]) for s in segments),
        )

    one = list(StreamSegments(stream, docs, 16, word_ends))
    per_rank = [list(StreamSegments(stream, docs, 16, word_ends, rank=r, world=3)) for r in range(3)]
    assert len({len(p) for p in per_rank}) == 1
    assert len(StreamSegments(stream, docs, 16, word_ends, rank=1, world=3)) == len(per_rank[1])
    merged = [s for p in per_rank for s in p]
    ref_keys, ref_targets, ref_words = totals(one)
    keys, targets, words = totals(merged)
    assert keys == ref_keys and targets == ref_targets and words == ref_words
    assert max(len(p) for p in per_rank) < len(one)  # the work is split
