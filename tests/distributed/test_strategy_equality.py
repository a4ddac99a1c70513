"""One seed, one run, whatever the strategy (issue 32): the same configuration trained on one process, under DDP,
under FSDP2 (meta-device initialisation, sharded) and with chunk parallelism (2 ranks each holding half of every
sequence) starts from bit-identical weights and logs the same training losses: the step-0 loss (before any
update) equal to float32 rounding, three steps within 1e-5. Checked end to end through the runner on two real
texts: the committed King James Bible and a generated corpus in the PG-19 layout.

The multi-rank runs are two spawned gloo processes that each call the runner, with the environment Lightning
reads from an external launcher (``LOCAL_RANK``, ``WORLD_SIZE``, ...): nothing re-runs the test command. The
earlier chunk-parallel run test passed while a user's run differed because its single-process baseline also
ran ``trainer.strategy=fsdp`` (the meta-device initialisation) rather than what a user runs on one device.
"""

from __future__ import annotations

import os
from pathlib import Path

import lightning as L
import pytest
import torch
from modality_fixtures import write_pg19
from spawn_support import TINY_KJV_LM, free_port, spawn

STEPS = 3
MODEL = [
    "model.num_layers=2", "model.model_dim=16", "model.z_dim=8", "model.value_dim=16", "model.ffn_hidden_dim=16",
    "model.cema_ndim=2", "model.norm_num_groups=4", "model.chunk_size=32", "model.dropout=0.0",
]  # fmt: skip
COMMON = [
    "seed=7", "data.options.seq_len=64", f"trainer.max_steps={STEPS}", "trainer.val_check_interval=1000",
    "trainer.progress_bar=false", "trainer.log_every_n_steps=1", "trainer.accelerator=cpu", "optim.warmup_steps=2",
]  # fmt: skip
CORPORA = {
    "kjv": [*TINY_KJV_LM, *MODEL, *COMMON],
    "pg19": ["recipe=pg19_small", *MODEL, *COMMON, "data.options.vocab_size=400"],
}
GLOBAL_BATCH = 4
# name -> overrides; every strategy sees a global batch of GLOBAL_BATCH sequences
STRATEGIES = {
    "ddp": ["trainer.devices=2", "trainer.strategy=ddp", f"data.batch_size={GLOBAL_BATCH // 2}"],
    "fsdp": ["trainer.devices=2", "trainer.strategy=fsdp", f"data.batch_size={GLOBAL_BATCH // 2}"],
    "chunk_parallel": [
        "trainer.devices=2", "trainer.strategy=fsdp", "trainer.chunk_parallel=2", f"data.batch_size={GLOBAL_BATCH}",
    ],
}  # fmt: skip
SINGLE = ["trainer.devices=1", "trainer.strategy=auto", f"data.batch_size={GLOBAL_BATCH}"]


class Record(L.Callback):
    """Rank 0 writes the initial weights (full tensors, gathered from the shards) and every logged training
    loss (the mean over the global batch) to ``path``."""

    def __init__(self, path: Path):
        self.path, self.losses, self.initial = Path(path), [], None

    def on_train_start(self, trainer, pl_module) -> None:
        state = {}
        for name, tensor in pl_module.model.state_dict().items():
            full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor  # every rank gathers
            state[name] = full.detach().cpu().clone()
        self.initial = state

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(trainer.callback_metrics["train/loss"]))

    def on_train_end(self, trainer, pl_module) -> None:
        if trainer.is_global_zero:
            torch.save({"initial": self.initial, "losses": self.losses}, self.path)


def _run(argv: list[str], out: Path) -> None:
    from mega_suite.config import load_config
    from mega_suite.training.runner import run

    run(load_config(argv), extra_callbacks=[Record(out)])


def _ranks(rank: int, port: int, jobs: list[tuple[list[str], str, str]]) -> None:
    """One rank of every multi-rank job in turn (one process group for all of them)."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", NODE_RANK="0", LOCAL_RANK=str(rank),
        RANK=str(rank), OMP_NUM_THREADS="1",
    )  # fmt: skip
    torch.set_num_threads(1)
    for argv, run_dir, out in jobs:
        # rank 0 resolves the run directory; the others take it from it, as under Lightning's own launcher
        if rank == 0:
            os.environ.pop("MEGA_SUITE_RUN", None)
        else:
            os.environ["MEGA_SUITE_RUN"] = f"{run_dir}{os.pathsep}"
        _run([*argv, f"run_dir={run_dir}"], Path(out))


@pytest.fixture(scope="module")
def corpora(tmp_path_factory) -> dict[str, Path]:
    """``data.data_dir`` of each corpus: KJV unpacked from the committed archive, and a PG-19-layout corpus."""
    kjv = tmp_path_factory.mktemp("kjv")
    pg19 = tmp_path_factory.mktemp("pg19")
    write_pg19(pg19, {"train": 6, "validation": 1, "test": 1})
    return {"kjv": kjv, "pg19": pg19}


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_one_seed_gives_one_run_under_every_strategy(corpora, tmp_path):
    results, jobs = {}, []
    for corpus, base in CORPORA.items():
        argv = [*base, f"data.data_dir={corpora[corpus]}"]
        # one process first: it also prepares the data (tokenizer, token files) that the ranks then read
        single = tmp_path / f"{corpus}-single.pt"
        _run([*argv, *SINGLE, f"run_dir={tmp_path / corpus / 'single'}"], single)
        results[corpus, "single"] = single
        for name, overrides in STRATEGIES.items():
            out = tmp_path / f"{corpus}-{name}.pt"
            jobs.append(([*argv, *overrides], str(tmp_path / corpus / name), str(out)))
            results[corpus, name] = out
    spawn(_ranks, 2, free_port(), jobs)

    report, problems = [], []
    for corpus in CORPORA:
        ref = torch.load(results[corpus, "single"], weights_only=True)
        assert len(ref["losses"]) == STEPS
        report.append(f"{corpus} single: {ref['losses']}")
        for name in STRATEGIES:
            got = torch.load(results[corpus, name], weights_only=True)
            differ = [k for k, v in ref["initial"].items() if not torch.equal(got["initial"].get(k), v)]
            report.append(f"{corpus} {name}: {got['losses']}; initial tensors differing: {len(differ)}")
            if set(got["initial"]) != set(ref["initial"]) or differ:
                problems.append(f"{corpus} {name}: initial weights differ in {differ[:4]}")
            if got["losses"][0] != pytest.approx(ref["losses"][0], rel=5e-7, abs=0):  # a few float32 ulps
                problems.append(f"{corpus} {name}: step-0 loss {got['losses'][0]} vs {ref['losses'][0]}")
            if got["losses"] != pytest.approx(ref["losses"], rel=1e-5, abs=0):
                problems.append(f"{corpus} {name}: losses {got['losses']} vs {ref['losses']}")
    print("\n".join(report))
    assert not problems, "\n".join(problems + report)
