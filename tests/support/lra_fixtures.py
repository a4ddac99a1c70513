"""Tiny copies of the published Long Range Arena layouts (docs/data.md#long-range-arena), written the way the real files are.

Each writer returns what a test needs to check the reader against (items in file order, planted values).
"""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
from PIL import Image

# ListOps rows (Source, Target) with their values worked out by hand.
LISTOPS_ROWS = {
    "train": [
        ("( ( ( [MAX 2 ) 9 ) ] )", 9),
        ("( ( ( ( [MIN 4 ) 7 ) 1 ) ] )", 1),
        ("( ( ( ( ( [MED 1 ) 8 ) ( ( ( [SM 5 ) 6 ) ] ) ) 3 ) ] )", 2),  # [MED 1 8 [SM 5 6] 3] = MED 1 8 1 3
        ("( ( ( [SM 9 ) 9 ) ] )", 8),
        ("( ( ( ( ( [MAX 0 ) 0 ) 0 ) 0 ) ] )", 0),
    ],
    "val": [("( ( ( [MIN 3 ) 5 ) ] )", 3), ("( ( ( [MED 2 ) 7 ) ] )", 4)],
    "test": [("( ( ( ( [SM 1 ) 2 ) 3 ) ] )", 6), ("( ( ( [MAX 4 ) 6 ) ] )", 6)],
}


def write_listops(root: Path, rows: dict[str, list[tuple[str, int]]] = LISTOPS_ROWS) -> Path:
    """``root/listops-1000/basic_{train,val,test}.tsv`` as LRA's csv.writer wrote them (tab, CRLF)."""
    folder = root / "listops-1000"
    folder.mkdir(parents=True, exist_ok=True)
    for split, items in rows.items():
        lines = ["Source\tTarget", *(f"{source}\t{target}" for source, target in items)]
        (folder / f"basic_{split}.tsv").write_bytes(("\r\n".join(lines) + "\r\n").encode())
    return folder


# IMDB reviews: (split, label folder, file name, text). Includes multi-byte UTF-8 and one long review.
LONG_REVIEW = "A" * 3990 + "é" * 10 + "tail"  # 4014 bytes: the 4000-byte cut falls inside the é run
IMDB_REVIEWS = [
    ("train", "neg", "0_2.txt", "Dull.<br /><br />Skip it."),
    ("train", "neg", "1_1.txt", 'Worst "film" ever'),
    ("train", "pos", "0_9.txt", "Great film — naïve and warm."),
    ("train", "pos", "1_10.txt", LONG_REVIEW),
    ("test", "neg", "0_3.txt", "Bad."),
    ("test", "pos", "0_8.txt", "Good!"),
    ("test", "pos", "1_7.txt", "Fine, fine."),
]


def write_aclimdb(root: Path) -> Path:
    """``root/aclImdb/{train,test}/{pos,neg}/<id>_<rating>.txt`` (plus the unsup folder the reader ignores)."""
    for split, label, name, text in IMDB_REVIEWS:
        folder = root / "aclImdb" / split / label
        folder.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(text.encode("utf-8"))
    unsup = root / "aclImdb" / "train" / "unsup"
    unsup.mkdir(parents=True, exist_ok=True)
    (unsup / "0_0.txt").write_text("unlabelled")
    return root / "aclImdb"


# AAN pairs: label (as the release writes it, a float), two ids, two texts with literal quotes.
AAN_DOCS = {
    "P01-1001": 'We study "parsing" with a CKY chart.',
    "P02-2002": "Statistical MT: 'phrase' tables & more.",
    "W03-0303": '"Quoted start and end"',
    "J04-4004": "Long " + "x" * 4100,
}
AAN_PAIRS = {
    "train": [
        (1.0, "P01-1001", "P02-2002"),
        (0.0, "W03-0303", "P01-1001"),
        (1.0, "J04-4004", "W03-0303"),
        (0.0, "P02-2002", "J04-4004"),
    ],
    "eval": [(1.0, "P02-2002", "W03-0303"), (0.0, "P01-1001", "J04-4004")],
    "test": [(0.0, "W03-0303", "P02-2002")],
}


