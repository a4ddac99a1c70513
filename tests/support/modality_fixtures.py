"""Tiny copies of the published on-disk layouts of the non-LRA data sets (docs/data.md), written by the tests."""

from __future__ import annotations

import gzip
import io
import json
from pathlib import Path

import numpy as np
import soundfile
from PIL import Image

SC10 = ("yes", "no", "up", "down", "left", "right", "on", "off", "stop", "go")


def write_speech_commands(data_dir: Path, seed: int = 0) -> dict:
    """``speech_commands_v0.02/`` with, for SC10 word ``c``, ``10 + c`` clips of exactly 16000 samples and two
    shorter ones (to be dropped), a non-SC10 word folder, background noise and the two list files; 16-bit PCM.

    Returns ``{"full": {relative path: int16 samples}, "short": [relative paths]}``."""
    root = data_dir / "speech_commands_v0.02"
    rng = np.random.default_rng(seed)
    full, short = {}, []
    for c, word in enumerate(SC10):
        (root / word).mkdir(parents=True, exist_ok=True)
        for n in range(10 + c):
            # A per-clip DC offset makes the training statistics differ from those of the whole set.
            samples = rng.integers(-3000, 3000, 16000) + int(rng.integers(-4000, 4000))
            name = f"{word}/{rng.integers(1 << 31):08x}_nohash_{n}.wav"
            full[name] = samples.astype(np.int16)
            soundfile.write(root / name, full[name], 16000, subtype="PCM_16")
        for n in range(2):
            name = f"{word}/short{c:02d}_nohash_{n}.wav"
            soundfile.write(
                root / name, rng.integers(-1000, 1000, 9000 + n).astype(np.int16), 16000, "PCM_16"
            )
            short.append(name)
    (root / "bed").mkdir()
    soundfile.write(root / "bed" / "aaaa_nohash_0.wav", np.zeros(16000, np.int16), 16000, subtype="PCM_16")
    (root / "_background_noise_").mkdir()
    soundfile.write(root / "_background_noise_" / "white.wav", np.zeros(48000, np.int16), 16000, "PCM_16")
    names = sorted(full)
    (root / "validation_list.txt").write_text("\n".join(names[::7]) + "\n")
    (root / "testing_list.txt").write_text("\n".join(names[3::7]) + "\n")
    return {"full": full, "short": short}


def write_image_folder(
    data_dir: Path, classes: int = 3, train_per_class: int = 4, val_per_class: int = 2
) -> None:
    """``train/<wnid>/*.JPEG`` and ``val/<wnid>/*.JPEG``: 32x32 RGB images, a different colour per class."""
    rng = np.random.default_rng(0)
    for split, count in (("train", train_per_class), ("val", val_per_class)):
        for c in range(classes):
            folder = data_dir / split / f"n{c:08d}"
            folder.mkdir(parents=True)
            for i in range(count):
                pixels = rng.integers(0, 60, (32, 32, 3)) + np.array([80 * c, 40, 200 - 80 * c])
                Image.fromarray(pixels.clip(0, 255).astype(np.uint8)).save(folder / f"img_{i}.JPEG", "JPEG")


WIKI_TRAIN = [
    " ",
    " = Valkyria Chronicles = ",
    " ",
    " the game is the third game of the series . ",
    " the <unk> began in 2010 , and the game was released . ",
    " ",
    " = = Gameplay = = ",
    " the player controls a squad . the squad fights . ",
]
WIKI_VALID = [" ", " = Tower = ", " the tower is a game of the series . ", " the zeppelin flies . "]
WIKI_TEST = [" ", " = Gameplay = ", " the squad is the player . "]


