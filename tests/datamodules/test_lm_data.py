"""Language-model data modules (WikiText-103, PG-19, LLM pretraining): content-defined splits, exact mid-epoch
resume, user data errors raised at set-up as ``DataError``, caches beside a read-only data set."""

from __future__ import annotations

import gzip
import json
import os
import shutil
import time

import numpy as np
import pytest
import torch
from modality_fixtures import train_sentencepiece, write_jsonl_corpus, write_pg19, write_wikitext

from datamodules import DataError

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _next_batches(loader, k: int) -> list[dict]:
    out = []
    for batch in loader:
        out.append(batch)
        if len(out) == k:
            break
    return out


def _assert_same_batches(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b) and a
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for key in x:
            torch.testing.assert_close(x[key], y[key], rtol=0, atol=0)


def _check_resume(make_dm, k: int, more: int, epoch: int = 0) -> None:
    """Iterate ``k`` batches, take the loader state, build a fresh data module, restore, and compare the next
    ``more`` batches with those of the uninterrupted run."""
    torch.manual_seed(123)  # the global generator must not matter: reseed differently for the resumed run
    dm = make_dm()
    loader = dm.train_dataloader()
    loader.sampler.set_epoch(epoch)
    it = iter(loader)
    for _ in range(k):
        next(it)
    state = loader.state_dict()
    reference = [next(it) for _ in range(more)]

    torch.manual_seed(999)
    fresh = make_dm()
    resumed = fresh.train_dataloader()
    resumed.load_state_dict(state)
    resumed.sampler.set_epoch(epoch)  # Lightning calls this again at the (resumed) epoch start
    _assert_same_batches(_next_batches(resumed, more), reference)


# ------------------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def wt_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("wt")
    write_wikitext(root)
    return root


@pytest.fixture(scope="module")
def pg_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("pg")
    write_pg19(root)
    return root


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    documents = write_jsonl_corpus(root / "data")
    return root / "data", train_sentencepiece(root / "tiny.model", documents), documents


# ------------------------------------------------------------------------------------------ resume
def test_wt103_variable_length_resume_is_exact(wt_dir, tmp_path):
    from datamodules.wikitext import WikiText103DataModule

    def make():
        dm = WikiText103DataModule(
            str(wt_dir),
            batch_size=2,
            chunk_size=4,
            min_chunks=2,
            max_chunks=6,
            cache_dir=str(tmp_path),
            seed=3,
        )
        dm.setup("fit")
        return dm

    _check_resume(make, k=3, more=4)
    _check_resume(make, k=2, more=3, epoch=2)
    # Epochs differ, and the seed matters.
    first = _next_batches(make().train_dataloader(), 3)
    loader = make().train_dataloader()
    loader.sampler.set_epoch(1)
    assert any(not torch.equal(a["input"], b["input"]) for a, b in zip(first, _next_batches(loader, 3)))


def test_wt103_fixed_length_resume_is_exact(wt_dir, tmp_path):
    from datamodules.wikitext import WikiText103DataModule

    def make():
        dm = WikiText103DataModule(str(wt_dir), batch_size=2, seq_len=16, cache_dir=str(tmp_path))
        dm.setup("fit")
        return dm

    _check_resume(make, k=3, more=4)


def test_pg19_resume_is_exact(pg_dir):
    from datamodules.pg19 import PG19DataModule

    def make():
        dm = PG19DataModule(str(pg_dir), batch_size=2, seq_len=16, vocab_size=300)
        dm.setup("fit")
        return dm

    _check_resume(make, k=2, more=3)


def test_pretrain_resume_is_exact(corpus, tmp_path):
    from datamodules.pretrain import PretrainDataModule

    data, model, _ = corpus

    def make():
        dm = PretrainDataModule(
            str(data), str(model), batch_size=2, seq_len=8, val_fraction=0.3, cache_dir=str(tmp_path)
        )
        dm.setup("fit")
        return dm

    _check_resume(make, k=2, more=3)


def test_wt103_resume_through_lightning_checkpoint(wt_dir, tmp_path):
    """The loader state travels in a Lightning checkpoint: a run stopped after 3 steps and resumed trains on
    the same batches as an uninterrupted 6-step run."""
    import lightning as L

    from datamodules.wikitext import WikiText103DataModule

    class Probe(L.LightningModule):
        def __init__(self, vocab):
            super().__init__()
            self.emb = torch.nn.Embedding(vocab, 4)
            self.seen = []

        def training_step(self, batch, batch_idx):
            self.seen.append(batch["input"].clone())
            return self.emb(batch["input"]).sum() * 0.0

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.0)

    class SaveAt(L.Callback):
        def on_train_batch_end(self, trainer, *args):
            if trainer.global_step == 3 and not (tmp_path / "mid.ckpt").exists():
                trainer.save_checkpoint(tmp_path / "mid.ckpt")  # mid-epoch, as ModelCheckpoint does

    def fit(steps, ckpt=None):
        dm = WikiText103DataModule(
            str(wt_dir), batch_size=2, chunk_size=4, min_chunks=2, max_chunks=6, cache_dir=str(tmp_path / "c")
        )
        dm.setup("fit")
        probe = Probe(dm.vocab_size)
        trainer = L.Trainer(accelerator="cpu", max_steps=steps, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                            callbacks=[SaveAt()])  # fmt: skip
        torch.manual_seed(len(str(ckpt)))  # a different global generator state for each run
        trainer.fit(probe, train_dataloaders=dm.train_dataloader(), ckpt_path=ckpt)
        return probe.seen

    whole = fit(6)
    assert (tmp_path / "mid.ckpt").is_file()
    rest = fit(6, str(tmp_path / "mid.ckpt"))
    assert len(whole) == 6 and len(rest) == 3
    for a, b in zip(rest, whole[3:]):
        assert torch.equal(a, b)


