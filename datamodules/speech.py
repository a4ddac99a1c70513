"""Speech Commands v0.02, SC10 raw waveforms (16000 samples at 16 kHz), as Mega and S4 use it.

Layout (docs/data.md#speech-commands): ``<data_dir>/speech_commands_v0.02/<word>/<speaker>_nohash_<n>.wav`` (16-bit PCM mono).
Only the ten SC10 words are read and only clips of exactly 16000 samples are kept (34,975 in the release);
samples are scaled by 1/2^15; the shorter clips are skipped (their count is logged). A clip that is not
16 kHz mono, or not a readable WAV, is a ``DataError`` naming the file. The split is stratified by word,
70/15/15: a 70/30 split seeded with ``split_seed``, then the 30 halved by a second split seeded with
``split_seed + 1`` (S4's ``split_data``: ``train_test_split`` with ``random_state=0``, then ``1``; the default
``split_seed=0`` follows it). The training ``seed`` orders the batches only, so every seed of a study sees the
same test set. Inputs are z-normalised with the mean and standard deviation of the training clips (one
scalar each, as S4).

Decoding happens once: ``<cache_dir>/waveforms.npy`` (int16 ``[N, 16000]``, memory-mapped) and
``labels.npy`` (int64 ``[N]``), plus ``split<split_seed>.npz`` with the split indices and the training
statistics; ``cache_dir`` defaults to ``<data_dir>/cache/speech_commands_sc10``, or to a user cache when the
data directory is read-only (``common.cache_dir_for``). The cache records the signature of the clips it was
decoded from (``common.source_signature``): a changed, added or removed clip decodes them again. Batches: ``{"input": [B, 16000] float32, "padding_mask": [B, 16000] bool (all False: every clip
is full length), "label": [B] int64}``.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import lightning as L
import numpy as np
import soundfile
import torch
from torch.utils.data import DataLoader, Dataset
from tqdm.auto import tqdm

from datamodules.common import (
    ResumableDataLoader,
    ResumableSampler,
    cache_dir_for,
    partial_file,
    read_json,
    save_npy_atomic,
    source_signature,
    sweep_partial_files,
    write_json_atomic,
    write_text_atomic,
)
from datamodules.errors import DataError

log = logging.getLogger(__name__)

SC10_WORDS = ("yes", "no", "up", "down", "left", "right", "on", "off", "stop", "go")
CLIP_SAMPLES = 16000
SOURCE = "http://download.tensorflow.org/data/speech_commands_v0.02.tar.gz"
_STD_EPS = 1e-5  # S4's normalise_data: (x - mean) / (std + 1e-5)


def stratified_split(labels: np.ndarray, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Splits indices ``0..len(labels)-1`` into (rest, part) with ``part`` holding ``round(fraction * n_c)``
    randomly chosen indices of every class ``c``; both returned sorted."""
    rng = np.random.default_rng(seed)
    part = []
    for c in np.unique(labels):
        members = np.flatnonzero(labels == c)
        part.append(rng.permutation(members)[: int(round(fraction * len(members)))])
    part = np.sort(np.concatenate(part)) if part else np.empty(0, np.int64)
    rest = np.setdiff1d(np.arange(len(labels)), part)
    return rest, part


def sc10_split(labels: np.ndarray, split_seed: int) -> dict[str, np.ndarray]:
    """70/15/15 stratified train/val/test indices: 70/30 seeded with ``split_seed``, then the 30 halved with
    ``split_seed + 1`` (S4's two ``train_test_split`` calls, ``random_state`` 0 and 1)."""
    train, held = stratified_split(labels, 0.3, split_seed)
    val_local, test_local = stratified_split(labels[held], 0.5, split_seed + 1)
    return {"train": train, "val": held[val_local], "test": held[test_local]}


class SpeechCommandsDataset(Dataset):
    """Normalised clips ``rows`` of the cached waveform file (opened lazily, once per process)."""

    def __init__(self, waveform_file: Path, labels: np.ndarray, rows: np.ndarray, mean: float, std: float):
        self.waveform_file = waveform_file
        self.labels = labels
        self.rows = rows
        self.mean = mean
        self.scale = 1.0 / (std + _STD_EPS)
        self._waves: np.ndarray | None = None

    def __getstate__(self):
        return {**self.__dict__, "_waves": None}

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if self._waves is None:
            self._waves = np.load(self.waveform_file, mmap_mode="r")
        row = self.rows[index]
        x = (self._waves[row].astype(np.float32) / 2**15 - self.mean) * self.scale
        return {
            "input": torch.from_numpy(x.astype(np.float32)),
            "padding_mask": torch.zeros(CLIP_SAMPLES, dtype=torch.bool),
            "label": torch.tensor(self.labels[row], dtype=torch.int64),
        }


