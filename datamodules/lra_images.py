"""LightningDataModules for the Long Range Arena's image tasks: CIFAR-10 in grayscale pixels, Pathfinder and
Path-X (docs/data.md#long-range-arena). The shared loader logic and the token tasks are in ``lra.py``.

Pixels reach the model as float32, one scalar per pixel, ``x / 255`` then ``(x - 0.5) / 0.5``, i.e. in
[-1, 1]; CIFAR-10 is first converted to 8-bit grayscale ``round(0.299 R + 0.587 G + 0.114 B)`` (ITU-R 601).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset, Subset

from . import common
from .common import random_split_indices
from .errors import DataError
from .lra import LRA_SOURCE, LRADataModule, _require
from .safe_pickle import restricted_load

CIFAR_SOURCE = (
    "CIFAR-10, python version (https://www.cs.toronto.edu/~kriz/cifar.html, cifar-10-python.tar.gz); "
    "unpack it under data_dir"
)
PIXEL_MEAN, PIXEL_STD = 0.5, 0.5  # applied to x / 255

log = logging.getLogger(__name__)


def normalize_pixels(pixels: np.ndarray) -> torch.Tensor:
    """uint8 pixels -> float32 ``(x / 255 - PIXEL_MEAN) / PIXEL_STD``."""
    return (torch.from_numpy(np.asarray(pixels, dtype=np.float32)) / 255.0 - PIXEL_MEAN) / PIXEL_STD


def rgb_to_gray(planar_rgb: np.ndarray) -> np.ndarray:
    """CIFAR rows (N, 3072) uint8, RGB planes of 32x32 -> (N, 1024) uint8 ITU-R 601 luma, rounded half up."""
    rgb = planar_rgb.reshape(-1, 3, 1024).astype(np.int32)
    # Exact integer arithmetic: (299 R + 587 G + 114 B) / 1000, rounded.
    return ((299 * rgb[:, 0] + 587 * rgb[:, 1] + 114 * rgb[:, 2] + 500) // 1000).astype(np.uint8)


class PixelDataset(Dataset):
    """Item i: ``{"input": float32 [H*W] normalised pixels, "label": int}`` from uint8 rows in memory."""

    def __init__(self, pixels: np.ndarray, labels: np.ndarray):
        self.pixels, self.labels = pixels, labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict:
        return {"input": normalize_pixels(self.pixels[i]), "label": int(self.labels[i])}


class PathfinderDataset(Dataset):
    """Pathfinder images decoded lazily per item (Path-X as floats would be 13 GB).

    Item i: ``{"input": float32 [resolution**2] normalised pixels, row-major, "label": int}``.
    """

    def __init__(self, root: Path, files: np.ndarray, labels: np.ndarray, resolution: int):
        self.root, self.files, self.labels, self.resolution = root, files, labels, resolution

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict:
        path = self.root / self.files[i].decode()
        with Image.open(path) as image:
            pixels = np.asarray(image.convert("L"))
        if pixels.shape != (self.resolution, self.resolution):
            raise DataError(f"{path}: image is {pixels.shape}, expected {(self.resolution, self.resolution)}")
        return {"input": normalize_pixels(pixels.reshape(-1)), "label": int(self.labels[i])}


class CIFAR10GrayDataModule(LRADataModule):
    """LRA Image: CIFAR-10 in 8-bit grayscale, 1024 pixels; 45k/5k train/val split (seed ``split_seed``).

    The official ``test_batch`` is the test set. ``max_length`` is fixed at 1024.
    """

    num_classes = 10
    input_type = "scalar"
    default_max_length = 1024

    def __init__(
        self,
        data_dir: str,
        batch_size: int,
        num_workers: int = 0,
        seed: int = 42,
        max_length: int | None = None,
        pad_to_multiple: int = 1,
        val_size: int = 5000,
        split_seed: int = 42,
    ):
        super().__init__(data_dir, batch_size, num_workers, seed, max_length, pad_to_multiple)
        self.val_size, self.split_seed = val_size, split_seed

    def build_datasets(self) -> dict[str, Dataset]:
        root = self.data_dir / "cifar-10-batches-py"
        train_files = [root / f"data_batch_{i}" for i in range(1, 6)]
        _require(
            [*train_files, root / "test_batch"],
            "CIFAR-10 (LRA Image)",
            "data_dir/cifar-10-batches-py/{data_batch_1..5,test_batch}",
            CIFAR_SOURCE,
        )
        train_pixels, train_labels = self._read(train_files)
        test_pixels, test_labels = self._read([root / "test_batch"])
        if not 0 < self.val_size < len(train_labels):
            raise DataError(
                f"data.options.val_size={self.val_size} must be between 1 and {len(train_labels) - 1} "
                f"(it is cut from the {len(train_labels)} CIFAR-10 training images; the paper uses 5000)"
            )
        train_idx, val_idx = random_split_indices(
            len(train_labels), [len(train_labels) - self.val_size, self.val_size], self.split_seed
        )
        return {
            "train": PixelDataset(train_pixels[train_idx], train_labels[train_idx]),
            "val": PixelDataset(train_pixels[val_idx], train_labels[val_idx]),
            "test": PixelDataset(test_pixels, test_labels),
        }

    @staticmethod
    def _read(files: list[Path]) -> tuple[np.ndarray, np.ndarray]:
        pixels, labels = [], []
        for file in files:
            try:
                with open(file, "rb") as f:
                    batch = restricted_load(f, _cifar_global, encoding="bytes")
                data = np.asarray(batch[b"data"], dtype=np.uint8)
                label = np.asarray(batch[b"labels"], dtype=np.int64)
                if data.ndim != 2 or data.shape[1] != 3072 or label.shape != (len(data),):
                    raise ValueError(f"data {data.shape} and labels {label.shape}")
            except Exception as e:  # whatever a damaged pickle raises
                raise DataError(
                    f"{file} is not a CIFAR-10 python batch ({type(e).__name__}: {str(e)[:100]}); expected a "
                    f"pickle with b'data' (N, 3072) uint8 and b'labels'; get it again from {CIFAR_SOURCE}"
                ) from None
            pixels.append(rgb_to_gray(data))
            labels.append(label)
        return np.concatenate(pixels), np.concatenate(labels)


# What a CIFAR-10 python batch (NumPy arrays in a dict, pickled by Python 2 or 3) may name; anything else in
# one of its files is refused before it could run.
_NUMPY = {
    "numpy",
    "numpy.core.multiarray",
    "numpy._core.multiarray",
    "numpy.core.numeric",
    "numpy._core.numeric",
}


def _cifar_global(module: str, name: str) -> bool:
    if module in _NUMPY:
        return name in ("ndarray", "dtype", "_reconstruct", "_frombuffer", "scalar")
    return (module, name) == ("_codecs", "encode")  # Python 2 byte strings


class PathfinderDataModule(LRADataModule):
    """LRA Pathfinder: ``pathfinder{resolution}/{difficulty}/`` with ``metadata/<k>.npy`` and ``imgs/<k>/``.

    Metadata files (text despite the suffix) are read sorted by integer stem, lines in order; field 0 is
    the image folder, field 1 the file name, field 3 the label. Empty image files are skipped. Then a
    ``val_fraction``/``test_fraction`` random split with ``split_seed`` (S4's and Mega's 80/10/10, seed 42).
    Images are decoded per item; ``max_length`` is fixed at ``resolution**2``.
    """

    num_classes = 2
    input_type = "scalar"
    resolution = 32
    default_max_length = 32 * 32

    def __init__(
        self,
        data_dir: str,
        batch_size: int,
        num_workers: int = 0,
        seed: int = 42,
        max_length: int | None = None,
        pad_to_multiple: int = 1,
        difficulty: str = "curv_contour_length_14",
        split_seed: int = 42,
        val_fraction: float = 0.1,
        test_fraction: float = 0.1,
    ):
        super().__init__(data_dir, batch_size, num_workers, seed, max_length, pad_to_multiple)
        self.difficulty, self.split_seed = difficulty, split_seed
        self.val_fraction, self.test_fraction = val_fraction, test_fraction

    @property
    def root(self) -> Path:
        return self.data_dir / f"pathfinder{self.resolution}" / self.difficulty

    def build_datasets(self) -> dict[str, Dataset]:
        metadata = sorted((self.root / "metadata").glob("*.npy"), key=lambda p: int(p.stem))
        if not metadata:
            raise FileNotFoundError(
                f"Pathfinder data not found: no metadata/<k>.npy files under {self.root}. Expected layout: "
                f"data_dir/pathfinder{self.resolution}/{self.difficulty}/metadata/<k>.npy and "
                f"imgs/<k>/sample_<i>.png. Get it from {LRA_SOURCE}."
            )
        files, labels, empty = [], [], 0
        for path in metadata:
            for line_number, line in enumerate(path.read_bytes().splitlines(), start=1):
                fields = line.decode("utf-8", errors="replace").split()
                if not fields:
                    continue
                if len(fields) < 4 or fields[3] not in ("0", "1"):
                    raise DataError(
                        f"{path}:{line_number}: expected 'imgs/<k> sample_<i>.png <i> <label 0/1> ...', "
                        f"got {line[:80]!r}"
                    )
                relative = f"{fields[0]}/{fields[1]}"
                try:
                    size = os.stat(self.root / relative).st_size
                except FileNotFoundError:
                    raise DataError(
                        f"{self.root / relative} is missing (listed in {path}:{line_number})"
                    ) from None
                if size == 0:  # e.g. pathfinder32/curv_baseline/imgs/0/sample_172.png
                    empty += 1
                    continue
                files.append(relative.encode())
                labels.append(int(fields[3]))
        log.info("%s: skipped %d empty image file(s) (as Mega and S4 do)", self.root, empty)
        common.check_images(
            [self.root / f.decode() for f in files],
            common.cache_dir_for(self.data_dir, f"pathfinder{self.resolution}_{self.difficulty}"),
            f"expected a {self.resolution}x{self.resolution} grayscale PNG (LRA Pathfinder); get {LRA_SOURCE}",
            size=(self.resolution, self.resolution),
        )
        dataset = PathfinderDataset(
            self.root, np.array(files), np.array(labels, dtype=np.int64), self.resolution
        )
        n = len(dataset)
        n_val, n_test = int(self.val_fraction * n), int(self.test_fraction * n)
        splits = random_split_indices(n, [n - n_val - n_test, n_val, n_test], self.split_seed)
        return {name: Subset(dataset, idx.tolist()) for name, idx in zip(("train", "val", "test"), splits)}


class PathXDataModule(PathfinderDataModule):
    """LRA Path-X: Pathfinder at 128x128 (``pathfinder128/``), sequences of 16384 pixels."""

    resolution = 128
    default_max_length = 128 * 128
