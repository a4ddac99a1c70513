"""Shared language-model data machinery: memory-mapped token files, packed training sequences, streaming
evaluation segments.

Token files are raw little-endian arrays (``uint16`` when the vocabulary fits in 16 bits, else ``uint32``), the
nanoGPT ``train.bin`` format: written once through :class:`TokenFileWriter` (to a partial name, renamed on
success and removed otherwise, so an interrupted build never leaves a file behind) and read back through
:class:`TokenStream`, which opens its memory maps lazily in each process (a DataLoader worker pickles the
path, never the mapped data).

Batches (all ``int64``):

- training: ``{"input": [B, L], "target": [B, L]}`` with ``target[:, i] = stream[start + i + 1]``;
- streaming evaluation: ``{"input": [1, S], "target": [1, S], "first_segment": [1] bool, "words": [1]}``,
  consecutive segments of one document (or of a whole split for WikiText-103); ``first_segment`` is True where
  the model must reset its streaming cache (docs/architecture.md#streaming) before the segment; ``words`` (when the data set defines
  words) is the number of words the segment *completes*: words whose last token is one of its targets. Summed
  over any prefix of the segments it is exactly the number of words of the scored text, so word perplexity
  ``exp(sum NLL / sum words)`` stays right when evaluation stops early (``limit_val_batches``): a document
  cut mid-way counts the words of its scored part, a word cut mid-way is counted with the segment that
  scores its last token.

Every target is a real token (no ``-100`` padding): packing leaves no gaps, and a short last segment is simply
shorter.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info

from datamodules import common
from datamodules.common import (  # noqa: F401  (the atomic writers: imported from here too)
    ResumableDataLoader,
    ResumableSampler,
    write_bytes_atomic,
    write_json_atomic,
    write_text_atomic,
)
from datamodules.errors import DataError

log = logging.getLogger(__name__)


class MissingDataError(DataError, FileNotFoundError):
    """A data set, tokenizer or file that is not where the configuration says (also a FileNotFoundError)."""


def decode_utf8(raw: bytes, path: str | os.PathLike, line: int | None = None) -> str:
    """``raw`` decoded as UTF-8, or a :class:`DataError` naming the file, line and offending byte offset."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1 if line is None else line
        where = f"{path}:{line}"
        raise DataError(
            f"{where} is not valid UTF-8 (byte {raw[exc.start : exc.start + 1]!r} at offset {exc.start}); "
            "the file is corrupt or in another encoding: re-download it or convert it to UTF-8"
        ) from None


def check_token_file(path: Path, dtype: np.dtype, expected: int, rebuild: Path) -> None:
    """A cached token file must hold ``expected`` tokens; otherwise it is truncated or from another build."""
    size = path.stat().st_size if path.is_file() else -1
    if size != expected * np.dtype(dtype).itemsize:
        raise DataError(
            f"cached token file {path} holds {size} bytes, expected {expected} {np.dtype(dtype).name} tokens "
            f"({expected * np.dtype(dtype).itemsize} bytes): it is truncated or stale; delete {rebuild} to rebuild"
        )


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned dtype that holds every token id of a ``vocab_size`` vocabulary."""
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


class TokenFileWriter:
    """Appends token arrays to ``path`` (raw ``dtype`` values); the file appears under its name only on
    :meth:`close` after a clean exit of the ``with`` block. Until then it is ``common.partial_name(path)``,
    removed by whatever else ends the block (an error, ``KeyboardInterrupt``, ``SystemExit``)."""

    def __init__(self, path: str | os.PathLike, dtype: np.dtype):
        self.path = Path(path)
        self.dtype = np.dtype(dtype)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._tmp = common.partial_name(self.path)
        self._file = open(self._tmp, "wb")
        self.num_tokens = 0

    def write(self, tokens: np.ndarray | Sequence[int]) -> None:
        array = np.asarray(tokens)
        if array.size and (array.min() < 0 or array.max() > np.iinfo(self.dtype).max):
            raise ValueError(f"token ids outside [0, {np.iinfo(self.dtype).max}] for dtype {self.dtype}")
        self._file.write(array.astype(self.dtype, copy=False).tobytes())
        self.num_tokens += array.size

    def close(self) -> None:
        try:
            self._file.close()
            os.replace(self._tmp, self.path)
        finally:
            self._tmp.unlink(missing_ok=True)  # nothing left after the rename

    def abort(self) -> None:
        try:
            self._file.close()
        finally:
            self._tmp.unlink(missing_ok=True)

    def __enter__(self) -> TokenFileWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


class TokenStream:
    """The concatenation of one or more token files as one read-only stream of ``length`` tokens."""

    def __init__(self, paths: Sequence[str | os.PathLike], dtype: np.dtype):
        self.paths = [str(p) for p in paths]
        self.dtype = np.dtype(dtype)
        sizes = [os.path.getsize(p) // self.dtype.itemsize for p in self.paths]
        self.offsets = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])  # file k holds [o_k, o_k+1)
        self.length = int(self.offsets[-1])
        self._maps: list[np.ndarray] | None = None

    def __len__(self) -> int:
        return self.length

    def __getstate__(self):
        return {**self.__dict__, "_maps": None}

    def _open(self) -> list[np.ndarray]:
        if self._maps is None:
            # np.memmap refuses empty files; an empty shard contributes an empty array.
            self._maps = [
                np.memmap(p, dtype=self.dtype, mode="r") if os.path.getsize(p) else np.empty(0, self.dtype)
                for p in self.paths
            ]
        return self._maps

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens ``[start, stop)`` as ``int64``, crossing file boundaries where needed."""
        if not 0 <= start <= stop <= self.length:
            raise IndexError(f"token range [{start}, {stop}) outside a stream of {self.length} tokens")
        maps = self._open()
        first = int(np.searchsorted(self.offsets, start, side="right")) - 1
        pieces = []
        k = first
        while start < stop:
            local = start - int(self.offsets[k])
            take = min(stop, int(self.offsets[k + 1])) - start
            pieces.append(maps[k][local : local + take])
            start += take
            k += 1
        if not pieces:
            return np.empty(0, dtype=np.int64)
        return np.concatenate(pieces).astype(np.int64)


