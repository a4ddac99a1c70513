"""Spawned gloo process groups for the multi-rank tests (2-4 CPU processes)."""

from __future__ import annotations

import os
import socket
import sys

import torch.multiprocessing as mp


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
