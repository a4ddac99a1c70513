"""Text to token ids and back for a trained language model, and training a SentencePiece model on a corpus.

``TextTokenizer(path)``: a SentencePiece ``.model`` or a Hugging Face ``tokenizer.json`` (the formats the data
modules read) with ``encode(text, bos=True)`` and ``decode(ids)``. A prompt is encoded as the training data
was written, ``BOS tokens`` (documents are packed as ``BOS tokens EOS``).

``train_sentencepiece(lines, path, ...)`` (``text_lm``): the step the pretraining data module runs when no
tokenizer is given, the same file for the same lines. A run directory keeps a copy of its tokenizer under
``RUN_TOKENIZER_NAMES`` so that it is self-contained.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable
from pathlib import Path

from datamodules.common import partial_file, sweep_partial_files
from datamodules.errors import DataError
from datamodules.pretrain import DocumentTokenizer
from datamodules.text_lm import MissingDataError, reservoir, train_sentencepiece

__all__ = ["RUN_TOKENIZER_NAMES", "TextTokenizer", "copy_tokenizer", "find_tokenizer", "reservoir",
           "train_sentencepiece"]  # fmt: skip

# The copy a run directory or an exported bundle keeps, by format (suffix of the source file).
RUN_TOKENIZER_NAMES = {".model": "tokenizer.model", ".json": "tokenizer.json"}


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
    sweep_partial_files(out.parent)
    with partial_file(out) as tmp:
        shutil.copyfile(source, tmp)
    return out
