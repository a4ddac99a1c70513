"""The Lightning strategy of the sharded runs (``trainer.strategy=fsdp|hsdp``): FSDP2 on the suite's device mesh,
atomic sharded checkpoints, and samplers split over the data-parallel ranks (docs/distributed.md)."""

from __future__ import annotations

import contextlib
from pathlib import Path

from lightning.pytorch.strategies import ModelParallelStrategy

from datamodules.common import set_data_parallel
from mega_suite.distributed.chunk_parallel import ChunkParallelContext
from mega_suite.distributed.fsdp import build_mesh, data_parallel_rank
from mega_suite.storage.atomic import remove_path, replace_checkpoint
from mega_suite.training.saving import save_error


def make_strategy(kind: str, chunk_parallel: int = 1, chunk_parallel_mode: str = "parallel", **kwargs):
    """Lightning's ``ModelParallelStrategy`` with the mesh of ``build_mesh`` (not Lightning's (data_parallel,
    tensor_parallel) mesh, which ``fully_shard`` would read as HSDP) and samplers split over every
    data-parallel rank."""

    class ShardedStrategy(ModelParallelStrategy):
        strategy_kind = kind

        def setup_environment(self) -> None:
            self._setup_distributed()
            device = self.root_device.type
            self._device_mesh = build_mesh(self.world_size, self.num_nodes, kind, chunk_parallel, device)
            self.lightning_module._device_mesh = self._device_mesh
            if chunk_parallel > 1:
                # the P ranks of a chunk group read the same batches (each trains on its own slice)
                set_data_parallel(*data_parallel_rank(self._device_mesh))
                group = self._device_mesh.get_group("cp")
                self.lightning_module.chunk_parallel = ChunkParallelContext.from_group(
                    group, chunk_parallel_mode
                )

        def save_checkpoint(self, checkpoint, filepath, storage_options=None) -> None:
            """Lightning's sharded save into ``<path>.tmp``, then ``replace_checkpoint``: atomic like the
            single-process ``AtomicCheckpointIO`` (a kill during a save leaves the previous one usable)."""
            path = Path(self.broadcast(str(filepath)))
            tmp = path.with_name(path.name + ".tmp")
            try:
                if self.global_rank == 0:
                    remove_path(tmp)
                self.barrier()
                super().save_checkpoint(checkpoint, tmp, storage_options)
                self.barrier()
                if self.global_rank == 0:
                    replace_checkpoint(tmp, path)
            except BaseException as exc:
                if self.global_rank == 0:
                    with contextlib.suppress(OSError):
                        remove_path(tmp)
                if isinstance(exc, OSError):
                    raise save_error(path, exc) from None
                raise
            self.barrier()

        @property
        def distributed_sampler_kwargs(self) -> dict:
            rank, size = data_parallel_rank(self.device_mesh)
            return {"num_replicas": size, "rank": rank}

    return ShardedStrategy(**kwargs)
