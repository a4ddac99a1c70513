"""What the modes that use a trained model (generate, lm_eval, passkey) need, and the periodic checkpoints'
keys, checked at load with the rest of ``config.checks`` (docs/after_training.md). Keys a mode does not read
are refused by ``checks.check_mode_keys`` (``schema.MODE_KEYS``)."""

from __future__ import annotations

from omegaconf import DictConfig

from mega_suite.config.schema import ConfigError

AFTER_MODES = ("generate", "lm_eval", "passkey")


def validate_after(cfg: DictConfig) -> None:
    mode = cfg.mode
    _validate_checkpoints(cfg.trainer)
    if mode in ("validate", "test") and not (cfg.ckpt or cfg.resume):
        raise ConfigError(f"mode={mode} needs ckpt=PATH (or resume=auto / a run folder)")
    if mode == "eval_context" and cfg.task != "lm":
        raise ConfigError(f"mode=eval_context needs task=lm (a language model), got task={cfg.task}")
    if mode not in AFTER_MODES:
        return
    if cfg.task != "lm":
        raise ConfigError(f"mode={mode} needs a language model (task=lm), got task={cfg.task}")
    if not cfg.ckpt and not (mode == "lm_eval" and cfg.lm_eval.checkpoints):
        raise ConfigError(
            f"mode={mode} needs ckpt=PATH: a checkpoint, a run folder (its newest checkpoint) or an "
            "exported bundle" + (" (or lm_eval.checkpoints=[...])" if mode == "lm_eval" else "")
        )
    if mode == "generate" and bool(cfg.prompt) == bool(cfg.prompt_file):
        raise ConfigError('mode=generate needs prompt="TEXT" or prompt_file=PATH (one of them)')
    if mode == "lm_eval":
        e = cfg.lm_eval
        if not e.tasks:
            raise ConfigError(
                "mode=lm_eval needs lm_eval.tasks=[name, ...] (harness tasks, or local ones in lm_eval.include_path)"
            )
        if cfg.ckpt and e.checkpoints:
            raise ConfigError("give ckpt=PATH or lm_eval.checkpoints=[...], not both")


def _validate_checkpoints(t: DictConfig) -> None:
    if t.keep_checkpoints and not t.save_every_n_steps:
        raise ConfigError(
            f"trainer.keep_checkpoints={t.keep_checkpoints} counts the checkpoints of trainer.save_every_n_steps, "
            "which is 0 (off)"
        )
