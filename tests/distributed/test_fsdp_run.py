"""trainer.strategy=fsdp end to end (issue 11): 2 CPU processes (gloo) of a small LM recipe train, stop on
SIGTERM, resume to the same weights bit for bit; the sharded checkpoint consolidates to one reference-format
file that a single process evaluates to the same loss; ``mode=test`` reads the sharded checkpoint."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from spawn_support import TINY_KJV_LM

ROOT = Path(__file__).resolve().parents[2]

SMALL_LM = [
    *TINY_KJV_LM,
    "trainer.val_check_interval=100000",
    "trainer.limit_val_batches=2",
    "trainer.limit_test_batches=3",
]
FSDP2 = ["trainer.strategy=fsdp", "trainer.devices=2"]
STEPS = 30


@pytest.fixture(scope="module")
def kjv_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("kjv_data")


def _args(data_dir: Path, *extra: str) -> list[str]:
    return [sys.executable, str(ROOT / "run.py"), *SMALL_LM, f"data.data_dir={data_dir}", *extra]


def _env() -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    env.pop("MEGA_SUITE_RUN", None)
    return env


def _run(args: list[str]) -> str:
    proc = subprocess.run(args, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=400)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    return out


def _metrics(out: str) -> dict:
    # rank 1 writes into the same pipe: its partial lines may precede rank 0's summary on one line (only rank
    # 0 prints the summary, in one write)
    # the summary names the folder; its metrics.json holds the values at full precision
    line = [x for x in out.splitlines() if "[mega-suite] done" in x][-1]
    folder = line[line.rindex("(in ") + 4 : line.rindex(")")]
    return json.loads((Path(folder) / "metrics.json").read_text())


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    from mega_suite.storage.checkpoints import open_checkpoint

    return open_checkpoint(run_dir / "checkpoints" / "last.ckpt", "ckpt").state()


def _step(run_dir: Path) -> int:
    return torch.load(run_dir / "checkpoints" / "last.ckpt" / "meta.pt", weights_only=True)["global_step"]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_fsdp_sigterm_resume_consolidate_and_test(kjv_dir, tmp_path):
    full_dir, split_dir = tmp_path / "full", tmp_path / "split"
    steps = f"trainer.max_steps={STEPS}"
    _run(_args(kjv_dir, *FSDP2, steps, f"run_dir={full_dir}"))
    assert _step(full_dir) == STEPS

    proc = subprocess.Popen(
        _args(kjv_dir, *FSDP2, steps, f"run_dir={split_dir}"),
        cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    seen, deadline = "", time.time() + 300
    while time.time() < deadline:
        line = proc.stdout.readline()
        seen += line
        if re.match(r"\[train\] step 3/", line) or not line:
            break
    # to every rank, as a cluster scheduler sends it (rank 0 and Lightning's child rank 1)
    os.killpg(proc.pid, signal.SIGTERM)
    out, _ = proc.communicate(timeout=300)
    seen += out
    assert proc.returncode == 0, seen[-4000:]
    assert seen.count("SIGTERM received") == 2, seen[-3000:]  # both ranks, one save together
    stopped_at = _step(split_dir)
    assert 3 <= stopped_at < STEPS, seen[-3000:]

    _run(_args(kjv_dir, *FSDP2, steps, f"run_dir={split_dir}", "resume=auto"))
    assert _step(split_dir) == STEPS
    ref, got = _weights(full_dir), _weights(split_dir)
    assert set(ref) == set(got) and ref
    for key in ref:
        assert torch.equal(ref[key], got[key]), f"{key} differs after SIGTERM at step {stopped_at} + resume"

    # the sharded checkpoint, evaluated on 2 ranks (the test books split between them), and consolidated,
    # evaluated on one process: the whole test split, in 2048-token segments
    whole = ["trainer.limit_test_batches=1.0", "data.options.eval_seq_len=2048"]
    runs = f"run_root={tmp_path / 'runs'}"  # the test runs' logs, not in the checkout's runs/
    sharded = _metrics(
        _run(_args(kjv_dir, *FSDP2, *whole, "mode=test", f"ckpt={full_dir}/checkpoints/last.ckpt", runs))
    )
    out_pt = tmp_path / "consolidated.pt"
    consolidate = [
        sys.executable,
        "-m",
        "mega_suite.training.checkpoint",
        "consolidate",
        str(full_dir),
        str(out_pt),
    ]
    subprocess.run(consolidate, cwd=ROOT, env=_env(), check=True, capture_output=True, timeout=200)
    single = _metrics(_run(_args(kjv_dir, "trainer.devices=1", *whole, "mode=test", f"ckpt={out_pt}", runs)))
    assert sharded["test/loss"] == pytest.approx(single["test/loss"], rel=1e-5)
