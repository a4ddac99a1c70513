"""Datamodules of the non-LRA data sets, on tiny copies of their real on-disk layouts."""

from __future__ import annotations

import os
from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from modality_fixtures import (
    SC10,
    train_hf_tokenizer,
    train_sentencepiece,
    write_image_folder,
    write_jsonl_corpus,
    write_pg19,
    write_speech_commands,
    write_wikitext,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _fail(*args, **kwargs):
    raise AssertionError("the cache should have been reused")


# ---------------------------------------------------------------------------------------------- speech
@pytest.fixture(scope="module")
def speech(tmp_path_factory):
    from datamodules.speech import SpeechCommandsDataModule

    data_dir = tmp_path_factory.mktemp("sc")
    clips = write_speech_commands(data_dir)
    dm = SpeechCommandsDataModule(str(data_dir), batch_size=8, seed=3)
    dm.prepare_data()
    dm.setup("fit")
    return dm, clips


def test_speech_split_is_stratified_70_15_15(speech):
    dm, clips = speech
    labels = dm.datasets["train"].labels
    assert len(labels) == len(clips["full"])  # the short clips and non-SC10 words are gone
    rows = {name: ds.rows for name, ds in dm.datasets.items()}
    union = np.concatenate(list(rows.values()))
    assert len(union) == len(set(union.tolist())) == len(labels)
    for c in range(len(SC10)):
        n = 10 + c
        held = round(0.3 * n)
        assert (labels[rows["train"]] == c).sum() == n - held
        assert (labels[rows["val"]] == c).sum() == held - round(0.5 * held)
        assert (labels[rows["test"]] == c).sum() == round(0.5 * held)


def test_speech_batches_and_decoding(speech):
    dm, clips = speech
    batch = next(iter(dm.train_dataloader()))
    assert batch["input"].shape == (8, 16000) and batch["input"].dtype == torch.float32
    assert batch["padding_mask"].shape == (8, 16000) and batch["padding_mask"].dtype == torch.bool
    assert not batch["padding_mask"].any()
    assert batch["label"].shape == (8,) and batch["label"].dtype == torch.int64
    # The cache holds each kept file's samples, labelled by its word folder.
    files = (dm.cache_dir / "files.txt").read_text().split()
    assert sorted(files) == sorted(clips["full"])
    waves = np.load(dm.cache_dir / "waveforms.npy", mmap_mode="r")
    labels = np.load(dm.cache_dir / "labels.npy")
    for i in (0, len(files) // 2, len(files) - 1):
        np.testing.assert_array_equal(waves[i], clips["full"][files[i]])
        assert SC10[labels[i]] == files[i].split("/")[0]


def test_speech_normalisation_uses_training_statistics(speech):
    dm, clips = speech
    waves = np.load(dm.cache_dir / "waveforms.npy").astype(np.float64) / 2**15
    train = waves[dm.datasets["train"].rows]
    assert dm.mean == pytest.approx(train.mean(), abs=1e-9)
    assert dm.std == pytest.approx(train.std(ddof=1), rel=1e-9)
    assert abs(dm.mean - waves.mean()) > 1e-5  # the fixture's offsets make the choice visible
    ds = dm.datasets["val"]
    row = ds.rows[1]
    expected = (waves[row] - train.mean()) / (train.std(ddof=1) + 1e-5)
    np.testing.assert_allclose(ds[1]["input"].numpy(), expected, rtol=1e-5, atol=1e-5)
    x = torch.stack([dm.datasets["train"][i]["input"] for i in range(len(dm.datasets["train"]))]).double()
    assert x.mean().item() == pytest.approx(0.0, abs=1e-5) and x.std().item() == pytest.approx(1.0, abs=1e-3)


def test_speech_cache_is_reused(speech, monkeypatch):
    import soundfile

    from datamodules.speech import SpeechCommandsDataModule

    dm, _ = speech
    monkeypatch.setattr(soundfile, "read", _fail)
    monkeypatch.setattr(soundfile, "info", _fail)
    again = SpeechCommandsDataModule(str(dm.data_dir), batch_size=8, seed=3)
    again.prepare_data()
    again.setup("fit")
    for name in ("train", "val", "test"):
        np.testing.assert_array_equal(again.datasets[name].rows, dm.datasets[name].rows)
    torch.testing.assert_close(again.datasets["test"][0]["input"], dm.datasets["test"][0]["input"])
    other_seed = SpeechCommandsDataModule(str(dm.data_dir), batch_size=8, seed=4)
    other_seed.setup("fit")  # the training seed orders batches only: same split
    for name in ("train", "val", "test"):
        np.testing.assert_array_equal(other_seed.datasets[name].rows, dm.datasets[name].rows)
    other_split = SpeechCommandsDataModule(str(dm.data_dir), batch_size=8, seed=3, split_seed=4)
    other_split.setup("fit")  # a new split from the same decoded clips
    assert not np.array_equal(other_split.datasets["train"].rows, dm.datasets["train"].rows)


def test_speech_missing_data_names_layout(tmp_path):
    from datamodules.speech import SpeechCommandsDataModule

    with pytest.raises(FileNotFoundError, match=r"speech_commands_v0\.02.*download\.tensorflow\.org"):
        SpeechCommandsDataModule(str(tmp_path), batch_size=4).setup("fit")


# ---------------------------------------------------------------------------------------------- imagenet
@pytest.fixture(scope="module")
def image_dir(tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("imagenet")
    write_image_folder(data_dir, classes=3, train_per_class=4, val_per_class=2)
    return data_dir


def test_imagenet_batches_and_mixup(image_dir):
    from datamodules.imagenet import ImageNetDataModule

    dm = ImageNetDataModule(str(image_dir), batch_size=4, num_workers=0, num_classes=3, image_size=32)
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    assert batch["input"].shape == (4, 3, 32, 32) and batch["input"].dtype == torch.float32
    assert batch["padding_mask"] is None
    assert batch["label"].shape == (4,) and batch["label"].dtype == torch.int64
    dm.trainer = SimpleNamespace(training=True, global_rank=0, world_size=1)
    mixed = dm.on_after_batch_transfer(batch, 0)
    assert mixed["label"].shape == (4, 3) and mixed["label"].dtype == torch.float32
    torch.testing.assert_close(mixed["label"].sum(-1), torch.ones(4))
    assert mixed["label"].min() >= 0.1 / 3 - 1e-6  # label smoothing 0.1 spreads mass to every class
    val = next(iter(dm.val_dataloader()))
    assert val["input"].shape == (4, 3, 32, 32)
    dm.trainer = SimpleNamespace(training=False, global_rank=0, world_size=1)
    assert dm.on_after_batch_transfer(val, 0)["label"].dtype == torch.int64
    with pytest.raises(ValueError, match="even"):
        ImageNetDataModule(str(image_dir), batch_size=3, num_classes=3, image_size=32)
    with pytest.raises(ValueError, match=r"3 class folders, but data\.options\.num_classes=1000"):
        ImageNetDataModule(str(image_dir), batch_size=4, image_size=32).setup("fit")


def test_imagenet_mixup_runs_inside_a_trainer(image_dir):
    import lightning as L

    from datamodules.imagenet import ImageNetDataModule

    seen = {}

    class Probe(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.head = torch.nn.Linear(3 * 32 * 32, 3)

        def training_step(self, batch, batch_idx):
            seen["train"] = batch["label"].shape
            logits = self.head(batch["input"].flatten(1))
            return -(batch["label"] * logits.log_softmax(-1)).sum(-1).mean()

        def validation_step(self, batch, batch_idx):
            seen["val"] = batch["label"].shape

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    dm = ImageNetDataModule(str(image_dir), batch_size=4, num_workers=0, num_classes=3, image_size=32)
    trainer = L.Trainer(
        accelerator="cpu", fast_dev_run=1, logger=False, enable_progress_bar=False, enable_model_summary=False
    )
    trainer.fit(Probe(), datamodule=dm)
    assert seen == {"train": (4, 3), "val": (4,)}


def test_repeat_aug_sampler_single_process(image_dir):
    from torch.utils.data import DistributedSampler

    from datamodules.common import ResumableSampler
    from datamodules.imagenet import ImageNetDataModule

    dm = ImageNetDataModule(
        str(image_dir), batch_size=4, num_workers=0, num_classes=3, image_size=32, repeated_aug=3
    )
    dm.setup("fit")
    sampler = dm.train_dataloader().sampler
    assert isinstance(sampler, ResumableSampler) and isinstance(sampler, DistributedSampler)
    order = [i for i, _ in sampler]
    assert len(order) == len(sampler) == 12  # one process, fewer than 256 images: len(dataset) draws
    assert all(order[i] == order[i + 1] == order[i + 2] for i in range(0, 12, 3))  # 4 images x 3 repeats
    assert [key for _, key in sampler] == [(0, 0, p) for p in range(12)]  # (seed, epoch, position)
    sampler.set_epoch(1)
    assert [i for i, _ in sampler] != order
    # timm's rule: with >= 256 images each rank draws floor(n // 256 * 256 / ranks) of the n * 3 repeats,
    # and the 3 repeats of an image land on 3 different ranks
    ranks = [ResumableSampler(600, seed=1, repeats=3, num_replicas=3, rank=r) for r in range(3)]
    assert [len(r) for r in ranks] == [512 // 3] * 3
    a, b, c = (r.indices(0) for r in ranks)
    assert a == b == c
    plain = ImageNetDataModule(
        str(image_dir), batch_size=4, num_workers=0, num_classes=3, image_size=32, repeated_aug=1
    )
    plain.setup("fit")
    plain_order = [i for i, _ in plain.train_dataloader().sampler]
    assert sorted(plain_order) == list(range(12))


def test_randaugment_posterize_at_magnitude_10(image_dir):
    """timm's PosterizeIncreasing keeps 0 bits at magnitude 10, which Pillow >= 12 rejects: it must give the
    all-black image that ``x & ~255`` does instead of ending the run."""
    from PIL import Image
    from timm.data.auto_augment import RandAugment

    from datamodules.imagenet import ImageNetDataModule

    dm = ImageNetDataModule(str(image_dir), batch_size=4, num_classes=3, image_size=32)
    (augment,) = [t for t in dm.train_transform.transforms if isinstance(t, RandAugment)]
    (op,) = [op for op in augment.ops if op.name == "PosterizeIncreasing"]
    op.prob, op.magnitude, op.magnitude_std = 1.0, 10, 0
    image = Image.fromarray(np.arange(32 * 32 * 3, dtype=np.uint8).reshape(32, 32, 3))
    assert not np.asarray(op(image)).any()
    op.magnitude = 5  # 4 - int(0.5 * 4) = 2 bits kept: x & 0b11000000
    np.testing.assert_array_equal(np.asarray(op(image)), np.asarray(image) & 0xC0)


def test_imagenet_missing_data_names_layout(tmp_path):
    from datamodules.imagenet import ImageNetDataModule

    with pytest.raises(FileNotFoundError, match=r"train/<wnid>/\*\.JPEG.*image-net\.org"):
        ImageNetDataModule(str(tmp_path), batch_size=4, image_size=32).setup("fit")


# ---------------------------------------------------------------------------------------------- wikitext
@pytest.fixture(scope="module")
def wikitext(tmp_path_factory):
    from datamodules.wikitext import WikiText103DataModule

    data_dir = tmp_path_factory.mktemp("wt")
    lines = write_wikitext(data_dir)
    dm = WikiText103DataModule(str(data_dir), batch_size=3, seq_len=16, eval_seq_len=7)
    dm.setup("fit")
    return dm, lines


def test_wikitext_vocabulary_sorted_by_frequency(wikitext):
    dm, lines = wikitext
    counts = Counter(w for line in lines["train"] for w in line.split())
    counts["<eos>"] = len(lines["train"])
    vocab = dm.vocabulary
    assert set(vocab) == set(counts) and dm.vocab_size == len(counts)
    assert vocab[0] == "<eos>"
    freqs = [counts[w] for w in vocab]
    assert freqs == sorted(freqs, reverse=True)
    ties = [w for w in vocab if counts[w] == counts["game"]]
    assert ties == sorted(ties)
    cached = [line.split() for line in (dm.cache_dir / "vocab.txt").read_text().splitlines()]
    assert [(w, int(c)) for w, c in cached] == [(w, counts[w]) for w in vocab]


def test_wikitext_token_files_and_word_counts(wikitext):
    dm, lines = wikitext
    vocab = dm.vocabulary
    for split, key in (("train", "train"), ("val", "valid"), ("test", "test")):
        words = [w for line in lines[key] for w in [*line.split(), "<eos>"]]
        tokens = dm.streams[split].read(0, len(dm.streams[split]))
        decoded = [vocab[t] for t in tokens]
        assert decoded == [w if w in vocab else "<unk>" for w in words]
        assert dm.num_words[split] == len(words)
    assert "zeppelin" not in vocab


def test_wikitext_eval_segments_cover_the_split_in_order(wikitext):
    dm, _ = wikitext
    for split, loader in (("val", dm.val_dataloader()), ("test", dm.test_dataloader())):
        segments = list(loader)
        assert len(segments) == len(loader)
        assert [bool(s["first_segment"]) for s in segments] == [True] + [False] * (len(segments) - 1)
        inputs = torch.cat([s["input"][0] for s in segments])
        targets = torch.cat([s["target"][0] for s in segments])
        assert all(s["input"].shape[0] == 1 and s["input"].shape[1] <= 7 for s in segments)
        stream = torch.from_numpy(dm.streams[split].read(0, len(dm.streams[split])))
        torch.testing.assert_close(targets, stream)  # every token is a target exactly once, in order
        assert len(targets) == dm.num_words[split]
        assert inputs[0] == dm.eos_id
        torch.testing.assert_close(inputs[1:], stream[:-1])


def test_wikitext_training_blocks(wikitext):
    from datamodules.wikitext import WikiText103DataModule

    dm, _ = wikitext
    loader = dm.train_dataloader()
    batch = next(iter(loader))
    assert batch["input"].shape == (3, 16) and batch["input"].dtype == torch.int64
    torch.testing.assert_close(batch["input"][:, 1:], batch["target"][:, :-1])
    assert len(loader.dataset) == (len(dm.streams["train"]) - 1) // 16

    variable = WikiText103DataModule(
        str(dm.data_dir), batch_size=2, chunk_size=4, min_chunks=2, max_chunks=6, eval_seq_len=8
    )
    variable.setup("fit")
    loader = variable.train_dataloader()
    lengths = set()
    stream = variable.streams["train"]
    for batch in loader:
        length = batch["input"].shape[1]
        lengths.add(length)
        assert batch["input"].shape[0] == 2 and length % 4 == 0 and 8 <= length <= 24
        torch.testing.assert_close(batch["input"][:, 1:], batch["target"][:, :-1])
        first = batch["input"][0]
        window = torch.from_numpy(stream.read(0, len(stream))).unfold(0, length, 1)
        assert (window == first).all(-1).any()  # a contiguous piece of the training stream
    assert len(lengths) > 1 and len(list(loader)) == len(loader)


def test_wikitext_cache_reused_and_missing_data(wikitext, monkeypatch, tmp_path):
    import datamodules.wikitext as wikitext_module

    dm, _ = wikitext
    monkeypatch.setattr(wikitext_module, "build_vocabulary", _fail)
    monkeypatch.setattr(wikitext_module, "TokenFileWriter", _fail)
    again = wikitext_module.WikiText103DataModule(str(dm.data_dir), batch_size=3, seq_len=16)
    again.setup("fit")
    assert again.vocabulary == dm.vocabulary and again.num_words == dm.num_words
    with pytest.raises(FileNotFoundError, match=r"wiki\.\{train,valid,test\}\.tokens.*wikitext-103-v1\.zip"):
        wikitext_module.WikiText103DataModule(str(tmp_path), batch_size=1).setup("fit")
    with pytest.raises(ValueError, match="chunk_size, min_chunks and max_chunks"):
        wikitext_module.WikiText103DataModule(str(tmp_path), batch_size=1, min_chunks=2)


# ---------------------------------------------------------------------------------------------- pg19
@pytest.fixture(scope="module")
def pg19(tmp_path_factory):
    from datamodules.pg19 import PG19DataModule

    data_dir = tmp_path_factory.mktemp("pg19")
    texts = write_pg19(data_dir)
    dm = PG19DataModule(str(data_dir), batch_size=2, seq_len=32, eval_seq_len=24, vocab_size=320)
    dm.setup("fit")
    return dm, texts


def test_pg19_books_packed_with_bos_eos(pg19):
    dm, texts = pg19
    sp = dm.tokenizer
    assert dm.vocab_size == sp.get_piece_size() <= 320
    assert (dm.cache_dir / "spm_unigram_320.model").is_file()
    for split, folder in (("train", "train"), ("val", "validation"), ("test", "test")):
        offsets = dm.book_offsets[split]
        stream = dm.streams[split]
        assert stream.dtype == np.uint16 and offsets[-1] == len(stream)
        books = (dm.token_dir / f"{split}.books.txt").read_text().split()
        assert books == sorted(texts[folder], key=int) and len(offsets) == len(books) + 1
        for k, book in enumerate(books):
            tokens = stream.read(offsets[k], offsets[k + 1])
            assert tokens[0] == sp.bos_id() and tokens[-1] == sp.eos_id()
            assert sp.bos_id() not in tokens[1:-1] and sp.eos_id() not in tokens[1:-1]
            assert sp.decode(tokens[1:-1].tolist()) == " ".join(texts[folder][book].split())
        assert dm.num_words[split] == sum(len(t.split()) for t in texts[folder].values())
    batch = next(iter(dm.train_dataloader()))
    assert batch["input"].shape == (2, 32) and batch["target"].dtype == torch.int64
    torch.testing.assert_close(batch["input"][:, 1:], batch["target"][:, :-1])


def test_pg19_eval_book_by_book(pg19):
    dm, _ = pg19
    for split, loader in (("val", dm.val_dataloader()), ("test", dm.test_dataloader())):
        offsets = dm.book_offsets[split]
        segments = list(loader)
        starts = [i for i, s in enumerate(segments) if s["first_segment"].item()]
        assert len(starts) == len(offsets) - 1 and starts[0] == 0
        starts.append(len(segments))
        for k in range(len(offsets) - 1):
            book = torch.from_numpy(dm.streams[split].read(offsets[k], offsets[k + 1]))
            pieces = segments[starts[k] : starts[k + 1]]
            assert all(p["input"].shape[1] <= 24 for p in pieces)
            torch.testing.assert_close(torch.cat([p["input"][0] for p in pieces]), book[:-1])
            torch.testing.assert_close(torch.cat([p["target"][0] for p in pieces]), book[1:])
        assert loader.dataset.num_targets == len(dm.streams[split]) - (len(offsets) - 1)


def test_pg19_inside_a_trainer(pg19):
    import lightning as L

    from datamodules.common import ResumableDataLoader

    dm, _ = pg19
    seen = {"train": 0, "first": 0, "segments": 0}

    class Probe(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.logits = torch.nn.Embedding(dm.vocab_size, dm.vocab_size)

        def training_step(self, batch, batch_idx):
            seen["train"] += 1
            return torch.nn.functional.cross_entropy(
                self.logits(batch["input"]).flatten(0, 1), batch["target"].flatten()
            )

        def validation_step(self, batch, batch_idx):
            seen["segments"] += 1
            seen["first"] += int(batch["first_segment"].item())

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    assert isinstance(dm.train_dataloader(), ResumableDataLoader)
    trainer = L.Trainer(
        accelerator="cpu",
        max_epochs=1,
        limit_train_batches=2,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Probe(), datamodule=dm)
    assert seen == {"train": 2, "first": 2, "segments": len(dm.val_dataloader())}


def test_pg19_given_tokenizer_and_cache_reuse(pg19, tmp_path, monkeypatch):
    import sentencepiece as spm

    from datamodules.pg19 import PG19DataModule

    dm, texts = pg19
    model = train_sentencepiece(tmp_path / "given.model", list(texts["train"].values()), vocab_size=300)
    given = PG19DataModule(
        str(dm.data_dir), seq_len=16, tokenizer_path=str(model), cache_dir=str(tmp_path / "c")
    )
    given.setup("fit")
    assert (
        given.token_dir != dm.token_dir
        and given.vocab_size == spm.SentencePieceProcessor(model_file=str(model)).get_piece_size()
    )
    assert not list((tmp_path / "c").glob("spm_*.model"))  # nothing trained
    monkeypatch.setattr(spm.SentencePieceTrainer, "train", _fail)
    monkeypatch.setattr(spm.SentencePieceProcessor, "encode", _fail)
    again = PG19DataModule(str(dm.data_dir), batch_size=2, seq_len=32, vocab_size=320)
    again.setup("fit")
    assert again.num_words == dm.num_words and again.token_dir == dm.token_dir


def test_pg19_missing_data_names_layout(tmp_path):
    from datamodules.pg19 import PG19DataModule

    with pytest.raises(FileNotFoundError, match=r"train,validation,test\}/<book_id>\.txt.*deepmind"):
        PG19DataModule(str(tmp_path), vocab_size=320).setup("fit")


# ---------------------------------------------------------------------------------------------- pretrain
@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("pretrain")
    documents = write_jsonl_corpus(data_dir)
    tok_dir = tmp_path_factory.mktemp("tokenizers")
    return {
        "data_dir": data_dir,
        "documents": documents,
        "sentencepiece": train_sentencepiece(tok_dir / "tiny.model", documents),
        "hf": train_hf_tokenizer(tok_dir / "tokenizer.json", documents),
    }


def _split_documents(stream, bos: int, eos: int) -> list[list[int]]:
    tokens = stream.read(0, len(stream)).tolist()
    docs, current = [], None
    for t in tokens:
        if t == bos:
            assert current is None, "BOS inside a document"
            current = []
        elif t == eos:
            docs.append(current)
            current = None
        else:
            current.append(t)
    assert current is None, "the stream ends inside a document"
    return docs


@pytest.mark.parametrize("kind", ["sentencepiece", "hf"])
def test_pretrain_packs_documents_with_bos_eos(corpus, kind, tmp_path):
    from datamodules.pretrain import PretrainDataModule

    dm = PretrainDataModule(
        str(corpus["data_dir"]),
        str(corpus[kind]),
        batch_size=2,
        seq_len=16,
        val_fraction=0.3,
        split_seed=1,
        cache_dir=str(tmp_path),
    )
    dm.setup("fit")
    tok = dm.tokenizer
    shards = sorted(p.name for p in dm.token_dir.glob("*.bin"))
    assert len(shards) == 6  # a train and a val shard per input file; notes.json is ignored
    assert all(dm.streams[s].dtype == np.uint16 for s in ("train", "val"))
    docs = {s: _split_documents(dm.streams[s], tok.bos_id, tok.eos_id) for s in ("train", "val")}
    assert len(docs["train"]) + len(docs["val"]) == len(corpus["documents"]) and len(docs["val"]) > 0
    expected = [tuple(ids) for ids in tok.encode_batch(corpus["documents"])]
    assert sorted(map(tuple, docs["train"] + docs["val"])) == sorted(expected)
    order = [expected.index(tuple(d)) for d in docs["train"]]
    assert order == sorted(order)  # documents keep their file order within a split

    batch = next(iter(dm.train_dataloader()))
    assert batch["input"].shape == (2, 16) and batch["input"].dtype == torch.int64
    torch.testing.assert_close(batch["input"][:, 1:], batch["target"][:, :-1])
    assert sum(len(b["input"]) for b in dm.val_dataloader()) == (len(dm.streams["val"]) - 1) // 16
    first = dm.val_dataloader().dataset[1]
    torch.testing.assert_close(first["input"], torch.from_numpy(dm.streams["val"].read(16, 32)))
    torch.testing.assert_close(first["target"], torch.from_numpy(dm.streams["val"].read(17, 33)))


def test_pretrain_shards_reused_and_split_is_seeded(corpus, tmp_path, monkeypatch):
    from datamodules.pretrain import DocumentTokenizer, PretrainDataModule

    kwargs = dict(batch_size=2, seq_len=8, val_fraction=0.3, cache_dir=str(tmp_path))
    dm = PretrainDataModule(str(corpus["data_dir"]), str(corpus["hf"]), split_seed=5, **kwargs)
    dm.setup("fit")
    monkeypatch.setattr(DocumentTokenizer, "encode_batch", _fail)
    again = PretrainDataModule(str(corpus["data_dir"]), str(corpus["hf"]), split_seed=5, **kwargs)
    again.setup("fit")
    assert len(again.streams["val"]) == len(dm.streams["val"])
    monkeypatch.undo()
    other = PretrainDataModule(str(corpus["data_dir"]), str(corpus["hf"]), split_seed=6, **kwargs)
    other.setup("fit")
    assert len(other.streams["val"]) != len(dm.streams["val"])


def test_pretrain_errors(corpus, tmp_path):
    from datamodules.pretrain import PretrainDataModule
    from datamodules.text_lm import token_dtype

    with pytest.raises(FileNotFoundError, match=r"\.jsonl\.gz"):
        PretrainDataModule(str(tmp_path), str(corpus["hf"]), seq_len=8).setup("fit")
    with pytest.raises(FileNotFoundError, match="tokenizer"):
        PretrainDataModule(str(corpus["data_dir"]), str(tmp_path / "missing.json"), seq_len=8).setup("fit")
    with pytest.raises(ValueError, match="val_fraction"):
        PretrainDataModule(str(corpus["data_dir"]), str(corpus["hf"]), val_fraction=0.0)
    with pytest.raises(ValueError, match="bos_token"):
        _ = PretrainDataModule(str(corpus["data_dir"]), str(corpus["hf"]), bos_token="<|im_start|>").tokenizer
    with pytest.raises(ValueError, match="no piece '<nope>'"):
        _ = PretrainDataModule(
            str(corpus["data_dir"]), str(corpus["sentencepiece"]), bos_token="<nope>"
        ).tokenizer
    (tmp_path / "bad.jsonl").write_text('{"content": "no text field"}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:1 has no field 'text'"):
        PretrainDataModule(str(tmp_path), str(corpus["hf"]), seq_len=8).setup("fit")
    assert (
        token_dtype(32000) == np.uint16
        and token_dtype(2**16) == np.uint16
        and token_dtype(128256) == np.uint32
    )


def test_token_stream_reads_across_files(tmp_path):
    from datamodules.text_lm import TokenFileWriter, TokenStream

    parts = [np.arange(0, 5), np.arange(5, 5), np.arange(5, 12), np.arange(12, 13)]
    for i, part in enumerate(parts):
        with TokenFileWriter(tmp_path / f"{i}.bin", np.uint32) as writer:
            writer.write(part + 70000)
    stream = TokenStream([tmp_path / f"{i}.bin" for i in range(4)], np.uint32)
    assert len(stream) == 13
    for a, b in ((0, 13), (3, 9), (5, 12), (11, 13), (4, 4)):
        np.testing.assert_array_equal(stream.read(a, b), np.arange(a, b) + 70000)
    with pytest.raises(IndexError):
        stream.read(10, 14)
    with (
        pytest.raises(ValueError, match="outside"),
        TokenFileWriter(tmp_path / "bad.bin", np.uint16) as writer,
    ):
        writer.write([70000])
    assert not list(tmp_path.glob("bad.bin*"))  # an aborted file leaves nothing behind
