"""ImageNet-1K with the DeiT training pipeline (Touvron et al. 2021), built from timm's parts.

Layout (DATA.md): ``<data_dir>/train/<wnid>/*.JPEG`` and ``<data_dir>/val/<wnid>/*.JPEG`` (validation
images moved into class folders); read with ``torchvision.datasets.ImageFolder``. ``val`` serves as both
validation and test set (the official test labels are not public).

Training transform: ``timm.data.create_transform`` with RandomResizedCrop + flip, RandAugment
``rand-m9-mstd0.5-inc1``, bicubic interpolation, random erasing 0.25 (pixel mode), ImageNet mean/std.
Evaluation: resize to ``image_size / crop_pct`` (256 for 224) bicubic, center crop, normalise.
Repeated augmentation (DeiT's 3 repeats): ``repeated_aug > 1`` trains with :class:`RepeatAugSampler`.

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

from pathlib import Path

import lightning as L
import torch
from timm.data import Mixup, create_transform
from timm.data.distributed_sampler import RepeatAugSampler as _TimmRepeatAugSampler
from torch.utils.data import DataLoader, DistributedSampler
from torchvision.datasets import ImageFolder

SOURCE = (
    "https://image-net.org/download (ILSVRC2012 train and val; sort val into class folders, e.g. valprep.sh)"
)


class RepeatAugSampler(_TimmRepeatAugSampler, DistributedSampler):
    """timm's (DeiT's) repeated-augmentation sampler: each epoch draws ``len(dataset) / world_size`` indices
    per rank from a permutation in which every index appears ``num_repeats`` times in a row, so the repeats
    of an image land on different ranks (or, on one process, in the same or adjacent batches).

    Also a ``DistributedSampler`` by type only, so that Lightning does not wrap it in a second distributed
    sampler: it already takes ``num_replicas``/``rank`` (pass them explicitly; 1 and 0 on one process).
    ``seed`` offsets timm's per-epoch shuffling seed.
    """

    def __init__(self, dataset, num_replicas: int, rank: int, num_repeats: int = 3, seed: int = 0):
        _TimmRepeatAugSampler.__init__(
            self, dataset, num_replicas=num_replicas, rank=rank, shuffle=True, num_repeats=num_repeats
        )
        self.seed = seed
        self.set_epoch(0)

    def set_epoch(self, epoch: int) -> None:
        # timm seeds its permutation with the epoch alone.
        self.epoch = self.seed * 1_000_003 + epoch


class ImageFolderDict(ImageFolder):
    """``torchvision.datasets.ImageFolder`` returning ``{"input": image, "label": class index}``."""

    def __getitem__(self, index: int) -> dict:
        image, label = super().__getitem__(index)
        return {"input": image, "label": label}


def collate_images(samples: list[dict]) -> dict:
    return {
        "input": torch.stack([s["input"] for s in samples]),
        "padding_mask": None,
        "label": torch.tensor([s["label"] for s in samples], dtype=torch.int64),
    }


class ImageNetDataModule(L.LightningDataModule):
    """ImageNet-1K classification, DeiT recipe; see the module docstring for augmentation and batches."""

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
    ):
        """
        Args:
            data_dir: ImageNet root holding ``train/`` and ``val/``.
            batch_size: training images per batch per device (DeiT: 1024 in total); even when mixing.
            seed: offsets the repeated-augmentation shuffling (other randomness follows ``seed_everything``).
            num_classes: expected number of class folders (checked against ``train/``).
            image_size: training crop and evaluation size (tests use 32).
            crop_pct: evaluation center-crop fraction (resize to ``image_size / crop_pct`` first).
            auto_augment: timm auto-augment policy string, None to disable.
            re_prob: random-erasing probability.
            mixup_alpha, cutmix_alpha, label_smoothing: ``timm.data.Mixup`` settings; both alphas 0 disables it.
            repeated_aug: repeats per image of repeated augmentation; 0 or 1 samples plainly.
            eval_batch_size: validation/test batch size (default ``batch_size``).
        """
        super().__init__()
        self.data_dir = Path(data_dir)
        self.batch_size = batch_size
        self.eval_batch_size = eval_batch_size or batch_size
        self.num_workers = num_workers
        self.seed = seed
        self.num_classes = num_classes
        self.repeated_aug = repeated_aug
        self.train_transform = create_transform(
            input_size=image_size,
            is_training=True,
            auto_augment=auto_augment,
            interpolation="bicubic",
            re_prob=re_prob,
            re_mode="pixel",
            re_count=1,
        )
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

    def setup(self, stage: str | None = None) -> None:
        if "train" not in self.datasets and stage in (None, "fit"):
            self.datasets["train"] = ImageFolderDict(
                str(self._folder("train")), transform=self.train_transform
            )
            found = len(self.datasets["train"].classes)
            if found != self.num_classes:
                raise ValueError(
                    f"{self.data_dir / 'train'} has {found} class folders, expected {self.num_classes}"
                )
        if "val" not in self.datasets:
            self.datasets["val"] = ImageFolderDict(str(self._folder("val")), transform=self.eval_transform)
            if "train" in self.datasets and self.datasets["val"].classes != self.datasets["train"].classes:
                raise ValueError(f"class folders of {self.data_dir / 'val'} differ from those of train/")

    def train_dataloader(self) -> DataLoader:
        dataset = self.datasets["train"]
        sampler = None
        if self.repeated_aug > 1:
            trainer = self.trainer
            rank, world = (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)
            sampler = RepeatAugSampler(dataset, world, rank, num_repeats=self.repeated_aug, seed=self.seed)
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            shuffle=sampler is None,
            sampler=sampler,
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
        if self.mixup_fn is not None and trainer is not None and trainer.training:
            batch["input"], batch["label"] = self.mixup_fn(batch["input"], batch["label"])
        return batch
