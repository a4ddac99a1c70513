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
        if e.num_fewshot is not None and e.num_fewshot < 0:
            raise ConfigError(f"lm_eval.num_fewshot={e.num_fewshot} must be >= 0")
        if e.limit is not None and e.limit <= 0:
            raise ConfigError(f"lm_eval.limit={e.limit} must be > 0 (a count, or a fraction below 1)")
        if e.max_gen_toks < 1:
            raise ConfigError(f"lm_eval.max_gen_toks={e.max_gen_toks} must be >= 1")
        if cfg.ckpt and e.checkpoints:
            raise ConfigError("give ckpt=PATH or lm_eval.checkpoints=[...], not both")
    else:
        p = cfg.passkey
        if p.samples < 1:
            raise ConfigError(f"passkey.samples={p.samples} must be >= 1")
        if any(n < 64 for n in p.lengths):
            raise ConfigError(f"passkey.lengths={list(p.lengths)}: every length must be >= 64 tokens")


def _validate_generate(cfg: DictConfig) -> None:
    if bool(cfg.prompt) == bool(cfg.prompt_file):
        raise ConfigError('mode=generate needs prompt="TEXT" or prompt_file=PATH (one of them)')
    if cfg.max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens={cfg.max_new_tokens} must be >= 1")
    if cfg.temperature < 0:
        raise ConfigError(f"temperature={cfg.temperature} must be >= 0 (0: greedy)")
    if cfg.top_k is not None and cfg.top_k < 1:
        raise ConfigError(f"top_k={cfg.top_k} must be >= 1")
    if cfg.top_p is not None and not 0.0 < cfg.top_p <= 1.0:
        raise ConfigError(f"top_p={cfg.top_p} must be in (0, 1]")


def _validate_checkpoints(t: DictConfig) -> None:
    if t.save_every_n_steps < 0:
        raise ConfigError(f"trainer.save_every_n_steps={t.save_every_n_steps} must be >= 0 (0: off)")
    if t.keep_checkpoints < 0:
        raise ConfigError(f"trainer.keep_checkpoints={t.keep_checkpoints} must be >= 0 (0: keep all)")
    if t.keep_checkpoints and not t.save_every_n_steps:
        raise ConfigError(
            f"trainer.keep_checkpoints={t.keep_checkpoints} counts the checkpoints of trainer.save_every_n_steps, "
            "which is 0 (off)"
        )