class PackedSequences(Dataset):
    """Non-overlapping training sequences of a packed stream: item ``i`` reads ``seq_len + 1`` tokens from
    ``i * seq_len`` (so consecutive items share one token and every token after the first is a target once);
    the tail shorter than a full item is dropped."""

    def __init__(self, stream: TokenStream, seq_len: int):
        if seq_len < 1:
            raise ValueError(f"seq_len must be positive, got {seq_len}")
        self.stream = stream
        self.seq_len = seq_len

    def __len__(self) -> int:
        return max(0, (len(self.stream) - 1) // self.seq_len)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(index)
        start = index * self.seq_len
        tokens = torch.from_numpy(self.stream.read(start, start + self.seq_len + 1))
        return {"input": tokens[:-1], "target": tokens[1:]}


class VariableLengthBatches(Dataset):
    """Whole training batches whose length is a random multiple of ``chunk_size``: batch ``i`` of epoch ``e``
    draws ``k ~ U{min_chunks..max_chunks}`` and ``batch_size`` window starts, uniform over the stream, from
    ``numpy.random.default_rng([seed, e, i])``, and reads windows of ``k * chunk_size + 1`` tokens (Mega's
    WikiText-103 recipe trains on 2–6 chunks).

    A map-style data set keyed by ``(epoch, i)``: a batch depends on nothing else (not on the global
    generator, the worker or the rank), so :func:`variable_length_loader` resumes it mid-epoch exactly.
    ``num_batches`` is the epoch's total over all ranks.
    """

    def __init__(
        self,
        stream: TokenStream,
        batch_size: int,
        chunk_size: int,
        min_chunks: int,
        max_chunks: int,
        num_batches: int,
        seed: int = 0,
    ):
        if not 1 <= min_chunks <= max_chunks:
            raise ValueError(f"need 1 <= min_chunks <= max_chunks, got {min_chunks}, {max_chunks}")
        if max_chunks * chunk_size + 1 > len(stream):
            raise DataError(
                f"data.options.max_chunks * chunk_size = {max_chunks * chunk_size} tokens do not fit the training "
                f"stream of {len(stream)} tokens: lower data.options.max_chunks or chunk_size"
            )
        self.stream = stream
        self.batch_size = batch_size
        self.chunk_size = chunk_size
        self.min_chunks = min_chunks
        self.max_chunks = max_chunks
        self.num_batches = num_batches
        self.seed = seed

    def __len__(self) -> int:
        return self.num_batches

    def __getitem__(self, key: tuple[int, int]) -> dict[str, torch.Tensor]:
        epoch, index = key
        rng = np.random.default_rng([self.seed, epoch, index])
        length = int(rng.integers(self.min_chunks, self.max_chunks + 1)) * self.chunk_size
        starts = rng.integers(0, len(self.stream) - length, size=self.batch_size)
        tokens = torch.from_numpy(np.stack([self.stream.read(s, s + length + 1) for s in starts]))
        return {"input": tokens[:, :-1], "target": tokens[:, 1:]}


class _EpochKeySampler(ResumableSampler):
    """A :class:`ResumableSampler` (in order, split across ranks) that yields ``(epoch, index)`` keys."""

    def indices(self, epoch: int) -> list[tuple[int, int]]:
        return [(epoch, i) for i in super().indices(epoch)]


def _single(items: list):
    return items[0]


def variable_length_loader(dataset: VariableLengthBatches, num_workers: int) -> ResumableDataLoader:
    """Loader of :class:`VariableLengthBatches` whose position (epoch, batches yielded) is saved in Lightning
    checkpoints, so a run resumes mid-epoch with exactly the batches the uninterrupted run would see."""
    sampler = _EpochKeySampler(len(dataset), seed=dataset.seed, shuffle=False)
    return ResumableDataLoader(dataset, 1, sampler, collate_fn=_single, **loader_kwargs(num_workers))


def mean_batches_per_epoch(num_tokens: int, batch_size: int, mean_len: float, world_size: int) -> int:
    """Batches each rank draws so that an epoch reads about as many tokens as the stream holds."""
    return max(1, math.floor(num_tokens / (batch_size * mean_len) / world_size))


class StreamSegments(IterableDataset):
    """Consecutive evaluation segments of documents, in order, for a model that carries a streaming cache.

    ``documents`` lists ``(start, stop)`` token ranges of the stream. In a document of ``n`` tokens the first
    token is context only (BOS, or WikiText-103's leading ``<eos>``): inputs are tokens ``[0, n - 1)``, targets
    ``[1, n)``, cut into segments of at most ``segment_len`` tokens; the first segment of each document has
    ``first_segment = True``. Iterable, so that Lightning never splits or reorders it. With ``world > 1``
    the documents are split across ranks (longest first to the least-loaded rank, by segment count; each
    rank reads its own in order) and every rank yields the same number of segments, padded with empty ones
    (one token, target -100, no words), so sharded models run the same collectives on every rank; the
    per-split totals are summed over the ranks (``CausalLM``). Use with ``DataLoader(dataset,
    batch_size=None, num_workers=0)``.

    ``word_ends`` (optional, one entry per stream position): how many words end at that token (the token that
    holds a word's last character). A segment with targets at positions ``[a + 1, b]`` then carries
    ``words = sum(word_ends[a + 1 : b + 1])``, the words it completes (see the module docstring).
    """

    def __init__(
        self,
        stream: TokenStream,
        documents: Sequence[tuple[int, int]],
        segment_len: int,
        word_ends: np.ndarray | None = None,
        rank: int = 0,
        world: int = 1,
    ):
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} is not in [0, world={world})")
        if segment_len < 1:
            raise ValueError(f"segment_len must be positive, got {segment_len}")
        if word_ends is not None and len(word_ends) != len(stream):
            raise ValueError(f"word_ends has {len(word_ends)} entries for a stream of {len(stream)} tokens")
        self.stream = stream
        self.documents = [(int(a), int(b)) for a, b in documents if b - a >= 2]
        self.segment_len = segment_len
        self.word_ends = word_ends
        self.rank, self.world = rank, world
        counts = [self._segments(d) for d in self.documents]
        loads, owner = [0] * world, [0] * len(self.documents)
        for i in sorted(range(len(counts)), key=lambda i: (-counts[i], i)):
            owner[i] = min(range(world), key=lambda r: (loads[r], r))
            loads[owner[i]] += counts[i]
        self.local_documents = [d for d, o in zip(self.documents, owner, strict=True) if o == rank]
        self.padding = max(loads) - loads[rank]

    def _segments(self, document: tuple[int, int]) -> int:
        a, b = document
        return math.ceil((b - a - 1) / self.segment_len)

    def __len__(self) -> int:
        return sum(self._segments(d) for d in self.local_documents) + self.padding

    @property
    def num_targets(self) -> int:
        """Tokens predicted over the whole split (every token of each document but its first)."""
        return sum(b - a - 1 for a, b in self.documents)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        if get_worker_info() is not None and get_worker_info().num_workers > 1:
            raise RuntimeError("StreamSegments must be read in order by one process (num_workers=0 or 1)")
        for start, stop in self.local_documents:
            for a in range(start, stop - 1, self.segment_len):
                b = min(a + self.segment_len, stop - 1)
                tokens = torch.from_numpy(self.stream.read(a, b + 1))
                segment = {
                    "input": tokens[None, :-1],
                    "target": tokens[None, 1:],
                    "first_segment": torch.tensor([a == start]),
                }
                if self.word_ends is not None:
                    segment["words"] = torch.tensor([int(self.word_ends[a + 1 : b + 1].sum())])
                yield segment
        for _ in range(self.padding):
            empty = {
                "input": torch.zeros(1, 1, dtype=torch.long),
                "target": torch.full((1, 1), -100, dtype=torch.long),
                "first_segment": torch.tensor([True]),
            }
            if self.word_ends is not None:
                empty["words"] = torch.tensor([0])
            yield empty


