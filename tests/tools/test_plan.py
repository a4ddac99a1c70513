"""``mode=plan`` (issue 11): the per-GPU memory table, without allocating the model."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
def test_plan_of_the_7b_prints_the_table_without_allocating():
    """Peak RSS < 2 GB (the float32 7B alone is 29 GB): nothing is materialised."""
    # the child reports its own peak (RUSAGE_CHILDREN would be the largest of every child this worker ran)
    child = (
        "import resource, runpy, sys\n"
        "sys.argv = ['run.py', 'recipe=llm_7b', 'mode=plan', 'trainer.devices=8']\n"
        "try:\n    runpy.run_path('run.py', run_name='__main__')\n"
        "finally:\n    print('peak_kib', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)\n"
    )
    env = dict(os.environ, MEGA_MALLOC="system")
    proc = subprocess.run(
        [sys.executable, "-c", child], cwd=ROOT, env=env, capture_output=True, text=True, timeout=280
    )
    peak_kib = int(proc.stderr.rsplit("peak_kib", 1)[1].split()[0])
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    for row in ("parameters (float32, sharded)", "gradients", "AdamW state", "activations, no checkpointing",
                "activations, activation checkpointing", "host RAM per rank", "tokens per optimizer step",
                "measured on CPU"):  # fmt: skip
        assert row in out, out
    assert "8 ranks, parameters sharded over 8" in out
    # 7,385.8M float32 parameters over 8 ranks
    line = next(x for x in out.splitlines() if "parameters (float32, sharded)" in x)
    assert float(line.split()[-1]) == pytest.approx(7_385.8e6 * 4 / 8 / 1024**3, rel=1e-3)
    assert peak_kib < 2 * 1024**2, f"peak RSS {peak_kib / 1024:.0f} MiB"


def test_measured_activations_grow_with_layers_and_width():
    from mega_suite.models.megalodon.config import MegalodonConfig
    from mega_suite.tools.plan import _scaled, saved_bytes

    cfg = MegalodonConfig(
        num_layers=2, model_dim=64, num_heads=2, z_dim=32, value_dim=64, ffn_hidden_dim=64, cema_ndim=2,
        norm_num_groups=4, chunk_size=16, vocab_size=32,
    )  # fmt: skip
    one, two = saved_bytes(_scaled(cfg, 1, 1), 16, False), saved_bytes(_scaled(cfg, 1, 2), 16, False)
    narrow = saved_bytes(_scaled(cfg, 2, 2), 16, False) - saved_bytes(_scaled(cfg, 2, 1), 16, False)
    assert two > one > 0
    assert two - one > narrow > 0
    # at least the block's input and output per token (float32, model_dim each)
    assert (two - one) / 16 >= 2 * 64 * 4


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_every_recipe_has_a_plan():
    from mega_suite.config import list_recipes, load_config
    from mega_suite.tools.plan import plan

    for name in list_recipes():
        out = plan(load_config([f"recipe={name}", "mode=plan"]))
        assert "activations, activation checkpointing" in out, name
