"""The King James Bible, shipped with the suite: an English LM corpus that needs no download.

``corpora/kjv/kjv.tar.xz`` holds the 66 books in the PG-19 layout (docs/data.md#kjv), ``kjv/{train,validation,test}/
<book_id>.txt`` + ``metadata.csv`` (split by whole books: corpora/kjv/README.md). When ``<data_dir>/kjv/`` is
absent the archive is unpacked there on first use; a ``<data_dir>/kjv/`` the suite did not unpack (no
``.archive.sha256`` stamp) is read as it is, and one unpacked from an older archive is replaced. The
committed SentencePiece model ``corpora/kjv/kjv_unigram_4096.model`` (trained on the training books by
``corpora/kjv/build.py``) is the default tokenizer. Everything else, batches and word-level perplexity, is
:class:`~datamodules.pg19.PG19DataModule`'s.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tarfile
from pathlib import Path

from datamodules.common import (
    cache_dir_for,
    is_writable,
    partial_name,
    ships_with_repository,
    sweep_partial_files,
)
from datamodules.errors import DataError
from datamodules.pg19 import SPLIT_DIRS, PG19DataModule
from datamodules.text_lm import MissingDataError

CORPUS_DIR = Path(__file__).resolve().parent.parent / "corpora" / "kjv"
ARCHIVE = CORPUS_DIR / "kjv.tar.xz"
TOKENIZER = CORPUS_DIR / "kjv_unigram_4096.model"
STAMP = ".archive.sha256"


def archive_digest(path: Path = ARCHIVE) -> str:
    if not path.is_file():
        raise DataError(
            f"the committed King James Bible archive {path} is missing; restore it with `git checkout -- {path}` "
            "or regenerate it with `python corpora/kjv/build.py` (needs Debian's bible-kjv)"
        )
    return hashlib.sha256(path.read_bytes()).hexdigest()


def unpack(data_dir: Path, archive: Path = ARCHIVE) -> Path:
    """``<data_dir>/kjv`` from ``archive`` unless it is already there (unpacked by us from this archive, or
    the user's own copy); returns it. Where ``data_dir`` is read-only and holds no ``kjv/``, the corpus is
    unpacked into the per-user cache instead (``common.cache_dir_for``). Unpacks beside the target under a
    partial name and renames, so a concurrent or interrupted unpack (``KeyboardInterrupt`` included) never
    leaves a partial corpus under the real name, nor its partial copy (removed, or swept at the next call)."""
    root = data_dir / "kjv"
    digest = archive_digest(archive)
    stamp = root / STAMP
    if root.exists() and not root.is_dir():
        raise DataError(f"{root} is a file, where the King James Bible corpus folder kjv/ belongs: expected a "
                        "folder (or nothing, to have corpora/kjv/kjv.tar.xz unpacked there)")  # fmt: skip
    if root.is_dir() and (not stamp.is_file() or stamp.read_text().strip() == digest):
        return root
    if not root.is_dir() and not is_writable(data_dir):
        data_dir = cache_dir_for(data_dir, "kjv_corpus")
        root, stamp = data_dir / "kjv", data_dir / "kjv" / STAMP
        if root.is_dir() and stamp.is_file() and stamp.read_text().strip() == digest:
            return root
    data_dir.mkdir(parents=True, exist_ok=True)
    sweep_partial_files(data_dir)
    tmp = partial_name(root)  # a folder: the archive's kjv/ lands in it
    old = partial_name(root.with_name("kjv.old"))  # our copy from an older archive, moved aside, then removed
    try:
        try:
            with tarfile.open(archive, "r:xz") as tar:
                tar.extractall(tmp, filter="data")
        except (tarfile.TarError, OSError, EOFError) as exc:
            raise DataError(f"cannot unpack {archive} into {data_dir}: {exc}") from None
        (tmp / "kjv" / STAMP).write_text(digest + "\n")
        if root.is_dir():  # unpacked by the suite (its stamp) from an older archive
            os.replace(root, old)
        try:
            os.replace(tmp / "kjv", root)
        except OSError:  # another process renamed its copy first
            if not root.is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)
    print(f"[mega-suite] unpacked the King James Bible ({archive.name}) into {root}")
    return root


class KJVDataModule(PG19DataModule):
    """PG-19 machinery over ``<data_dir>/kjv`` (unpacked from the committed archive when absent)."""

    cache_name = "kjv"

    def __init__(
        self,
        data_dir: str,
        batch_size: int = 8,
        num_workers: int = 0,
        seed: int = 0,
        seq_len: int = 1024,
        eval_seq_len: int | None = None,
        tokenizer_path: str | None = str(TOKENIZER),
        vocab_size: int = 4096,
        spm_model_type: str = "unigram",
        byte_fallback: bool = True,
        spm_input_sentence_size: int = 5_000_000,
        cache_dir: str | None = None,
    ):
        """Arguments as :class:`PG19DataModule`'s; ``tokenizer_path`` defaults to the committed model (None
        trains one of ``vocab_size`` on the training books), ``cache_dir`` to ``<data_dir>/cache/kjv`` (or the
        per-user cache when the data directory is read-only)."""
        super().__init__(
            data_dir,
            batch_size=batch_size,
            num_workers=num_workers,
            seed=seed,
            seq_len=seq_len,
            eval_seq_len=eval_seq_len,
            tokenizer_path=tokenizer_path,
            vocab_size=vocab_size,
            spm_model_type=spm_model_type,
            byte_fallback=byte_fallback,
            spm_input_sentence_size=spm_input_sentence_size,
            cache_dir=cache_dir,
        )
        self.root = self.data_dir / "kjv"

    def _check_layout(self) -> None:
        self.root = unpack(self.data_dir)
        try:
            super()._check_layout()
        except MissingDataError:
            missing = [d for d in SPLIT_DIRS.values() if not (self.root / d).is_dir() or not any(
                (self.root / d).glob("*.txt"))]  # fmt: skip
            if ships_with_repository(self.root):  # e.g. data.data_dir=corpora: never advise removing it
                raise MissingDataError(
                    f"data.data_dir={self.data_dir}: {self.root} is a folder the repository ships, not an "
                    f"unpacked corpus (no books in {', '.join(missing)}): point data.data_dir at a folder of "
                    "your own (the recipe's default, data, is one); corpora/kjv/kjv.tar.xz is unpacked there"
                ) from None
            raise MissingDataError(
                f"data.data_dir={self.data_dir}: {self.root} holds no King James Bible (no books in "
                f"{', '.join(missing)}), and the suite unpacks corpora/kjv/kjv.tar.xz only where kjv/ is "
                f"absent: remove the folder {self.root} to have it unpacked there, or point data.data_dir at "
                "the folder that holds the corpus's kjv/"
            ) from None

    @property
    def token_dir(self) -> Path:
        """Token files of this tokenizer and this corpus: a regenerated archive never reads stale tokens."""
        stamp = self.root / STAMP
        corpus = stamp.read_text().strip()[:12] if stamp.is_file() else "own"
        return super().token_dir.with_name(f"{super().token_dir.name}_{corpus}")
