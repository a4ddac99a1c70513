"""LightningDataModules of the suite, by name: readers of published on-disk layouts (see docs/data.md)."""

from .errors import DataError as DataError
from .imagenet import ImageNetDataModule
from .kjv import KJVDataModule
from .lra import AANRetrievalDataModule, IMDBTextDataModule, ListOpsDataModule
from .lra_images import CIFAR10GrayDataModule, PathfinderDataModule, PathXDataModule
from .pg19 import PG19DataModule
from .pretrain import PretrainDataModule
from .speech import SpeechCommandsDataModule
from .wikitext import WikiText103DataModule

DATAMODULES = {
    "listops": ListOpsDataModule,
    "lra_text": IMDBTextDataModule,
    "lra_retrieval": AANRetrievalDataModule,
    "lra_image": CIFAR10GrayDataModule,
    "lra_pathfinder": PathfinderDataModule,
    "lra_pathx": PathXDataModule,
    "sc_raw": SpeechCommandsDataModule,
    "imagenet": ImageNetDataModule,
    "wt103": WikiText103DataModule,
    "pg19": PG19DataModule,
    "kjv": KJVDataModule,
    "pretrain": PretrainDataModule,
}


def build_datamodule(name: str, **kwargs):
    """Instantiate the datamodule registered as ``name`` with keyword arguments ``kwargs``."""
    if name not in DATAMODULES:
        raise KeyError(f"unknown datamodule {name!r}; valid names: {', '.join(sorted(DATAMODULES))}")
    return DATAMODULES[name](**kwargs)
