"""Training-loop services: throughput (Lightning's ThroughputMonitor), reproducible per-step randomness, graceful
stop, progress lines. Atomic checkpoint writes live in ``checkpoint.py``."""

from __future__ import annotations

import copy
import os
import signal
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ThroughputMonitor, TQDMProgressBar

from mega_suite.training.saving import save_last


class StepSeed(L.Callback):
    """Seed the global RNG from (seed, step, batch, rank) before every training batch.

    Dropout masks then depend only on the position in training, so a resumed run draws exactly the
    randomness an uninterrupted one would have, whatever validation or data loading consumed in between.
    """

    def __init__(self, seed: int):
        self.seed = seed

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        step = (
            trainer.fit_loop.epoch_loop.total_batch_idx
            if hasattr(trainer.fit_loop, "epoch_loop")
            else batch_idx
        )
        torch.manual_seed((self.seed * 1_000_003 + step * 7919 + trainer.global_rank) % (2**63 - 1))


class TokenThroughput(ThroughputMonitor):
    """Lightning's ``ThroughputMonitor`` counting valid tokens, with the model's FLOPs per token and a given peak.

    Logged every ``every`` optimizer steps, per device, as rates over those steps (wall time between batch
    ends: data loading, forward, backward and optimizer step; validation time is excluded):

    - ``train/device/items_per_sec``: valid (non-padding) input tokens / s (images / s for image batches);
    - ``train/device/samples_per_sec``: sequences / s;
    - with ``flops_per_token`` > 0: ``train/device/flops_per_sec`` = tokens / s x flops_per_token, and with
      ``peak_tflops`` > 0 ``train/device/mfu`` = flops_per_sec / (peak_tflops x 1e12).

    Lightning also logs the running totals ``train/time``, ``train/batches``, ``train/samples``,
    ``train/lengths`` and the same rates under ``validate/`` during validation.
    """

    def __init__(self, every: int = 10, flops_per_token: float = 0.0, peak_tflops: float = 0.0):
        super().__init__(batch_size_fn=_batch_samples, length_fn=_batch_tokens)
        self.every = max(1, every)
        self.flops_per_token, self.peak_tflops = flops_per_token, peak_tflops

    def setup(self, trainer, pl_module, stage: str) -> None:
        # A window of every x accumulation + 1 batch ends spans exactly the last `every` optimizer steps.
        self.kwargs["window_size"] = self.every * max(1, trainer.accumulate_grad_batches) + 1
        super().setup(trainer, pl_module, stage)
        # Lightning looks the peak up from a table of known GPUs; the recipe's trainer.peak_tflops is used instead.
        peak = self.peak_tflops * 1e12 if self.peak_tflops else None
        self.available_flops = peak
        for throughput in self._throughputs.values():
            throughput.available_flops = peak

    # ThroughputMonitor reads `flops_per_batch` from the module at each update; batches vary in length, so it
    # is set per batch. flops_per_token counts forward + backward: evaluation batches get none.
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        flops = self.flops_per_token * _batch_tokens(batch) if self.flops_per_token else None
        pl_module.flops_per_batch = flops

    def on_validation_batch_start(
        self, trainer, pl_module, batch, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        pl_module.flops_per_batch = None

    on_test_batch_start = on_validation_batch_start


def _batch_tokens(batch: dict) -> int:
    return batch_size_in_tokens(batch)[0]


def _batch_samples(batch: dict) -> int:
    return batch_size_in_tokens(batch)[1]


def batch_size_in_tokens(batch: dict) -> tuple[int, int]:
    """(valid tokens, samples) of a batch dict."""
    tokens = 0
    samples = 0
    for key in ("input", "input1", "input2"):
        if key not in batch:
            continue
        x = batch[key]
        mask = batch.get(key.replace("input", "padding_mask"))
        samples = x.shape[0]
        if mask is not None:
            tokens += int((~mask).sum())
        else:
            tokens += x.shape[0] * (x.shape[1] if x.dim() == 2 else 1)
    return tokens, samples


class StopRequested(Exception):
    """A stop request ended the fit during validation, after saving at the last completed step."""


class GracefulStop(L.Callback):
    """First SIGTERM / Ctrl-C (on any rank): every rank saves ``last.ckpt`` together at the last completed
    optimizer step and the fit ends -- no further step, validation or other work. A second signal aborts.

    Where the request is seen:

    - during a training step: at its end (after the optimizer step), which is saved;
    - during validation: at the next validation batch; validation is abandoned and the checkpoint written is
      the state after the last training step (its loop state as it was then, so that a resume continues
      exactly; the abandoned validation is not repeated), then ``StopRequested`` ends the fit;
    - during a checkpoint write: right after it (``after_save``, called by ``SuiteCheckpoint``), which stops
      the run at that checkpoint's step.

    The ranks agree through an all-reduce (max) of the stop flag at each of these points, so a signal that
    reaches one rank or all of them stops them at the same step; under gradient accumulation the check runs
    only when a window has ended (``global_step`` advanced), so no window's gradients are lost.
    """

    def __init__(self, last_path: Path):
        self.last_path = Path(last_path)
        self.requested: str | None = None
        self.stopping = False
        self._previous: dict[int, Any] = {}
        self._checked_step = -1
        self._loops: dict | None = None  # the loop state at the end of the last optimizer step
        self._use_loops = False  # the checkpoint being written is a stop during validation

    def _handler(self, signum, frame) -> None:
        if self.requested is not None:
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            signal.signal(signum, signal.SIG_DFL)  # abort now: the default action of a second SIGTERM
            os.kill(os.getpid(), signum)
            return
        self.requested = signal.Signals(signum).name
        print(
            f"\n[mega-suite] {self.requested} received: saving a checkpoint at the last completed step, then "
            "stopping (a second signal aborts).",
            flush=True,
        )

    def _agree(self, trainer, pl_module) -> bool:
        """Whether any rank was asked to stop (a collective: every rank calls it at the same point)."""
        stop = torch.tensor(float(self.requested is not None), device=pl_module.device)
        if trainer.world_size > 1:
            stop = trainer.strategy.reduce(stop, reduce_op="max")
        if stop.item() > 0:
            self.requested = self.requested or "stop on another rank"
            return True
        return False

    def on_train_start(self, trainer, pl_module) -> None:
        # Installed here, after Lightning registers its own SIGTERM handler (between on_fit_start and the fit
        # loop), so ours replaces it: Lightning's would end the loop at the next epoch boundary without a save.
        # Every rank listens (a scheduler signals them all, or only one).
        self._checked_step = trainer.global_step
        try:
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handler)
        except ValueError:  # not the main thread: leave signals alone
            self._previous.clear()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if trainer.global_step == self._checked_step:  # inside an accumulation window: no optimizer step yet
            return
        self._checked_step = trainer.global_step
        self._loops = copy.deepcopy(trainer._checkpoint_connector._get_loops_state_dict())
        if self._agree(trainer, pl_module):
            self._stop(trainer, pl_module, save=True)

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx: int, dataloader_idx: int = 0):
        if trainer.sanity_checking or trainer.state.fn != "fit" or self.stopping or self._loops is None:
            return
        if not self._agree(trainer, pl_module):
            return
        self._use_loops = True
        try:
            self._stop(trainer, pl_module, save=True)
        finally:
            self._use_loops = False
        raise StopRequested(f"stopped during validation at step {trainer.global_step}")

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        if self._use_loops and self._loops is not None:  # mid-validation: the state after the last step
            checkpoint["loops"] = copy.deepcopy(self._loops)

    def after_save(self, trainer, pl_module) -> None:
        """Called after every checkpoint write (``SuiteCheckpoint``): a request that arrived during the write
        stops the run at that checkpoint's step."""
        if not self.stopping and trainer.state.fn == "fit" and self._agree(trainer, pl_module):
            print(
                f"[mega-suite] stop requested during a checkpoint write: stopping at step {trainer.global_step}"
            )
            self._stop(trainer, pl_module, save=False)

    def _stop(self, trainer, pl_module, save: bool) -> None:
        self.stopping = True
        if save:
            save_last(trainer, self.last_path)
            print(
                f"[mega-suite] saved {self.last_path} at step {trainer.global_step}; resume with resume=auto"
            )
        trainer.should_stop = True
        # Lightning validates when should_stop is set (meant for early stopping): not after a stop request.
        trainer.fit_loop.epoch_loop._should_check_val_fx = lambda *args, **kwargs: False

    def _restore_signals(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def on_fit_end(self, trainer, pl_module) -> None:
        self._restore_signals()

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        self._restore_signals()


def _duration(seconds: float) -> str:
    seconds = int(max(0.0, seconds))
    h, rest = divmod(seconds, 3600)
    return f"{h}h{rest // 60:02d}m" if h else f"{rest // 60}m{rest % 60:02d}s"


def _metric_text(metrics: dict[str, Any], prefixes: tuple[str, ...]) -> str:
    parts = []
    for key in sorted(metrics):
        if key.startswith(prefixes) and not key.endswith("_epoch"):
            value = float(metrics[key])
            parts.append(f"{key.removesuffix('_step')} {value:.4g}")
    return "  ".join(parts)


class LogLines(L.Callback):
    """Plain progress lines for logs and non-interactive runs (``trainer.progress_bar=false``).

    Every ``every`` optimizer steps: step, the mean training loss over those steps, the last step's
    logged metrics, learning rate, seconds per step and the ETA to ``max_steps``; after every validation:
    all validation and test metrics with the step.
    """

    def __init__(self, every: int = 50, print_fn=print):
        self.every = max(1, every)
        self.print = print_fn
        self._t0: float | None = None
        self._step0 = 0
        self._losses: list[float] = []
        self._last_printed = -1

    def on_train_start(self, trainer, pl_module) -> None:
        self._t0, self._step0 = time.monotonic(), trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        # the logged loss (the global batch's mean under every strategy), not the one back-propagated (rank 0's
        # share: under chunk parallelism P times its slice's)
        loss = trainer.callback_metrics.get("train/loss")
        if loss is None:
            loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if isinstance(loss, torch.Tensor):
            self._losses.append(float(loss.detach()))
        step = trainer.global_step
        if not trainer.is_global_zero or step == 0 or step % self.every or self._t0 is None:
            return
        if self._last_printed == step:  # gradient accumulation: one line per step
            return
        self._last_printed = step
        mean_loss = f"loss(mean) {sum(self._losses) / len(self._losses):.4g}  " if self._losses else ""
        self._losses.clear()
        per_step = (time.monotonic() - self._t0) / max(1, step - self._step0)
        total = trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else None
        where = f"step {step}/{total}" if total else f"step {step}"
        eta = f"  ETA {_duration(per_step * (total - step))}" if total else ""
        lr = trainer.optimizers[0].param_groups[0]["lr"] if trainer.optimizers else float("nan")
        metrics = _metric_text(trainer.callback_metrics, ("train/loss", "train/acc", "train/ppl"))
        self.print(
            f"[train] {where}  {mean_loss}{metrics}  lr {lr:.3g}  {per_step:.2f} s/step{eta}", flush=True
        )

    def on_validation_end(self, trainer, pl_module) -> None:
        if not trainer.is_global_zero or trainer.sanity_checking:
            return
        metrics = _metric_text(trainer.callback_metrics, ("val/", "test/"))
        self.print(f"[eval] step {trainer.global_step}  {metrics}", flush=True)


class StepProgressBar(TQDMProgressBar):
    """The training bar counts optimizer steps towards ``max_steps`` (so its ETA is the run's)."""

    def on_train_epoch_start(self, trainer, *_: Any) -> None:
        if self.train_progress_bar is None or getattr(self, "_step_bar_started", False):
            return
        self._step_bar_started = True
        total = trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else None
        self.train_progress_bar.reset(total=total)
        self.train_progress_bar.n = trainer.global_step
        self.train_progress_bar.initial = 0
        self.train_progress_bar.set_description("train")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        bar = self.train_progress_bar
        if bar is None:
            return
        bar.n = trainer.global_step
        bar.set_postfix(self.get_metrics(trainer, pl_module), refresh=False)
        bar.refresh()

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        pass
