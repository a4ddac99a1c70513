"""Shared pytest fixtures."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
from lra_fixtures import write_aan, write_aclimdb, write_cifar10, write_listops, write_pathfinder

# Without a GPU, Triton kernels run under the interpreter (set before triton is first imported).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Test shapes are tiny: one thread avoids OpenMP start-up and contention costs that dominate them.
torch.set_num_threads(1)

PATHFINDER_EMPTY = (1, 2)  # metadata file 1, sample_2.png is a 0-byte file, as sample_172.png in the release


@pytest.fixture(scope="session")
def lra(tmp_path_factory):
    """Long Range Arena: one ``data_dir`` with tiny copies of every published layout, written once.

    Attributes: ``data_dir``; ``pathfinder32`` / ``pathx``: (relative path, label) of the non-empty images
    in reading order.
    """
    root = tmp_path_factory.mktemp("lra")
    write_listops(root)
    write_aclimdb(root)
    write_aan(root)
    write_cifar10(root)
    return SimpleNamespace(
        data_dir=root,
        pathfinder32=write_pathfinder(root, 32, per_file=10, n_files=3, empty=PATHFINDER_EMPTY),
        pathx=write_pathfinder(root, 128, per_file=4, n_files=2),
    )
