"""The experiment suite end to end on the tiny debug recipe: config errors, resume, graceful stop, atomic saves."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from mega_suite.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[2]

# Tiny and quick: sequences truncated to 128 tokens, 2 layers of width 16.
TINY = [
    "model.model_dim=16",
    "model.z_dim=8",
    "model.value_dim=16",
    "model.ffn_hidden_dim=16",
    "model.chunk_size=32",
    "data.max_length=128",
    "data.batch_size=4",
    "trainer.progress_bar=false",
    "trainer.limit_val_batches=2",
    "trainer.limit_test_batches=2",
    "trainer.log_every_n_steps=1",
]


@pytest.fixture(scope="module")
def listops_dir(tmp_path_factory) -> Path:
    from datamodules.listops_generator import generate_listops

    out = tmp_path_factory.mktemp("listops")
    generate_listops(out, 96, 16, 16, seed=0)
    return out


def tiny_config(listops_dir: Path, run_root: Path, *extra: str):
    return load_config(
        ["recipe=debug", f"data.data_dir={listops_dir}", f"run_root={run_root}", *TINY, *extra]
    )


def test_config_errors_name_key_value_and_suggestions():
    with pytest.raises(ConfigError, match=r"optim\.lrr.*nearest valid keys: optim\.lr"):
        load_config(["recipe=debug", "optim.lrr=1"])
    with pytest.raises(ConfigError, match=r"optim\.lr.*'abc'"):
        load_config(["recipe=debug", "optim.lr=abc"])
    with pytest.raises(ConfigError, match=r"unknown recipe 'lra_listop'.*lra_listops"):
        load_config(["recipe=lra_listop"])
    with pytest.raises(ConfigError, match=r"trainer\.strategy='fsdpp'.*auto, ddp, fsdp"):
        load_config(["recipe=debug", "trainer.strategy=fsdpp"])
    with pytest.raises(ConfigError, match=r"model_dim.*norm_num_groups"):
        load_config(["recipe=debug", "model.model_dim=30"])


def test_every_recipe_resolves():
    from mega_suite.config import list_recipes

    recipes = list_recipes()
    for name in ("lra_listops", "lra_pathx_chunk", "wt103", "pg19", "llm_7b", "sc_raw", "imagenet", "debug"):
        assert name in recipes and recipes[name], name
    for name in recipes:
        cfg = load_config([f"recipe={name}"])
        assert cfg.recipe == name
    assert load_config(["recipe=lra_pathx_chunk"]).model.chunk_size == 4096
    assert load_config(["recipe=lra_listops_chunk"]).model.chunk_size == 128
    assert load_config(["recipe=lra_listops"]).optim.lr == pytest.approx(1e-3)


class StopAt:
    """Simulate a SIGTERM arriving during step ``step``: GracefulStop saves last.ckpt and stops."""

    def __init__(self, step: int):
        self.step = step

    def __call__(self):
        import lightning as L

        from mega_suite.training.callbacks import GracefulStop

        outer = self

        class _Stop(L.Callback):
            def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
                if trainer.global_step == outer.step - 1:
                    for cb in trainer.callbacks:
                        if isinstance(cb, GracefulStop):
                            cb.requested = "SIGTERM"

        return _Stop()


def _weights(ckpt: Path) -> dict[str, torch.Tensor]:
    state = torch.load(ckpt, map_location="cpu", weights_only=True)  # checkpoints are weights_only-safe
    return state["state_dict"], state["global_step"]


def test_resume_reaches_the_same_weights(listops_dir, tmp_path, capsys):
    from mega_suite.training.runner import run

    steps = ["trainer.max_steps=6", "trainer.val_check_interval=4"]
    full = run(tiny_config(listops_dir, tmp_path / "a", *steps))
    # without a progress bar, progress goes to plain lines: every step here, and every evaluation
    printed = capsys.readouterr().out
    assert re.search(
        r"^\[train\] step 5/6  loss\(mean\) \d.*train/loss \d.* lr .* s/step  ETA ", printed, re.M
    ), printed
    assert re.search(r"^\[eval\] step 4 .*test/acc .*val/acc \d", printed, re.M), printed
    ref, ref_step = _weights(Path(full["run_dir"]) / "checkpoints" / "last.ckpt")
    assert ref_step == 6

    first = run(tiny_config(listops_dir, tmp_path / "b", *steps), extra_callbacks=[StopAt(3)()])
    mid, mid_step = _weights(Path(first["run_dir"]) / "checkpoints" / "last.ckpt")
    assert mid_step == 3
    second = run(tiny_config(listops_dir, tmp_path / "b", *steps, "resume=auto"))
    assert second["run_dir"] == first["run_dir"]
    out, out_step = _weights(Path(second["run_dir"]) / "checkpoints" / "last.ckpt")
    assert out_step == 6
    assert set(out) == set(ref)
    for key in ref:
        torch.testing.assert_close(out[key], ref[key], rtol=0, atol=0, msg=key)
    assert any(not torch.equal(mid[k], ref[k]) for k in ref)  # the resumed half did train
    events = list(Path(second["run_dir"]).glob("events.out.tfevents.*"))
    assert events, "TensorBoard event files are written into the run directory"
    assert (Path(second["run_dir"]) / "config.yaml").exists()


def test_sigterm_saves_a_checkpoint_and_exits(listops_dir, tmp_path):
    args = [sys.executable, str(ROOT / "run.py"), "recipe=debug", f"data.data_dir={listops_dir}"]
    args += [f"run_root={tmp_path}", *TINY, "trainer.max_steps=100000", "trainer.val_check_interval=100000"]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    deadline = time.time() + 120
    seen = ""
    while time.time() < deadline and proc.poll() is None:
        line = proc.stdout.readline()
        seen += line
        if line.startswith("[train] step 2"):  # training is under way: stop it between steps
            break
    assert "[train] step 2" in seen, seen[-3000:]
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    seen += out
    assert proc.returncode == 0, seen[-3000:]
    assert "SIGTERM received" in seen
    ckpts = list(tmp_path.glob("debug/*/checkpoints/last.ckpt"))
    assert len(ckpts) == 1, seen[-2000:]
    state, step = _weights(ckpts[0])
    assert step >= 1 and state


def test_checkpoint_write_is_atomic(tmp_path, monkeypatch):
    from mega_suite.training.saving import AtomicCheckpointIO

    io = AtomicCheckpointIO()
    path = tmp_path / "last.ckpt"
    io.save_checkpoint({"w": torch.ones(3)}, path)

    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

    def broken_save(self, checkpoint, path, storage_options=None):
        Path(path).write_bytes(b"partial garbage")
        raise KeyboardInterrupt  # killed mid-write

    monkeypatch.setattr(TorchCheckpointIO, "save_checkpoint", broken_save)
    with pytest.raises(KeyboardInterrupt):
        io.save_checkpoint({"w": torch.zeros(3)}, path)
    monkeypatch.undo()
    assert torch.equal(io.load_checkpoint(path)["w"], torch.ones(3))


def test_non_finite_loss_stops_with_clear_error_and_keeps_checkpoint(listops_dir, tmp_path):
    import lightning as L

    from mega_suite.training.module import NonFiniteLossError
    from mega_suite.training.runner import run

    class PoisonAt(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step == 4:
                with torch.no_grad():
                    next(pl_module.model.parameters()).fill_(float("nan"))

    cfg = tiny_config(listops_dir, tmp_path, "trainer.max_steps=10", "trainer.val_check_interval=3")
    with pytest.raises(NonFiniteLossError, match="non-finite training loss"):
        run(cfg, extra_callbacks=[PoisonAt()])
    last = list(tmp_path.glob("debug/*/checkpoints/last.ckpt"))
    assert last, "the last good checkpoint survives"
    state, step = _weights(last[0])
    assert step == 3 and all(torch.isfinite(v).all() for v in state.values() if v.is_floating_point())


def test_init_from_starts_a_new_run_from_checkpoint_weights(listops_dir, tmp_path):
    from mega_suite.training.runner import run

    source = run(
        tiny_config(listops_dir, tmp_path / "a", "trainer.max_steps=2", "trainer.val_check_interval=2")
    )
    ckpt = Path(source["run_dir"]) / "checkpoints" / "last.ckpt"
    trained, _ = _weights(ckpt)
    # lr 1e-30: the one step leaves the loaded weights as they were; the step count starts afresh
    tuned = run(
        tiny_config(
            listops_dir, tmp_path / "b", f"init_from={ckpt}", "optim.lr=1e-30", "trainer.max_steps=1",
            "trainer.val_check_interval=1", "data.max_length=64",
        )
    )  # fmt: skip
    out, step = _weights(Path(tuned["run_dir"]) / "checkpoints" / "last.ckpt")
    assert step == 1
    for key in trained:
        torch.testing.assert_close(out[key], trained[key], rtol=0, atol=1e-20, msg=key)
    with pytest.raises(FileNotFoundError, match="init_from=.*nope.ckpt: no such checkpoint"):
        run(tiny_config(listops_dir, tmp_path / "c", f"init_from={tmp_path / 'nope.ckpt'}"))
    with pytest.raises(
        ValueError,
        match=r"init_from=.*last.ckpt: checkpoint was trained with model.model_dim=16 \(recipe=debug, task=classify\); "
        r"this run builds model.model_dim=32",
    ):
        run(tiny_config(listops_dir, tmp_path / "d", f"init_from={ckpt}", "model.model_dim=32"))
    with pytest.raises(ValueError, match=r"init_from=.* is read by mode=fit only \(mode=test\)"):
        run(tiny_config(listops_dir, tmp_path / "e", f"init_from={ckpt}", "mode=test", f"ckpt={ckpt}"))


def test_sigterm_at_an_epoch_end_still_saves(listops_dir, tmp_path):
    """A real SIGTERM after the last batch of an epoch: Lightning's own handler would end the fit loop at
    the epoch boundary (SIGTERMException) before GracefulStop saw it; GracefulStop must still save."""
    import lightning as L

    from mega_suite.training.runner import run

    killed_at = []

    class _KillAtEpochEnd(L.Callback):  # runs after GracefulStop's on_train_batch_end
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if not killed_at and batch_idx == trainer.num_training_batches - 1:
                killed_at.append(trainer.global_step)
                os.kill(os.getpid(), signal.SIGTERM)

    steps = ["trainer.max_steps=1000", "trainer.val_check_interval=1000"]
    out = run(tiny_config(listops_dir, tmp_path, *steps), extra_callbacks=[_KillAtEpochEnd()])
    state, step = _weights(Path(out["run_dir"]) / "checkpoints" / "last.ckpt")
    assert killed_at and step == killed_at[0] + 1  # saved after the next step, then stopped
    assert state