class SpeechCommandsDataModule(L.LightningDataModule):
    """SC10 raw-waveform classification (10 classes); see the module docstring for layout and batches."""

    task = "classify"  # the data contract (config checks it against task and model.*)
    input_type = "scalar"  # one float per step

    num_classes = len(SC10_WORDS)

    def __init__(
        self,
        data_dir: str,
        batch_size: int = 20,
        num_workers: int = 0,
        seed: int = 42,
        eval_batch_size: int | None = None,
        cache_dir: str | None = None,
        split_seed: int = 0,
    ):
        """
        Args:
            data_dir: folder holding ``speech_commands_v0.02/``.
            batch_size: training clips per batch (Mega: 20).
            seed: seeds the training order only.
            eval_batch_size: validation/test batch size (default ``batch_size``).
            cache_dir: decoded clips and splits (default: see ``common.cache_dir_for``).
            split_seed: seeds the two stratified splits (default 0: S4's ``random_state`` 0, then 1).
        """
        super().__init__()
        self.data_dir = Path(data_dir)
        self.root = self.data_dir / "speech_commands_v0.02"
        self.cache_dir = cache_dir_for(self.data_dir, "speech_commands_sc10", cache_dir)
        self.batch_size = batch_size
        self.eval_batch_size = eval_batch_size or batch_size
        self.num_workers = num_workers
        self.seed = seed
        self.split_seed = split_seed
        self.datasets: dict[str, SpeechCommandsDataset] = {}
        self.mean: float | None = None
        self.std: float | None = None

    # ------------------------------------------------------------------ cache
    def _wav_files(self) -> list[tuple[Path, int]]:
        missing = [w for w in SC10_WORDS if not (self.root / w).is_dir()]
        if missing:
            raise FileNotFoundError(
                f"Speech Commands v0.02 not found: missing {', '.join(str(self.root / w) for w in missing)}. "
                f"Expected {self.root}/<word>/<speaker>_nohash_<n>.wav (16 kHz 16-bit mono) for the SC10 "
                f"words {', '.join(SC10_WORDS)}. Get {SOURCE} and unpack it into {self.root}."
            )
        return [
            (path, label)
            for label, word in enumerate(SC10_WORDS)
            for path in sorted((self.root / word).glob("*.wav"))
        ]

    def prepare_data(self) -> None:
        """Decodes the SC10 clips, then splits them for ``split_seed``, each once (idempotent; run on one
        process per node); again when a clip was changed, added or removed since."""
        meta_path = self.cache_dir / "meta.json"
        sources = source_signature([p for p, _ in self._wav_files()], self.root)
        sweep_partial_files(self.cache_dir)
        if meta_path.is_file() and (read_json(meta_path) or {}).get("sources") != sources:
            print(
                f"[mega-suite] the clips under {self.root} changed since {self.cache_dir} was built: decoding again"
            )
            meta_path.unlink()
            for split in self.cache_dir.glob("split*.npz"):  # computed from the clips decoded before
                split.unlink()
        if not meta_path.is_file():
            self._decode(sources)
        self._split(np.load(self.cache_dir / "labels.npy"))

    @staticmethod
    def _frames(path: Path) -> int:
        """Sample count of a 16 kHz mono WAV; ``DataError`` naming ``path`` for anything else."""
        try:
            info = soundfile.info(str(path))
        except (RuntimeError, soundfile.LibsndfileError) as e:
            raise DataError(
                f"{path} is not a readable WAV file ({e}); expected 16 kHz mono 16-bit PCM"
            ) from None
        if info.samplerate != 16000 or info.channels != 1:
            raise DataError(
                f"{path} has {info.samplerate} Hz, {info.channels} channel(s); expected 16 kHz mono "
                f"(Speech Commands v0.02 clips); replace the file or remove it"
            )
        return info.frames

    def _decode(self, sources: str) -> None:
        files = self._wav_files()
        # Headers first (cheap), so the memory-mapped output can be allocated at its final size.
        keep = [(p, y) for p, y in files if self._frames(p) == CLIP_SAMPLES]
        if not keep:
            raise DataError(f"no clip of exactly {CLIP_SAMPLES} samples under {self.root}")
        with partial_file(self.cache_dir / "waveforms.npy") as tmp:
            waves = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.int16, shape=(len(keep), CLIP_SAMPLES))
            # the bar is closed on an error too, so that the error line starts a line of its own
            with tqdm(keep, desc="decoding Speech Commands SC10", unit=" clips") as bar:
                for i, (path, _) in enumerate(bar):
                    try:
                        audio, rate = soundfile.read(str(path), dtype="int16")
                    except (RuntimeError, soundfile.LibsndfileError) as e:
                        raise DataError(
                            f"{path} is not a readable WAV file ({e}); expected 16 kHz mono"
                        ) from None
                    if audio.shape != (CLIP_SAMPLES,) or rate != 16000:
                        raise DataError(
                            f"{path}: decoded {audio.shape} samples at {rate} Hz, expected 16 kHz mono of "
                            f"{CLIP_SAMPLES} samples as its header says"
                        )
                    waves[i] = audio
            waves.flush()
            del waves
            save_npy_atomic(self.cache_dir / "labels.npy", np.asarray([y for _, y in keep], dtype=np.int64))
        write_text_atomic(
            self.cache_dir / "files.txt", "".join(f"{p.relative_to(self.root)}\n" for p, _ in keep)
        )
        meta = {"clips": len(keep), "scanned": len(files), "words": list(SC10_WORDS), "sources": sources}
        write_json_atomic(self.cache_dir / "meta.json", meta)  # last: the cache is complete

    def _split(self, labels: np.ndarray) -> dict:
        """Split indices and training statistics for ``split_seed``, computed once and cached."""
        path = self.cache_dir / f"split{self.split_seed}.npz"  # (older caches named split_seed<seed>.npz
        if not path.is_file():  # used one seed for both splits: not reused)
            split = sc10_split(labels, self.split_seed)
            waves = np.load(self.cache_dir / "waveforms.npy", mmap_mode="r")
            total, total_sq = 0.0, 0.0
            for start in range(0, len(split["train"]), 1024):  # float64 sums over blocks of clips
                block = waves[split["train"][start : start + 1024]].astype(np.float64) / 2**15
                total += block.sum()
                total_sq += np.square(block).sum()
            count = len(split["train"]) * CLIP_SAMPLES
            mean = total / count
            std = np.sqrt(max(total_sq / count - mean**2, 0.0) * count / max(count - 1, 1))  # torch.std's
            with partial_file(path) as tmp, open(tmp, "wb") as f:
                np.savez(f, **split, mean=mean, std=std)
        with np.load(path) as f:
            return {k: f[k] for k in f.files}

    # ------------------------------------------------------------------ Lightning
    def setup(self, stage: str | None = None) -> None:
        self.prepare_data()
        meta = json.loads((self.cache_dir / "meta.json").read_text())
        log.info(
            "Speech Commands SC10: %d clips of %d samples; skipped %d clips not of exactly %d samples "
            "(the shorter ones, as Mega and S4 do); cache %s",
            meta["clips"],
            CLIP_SAMPLES,
            meta["scanned"] - meta["clips"],
            CLIP_SAMPLES,
            self.cache_dir,
        )
        labels = np.load(self.cache_dir / "labels.npy")
        split = self._split(labels)
        self.mean, self.std = float(split["mean"]), float(split["std"])
        waveform_file = self.cache_dir / "waveforms.npy"
        self.datasets = {
            name: SpeechCommandsDataset(waveform_file, labels, split[name], self.mean, self.std)
            for name in ("train", "val", "test")
        }

    def _loader_kwargs(self) -> dict:
        return {
            "num_workers": self.num_workers,
            "pin_memory": torch.cuda.is_available(),
            "persistent_workers": self.num_workers > 0,
        }

    def train_dataloader(self) -> ResumableDataLoader:
        dataset = self.datasets["train"]
        sampler = ResumableSampler(len(dataset), seed=self.seed, shuffle=True)
        return ResumableDataLoader(dataset, self.batch_size, sampler, **self._loader_kwargs())

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.datasets["val"], self.eval_batch_size, shuffle=False, **self._loader_kwargs())

    def test_dataloader(self) -> DataLoader:
        return DataLoader(self.datasets["test"], self.eval_batch_size, shuffle=False, **self._loader_kwargs())