# ------------------------------------------------------------------------------------------ splits
def _val_tokens(dm) -> np.ndarray:
    return dm.streams["val"].read(0, len(dm.streams["val"]))


def test_pretrain_split_is_defined_by_content(corpus, tmp_path):
    """The held-out documents follow from the corpus bytes and ``split_seed`` only: not the training seed, the
    directory, or file times."""
    from datamodules.pretrain import PretrainDataModule

    data, model, _ = corpus

    def split(data_dir, seed=0, **kw):
        dm = PretrainDataModule(
            str(data_dir), str(model), seq_len=8, val_fraction=0.3, seed=seed, cache_dir=str(tmp_path / "cache"),
            **kw,
        )  # fmt: skip
        dm.setup("fit")
        return _val_tokens(dm), dm.streams["train"].read(0, len(dm.streams["train"]))

    base = split(data)
    assert len(base[0]) > 0
    same_seed = split(data, seed=7)
    copy = tmp_path / "elsewhere" / "copy"
    shutil.copytree(data, copy)
    later = time.time() + 100
    for path in copy.rglob("*"):
        os.utime(path, (later, later))
    for a, b in zip(base, same_seed):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(base, split(copy)):
        np.testing.assert_array_equal(a, b)
    other = split(data, split_seed=1)
    assert len(other[0]) != len(base[0]) or not np.array_equal(other[0], base[0])


# ------------------------------------------------------------------------------------------ data errors
def test_wt103_bad_files_are_data_errors(tmp_path):
    from datamodules.wikitext import WikiText103DataModule

    root = tmp_path / "wt"
    write_wikitext(root)
    valid = root / "wikitext-103" / "wiki.valid.tokens"
    valid.write_bytes(b" = Tower = \n the \xff tower \n")
    with pytest.raises(DataError, match=r"wiki\.valid\.tokens:2 is not valid UTF-8"):
        WikiText103DataModule(str(root), cache_dir=str(tmp_path / "c1")).setup("fit")
    valid.write_bytes(b"")
    with pytest.raises(DataError, match=r"wiki\.valid\.tokens is empty"):
        WikiText103DataModule(str(root), cache_dir=str(tmp_path / "c2")).setup("fit")
    with pytest.raises(DataError, match=r"wikitext-103-v1\.zip"):  # missing data: also a FileNotFoundError
        WikiText103DataModule(str(tmp_path / "nothing")).setup("fit")


def test_wt103_truncated_cache_is_a_data_error(wt_dir, tmp_path):
    from datamodules.wikitext import WikiText103DataModule

    WikiText103DataModule(str(wt_dir), cache_dir=str(tmp_path)).setup("fit")
    token_file = tmp_path / "val.bin"
    token_file.write_bytes(token_file.read_bytes()[:-2])
    with pytest.raises(DataError, match=r"val\.bin .*truncated or stale; delete"):
        WikiText103DataModule(str(wt_dir), cache_dir=str(tmp_path)).setup("fit")


def test_pg19_bad_files_are_data_errors(tmp_path):
    from datamodules.pg19 import PG19DataModule

    root = tmp_path / "pg"
    write_pg19(root)
    book = sorted((root / "pg19" / "validation").glob("*.txt"))[0]
    book.write_bytes(b"A fine line\nand then \xc3\x28 a broken one\n")
    with pytest.raises(DataError, match=rf"{book.name}:2 is not valid UTF-8"):
        PG19DataModule(str(root), vocab_size=300, cache_dir=str(tmp_path / "c1")).setup("fit")
    book.write_text("   \n")
    with pytest.raises(DataError, match=rf"{book.name} holds no text"):
        PG19DataModule(str(root), vocab_size=300, cache_dir=str(tmp_path / "c2")).setup("fit")
    train_book = sorted((root / "pg19" / "train").glob("*.txt"))[0]
    train_book.write_bytes(b"\xff\xfe")  # read while the tokenizer trains
    with pytest.raises(DataError, match=rf"{train_book.name}:1 is not valid UTF-8"):
        PG19DataModule(str(root), vocab_size=300, cache_dir=str(tmp_path / "c3")).setup("fit")
    with pytest.raises(DataError, match=r"data\.options\.tokenizer_path=.*nope\.model does not exist"):
        PG19DataModule(str(root), tokenizer_path=str(tmp_path / "nope.model")).setup("fit")
    for path in (root / "pg19" / "test").glob("*.txt"):
        path.unlink()
    with pytest.raises(DataError, match=r"test/\*\.txt"):
        PG19DataModule(str(root), vocab_size=300, cache_dir=str(tmp_path / "c4")).setup("fit")


