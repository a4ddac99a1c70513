"""What a careless user types (issue 32): every case is a ``run.py`` command line, driven through ``run.main``
(the command line's own entry, in this process: a subprocess per case would cost seconds of imports each; a
few cases also run as real processes at the end). A mistake is exit code 2 and one ``error:`` line naming the
key or file, no traceback, and nothing created or modified anywhere the run could have written (every file and
folder under the run root, the data directories and the checkpoints, compared before and after). Runs that
go wrong mid-way (a NaN, a stop request, a full disk) keep a good checkpoint and resume."""

from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from spawn_support import TINY_KJV_LM

import run as entry

ROOT = Path(__file__).resolve().parents[2]
TINY = [
    "model.model_dim=16", "model.z_dim=8", "model.value_dim=16", "model.ffn_hidden_dim=16", "model.chunk_size=32",
    "data.max_length=128", "data.batch_size=4", "trainer.progress_bar=false", "trainer.limit_val_batches=2",
    "trainer.limit_test_batches=2", "trainer.log_every_n_steps=1",
]  # fmt: skip


def snapshot(*roots: Path) -> dict[str, tuple]:
    """Every file and folder under ``roots``: (size, modification time) -- what 'nothing was created or
    modified' compares."""
    out = {}
    for root in roots:
        if not root.exists():
            out[str(root)] = None
            continue
        for p in [root, *root.rglob("*")]:
            st = p.lstat()
            out[str(p)] = (p.is_dir(), 0 if p.is_dir() else st.st_size, st.st_mtime_ns)
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Prepared once: a ListOps data directory, the KJV corpus unpacked and tokenised, a finished tiny debug
    run (the run other commands must never touch) and damaged checkpoint files."""
    from datamodules import KJVDataModule
    from datamodules.listops_generator import generate_listops
    from mega_suite.config import load_config
    from mega_suite.training.export import consolidate
    from mega_suite.training.runner import run

    root = tmp_path_factory.mktemp("user")
    listops = root / "listops"
    generate_listops(listops, 96, 16, 16, seed=0)
    kjv = root / "kjv-data"
    KJVDataModule(str(kjv), batch_size=2, seq_len=64).prepare_data()
    runs = root / "runs"
    debug = ["recipe=debug", f"data.data_dir={listops}", f"run_root={runs}", *TINY]
    done = run(load_config([*debug, "trainer.max_steps=2", "trainer.val_check_interval=2"]))
    last = Path(done["run_dir"]) / "checkpoints" / "last.ckpt"
    bad = root / "bad"
    bad.mkdir()
    (bad / "empty.ckpt").write_bytes(b"")
    (bad / "random.ckpt").write_bytes(os.urandom(4096))
    (bad / "truncated.ckpt").write_bytes(last.read_bytes()[: last.stat().st_size // 2])
    weights = consolidate(last, bad / "weights.pt")
    empty_kjv = root / "empty-kjv"
    (empty_kjv / "kjv").mkdir(parents=True)
    return SimpleNamespace(
        root=root, listops=listops, kjv=kjv, runs=runs, debug=debug, run=Path(done["run_dir"]), last=last,
        bad=bad, weights=weights, empty_kjv=empty_kjv,
        kjv_args=["recipe=kjv", f"data.data_dir={kjv}", f"run_root={runs}"],
    )  # fmt: skip


def refused(capsys, argv: list[str], *names: str, watch: tuple[Path, ...] = ()) -> str:
    """Run ``argv``; it must exit 2 with one ``error:`` line naming every one of ``names``, print no
    traceback, and leave everything under ``watch`` as it was. Returns the error line."""
    before = snapshot(*watch)
    code = entry.main(argv)
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2, (code, err[-3000:])
    assert len(lines) == 1 and err.strip().splitlines()[-1] == lines[0], err[-3000:]
    assert "Traceback" not in err and "Traceback" not in out
    for name in names:
        assert name in lines[0], (name, lines[0])
    assert snapshot(*watch) == before, "something was created or modified"
    return lines[0]


def _watch(world) -> tuple[Path, ...]:
    return (world.runs, world.listops, world.kjv, world.bad, world.empty_kjv)


# ---------------------------------------------------------------------------------------------------------
# The table of bad input: one line at load, nothing written
# ---------------------------------------------------------------------------------------------------------

CONFIG_ROWS = {
    # the table
    "devices=0": (["trainer.devices=0"], "trainer.devices=0"),
    "accelerator=tpu": (["trainer.accelerator=tpu"], "trainer.accelerator='tpu'"),
    "num_workers=-1": (["data.num_workers=-1"], "data.num_workers=-1"),
    "limit_val_batches=-1": (["trainer.limit_val_batches=-1"], "trainer.limit_val_batches=-1"),
    "eps=-1": (["optim.eps=-1"], "optim.eps=-1"),
    "betas=[2,0.9]": (["optim.betas=[2,0.9]"], "optim.betas=[2.0, 0.9]"),
    "lr=nan": (["optim.lr=nan"], "optim.lr=nan"),
    "val_check_interval=0": (["trainer.val_check_interval=0"], "trainer.val_check_interval=0"),
    "lr=inf": (["optim.lr=inf"], "optim.lr=inf"),
    # the same pattern, found probing
    "seed=-1": (["seed=-1"], "seed=-1"),
    "norm_num_groups=0": (["model.norm_num_groups=0"], "model.norm_num_groups=0"),  # was ZeroDivisionError
    "max_length=0": (["data.max_length=0"], "data.max_length=0"),
    "log_every_n_steps=0": (["trainer.log_every_n_steps=0"], "trainer.log_every_n_steps=0"),
    "max_epochs=0": (["trainer.max_epochs=0"], "trainer.max_epochs=0"),
    "num_nodes=0": (["trainer.num_nodes=0"], "trainer.num_nodes=0"),
    "limit_test_batches=2.5": (["trainer.limit_test_batches=2.5"], "trainer.limit_test_batches=2.5"),
    "weight_decay=-1": (["optim.weight_decay=-1"], "optim.weight_decay=-1"),
    "clip_grad_norm=nan": (["optim.clip_grad_norm=nan"], "optim.clip_grad_norm=nan"),
    "min_lr_ratio=2": (["optim.min_lr_ratio=2"], "optim.min_lr_ratio=2"),
    "dropout=1": (["model.dropout=1"], "model.dropout=1"),
    "devices=[0,1] on the CPU": (
        ["trainer.devices=[0,1]", "trainer.accelerator=cpu"],
        "trainer.devices=[0, 1]",
    ),
}
if not torch.cuda.is_available():
    CONFIG_ROWS["accelerator=gpu without a GPU"] = (["trainer.accelerator=gpu"], "trainer.accelerator=gpu")


@pytest.mark.parametrize("case", list(CONFIG_ROWS))
def test_a_bad_value_is_one_line_before_anything_is_written(case, world, capsys):
    overrides, named = CONFIG_ROWS[case]
    refused(capsys, [*world.debug, *overrides], named, watch=_watch(world))


def _checkpoint_rows(world) -> dict[str, tuple[list[str], tuple[str, ...]]]:
    bad, debug, kjv = world.bad, world.debug, world.kjv_args
    return {
        # mode=test ckpt= a damaged file: "is not a checkpoint", and why
        "ckpt=empty": ([*debug, "mode=test", f"ckpt={bad / 'empty.ckpt'}"], ("ckpt=", "empty.ckpt", "empty")),
        "ckpt=random bytes": ([*debug, "mode=test", f"ckpt={bad / 'random.ckpt'}"], ("ckpt=", "not a torch file")),
        "ckpt=truncated": ([*debug, "mode=test", f"ckpt={bad / 'truncated.ckpt'}"], ("ckpt=", "truncated")),
        "ckpt=missing": ([*debug, "mode=test", f"ckpt={bad / 'nope.ckpt'}"], ("ckpt=", "nope.ckpt", "no such")),
        "ckpt=a folder": ([*debug, "mode=test", f"ckpt={bad}"], ("ckpt=", "is a folder but not a checkpoint")),
        "init_from=random bytes": ([*debug, f"init_from={bad / 'random.ckpt'}"], ("init_from=", "not a torch file")),
        "init_from=truncated": ([*debug, f"init_from={bad / 'truncated.ckpt'}"], ("init_from=", "truncated")),
        "init_from=another model": (
            [*debug, "model.model_dim=32", f"init_from={world.last}"],
            ("init_from=", "checkpoint was trained with model.model_dim=16", "this run builds model.model_dim=32"),
        ),
        # a debug checkpoint under recipe=kjv
        "ckpt=debug under kjv": (
            [*kjv, "mode=test", f"ckpt={world.last}"],
            ("ckpt=", "checkpoint was trained with model.preset=lra_listops", "recipe=debug", "this run builds"),
        ),
        # resume= another recipe's run: refused before anything is written there
        "resume=another recipe's run": ([*kjv, f"resume={world.run}"], ("resume=", "recipe=debug", "recipe=kjv")),
        "resume=another recipe's checkpoint": (
            [*kjv, f"resume={world.last}"], ("resume=", "recipe=debug", "init_from="),
        ),
        "resume=a missing path": ([*debug, f"resume={bad / 'gone'}"], ("resume=", "no such")),
        "resume=weights without trainer state": ([*debug, f"resume={world.weights}"], ("resume=", "init_from=")),
        "resume=truncated": ([*debug, f"resume={bad / 'truncated.ckpt'}"], ("resume=", "truncated")),
        "resume with other parameter groups": (
            [*debug, f"resume={world.last}", "optim.no_decay_groups=true"], ("resume=", "parameter group"),
        ),
        # run_dir= an existing run: never overwritten
        "run_dir=another recipe's run": ([*kjv, f"run_dir={world.run}"], ("run_dir=", "recipe=debug", "resume=auto")),
        "run_dir=a finished run": ([*debug, f"run_dir={world.run}"], ("run_dir=", "already holds", "resume=auto")),
        # data: KJV's own message for an empty kjv/ folder (not PG-19's)
        "data_dir=an empty kjv/": (
            [*TINY_KJV_LM, f"data.data_dir={world.empty_kjv}", f"run_root={world.runs}"],
            ("King James Bible", "data.data_dir="),
        ),
    }  # fmt: skip


CHECKPOINT_CASES = [
    "ckpt=empty", "ckpt=random bytes", "ckpt=truncated", "ckpt=missing", "ckpt=a folder", "init_from=random bytes",
    "init_from=truncated", "init_from=another model", "ckpt=debug under kjv", "resume=another recipe's run",
    "resume=another recipe's checkpoint", "resume=a missing path", "resume=weights without trainer state",
    "resume=truncated", "resume with other parameter groups", "run_dir=another recipe's run",
    "run_dir=a finished run", "data_dir=an empty kjv/",
]  # fmt: skip


@pytest.mark.parametrize("case", CHECKPOINT_CASES)
def test_checkpoints_and_run_directories_are_checked_before_use(case, world, capsys):
    argv, names = _checkpoint_rows(world)[case]
    refused(capsys, argv, *names, watch=_watch(world))


def test_a_read_only_run_root_is_one_line(world, capsys, monkeypatch):
    """Where this user (root) can write anyway, ``os.access`` is made to answer as on a read-only mount."""
    read_only = world.root / "read-only"
    read_only.mkdir(exist_ok=True)
    real = os.access
    monkeypatch.setattr(
        os,
        "access",
        lambda p, mode, *a, **k: False if Path(p) == read_only and mode & os.W_OK else real(p, mode),
    )
    refused(capsys, [*world.debug, f"run_root={read_only}"], "run_root=", "cannot create the folder",
            watch=(*_watch(world), read_only))  # fmt: skip


def test_resume_auto_without_any_usable_checkpoint_names_each(world, capsys, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(world.run, broken)
    for ckpt in (broken / "checkpoints").iterdir():
        ckpt.write_bytes(ckpt.read_bytes()[:100])
    refused(capsys, [*world.debug, "resume=auto", f"run_dir={broken}"], "resume=auto", "no usable checkpoint",
            "last.ckpt: truncated", "best-step2.ckpt: truncated", watch=(*_watch(world), broken))  # fmt: skip


# ---------------------------------------------------------------------------------------------------------
# Runs that go wrong mid-way
# ---------------------------------------------------------------------------------------------------------


def _ckpts(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (Path(run_dir) / "checkpoints").iterdir())


def _state(path: Path):
    state = torch.load(path, map_location="cpu", weights_only=True)
    return state["state_dict"], state["global_step"]


def test_a_diverged_run_keeps_no_diverged_checkpoint_and_claims_none(world, capsys, tmp_path):
    """lr 1e6 from the first step, validating every step: the first validation is already NaN. Neither
    last.ckpt nor best-*.ckpt is written from it, and the message says no checkpoint was saved (it claimed
    'the last good checkpoint is kept' when there was none)."""
    run_dir = tmp_path / "nan"
    argv = [*world.debug, f"run_dir={run_dir}", "optim.lr=1e6", "optim.warmup_steps=0",
            "trainer.val_check_interval=1", "trainer.max_steps=6"]  # fmt: skip
    assert entry.main(argv) == 3
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert (
        len(lines) == 1 and "non-finite validation" in lines[0] and "No checkpoint was saved" in lines[0]
    ), err
    assert not (run_dir / "checkpoints").exists() or not list((run_dir / "checkpoints").glob("*.ckpt"))


def test_after_a_nan_the_kept_checkpoint_is_good_and_named(world, capsys, tmp_path):
    """Weights poisoned after step 2 (validated and saved at step 2): the run stops at step 3 and names the
    checkpoint it keeps; every checkpoint it left evaluates finite (fine-tuning from last.ckpt no longer
    starts from NaN)."""
    from mega_suite.config import load_config
    from mega_suite.training.module import NonFiniteLossError
    from mega_suite.training.runner import run

    class Poison(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step == 2:
                with torch.no_grad():
                    next(pl_module.model.parameters()).fill_(float("nan"))

    run_dir = tmp_path / "poisoned"
    cfg = load_config(
        [*world.debug, f"run_dir={run_dir}", "trainer.max_steps=6", "trainer.val_check_interval=2"]
    )
    with pytest.raises(NonFiniteLossError):
        run(cfg, extra_callbacks=[Poison()])
    err = capsys.readouterr().err
    assert f"The last good checkpoint, {run_dir / 'checkpoints' / 'last.ckpt'} (step 2), is kept" in err
    for name in _ckpts(run_dir):
        state, step = _state(run_dir / "checkpoints" / name)
        assert step == 2 and all(torch.isfinite(v).all() for v in state.values() if v.is_floating_point())
    code = entry.main([*world.debug, "mode=validate", f"ckpt={run_dir / 'checkpoints' / 'last.ckpt'}",
                       f"run_root={tmp_path / 'eval'}"])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0 and "'val/loss': nan" not in out


class SignalAt(L.Callback):
    """Send this process a real SIGTERM at validation batch ``batch`` of the validation after step ``step``
    (``where="validation"``), or while the checkpoint of that step is being written (``where="save"``);
    count what runs afterwards."""

    def __init__(self, step: int, where: str, batch: int = 1):
        self.step, self.where, self.batch = step, where, batch
        self.sent, self.after = False, {"validation": 0, "train": 0}

    def _send(self):
        self.sent = True
        os.kill(os.getpid(), signal.SIGTERM)

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        if self.sent:
            self.after["validation"] += 1
        elif self.where == "validation" and trainer.global_step == self.step and batch_idx == self.batch:
            self._send()

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        if self.where == "save" and not self.sent and trainer.global_step == self.step:
            self._send()  # arrives while the checkpoint is being written

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.sent:
            self.after["train"] += 1


STOP_STEPS = ["trainer.max_steps=6", "trainer.val_check_interval=3", "trainer.limit_val_batches=4"]


@pytest.fixture(scope="module")
def uninterrupted(world, tmp_path_factory):
    from mega_suite.config import load_config
    from mega_suite.training.runner import run

    out = run(load_config([*world.debug, f"run_root={tmp_path_factory.mktemp('full')}", *STOP_STEPS]))
    return _state(Path(out["run_dir"]) / "checkpoints" / "last.ckpt")[0]


@pytest.mark.parametrize("where", ["validation", "save"])
def test_a_stop_during_validation_or_a_save_is_honoured_at_the_last_step_and_resumes_exactly(
    where, world, uninterrupted, tmp_path, capsys
):
    """SIGTERM during the validation after step 3 (it used to finish the whole validation, then train one
    more step) or while step 3's checkpoint is written: no further validation batch and no training step
    run; last.ckpt holds step 3; resume=auto reaches the uninterrupted run's weights exactly, and no
    last-vN.ckpt ever appears."""
    from mega_suite.config import load_config
    from mega_suite.training.runner import run

    stop = SignalAt(3, where)
    args = [*world.debug, f"run_root={tmp_path}", *STOP_STEPS]
    first = run(load_config(args), extra_callbacks=[stop])
    assert stop.sent and stop.after == {"validation": 0, "train": 0}, stop.after
    run_dir = Path(first["run_dir"])
    assert _state(run_dir / "checkpoints" / "last.ckpt")[1] == 3
    second = run(load_config([*args, "resume=auto"]))
    assert second["run_dir"] == first["run_dir"]
    state, step = _state(run_dir / "checkpoints" / "last.ckpt")
    assert step == 6 and all(torch.equal(state[k], v) for k, v in uninterrupted.items())
    assert not [n for n in _ckpts(run_dir) if n.startswith("last-v")], _ckpts(run_dir)


def test_a_stop_before_the_first_validation_leaves_no_last_v1(world, uninterrupted, tmp_path):
    """Lightning's ModelCheckpoint saved 'last' again at the end of the loop when it had not written one
    itself: last-v1.ckpt beside the stop's last.ckpt (and last-v2.ckpt after a resume), from which a resume
    was not exact."""
    from test_run_end_to_end import StopAt

    from mega_suite.config import load_config
    from mega_suite.training.runner import run

    args = [*world.debug, f"run_root={tmp_path}", *STOP_STEPS]
    first = run(load_config(args), extra_callbacks=[StopAt(2)()])
    run_dir = Path(first["run_dir"])
    assert _ckpts(run_dir) == ["last.ckpt"] and _state(run_dir / "checkpoints" / "last.ckpt")[1] == 2
    run(load_config([*args, "resume=auto"]))
    assert not [n for n in _ckpts(run_dir) if n.startswith("last-v")], _ckpts(run_dir)
    state, step = _state(run_dir / "checkpoints" / "last.ckpt")
    assert step == 6 and all(torch.equal(state[k], v) for k, v in uninterrupted.items())


def test_last_ckpt_follows_every_validation(world, tmp_path):
    """Lightning wrote "last" only at the validations that also saved a new best checkpoint, so a crash lost
    every step since the last improvement. After each validation last.ckpt now holds that step."""
    from mega_suite.config import load_config
    from mega_suite.training.runner import run

    seen = []

    class Check(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step and trainer.global_step % 2 == 0:  # a validation ran after this step
                last = Path(trainer.checkpoint_callback.dirpath) / "last.ckpt"
                seen.append((trainer.global_step, _state(last)[1]))

    # monitor val/loss for a maximum: an improvement now and then, not at every validation
    cfg = load_config([*world.debug, f"run_root={tmp_path}", "trainer.max_steps=9", "trainer.val_check_interval=2",
                       "monitor=val/loss", "monitor_mode=max"])  # fmt: skip
    run(cfg, extra_callbacks=[Check()])
    assert [step for step, _ in seen] == [2, 4, 6, 8] and all(a == b for a, b in seen), seen


def test_optim_given_with_resume_is_applied_and_logged(world, capsys, tmp_path):
    """resume=auto optim.lr=... trained on at the old rate while config.resumed-*.yaml recorded the new one.
    Now the new peak lr (and betas, eps, weight decay) is set on the restored optimizer and schedule, and
    each change is logged."""
    constant = [*world.debug, f"run_root={tmp_path}", "optim.schedule=constant", "optim.warmup_steps=0",
                "trainer.val_check_interval=100"]  # fmt: skip
    assert entry.main([*constant, "trainer.max_steps=2", "optim.lr=0.001"]) == 0
    capsys.readouterr()
    assert (
        entry.main([*constant, "trainer.max_steps=4", "optim.lr=0.0005", "optim.eps=1e-6", "resume=auto"])
        == 0
    )
    out = capsys.readouterr().out
    assert (
        "resume: optim.lr 0.001 -> 0.0005 applied" in out
        and "resume: optim.eps 1e-08 -> 1e-06 applied" in out
    )
    (run_dir,) = (tmp_path / "debug").iterdir()
    state = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)
    assert state["global_step"] == 4
    group = state["optimizer_states"][0]["param_groups"][0]
    assert group["lr"] == group["initial_lr"] == 0.0005 and group["eps"] == 1e-6
    assert state["lr_schedulers"][0]["base_lrs"] == [0.0005]


def test_a_full_disk_is_one_line_and_leaves_no_partial_file(world, capsys, tmp_path, monkeypatch):
    """The second save finds the disk full: exit 2 with one error line (it was a traceback), no .tmp left
    behind, and the first checkpoint intact."""
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

    real, calls = TorchCheckpointIO.save_checkpoint, []

    def fills_up(self, checkpoint, path, storage_options=None):
        calls.append(path)
        if len(calls) >= 2:
            Path(path).write_bytes(b"half a checkpoint")
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real(self, checkpoint, path, storage_options)

    monkeypatch.setattr(TorchCheckpointIO, "save_checkpoint", fills_up)
    code = entry.main(
        [*world.debug, f"run_root={tmp_path}", "trainer.max_steps=4", "trainer.val_check_interval=1"]
    )
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err[-3000:]
    assert "cannot write checkpoint" in lines[0] and "the disk is full" in lines[0], lines[0]
    (run_dir,) = (tmp_path / "debug").iterdir()
    assert not list((run_dir / "checkpoints").glob("*.tmp"))
    assert _state(run_dir / "checkpoints" / "best-step1.ckpt")[1] == 1


def test_a_save_a_kill_left_behind_is_removed_and_a_truncated_last_is_skipped(world, capsys, tmp_path):
    """A SIGKILL during a save left last.ckpt.tmp for good (55 MB in the issue), and a truncated last.ckpt (a
    disk filled up, a copy cut short) made resume=auto a traceback. Now the partial save is removed (and
    said), and the resume continues from the newest usable checkpoint, naming the one it skipped."""
    killed = tmp_path / "killed"
    shutil.copytree(world.run, killed)
    (killed / "checkpoints" / "last.ckpt.tmp").write_bytes(os.urandom(1 << 20))
    last = killed / "checkpoints" / "last.ckpt"
    last.write_bytes(last.read_bytes()[:5000])
    assert entry.main([*world.debug, "resume=auto", f"run_dir={killed}", "trainer.max_steps=3"]) == 0
    out = capsys.readouterr().out
    assert "removed last.ckpt.tmp (1.0 MiB)" in out
    assert "skipped last.ckpt: truncated" in out and "resuming from best-step2.ckpt (step 2)" in out
    assert _state(last)[1] == 3 and not list((killed / "checkpoints").glob("*.tmp"))


def test_a_kjv_book_replaced_after_tokenisation_is_read_again(world, capsys, tmp_path):
    """The token cache hid a changed source: a KJV book replaced with garbage after the first tokenisation
    trained on the old tokens with exit 0. Now the cache is rebuilt and the garbage is one error line naming
    the book (after the interrupted progress bar, on a line of its own), with no run directory."""
    data = tmp_path / "kjv-copy"
    shutil.copytree(world.kjv, data)
    book = sorted((data / "kjv" / "train").glob("*.txt"))[3]
    book.write_bytes(os.urandom(3000) + b"\xff")
    argv = [*TINY_KJV_LM, f"data.data_dir={data}", f"run_root={tmp_path / 'runs'}", "trainer.max_steps=1"]
    refused(capsys, argv, f"kjv/train/{book.name}", "not valid UTF-8", watch=(tmp_path / "runs",))


def test_kjv_with_a_read_only_data_directory_trains_from_the_user_cache(world, capsys, tmp_path, monkeypatch):
    import datamodules.common as common
    import datamodules.kjv as kjv

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "user-cache"))
    inside = lambda p: Path(p).resolve().is_relative_to(world.kjv.resolve())  # noqa: E731
    real = common.is_writable
    monkeypatch.setattr(common, "is_writable", lambda p: not inside(p) and real(p))
    monkeypatch.setattr(kjv, "is_writable", common.is_writable)
    before = snapshot(world.kjv)
    argv = [*TINY_KJV_LM, f"data.data_dir={world.kjv}", f"run_root={tmp_path}", "trainer.max_steps=1",
            "trainer.val_check_interval=100"]  # fmt: skip
    assert entry.main(argv) == 0, capsys.readouterr().err[-3000:]
    assert snapshot(world.kjv) == before
    assert list((tmp_path / "user-cache" / "mega_suite").rglob("meta.json"))


def test_two_runs_started_in_the_same_second_never_share_a_directory(world, tmp_path):
    """The fresh directory is claimed with one mkdir that fails if it exists (it was a check, then a
    create): many claims of the same second's name at once all get their own."""
    from mega_suite.config import load_config
    from mega_suite.storage.runs import claim, training_output

    cfg = load_config([*world.debug, f"run_root={tmp_path}"])
    target, _ = training_output(tmp_path, cfg.recipe, None, None)
    got, barrier = [], threading.Barrier(8)

    def claim_one():
        barrier.wait()
        got.append(claim(target).path)

    threads = [threading.Thread(target=claim_one) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(got)) == 8 and all(p.parent == target.path.parent for p in got)


