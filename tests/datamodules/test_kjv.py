"""The committed King James Bible corpus: archive contents, split, unpacking, tokenizer, regeneration.

The recipe itself (2 steps + validation on the real corpus unpacked into an empty folder) runs in
test_recipes.py with the other recipes.
"""

from __future__ import annotations

import csv
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import sentencepiece as spm

from datamodules import DataError, KJVDataModule
from datamodules.kjv import ARCHIVE, STAMP, TOKENIZER, unpack

REPO = Path(__file__).resolve().parents[2]
HELD_OUT = {"validation": {"Ezekiel", "John"}, "test": {"Jeremiah", "Acts"}}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return unpack(tmp_path_factory.mktemp("kjv"))


def metadata(root: Path) -> list[dict[str, str]]:
    with open(root / "metadata.csv", newline="") as f:
        return list(csv.DictReader(f))


def test_archive_holds_66_books_split_by_whole_book(corpus):
    rows = metadata(corpus)
    assert [int(r["id"]) for r in rows] == list(range(1, 67))
    assert sum(int(r["verses"]) for r in rows) == 31102  # the KJV's verse count
    for split in ("train", "validation", "test"):
        on_disk = sorted(int(p.stem) for p in (corpus / split).glob("*.txt"))
        assert on_disk == sorted(int(r["id"]) for r in rows if r["split"] == split)
        titles = {r["title"] for r in rows if r["split"] == split}
        if split != "train":
            assert titles == HELD_OUT[split]
    for r in rows:
        text = (corpus / r["split"] / f"{r['id']}.txt").read_text(encoding="ascii")
        assert text.startswith(r["title"] + "\n\nChapter 1\n\n")
        assert text.count("\nChapter ") == int(r["chapters"])
        assert len(text.split()) == int(r["words"])
    genesis = (corpus / "train" / "1.txt").read_text().splitlines()
    assert genesis[4] == "In the beginning God created the heaven and the earth."
    assert (corpus / "train" / "66.txt").read_text().splitlines()[-1] == (
        "The grace of our Lord Jesus Christ be with you all. Amen."
    )
    words = {s: sum(int(r["words"]) for r in rows if r["split"] == s) for s in HELD_OUT | {"train": 0}}
    assert words["train"] > 0.8 * sum(words.values())  # most of the text trains


def test_unpack_keeps_current_and_own_copies_and_replaces_stale_ones(corpus, tmp_path):
    marker = corpus / "validation" / "43.txt"
    assert unpack(corpus.parent) == corpus  # same archive: nothing rewritten
    assert marker.read_text().startswith("John")

    own = tmp_path / "kjv"
    (own / "train").mkdir(parents=True)
    (own / "train" / "1.txt").write_text("my own text\n")
    unpack(tmp_path)
    assert (own / "train" / "1.txt").read_text() == "my own text\n"  # no stamp: the user's copy

    (own / STAMP).write_text("0" * 64 + "\n")  # unpacked by the suite from another archive
    unpack(tmp_path)
    assert (own / "train" / "1.txt").read_text().startswith("Genesis")
    assert not list(tmp_path.glob("kjv.tmp*"))


def test_missing_archive_is_a_data_error(tmp_path):
    with pytest.raises(DataError, match="missing"):
        unpack(tmp_path, archive=tmp_path / "nowhere.tar.xz")


def test_committed_tokenizer(corpus):
    sp = spm.SentencePieceProcessor(model_file=str(TOKENIZER))
    assert sp.get_piece_size() == 4096 and (sp.bos_id(), sp.eos_id()) == (1, 2)
    verse = (corpus / "validation" / "43.txt").read_text().splitlines()[4]
    ids = sp.encode(verse)
    assert sp.decode(ids) == verse and 0 not in ids  # ASCII text never needs <unk>
    assert len(ids) < 1.6 * len(verse.split())


def test_data_module_counts_words_of_the_committed_split(corpus):
    dm = KJVDataModule(str(corpus.parent), seq_len=64)
    dm.setup("fit")
    rows = metadata(corpus)
    for stage, split in (("train", "train"), ("val", "validation"), ("test", "test")):
        assert dm.num_words[stage] == sum(int(r["words"]) for r in rows if r["split"] == split)
    offsets = dm.book_offsets["val"]
    assert len(offsets) == 3 and max(offsets[1:] - offsets[:-1]) > 50_000  # Ezekiel: a long held-out book
    assert dm.vocab_size == 4096


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("bible") is None, reason="Debian's bible-kjv is not installed")
def test_build_regenerates_the_committed_files_byte_for_byte(tmp_path):
    subprocess.run(
        [sys.executable, str(REPO / "corpora" / "kjv" / "build.py"), "--out", str(tmp_path)],
        check=True,
        capture_output=True,
    )
    assert (tmp_path / ARCHIVE.name).read_bytes() == ARCHIVE.read_bytes()
    assert (tmp_path / TOKENIZER.name).read_bytes() == TOKENIZER.read_bytes()
