"""Regenerate the committed King James Bible corpus from Debian's ``bible-kjv`` package.

    apt-get install bible-kjv          # the text (bible-kjv-text) and its reader, ``bible``
    python corpora/kjv/build.py        # writes corpora/kjv/kjv.tar.xz and corpora/kjv/kjv_unigram_4096.model

``bible -f Gen1:1-Rev22:21`` prints every verse on one line as ``<book abbreviation><chapter>:<verse> <text>``
(31,102 verses, ASCII). Each of the 66 books becomes one file in the PG-19 layout (docs/data.md#kjv):
``kjv/{train,validation,test}/<book_id>.txt`` with ``book_id`` its canonical number (Genesis 1 ... Revelation
66), plus ``kjv/metadata.csv`` (id, title, testament, split, chapters, verses, words). A book file is its
title, then per chapter a ``Chapter N`` heading and one verse per line (verse numbers dropped: they are not
English text, and the reference of a line is its position in the chapter), blocks separated by blank lines.

Same bytes on every run: files in sorted order, fixed mtime / owner / mode in the tar, single-threaded xz
(``lzma`` preset 9e); the SentencePiece model is trained single-threaded on every line of the training books
(no sampling), so it is the same model too.
"""

from __future__ import annotations

import argparse
import csv
import io
import lzma
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ARCHIVE = "kjv.tar.xz"
TOKENIZER = "kjv_unigram_4096.model"
VOCAB_SIZE = 4096
MTIME = 946684800  # 2000-01-01 UTC: a fixed timestamp so the tar bytes do not depend on when it was built

# (abbreviation printed by `bible -f`, title), in canonical order; the book id is the 1-based position.
BOOKS = [
    ("Ge", "Genesis"), ("Exo", "Exodus"), ("Lev", "Leviticus"), ("Num", "Numbers"), ("Deu", "Deuteronomy"),
    ("Josh", "Joshua"), ("Jdgs", "Judges"), ("Ruth", "Ruth"), ("1Sm", "1 Samuel"), ("2Sm", "2 Samuel"),
    ("1Ki", "1 Kings"), ("2Ki", "2 Kings"), ("1Chr", "1 Chronicles"), ("2Chr", "2 Chronicles"),
    ("Ezra", "Ezra"), ("Neh", "Nehemiah"), ("Est", "Esther"), ("Job", "Job"), ("Psa", "Psalms"),
    ("Prv", "Proverbs"), ("Eccl", "Ecclesiastes"), ("SSol", "Song of Solomon"), ("Isa", "Isaiah"),
    ("Jer", "Jeremiah"), ("Lam", "Lamentations"), ("Eze", "Ezekiel"), ("Dan", "Daniel"), ("Hos", "Hosea"),
    ("Joel", "Joel"), ("Amos", "Amos"), ("Obad", "Obadiah"), ("Jonah", "Jonah"), ("Mic", "Micah"),
    ("Nahum", "Nahum"), ("Hab", "Habakkuk"), ("Zep", "Zephaniah"), ("Hag", "Haggai"), ("Zec", "Zechariah"),
    ("Mal", "Malachi"),
    ("Mat", "Matthew"), ("Mark", "Mark"), ("Luke", "Luke"), ("John", "John"), ("Acts", "Acts"),
    ("Rom", "Romans"), ("1Cor", "1 Corinthians"), ("2Cor", "2 Corinthians"), ("Gal", "Galatians"),
    ("Eph", "Ephesians"), ("Phi", "Philippians"), ("Col", "Colossians"), ("1Th", "1 Thessalonians"),
    ("2Th", "2 Thessalonians"), ("1Tim", "1 Timothy"), ("2Tim", "2 Timothy"), ("Titus", "Titus"),
    ("Phmn", "Philemon"), ("Heb", "Hebrews"), ("Jas", "James"), ("1Pet", "1 Peter"), ("2Pet", "2 Peter"),
    ("1Jn", "1 John"), ("2Jn", "2 John"), ("3Jn", "3 John"), ("Jude", "Jude"), ("Rev", "Revelation"),
]  # fmt: skip
OLD_TESTAMENT = 39  # books 1..39; 40..66 are the New Testament

# Whole books held out (README.md says why): a long prophet and a narrative/gospel in each held-out split.
VALIDATION = ("Ezekiel", "John")
TEST = ("Jeremiah", "Acts")

_VERSE = re.compile(r"^([1-3]?[A-Za-z]+)(\d+):(\d+) (.*)$")


def split_of(title: str) -> str:
    return "validation" if title in VALIDATION else "test" if title in TEST else "train"


