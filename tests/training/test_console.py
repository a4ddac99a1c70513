"""What a person sees and keeps after ``python run.py`` (issue 38, points 6 and 7): no third-party adverts or
empty FLOP tables, the configuration in the run folder rather than on screen, a final line a person reads, and
one copy of the weights where ``last.ckpt`` and the best checkpoint hold the same step."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TINY = [
    "model.model_dim=16", "model.z_dim=8", "model.value_dim=16", "model.ffn_hidden_dim=16", "model.chunk_size=32",
    "data.max_length=128", "data.batch_size=4", "trainer.progress_bar=false", "trainer.limit_val_batches=2",
    "trainer.limit_test_batches=2", "trainer.max_steps=4", "trainer.val_check_interval=4",
]  # fmt: skip


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    from datamodules.listops_generator import generate_listops

    root = tmp_path_factory.mktemp("console")
    generate_listops(root / "listops", 96, 16, 16, seed=0)
    args = [sys.executable, "run.py", "recipe=debug", f"data.data_dir={root / 'listops'}", f"run_root={root}"]
    proc = subprocess.run(
        [*args, *TINY], cwd=ROOT, env=dict(os.environ, MEGA_MALLOC="system"), capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run_dir,) = (root / "debug").iterdir()
    return proc.stdout + proc.stderr, run_dir


def test_the_console_holds_no_adverts_no_empty_flops_and_no_configuration_dump(fitted):
    out, run_dir = fitted
    for noise in ("Tip:", "litlogger", "litmodels", "Total FLOPs", "| Name ", "optim:\n"):
        assert noise not in out, f"{noise!r} on the console:\n{out}"
    assert len(out.splitlines()) < 40, out
    assert "optim:" in (run_dir / "config.yaml").read_text()  # the configuration is kept, in the run


def test_the_last_line_is_a_readable_summary(fitted):
    out, run_dir = fitted
    last = [line for line in out.splitlines() if line.startswith("[mega-suite] done")]
    assert len(last) == 1, out
    assert "{" not in last[0] and "val/acc " in last[0] and str(run_dir) in last[0], last[0]


def test_last_and_best_at_the_same_step_are_one_copy_of_the_weights(fitted):
    _, run_dir = fitted
    (best,) = (run_dir / "checkpoints").glob("best-*.ckpt")
    last = run_dir / "checkpoints" / "last.ckpt"
    assert best.name == "best-step4.ckpt"
    assert os.path.samefile(best, last), "last.ckpt is a second copy of best-step4.ckpt"
    files = [p for p in (run_dir / "checkpoints").iterdir() if p.is_file()]
    assert len({p.stat().st_ino for p in files}) == 1, sorted(p.name for p in files)
