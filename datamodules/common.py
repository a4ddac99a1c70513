"""Pieces shared by the datamodules: a resumable sampler and loader, padding collate, seeded splits."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

PAD_ID = 0  # token id of padding in every token task; real symbols start at 1


class ResumableSampler(DistributedSampler):
    """Shuffling sampler whose position can be saved mid-epoch and restored exactly.

    The order of epoch ``e`` depends only on ``(seed, epoch)``. ``state_dict()`` records the epoch and how
    many of its indices were consumed; after ``load_state_dict()`` the next iteration yields the rest of that
    epoch's order (the offset is used once; a later iteration of the same epoch starts from 0 again).

    Under ``torch.distributed`` (or with explicit ``num_replicas``/``rank``) each rank takes every
    ``num_replicas``-th index of the order, padded by repetition to equal length as ``DistributedSampler``
    does. It *is* a ``DistributedSampler`` so that Lightning keeps it rather than wrapping it in one.
    """

    def __init__(
        self,
        length: int,
        seed: int,
        shuffle: bool = True,
        num_replicas: int | None = None,
        rank: int | None = None,
    ):
        if num_replicas is None:
            distributed = dist.is_available() and dist.is_initialized()
            num_replicas = dist.get_world_size() if distributed else 1
            rank = dist.get_rank() if distributed else 0
        super().__init__(range(length), num_replicas=num_replicas, rank=rank or 0, shuffle=shuffle, seed=seed)
        self.length = length
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
        else:
            order = np.arange(self.length)
        if self.total_size > self.length:
            order = np.resize(order, self.total_size)  # repeats the head
        return order[self.rank : self.total_size : self.num_replicas].tolist()

    def __iter__(self) -> Iterator[int]:
        start, self._resume_offset = self._resume_offset, 0
        self._consumed = start
        for index in self.indices(self.epoch)[start:]:
            self._consumed += 1
            yield index

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "consumed": self._consumed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        epoch, consumed = int(state["epoch"]), int(state["consumed"])
        if consumed >= self.num_samples:  # a finished epoch resumes as the start of the next one
            epoch, consumed = epoch + 1, 0
        self.epoch, self._resume_offset, self._consumed = epoch, consumed, consumed


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
