"""run.py: a user-caused error (ConfigError, DataError, FileNotFoundError) is one line on stderr, exit code 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import run as entry
from datamodules import DataError

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["trainer.max_steps=2", "trainer.progress_bar=false", "data.batch_size=4", "data.max_length=64"]


def _broken_listops(monkeypatch, where: str):
    """The ListOps data module raising a DataError from ``where`` (prepare_data runs before Lightning's fit,
    setup and the loaders inside it)."""
    from datamodules import DATAMODULES

    cls = DATAMODULES["listops"]

    def fail(self, *args, **kwargs):
        raise DataError("data/listops/basic_train.tsv: line 3 has 1 column, expected 2 (Source, Target)")

    monkeypatch.setattr(cls, where, fail)


@pytest.mark.parametrize("where", ["prepare_data", "setup", "train_dataloader"])
def test_data_error_is_one_clean_line(where, monkeypatch, tmp_path, capsys):
    _broken_listops(monkeypatch, where)
    code = entry.main(["recipe=debug", f"data.data_dir={tmp_path / 'd'}", f"run_root={tmp_path}", *SMALL])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("expected 2 (Source, Target)") == 1, err
    assert err.strip().splitlines()[-1] == (
        "error: data/listops/basic_train.tsv: line 3 has 1 column, expected 2 (Source, Target)"
    )
    assert "Traceback" not in err


def test_an_error_from_a_dataloader_worker_keeps_only_its_message():
    from torch._utils import ExceptionWrapper

    try:
        raise DataError("img/3.png: cannot be decoded,\nexpected a PNG")
    except DataError:
        wrapped = ExceptionWrapper(where="in DataLoader worker process 0")
    with pytest.raises(DataError) as info:
        wrapped.reraise()
    assert "Original Traceback" in str(info.value)
    assert entry.one_line(info.value) == "img/3.png: cannot be decoded, expected a PNG"


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "run.py"), *args], cwd=ROOT, capture_output=True, text=True, timeout=300
    )


@pytest.mark.slow
def test_subprocess_missing_data_exits_2_without_traceback(tmp_path):
    out = _run("recipe=lra_text", f"data.data_dir={tmp_path / 'nothing'}", f"run_root={tmp_path}", *SMALL)
    assert out.returncode == 2, out.stderr[-2000:]
    lines = out.stderr.strip().splitlines()
    assert lines[-1].startswith("error: ") and "aclImdb" in lines[-1], out.stderr[-2000:]
    assert "Traceback" not in out.stderr


def test_config_error_is_one_line_and_writes_nothing(tmp_path, capsys):
    assert entry.main(["recipe=debug", "data.options.bucket_batchez=1", f"run_root={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1].startswith("error: data.options ['bucket_batchez']"), err
    assert "Traceback" not in err
    assert not list(tmp_path.iterdir()), "a config error writes no run directory"


@pytest.mark.parametrize("rank", [0, 1])
def test_the_summary_line_is_rank_zeros_alone(rank, monkeypatch, tmp_path, capsys):
    """Every rank of a multi-process run returns from ``run``; only global rank 0 prints the final summary,
    in one write. Both used to print it into the shared pipe, and the two lines interleaved into one
    (``done: {...}{...}``, a 2-rank FSDP2 test run failed parsing it)."""
    from lightning.pytorch.utilities import rank_zero_only

    import mega_suite.training.runner

    monkeypatch.setattr(
        mega_suite.training.runner, "run", lambda cfg: {"test/loss": 1.5, "run_dir": "runs/x"}
    )
    monkeypatch.setattr(rank_zero_only, "rank", rank)
    assert entry.main(["recipe=debug", f"run_root={tmp_path}"]) == 0
    out = capsys.readouterr().out
    want = "[mega-suite] done: test/loss 1.5 (in runs/x)\n"
    assert out == (want if rank == 0 else ""), out
