"""LLM pretraining corpora: JSON-lines documents, tokenised once, packed into fixed-length sequences.

Layout (docs/data.md#pretraining-corpora): files matching ``patterns`` under ``data_dir`` (``.jsonl`` or ``.jsonl.gz``), one JSON
object per line with the document in ``text_field`` (default ``"text"``). Tokenizer by path: a SentencePiece
``.model`` or a Hugging Face ``tokenizer.json`` (BOS/EOS found among the usual names, or given as
``bos_token``/``eos_token``); without one, a SentencePiece model trained on the training documents only,
cached under a key of the corpus's content (``trained_tokenizer_path``). Each input file is tokenised once into two memory-mapped shards under
``<cache_dir>/tokens_<tokenizer hash>/``: ``<key>.train.bin`` and ``<key>.val.bin`` (``uint16`` when the
vocabulary has at most 65536 ids, else ``uint32``), where ``<key>`` hashes the file's path, size and mtime and
the split settings, so adding files tokenises only the new ones (the key only names the cache; it never
decides the split). Every document is written as ``BOS tokens EOS``.

The held-out set is defined by content alone: a document goes to validation iff
``u(text) = int(BLAKE2b-64(text as UTF-8, key=str(split_seed))) / 2^64 < val_fraction``. So the same corpus
gives the same split in any directory, after a copy or ``touch``, in any file order and whatever the
training ``seed``; identical documents always land in the same split (no exact-duplicate leak between them).

Training batches resume mid-epoch exactly (a :class:`ResumableSampler` order saved in Lightning checkpoints).
Caches go to ``cache_dir``, else ``<data_dir>/cache/pretrain`` when writable, else a per-user cache
(:func:`~datamodules.common.cache_dir_for`). Bad input raises a :class:`~datamodules.DataError` at
set-up naming the file and line: not UTF-8, not a JSON object, no ``text_field`` or not a string, a file with
no documents, a truncated or corrupt ``.gz``; as does a split too small for one sequence (naming
``data.options.val_fraction``) and a missing tokenizer.

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
import zlib
from collections.abc import Iterator
from pathlib import Path

import lightning as L
import numpy as np
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from datamodules.common import cache_dir_for, read_json, sweep_partial_files
from datamodules.errors import DataError
from datamodules.text_lm import (
    MissingDataError,
    PackedSequences,
    TokenFileWriter,
    TokenStream,
    check_token_file,
    decode_utf8,
    loader_kwargs,
    packed_train_loader,
    token_dtype,
    train_sentencepiece,
    write_json_atomic,
)

BOS_NAMES = ("<s>", "<|begin_of_text|>", "<bos>", "[BOS]", "<|endoftext|>")
EOS_NAMES = ("</s>", "<|end_of_text|>", "<eos>", "[EOS]", "<|endoftext|>")
_ENCODE_BATCH = 1024  # documents per call of the tokenizer's multi-threaded batch encoder
_SHARD_FORMAT = 2  # 2: content-defined split
_TOKENIZER_FORMAT = 1  # part of a trained tokenizer's cache key


def held_out(text: str, split_seed: int, val_fraction: float) -> bool:
    """Whether a document belongs to validation: ``BLAKE2b-64(text, key=split_seed) / 2^64 < val_fraction``."""
    digest = hashlib.blake2b(
        text.encode("utf-8", "surrogatepass"), digest_size=8, key=str(split_seed).encode()
    ).digest()
    return int.from_bytes(digest, "little") / 2**64 < val_fraction


class DocumentTokenizer:
    """A SentencePiece ``.model`` or a Hugging Face ``tokenizer.json`` behind one interface: ``vocab_size``,
    ``bos_id``, ``eos_id`` and ``encode_batch(texts) -> list[list[int]]`` (no special tokens added)."""

    def __init__(self, path: str | os.PathLike, bos_token: str | None = None, eos_token: str | None = None):
        self.path = Path(path)
        if not self.path.is_file():
            raise MissingDataError(
                f"data.options.tokenizer_path={self.path} does not exist: give a SentencePiece .model or a "
                "Hugging Face tokenizer.json (e.g. the Llama 2 tokenizer.model the paper used)"
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
            raise DataError(f"tokenizer {self.path} has no piece {given!r} (from data.options.{arg})")
        if token_id < 0:
            raise DataError(
                f"SentencePiece model {self.path} defines no {arg[:3].upper()}; set data.options.{arg}"
            )
        return token_id

    def _special_id(self, given: str | None, names: tuple[str, ...], arg: str) -> int:
        for name in (given,) if given else names:
            token_id = self._hf.token_to_id(name)
            if token_id is not None:
                return token_id
        wanted = (
            f"{given!r} (from data.options.{arg})"
            if given
            else f"any of {names}; name its special token with data.options.{arg}"
        )
        raise DataError(f"tokenizer {self.path} has no token {wanted}")

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        if self._sp is not None:
            return self._sp.encode(texts, num_threads=os.cpu_count() or 1)
        return [e.ids for e in self._hf.encode_batch(texts, add_special_tokens=False)]


def training_text(files: list[Path], text_field: str, split_seed: int, val_fraction: float) -> Iterator[str]:
    """The lines a tokenizer trained for this corpus learns from: the non-empty lines of the training
    documents only (``held_out`` ones never reach it), in file then document order."""
    for path in files:
        for text in _documents(path, text_field):
            if not held_out(text, split_seed, val_fraction):
                yield from (line for line in map(str.strip, text.splitlines()) if line)


def _documents(path: Path, text_field: str) -> Iterator[str]:
    """The documents of a JSON-lines file (blank lines skipped); a :class:`DataError` naming the file and line
    for anything else than a JSON object whose ``text_field`` is a string, for a file with no documents and
    for a truncated or corrupt compressed file."""
    opener = gzip.open if path.name.endswith(".gz") else open
    count = 0
    number = 0
    try:
        with opener(path, "rb") as f:
            for number, raw in enumerate(f, 1):
                line = decode_utf8(raw, path, number)
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise DataError(
                        f"{path}:{number} is not a JSON object ({exc.msg}); truncated or corrupt line"
                    ) from None
                if not isinstance(record, dict):
                    raise DataError(f"{path}:{number} is not a JSON object but a {type(record).__name__}")
                if text_field not in record:
                    raise DataError(
                        f"{path}:{number} has no field {text_field!r} (fields: {sorted(record)}); set "
                        "data.options.text_field to the field that holds the document"
                    )
                text = record[text_field]
                if not isinstance(text, str):
                    raise DataError(
                        f"{path}:{number} field {text_field!r} is a {type(text).__name__}, expected a string"
                    )
                count += 1
                yield text
    except (EOFError, zlib.error, gzip.BadGzipFile) as exc:
        raise DataError(
            f"{path} cannot be read past line {number}: {exc}; the file is truncated or corrupt: re-download or "
            "remove it"
        ) from None
    if count == 0:
        raise DataError(f"{path} holds no documents (an empty file?): expected one JSON object per line")


class PretrainDataModule(L.LightningDataModule):
    """Packed-sequence LLM pretraining data; see the module docstring for the layout and batch format."""

    task = "lm"  # the data contract (config checks it against task and model.*)
    input_type = "token"

    def __init__(
        self,
        data_dir: str,
        tokenizer_path: str | None = None,
        batch_size: int = 1,
        num_workers: int = 0,
        seed: int = 0,
        seq_len: int = 4096,
        patterns: str | list[str] | tuple[str, ...] = ("**/*.jsonl", "**/*.jsonl.gz"),
        val_fraction: float = 0.001,
        split_seed: int = 0,
        text_field: str = "text",
        bos_token: str | None = None,
        eos_token: str | None = None,
        eval_batch_size: int | None = None,
        cache_dir: str | None = None,
        vocab_size: int = 32000,
        spm_model_type: str = "unigram",
        byte_fallback: bool = True,
        spm_input_sentence_size: int = 5_000_000,
    ):
        """
        Args:
            data_dir: folder the glob ``patterns`` are relative to (absolute patterns are allowed too).
            tokenizer_path: SentencePiece ``.model`` or Hugging Face ``tokenizer.json``; None trains a
                SentencePiece model on the training split (``trained_tokenizer_path``).
            batch_size: training sequences per batch (per device).
            seed: seeds the training order (resumable mid-epoch); never the split.
            seq_len: tokens per training sequence (the paper's 7B: 32768).
            patterns: glob pattern(s) of input files; only ``.jsonl`` / ``.jsonl.gz`` matches are read.
            val_fraction: the fraction of documents held out for validation, in (0, 1) (chosen by content
                hash, see the module docstring).
            split_seed: keys the content hash that picks the held-out documents (part of the shard key:
                changing it re-tokenises).
            text_field: JSON field that holds a document.
            bos_token, eos_token: special tokens of a Hugging Face tokenizer whose names are not the usual ones.
            eval_batch_size: validation batch size (default ``batch_size``).
            cache_dir: token shards (default ``<data_dir>/cache/pretrain``, or a per-user cache when the data
                directory is read-only).
            vocab_size, spm_model_type, byte_fallback, spm_input_sentence_size: the SentencePiece model trained
                when no ``tokenizer_path`` is given.
        """
        super().__init__()
        if not 0.0 < val_fraction < 1.0:
            raise DataError(f"data.options.val_fraction must be in (0, 1), got {val_fraction}")
        self.data_dir = Path(data_dir)
        self.tokenizer_path = tokenizer_path
        self.patterns = [patterns] if isinstance(patterns, str) else list(patterns)
        self.cache_dir = cache_dir_for(self.data_dir, "pretrain", cache_dir or None)
        self.batch_size = batch_size
        self.eval_batch_size = eval_batch_size or batch_size
        self.num_workers = num_workers
        self.seed = seed
        self.seq_len = seq_len
        self.val_fraction = val_fraction
        self.split_seed = split_seed
        self.text_field = text_field
        self.special_tokens = (bos_token, eos_token)
        self.spm_options = dict(
            vocab_size=vocab_size,
            model_type=spm_model_type,
            byte_fallback=byte_fallback,
            input_sentence_size=spm_input_sentence_size,
        )
        self._tokenizer: DocumentTokenizer | None = None
        self.streams: dict[str, TokenStream] = {}

    @property
    def tokenizer(self) -> DocumentTokenizer:
        if self._tokenizer is None:
            self._tokenizer = DocumentTokenizer(self.tokenizer_file, *self.special_tokens)
        return self._tokenizer

    @property
    def tokenizer_file(self) -> Path:
        """The tokenizer the run uses: ``tokenizer_path``, or the one trained on this corpus (trained now if
        absent)."""
        if self.tokenizer_path is not None:
            return Path(self.tokenizer_path)
        path = self.trained_tokenizer_path()
        if not path.is_file():
            print(f"[mega-suite] training a SentencePiece tokenizer on the training split: {path}")
            lines = training_text(
                self._files_by_content(), self.text_field, self.split_seed, self.val_fraction
            )
            train_sentencepiece(lines, path, **self.spm_options)
        return path

    def trained_tokenizer_path(self) -> Path:
        """``<cache_dir>/tokenizer_<key>/spm_<type>_<vocab>.model``; the key hashes the input files' contents
        (not their names or times), the split settings and the SentencePiece options."""
        digests = sorted(self._content_digests().values())
        ident = json.dumps(
            [
                digests,
                self.val_fraction,
                self.split_seed,
                self.text_field,
                self.spm_options,
                _TOKENIZER_FORMAT,
            ]
        )
        key = hashlib.sha1(ident.encode()).hexdigest()[:12]
        o = self.spm_options
        return self.cache_dir / f"tokenizer_{key}" / f"spm_{o['model_type']}_{o['vocab_size']}.model"

    def _content_digests(self) -> dict[Path, str]:
        """SHA-256 of each input file's bytes, remembered by path, size and mtime (read once per change)."""
        memo_path = self.cache_dir / "content_digests.json"
        memo = read_json(memo_path) or {}
        out, changed = {}, False
        for path in self.input_files():
            stat = path.stat()
            ident = f"{path}|{stat.st_size}|{stat.st_mtime_ns}"
            if ident not in memo:
                h = hashlib.sha256()
                with open(path, "rb") as f:
                    for block in iter(lambda: f.read(1 << 20), b""):
                        h.update(block)
                memo[ident], changed = h.hexdigest(), True
            out[path] = memo[ident]
        if changed:
            write_json_atomic(memo_path, memo)
        return out

    def _files_by_content(self) -> list[Path]:
        """The input files in the order of their contents' digests: the training text does not depend on
        where the corpus lies or what its files are called."""
        digests = self._content_digests()
        return sorted(digests, key=lambda p: (digests[p], str(p)))

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
            raise MissingDataError(
                f"no pretraining files: nothing matches {self.patterns} under {self.data_dir}. Expected JSON "
                f"lines files (.jsonl or .jsonl.gz) with one document per line in the field {self.text_field!r}."
            )
        return sorted(found)

    def _shard_key(self, path: Path) -> str:
        stat = path.stat()
        ident = (
            f"{path}|{stat.st_size}|{stat.st_mtime_ns}|{self.val_fraction}|{self.split_seed}|{self.text_field}"
            f"|{_SHARD_FORMAT}"
        )
        return f"{path.name.split('.')[0][:40]}-{hashlib.sha1(ident.encode()).hexdigest()[:12]}"

    # ------------------------------------------------------------------ cache
    def prepare_data(self) -> None:
        """Tokenises every input file not tokenised yet (one shard pair per file; idempotent)."""
        files = self.input_files()
        sweep_partial_files(self.cache_dir)
        sweep_partial_files(self.token_dir)
        todo = [p for p in files if not (self.token_dir / f"{self._shard_key(p)}.json").is_file()]
        if not todo:
            return
        tok = self.tokenizer
        dtype = token_dtype(tok.vocab_size)
        # the bar is closed on an error too, so that the error line starts a line of its own
        with tqdm(desc="tokenising pretraining corpus", unit=" docs", mininterval=2) as bar:
            for path in todo:
                key = self._shard_key(path)
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
                        held = [held_out(text, self.split_seed, self.val_fraction) for text in batch]
                        for ids, is_val in zip(tok.encode_batch(batch), held):
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

    # ------------------------------------------------------------------ Lightning
    def setup(self, stage: str | None = None) -> None:
        self.prepare_data()
        keys = [self._shard_key(p) for p in self.input_files()]
        dtype = token_dtype(self.tokenizer.vocab_size)
        for key in keys:
            meta = json.loads((self.token_dir / f"{key}.json").read_text())
            for split in ("train", "val"):
                path = self.token_dir / f"{key}.{split}.bin"
                check_token_file(path, dtype, meta["tokens"][split], path.with_suffix("").with_suffix(".*"))
        for split in ("train", "val"):
            self.streams[split] = TokenStream([self.token_dir / f"{k}.{split}.bin" for k in keys], dtype)
            if len(self.streams[split]) < self.seq_len + 1:
                raise DataError(
                    f"the {split} split holds {len(self.streams[split])} tokens, fewer than one sequence of "
                    f"data.options.seq_len + 1 = {self.seq_len + 1}: add data, raise or lower "
                    f"data.options.val_fraction (now {self.val_fraction}) or lower data.options.seq_len"
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
