"""ImageNet-1K with the DeiT training pipeline (Touvron et al. 2021), built from timm's parts.

Layout (docs/data.md#imagenet): ``<data_dir>/train/<wnid>/*.JPEG`` and ``<data_dir>/val/<wnid>/*.JPEG`` (validation
images moved into class folders); read with ``torchvision.datasets.ImageFolder``. ``val`` serves as both
validation and test set (the official test labels are not public).

Training transform: ``timm.data.create_transform`` with RandomResizedCrop + flip, RandAugment
``rand-m9-mstd0.5-inc1``, bicubic interpolation, random erasing 0.25 (pixel mode), ImageNet mean/std.
Evaluation: resize to ``image_size / crop_pct`` (256 for 224) bicubic, center crop, normalise.
Repeated augmentation (DeiT's 3 repeats): ``repeated_aug > 1`` trains with a ``ResumableSampler`` with
``repeats`` (timm's ``RepeatAugSampler`` order rule, seeded by ``(seed, epoch)``).

Exact resume: the training loader is a ``ResumableDataLoader`` (its state is the epoch and the items
consumed), and every training item is augmented under global generators seeded from ``(seed, epoch,
position in the epoch)`` (``common.SeededItems``); the batch's mixup/cutmix draw is seeded from its first
item's key. So a resumed run, or one with another worker count, sees the same pixels and mixed labels.

Set-up checks every image's header once (cached by a digest of paths, sizes and times): an empty or
unreadable file is a ``DataError`` naming it before training starts. (A JPEG truncated after a valid header
passes this check and fails when decoded, also as a ``DataError`` naming the file.)

Mixup/CutMix with label smoothing is applied by THIS datamodule in ``on_after_batch_transfer`` to training
batches only (on the device, after transfer): training labels are then soft targets ``[B, num_classes]``
float; validation and test labels stay class indices ``[B]`` int64. The LightningModule trains with
soft-target cross-entropy ``-(label * log_softmax(logits)).sum(-1).mean()`` when ``label.ndim == 2`` (and
must not override ``on_after_batch_transfer`` itself, or Lightning uses the datamodule's). The
``timm.data.Mixup`` object is ``self.mixup_fn`` (None when both alphas are 0, in which case training labels
stay indices and label smoothing is up to the module).

Batches: ``{"input": [B, 3, H, W] float32, "padding_mask": None, "label": [B] int64 or [B, classes] float}``.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import lightning as L
import torch
from PIL import Image
from timm.data import Mixup, create_transform
from timm.data.auto_augment import RandAugment
from torch.utils.data import DataLoader
from torchvision.datasets import ImageFolder

from .common import (
    ResumableDataLoader,
    ResumableSampler,
    SeededItems,
    cache_dir_for,
    check_images,
    seeded_global_rngs,
)
from .errors import DataError

SOURCE = (
    "https://image-net.org/download (ILSVRC2012 train and val; sort val into class folders, e.g. valprep.sh)"
)


def posterize_bits(img: Image.Image, bits_to_keep: int, **_) -> Image.Image:
    """Keep the ``bits_to_keep`` most significant bits of each channel: ``x & ~(2**(8 - bits) - 1)``.

    timm's ``PosterizeIncreasing`` reaches ``bits_to_keep = 0`` (an all-black image) when RandAugment's
    sampled magnitude reaches 10 (``m9-mstd0.5``: about 2% of draws); Pillow >= 12's ``ImageOps.posterize``
    rejects 0, which would end training on the first such draw. This computes the same table for 0..8.
    """
    if bits_to_keep >= 8:
        return img
    mask = ~(2 ** (8 - max(bits_to_keep, 0)) - 1)
    return img.point([i & mask for i in range(256)] * len(img.getbands()))


def _patch_posterize(transform) -> None:
    for t in getattr(transform, "transforms", []):
        if isinstance(t, RandAugment):
            for op in t.ops:
                if op.name.startswith("Posterize"):
                    op.aug_fn = posterize_bits


class ImageFolderDict(ImageFolder):
    """``torchvision.datasets.ImageFolder`` returning ``{"input": image, "label": class index}``; an image
    that cannot be decoded is a ``DataError`` naming the file."""

    def __getitem__(self, index: int) -> dict:
        try:
            image, label = super().__getitem__(index)
        except OSError as e:
            raise DataError(f"{self.samples[index][0]} cannot be decoded ({e}); replace the file") from None
        return {"input": image, "label": label}


def collate_images(samples: list[dict]) -> dict:
    batch = {
        "input": torch.stack([s["input"] for s in samples]),
        "padding_mask": None,
        "label": torch.tensor([s["label"] for s in samples], dtype=torch.int64),
    }
    if "aug_key" in samples[0]:  # seeds the batch's mixup draw (popped in on_after_batch_transfer)
        batch["aug_key"] = samples[0]["aug_key"]
    return batch


class ImageNetDataModule(L.LightningDataModule):
    """ImageNet-1K classification, DeiT recipe; see the module docstring for augmentation and batches."""

    task = "classify"  # the data contract (config checks it against task and model.*)
    input_type = "patch"  # [B, C, H, W] images

    def __init__(
        self,
        data_dir: str,
        batch_size: int = 128,
        num_workers: int = 8,
        seed: int = 0,
        num_classes: int = 1000,
        image_size: int = 224,
        crop_pct: float = 224 / 256,
        auto_augment: str | None = "rand-m9-mstd0.5-inc1",
        re_prob: float = 0.25,
        mixup_alpha: float = 0.8,
        cutmix_alpha: float = 1.0,
        label_smoothing: float = 0.1,
        repeated_aug: int = 3,
        eval_batch_size: int | None = None,
        cache_dir: str | None = None,
    ):
        """
        Args:
            data_dir: ImageNet root holding ``train/`` and ``val/``.
            batch_size: training images per batch per device (DeiT: 1024 in total); even when mixing.
            seed: seeds the training order and every item's augmentation (with its epoch and position).
            num_classes: expected number of class folders (checked against ``train/`` and ``val/``).
            image_size: training crop and evaluation size (tests use 32).
            crop_pct: evaluation center-crop fraction (resize to ``image_size / crop_pct`` first).
            auto_augment: timm auto-augment policy string, None to disable.
            re_prob: random-erasing probability.
            mixup_alpha, cutmix_alpha, label_smoothing: ``timm.data.Mixup`` settings; both alphas 0 disables it.
            repeated_aug: repeats per image of repeated augmentation; 0 or 1 samples plainly.
            eval_batch_size: validation/test batch size (default ``batch_size``).
            cache_dir: where the image check is remembered (default: ``common.cache_dir_for``).
        """
        super().__init__()
        self.data_dir = Path(data_dir)
        self.batch_size = batch_size
        self.eval_batch_size = eval_batch_size or batch_size
        self.num_workers = num_workers
        self.seed = seed
        self.num_classes = num_classes
        self.repeated_aug = repeated_aug
        self.cache_dir = cache_dir_for(self.data_dir, "imagenet", cache_dir)
        self.train_transform = create_transform(
            input_size=image_size,
            is_training=True,
            auto_augment=auto_augment,
            interpolation="bicubic",
            re_prob=re_prob,
            re_mode="pixel",
            re_count=1,
        )
        _patch_posterize(self.train_transform)
        self.eval_transform = create_transform(
            input_size=image_size, is_training=False, interpolation="bicubic", crop_pct=crop_pct
        )
        self.mixup_fn: Mixup | None = None
        if mixup_alpha > 0 or cutmix_alpha > 0:
            if batch_size % 2:
                raise ValueError(
                    f"mixup/cutmix pair images within a batch: batch_size must be even, got {batch_size}"
                )
            self.mixup_fn = Mixup(
                mixup_alpha=mixup_alpha,
                cutmix_alpha=cutmix_alpha,
                label_smoothing=label_smoothing,
                num_classes=num_classes,
            )
        self.datasets: dict[str, ImageFolderDict] = {}

    def _folder(self, split: str) -> Path:
        folder = self.data_dir / split
        if not folder.is_dir():
            raise FileNotFoundError(
                f"ImageNet not found: missing {folder}. Expected {self.data_dir}/train/<wnid>/*.JPEG and "
                f"{self.data_dir}/val/<wnid>/*.JPEG. Get it from {SOURCE}."
            )
        return folder

    def _image_folder(self, split: str, transform) -> ImageFolderDict:
        folder = self._folder(split)
        try:
            dataset = ImageFolderDict(str(folder), transform=transform)
        except FileNotFoundError as e:  # no class folder, or a class folder without images
            raise DataError(f"{folder}: {e}; expected {folder}/<wnid>/*.JPEG") from None
        found = len(dataset.classes)
        if found != self.num_classes:
            raise DataError(
                f"{folder} has {found} class folders, but data.options.num_classes={self.num_classes}; set "
                f"data.options.num_classes: {found} for a subset, or restore the missing folders (ImageNet-1K "
                f"has 1000)"
            )
        check_images(
            [Path(p) for p, _ in dataset.samples], self.cache_dir, "expected a readable image (ImageNet JPEG)"
        )
        return dataset

    def setup(self, stage: str | None = None) -> None:
        if "train" not in self.datasets and stage in (None, "fit"):
            self.datasets["train"] = self._image_folder("train", self.train_transform)
        if "val" not in self.datasets:
            self.datasets["val"] = self._image_folder("val", self.eval_transform)
            if "train" in self.datasets and self.datasets["val"].classes != self.datasets["train"].classes:
                raise DataError(f"class folders of {self.data_dir / 'val'} differ from those of train/")

    def train_dataloader(self) -> ResumableDataLoader:
        dataset = self.datasets["train"]
        sampler = ResumableSampler(
            len(dataset), seed=self.seed, repeats=max(self.repeated_aug, 1), item_keys=True
        )
        return ResumableDataLoader(
            SeededItems(dataset),
            self.batch_size,
            sampler,
            drop_last=True,
            collate_fn=collate_images,
            num_workers=self.num_workers,
            pin_memory=torch.cuda.is_available(),
            persistent_workers=self.num_workers > 0,
        )

    def _eval_loader(self) -> DataLoader:
        return DataLoader(
            self.datasets["val"],
            batch_size=self.eval_batch_size,
            shuffle=False,
            collate_fn=collate_images,
            num_workers=self.num_workers,
            pin_memory=torch.cuda.is_available(),
            persistent_workers=self.num_workers > 0,
        )

    def val_dataloader(self) -> DataLoader:
        return self._eval_loader()

    def test_dataloader(self) -> DataLoader:
        return self._eval_loader()

    def on_after_batch_transfer(self, batch: dict, dataloader_idx: int) -> dict:
        trainer = self.trainer
        key = batch.pop("aug_key", None)
        if self.mixup_fn is not None and trainer is not None and trainer.training:
            # timm's Mixup draws from NumPy's global generator: seed it from the batch's first item.
            with seeded_global_rngs([*key, 1]) if key is not None else contextlib.nullcontext():
                batch["input"], batch["label"] = self.mixup_fn(batch["input"], batch["label"])
        return batch
