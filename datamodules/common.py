"""Pieces shared by the datamodules: a resumable sampler and loader, per-item seeded augmentation, padding
collate, seeded splits, a writable cache location, image checks, and files written whole or not at all
(partial files named by host and process, removed on any exit, swept when their writer is gone)."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import math
import os
import random
import re
import shutil
import socket
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from .errors import DataError

log = logging.getLogger(__name__)

PAD_ID = 0  # token id of padding in every token task; real symbols start at 1


_DATA_PARALLEL: tuple[int, int] | None = None


def set_data_parallel(rank: int, size: int) -> None:
    """Declare this process's data-parallel (rank, size) when it differs from the world's: under chunk
    parallelism the ranks of one chunk group read the same batches and each trains on its own slice."""
    global _DATA_PARALLEL
    _DATA_PARALLEL = (rank, size)


def reset_data_parallel() -> None:
    """Forget ``set_data_parallel``'s declaration: the next run in this process (a notebook, a test) reads the
    world's ranks unless its strategy declares its own."""
    global _DATA_PARALLEL
    _DATA_PARALLEL = None


def declared_data_parallel() -> tuple[int, int] | None:
    """``set_data_parallel``'s (rank, size), or None when the data-parallel ranks are the world's."""
    return _DATA_PARALLEL


