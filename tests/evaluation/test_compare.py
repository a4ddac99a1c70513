"""mega_suite.evaluation.compare on run directories written like the runner's: SummaryWriter events + config.yaml."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import yaml
from torch.utils.tensorboard import SummaryWriter

from mega_suite.cli import main as cli
from mega_suite.evaluation.compare import CompareError, compare


def main(argv):  # mega-suite compare ...
    return cli(["compare", *argv])


TRAIN = {0: 8.0, 1: 7.0, 2: 6.5, 3: 6.0, 4: 5.5}  # step -> train/loss of seed 1; seed 2 adds `shift`
VAL = {2: 6.8, 4: 6.9}  # val/loss; the best is at step 2
TEST = {2: 7.1, 4: 7.3}
WALL = 125.0  # seconds from the writer's creation to the last event


def write_run(root: Path, name: str, seed: int, shift: float = 0.0, lr: float = 1e-3, counter=False) -> Path:
    run = root / "kjv" / name
    run.mkdir(parents=True)
    config = {
        "recipe": "kjv",
        "task": "lm",
        "seed": seed,
        "run_dir": str(run),
        "data": {"name": "kjv", "batch_size": 2, "options": {"seq_len": 16}},
        "optim": {"lr": lr},
        "trainer": {"accumulate_grad_batches": 3, "devices": 1, "num_nodes": 1, "global_batch_tokens": 0},
    }
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    writer = SummaryWriter(str(run))
    t0 = time.time()
    for step, loss in TRAIN.items():
        writer.add_scalar("train/loss", loss + shift, step, walltime=t0 + step)
        if counter:
            writer.add_scalar("train/tokens_seen", 1000 * step, step, walltime=t0 + step)
        else:
            writer.add_scalar("train/device/items_per_sec", 100.0 * step, step, walltime=t0 + step)
    for step in VAL:
        writer.add_scalar("val/loss", VAL[step] + shift, step, walltime=t0 + 10 * step)
        writer.add_scalar("test/loss", TEST[step] + shift, step, walltime=t0 + 10 * step)
    writer.add_scalar("val/ppl", 900.0 + shift, 4, walltime=t0 + WALL)
    writer.close()
    return run


def rows(markdown: str) -> dict[str, dict[str, str]]:
    lines = [line for line in markdown.splitlines() if line.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    out = {}
    for line in lines[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        out[cells[0]] = dict(zip(header, cells))
    return out


def test_table_and_plot(tmp_path):
    a = write_run(tmp_path, "a", seed=1)
    c = write_run(tmp_path, "c", seed=1, counter=True)
    md, png = compare([a, c], tmp_path / "out")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = md.read_text()
    row = rows(text)["kjv/a"]
    assert row["steps"] == "5"  # metrics logged at step 4 are those of batch 4: 5 steps done
    assert row["tokens"] == "480"  # 5 steps x (batch 2 x seq_len 16 x accumulate 3)
    assert row["wall time"] == "2m05s"
    assert row["train/loss final"] == "5.5"
    assert row["train tokens/s"] == "200"  # median of the throughput logged at steps 0..4
    assert rows(text)["kjv/c"]["train tokens/s"] == ""  # not logged
    assert row["val/loss best"] == "6.8 (after 3 steps)" and row["val/loss final"] == "6.9"
    assert row["test/loss @ best val"] == "7.1"
    assert row["val/ppl best"] == "900 (after 5 steps)"
    assert (
        "96 tokens/step = batch 2 x tokens per sequence 16 x accumulate 3 x devices 1 x nodes 1 (config.yaml)"
        in text
    )
    assert rows(text)["kjv/c"]["tokens"] == "4,000"  # the logged counter at step 4, not the config
    assert "kjv/c: tokens from the logged counter train/tokens_seen" in text


def test_group_by_seed_mean_and_range(tmp_path):
    runs = [
        write_run(tmp_path, "s1", seed=1),
        write_run(tmp_path, "s2", seed=2, shift=1.0),
        write_run(tmp_path, "other", seed=1, lr=5e-4),  # another experiment: its own row
    ]
    md, png = compare(runs, tmp_path, group_seeds=True)
    table = rows(md.read_text())
    assert set(table) == {
        "kjv optim.lr=0.001 (seeds 1,2)",
        "kjv/other optim.lr=0.0005",
    }  # named by what sets it apart
    group = table["kjv optim.lr=0.001 (seeds 1,2)"]
    assert group["seed"] == "1,2"
    assert group["train/loss final"] == "6 [5.5, 6.5]"
    assert group["val/loss best"] == "7.3 [6.8, 7.8]"
    assert group["tokens"] == "480"
    assert png.is_file()


def test_errors_name_the_path(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CompareError, match=f"{empty}: no TensorBoard event files"):
        compare([empty], tmp_path)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "events.out.tfevents.1.host.0").write_bytes(b"not an event file" * 10)
    with pytest.raises(CompareError, match="events.out.tfevents.1.host.0: unreadable"):
        compare([bad], tmp_path)
    assert main([str(tmp_path / "missing"), "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and str(tmp_path / "missing") in err
    run = write_run(tmp_path, "noconfig", seed=1)
    (run / "config.yaml").unlink()
    with pytest.raises(CompareError, match="no config.yaml"):
        compare([run], tmp_path)


def test_seed_groups_are_labelled_by_what_differs(tmp_path):
    # Two experiments of one recipe (e.g. model.arch=megalodon vs llama): their rows and curves must not
    # both read "kjv (seeds 1,2)".
    runs = [
        write_run(tmp_path, "a1", seed=1),
        write_run(tmp_path, "a2", seed=2),
        write_run(tmp_path, "b1", seed=1, lr=5e-4),
        write_run(tmp_path, "b2", seed=2, lr=5e-4),
    ]
    md, _ = compare(runs, tmp_path, group_seeds=True)
    assert set(rows(md.read_text())) == {"kjv optim.lr=0.001 (seeds 1,2)", "kjv optim.lr=0.0005 (seeds 1,2)"}
    md, _ = compare([runs[0], runs[2]], tmp_path, overwrite=True)  # single runs too (over the report)
    assert set(rows(md.read_text())) == {"kjv/a1 optim.lr=0.001", "kjv/b1 optim.lr=0.0005"}
