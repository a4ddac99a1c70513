"""Spawned gloo process groups for the multi-rank tests (2-4 CPU processes)."""

from __future__ import annotations

import os
import socket
import sys

import torch.multiprocessing as mp

# The run.py overrides of the multi-process run tests: a 2-layer, width-16 Megalodon on the committed KJV
# corpus, 64-token training sequences, logging every step.
TINY_KJV_LM = [
    "recipe=kjv", "model.num_layers=2", "model.model_dim=16", "model.z_dim=8", "model.value_dim=16",
    "model.ffn_hidden_dim=16", "model.cema_ndim=2", "model.norm_num_groups=4", "model.chunk_size=32",
    "data.batch_size=2", "data.options.seq_len=64", "optim.warmup_steps=2", "trainer.progress_bar=false",
    "trainer.log_every_n_steps=1", "trainer.accelerator=cpu",
]  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_then_exit(rank: int, fn, args: tuple) -> None:
    fn(rank, *args)
    # A worker that finished (and destroyed its process group) leaves at once: gloo's background threads
    # can otherwise abort the interpreter's teardown ("terminate called without an active exception",
    # SIGABRT), failing a test whose work succeeded.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(fn, nprocs: int, *args) -> None:
    """``fn(rank, *args)`` in ``nprocs`` spawned processes; raises if any of them fails."""
    mp.spawn(_run_then_exit, args=(fn, args), nprocs=nprocs, join=True)
