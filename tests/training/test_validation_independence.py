"""A validation changes nothing that follows (issue 36, point 7): the weights after N steps and the metrics of
a validation at step N are the same whether the run validated after every step or only at step N.

The difference once seen (2e-4 in a later validation loss) came from the evaluation forward's cache of the CEMA
coefficients, keyed on the parameters' version counters: the fused AdamW kernel (``optim.implementation``'s
default) updates parameters in place without moving them, and FSDP2's all-gather keeps them on purpose, so
every validation after the first reused the first one's coefficients.
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
from spawn_support import TINY_KJV_LM

from mega_suite.config import ADAMW_KERNELS
from mega_suite.models.megalodon.layers import ComplexEMA

STEPS = 3


def _adamw_step(kernel: str):
    def change(cema: ComplexEMA) -> None:
        params = list(cema.parameters())
        for p in params:
            p.grad = torch.ones_like(p)
        torch.optim.AdamW(params, lr=0.1, **ADAMW_KERNELS[kernel]).step()

    return change


def _copy_keeping_versions(cema: ComplexEMA) -> None:
    """New values written as FSDP2's all-gather writes the unsharded parameters: version counters kept."""
    with torch.no_grad():
        for p in cema.parameters():
            with torch.autograd._unsafe_preserve_version_counter(p):
                p.copy_(p + 0.1)


CHANGES = {
    "adamw_fused": _adamw_step("fused"),
    "adamw_foreach": _adamw_step("foreach"),
    "adamw_for_loop": _adamw_step("for-loop"),
    "fsdp2_all_gather": _copy_keeping_versions,
}


@pytest.mark.parametrize("change", CHANGES)
def test_an_evaluation_forward_sees_parameters_changed_in_place(change):
    """A no-grad forward (validation, streaming evaluation) after the parameters changed in place equals the
    forward of a fresh layer holding the new values, exactly; and differs from the forward before the change."""
    torch.manual_seed(0)
    cema = ComplexEMA(8, 4)
    x = torch.randn(2, 16, 8)
    with torch.no_grad():
        before = cema(x)[0]
        CHANGES[change](cema)
        after = cema(x)[0]
        fresh = ComplexEMA(8, 4)
        fresh.load_state_dict(cema.state_dict())
        expected = fresh(x)[0]
    assert not torch.equal(before, expected)
    assert torch.equal(after, expected)


class Record(L.Callback):
    """The metrics of every validation (by step) and the final weights."""

    def __init__(self):
        self.metrics: dict[int, dict[str, float]] = {}
        self.weights: dict[str, torch.Tensor] = {}

    def on_validation_end(self, trainer, pl_module) -> None:
        logged = trainer.callback_metrics.items()
        self.metrics[trainer.global_step] = {
            k: float(v) for k, v in logged if k.startswith(("val/", "test/"))
        }

    def on_fit_end(self, trainer, pl_module) -> None:
        self.weights = {k: v.detach().clone() for k, v in pl_module.model.state_dict().items()}


@pytest.fixture(scope="module")
def data_dirs(tmp_path_factory) -> dict[str, Path]:
    from datamodules.listops_generator import generate_listops

    listops = tmp_path_factory.mktemp("listops")
    generate_listops(listops, 96, 16, 16, seed=0)
    return {"debug": listops, "kjv": tmp_path_factory.mktemp("kjv")}  # KJV: unpacked from the repository


RECIPES = {
    # ListOps classifier with dropout 0.1 (the debug recipe's)
    "debug": [
        "recipe=debug", "model.model_dim=16", "model.z_dim=8", "model.value_dim=16", "model.ffn_hidden_dim=16",
        "model.chunk_size=32", "data.max_length=128", "data.batch_size=4",
    ],
    "kjv": [*TINY_KJV_LM, "model.dropout=0.1"],  # a language model
}  # fmt: skip


@pytest.mark.parametrize("recipe", RECIPES)
def test_how_often_one_validates_changes_no_result(recipe, data_dirs, tmp_path):
    """Validation after every step vs only after the last: the same weights (torch.equal) and the same
    validation and test metrics at the last step, exactly."""
    from mega_suite.config import load_config
    from mega_suite.training.runner import run

    records = {}
    for every in (1, STEPS):
        record = records[every] = Record()
        argv = [
            *RECIPES[recipe], f"data.data_dir={data_dirs[recipe]}", f"run_dir={tmp_path / str(every)}",
            f"trainer.max_steps={STEPS}", f"trainer.val_check_interval={every}", "trainer.limit_val_batches=2",
            "trainer.limit_test_batches=2", "trainer.progress_bar=false", "trainer.log_every_n_steps=1",
        ]  # fmt: skip
        run(load_config(argv), extra_callbacks=[record])
    often, once = records[1], records[STEPS]
    assert sorted(often.metrics) == list(range(1, STEPS + 1)) and sorted(once.metrics) == [STEPS]
    assert once.metrics[STEPS] and "val/loss" in once.metrics[STEPS]
    assert often.metrics[STEPS] == once.metrics[STEPS]
    assert often.metrics[1] != once.metrics[STEPS]  # the model changed between the validations
    assert set(often.weights) == set(once.weights)
    differ = [k for k, v in once.weights.items() if not torch.equal(often.weights[k], v)]
    assert not differ, differ