def write_aan(root: Path) -> Path:
    """``root/tsv_data/new_aan_pairs.{train,eval,test}.tsv``: no header, ``label id1 id2 text1 text2``."""
    folder = root / "tsv_data"
    folder.mkdir(parents=True, exist_ok=True)
    for split, pairs in AAN_PAIRS.items():
        lines = [f"{label}\t{a}\t{b}\t{AAN_DOCS[a]}\t{AAN_DOCS[b]}\n" for label, a, b in pairs]
        (folder / f"new_aan_pairs.{split}.tsv").write_text("".join(lines), encoding="utf-8")
    return folder


CIFAR_PER_BATCH = 6
# Planted in test image 0, pixel 0: R, G, B and its ITU-R 601 gray value worked out by hand:
# 0.299 * 200 + 0.587 * 100 + 0.114 * 50 = 59.8 + 58.7 + 5.7 = 124.2 -> 124.
CIFAR_PLANTED_RGB, CIFAR_PLANTED_GRAY = (200, 100, 50), 124


def write_cifar10(root: Path, per_batch: int = CIFAR_PER_BATCH) -> Path:
    """``root/cifar-10-batches-py/{data_batch_1..5,test_batch}``: pickles of the python version.

    Image ``k`` (counted over all train batches in order) has label ``k % 10`` and every pixel equal to
    ``k`` in all three planes, so its gray value is ``k`` and tests can tell images apart.
    """
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True, exist_ok=True)
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    for b, name in enumerate(names):
        ids = np.arange(b * per_batch, (b + 1) * per_batch)
        data = np.repeat(ids.astype(np.uint8)[:, None], 3072, axis=1)
        if name == "test_batch":
            data[0, [0, 1024, 2048]] = CIFAR_PLANTED_RGB  # pixel 0 of the R, G and B planes
        batch = {
            b"batch_label": f"{name} of 6".encode(),
            b"labels": [int(k % 10) for k in ids],
            b"data": data,
            b"filenames": [f"img_{k}.png".encode() for k in ids],
        }
        with open(folder / name, "wb") as f:
            pickle.dump(batch, f)
    return folder


def pathfinder_pixels(resolution: int, sample: int) -> np.ndarray:
    """Image content of a fixture sample: a ramp in row-major order, offset by the sample number."""
    return (
        ((np.arange(resolution * resolution) + 3 * sample) % 256)
        .astype(np.uint8)
        .reshape(resolution, resolution)
    )


def write_pathfinder(
    root: Path, resolution: int, per_file: int, n_files: int, empty: tuple[int, int] | None = None
) -> list[tuple[str, int]]:
    """``root/pathfinder{res}/curv_contour_length_14/{metadata/<k>.npy, imgs/<k>/sample_<i>.png}``.

    Metadata stems go 0, 1, ..., with the last one renamed to 10 so that a lexical sort would misorder it.
    The image ``empty`` = (k, i) is written as a 0-byte file. Returns ``(relative path, label)`` of the
    non-empty images in reading order. Sample number s (over all files) has label ``s % 2``.
    """
    base = root / f"pathfinder{resolution}" / "curv_contour_length_14"
    (base / "metadata").mkdir(parents=True, exist_ok=True)
    stems = list(range(n_files - 1)) + [10]
    expected = []
    sample = 0
    for k in stems:
        (base / "imgs" / str(k)).mkdir(parents=True, exist_ok=True)
        lines = []
        for i in range(per_file):
            label = sample % 2
            path = base / "imgs" / str(k) / f"sample_{i}.png"
            if (k, i) == empty:
                path.write_bytes(b"")
            else:
                Image.fromarray(pathfinder_pixels(resolution, sample), mode="L").save(path)
                expected.append((f"imgs/{k}/sample_{i}.png", label))
            # Real lines: folder, file name, sample index, label, then generator parameters.
            lines.append(f"imgs/{k} sample_{i}.png {i} {label} 14 1.5 3 0.7\n")
            sample += 1
        (base / "metadata" / f"{k}.npy").write_text("".join(lines))
    return expected