def read_bible(bible: str = "bible") -> list[list[list[str]]]:
    """Every verse of the package's text: ``books[b][c][v]`` (0-based), read with ``bible -f``."""
    out = subprocess.run([bible, "-f", "Gen1:1-Rev22:21"], check=True, capture_output=True, text=True)
    books: list[list[list[str]]] = []
    abbreviations: list[str] = []
    for line in out.stdout.splitlines():
        match = _VERSE.match(line)
        if match is None:
            raise ValueError(f"unexpected line from `bible -f`: {line[:80]!r}")
        abbr, chapter, verse, text = match[1], int(match[2]), int(match[3]), match[4].strip()
        if not abbreviations or abbreviations[-1] != abbr:
            abbreviations.append(abbr)
            books.append([])
        chapters = books[-1]
        if chapter == len(chapters) + 1:
            chapters.append([])
        if chapter != len(chapters) or verse != len(chapters[-1]) + 1:
            raise ValueError(f"verses out of order at {abbr}{chapter}:{verse}")
        chapters[-1].append(text)
    expected = [abbr for abbr, _ in BOOKS]
    if abbreviations != expected:
        raise ValueError(f"`bible -f` printed books {abbreviations}, expected {expected}")
    return books


def book_text(title: str, chapters: list[list[str]]) -> str:
    blocks = [title] + [f"Chapter {c}\n\n" + "\n".join(verses) for c, verses in enumerate(chapters, 1)]
    return "\n\n".join(blocks) + "\n"


def corpus_files(books: list[list[list[str]]]) -> dict[str, bytes]:
    """Archive member name -> bytes, for the 66 books and ``metadata.csv``."""
    files = {}
    meta = io.StringIO()
    writer = csv.writer(meta, lineterminator="\n")
    writer.writerow(["id", "title", "testament", "split", "chapters", "verses", "words"])
    for book_id, ((_, title), chapters) in enumerate(zip(BOOKS, books), 1):
        text = book_text(title, chapters)
        split = split_of(title)
        files[f"kjv/{split}/{book_id}.txt"] = text.encode("ascii")
        testament = "old" if book_id <= OLD_TESTAMENT else "new"
        verses = sum(len(c) for c in chapters)
        writer.writerow([book_id, title, testament, split, len(chapters), verses, len(text.split())])
    files["kjv/metadata.csv"] = meta.getvalue().encode("ascii")
    return files


def write_archive(files: dict[str, bytes], path: Path) -> None:
    """A tar.xz whose bytes depend only on ``files``: sorted members, fixed metadata, single-threaded xz."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        dirs = sorted({str(Path(name).parent) for name in files} | {"kjv"})
        for name in dirs:
            tar.addfile(_info(name, tarfile.DIRTYPE, 0o755, 0))
        for name in sorted(files):
            tar.addfile(_info(name, tarfile.REGTYPE, 0o644, len(files[name])), io.BytesIO(files[name]))
    data = lzma.compress(buffer.getvalue(), format=lzma.FORMAT_XZ, preset=9 | lzma.PRESET_EXTREME)
    path.write_bytes(data)


def _info(name: str, kind: bytes, mode: int, size: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.mode, info.size, info.mtime = kind, mode, size, MTIME
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info


def train_tokenizer(files: dict[str, bytes], path: Path) -> None:
    """A unigram SentencePiece model on the training books' lines (the options PG19DataModule trains with)."""
    import sentencepiece as spm

    lines = [
        line
        for name in sorted(files)
        if name.startswith("kjv/train/")
        for line in files[name].decode("ascii").splitlines()
        if line.strip()
    ]
    model = io.BytesIO()  # not a model_prefix: the model records its prefix, which would vary per run
    spm.set_random_generator_seed(0)
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_writer=model,
        vocab_size=VOCAB_SIZE,
        model_type="unigram",
        byte_fallback=True,
        normalization_rule_name="identity",  # ASCII text: NFKC would change nothing and adds 240 KB
        input_sentence_size=len(lines) + 1,  # every line: no random sample
        shuffle_input_sentence=False,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        num_threads=1,
        minloglevel=2,
    )
    path.write_bytes(model.getvalue())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=HERE, help=f"output folder (default {HERE})")
    parser.add_argument("--bible", default="bible", help="the bible-kjv reader (default: bible on PATH)")
    args = parser.parse_args(argv)
    if shutil.which(args.bible) is None:
        print(f"error: {args.bible!r} not found; install Debian's bible-kjv package", file=sys.stderr)
        return 2
    files = corpus_files(read_bible(args.bible))
    args.out.mkdir(parents=True, exist_ok=True)
    write_archive(files, args.out / ARCHIVE)
    train_tokenizer(files, args.out / TOKENIZER)
    for split in ("train", "validation", "test"):
        texts = [v for k, v in files.items() if k.startswith(f"kjv/{split}/")]
        words = sum(len(t.split()) for t in texts)
        print(f"{split}: {len(texts)} books, {words} words, {sum(map(len, texts))} bytes")
    print(f"wrote {args.out / ARCHIVE} ({(args.out / ARCHIVE).stat().st_size} bytes), {args.out / TOKENIZER}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
