"""Checks of a whole configuration against itself, the data module's contract, the architecture and the mode,
run at load so that a mistake is one clear error before anything is created (docs/configuration.md).

Nothing here imports torch or reads a file: the files a run names are checked by the run plan
(``mega_suite.config.run_plan``), after these.
"""

from __future__ import annotations

from omegaconf import DictConfig, ListConfig, OmegaConf

from mega_suite.config.after import validate_after
from mega_suite.config.resolve import (
    accumulation,
    data_arguments,
    data_contract,
    data_num_classes,
    data_option,
    megalodon_config,
    tokens_per_sequence,
)
from mega_suite.config.schema import (
    CHOICES,
    COMPILE_MODES,
    CUDAGRAPH_MODES,
    FLOAT32_MATMUL_PRECISIONS,
    MODE_KEYS,
    RANGES,
    ConfigError,
    RunConfig,
)
from mega_suite.models import ARCHS

# What to do instead, when a key is set in a mode that does not read it.
_INSTEAD = {
    ("ckpt", "fit"): "continue a run with resume=PATH, or start one from those weights with init_from=PATH",
    ("init_from", None): "pass the checkpoint as ckpt=PATH",
}


def validate(cfg: DictConfig, user_classes: int | None = None) -> None:
    for key, choices in CHOICES.items():
        value = OmegaConf.select(cfg, key)
        if value not in choices:
            raise ConfigError(f"{key}={value!r} is invalid; expected one of {', '.join(map(str, choices))}")
    check_ranges(cfg)
    _validate_data(cfg, user_classes)
    check_mode_keys(cfg)
    validate_after(cfg)  # what generate / lm_eval / passkey need, and periodic checkpoints
    _validate_trainer(cfg)
    _validate_model(cfg)


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


def _plain(value):
    return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value


def check_mode_keys(cfg: DictConfig) -> None:
    """A key only some modes read (``MODE_KEYS``), set to anything but its default in another mode, is
    refused: it would do nothing there."""
    mode, defaults = cfg.mode, OmegaConf.structured(RunConfig)
    for key, modes in MODE_KEYS.items():
        if mode in modes:
            continue
        ours, theirs = _plain(OmegaConf.select(cfg, key)), _plain(OmegaConf.select(defaults, key))
        if ours == theirs:
            continue
        if isinstance(ours, dict):  # a section: name the first key that is set
            key, ours = next((f"{key}.{k}", v) for k, v in ours.items() if v != theirs.get(k))
        instead = _INSTEAD.get((key, mode)) or _INSTEAD.get((key, None))
        raise ConfigError(
            f"{key}={ours} is read by mode={'/'.join(modes)} only (mode={mode})"
            + (f": {instead}" if instead else "")
        )


def _validate_data(cfg: DictConfig, user_classes: int | None) -> None:
    """data.* and data.options against the data module's contract; task, model.num_classes / input_type /
    dual_input against it."""
    name, task, m = cfg.data.name, cfg.task, cfg.model
    contract = data_contract(cfg)
    data_arguments(cfg)  # every data option declared, of its type and in its range
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
        m.num_classes = classes  # the preset's placeholder replaced at load, before the config is read-only
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


def _validate_model(cfg: DictConfig) -> None:
    """The model section makes a valid Megalodon, and the architecture ``model.arch`` names can be built from
    it for this task (its spec's cheap checks; a Llama's size is matched in the run plan)."""
    arch = cfg.model.arch
    if arch not in ARCHS:
        raise ConfigError(
            f"model.arch={arch!r} is not a registered architecture; expected one of {sorted(ARCHS)}"
        )
    megalodon = megalodon_config(cfg)
    spec = ARCHS[arch]
    seq_len = data_option(cfg, "seq_len") if cfg.task == "lm" else None
    try:
        spec.check_recipe(megalodon, int(seq_len) if seq_len else None)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if cfg.trainer.chunk_parallel != 1:
        _validate_chunk_parallel(cfg)


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


def check_compile_backend(cfg: DictConfig) -> None:
    """``trainer.compile_backend`` is one torch.compile knows here (imports torch: the run plan calls it)."""
    t = cfg.trainer
    if not t.compile:
        return
    import torch._dynamo  # the backends torch.compile accepts here, debug ones included (aot_eager)

    backends = torch._dynamo.list_backends(exclude_tags=())
    if t.compile_backend not in backends:
        raise ConfigError(
            f"trainer.compile_backend={t.compile_backend!r} is not a torch.compile backend here; "
            f"expected one of {', '.join(sorted(backends))}"
        )


def _validate_chunk_parallel(cfg: DictConfig) -> None:
    t, p = cfg.trainer, cfg.trainer.chunk_parallel
    where = f"trainer.chunk_parallel={p}"
    if cfg.task != "lm" or not ARCHS[cfg.model.arch].chunk_parallel:
        supported = [name for name, spec in ARCHS.items() if spec.chunk_parallel]
        raise ConfigError(
            f"{where} splits a language model's sequences across ranks: needs task=lm and model.arch in "
            f"{supported} (got task={cfg.task}, model.arch={cfg.model.arch})"
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
