"""Checks of a whole configuration against itself, the data module's contract and the mode, run at load so
that a mistake is one clear error before anything is created (docs/configuration.md)."""

from __future__ import annotations

from omegaconf import DictConfig, ListConfig, OmegaConf

from mega_suite.config.after import validate_after
from mega_suite.config.resolve import (
    accumulation,
    data_contract,
    data_module,
    data_num_classes,
    data_option,
    model_config,
    tokens_per_sequence,
)
from mega_suite.config.schema import (
    CHOICES,
    COMPILE_MODES,
    CUDAGRAPH_MODES,
    FLOAT32_MATMUL_PRECISIONS,
    RANGES,
    ConfigError,
)


def validate(cfg: DictConfig, user_classes: int | None = None) -> None:
    for key, choices in CHOICES.items():
        value = OmegaConf.select(cfg, key)
        if value not in choices:
            raise ConfigError(f"{key}={value!r} is invalid; expected one of {', '.join(map(str, choices))}")
    check_ranges(cfg)
    _validate_data(cfg, user_classes)
    _validate_mode(cfg)
    validate_after(cfg)  # generate / lm_eval / passkey and periodic checkpoints
    _validate_trainer(cfg)
    try:
        model_config(cfg)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def check_ranges(cfg: DictConfig) -> None:
    """Every key of ``RANGES`` (schema.py) within its declared domain: one error naming the key, the value and
    what was expected."""
    for key, domain in RANGES.items():
        value = OmegaConf.select(cfg, key)
        if isinstance(value, (DictConfig, ListConfig)):
            value = OmegaConf.to_container(value, resolve=True)
        problem = domain.problem(value)
        if problem is not None:
            raise ConfigError(f"{key}={value!r} is out of range; expected {problem}")


def _validate_data(cfg: DictConfig, user_classes: int | None) -> None:
    """data.* against the data module; task, model.num_classes / input_type / dual_input against its contract."""
    name, task, m = cfg.data.name, cfg.task, cfg.model
    cls, _ = data_module(cfg)
    contract = data_contract(cls)
    if contract.task != task:
        raise ConfigError(
            f"task={task} does not fit data.name={name!r}, a task={contract.task} data module; set "
            f"task={contract.task} or a {task} data module"
        )
    if task == "lm":
        if m.num_classes:
            raise ConfigError(
                f"model.num_classes={m.num_classes} makes a classifier, but task=lm builds a language model "
                f"(model.preset={m.preset}); set model.num_classes=0 or use a language-model preset"
            )
    else:
        classes = data_num_classes(cfg)
        if user_classes is not None and user_classes != classes:
            raise ConfigError(
                f"model.num_classes={user_classes} but data.name={name!r} has {classes} classes; leave "
                "model.num_classes out (it follows the data)"
            )
        m.num_classes = classes
    if m.input_type != contract.input_type:
        raise ConfigError(
            f"model.input_type={m.input_type!r} but data.name={name!r} gives {contract.input_type!r} inputs; "
            f"set model.input_type={contract.input_type} (or a preset made for this data)"
        )
    if bool(m.dual_input) != contract.dual_input:
        raise ConfigError(
            f"model.dual_input={bool(m.dual_input)} but data.name={name!r} "
            + ("gives document pairs" if contract.dual_input else "gives single sequences")
            + f"; set model.dual_input={str(contract.dual_input).lower()}"
        )


def _validate_mode(cfg: DictConfig) -> None:
    """Keys that only one mode reads are rejected in the others."""
    mode = cfg.mode
    if cfg.init_from and mode != "fit":
        raise ConfigError(f"init_from applies to mode=fit; for mode={mode} pass the checkpoint as ckpt=PATH")
    if cfg.ckpt and mode == "fit":
        raise ConfigError(
            f"ckpt={cfg.ckpt} is read by mode=validate/test/eval_context, not mode=fit: continue a run with "
            "resume=PATH, or start one from those weights with init_from=PATH"
        )
    if mode in ("validate", "test") and not (cfg.ckpt or cfg.resume):
        raise ConfigError(f"mode={mode} needs ckpt=PATH (or resume=auto / a run directory)")
    if mode == "eval_context" and cfg.task != "lm":
        raise ConfigError(f"mode=eval_context needs task=lm (a language model), got task={cfg.task}")
    if mode != "eval_context":
        for key in ("eval_context_lengths", "eval_max_documents"):
            if cfg[key]:
                raise ConfigError(f"{key}={cfg[key]} is read by mode=eval_context only (mode={mode})")


