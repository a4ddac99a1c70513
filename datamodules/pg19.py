"""PG-19 (Rae et al. 2019): whole Project Gutenberg books, subword-tokenised, evaluated book by book.

Layout (DATA.md): ``<data_dir>/pg19/{train,validation,test}/<book_id>.txt`` (+ ``metadata.csv``, not needed
here). Tokenizer: a SentencePiece ``.model`` given by ``tokenizer_path``, or one trained once on the training
books (``vocab_size``, default 32K as in the paper) and cached as ``<cache_dir>/spm_<type>_<vocab>.model``.
Each split is tokenised once into ``<cache_dir>/tokens_<tokenizer hash>/<split>.bin``: the books in
book-id order, each as ``BOS tokens EOS``, with ``<split>.offsets.npy`` (int64, book ``k`` is tokens
``[offsets[k], offsets[k+1])``) and ``<split>.books.txt`` (book ids).

Training: ``{"input": [B, L] int64, "target": [B, L] int64}``, ``L = seq_len`` (keep it a multiple of the
attention chunk C), non-overlapping windows of the packed training stream, shuffled. Evaluation (val =
``validation``, test = ``test``): book after book, each as consecutive segments ``{"input": [1, S],
"target": [1, S], "first_segment": [1] bool}``; ``first_segment`` marks each book's first segment (reset the
streaming cache there); targets are every token of a book after its BOS, EOS included. Perplexity is per
word (DATA.md): ``exp(total NLL over the split / num_words[split])`` with ``num_words`` the number of
whitespace-separated words of the split's books, whatever the tokenizer.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

import lightning as L
import numpy as np
import sentencepiece as spm
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from datamodules.text_lm import (
    PackedSequences,
    StreamSegments,
    TokenFileWriter,
    TokenStream,
    packed_train_loader,
    token_dtype,
    write_json_atomic,
)

SPLIT_DIRS = {"train": "train", "val": "validation", "test": "test"}
SOURCE = "https://github.com/google-deepmind/pg19 (bucket gs://deepmind-gutenberg)"
_ENCODE_BATCH = 32  # books handed to SentencePiece's multi-threaded encoder at once


def book_files(folder: Path) -> list[Path]:
    """The ``<book_id>.txt`` files of a split folder, numeric ids in numeric order."""
    files = [p for p in folder.iterdir() if p.suffix == ".txt"]
    return sorted(files, key=lambda p: (not p.stem.isdigit(), int(p.stem) if p.stem.isdigit() else 0, p.stem))


def _training_lines(files: list[Path]) -> Iterator[str]:
    for path in tqdm(files, desc="pg19 tokenizer training", unit=" books", mininterval=2):
        with open(path, encoding="utf-8") as f:
            for line in f:
                line = line.strip()
                if line:
                    yield line


class PG19DataModule(L.LightningDataModule):
    """PG-19 book-level language modelling; see the module docstring for the batch formats."""

    def __init__(
        self,
        data_dir: str,
        batch_size: int = 1,
        num_workers: int = 0,
        seed: int = 0,
        seq_len: int = 8192,
        eval_seq_len: int | None = None,
        tokenizer_path: str | None = None,
        vocab_size: int = 32000,
        spm_model_type: str = "unigram",
        byte_fallback: bool = True,
        spm_input_sentence_size: int = 5_000_000,
        cache_dir: str | None = None,
    ):
        """
        Args:
            data_dir: folder holding ``pg19/``.
            batch_size: training sequences per batch.
            seed: training order (resumable mid-epoch) and the sentence sample a trained tokenizer learns from.
            seq_len: training sequence length in tokens (a multiple of the chunk size C).
            eval_seq_len: evaluation segment length (default ``seq_len``).
            tokenizer_path: a SentencePiece ``.model``; None trains one on the training books.
            vocab_size, spm_model_type, byte_fallback: options of the tokenizer trained when none is given
                (``hard_vocab_limit`` is off, so a small corpus may give fewer pieces than ``vocab_size``).
            spm_input_sentence_size: lines SentencePiece samples from the training books to train on.
            cache_dir: tokenizer and token files (default ``<data_dir>/cache/pg19``).
        """
        super().__init__()
        self.data_dir = Path(data_dir)
        self.root = self.data_dir / "pg19"
        self.cache_dir = Path(cache_dir) if cache_dir else self.data_dir / "cache" / "pg19"
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.seed = seed
        self.seq_len = seq_len
        self.eval_seq_len = eval_seq_len or seq_len
        self.tokenizer_path = tokenizer_path
        self.spm_options = {
            "vocab_size": vocab_size,
            "model_type": spm_model_type,
            "byte_fallback": byte_fallback,
            "input_sentence_size": spm_input_sentence_size,
        }
        self._sp: spm.SentencePieceProcessor | None = None
        self.num_words: dict[str, int] = {}
        self.streams: dict[str, TokenStream] = {}
        self.book_offsets: dict[str, np.ndarray] = {}

    # ------------------------------------------------------------------ tokenizer
    def _check_layout(self) -> None:
        missing = [d for d in SPLIT_DIRS.values() if not (self.root / d).is_dir()]
        if not missing and not any(p.suffix == ".txt" for p in (self.root / "train").iterdir()):
            missing = ["train/*.txt"]
        if missing:
            raise FileNotFoundError(
                f"PG-19 not found: missing {', '.join(str(self.root / m) for m in missing)}. Expected "
                f"{self.root}/{{train,validation,test}}/<book_id>.txt (+ metadata.csv). Get it from {SOURCE} "
                f"and copy it into {self.data_dir}."
            )

    def _trained_model_path(self) -> Path:
        o = self.spm_options
        return self.cache_dir / f"spm_{o['model_type']}_{o['vocab_size']}.model"

    @property
    def tokenizer(self) -> spm.SentencePieceProcessor:
        """The SentencePiece processor; trained on the training books (once, then cached) if none was given."""
        if self._sp is None:
            if self.tokenizer_path is not None:
                path = Path(self.tokenizer_path)
                if not path.is_file():
                    raise FileNotFoundError(f"tokenizer_path {path} does not exist (a SentencePiece .model)")
            else:
                path = self._trained_model_path()
                if not path.is_file():
                    self._train_tokenizer(path)
            self._sp = spm.SentencePieceProcessor(model_file=str(path))
            if self._sp.bos_id() < 0 or self._sp.eos_id() < 0:
                raise ValueError(
                    f"SentencePiece model {path} defines no BOS/EOS piece; PG-19 packing needs both"
                )
        return self._sp

    def _train_tokenizer(self, path: Path) -> None:
        self._check_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        prefix = path.with_name(f"{path.stem}.tmp{os.getpid()}")
        o = self.spm_options
        spm.set_random_generator_seed(self.seed)  # the sentence sample, so the tokenizer is reproducible
        spm.SentencePieceTrainer.train(
            sentence_iterator=_training_lines(book_files(self.root / "train")),
            model_prefix=str(prefix),
            vocab_size=o["vocab_size"],
            model_type=o["model_type"],
            byte_fallback=o["byte_fallback"],
            hard_vocab_limit=False,
            input_sentence_size=o["input_sentence_size"],
            shuffle_input_sentence=True,
            unk_id=0,
            bos_id=1,
            eos_id=2,
            pad_id=-1,
            num_threads=os.cpu_count() or 1,
            minloglevel=2,
        )
        os.replace(f"{prefix}.model", path)
        Path(f"{prefix}.vocab").unlink(missing_ok=True)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_piece_size()

    @property
    def token_dir(self) -> Path:
        """Token files of this tokenizer: a new tokenizer never reads another's cache."""
        digest = hashlib.sha1(self.tokenizer.serialized_model_proto()).hexdigest()[:12]
        return self.cache_dir / f"tokens_{digest}"

    # ------------------------------------------------------------------ cache
    def prepare_data(self) -> None:
        """Trains the tokenizer if needed and tokenises the three splits once (idempotent)."""
        self._check_layout()
        meta_path = self.token_dir / "meta.json"
        if meta_path.is_file():
            return
        sp = self.tokenizer
        dtype = token_dtype(sp.get_piece_size())
        num_words = {}
        for split, folder in SPLIT_DIRS.items():
            files = book_files(self.root / folder)
            offsets = [0]
            words = 0
            with TokenFileWriter(self.token_dir / f"{split}.bin", dtype) as writer:
                bar = tqdm(total=len(files), desc=f"tokenising pg19 {split}", unit=" books", mininterval=2)
                for i in range(0, len(files), _ENCODE_BATCH):
                    texts = [p.read_text(encoding="utf-8") for p in files[i : i + _ENCODE_BATCH]]
                    words += sum(len(t.split()) for t in texts)
                    for ids in sp.encode(texts, num_threads=os.cpu_count() or 1):
                        writer.write(np.asarray([sp.bos_id(), *ids, sp.eos_id()], dtype=np.int64))
                        offsets.append(writer.num_tokens)
                    bar.update(len(texts))
                bar.close()
            np.save(self.token_dir / f"{split}.offsets.npy", np.asarray(offsets, dtype=np.int64))
            (self.token_dir / f"{split}.books.txt").write_text("".join(f"{p.stem}\n" for p in files))
            num_words[split] = words
        write_json_atomic(
            meta_path, {"vocab_size": sp.get_piece_size(), "dtype": dtype.name, "num_words": num_words}
        )

    # ------------------------------------------------------------------ Lightning
    def setup(self, stage: str | None = None) -> None:
        self.prepare_data()
        meta = json.loads((self.token_dir / "meta.json").read_text())
        self.num_words = meta["num_words"]
        dtype = np.dtype(meta["dtype"])
        for split in SPLIT_DIRS:
            self.streams[split] = TokenStream([self.token_dir / f"{split}.bin"], dtype)
            self.book_offsets[split] = np.load(self.token_dir / f"{split}.offsets.npy")

    def train_dataloader(self) -> DataLoader:
        dataset = PackedSequences(self.streams["train"], self.seq_len)
        return packed_train_loader(dataset, self.batch_size, self.num_workers, self.seed)

    def _eval_loader(self, split: str) -> DataLoader:
        offsets = self.book_offsets[split]
        dataset = StreamSegments(self.streams[split], list(zip(offsets[:-1], offsets[1:])), self.eval_seq_len)
        return DataLoader(dataset, batch_size=None, num_workers=0)

    def val_dataloader(self) -> DataLoader:
        return self._eval_loader("val")

    def test_dataloader(self) -> DataLoader:
        return self._eval_loader("test")
