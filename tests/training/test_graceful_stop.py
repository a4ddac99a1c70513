"""Stopping promptly (issue 11): after a stop request the run saves at the next optimizer-step boundary and
does nothing else -- no validation -- and under gradient accumulation it never stops inside a window."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import torch
from test_run_end_to_end import StopAt, _weights, listops_dir, tiny_config  # noqa: F401  (listops_dir: fixture)


class CountValidations(L.Callback):
    def __init__(self):
        self.after_stop = 0

    def on_validation_start(self, trainer, pl_module) -> None:
        from mega_suite.training.callbacks import GracefulStop

        if any(isinstance(cb, GracefulStop) and cb.requested for cb in trainer.callbacks):
            self.after_stop += 1


def test_no_validation_after_a_stop_request(listops_dir, tmp_path):  # noqa: F811
    """Lightning validates when ``should_stop`` is set (as for early stopping); a stop request must not: on
    a real split that validation takes minutes, and the scheduler's SIGKILL follows."""
    from mega_suite.training.runner import run

    counter = CountValidations()
    cfg = tiny_config(listops_dir, tmp_path, "trainer.max_steps=8", "trainer.val_check_interval=100000")
    out = run(cfg, extra_callbacks=[StopAt(3)(), counter])
    assert counter.after_stop == 0
    _, step = _weights(Path(out["run_dir"]) / "checkpoints" / "last.ckpt")
    assert step == 3


def test_stop_under_accumulation_waits_for_the_window_and_resumes_exactly(listops_dir, tmp_path):  # noqa: F811
    """accumulate_grad_batches=2: a stop requested in the first micro-batch of step 3 saves after step 3's
    optimizer step (never half a window), and resuming reaches the uninterrupted run's weights exactly."""
    from mega_suite.training.runner import run

    steps = ["trainer.max_steps=5", "trainer.val_check_interval=100000", "trainer.accumulate_grad_batches=2"]
    full = run(tiny_config(listops_dir, tmp_path / "a", *steps))
    ref, _ = _weights(Path(full["run_dir"]) / "checkpoints" / "last.ckpt")
    first = run(tiny_config(listops_dir, tmp_path / "b", *steps), extra_callbacks=[StopAt(3)()])
    state = torch.load(Path(first["run_dir"]) / "checkpoints" / "last.ckpt", weights_only=True)
    assert state["global_step"] == 3
    second = run(tiny_config(listops_dir, tmp_path / "b", *steps, "resume=auto"))
    out, step = _weights(Path(second["run_dir"]) / "checkpoints" / "last.ckpt")
    assert step == 5
    for key in ref:
        assert torch.equal(out[key], ref[key]), key


def test_sharded_checkpoint_replacement_survives_a_kill(tmp_path):
    """A sharded checkpoint is a directory: replaced through <path>.prev. A kill before the swap leaves the
    previous checkpoint in place; a kill between the two renames leaves it in <path>.prev (and an older
    version's <path>.old, which resuming puts back); after the swap the new one is in place and the
    previous one kept as <path>.prev."""
    from mega_suite.storage.atomic import recover_checkpoint, replace_checkpoint

    last = tmp_path / "last.ckpt"
    last.mkdir()
    (last / "shard").write_text("previous")
    tmp = tmp_path / "last.ckpt.tmp"
    tmp.mkdir()
    (tmp / "shard").write_text("new")
    # killed between the renames
    import os

    os.replace(last, tmp_path / "last.ckpt.old")
    assert recover_checkpoint(last).joinpath("shard").read_text() == "previous"
    replace_checkpoint(tmp, last)
    assert (last / "shard").read_text() == "new"
    # the replaced one is kept, one generation back (resume=auto's fallback)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt", "last.ckpt.prev"]
    assert (tmp_path / "last.ckpt.prev" / "shard").read_text() == "previous"
    # a file checkpoint replaced by a directory (and back) works too
    f = tmp_path / "f.ckpt"
    f.write_text("file")
    d = tmp_path / "d.tmp"
    d.mkdir()
    replace_checkpoint(d, f)
    assert f.is_dir()
