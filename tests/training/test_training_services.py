"""Library-backed training services: the classifier loss (timm) against float64, throughput (Lightning's
ThroughputMonitor) against a known clock, and the ValWithTest wrapper's forwarding."""

from __future__ import annotations

import types

import lightning as L
import pytest
import torch
from modality_fixtures import write_wikitext

from mega_suite import MegalodonConfig
from mega_suite.training.callbacks import TokenThroughput
from mega_suite.training.module import SequenceClassifier

TINY_MODEL = dict(
    num_layers=1, model_dim=8, z_dim=4, value_dim=8, ffn_hidden_dim=8, norm_num_groups=2, cema_ndim=2,
    chunk_size=8, vocab_size=11, num_classes=5,
)  # fmt: skip
OPTIM = dict(
    lr=1e-3, weight_decay=0.0, betas=[0.9, 0.98], eps=1e-8, schedule="constant", warmup_steps=0,
    min_lr_ratio=0.0, clip_grad_norm=0.0, no_decay_groups=False,
)  # fmt: skip


def _classifier(label_smoothing: float) -> SequenceClassifier:
    cfg = MegalodonConfig(**TINY_MODEL)
    return SequenceClassifier(cfg, OPTIM, {}, total_steps=1, label_smoothing=label_smoothing)


def _oracle(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """mean_b -sum_k y_bk log softmax(z_b)_k in float64."""
    z = logits.double()
    logp = z - torch.logsumexp(z, -1, keepdim=True)
    return -(target.double() * logp).sum(-1).mean()


@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_loss_on_hard_labels_is_smoothed_cross_entropy(eps):
    torch.manual_seed(0)
    logits = torch.randn(7, 5) * 3
    label = torch.randint(0, 5, (7,))
    target = torch.full((7, 5), eps / 5, dtype=torch.float64)
    target[torch.arange(7), label] += 1 - eps
    got = _classifier(eps).loss(logits, label)
    torch.testing.assert_close(got.double(), _oracle(logits, target), rtol=1e-6, atol=1e-7)


def test_loss_on_soft_targets_is_their_cross_entropy_unsmoothed_again():
    torch.manual_seed(1)
    logits = torch.randn(6, 5) * 3
    target = torch.softmax(torch.randn(6, 5), -1)  # as timm's Mixup gives: smoothing already mixed in
    got = _classifier(0.1).loss(logits, target)
    torch.testing.assert_close(got.double(), _oracle(logits, target), rtol=1e-6, atol=1e-7)


class _Inner(L.LightningDataModule):
    num_words = {"val": 12}

    def on_after_batch_transfer(self, batch, dataloader_idx):
        return dict(batch, mixed=True)


def test_val_with_test_forwards_the_trainer_hooks_and_attributes():
    """Lightning attaches the trainer to, and calls batch hooks on, the wrapper only: ImageNet's mixup (in
    on_after_batch_transfer) was never applied and the inner samplers saw rank 0 of 1."""
    from mega_suite.training.runner import ValWithTest

    inner = _Inner()
    wrapped = ValWithTest(inner)
    trainer = types.SimpleNamespace(global_rank=1, world_size=2)
    wrapped.trainer = trainer
    assert inner.trainer is trainer
    assert wrapped.on_after_batch_transfer({"input": 1}, 0) == {"input": 1, "mixed": True}
    assert wrapped.num_words == {"val": 12}
    with pytest.raises(AttributeError):
        _ = wrapped.no_such_attribute


class _Clock:
    """A perf_counter that moves only when told: 2 s per training batch, 1 s per evaluation batch."""

    def __init__(self):
        self.now = 100.0

    def perf_counter(self) -> float:
        return self.now


class _Recorder(L.Callback):
    def __init__(self, clock: _Clock):
        self.clock = clock
        self.tokens: list[int] = []  # per training batch, counted here independently
        self.logged: list[dict] = []

    def setup(self, trainer, pl_module, stage):
        log_metrics = trainer.logger.log_metrics

        def record(metrics, step=None):
            self.logged.append(dict(metrics))
            return log_metrics(metrics, step)

        trainer.logger.log_metrics = record
        (monitor,) = [cb for cb in trainer.callbacks if isinstance(cb, TokenThroughput)]
        self.flops_per_token = monitor.flops_per_token

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.tokens.append(batch["input"].numel())  # LM batches: no padding
        self.clock.now += 2.0

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        self.clock.now += 1.0


def test_throughput_logs_tokens_samples_flops_and_mfu_of_each_step(tmp_path, monkeypatch):
    from lightning.pytorch.callbacks import throughput_monitor

    from mega_suite.config import load_config
    from mega_suite.training.runner import run

    write_wikitext(tmp_path)
    clock = _Clock()
    monkeypatch.setattr(throughput_monitor, "time", clock)  # only ThroughputMonitor's clock
    cfg = load_config(
        ["recipe=wt103", f"run_root={tmp_path / 'runs'}", f"data.data_dir={tmp_path}", "model.num_layers=1",
         "model.model_dim=16", "model.z_dim=8", "model.value_dim=16", "model.ffn_hidden_dim=16",
         "model.norm_num_groups=4", "model.cema_ndim=2", "model.chunk_size=16", "model.adaptive_cutoffs=[5,15]",
         "data.batch_size=2", "data.options.seq_len=32", "data.options.chunk_size=16",
         "data.options.min_chunks=1", "data.options.max_chunks=3", "trainer.global_batch_tokens=0",
         "trainer.max_steps=5", "trainer.val_check_interval=3", "trainer.limit_val_batches=2",
         "trainer.limit_test_batches=2", "trainer.log_every_n_steps=1", "trainer.progress_bar=false",
         "trainer.precision=32-true", "trainer.accelerator=cpu", "trainer.devices=1", "trainer.peak_tflops=1e-6"]
    )  # fmt: skip
    recorder = _Recorder(clock)
    run(cfg, extra_callbacks=[recorder])
    train = [m for m in recorder.logged if "train/batches" in m]
    assert [m["train/batches"] for m in train] == [1, 2, 3, 4, 5]
    assert len(set(recorder.tokens)) > 1, "variable-length batches: the test sees different lengths"
    fpt = recorder.flops_per_token
    assert fpt > 0
    for n, m in enumerate(train[1:], start=1):  # a rate needs two batch ends: from the second on
        tokens = recorder.tokens[n]
        assert m["train/device/items_per_sec"] == pytest.approx(tokens / 2.0, rel=1e-12)
        assert m["train/device/samples_per_sec"] == pytest.approx(2 / 2.0, rel=1e-12)
        assert m["train/device/flops_per_sec"] == pytest.approx(tokens * fpt / 2.0, rel=1e-12)
        assert m["train/device/mfu"] == pytest.approx(tokens * fpt / 2.0 / 1e6, rel=1e-12)
    assert "train/device/items_per_sec" not in train[0]
