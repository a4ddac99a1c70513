"""Every classification data module: splits independent of the training seed, exact mid-epoch resume, and
bad data reported at set-up as a ``DataError`` naming the file or key (on tiny copies of the real layouts)."""

from __future__ import annotations

import logging
import os
import random
import stat
from pathlib import Path

import numpy as np
import pytest
import soundfile
import torch
from lra_fixtures import write_aan, write_aclimdb, write_cifar10, write_listops, write_pathfinder
from modality_fixtures import write_image_folder, write_speech_commands
from torch.utils.data import Subset

from datamodules import DataError, build_datamodule

# name -> (sub-folder of the shared data root, options for tiny fixtures)
MODULES = {
    "listops": ("", {}),
    "lra_text": ("", {}),
    "lra_retrieval": ("", {}),
    "lra_image": ("", {"val_size": 6}),
    "lra_pathfinder": ("", {}),
    "lra_pathx": ("", {}),
    "sc_raw": ("", {}),
    "imagenet": ("imagenet", {"num_classes": 3, "image_size": 32, "num_workers": 0, "repeated_aug": 3}),
}


def write_all(root: Path, names=tuple(MODULES)) -> Path:
    """The layouts of ``names`` under ``root`` (each only as big as these tests need)."""
    writers = {
        "listops": lambda: write_listops(root),
        "lra_text": lambda: write_aclimdb(root),
        "lra_retrieval": lambda: write_aan(root),
        "lra_image": lambda: write_cifar10(root),
        "lra_pathfinder": lambda: write_pathfinder(root, 32, per_file=10, n_files=3, empty=(1, 2)),
        "lra_pathx": lambda: write_pathfinder(root, 128, per_file=5, n_files=2),
        "sc_raw": lambda: write_speech_commands(root),
        "imagenet": lambda: write_image_folder(
            root / "imagenet", classes=3, train_per_class=4, val_per_class=2
        ),
    }
    for name in names:
        writers[name]()
    return root


def build(name: str, root: Path, seed: int = 0, batch_size: int = 4, **overrides):
    folder, options = MODULES[name]
    dm = build_datamodule(
        name, data_dir=str(root / folder), batch_size=batch_size, seed=seed, **{**options, **overrides}
    )
    dm.prepare_data()
    dm.setup("fit")
    return dm


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return write_all(tmp_path_factory.mktemp("cls"))


def split_identity(dataset) -> list:
    """What a split holds, in order: file/row identity where items are random (ImageNet), items otherwise."""
    if hasattr(dataset, "samples"):  # ImageFolder: paths and labels; training items are augmented
        return list(dataset.samples)
    if hasattr(dataset, "rows"):  # Speech Commands: cached clip rows
        return dataset.rows.tolist()
    if isinstance(dataset, Subset):
        return [split_identity(dataset.dataset), list(dataset.indices)]
    return [
        {k: v.tolist() if torch.is_tensor(v) else v for k, v in dataset[i].items()}
        for i in range(len(dataset))
    ]


# ---------------------------------------------------------------------------------- splits vs. seed
@pytest.mark.parametrize("name", list(MODULES))
def test_training_seed_does_not_move_any_split(root, name):
    a, b = build(name, root, seed=1), build(name, root, seed=2)
    for split in ("train", "val", "test"):
        if split in a.datasets:
            assert split_identity(a.datasets[split]) == split_identity(b.datasets[split]), split


def test_speech_split_seed_defaults_to_s4_and_moves_the_split(root):
    default = build("sc_raw", root)
    assert default.split_seed == 0  # S4's split_data: random_state=0, then random_state=1
    other = build("sc_raw", root, split_seed=5)
    assert not np.array_equal(default.datasets["test"].rows, other.datasets["test"].rows)


# ---------------------------------------------------------------------------------- exact resume
def batch_identity(batch: dict) -> list:
    return [
        (k, v.numpy().tobytes() if torch.is_tensor(v) else v)
        for k, v in sorted(batch.items())
        if v is not None
    ]


