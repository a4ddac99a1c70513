"""Checks of the keys of the modes that use a trained model (generate, lm_eval, passkey) and of periodic
checkpoints, run at load with the rest of ``config.checks`` (docs/after_training.md)."""

from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

from mega_suite.config.schema import ConfigError, LmEvalSection, PasskeySection, RunConfig

AFTER_MODES = ("generate", "lm_eval", "passkey")
GENERATE_KEYS = ("prompt", "prompt_file", "max_new_tokens", "temperature", "top_k", "top_p", "compile")


def _defaults() -> dict[str, tuple[str, object]]:
    """key -> (the mode that reads it, its default)."""
    out: dict[str, tuple[str, object]] = {k: ("generate", getattr(RunConfig, k)) for k in GENERATE_KEYS}
    for section, owner in ((LmEvalSection(), "lm_eval"), (PasskeySection(), "passkey")):
        out.update({f"{owner}.{k}": (owner, v) for k, v in vars(section).items()})
    return out


def validate_after(cfg: DictConfig) -> None:
    mode = cfg.mode
    for key, (owner, default) in _defaults().items():  # keys one mode reads are refused in the others
        value = OmegaConf.select(cfg, key)
        if OmegaConf.is_config(value):
            value = OmegaConf.to_container(value, resolve=True)
        if mode != owner and value != default:
            raise ConfigError(f"{key}={value} is read by mode={owner} only (mode={mode})")
    if cfg.tokenizer and mode not in AFTER_MODES:
        raise ConfigError(
            f"tokenizer={cfg.tokenizer} is read by mode={'/'.join(AFTER_MODES)} only (mode={mode})"
        )
    _validate_checkpoints(cfg.trainer)
    if mode not in AFTER_MODES:
        return
    if cfg.task != "lm":
        raise ConfigError(f"mode={mode} needs a language model (task=lm), got task={cfg.task}")
    if not cfg.ckpt and not (mode == "lm_eval" and cfg.lm_eval.checkpoints):
        raise ConfigError(
            f"mode={mode} needs ckpt=PATH: a checkpoint, a run directory (its checkpoints/last.ckpt) or an "
            "exported bundle" + (" (or lm_eval.checkpoints=[...])" if mode == "lm_eval" else "")
        )
    if mode == "generate":
        _validate_generate(cfg)
    elif mode == "lm_eval":
        e = cfg.lm_eval
        if not e.tasks:
            raise ConfigError(
                "mode=lm_eval needs lm_eval.tasks=[name, ...] (harness tasks, or local ones in lm_eval.include_path)"
            )
        if cfg.ckpt and e.checkpoints:
            raise ConfigError("give ckpt=PATH or lm_eval.checkpoints=[...], not both")


def _validate_generate(cfg: DictConfig) -> None:
    if bool(cfg.prompt) == bool(cfg.prompt_file):
        raise ConfigError('mode=generate needs prompt="TEXT" or prompt_file=PATH (one of them)')


def _validate_checkpoints(t: DictConfig) -> None:
    if t.keep_checkpoints and not t.save_every_n_steps:
        raise ConfigError(
            f"trainer.keep_checkpoints={t.keep_checkpoints} counts the checkpoints of trainer.save_every_n_steps, "
            "which is 0 (off)"
        )