def write_wikitext(data_dir: Path, repeat: int = 20) -> dict[str, list[str]]:
    """``wikitext-103/wiki.{train,valid,test}.tokens`` (the training lines repeated ``repeat`` times, so that
    blocks of a few dozen tokens fit). ``zeppelin`` is out of the training vocabulary. Returns the lines."""
    root = data_dir / "wikitext-103"
    root.mkdir(parents=True)
    lines = {"train": WIKI_TRAIN * repeat, "valid": WIKI_VALID * 3, "test": WIKI_TEST * 3}
    for split, split_lines in lines.items():
        (root / f"wiki.{split}.tokens").write_text("".join(f"{line}\n" for line in split_lines))
    return lines


_WORDS = (
    "the of and to a in that was he his it with for as had you not be her on at by which have or from this "
    "but all she they were my are him one said there when what we their so if would no been an who will"
).split()


def _book(rng: np.random.Generator, paragraphs: int) -> str:
    out = []
    for _ in range(paragraphs):
        lines = [
            " ".join(rng.choice(_WORDS, size=int(rng.integers(6, 12))))
            for _ in range(int(rng.integers(2, 5)))
        ]
        out.append("\n".join(lines).capitalize() + ".")
    return "\n\n".join(out) + "\n"


def write_pg19(data_dir: Path, books: dict[str, int] | None = None) -> dict[str, dict[str, str]]:
    """``pg19/{train,validation,test}/<book_id>.txt`` plus ``metadata.csv``; returns {split: {id: text}}."""
    books = books or {"train": 4, "validation": 2, "test": 2}
    root = data_dir / "pg19"
    rng = np.random.default_rng(1)
    texts: dict[str, dict[str, str]] = {}
    book_id = 100
    rows = []
    for split, count in books.items():
        (root / split).mkdir(parents=True)
        texts[split] = {}
        for _ in range(count):
            book_id += 7
            text = _book(rng, paragraphs=int(rng.integers(8, 20)))
            (root / split / f"{book_id}.txt").write_text(text)
            texts[split][str(book_id)] = text
            rows.append(f"{book_id},Book number {book_id},1900,https://www.gutenberg.org/ebooks/{book_id}\n")
    (root / "metadata.csv").write_text("".join(rows))
    return texts


def write_jsonl_corpus(data_dir: Path) -> list[str]:
    """Two ``.jsonl`` files (one in a sub-folder) and one ``.jsonl.gz``, plus a file that must be ignored;
    returns every document in file-path order."""
    rng = np.random.default_rng(2)
    files = {"a.jsonl": 12, "sub/b.jsonl": 8, "c.jsonl.gz": 10}
    documents = []
    for name in sorted(files, key=lambda n: str((data_dir / n).resolve())):
        docs = [" ".join(rng.choice(_WORDS, size=int(rng.integers(5, 30)))) for _ in range(files[name])]
        lines = "".join(json.dumps({"id": i, "text": d}) + "\n" for i, d in enumerate(docs)) + "\n"
        path = data_dir / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if name.endswith(".gz"):
            with gzip.open(path, "wt", encoding="utf-8") as f:
                f.write(lines)
        else:
            path.write_text(lines)
        documents.extend(docs)
    (data_dir / "notes.json").write_text(json.dumps({"text": "not a jsonl file"}))
    return documents


def train_sentencepiece(path: Path, texts: list[str], vocab_size: int = 300) -> Path:
    """A tiny SentencePiece model (unk 0, BOS 1, EOS 2) trained on ``texts``."""
    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(texts),
        model_writer=model,
        vocab_size=vocab_size,
        hard_vocab_limit=False,
        byte_fallback=True,
        minloglevel=2,
        num_threads=1,
    )
    path.write_bytes(model.getvalue())
    return path


def train_hf_tokenizer(path: Path, texts: list[str]) -> Path:
    """A tiny Hugging Face ``tokenizer.json`` (word-level, ``<s>``/``</s>``/``<unk>`` specials) trained on ``texts``."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator(texts, trainers.WordLevelTrainer(special_tokens=["<unk>", "<s>", "</s>"]))
    tokenizer.save(str(path))
    return path