def data_parallel() -> tuple[int, int]:
    """(rank, size) among the processes that read different data: ``set_data_parallel``'s, else the world's."""
    if _DATA_PARALLEL is not None:
        return _DATA_PARALLEL
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class ResumableSampler(DistributedSampler):
    """Shuffling sampler whose position can be saved mid-epoch and restored exactly.

    The order of epoch ``e`` depends only on ``(seed, epoch)``. ``state_dict()`` records the epoch and how
    many of its indices were consumed; after ``load_state_dict()`` the next iteration yields the rest of that
    epoch's order (the offset is used once; a later iteration of the same epoch starts from 0 again).

    Under ``torch.distributed`` (or with explicit ``num_replicas``/``rank``) each rank takes every
    ``num_replicas``-th index of the order, padded by repetition to equal length as ``DistributedSampler``
    does. It *is* a ``DistributedSampler`` so that Lightning keeps it rather than wrapping it in one.

    Length bucketing (``lengths`` and ``bucket_batches > 0``): the shuffled order is cut into windows of
    ``bucket_batches`` global batches (``batch_size * num_replicas`` items), each window is sorted by length
    and cut into batches, and the full batches of the whole epoch are shuffled (the one partial batch, if
    any, stays last). Every batch then holds items of similar length, so padding nearly vanishes, while
    the order still depends only on ``(seed, epoch)`` and resumes exactly. (Each batch is then a sample of
    one length range rather than of the whole set; across the epoch every item is still seen once.)

    Repeated augmentation (``repeats > 1``, DeiT's RASampler as timm's ``RepeatAugSampler``): the epoch's
    permutation has every index ``repeats`` times in a row, global position ``p`` goes to rank
    ``p % num_replicas`` (wrapping around), and each rank draws ``floor(n // 256 * 256 / num_replicas)``
    items per epoch (``ceil(n / num_replicas)`` when ``n < 256``), so an epoch still shows about ``n`` images.

    ``item_keys=True`` yields ``(index, (seed, epoch, position))`` with the item's global position in the
    epoch, for :class:`SeededItems` to seed the item's augmentation from; the key depends on nothing else, so
    a resumed run (or another worker count) augments every item exactly as the uninterrupted run did.
    """

    def __init__(
        self,
        length: int,
        seed: int,
        shuffle: bool = True,
        num_replicas: int | None = None,
        rank: int | None = None,
        lengths: np.ndarray | None = None,
        batch_size: int = 1,
        bucket_batches: int = 0,
        repeats: int = 1,
        item_keys: bool = False,
    ):
        if num_replicas is None:
            rank, num_replicas = data_parallel()
        super().__init__(range(length), num_replicas=num_replicas, rank=rank or 0, shuffle=shuffle, seed=seed)
        self.length = length
        if bucket_batches < 0:
            raise ValueError(f"bucket_batches must be >= 0 (0 = no length bucketing), got {bucket_batches}")
        if bucket_batches and lengths is None:
            raise ValueError("length bucketing (bucket_batches > 0) needs the item lengths")
        if lengths is not None and len(lengths) != length:
            raise ValueError(f"lengths has {len(lengths)} entries for a data set of {length} items")
        self.lengths = None if lengths is None else np.asarray(lengths)
        if repeats < 1 or (repeats > 1 and bucket_batches):
            raise ValueError(f"repeats must be >= 1 and cannot be combined with bucketing, got {repeats}")
        self.repeats = repeats
        self.item_keys = item_keys
        if repeats > 1:  # timm's RepeatAugSampler: num_selected_samples with selected_round=256
            if length >= 256:
                self.num_samples = int(math.floor(length // 256 * 256 / self.num_replicas))
            else:
                self.num_samples = int(math.ceil(length / self.num_replicas))
            self.total_size = int(math.ceil(length * repeats / self.num_replicas)) * self.num_replicas
        self.batch_size = batch_size
        self.bucket_batches = bucket_batches
        self._resume_offset = 0  # where the next iteration starts in this epoch's order
        self._consumed = 0  # indices handed out by the current iteration, counting the offset

    def set_epoch(self, epoch: int) -> None:
        # Lightning calls this at every epoch start, also right after a mid-epoch resume: keep the offset
        # unless the epoch really changes.
        if epoch != self.epoch:
            self.epoch = epoch
            self._resume_offset = 0
            self._consumed = 0

    def indices(self, epoch: int) -> list[int]:
        """This rank's full order for ``epoch``."""
        if self.shuffle:
            order = np.random.default_rng([self.seed, epoch]).permutation(self.length)
            if self.bucket_batches:
                order = bucket_by_length(
                    order,
                    self.lengths,
                    self.batch_size * self.num_replicas,
                    self.bucket_batches,
                    np.random.default_rng([self.seed, epoch, 1]),
                )
        else:
            order = np.arange(self.length)
        if self.repeats > 1:
            order = np.repeat(order, self.repeats)
        return order[self.positions() % len(order)].tolist()  # wrapping pads by repeating the head

    def positions(self) -> np.ndarray:
        """Global positions in the epoch's order of this rank's items."""
        return np.arange(self.rank, self.total_size, self.num_replicas)[: self.num_samples]

    def __iter__(self) -> Iterator:
        start, self._resume_offset = self._resume_offset, 0
        self._consumed = start
        indices = self.indices(self.epoch)[start:]
        if self.item_keys:
            positions = self.positions()[start:].tolist()
            indices = [(i, (self.seed, self.epoch, p)) for i, p in zip(indices, positions)]
        for index in indices:
            self._consumed += 1
            yield index

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "consumed": self._consumed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        epoch, consumed = int(state["epoch"]), int(state["consumed"])
        if consumed >= self.num_samples:  # a finished epoch resumes as the start of the next one
            epoch, consumed = epoch + 1, 0
        self.epoch, self._resume_offset, self._consumed = epoch, consumed, consumed


def bucket_by_length(
    order: np.ndarray, lengths: np.ndarray, batch_size: int, window_batches: int, rng: np.random.Generator
) -> np.ndarray:
    """Reorder ``order`` so that each consecutive run of ``batch_size`` items has similar lengths.

    Windows of ``window_batches * batch_size`` items are sorted by length (stable) and cut into batches;
    the full batches are then shuffled with ``rng`` and the partial one (at most one) is put last.
    """
    if batch_size < 1 or window_batches < 1:
        raise ValueError(f"batch_size and window_batches must be >= 1, got {batch_size}, {window_batches}")
    window = batch_size * window_batches
    full, partial = [], []
    for start in range(0, len(order), window):
        chunk = order[start : start + window]
        chunk = chunk[np.argsort(lengths[chunk], kind="stable")]
        for b in range(0, len(chunk), batch_size):
            (full if b + batch_size <= len(chunk) else partial).append(chunk[b : b + batch_size])
    batches = [full[i] for i in rng.permutation(len(full))] + partial
    return np.concatenate(batches) if batches else order[:0]


class ResumableDataLoader(DataLoader):
    """DataLoader over a ``ResumableSampler`` whose state counts the batches it has *yielded*.

    Worker processes prefetch indices ahead of training, so the sampler's own count runs ahead of what the
    model has seen; this loader reports ``offset + yielded_batches * batch_size`` instead. Lightning 2.x
    saves ``state_dict()`` of a training loader that has one into the checkpoint and restores it on resume.
    """

    def __init__(self, dataset, batch_size: int, sampler: ResumableSampler, **kwargs):
        if not isinstance(sampler, ResumableSampler):
            raise TypeError(f"ResumableDataLoader needs a ResumableSampler, got {type(sampler).__name__}")
        super().__init__(dataset, batch_size=batch_size, sampler=sampler, **kwargs)
        self._position: tuple[int, int] | None = None  # (epoch, offset) of the iteration in progress
        self._yielded = 0

    def __iter__(self):
        sampler: ResumableSampler = self.sampler
        self._position = (sampler.epoch, sampler._resume_offset)
        self._yielded = 0
        for batch in super().__iter__():
            self._yielded += 1
            yield batch

    def state_dict(self) -> dict[str, int]:
        if self._position is None:
            return self.sampler.state_dict()
        epoch, offset = self._position
        consumed = offset + self._yielded * self.batch_size
        left = self.sampler.num_samples - consumed
        if left <= 0 or (self.drop_last and left < self.batch_size):
            consumed = self.sampler.num_samples  # the epoch has nothing more to yield
        return {"epoch": epoch, "consumed": consumed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.sampler.load_state_dict(state)
        self._position = None
        self._yielded = 0


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def pad_stack(
    sequences: Sequence[torch.Tensor], pad_to_multiple: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack 1-D tensors into ``[B, L]`` (L = longest, rounded up to ``pad_to_multiple``), padded with 0.

    Returns ``(values [B, L], padding_mask [B, L] bool, True = padding)``.
    """
    length = round_up(max(len(s) for s in sequences), pad_to_multiple)
    values = sequences[0].new_full((len(sequences), length), PAD_ID)
    mask = torch.ones((len(sequences), length), dtype=torch.bool)
    for row, s in enumerate(sequences):
        values[row, : len(s)] = s
        mask[row, : len(s)] = False
    return values, mask


class PadCollate:
    """Collate items ``{"input": 1-D tensor, "label": int}`` (or ``input1``/``input2``) into a padded batch.

    Every ``input<k>`` key gets a ``padding_mask<k>`` ([B, L] bool, True = padding); labels become [B] int64.
    """

    def __init__(self, pad_to_multiple: int = 1, input_keys: tuple[str, ...] = ("input",)):
        if pad_to_multiple < 1:
            raise ValueError(f"pad_to_multiple must be >= 1, got {pad_to_multiple}")
        self.pad_to_multiple = pad_to_multiple
        self.input_keys = input_keys

    def __call__(self, items: list[dict]) -> dict[str, torch.Tensor]:
        batch = {}
        for key in self.input_keys:
            values, mask = pad_stack([item[key] for item in items], self.pad_to_multiple)
            batch[key] = values
            batch["padding_mask" + key.removeprefix("input")] = mask
        batch["label"] = torch.tensor([item["label"] for item in items], dtype=torch.int64)
        return batch


def random_split_indices(n: int, lengths: Sequence[int], seed: int) -> list[np.ndarray]:
    """Disjoint index sets of the given ``lengths`` (summing to ``n``), as ``torch.utils.data.random_split``
    draws them with ``torch.Generator().manual_seed(seed)`` (the split Mega and S4 use)."""
    if sum(lengths) != n:
        raise ValueError(f"split lengths {list(lengths)} do not sum to {n}")
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).numpy()
    bounds = np.cumsum([0, *lengths])
    return [order[a:b] for a, b in zip(bounds[:-1], bounds[1:])]


@contextlib.contextmanager
def seeded_global_rngs(key: Sequence[int]):
    """Run the body with Python's, NumPy's and torch's (CPU) global generators seeded from ``key`` through
    ``numpy.random.SeedSequence``, then put their previous states back.

    Augmentation libraries (timm, torchvision) draw from these global generators; seeding them per item from
    a key of the item's place in the epoch makes its augmentation a function of that place alone, and the
    restore keeps the caller's streams (e.g. the model's dropout in the main process) untouched. CUDA
    generators are not touched.
    """
    words = np.random.SeedSequence(list(key)).generate_state(4)
    saved = random.getstate(), np.random.get_state(), torch.get_rng_state()
    random.seed(int(words[0]) << 32 | int(words[1]))
    np.random.seed(int(words[2]))
    torch.default_generator.manual_seed(int(words[3]))
    try:
        yield
    finally:
        random.setstate(saved[0])
        np.random.set_state(saved[1])
        torch.set_rng_state(saved[2])


class SeededItems(Dataset):
    """Wraps a map-style dataset of dict items for a sampler with ``item_keys=True``: item ``(index, key)``
    is ``dataset[index]`` computed under :func:`seeded_global_rngs` ``(key)``, plus ``"aug_key": key``."""

    def __init__(self, dataset: Dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index_key) -> dict:
        index, key = index_key
        with seeded_global_rngs(key):
            item = self.dataset[index]
        return {**item, "aug_key": tuple(key)}


def is_writable(path: str | os.PathLike) -> bool:
    """Whether this process may create files in ``path`` (or, if absent, in its nearest existing parent)."""
    path = Path(path)
    while not path.exists() and path != path.parent:
        path = path.parent
    return os.access(path, os.W_OK)


def source_signature(files: Sequence[str | os.PathLike], root: str | os.PathLike) -> str:
    """What a cache was built from, in 32 hex digits: each source file's path relative to ``root``, its size
    and its modification time (ns). A changed, added, removed or renamed file changes it; so does a copy
    that does not keep the times (a rebuild, never a stale read). Cheap: one ``stat`` per file, where hashing
    the contents (PG-19: 11 GB) at every start would not be."""
    root = Path(root)
    digest = hashlib.sha256()
    for path in sorted(Path(p) for p in files):
        st = path.stat()
        digest.update(f"{path.relative_to(root)}\t{st.st_size}\t{st.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:32]


def cache_dir_for(data_dir: str | os.PathLike, name: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """Where a data module keeps its derived files (decoded clips, split indices, check results).

    ``cache_dir`` when given; else ``<data_dir>/cache/<name>`` when that can be written; else, for a
    read-only data set (a shared mount), ``$XDG_CACHE_HOME/mega_suite/<16 hex of sha256 of the resolved
    data_dir>/<name>`` (``XDG_CACHE_HOME`` defaults to ``~/.cache``), logged.
    """
    if cache_dir is not None:
        return Path(cache_dir)
    data_dir = Path(data_dir)
    local = data_dir / "cache" / name
    if is_writable(local):
        return local
    digest = hashlib.sha256(str(data_dir.resolve()).encode()).hexdigest()[:16]
    user = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    elsewhere = user / "mega_suite" / digest / name
    log.warning("%s is not writable: caching %s in %s", data_dir, name, elsewhere)
    return elsewhere


def _check_image(path: Path, size: tuple[int, int] | None) -> str | None:
    from PIL import Image, UnidentifiedImageError

    try:
        if path.stat().st_size == 0:
            return "is an empty file"
        with Image.open(path) as image:
            found = image.size
            image.verify()  # PNG: every chunk's CRC; JPEG: the header only
    except FileNotFoundError:
        return "is missing"
    except (OSError, SyntaxError, UnidentifiedImageError, ValueError) as e:
        return f"cannot be read as an image ({e})"
    if size is not None and found != size:
        return f"is {found[0]}x{found[1]} pixels, expected {size[0]}x{size[1]}"
    return None


def check_images(
    paths: Sequence[Path], cache_dir: Path, what: str, size: tuple[int, int] | None = None, threads: int = 16
) -> None:
    """Raise ``DataError`` naming the first of ``paths`` that is empty, missing, not a readable image, or not
    ``size`` pixels (width, height). Reads each header (PNG: all chunks); a list that passed is remembered in
    ``cache_dir`` by a digest of every path, size and modification time, so the check runs once."""
    stats = []
    for p in paths:
        try:
            st = os.stat(p)
            stats.append(f"{p}\t{st.st_size}\t{st.st_mtime_ns}")
        except FileNotFoundError:
            stats.append(f"{p}\tmissing")
    digest = hashlib.sha256(f"{size}\n".encode() + "\n".join(stats).encode()).hexdigest()[:32]
    marker = cache_dir / f"images_ok_{digest}"
    if marker.is_file():
        return
    with ThreadPoolExecutor(threads) as pool:  # file reads release the GIL
        for path, problem in zip(paths, pool.map(lambda p: _check_image(Path(p), size), paths)):
            if problem:
                raise DataError(f"{path} {problem}; {what}")
    sweep_partial_files(cache_dir)
    write_text_atomic(marker, f"{len(paths)} images checked\n")


# ---------------------------------------------------------------------------------- files written whole
_HOST = re.sub(r"[^A-Za-z0-9._-]", "_", socket.gethostname()) or "host"
_PARTIAL = re.compile(r"^(?P<target>.+)\.tmp-(?P<host>[A-Za-z0-9._-]+)-(?P<pid>\d+)$")
FOREIGN_STALE_S = 24 * 3600  # another host's partial file: swept only when unmodified this long
_START_SLACK_S = 5.0  # process start times from /proc are exact to ~1 s; a writer is never that quick


def partial_name(path: str | os.PathLike) -> Path:
    """The name ``path`` is written under until it is complete: ``<name>.tmp-<host>-<pid>`` beside it."""
    path = Path(path)
    return path.with_name(f"{path.name}.tmp-{_HOST}-{os.getpid()}")


def _process_start(pid: int) -> float | None:
    """When process ``pid`` started (seconds since the epoch), from Linux's /proc; None where unknown."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        boot = next(line for line in Path("/proc/stat").read_text().splitlines() if line.startswith("btime"))
        return int(boot.split()[1]) + int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22: starttime
    except (OSError, IndexError, ValueError, StopIteration):
        return None


def _is_stale(path: Path, host: str, pid: int) -> bool:
    """Whether the process that wrote partial file ``path`` is gone: on this host, no process ``pid`` runs,
    or the one that does started after ``path`` was last written (its pid was reused); on another host
    (a shared file system), ``path`` was not modified for ``FOREIGN_STALE_S``."""
    mtime = path.lstat().st_mtime
    if host != _HOST:
        return time.time() - mtime > FOREIGN_STALE_S
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # another user's process: alive
        pass
    started = _process_start(pid)
    return started is not None and mtime < started - _START_SLACK_S


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _size(path: Path) -> int:
    if path.is_dir() and not path.is_symlink():
        return sum(p.lstat().st_size for p in path.rglob("*"))
    return path.lstat().st_size


def sweep_partial_files(folder: str | os.PathLike) -> list[Path]:
    """Remove the partial files (``partial_name``) in ``folder`` whose writer is gone (a killed preparation),
    saying in one line what was removed; returns them. Another live process's are kept."""
    folder = Path(folder)
    removed, total = [], 0
    try:
        entries = list(folder.iterdir())
    except OSError:  # absent or unreadable: nothing of ours there
        return removed
    for entry in sorted(entries):
        match = _PARTIAL.match(entry.name)
        try:
            if match is None or not _is_stale(entry, match["host"], int(match["pid"])):
                continue
            size = _size(entry)
            _remove(entry)
        except OSError:  # removed meanwhile by another sweep, or not ours to remove
            continue
        removed.append(entry)
        total += size
    if removed:
        names = ", ".join(p.name for p in removed)
        print(
            f"[mega-suite] removed {len(removed)} partial file(s) ({total / 2**20:.1f} MiB) an interrupted "
            f"preparation left in {folder}: {names}"
        )
    return removed


@contextlib.contextmanager
def partial_file(path: str | os.PathLike) -> Iterator[Path]:
    """Write ``path`` whole or not at all: the body writes the yielded ``partial_name(path)``, renamed onto
    ``path`` when the body ends normally and removed whatever else ends it (an error, ``KeyboardInterrupt``,
    ``SystemExit``). Sweeping what killed writers left is the preparation's, once per folder
    (``sweep_partial_files``), not every write's: a folder of many shards would be listed once per shard."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = partial_name(path)
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        _remove(tmp)  # nothing left after the rename


def place_new(tmp: Path, path: Path) -> None:
    """Rename ``tmp`` to ``path`` unless ``path`` exists (``FileExistsError``): never replaces a file."""
    try:
        os.link(tmp, path)  # fails on an existing name, where a rename would replace it
    except FileExistsError:
        raise FileExistsError(errno.EEXIST, "File exists", str(path)) from None
    except OSError:  # a file system without hard links: the check and the rename are two steps there
        if path.exists():
            raise FileExistsError(errno.EEXIST, "File exists", str(path)) from None
        os.replace(tmp, path)
        return
    tmp.unlink()


def write_bytes_atomic(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` whole or not at all (``partial_file``): readers see all of it or nothing."""
    with partial_file(path) as tmp:
        tmp.write_bytes(data)


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` whole or not at all (``partial_file``)."""
    write_bytes_atomic(path, text.encode("utf-8"))


def write_json_atomic(path: str | os.PathLike, obj) -> None:
    """Write ``obj`` as JSON to ``path`` whole or not at all (``partial_file``)."""
    write_text_atomic(path, json.dumps(obj, indent=1))


def save_npy_atomic(path: str | os.PathLike, array: np.ndarray) -> None:
    """``np.save`` to ``path`` whole or not at all (``partial_file``)."""
    with partial_file(path) as tmp, open(tmp, "wb") as f:
        np.save(f, array)


def read_json(path: str | os.PathLike) -> dict | None:
    """A cache's JSON record, or None when it is absent or unreadable (then the cache is rebuilt)."""
    try:
        value = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


REPOSITORY = Path(__file__).resolve().parent.parent
_USER_AREAS = ("data", "runs")  # the repository's ignored folders for the user's data and runs (.gitignore)


def ships_with_repository(path: str | os.PathLike) -> bool:
    """Whether ``path`` is the repository or lies in a folder it ships (corpora/, recipes/, ...): an error
    message must never advise removing such a folder."""
    try:
        relative = Path(path).resolve().relative_to(REPOSITORY)
    except ValueError:
        return False
    return not relative.parts or relative.parts[0] not in _USER_AREAS
