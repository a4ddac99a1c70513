"""LLM pretraining corpora: JSON-lines documents, tokenised once, packed into fixed-length sequences.

Layout (DATA.md): files matching ``patterns`` under ``data_dir`` (``.jsonl`` or ``.jsonl.gz``), one JSON
object per line with the document in ``text_field`` (default ``"text"``). Tokenizer by path: a SentencePiece
``.model`` or a Hugging Face ``tokenizer.json`` (BOS/EOS found among the usual names, or given as
``bos_token``/``eos_token``). Each input file is tokenised once into two memory-mapped shards under
``<cache_dir>/tokens_<tokenizer hash>/``: ``<key>.train.bin`` and ``<key>.val.bin`` (``uint16`` when the
vocabulary has at most 65536 ids, else ``uint32``), where ``<key>`` hashes the file's path, size and mtime and
the split settings, so adding files tokenises only the new ones. A document goes to validation with
probability ``val_fraction`` (drawn per file from ``val_seed``). Every document is written as ``BOS tokens EOS``.

Batches: ``{"input": [B, seq_len] int64, "target": [B, seq_len] int64}``: the concatenation of all shards
of a split is cut into sequences of ``seq_len + 1`` tokens starting every ``seq_len`` tokens (documents are
packed across sequence boundaries), shifted by one into input and target. Training sequences are shuffled;
validation sequences come in order.
"""

from __future__ import annotations

import gzip
import hashlib
import itertools
import json
import os
from collections.abc import Iterator
from pathlib import Path

import lightning as L
import numpy as np
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from datamodules.text_lm import (
    PackedSequences,
    TokenFileWriter,
    TokenStream,
    loader_kwargs,
    packed_train_loader,
    token_dtype,
    write_json_atomic,
)

BOS_NAMES = ("<s>", "<|begin_of_text|>", "<bos>", "[BOS]", "<|endoftext|>")
EOS_NAMES = ("</s>", "<|end_of_text|>", "<eos>", "[EOS]", "<|endoftext|>")
_ENCODE_BATCH = 1024  # documents per call of the tokenizer's multi-threaded batch encoder


class DocumentTokenizer:
    """A SentencePiece ``.model`` or a Hugging Face ``tokenizer.json`` behind one interface: ``vocab_size``,
    ``bos_id``, ``eos_id`` and ``encode_batch(texts) -> list[list[int]]`` (no special tokens added)."""

    def __init__(self, path: str | os.PathLike, bos_token: str | None = None, eos_token: str | None = None):
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(
                f"tokenizer {self.path} does not exist: give a SentencePiece .model or a Hugging Face "
                "tokenizer.json (e.g. the Llama 2 tokenizer.model the paper used)"
            )
        self.digest = hashlib.sha1(self.path.read_bytes()).hexdigest()[:12]
        if self.path.suffix == ".json":
            from tokenizers import Tokenizer

            self._hf = Tokenizer.from_file(str(self.path))
            self._sp = None
            self.vocab_size = self._hf.get_vocab_size(with_added_tokens=True)
            self.bos_id = self._special_id(bos_token, BOS_NAMES, "bos_token")
            self.eos_id = self._special_id(eos_token, EOS_NAMES, "eos_token")
        else:
            import sentencepiece as spm

            self._hf = None
            self._sp = spm.SentencePieceProcessor(model_file=str(self.path))
            self.vocab_size = self._sp.get_piece_size()
            self.bos_id = self._sp_special_id(bos_token, self._sp.bos_id(), "bos_token")
            self.eos_id = self._sp_special_id(eos_token, self._sp.eos_id(), "eos_token")

    def _sp_special_id(self, given: str | None, default: int, arg: str) -> int:
        token_id = self._sp.piece_to_id(given) if given else default
        if given and self._sp.id_to_piece(token_id) != given:  # piece_to_id answers unk for unknown pieces
            raise ValueError(f"tokenizer {self.path} has no piece {given!r} (from {arg})")
        if token_id < 0:
            raise ValueError(f"SentencePiece model {self.path} defines no {arg[:3].upper()}; pass {arg}")
        return token_id

    def _special_id(self, given: str | None, names: tuple[str, ...], arg: str) -> int:
        for name in (given,) if given else names:
            token_id = self._hf.token_to_id(name)
            if token_id is not None:
                return token_id
        wanted = f"{given!r} (from {arg})" if given else f"any of {names}; name its special token with {arg}"
        raise ValueError(f"tokenizer {self.path} has no token {wanted}")

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        if self._sp is not None:
            return self._sp.encode(texts, num_threads=os.cpu_count() or 1)
        return [e.ids for e in self._hf.encode_batch(texts, add_special_tokens=False)]


