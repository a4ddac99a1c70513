"""Text to token ids and back for a trained language model, and training a SentencePiece model on a corpus.

``TextTokenizer(path)``: a SentencePiece ``.model`` or a Hugging Face ``tokenizer.json`` (the formats the data
modules read) with ``encode(text, bos=True)`` and ``decode(ids)``. A prompt is encoded as the training data
was written, ``BOS tokens`` (documents are packed as ``BOS tokens EOS``).

``train_sentencepiece(lines, path, ...)``: the step the PG-19, KJV and pretraining data modules run when no
tokenizer is given, deterministic for the same lines (SentencePiece's sentence sample is seeded). A run
directory keeps a copy of its tokenizer under ``RUN_TOKENIZER_NAMES`` so that it is self-contained.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable
from pathlib import Path

from datamodules.errors import DataError
from datamodules.pretrain import DocumentTokenizer
from datamodules.text_lm import MissingDataError

# The copy a run directory or an exported bundle keeps, by format (suffix of the source file).
RUN_TOKENIZER_NAMES = {".model": "tokenizer.model", ".json": "tokenizer.json"}
TOKENIZER_SEED = 0  # the seed of the sentence sample (reservoir): the same corpus gives the same model


class TextTokenizer(DocumentTokenizer):
    """A tokenizer file behind ``encode`` / ``decode`` (and ``vocab_size``, ``bos_id``, ``eos_id``);
    ``source`` names where its path came from in the error for a missing file."""

    def __init__(self, path: str | os.PathLike, source: str = "tokenizer", **special: str | None):
        if not Path(path).is_file():
            raise MissingDataError(
                f"{source}={path} does not exist: expected a SentencePiece .model or a Hugging Face "
                "tokenizer.json"
            )
        super().__init__(path, **special)

    def encode(self, text: str, bos: bool = True) -> list[int]:
        ids = self.encode_batch([text])[0]
        return [self.bos_id, *ids] if bos else list(ids)

    def decode(self, ids: Iterable[int]) -> str:
        """Token ids -> text; BOS / EOS and other special tokens are dropped."""
        ids = [int(i) for i in ids]
        if self._sp is not None:
            return self._sp.decode(ids)
        return self._hf.decode(ids, skip_special_tokens=True)


def find_tokenizer(folder: str | os.PathLike) -> Path | None:
    """The tokenizer copy of a run directory or bundle (``tokenizer.model`` or ``tokenizer.json``), if any."""
    for name in RUN_TOKENIZER_NAMES.values():
        path = Path(folder) / name
        if path.is_file():
            return path
    return None


def copy_tokenizer(source: str | os.PathLike, folder: str | os.PathLike) -> Path:
    """Copy a tokenizer file into ``folder`` under its run name; returns the copy."""
    source = Path(source)
    name = RUN_TOKENIZER_NAMES.get(source.suffix)
    if name is None:
        raise DataError(
            f"tokenizer {source}: expected a SentencePiece .model or a Hugging Face tokenizer.json"
        )
    if not source.is_file():
        raise MissingDataError(f"tokenizer {source} does not exist")
    out = Path(folder) / name
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
    shutil.copyfile(source, tmp)
    os.replace(tmp, out)
    return out


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
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    tmp.write_bytes(buffer.getvalue())
    os.replace(tmp, path)
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