def check_cudagraph_mode(cfg: DictConfig) -> None:
    """A CUDA-graph compile mode keeps each compiled block's outputs (activations, and the parameters'
    gradients from the compiled backward) in graph memory that the next step overwrites. Refused where that
    breaks or is unverified: gradient accumulation (the next micro-batch adds into overwritten gradients:
    torch stops with an error), FSDP2 (parameters re-gathered at new addresses every step: the graphs
    re-record), activation checkpointing (compiled forwards replayed inside backward, untested), and
    evaluation-only modes (no training step marks where one graph generation ends)."""
    t = cfg.trainer
    if not t.compile or t.compile_mode not in CUDAGRAPH_MODES:
        return
    name = f"trainer.compile_mode={t.compile_mode!r} (CUDA graphs)"
    way_out = "use trainer.compile_mode=default or max-autotune-no-cudagraphs"
    accumulate = accumulation(cfg)
    if accumulate > 1:
        raise ConfigError(
            f"{name} cannot accumulate gradients (trainer.accumulate_grad_batches={accumulate}, "
            f"set directly or by trainer.global_batch_tokens): the next micro-batch would add into graph "
            f"memory already overwritten; {way_out}"
        )
    if t.strategy in ("fsdp", "hsdp"):
        raise ConfigError(
            f"{name} needs fixed parameter addresses; trainer.strategy={t.strategy!r} (FSDP2) re-gathers them "
            f"every step; {way_out}"
        )
    if t.gradient_checkpointing:
        raise ConfigError(f"{name} with trainer.gradient_checkpointing=true is untested; {way_out}")
    if cfg.mode != "fit":
        raise ConfigError(f"{name} is for training (mode=fit); mode={cfg.mode!r}: {way_out}")


def _validate_trainer(cfg: DictConfig) -> None:
    t = cfg.trainer
    if t.chunk_parallel != 1:
        _validate_chunk_parallel(cfg)
    if t.float32_matmul_precision not in FLOAT32_MATMUL_PRECISIONS:
        raise ConfigError(
            f"trainer.float32_matmul_precision={t.float32_matmul_precision!r}; expected one of "
            f"{', '.join(FLOAT32_MATMUL_PRECISIONS)} (high: TF32 matmuls on CUDA)"
        )
    if t.compile_mode not in COMPILE_MODES:
        raise ConfigError(
            f"trainer.compile_mode={t.compile_mode!r}; expected one of {', '.join(COMPILE_MODES)}"
        )
    if t.compile_mode != "default" and not t.compile:
        raise ConfigError(f"trainer.compile_mode={t.compile_mode!r} applies with trainer.compile=true")
    if t.compile_mode != "default" and t.compile_backend != "inductor":
        raise ConfigError(
            f"trainer.compile_mode={t.compile_mode!r} is an Inductor mode; trainer.compile_backend is "
            f"{t.compile_backend!r}"
        )
    if t.compile:
        import torch._dynamo  # the backends torch.compile accepts here, debug ones included (aot_eager)

        backends = torch._dynamo.list_backends(exclude_tags=())
        if t.compile_backend not in backends:
            raise ConfigError(
                f"trainer.compile_backend={t.compile_backend!r} is not a torch.compile backend here; "
                f"expected one of {', '.join(sorted(backends))}"
            )
    for key in ("global_batch_tokens", "peak_tflops"):
        if t[key] and cfg.task != "lm":
            raise ConfigError(
                f"trainer.{key}={t[key]} applies to task=lm (tokens and FLOPs per token are counted for the "
                f"language model); task={cfg.task} batches are set in samples by data.batch_size"
            )
    if t.global_batch_tokens:
        if t.accumulate_grad_batches != 1:
            raise ConfigError(
                f"trainer.accumulate_grad_batches={t.accumulate_grad_batches} and trainer.global_batch_tokens="
                f"{t.global_batch_tokens} both set the accumulation: set one of them"
            )
        tokens_per_sequence(cfg)
    check_cudagraph_mode(cfg)  # after the global batch's own checks: it reads the accumulation


def _validate_chunk_parallel(cfg: DictConfig) -> None:
    t, p = cfg.trainer, cfg.trainer.chunk_parallel
    where = f"trainer.chunk_parallel={p}"
    if p < 1:
        raise ConfigError(f"{where} must be >= 1")
    if cfg.task != "lm" or cfg.model.arch != "megalodon":
        raise ConfigError(
            f"{where} splits a Megalodon language model's sequences: needs task=lm, model.arch=megalodon"
        )
    if t.strategy != "fsdp":
        raise ConfigError(f"{where} runs on the FSDP2 mesh: set trainer.strategy=fsdp (got {t.strategy!r})")
    if not isinstance(t.devices, int) or (t.devices * t.num_nodes) % p:
        raise ConfigError(
            f"{where} must divide the number of ranks, trainer.devices x trainer.num_nodes "
            f"({t.devices!r} x {t.num_nodes}); give trainer.devices as a number"
        )
    seq_len, chunk = data_option(cfg, "seq_len"), cfg.model.chunk_size
    if not seq_len or seq_len % (p * chunk):
        raise ConfigError(
            f"{where}: data.options.seq_len={seq_len} must be a multiple of chunk_parallel x model.chunk_size "
            f"= {p} x {chunk} so that every rank gets the same chunk-aligned slice"
        )