def loader_kwargs(num_workers: int) -> dict:
    """DataLoader options shared by the LM datamodules' loaders."""
    return {
        "num_workers": num_workers,
        "pin_memory": torch.cuda.is_available(),
        "persistent_workers": num_workers > 0,
    }


def packed_train_loader(
    dataset: Dataset, batch_size: int, num_workers: int, seed: int
) -> ResumableDataLoader:
    """Shuffled training batches whose order depends on ``(seed, epoch)`` only and whose position is saved in
    Lightning checkpoints, so a run resumes mid-epoch exactly (an LM epoch can be the whole run)."""
    sampler = ResumableSampler(len(dataset), seed=seed, shuffle=True)
    return ResumableDataLoader(dataset, batch_size, sampler, drop_last=True, **loader_kwargs(num_workers))


def trainer_rank(datamodule) -> tuple[int, int]:
    """``(global_rank, world_size)`` of the trainer a datamodule is attached to; ``(0, 1)`` without one."""
    trainer = getattr(datamodule, "trainer", None)
    if trainer is None:
        return 0, 1
    # chunk parallelism: the data-parallel coordinates, not the world's
    return common.declared_data_parallel() or (int(trainer.global_rank), int(trainer.world_size))


def eval_stream_rank(datamodule) -> tuple[int, int]:
    """``(rank, world)`` over which streamed evaluation documents (``StreamSegments``) are split: every rank of
    the world, chunk-parallel ones included. A streamed segment is short (one ``eval_seq_len``) and carries a
    cache from the previous one, so under chunk parallelism the ranks of a group score different documents
    rather than slices of the same one; the totals are summed over the world (``CausalLM``), each token once."""
    trainer = getattr(datamodule, "trainer", None)
    if trainer is None:
        return 0, 1
    return int(trainer.global_rank), int(trainer.world_size)


