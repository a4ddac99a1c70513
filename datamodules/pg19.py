"""PG-19 (Rae et al. 2019): whole Project Gutenberg books, subword-tokenised, evaluated book by book.

Layout (docs/data.md#pg-19): ``<data_dir>/pg19/{train,validation,test}/<book_id>.txt`` (+ ``metadata.csv``, not needed
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
word (docs/data.md#pg-19): ``exp(total NLL / words)`` with words the whitespace-separated words (``str.split``) of the
books, whatever the tokenizer. Each segment also carries ``"words": [1]``, the words it completes: a word is
assigned to the token that holds its last character (SentencePiece's byte offsets into the book text; a word
left without one, e.g. made only of characters the normaliser drops, goes to the book's EOS), stored per
token as ``<split>.words.npy`` for the evaluation splits. Summed over the segments actually scored it is the
word count of the scored text, so word perplexity is right with ``limit_val_batches`` too (a book cut
mid-way counts the words of its scored part); ``num_words[split]`` is the whole split's count.

Training batches resume mid-epoch exactly (a :class:`ResumableSampler` order saved in Lightning
checkpoints). The trained tokenizer samples its sentences with a fixed seed, not the training ``seed``, so
every run of a study shares it. The caches follow the books: each records the signature of the books it was
built from (path, size and modification time of every book: ``common.source_signature``), and a changed,
added or removed book trains the tokenizer again (training books) and tokenises the splits again. Caches go
to ``cache_dir``, else ``<data_dir>/cache/pg19`` when writable,
else a per-user cache (:func:`~datamodules.common.cache_dir_for`). A book that is empty or not UTF-8,
an empty split folder or a missing tokenizer raises a :class:`~datamodules.DataError` at set-up.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from collections.abc import Iterator
from pathlib import Path

import lightning as L
import numpy as np
import sentencepiece as spm
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from datamodules.common import (
    cache_dir_for,
    read_json,
    save_npy_atomic,
    source_signature,
    sweep_partial_files,
    write_bytes_atomic,
)
from datamodules.errors import DataError
from datamodules.text_lm import (
    MissingDataError,
    PackedSequences,
    StreamSegments,
    TokenFileWriter,
    TokenStream,
    check_token_file,
    decode_utf8,
    eval_stream_rank,
    packed_train_loader,
    token_dtype,
    write_json_atomic,
    write_text_atomic,
)

SPLIT_DIRS = {"train": "train", "val": "validation", "test": "test"}
SOURCE = "https://github.com/google-deepmind/pg19 (bucket gs://deepmind-gutenberg)"
_ENCODE_BATCH = 32  # books handed to SentencePiece's multi-threaded encoder at once
_TOKENIZER_SEED = (
    0  # SentencePiece's sentence sample: fixed, so the tokenizer never follows the training seed
)
_CACHE_FORMAT = 3  # 2: per-token word ends for the evaluation splits; 3: the books' signature (sources)


def book_files(folder: Path) -> list[Path]:
    """The ``<book_id>.txt`` files of a split folder, numeric ids in numeric order."""
    files = [p for p in folder.iterdir() if p.suffix == ".txt"]
    return sorted(files, key=lambda p: (not p.stem.isdigit(), int(p.stem) if p.stem.isdigit() else 0, p.stem))


def read_book(path: Path) -> str:
    """A book's text; a :class:`DataError` naming the file when it is not UTF-8 or holds no word."""
    text = decode_utf8(path.read_bytes(), path)
    if not text.split():
        raise DataError(f"{path} holds no text (an empty or truncated book): re-download it or remove it")
    return text


def word_ends(text: str, pieces) -> np.ndarray:
    """Per piece of ``text``'s SentencePiece encoding (``pieces``, with byte offsets ``begin``/``end`` into the
    UTF-8 text), how many words of ``text.split()`` end in it: word ``w`` ending at byte ``e_w`` (exclusive) is
    assigned to the first piece with ``end >= e_w``. Returns ``len(pieces) + 1`` counts, the last for EOS,
    which takes the words no piece reaches; the counts sum to ``len(text.split())``."""
    codepoints = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    nbytes = 1 + (codepoints >= 0x80) + (codepoints >= 0x800) + (codepoints >= 0x10000)
    byte_end = np.cumsum(nbytes)  # byte offset just after each character
    space = np.fromiter((c.isspace() for c in text), dtype=bool, count=len(text))
    last = ~space & np.append(space[1:], True)  # the last character of each word of str.split()
    ends = byte_end[last]
    piece_ends = np.maximum.accumulate(np.asarray([p.end for p in pieces], dtype=np.int64))
    owner = np.searchsorted(piece_ends, ends, side="left")  # == len(pieces): EOS
    return np.bincount(owner, minlength=len(pieces) + 1)


