"""LRA datamodules read tiny copies of the published layouts (tests/support/lra_fixtures.py) exactly as docs/data.md#long-range-arena says."""

from __future__ import annotations

import lightning as L
import numpy as np
import pytest
import torch
from lra_fixtures import (
    AAN_DOCS,
    AAN_PAIRS,
    CIFAR_PER_BATCH,
    CIFAR_PLANTED_GRAY,
    IMDB_REVIEWS,
    LISTOPS_ROWS,
    LONG_REVIEW,
    pathfinder_pixels,
)
from torch.utils.data import Dataset

from datamodules import DATAMODULES, build_datamodule
from datamodules.common import PadCollate, ResumableDataLoader, ResumableSampler
from datamodules.lra import LRADataModule, encode_listops


def make(name, data_dir, **kwargs):
    dm = build_datamodule(name, data_dir=str(data_dir), batch_size=kwargs.pop("batch_size", 4), **kwargs)
    dm.prepare_data()
    dm.setup("fit")
    return dm


def check_batch(batch, keys=("",), dtype=torch.int64, multiple=1):
    """Shapes, dtypes, and padding masks that agree with the padding."""
    batch_size = batch["label"].shape[0]
    assert batch["label"].dtype == torch.int64 and batch["label"].shape == (batch_size,)
    for k in keys:
        x, mask = batch[f"input{k}"], batch[f"padding_mask{k}"]
        assert x.dtype == dtype and mask.dtype == torch.bool
        assert x.shape == mask.shape and x.shape[0] == batch_size
        lengths = (~mask).sum(1)
        assert x.shape[1] == -(-lengths.max().item() // multiple) * multiple  # longest item, rounded up
        for row, n in enumerate(lengths.tolist()):
            assert not mask[row, :n].any() and mask[row, n:].all()
            assert (x[row, n:] == 0).all()


def items(dataset):
    return [dataset[i] for i in range(len(dataset))]


def test_registry():
    lra = {"listops", "lra_text", "lra_retrieval", "lra_image", "lra_pathfinder", "lra_pathx"}
    others = {"sc_raw", "imagenet", "wt103", "pg19", "pretrain", "kjv"}
    assert set(DATAMODULES) == lra | others
    with pytest.raises(KeyError, match="'lra_nope'.*listops.*lra_text"):
        build_datamodule("lra_nope", data_dir=".", batch_size=1)


# ---------------------------------------------------------------- ListOps


def test_listops(lra):
    dm = make("listops", lra.data_dir, batch_size=2)
    assert (dm.vocab_size, dm.num_classes, dm.max_length, dm.input_type, dm.is_retrieval) == (
        16,
        10,
        2000,
        "token",
        False,
    )
    for split in ("train", "val", "test"):
        got = items(dm.datasets[split])
        assert [g["label"] for g in got] == [t for _, t in LISTOPS_ROWS[split]]
        assert [g["input"].tolist() for g in got] == [encode_listops(s) for s, _ in LISTOPS_ROWS[split]]
    assert dm.datasets["train"][0]["input"].tolist() == [2, 8, 15, 5]  # [MAX 2 9 ]
    for batch in dm.train_dataloader():
        check_batch(batch)
    short = make("listops", lra.data_dir, max_length=3, pad_to_multiple=8)
    assert short.datasets["train"][0]["input"].tolist() == [2, 8, 15]
    assert short.datasets["train"][2]["input"].shape == (3,)
    batch = next(iter(short.val_dataloader()))
    assert batch["input"].shape == (2, 8)
    check_batch(batch, multiple=8)


def test_listops_generated_when_absent(tmp_path):
    dm = make("listops", tmp_path, generate_sizes=(6, 2, 2))
    assert [len(dm.datasets[s]) for s in ("train", "val", "test")] == [6, 2, 2]
    assert (tmp_path / "listops-1000" / "basic_train.tsv").read_text().startswith("Source\tTarget\n")
    assert all(500 < len(item["input"]) < 2000 for item in items(dm.datasets["train"]))


# ---------------------------------------------------------------- Text (IMDB bytes)


def test_imdb_text(lra):
    dm = make("lra_text", lra.data_dir, batch_size=3)
    assert (dm.vocab_size, dm.num_classes, dm.max_length, dm.input_type) == (257, 2, 4000, "token")
    for split in ("train", "test"):
        # Reader order: neg then pos, files sorted by name.
        expected = sorted((label, name, text) for s, label, name, text in IMDB_REVIEWS if s == split)
        got = items(dm.datasets[split])
        assert [g["label"] for g in got] == [int(label == "pos") for label, _, _ in expected]
        for g, (_, _, text) in zip(got, expected):
            assert g["input"].tolist() == [b + 1 for b in text.encode("utf-8")[:4000]]
    assert dm.datasets["val"] is dm.datasets["test"]  # LRA validates on the test split
    lengths = sorted(len(g["input"]) for g in items(dm.datasets["train"]))
    assert lengths[-1] == 4000 and len(LONG_REVIEW.encode()) > 4000  # cut in bytes, inside a 2-byte char
    for batch in dm.train_dataloader():
        check_batch(batch)
    short = make("lra_text", lra.data_dir, max_length=5)
    assert bytes(b - 1 for b in short.datasets["test"][0]["input"].tolist()) == b"Bad."
    assert max(len(g["input"]) for g in items(short.datasets["train"])) == 5


# ---------------------------------------------------------------- Retrieval (AAN)


def test_aan_retrieval(lra):
    dm = make("lra_retrieval", lra.data_dir, batch_size=3, pad_to_multiple=16)
    assert (dm.vocab_size, dm.num_classes, dm.max_length, dm.is_retrieval) == (257, 2, 4000, True)
    for split, file_split in (("train", "train"), ("val", "eval"), ("test", "test")):
        got = items(dm.datasets[split])
        assert [g["label"] for g in got] == [int(label) for label, _, _ in AAN_PAIRS[file_split]]
        for g, (_, a, b) in zip(got, AAN_PAIRS[file_split]):
            assert g["input1"].tolist() == [c + 1 for c in AAN_DOCS[a].encode()[:4000]]
            assert g["input2"].tolist() == [c + 1 for c in AAN_DOCS[b].encode()[:4000]]
    quote = AAN_DOCS["P01-1001"].index('"')  # quotes are kept literally, not parsed
    assert dm.datasets["train"][0]["input1"][quote].item() == ord('"') + 1
    assert len(dm.datasets["train"].documents) == 4  # each distinct document stored once
    for batch in dm.train_dataloader():
        assert set(batch) == {"input1", "padding_mask1", "input2", "padding_mask2", "label"}
        assert batch["input1"].shape[1] % 16 == 0 and batch["input2"].shape[1] % 16 == 0
        check_batch(batch, keys=("1", "2"), multiple=16)
    short = make("lra_retrieval", lra.data_dir, max_length=7)
    assert short.datasets["test"][0]["input1"].tolist() == [c + 1 for c in b'"Quoted']


def test_aan_rejects_malformed_line(tmp_path):
    (tmp_path / "tsv_data").mkdir()
    for split in ("train", "eval", "test"):
        (tmp_path / "tsv_data" / f"new_aan_pairs.{split}.tsv").write_text("1.0\ta\tb\tonly one text\n")
    with pytest.raises(ValueError, match=r"new_aan_pairs.train.tsv:1: expected 5 tab-separated fields"):
        make("lra_retrieval", tmp_path)


# ---------------------------------------------------------------- Image (CIFAR-10 gray)


def test_cifar10_gray(lra):
    dm = make("lra_image", lra.data_dir, batch_size=4, val_size=6)
    assert (dm.vocab_size, dm.num_classes, dm.max_length, dm.input_type) == (None, 10, 1024, "scalar")
    train, val, test = (items(dm.datasets[s]) for s in ("train", "val", "test"))
    n_train = 5 * CIFAR_PER_BATCH
    assert (len(train), len(val), len(test)) == (n_train - 6, 6, CIFAR_PER_BATCH)

    def image_id(item):  # fixture image k has every pixel = k (gray k), label k % 10
        assert item["input"].shape == (1024,) and item["input"].dtype == torch.float32
        k = round((item["input"][-1].item() * 0.5 + 0.5) * 255)
        assert item["label"] == k % 10
        return k

    train_ids, val_ids = [image_id(i) for i in train], [image_id(i) for i in val]
    assert sorted(train_ids + val_ids) == list(range(n_train))
    # 45k/5k split as torch random_split with seed 42.
    order = torch.randperm(n_train, generator=torch.Generator().manual_seed(42)).tolist()
    assert train_ids == order[: n_train - 6] and val_ids == order[n_train - 6 :]
    # Test image 0, pixel 0: (R, G, B) = (200, 100, 50) -> gray 124 -> (124 / 255 - 0.5) / 0.5.
    assert test[0]["input"][0].item() == pytest.approx((CIFAR_PLANTED_GRAY / 255 - 0.5) / 0.5, abs=1e-6)
    assert test[0]["input"][0].item() == pytest.approx(-0.0274509804, abs=1e-6)
    gray_31 = (31 / 255 - 0.5) / 0.5  # test image 1 is (31, 31, 31) everywhere: weights sum to 1
    assert test[1]["input"][0].item() == pytest.approx(gray_31, abs=1e-6)
    batch = next(iter(dm.train_dataloader()))
    assert batch["input"].shape == (4, 1024) and not batch["padding_mask"].any()
    check_batch(batch, dtype=torch.float32)
    with pytest.raises(ValueError, match="max_length=2048"):
        build_datamodule("lra_image", data_dir=str(lra.data_dir), batch_size=2, max_length=2048)


# ---------------------------------------------------------------- Pathfinder / Path-X


def test_pathfinder_reading_and_split(lra):
    dm = make("lra_pathfinder", lra.data_dir, batch_size=5)
    assert (dm.vocab_size, dm.num_classes, dm.max_length, dm.input_type) == (None, 2, 1024, "scalar")
    whole = dm.datasets["train"].dataset
    # Metadata read by integer stem (0, 1, 10), lines in order; the empty sample_2.png of file 1 skipped.
    assert [(f.decode(), int(y)) for f, y in zip(whole.files, whole.labels)] == lra.pathfinder32
    assert len(whole) == 29 and "imgs/1/sample_2.png" not in [f.decode() for f in whole.files]
    splits = {s: list(dm.datasets[s].indices) for s in ("train", "val", "test")}
    assert [len(splits[s]) for s in ("train", "val", "test")] == [25, 2, 2]  # int(0.1 * 29) = 2
    assert sorted(splits["train"] + splits["val"] + splits["test"]) == list(range(29))
    order = torch.randperm(29, generator=torch.Generator().manual_seed(42)).tolist()
    assert splits["train"] + splits["val"] + splits["test"] == order
    again = make("lra_pathfinder", lra.data_dir, seed=0)  # the training seed does not move the split
    assert {s: list(again.datasets[s].indices) for s in splits} == splits
    # Pixels: row-major flattening of the PNG, normalised to [-1, 1].
    i = splits["val"][0]
    sample_number = i + (i >= 12)  # fixture sample 12 (file 1, sample_2) is the skipped empty file
    expected = torch.from_numpy(pathfinder_pixels(32, sample_number).reshape(-1).astype(np.float32))
    torch.testing.assert_close(dm.datasets["val"][0]["input"], expected / 127.5 - 1)
    batch = next(iter(dm.train_dataloader()))
    assert batch["input"].shape == (5, 1024)
    check_batch(batch, dtype=torch.float32)


def test_pathx(lra):
    dm = make("lra_pathx", lra.data_dir, batch_size=2, pad_to_multiple=4096)
    assert (dm.max_length, dm.num_classes, dm.input_type) == (16384, 2, "scalar")
    whole = dm.datasets["train"].dataset
    assert [(f.decode(), int(y)) for f, y in zip(whole.files, whole.labels)] == lra.pathx
    assert isinstance(whole.files, np.ndarray)  # paths only: images are decoded per item
    item = whole[5]
    torch.testing.assert_close(
        item["input"], torch.from_numpy(pathfinder_pixels(128, 5).reshape(-1).astype(np.float32)) / 127.5 - 1
    )
    batch = next(iter(dm.train_dataloader()))
    assert batch["input"].shape == (2, 16384)
    check_batch(batch, dtype=torch.float32, multiple=4096)


# ---------------------------------------------------------------- Missing data


@pytest.mark.parametrize(
    "name, files, source",
    [
        ("lra_text", "aclImdb/train/neg", "ai.stanford.edu"),
        ("lra_retrieval", "tsv_data/new_aan_pairs.train.tsv", "lra_release.gz"),
        ("lra_image", "cifar-10-batches-py/data_batch_1", "www.cs.toronto.edu/~kriz/cifar.html"),
        ("lra_pathfinder", "pathfinder32/curv_contour_length_14/metadata", "lra_release.gz"),
        ("lra_pathx", "pathfinder128/curv_contour_length_14/metadata", "google-research/long-range-arena"),
    ],
)
def test_missing_data_raises(tmp_path, name, files, source):
    dm = build_datamodule(name, data_dir=str(tmp_path), batch_size=2)
    with pytest.raises(FileNotFoundError) as error:
        dm.setup("fit")
    assert files in str(error.value) and source in str(error.value)


# ---------------------------------------------------------------- Resumable sampling


def test_resumable_sampler_order_and_resume():
    sampler = ResumableSampler(10, seed=3)
    epoch0 = list(sampler)
    assert sorted(epoch0) == list(range(10)) and epoch0 == list(ResumableSampler(10, seed=3))
    sampler.set_epoch(1)
    epoch1 = list(sampler)
    assert epoch1 != epoch0 and epoch1 == ResumableSampler(10, seed=3).indices(1)
    assert ResumableSampler(10, seed=4).indices(0) != epoch0
    assert list(ResumableSampler(5, seed=3, shuffle=False)) == [0, 1, 2, 3, 4]

    it = iter(sampler)
    head = [next(it) for _ in range(4)]
    state = sampler.state_dict()
    assert state == {"epoch": 1, "consumed": 4}
    resumed = ResumableSampler(10, seed=3)
    resumed.load_state_dict(state)
    resumed.set_epoch(1)  # Lightning calls this again after restoring: must keep the offset
    assert head + list(resumed) == epoch1
    assert list(resumed) == epoch1  # the offset is used once
    finished = ResumableSampler(10, seed=3)
    finished.load_state_dict({"epoch": 1, "consumed": 10})  # end of epoch 1 = start of epoch 2
    assert finished.epoch == 2 and list(finished) == finished.indices(2)
    ranks = [ResumableSampler(10, seed=3, num_replicas=3, rank=r).indices(0) for r in range(3)]
    assert all(len(r) == 4 for r in ranks)  # 10 indices padded to 12 by repeating the head
    assert set(sum(ranks, [])) == set(range(10))


def test_length_bucketing_batches_similar_lengths_and_resumes():
    rng = np.random.default_rng(0)
    lengths = rng.integers(500, 2000, size=203)
    sampler = ResumableSampler(203, seed=3, lengths=lengths, batch_size=8, bucket_batches=5)
    order = sampler.indices(0)
    assert sorted(order) == list(range(203))  # a permutation: nothing lost or repeated
    batches = [order[i : i + 8] for i in range(0, 203, 8)]
    assert [len(b) for b in batches] == [8] * 25 + [3]  # full batches first, the partial one last
    padded = sum(len(b) * lengths[b].max() for b in batches)
    unbucketed = ResumableSampler(203, seed=3).indices(0)
    padded_plain = sum(len(b) * lengths[b].max() for b in (unbucketed[i : i + 8] for i in range(0, 203, 8)))
    assert padded < 1.1 * lengths.sum() < 0.8 * padded_plain  # padding nearly vanishes
    # sorted within each window of 5 batches, yet the batch order is shuffled (not globally sorted)
    assert all(np.all(np.diff(lengths[b]) >= 0) for b in batches)
    assert not np.all(np.diff([lengths[b].max() for b in batches[:-1]]) >= 0)
    # the order is a function of (seed, epoch): epochs differ, a resumed sampler continues it
    assert sampler.indices(1) != order
    it = iter(sampler)
    head = [next(it) for _ in range(40)]
    resumed = ResumableSampler(203, seed=3, lengths=lengths, batch_size=8, bucket_batches=5)
    resumed.load_state_dict(sampler.state_dict())
    assert head + list(resumed) == order
    # two ranks of 4: global batch k (8 items, sorted together) is split between the ranks' batch k
    ranks = [
        ResumableSampler(203, seed=3, lengths=lengths, batch_size=4, bucket_batches=5, num_replicas=2, rank=r)
        for r in range(2)
    ]
    a, b = (r.indices(0) for r in ranks)
    assert len(a) == len(b) == 102 and set(a) | set(b) == set(range(203))
    for k in range(25):
        assert set(a[4 * k : 4 * k + 4]) | set(b[4 * k : 4 * k + 4]) == set(order[8 * k : 8 * k + 8])
    with pytest.raises(ValueError, match="needs the item lengths"):
        ResumableSampler(10, seed=0, batch_size=2, bucket_batches=3)
    with pytest.raises(ValueError, match="lengths has 9 entries for a data set of 10"):
        ResumableSampler(10, seed=0, lengths=np.ones(9), batch_size=2, bucket_batches=3)
    with pytest.raises(ValueError, match="bucket_batches must be >= 0.*got -1"):
        ResumableSampler(10, seed=0, lengths=np.ones(10), batch_size=2, bucket_batches=-1)


def test_listops_bucketed_loader(lra):
    dm = make("listops", lra.data_dir, batch_size=2, bucket_batches=2)
    batches = list(dm.train_dataloader())
    labels = sorted(sum((b["label"].tolist() for b in batches), []))
    assert labels == sorted(t for _, t in LISTOPS_ROWS["train"])
    for batch in batches:
        check_batch(batch)


class _Indices(Dataset):
    def __len__(self):
        return 22

    def __getitem__(self, i):
        return {"input": torch.tensor([i, i]), "label": i}


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resumable_loader_counts_yielded_batches(num_workers):
    """Workers prefetch indices ahead; the saved position is what the consumer received."""

    def loader():
        sampler = ResumableSampler(22, seed=5)
        return ResumableDataLoader(_Indices(), 4, sampler, num_workers=num_workers, collate_fn=PadCollate())

    full = [b["label"].tolist() for b in loader()]
    first = loader()
    it = iter(first)
    head = [next(it)["label"].tolist() for _ in range(3)]
    state = first.state_dict()
    assert state == {"epoch": 0, "consumed": 12}
    del it
    second = loader()
    second.load_state_dict(state)
    assert head + [b["label"].tolist() for b in second] == full
    assert second.state_dict() == {"epoch": 0, "consumed": 22}
    dropping = ResumableDataLoader(
        _Indices(), 4, ResumableSampler(22, seed=5), drop_last=True, collate_fn=PadCollate()
    )
    assert len(list(dropping)) == 5 and dropping.state_dict() == {
        "epoch": 0,
        "consumed": 22,
    }  # 2 dropped: done


class _IndexDataModule(LRADataModule):
    num_classes, input_type, default_max_length = 2, "token", 2

    def build_datasets(self):
        return {"train": _Indices(), "val": _Indices(), "test": _Indices()}


class _Recorder(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(()))
        self.seen = []

    def training_step(self, batch, batch_idx):
        self.seen.append(batch["label"].tolist())
        return self.weight * 0.0

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def _fit(max_steps, num_workers, ckpt_dir=None, ckpt_path=None):
    model, dm = _Recorder(), _IndexDataModule(data_dir=".", batch_size=4, seed=9, num_workers=num_workers)
    callbacks = []
    if ckpt_dir is not None:
        callbacks.append(
            L.pytorch.callbacks.ModelCheckpoint(ckpt_dir, "{step}", every_n_train_steps=1, save_top_k=-1)
        )
    trainer = L.Trainer(
        max_steps=max_steps,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=bool(callbacks),
        callbacks=callbacks,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
    )
    trainer.fit(model, dm, ckpt_path=ckpt_path)
    return model.seen


@pytest.mark.filterwarnings("ignore:.*validation_step", "ignore:Be aware that when using `ckpt_path`")
@pytest.mark.parametrize("num_workers", [0, 2])
def test_lightning_resume_continues_the_data_exactly(tmp_path, num_workers):
    """22 items in batches of 4: 6 batches per epoch. Resume mid-epoch and at an epoch's last batch."""
    full = _fit(14, num_workers, ckpt_dir=tmp_path)
    assert len(full) == 14 and sorted(sum(full[:6], [])) == list(range(22))
    for step in (4, 6):
        assert full[:step] + _fit(14, num_workers, ckpt_path=tmp_path / f"step={step}.ckpt") == full, step