# ---------------------------------------------------------------------------------------------------------
# The same through real processes (python run.py ...), all at once
# ---------------------------------------------------------------------------------------------------------


def test_the_command_line_itself(world, tmp_path):
    """A few of the cases above, and two runs started together, as real ``python run.py`` processes: exit
    code, one error line, no traceback, nothing written; the two runs get two directories."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", MEGA_MALLOC="system")
    env.pop("MEGA_SUITE_RUN", None)
    rows = _checkpoint_rows(world)
    cases = {
        "devices=0": ([*world.debug, "trainer.devices=0"], "trainer.devices=0"),
        "run_dir=another recipe's run": (rows["run_dir=another recipe's run"][0], "run_dir="),
        "ckpt=truncated": (rows["ckpt=truncated"][0], "truncated"),
        "data_dir=an empty kjv/": (rows["data_dir=an empty kjv/"][0], "King James Bible"),
    }
    together = [*world.debug, f"run_root={tmp_path / 'together'}", "trainer.max_steps=1",
                "trainer.val_check_interval=100"]  # fmt: skip
    before = snapshot(*_watch(world))
    procs = {
        name: subprocess.Popen([sys.executable, str(ROOT / "run.py"), *argv], cwd=ROOT, env=env, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for name, (argv, _) in {**cases, "run 1": (together, ""), "run 2": (together, "")}.items()
    }  # fmt: skip
    results = {name: (*p.communicate(timeout=300), p.returncode) for name, p in procs.items()}
    results = {name: (code, out, err) for name, (out, err, code) in results.items()}
    for name, (_argv, named) in cases.items():
        code, out, err = results[name]
        lines = [line for line in err.splitlines() if line.startswith("error:")]
        assert code == 2 and len(lines) == 1 and named in lines[0], (name, err[-2000:])
        assert "Traceback" not in err + out, name
    assert snapshot(*_watch(world)) == before
    assert results["run 1"][0] == results["run 2"][0] == 0, results["run 1"][2][-2000:]
    assert len(list((tmp_path / "together" / "debug").iterdir())) == 2
