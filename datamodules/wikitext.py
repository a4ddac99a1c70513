"""WikiText-103, word level (Merity et al. 2016), as Mega and Megalodon train on it.

Layout (docs/data.md#wikitext-103): ``<data_dir>/wikitext-103/wiki.{train,valid,test}.tokens``, already tokenised, one paragraph
per line; every line (blank ones included) ends with an ``<eos>`` token, as in fairseq. The vocabulary is
every word of the training file, sorted by frequency, most frequent first (so adaptive-softmax cutoffs
20000 / 60000 split it into frequency bands), ties broken alphabetically; it is cached as
``<cache_dir>/vocab.txt`` (``word count`` per line, fairseq's ``dict.txt`` format) and each split as
``<cache_dir>/<split>.bin`` (token ids, memory-mapped).

Training: ``{"input": [B, L] int64, "target": [B, L] int64}`` where ``L = seq_len`` (non-overlapping blocks of
the training stream, shuffled), or, when ``min_chunks``/``max_chunks`` are given, ``L`` a random multiple of
``chunk_size`` per batch (Mega's 2–6 chunks). Evaluation (val = ``valid``, test = ``test``): the split as ONE
stream, fed in order with batch size 1 as consecutive segments ``{"input": [1, S], "target": [1, S],
"first_segment": [1] bool}`` (True only for the first segment), so the model carries its streaming cache
across segments. The stream starts with an ``<eos>`` as context, so the targets are exactly the split's
tokens; every token is a word (``<eos>`` included, as is usual for WikiText-103), so each segment's ``words``
is its target count and ``ppl = exp(NLL of the scored tokens / number of scored tokens)`` for the whole split
(``num_words[split]`` = its token count) or any prefix of it.

Training batches resume mid-epoch exactly (fixed length: a :class:`ResumableSampler` order; variable length:
each batch drawn from ``(seed, epoch, batch index)``), their position saved in Lightning checkpoints.
The cache records the signature of the three files it was built from (``common.source_signature``): a changed
file builds it again. Caches go to ``cache_dir``, else ``<data_dir>/cache/wikitext-103`` when writable, else a per-user cache
(:func:`~datamodules.common.cache_dir_for`). Unreadable input (not UTF-8, an empty split file) raises a
:class:`~datamodules.DataError` naming the file at set-up.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import lightning as L
import numpy as np
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from datamodules.common import (
    cache_dir_for,
    read_json,
    source_signature,
    sweep_partial_files,
    write_text_atomic,
)
from datamodules.errors import DataError
from datamodules.text_lm import (
    MissingDataError,
    PackedSequences,
    StreamSegments,
    TokenFileWriter,
    TokenStream,
    VariableLengthBatches,
    check_token_file,
    decode_utf8,
    eval_stream_rank,
    mean_batches_per_epoch,
    packed_train_loader,
    token_dtype,
    trainer_rank,
    variable_length_loader,
    write_json_atomic,
)

EOS = "<eos>"
UNK = "<unk>"
SPLIT_FILES = {"train": "wiki.train.tokens", "val": "wiki.valid.tokens", "test": "wiki.test.tokens"}
SOURCE = "https://s3.amazonaws.com/research.metamind.io/wikitext/wikitext-103-v1.zip (or Hugging Face Salesforce/wikitext)"


def read_lines(path: str | os.PathLike, desc: str) -> Iterator[str]:
    """The lines of a WikiText-103 split file; a :class:`DataError` naming the file (and line) when it is empty
    or not UTF-8."""
    if os.path.getsize(path) == 0:
        raise DataError(
            f"{path} is empty: expected WikiText-103 text (one paragraph per line); re-download it"
        )
    try:
        with open(path, encoding="utf-8") as f, tqdm(f, desc=desc, unit=" lines", mininterval=2) as bar:
            yield from bar
    except UnicodeDecodeError:
        with open(path, "rb") as f:  # find the line for the message
            for number, raw in enumerate(f, 1):
                decode_utf8(raw, path, number)
        raise


def build_vocabulary(train_file: str | os.PathLike) -> list[tuple[str, int]]:
    """``(word, count)`` for every word of the training file plus ``<eos>`` (one per line), by count
    descending then alphabetically; ``<unk>`` is appended with count 0 if the file never uses it."""
    counts: Counter[str] = Counter()
    for line in read_lines(train_file, "wikitext-103 vocabulary"):
        counts.update(line.split())
        counts[EOS] += 1
    counts.setdefault(UNK, 0)
    return sorted(counts.items(), key=lambda wc: (-wc[1], wc[0]))


class WikiText103DataModule(L.LightningDataModule):
    """WikiText-103 word-level language modelling; see the module docstring for the batch formats."""

    task = "lm"  # the data contract (config checks it against task and model.*)
    input_type = "token"

    def __init__(
        self,
        data_dir: str,
        batch_size: int = 1,
        num_workers: int = 0,
        seed: int = 0,
        seq_len: int = 6144,
        eval_seq_len: int | None = None,
        chunk_size: int | None = None,
        min_chunks: int | None = None,
        max_chunks: int | None = None,
        cache_dir: str | None = None,
    ):
        """
        Args:
            data_dir: folder holding ``wikitext-103/``.
            batch_size: training sequences per batch.
            seed: training order (fixed length: resumable mid-epoch; variable length: mixed into the draws).
            seq_len: training block length (tokens) when the length is fixed; 6144 = 3 chunks of 2048.
            eval_seq_len: evaluation segment length (default ``seq_len``).
            chunk_size, min_chunks, max_chunks: when both chunk counts are given, each training batch has
                length ``k * chunk_size`` with ``k`` uniform in ``[min_chunks, max_chunks]`` (``seq_len`` unused).
            cache_dir: where the vocabulary and token files go (default ``<data_dir>/cache/wikitext-103``, or a
                per-user cache when the data directory is read-only).
        """
        super().__init__()
        variable = min_chunks is not None or max_chunks is not None
        if variable and (chunk_size is None or min_chunks is None or max_chunks is None):
            raise ValueError(
                "variable-length training needs chunk_size, min_chunks and max_chunks together, got "
                f"chunk_size={chunk_size}, min_chunks={min_chunks}, max_chunks={max_chunks}"
            )
        self.data_dir = Path(data_dir)
        self.root = self.data_dir / "wikitext-103"
        self.cache_dir = cache_dir_for(self.data_dir, "wikitext-103", cache_dir or None)
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.seed = seed
        self.seq_len = seq_len
        self.eval_seq_len = eval_seq_len or seq_len
        self.chunk_size = chunk_size
        self.chunks = (min_chunks, max_chunks) if variable else None
        self._vocab: list[str] | None = None
        self.num_words: dict[str, int] = {}
        self.streams: dict[str, TokenStream] = {}

    # ------------------------------------------------------------------ cache
    def _check_layout(self) -> None:
        missing = [name for name in SPLIT_FILES.values() if not (self.root / name).is_file()]
        if missing:
            raise MissingDataError(
                f"WikiText-103 not found: missing {', '.join(str(self.root / m) for m in missing)}. Expected "
                f"{self.root}/wiki.{{train,valid,test}}.tokens (word level, 'wikitext-103' not the raw "
                f"variant). Get it from {SOURCE} and unpack it into {self.data_dir}."
            )

    def _token_file(self, split: str) -> Path:
        return self.cache_dir / f"{split}.bin"

    def _drop_stale_cache(self) -> str:
        """The three token files' signature (``common.source_signature``); a cache built from other files (or
        before it was recorded) is removed, so that a changed split is read again."""
        sources = source_signature([self.root / n for n in SPLIT_FILES.values()], self.root)
        meta_path = self.cache_dir / "meta.json"
        sweep_partial_files(self.cache_dir)
        if meta_path.is_file() and (read_json(meta_path) or {}).get("sources") != sources:
            print(f"[mega-suite] {self.root} changed since {self.cache_dir} was built: building it again")
            for name in ("meta.json", "vocab.txt"):
                (self.cache_dir / name).unlink(missing_ok=True)
            self._vocab = None
        return sources

    def prepare_data(self) -> None:
        """Builds the vocabulary and the token files once (idempotent; run on one process per node), again
        when a split file changed since."""
        self._check_layout()
        sources = self._drop_stale_cache()
        vocab = self.vocabulary
        meta_path = self.cache_dir / "meta.json"
        if meta_path.is_file():
            return
        index = {word: i for i, word in enumerate(vocab)}
        unk = index[UNK]
        eos = index[EOS]
        dtype = token_dtype(len(vocab))
        num_words = {}
        for split, name in SPLIT_FILES.items():
            with TokenFileWriter(self._token_file(split), dtype) as writer:
                buffer: list[int] = []
                for line in read_lines(self.root / name, f"tokenising wikitext-103 {split}"):
                    buffer.extend(index.get(word, unk) for word in line.split())
                    buffer.append(eos)
                    if len(buffer) > 1 << 20:
                        writer.write(np.asarray(buffer, dtype=np.int64))
                        buffer.clear()
                writer.write(np.asarray(buffer, dtype=np.int64))
            num_words[split] = writer.num_tokens
        write_json_atomic(
            meta_path,
            {"sources": sources, "vocab_size": len(vocab), "dtype": dtype.name, "num_words": num_words},
        )

    @property
    def vocabulary(self) -> list[str]:
        """Words by frequency rank (index = token id); built from the training file on first use."""
        if self._vocab is None:
            self._check_layout()
            path = self.cache_dir / "vocab.txt"
            if not path.is_file():
                counts = build_vocabulary(self.root / SPLIT_FILES["train"])
                write_text_atomic(path, "".join(f"{w} {c}\n" for w, c in counts))
            with open(path, encoding="utf-8") as f:
                self._vocab = [line.split(" ")[0] for line in f]
        return self._vocab

    @property
    def vocab_size(self) -> int:
        return len(self.vocabulary)

    @property
    def eos_id(self) -> int:
        return self.vocabulary.index(EOS)

    # ------------------------------------------------------------------ Lightning
    def setup(self, stage: str | None = None) -> None:
        self.prepare_data()
        meta = json.loads((self.cache_dir / "meta.json").read_text())
        self.num_words = meta["num_words"]
        dtype = np.dtype(meta["dtype"])
        for split in SPLIT_FILES:
            check_token_file(self._token_file(split), dtype, self.num_words[split], self.cache_dir)
        self.streams = {split: TokenStream([self._token_file(split)], dtype) for split in SPLIT_FILES}

    def train_dataloader(self) -> DataLoader:
        stream = self.streams["train"]
        if self.chunks is None:
            return packed_train_loader(
                PackedSequences(stream, self.seq_len), self.batch_size, self.num_workers, self.seed
            )
        _, world_size = trainer_rank(self)
        lo, hi = self.chunks
        per_rank = mean_batches_per_epoch(
            len(stream), self.batch_size, (lo + hi) / 2 * self.chunk_size, world_size
        )
        dataset = VariableLengthBatches(
            stream, self.batch_size, self.chunk_size, lo, hi, per_rank * world_size, seed=self.seed
        )
        return variable_length_loader(dataset, self.num_workers)

    def _eval_loader(self, split: str) -> DataLoader:
        # A leading <eos> (the end of the "previous line") is the context of token 0, so that every token of
        # the split is a target and the targets number exactly num_words[split].
        stream = _PrefixedStream(self.streams[split], self.eos_id)
        word_ends = np.ones(len(stream), dtype=np.uint8)  # every token is a word ...
        word_ends[0] = 0  # ... but the leading context <eos> is not scored
        rank, world = eval_stream_rank(self)  # one document: rank 0 reads it, the others pad
        dataset = StreamSegments(
            stream, [(0, len(stream))], self.eval_seq_len, word_ends=word_ends, rank=rank, world=world
        )
        return DataLoader(dataset, batch_size=None, num_workers=0)

    def val_dataloader(self) -> DataLoader:
        return self._eval_loader("val")

    def test_dataloader(self) -> DataLoader:
        return self._eval_loader("test")


class _PrefixedStream:
    """A :class:`TokenStream` with one extra token in front (the ``<eos>`` that gives token 0 a context)."""

    def __init__(self, stream: TokenStream, first: int):
        self.stream = stream
        self.first = first

    def __len__(self) -> int:
        return len(self.stream) + 1

    def read(self, start: int, stop: int) -> np.ndarray:
        if start > 0:
            return self.stream.read(start - 1, stop - 1)
        return np.concatenate([np.array([self.first], dtype=np.int64), self.stream.read(0, stop - 1)])