class PG19DataModule(L.LightningDataModule):
    """PG-19 book-level language modelling; see the module docstring for the batch formats."""

    task = "lm"  # the data contract (config checks it against task and model.*)
    input_type = "token"
    cache_name = "pg19"  # <data_dir>/cache/<cache_name> (or the per-user cache) unless cache_dir is given

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
            cache_dir: tokenizer and token files (default ``<data_dir>/cache/pg19``, or a per-user cache when
                the data directory is read-only).
        """
        super().__init__()
        self.data_dir = Path(data_dir)
        self.root = self.data_dir / "pg19"
        self.cache_dir = cache_dir_for(self.data_dir, self.cache_name, cache_dir or None)
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
        self.word_ends: dict[str, np.ndarray] = {}

    # ------------------------------------------------------------------ tokenizer
    def _check_layout(self) -> None:
        missing = [d for d in SPLIT_DIRS.values() if not (self.root / d).is_dir()]
        if not missing:
            missing = [f"{d}/*.txt" for d in SPLIT_DIRS.values() if not book_files(self.root / d)]
        if missing:
            raise MissingDataError(
                f"PG-19 not found: missing {', '.join(str(self.root / m) for m in missing)}. Expected "
                f"{self.root}/{{train,validation,test}}/<book_id>.txt (+ metadata.csv). Get it from {SOURCE} "
                f"and copy it into {self.data_dir}."
            )

    def _trained_model_path(self) -> Path:
        o = self.spm_options
        return self.cache_dir / f"spm_{o['model_type']}_{o['vocab_size']}.model"

    def sources(self, splits: tuple[str, ...] | None = None) -> str:
        """The signature of the books (of ``splits``, default all) the caches are built from
        (``common.source_signature``): a changed, added or removed book rebuilds them."""
        splits = tuple(SPLIT_DIRS.values()) if splits is None else splits
        return source_signature([p for d in splits for p in book_files(self.root / d)], self.root)

    @property
    def tokenizer(self) -> spm.SentencePieceProcessor:
        """The SentencePiece processor; trained on the training books (once, then cached) if none was given."""
        if self._sp is None:
            if self.tokenizer_path is not None:
                path = Path(self.tokenizer_path)
                if not path.is_file():
                    raise MissingDataError(
                        f"data.options.tokenizer_path={path} does not exist: expected a SentencePiece .model "
                        "(or leave tokenizer_path unset to train one on the training books)"
                    )
            else:
                path = self._trained_model_path()
                self._check_layout()
                books = self.sources(("train",))
                stamp = path.with_suffix(".sources")  # the training books it was trained on
                if not path.is_file() or not stamp.is_file() or stamp.read_text().strip() != books:
                    if path.is_file():
                        print(
                            f"[mega-suite] {self.root}/train changed since {path.name} was trained: training it again"
                        )
                    self._train_tokenizer(path)
                    write_text_atomic(stamp, books + "\n")
            self._sp = spm.SentencePieceProcessor(model_file=str(path))
            if self._sp.bos_id() < 0 or self._sp.eos_id() < 0:
                raise DataError(
                    f"SentencePiece model {path} (data.options.tokenizer_path) defines no BOS/EOS piece; PG-19 "
                    "packing needs both"
                )
        return self._sp

    @property
    def tokenizer_file(self) -> Path:
        """The tokenizer file the run uses (trained now when none was given and none is cached)."""
        self.tokenizer  # noqa: B018  (trains one when needed)
        return Path(self.tokenizer_path) if self.tokenizer_path is not None else self._trained_model_path()

    def _train_tokenizer(self, path: Path) -> None:
        self._check_layout()
        sweep_partial_files(path.parent)
        spm.set_random_generator_seed(
            _TOKENIZER_SEED
        )  # the sentence sample, so the tokenizer is reproducible
        errors: list[DataError] = []

        def lines() -> Iterator[str]:
            books = book_files(self.root / "train")
            # closed on an error too, so that the error line starts a line of its own
            with tqdm(books, desc=f"{self.cache_name} tokenizer training", mininterval=2) as bar:
                for book in bar:
                    try:
                        text = read_book(book)
                    except (
                        DataError
                    ) as exc:  # SentencePiece turns it into a RuntimeError: keep it to re-raise
                        errors.append(exc)
                        raise
                    yield from (line for line in map(str.strip, text.splitlines()) if line)

        buffer = io.BytesIO()  # the model is written whole once trained (a path would be recorded in it)
        try:
            self._run_trainer(lines(), buffer)
        except RuntimeError:
            if errors:
                raise errors[0] from None
            raise
        write_bytes_atomic(path, buffer.getvalue())

    def _run_trainer(self, sentences: Iterator[str], model: io.BytesIO) -> None:
        o = self.spm_options
        spm.SentencePieceTrainer.train(
            sentence_iterator=sentences,
            model_writer=model,
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
        sweep_partial_files(self.cache_dir)
        sources = self.sources()
        meta_path = self.token_dir / "meta.json"
        sweep_partial_files(self.token_dir)
        meta = read_json(meta_path)
        if meta is not None:
            if meta.get("format") == _CACHE_FORMAT and meta.get("sources") == sources:
                return
            if meta.get("format") == _CACHE_FORMAT:
                print(
                    f"[mega-suite] the books under {self.root} changed since {self.token_dir} was built: re-tokenising"
                )
        sp = self.tokenizer
        dtype = token_dtype(sp.get_piece_size())
        num_words = {}
        for split, folder in SPLIT_DIRS.items():
            files = book_files(self.root / folder)
            offsets = [0]
            words = 0
            ends: list[np.ndarray] = []  # per token of the evaluation splits: words ending there
            with (
                TokenFileWriter(self.token_dir / f"{split}.bin", dtype) as writer,
                tqdm(
                    total=len(files),
                    desc=f"tokenising {self.cache_name} {split}",
                    unit=" books",
                    mininterval=2,
                ) as bar,
            ):
                for i in range(0, len(files), _ENCODE_BATCH):
                    texts = [read_book(p) for p in files[i : i + _ENCODE_BATCH]]
                    words += sum(len(t.split()) for t in texts)
                    threads = os.cpu_count() or 1
                    if split == "train":
                        encoded = sp.encode(texts, num_threads=threads)
                    else:
                        protos = sp.encode(texts, return_type="proto", num_threads=threads)
                        encoded = [[p.id for p in proto.pieces] for proto in protos]
                        for text, proto in zip(texts, protos):
                            ends.append(np.concatenate([[0], word_ends(text, proto.pieces)]))  # BOS: none
                    for ids in encoded:
                        writer.write(np.asarray([sp.bos_id(), *ids, sp.eos_id()], dtype=np.int64))
                        offsets.append(writer.num_tokens)
                    bar.update(len(texts))
            if split != "train":
                counts = np.concatenate(ends)
                assert counts.sum() == words and len(counts) == offsets[-1]
                save_npy_atomic(
                    self.token_dir / f"{split}.words.npy", counts.astype(token_dtype(int(counts.max()) + 1))
                )
            save_npy_atomic(self.token_dir / f"{split}.offsets.npy", np.asarray(offsets, dtype=np.int64))
            write_text_atomic(self.token_dir / f"{split}.books.txt", "".join(f"{p.stem}\n" for p in files))
            num_words[split] = words
        write_json_atomic(
            meta_path,
            {
                "format": _CACHE_FORMAT,
                "sources": sources,
                "vocab_size": sp.get_piece_size(),
                "dtype": dtype.name,
                "num_words": num_words,
            },
        )

    # ------------------------------------------------------------------ Lightning
    def setup(self, stage: str | None = None) -> None:
        self.prepare_data()
        meta = json.loads((self.token_dir / "meta.json").read_text())
        self.num_words = meta["num_words"]
        dtype = np.dtype(meta["dtype"])
        for split in SPLIT_DIRS:
            self.book_offsets[split] = np.load(self.token_dir / f"{split}.offsets.npy")
            path = self.token_dir / f"{split}.bin"
            check_token_file(path, dtype, int(self.book_offsets[split][-1]), self.token_dir)
            self.streams[split] = TokenStream([path], dtype)
            if split != "train":
                self.word_ends[split] = np.load(self.token_dir / f"{split}.words.npy", mmap_mode="r")

    def train_dataloader(self) -> DataLoader:
        dataset = PackedSequences(self.streams["train"], self.seq_len)
        return packed_train_loader(dataset, self.batch_size, self.num_workers, self.seed)

    def _eval_loader(self, split: str) -> DataLoader:
        offsets = self.book_offsets[split]
        documents = list(zip(offsets[:-1], offsets[1:]))
        rank, world = eval_stream_rank(self)
        dataset = StreamSegments(
            self.streams[split], documents, self.eval_seq_len, self.word_ends[split], rank=rank, world=world
        )
        return DataLoader(dataset, batch_size=None, num_workers=0)

    def val_dataloader(self) -> DataLoader:
        return self._eval_loader("val")

    def test_dataloader(self) -> DataLoader:
        return self._eval_loader("test")