def test_pretrain_bad_files_are_data_errors(corpus, tmp_path):
    from datamodules.pretrain import PretrainDataModule

    _, model, _ = corpus

    def setup(name: str, content: bytes, **kw):
        folder = tmp_path / name
        folder.mkdir()
        good = "".join(json.dumps({"text": f"document number {i} " * 5}) + "\n" for i in range(40))
        (folder / "good.jsonl").write_text(good)
        path = folder / name
        if name.endswith(".gz"):
            content = gzip.compress(content)[: -10 if kw.pop("truncate", False) else None]
        path.write_bytes(content)
        kw = {"seq_len": 8, "val_fraction": 0.2, "cache_dir": str(tmp_path / f"c_{name}"), **kw}
        PretrainDataModule(str(folder), str(model), **kw).setup("fit")

    with pytest.raises(DataError, match=r"bad\.jsonl:2 has no field 'text'.*data\.options\.text_field"):
        setup("bad.jsonl", b'{"text": "fine"}\n{"content": "no text field"}\n')
    with pytest.raises(DataError, match=r"json1\.jsonl:1 is not a JSON object"):
        setup("json1.jsonl", b'{"text": "cut off\n')
    with pytest.raises(DataError, match=r"utf\.jsonl:2 is not valid UTF-8"):
        setup("utf.jsonl", b'{"text": "fine"}\n{"text": "\xff"}\n')
    with pytest.raises(DataError, match=r"notstr\.jsonl:1 field 'text' is a int"):
        setup("notstr.jsonl", b'{"text": 3}\n')
    with pytest.raises(DataError, match=r"empty\.jsonl holds no documents"):
        setup("empty.jsonl", b"\n")
    with pytest.raises(DataError, match=r"trunc\.jsonl\.gz.*truncated or corrupt"):
        setup("trunc.jsonl.gz", b'{"text": "a"}\n' * 200, truncate=True)
    with pytest.raises(DataError, match=r"data\.options\.val_fraction"):
        setup("ok.jsonl", b'{"text": "short"}\n', val_fraction=0.001)
    with pytest.raises(DataError, match=r"data\.options\.tokenizer_path=.*missing\.model"):
        PretrainDataModule(str(tmp_path / "ok.jsonl"), str(tmp_path / "missing.model")).setup("fit")
    with pytest.raises(DataError, match=r"data\.options\.val_fraction"):
        PretrainDataModule(str(tmp_path), str(model), val_fraction=1.5)


# ------------------------------------------------------------------------------------------ read-only data
def _read_only(path, monkeypatch) -> None:
    """Make ``path`` read-only with chmod; where that does not stop this user (root), also make
    ``os.access`` report it read-only, so the fallback is still exercised (and writing there would show)."""
    for p in [path, *path.rglob("*")]:
        p.chmod(p.stat().st_mode & ~0o222)
    if os.access(path, os.W_OK):
        real = os.access
        inside = str(path.resolve())

        def access(p, mode, *args, **kwargs):
            if mode & os.W_OK and str(os.path.realpath(p)).startswith(inside):
                return False
            return real(p, mode, *args, **kwargs)

        monkeypatch.setattr(os, "access", access)


def _writable(path):
    for p in [path, *path.rglob("*")]:
        p.chmod(p.stat().st_mode | 0o200)


@pytest.mark.parametrize("name", ["wt103", "pg19", "pretrain"])
def test_read_only_data_dir_caches_in_the_user_cache(name, tmp_path, monkeypatch, caplog):
    from datamodules.pg19 import PG19DataModule
    from datamodules.pretrain import PretrainDataModule
    from datamodules.wikitext import WikiText103DataModule

    data = tmp_path / "data"
    data.mkdir()
    if name == "wt103":
        write_wikitext(data)
        make = lambda: WikiText103DataModule(str(data), seq_len=16)  # noqa: E731
    elif name == "pg19":
        write_pg19(data)
        make = lambda: PG19DataModule(str(data), seq_len=16, vocab_size=300)  # noqa: E731
    else:
        documents = write_jsonl_corpus(data)
        model = train_sentencepiece(tmp_path / "tok.model", documents)
        make = lambda: PretrainDataModule(str(data), str(model), seq_len=8, val_fraction=0.3)  # noqa: E731
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "user-cache"))
    _read_only(data, monkeypatch)
    try:
        with caplog.at_level("WARNING"):
            dm = make()
            dm.setup("fit")
        assert str(dm.cache_dir).startswith(str(tmp_path / "user-cache" / "mega_suite"))
        assert str(dm.cache_dir) in caplog.text and not (data / "cache").exists()
        assert len(dm.streams["train"]) > 0 and next(iter(dm.train_dataloader()))["input"].shape[1] in (8, 16)
    finally:
        _writable(data)