TOKENIZER_SEED = 0  # the seed of the sentence sample (reservoir): the same corpus gives the same model


def train_sentencepiece(
    lines: Iterable[str],
    path: str | os.PathLike,
    vocab_size: int,
    model_type: str = "unigram",
    byte_fallback: bool = True,
    input_sentence_size: int = 5_000_000,
) -> Path:
    """Train a SentencePiece model on ``lines`` and write it to ``path`` (atomically). BOS = 1, EOS = 2,
    UNK = 0, no PAD; ``hard_vocab_limit`` off, so a small corpus may give fewer pieces than ``vocab_size``.

    The same lines in the same order give the same file, byte for byte: beyond ``input_sentence_size``
    lines a seeded reservoir sample is taken here (SentencePiece's own sample is not reproducible, whatever
    its seed), and the model is written through a buffer (a file's path would be recorded in it)."""
    import io

    import sentencepiece as spm

    sample = reservoir(lines, input_sentence_size) if input_sentence_size > 0 else list(lines)
    if not sample:
        raise DataError(f"no text to train the tokenizer {path} on: the training split is empty")
    buffer = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(sample),
        model_writer=buffer,
        vocab_size=vocab_size,
        model_type=model_type,
        byte_fallback=byte_fallback,
        hard_vocab_limit=False,
        input_sentence_size=0,  # every line given (sampled above)
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        num_threads=os.cpu_count() or 1,
        minloglevel=2,
    )
    path = Path(path)
    common.sweep_partial_files(path.parent)
    write_bytes_atomic(path, buffer.getvalue())
    return path


def reservoir(lines: Iterable[str], size: int) -> list[str]:
    """A uniform sample of ``size`` lines (all of them when fewer), the same for the same lines in the same
    order (Algorithm R with a fixed seed), in their original order."""
    import random

    rng = random.Random(TOKENIZER_SEED)
    kept: list[tuple[int, str]] = []
    for i, line in enumerate(lines):
        if i < size:
            kept.append((i, line))
        else:
            j = rng.randrange(i + 1)
            if j < size:
                kept[j] = (i, line)
    return [line for _, line in sorted(kept)]
