"""trainer.chunk_parallel=2 end to end (issue 12's must-show): two CPU processes (gloo), each training on its
chunk-aligned half of the same sequences, log the same training losses as one process with the same seed,
and the same validation and test metrics (the streamed documents split over both ranks, each scored once). The
gradients of the training step's loss: tests/distributed/test_chunk_parallel.py (_training_step_gradients)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from spawn_support import TINY_KJV_LM

ROOT = Path(__file__).resolve().parents[2]

SMALL_LM = [
    *TINY_KJV_LM, "data.options.eval_seq_len=2048", "trainer.val_check_interval=3",
    "trainer.limit_val_batches=1.0", "trainer.limit_test_batches=2", "trainer.strategy=fsdp", "trainer.max_steps=3",
]  # fmt: skip


EVAL_TAGS = ("val/loss", "val/word_ppl", "test/loss", "test/word_ppl")


def _scalars(run_dir: Path) -> dict[str, list[float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir))
    acc.Reload()
    return {tag: [e.value for e in acc.Scalars(tag)] for tag in ("train/loss", *EVAL_TAGS)}


def _run(data_dir: Path, run_dir: Path, *extra: str) -> dict[str, list[float]]:
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    env.pop("MEGA_SUITE_RUN", None)
    args = [
        sys.executable,
        str(ROOT / "run.py"),
        *SMALL_LM,
        f"data.data_dir={data_dir}",
        f"run_dir={run_dir}",
    ]
    proc = subprocess.run([*args, *extra], cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return _scalars(run_dir)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    "mode", ["parallel"]
)  # the sequential mode's equality: test_chunk_parallel.py, float64
def test_two_chunk_parallel_ranks_log_the_single_process_losses(mode, tmp_path_factory):
    data = tmp_path_factory.mktemp("kjv")
    out = tmp_path_factory.mktemp("runs")
    # the baseline is what a user runs on one device (strategy auto), not one-rank FSDP: that also built the
    # model on the meta device, and so hid that the two initialisations differed
    one = _run(data, out / "one", "trainer.devices=1", "trainer.strategy=auto")
    two = _run(
        data,
        out / "two",
        "trainer.devices=2",
        "trainer.chunk_parallel=2",
        f"trainer.chunk_parallel_mode={mode}",
    )
    assert len(one["train/loss"]) == len(two["train/loss"]) == 3
    assert two["train/loss"] == pytest.approx(one["train/loss"], rel=1e-5)
    # the whole validation split (2 books: one per rank under cp=2) at step 3, val and test loaders
    for tag in EVAL_TAGS:
        assert len(one[tag]) == len(two[tag]) == 1, (tag, one[tag], two[tag])
        assert two[tag] == pytest.approx(one[tag], rel=1e-5), tag


def test_chunk_parallel_configuration_errors(tmp_path):
    from mega_suite.config import ConfigError, load_config

    base = [*SMALL_LM, f"data.data_dir={tmp_path}", "trainer.devices=2"]
    with pytest.raises(ConfigError, match="trainer.strategy=fsdp"):
        load_config([*base, "trainer.chunk_parallel=2", "trainer.strategy=ddp"])
    with pytest.raises(ConfigError, match="multiple of chunk_parallel x model.chunk_size"):
        load_config([*base, "trainer.chunk_parallel=2", "data.options.seq_len=96"])
    with pytest.raises(ConfigError, match="must divide the number of ranks"):
        load_config([*base, "trainer.chunk_parallel=3", "data.options.seq_len=96"])
    with pytest.raises(ConfigError, match=r"model.arch in \[.megalodon.\] \(got task=lm, model.arch=llama\)"):
        load_config([*base, "trainer.chunk_parallel=2", "model.arch=llama"])
    with pytest.raises(ConfigError, match="trainer.chunk_parallel_mode"):
        load_config([*base, "trainer.chunk_parallel=2", "trainer.chunk_parallel_mode=ring"])