def _scramble_global_rngs(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


@pytest.mark.parametrize("name", list(MODULES))
def test_mid_epoch_resume_continues_the_same_batches(root, name):
    """k batches, the loader's state, a fresh data module restored from it: the rest of the epoch and the
    next epoch equal the uninterrupted run's (ImageNet: the augmented pixels and mixup too)."""

    def epochs(loader, dm, count: int, start_epoch: int = 0) -> list:
        out = []
        for epoch in range(start_epoch, start_epoch + count):
            loader.sampler.set_epoch(epoch)
            out += [batch_identity(mixed(dm, b)) for b in loader]
        return out

    def mixed(dm, batch):
        if getattr(dm, "mixup_fn", None) is None:
            return batch
        dm.trainer = type("T", (), {"training": True})()
        return dm.on_after_batch_transfer(batch, 0)

    batch_size = 2 if name in ("listops", "lra_text", "lra_retrieval", "lra_pathx") else 4
    _scramble_global_rngs(1)
    dm = build(name, root, seed=7, batch_size=batch_size)
    full = epochs(dm.train_dataloader(), dm, 2)
    n_epoch = len(dm.train_dataloader())
    assert n_epoch >= 2 and len(full) == 2 * n_epoch
    for k in (1, n_epoch - 1):
        _scramble_global_rngs(2)  # a resumed process starts with other global RNG states
        first = build(name, root, seed=7, batch_size=batch_size)
        loader = first.train_dataloader()
        loader.sampler.set_epoch(0)
        it = iter(loader)
        head = [batch_identity(mixed(first, next(it))) for _ in range(k)]
        state = loader.state_dict()
        del it
        _scramble_global_rngs(3)
        workers = {"num_workers": 2} if name == "imagenet" else {}  # per-item seeds: workers do not matter
        fresh = build(name, root, seed=7, batch_size=batch_size, **workers)
        resumed = fresh.train_dataloader()
        resumed.load_state_dict(state)
        resumed.sampler.set_epoch(0)  # Lightning calls it again after restoring
        rest = [batch_identity(mixed(fresh, b)) for b in resumed]
        assert head + rest == full[:n_epoch], k
        assert epochs(resumed, fresh, 1, start_epoch=1) == full[n_epoch:]


# ---------------------------------------------------------------------------------- bad data
def _corrupt(path: Path, data: bytes = b"\x00garbage\xff not what it claims") -> Path:
    path.write_bytes(data)
    return path


BAD_ITEMS = {
    # name: (what to break, returns the file/key that the message must name, extra match)
    "listops": [
        (
            lambda r: _corrupt(r / "listops-1000/basic_val.tsv", b"Source\tTarget\r\n( [MAX 2 9 ] )\r\n"),
            ":2:",
        ),
        (lambda r: _corrupt(r / "listops-1000/basic_test.tsv", b""), "empty"),
        (
            lambda r: _corrupt(r / "listops-1000/basic_train.tsv", b"Source\tTarget\n( [MAX 2 \xff ] )\t9\n"),
            "UTF-8",
        ),
    ],
    "lra_text": [(lambda r: _corrupt(r / "aclImdb/train/pos/0_9.txt", b""), "empty")],
    "lra_retrieval": [
        (lambda r: _corrupt(r / "tsv_data/new_aan_pairs.eval.tsv", b"1.0\ta\tb\tone text\n"), "5 tab"),
        (lambda r: _corrupt(r / "tsv_data/new_aan_pairs.test.tsv", b""), "empty"),
    ],
    "lra_image": [(lambda r: _corrupt(r / "cifar-10-batches-py/data_batch_3"), "CIFAR-10")],
    "lra_pathfinder": [
        (lambda r: _corrupt(r / "pathfinder32/curv_contour_length_14/imgs/0/sample_3.png"), "image"),
        (
            lambda r: _corrupt(
                r / "pathfinder32/curv_contour_length_14/metadata/1.npy", b"imgs/1 sample_0.png\n"
            ),
            ":1:",
        ),
    ],
    "lra_pathx": [
        (lambda r: _corrupt(r / "pathfinder128/curv_contour_length_14/imgs/10/sample_1.png"), "image")
    ],
    "sc_raw": [
        (lambda r: _wav(r, "yes", rate=8000), "16 kHz mono"),
        (lambda r: _wav(r, "no", channels=2), "16 kHz mono"),
        (lambda r: _corrupt(next((r / "speech_commands_v0.02/up").glob("*_nohash_0.wav"))), "WAV"),
    ],
    "imagenet": [
        (lambda r: _corrupt(next((r / "imagenet/train/n00000001").glob("*.JPEG"))), "image"),
        (lambda r: _corrupt(next((r / "imagenet/val/n00000002").glob("*.JPEG")), b""), "empty"),
    ],
}


def _wav(root: Path, word: str, rate: int = 16000, channels: int = 1) -> Path:
    path = root / "speech_commands_v0.02" / word / "badbad00_nohash_0.wav"
    samples = np.zeros((rate, channels) if channels > 1 else rate, np.int16)
    soundfile.write(path, samples, rate, subtype="PCM_16")
    return path


@pytest.mark.parametrize(
    "name, case", [(name, i) for name, cases in BAD_ITEMS.items() for i in range(len(cases))]
)
def test_bad_item_is_a_data_error_naming_the_file(tmp_path, name, case):
    root = write_all(tmp_path, [name])
    broken, what = BAD_ITEMS[name][case]
    path = broken(root)
    with pytest.raises(DataError) as error:
        build(name, root)  # set-up, before any training step
    message = str(error.value)
    assert str(path) in message and what in message, message


def test_data_errors_that_name_a_configuration_key(tmp_path):
    root = write_all(tmp_path, ["imagenet", "lra_image"])
    with pytest.raises(DataError, match=r"3 class folders.*data\.options\.num_classes.*1000"):
        build("imagenet", root, num_classes=1000)
    with pytest.raises(DataError, match=r"data\.options\.val_size=30.*1 and 29"):
        build("lra_image", root, val_size=30)


def test_published_skips_are_counted_in_the_log(root, caplog):
    caplog.set_level(logging.INFO, logger="datamodules")
    build("sc_raw", root, cache_dir=str(root / "fresh_sc_cache"))
    assert any("skipped 20 clips" in r.getMessage() and "16000" in r.getMessage() for r in caplog.records)
    build("lra_pathfinder", root)
    assert any("skipped 1 empty image" in r.getMessage() for r in caplog.records)


# ---------------------------------------------------------------------------------- read-only data
def _listing(root: Path) -> dict[str, tuple[int, int]]:
    return {
        str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(root.rglob("*"))
    }


@pytest.mark.parametrize("name", list(MODULES))
def test_read_only_data_dir_puts_caches_elsewhere(tmp_path, monkeypatch, name, caplog):
    import datamodules.common as common

    caplog.set_level(logging.INFO, logger="datamodules")
    data = write_all(tmp_path / "data", [name])
    if name == "listops":  # absent files are generated: into the cache when data_dir is read-only
        for f in (data / "listops-1000").iterdir():
            f.unlink()
        (data / "listops-1000").rmdir()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "user_cache"))
    before = _listing(data)
    modes = {p: p.stat().st_mode for p in [data, *data.rglob("*")] if p.is_dir()}
    for p in modes:
        p.chmod(stat.S_IMODE(modes[p]) & ~0o222)
    try:
        if os.access(data, os.W_OK):  # root ignores permission bits: make the check see what a mount says
            real = common.is_writable
            monkeypatch.setattr(
                common, "is_writable", lambda p: not Path(p).resolve().is_relative_to(data) and real(p)
            )
        overrides = {"generate_sizes": (3, 1, 1)} if name == "listops" else {}
        dm = build(name, data, **overrides)
        assert len(dm.datasets["train"]) > 0
    finally:
        for p, mode in modes.items():
            p.chmod(mode)
    assert _listing(data) == before  # nothing written into the data set
    if name in ("listops", "sc_raw", "lra_pathfinder", "lra_pathx", "imagenet"):  # modules with a cache
        cache = tmp_path / "user_cache" / "mega_suite"
        assert any(cache.rglob("*")), "the cache should be under $XDG_CACHE_HOME/mega_suite"
        assert any(str(cache) in r.getMessage() for r in caplog.records)


def test_cache_dir_helper(tmp_path, monkeypatch):
    from datamodules.common import cache_dir_for

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    data = tmp_path / "data"
    data.mkdir()
    assert cache_dir_for(data, "x") == data / "cache" / "x"
    assert cache_dir_for(data, "x", tmp_path / "given") == tmp_path / "given"
    import datamodules.common as common

    monkeypatch.setattr(common, "is_writable", lambda p: False)
    elsewhere = cache_dir_for(data, "x")
    assert elsewhere.parent.parent == tmp_path / "xdg" / "mega_suite" and elsewhere.name == "x"
    assert cache_dir_for(tmp_path / "data" / ".." / "data", "x") == elsewhere  # keyed by the resolved path
    assert cache_dir_for(tmp_path, "x") != elsewhere