def _documents(path: Path, text_field: str) -> Iterator[str]:
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            record = json.loads(line)
            if text_field not in record:
                raise ValueError(f"{path}:{number} has no field {text_field!r} (fields: {sorted(record)})")
            yield record[text_field]


class PretrainDataModule(L.LightningDataModule):
    """Packed-sequence LLM pretraining data; see the module docstring for the layout and batch format."""

    def __init__(
        self,
        data_dir: str,
        tokenizer_path: str,
        batch_size: int = 1,
        num_workers: int = 0,
        seed: int = 0,
        seq_len: int = 4096,
        patterns: str | list[str] | tuple[str, ...] = ("**/*.jsonl", "**/*.jsonl.gz"),
        val_fraction: float = 0.001,
        val_seed: int = 0,
        text_field: str = "text",
        bos_token: str | None = None,
        eos_token: str | None = None,
        eval_batch_size: int | None = None,
        cache_dir: str | None = None,
    ):
        """
        Args:
            data_dir: folder the glob ``patterns`` are relative to (absolute patterns are allowed too).
            tokenizer_path: SentencePiece ``.model`` or Hugging Face ``tokenizer.json``.
            batch_size: training sequences per batch (per device).
            seed: seeds the training order (resumable mid-epoch).
            seq_len: tokens per training sequence (the paper's 7B: 32768).
            patterns: glob pattern(s) of input files; only ``.jsonl`` / ``.jsonl.gz`` matches are read.
            val_fraction: probability that a document is held out for validation, in (0, 1).
            val_seed: seeds which documents are held out (part of the shard key: changing it re-tokenises).
            text_field: JSON field that holds a document.
            bos_token, eos_token: special tokens of a Hugging Face tokenizer whose names are not the usual ones.
            eval_batch_size: validation batch size (default ``batch_size``).
            cache_dir: token shards (default ``<data_dir>/cache/pretrain``).
        """
        super().__init__()
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
        self.data_dir = Path(data_dir)
        self.tokenizer_path = tokenizer_path
        self.patterns = [patterns] if isinstance(patterns, str) else list(patterns)
        self.cache_dir = Path(cache_dir) if cache_dir else self.data_dir / "cache" / "pretrain"
        self.batch_size = batch_size
        self.eval_batch_size = eval_batch_size or batch_size
        self.num_workers = num_workers
        self.seed = seed
        self.seq_len = seq_len
        self.val_fraction = val_fraction
        self.val_seed = val_seed
        self.text_field = text_field
        self.special_tokens = (bos_token, eos_token)
        self._tokenizer: DocumentTokenizer | None = None
        self.streams: dict[str, TokenStream] = {}

    @property
    def tokenizer(self) -> DocumentTokenizer:
        if self._tokenizer is None:
            self._tokenizer = DocumentTokenizer(self.tokenizer_path, *self.special_tokens)
        return self._tokenizer

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    @property
    def token_dir(self) -> Path:
        return self.cache_dir / f"tokens_{self.tokenizer.digest}"

    def input_files(self) -> list[Path]:
        """Sorted, de-duplicated ``.jsonl``/``.jsonl.gz`` files matching ``patterns``."""
        found = set()
        for pattern in self.patterns:
            base = Path(pattern) if Path(pattern).is_absolute() else self.data_dir / pattern
            anchor = Path(base.anchor)
            for path in anchor.glob(str(base.relative_to(anchor))):
                if path.is_file() and (path.name.endswith(".jsonl") or path.name.endswith(".jsonl.gz")):
                    found.add(path.resolve())
        if not found:
            raise FileNotFoundError(
                f"no pretraining files: nothing matches {self.patterns} under {self.data_dir}. Expected JSON "
                f"lines files (.jsonl or .jsonl.gz) with one document per line in the field {self.text_field!r}."
            )
        return sorted(found)

    def _shard_key(self, path: Path) -> str:
        stat = path.stat()
        ident = (
            f"{path}|{stat.st_size}|{stat.st_mtime_ns}|{self.val_fraction}|{self.val_seed}|{self.text_field}"
        )
        return f"{path.name.split('.')[0][:40]}-{hashlib.sha1(ident.encode()).hexdigest()[:12]}"

    # ------------------------------------------------------------------ cache
    def prepare_data(self) -> None:
        """Tokenises every input file not tokenised yet (one shard pair per file; idempotent)."""
        files = self.input_files()
        todo = [p for p in files if not (self.token_dir / f"{self._shard_key(p)}.json").is_file()]
        if not todo:
            return
        tok = self.tokenizer
        dtype = token_dtype(tok.vocab_size)
        bar = tqdm(desc="tokenising pretraining corpus", unit=" docs", mininterval=2)
        for path in todo:
            key = self._shard_key(path)
            # One generator per file, keyed by the file's identity: a document's split does not depend on
            # which other files are present or in what order they are processed.
            rng = np.random.default_rng([self.val_seed, int(key.rsplit("-", 1)[1], 16)])
            counts = {"train": [0, 0], "val": [0, 0]}  # documents, tokens
            with (
                TokenFileWriter(self.token_dir / f"{key}.train.bin", dtype) as train,
                TokenFileWriter(self.token_dir / f"{key}.val.bin", dtype) as val,
            ):
                writers = {"train": train, "val": val}
                batch: list[str] = []
                for text in itertools.chain(_documents(path, self.text_field), [None]):  # None: flush
                    if text is not None:
                        batch.append(text)
                    if len(batch) < _ENCODE_BATCH and text is not None:
                        continue
                    held_out = rng.random(len(batch)) < self.val_fraction
                    for ids, is_val in zip(tok.encode_batch(batch), held_out):
                        split = "val" if is_val else "train"
                        writers[split].write(np.asarray([tok.bos_id, *ids, tok.eos_id], dtype=np.int64))
                        counts[split][0] += 1
                    bar.update(len(batch))
                    batch = []
                for split in counts:
                    counts[split][1] = writers[split].num_tokens
            write_json_atomic(
                self.token_dir / f"{key}.json",
                {
                    "source": str(path),
                    "dtype": dtype.name,
                    "documents": {s: c[0] for s, c in counts.items()},
                    "tokens": {s: c[1] for s, c in counts.items()},
                },
            )
        bar.close()

    # ------------------------------------------------------------------ Lightning
    def setup(self, stage: str | None = None) -> None:
        self.prepare_data()
        keys = [self._shard_key(p) for p in self.input_files()]
        dtype = token_dtype(self.tokenizer.vocab_size)
        for split in ("train", "val"):
            self.streams[split] = TokenStream([self.token_dir / f"{k}.{split}.bin" for k in keys], dtype)
            if len(self.streams[split]) < self.seq_len + 1:
                raise ValueError(
                    f"the {split} split holds {len(self.streams[split])} tokens, fewer than one sequence of "
                    f"seq_len + 1 = {self.seq_len + 1}; add data or change val_fraction ({self.val_fraction})"
                )

    def train_dataloader(self) -> DataLoader:
        dataset = PackedSequences(self.streams["train"], self.seq_len)
        return packed_train_loader(dataset, self.batch_size, self.num_workers, self.seed)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(
            PackedSequences(self.streams["val"], self.seq_len),
            batch_size=self.eval_batch_size,
            shuffle=False,
            **loader_kwargs(self.num_workers),
        )
