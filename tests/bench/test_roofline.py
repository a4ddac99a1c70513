"""bench/roofline.py: the analytic FLOPs, bytes and floors, each checked against a count written another way."""

from __future__ import annotations

import itertools
import math

import pytest

from bench import roofline as rl


def _pairs_by_enumeration(length: int, chunk: int, causal: bool) -> int:
    """Every (query, key) pair that shares a chunk (and, causal, has key <= query), counted one by one."""
    return sum(
        1
        for i, j in itertools.product(range(length), repeat=2)
        if i // chunk == j // chunk and (not causal or j <= i)
    )


@pytest.mark.parametrize("length,chunk", [(8, 4), (10, 4), (7, 16), (12, 12)])
@pytest.mark.parametrize("causal", [True, False])
def test_attention_pairs_and_minimal_flops_match_an_enumeration(length, chunk, causal):
    pairs = _pairs_by_enumeration(length, chunk, causal)
    assert rl.attention_pairs(length, chunk, causal) == pairs
    b, h, dk, dv = 2, 3, 16, 40
    work = rl.attention(b, h, length, chunk, dk, dv, causal)
    # forward QKᵀ (dk) + PV (dv); backward dV, dP (dv), dQ, dK (dk); 2 FLOPs per multiply-add
    assert work.flops == 2 * b * h * pairs * ((dk + dv) + (2 * dv + 2 * dk))
    assert work.simt_flops == 0


def test_attention_flops_equal_the_attention_benchmarks_count():
    from bench.attention_gpu import minimal_flops

    for args in [(1, 4, 4096, 4096, 256, 2048, True), (2, 2, 1000, 384, 64, 128, False)]:
        assert rl.attention(*args).flops == minimal_flops(*args)


def test_attention_at_the_7b_chunk():
    work = rl.attention(1, 4, 4096, 4096, 256, 2048)
    assert work.flops == 2 * 4 * (4096 * 4097 // 2) * 3 * (256 + 2048)  # ≈ 464 GFLOP
    # Q, K, V, O forward; Q, K, V, O, dO, dQ, dK, dV backward (bf16), the log-sum-exp (float32) out and in
    assert work.bytes == 4 * 4096 * (2 * (2 * 256 + 2 * 2048) + 2 * (4 * 256 + 4 * 2048) + 8)


def test_timestep_norm_bytes_are_five_passes_and_the_parameters():
    b, length, d, g = 2, 96, 64, 8
    for itemsize in (2, 4):
        work = rl.timestep_norm(b, length, d, g, itemsize)
        x = b * length * d * itemsize
        # forward: x in, y out; backward: x, dy in, dx out; w, b read twice, dw, db written (float32)
        assert work.bytes == (1 + 1 + 1 + 1 + 1) * x + (2 + 2 + 2) * d * 4
    assert rl.timestep_norm(1, 32768, 4096, 64).bytes == pytest.approx(1.342e9, rel=1e-3)


def test_cema_counts():
    work = rl.cema(1, 100, 8, 16, itemsize=4)
    assert work.simt_flops == 100 * 8 * ((14 + 36) * 16 + 6)
    assert work.bytes == 5 * 100 * 8 * 4 and work.flops == 0


def test_qk_norm_rope_and_gemv_bytes():
    work = rl.qk_norm_rope(1, 10, 2, 8, itemsize=2)
    assert work.bytes == 7 * 10 * 16 * 2 + 10 * 16 * 4
    gemv = rl.gemv(16384, 4096)
    assert gemv.bytes == 16384 * 4096 * 2 + 4096 * 4 + 2 * 16384 * 4


def test_floor_is_the_larger_of_arithmetic_and_memory_time():
    c = rl.Ceilings(copy_bytes_per_s=2e12, bf16_flops_per_s=800e12, fp32_flops_per_s=50e12, source="test")
    compute = rl.Work("c", flops=8e12, simt_flops=5e11, bytes=1e9)
    assert compute.floor_s(c) == pytest.approx(8e12 / 800e12 + 5e11 / 50e12)
    assert compute.bound(c) == "compute"
    memory = rl.Work("m", simt_flops=1e9, bytes=4e9)
    assert memory.floor_s(c) == pytest.approx(4e9 / 2e12) and memory.bound(c) == "memory"
    both = rl.combine("both", [compute, memory])
    assert both.flops == 8e12 and both.bytes == 5e9
    assert both.floor_s(c) == pytest.approx(max(8e12 / 800e12 + (5e11 + 1e9) / 50e12, 5e9 / 2e12))
    assert both.parts_floor_s(c) == pytest.approx(compute.floor_s(c) + memory.floor_s(c))
    assert both.parts_floor_s(c) >= both.floor_s(c)


def test_block_tensor_flops_agree_with_the_models_flops_per_token():
    """The blocks' GEMM + attention FLOPs against the models' own FLOP counts (the per-token formulas the
    throughput logs use, written there independently: mean context C/2 instead of (C+1)/2)."""
    from mega_suite import get_config
    from mega_suite.models.llama import LlamaConfig
    from mega_suite.models.llama import flops_per_token as llama_fpt
    from mega_suite.models.megalodon import flops_per_token as mega_fpt

    cfg = get_config("megalodon_7b")
    for length in rl.BLOCK_LENGTHS:
        head = 6 * cfg.model_dim * cfg.vocab_size
        per_block = (mega_fpt(cfg, length) - head) / cfg.num_layers
        assert rl.megalodon_block(length, **rl.MEGALODON_7B).flops == pytest.approx(
            per_block * length, rel=1e-3
        )
        lcfg = LlamaConfig(
            num_layers=1, model_dim=4096, num_heads=32, ffn_hidden_dim=11008, vocab_size=1, max_seq_len=length
        )
        expected = llama_fpt(lcfg, length) - 6 * 4096
        assert rl.llama_block(length, **rl.LLAMA_7B).flops == pytest.approx(expected * length, rel=1e-3)


def test_the_7b_widths_are_the_presets():
    from bench.block import LLAMA_7B
    from mega_suite import get_config

    cfg = get_config("megalodon_7b")
    m = rl.MEGALODON_7B
    assert (m["dim"], m["z_dim"], m["value_dim"], m["ffn_dim"]) == (
        cfg.model_dim,
        cfg.z_dim,
        cfg.value_dim,
        cfg.ffn_hidden_dim,
    )
    assert (m["heads"], m["ndim"], m["groups"], m["chunk"]) == (
        cfg.num_heads,
        cfg.cema_ndim,
        cfg.norm_num_groups,
        cfg.chunk_size,
    )
    assert cfg.swiglu and rl.LLAMA_7B == LLAMA_7B


def test_the_table_labels_spec_sheet_figures_and_lists_every_kernel_and_block():
    text = rl.table()
    assert "spec sheet (not measured)" in text
    for work in [*rl.kernel_works().values(), *rl.block_works().values()]:
        assert f"| {work.name} |" in text
    # equal efficiency would leave Megalodon / Llama at the floors' ratio: above 1 at 4K, below at 32K
    blocks = rl.block_works()
    c = rl.H100_SXM_SPEC
    assert blocks["megalodon", 4096].floor_s(c) > blocks["llama", 4096].floor_s(c)
    assert blocks["megalodon", 32768].floor_s(c) < blocks["llama", 32768].floor_s(c)
    assert math.isclose(rl.H100_SXM_SPEC.bf16_flops_per_s, 989.4e12)
