"""Experiment configuration: typed omegaconf structured configs, recipes with inheritance, dotted overrides.

Resolution order (later wins): dataclass defaults < the model preset named by ``model.preset`` < the
recipe chain (``inherit:`` parents first) < command-line ``key=value`` overrides. A misspelt key or a
value of the wrong type fails at once, naming the key, the value and the nearest valid keys.
"""

from __future__ import annotations

import difflib
import inspect
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from mega_suite.models.megalodon.config import MegalodonConfig
from mega_suite.models.megalodon.presets import PRESETS

RECIPES_DIR = Path(__file__).resolve().parent.parent / "recipes"


@dataclass
class ModelSection(MegalodonConfig):
    preset: str = "megalodon_debug"  # registry name (mega_suite.models); its values are the defaults here
    # megalodon | llama. With llama (language models only) the run trains the Llama-2 decoder matched in
    # parameter count to the Megalodon this section describes (mega_suite.models.llama.matched_config),
    # its context window the data's seq_len: the paper's controlled comparison on the same recipe.
    arch: str = "megalodon"

    def __post_init__(self) -> None:  # validated when the model is built, after all overrides
        pass


@dataclass
class DataSection:
    name: str = "listops"  # datamodule registry name (datamodules.DATAMODULES)
    data_dir: str = "data"  # root of the published on-disk layout
    batch_size: int = 64  # per device
    num_workers: int = 0  # DataLoader workers
    max_length: int | None = None  # truncation length (tokens, pixels); None: the data module's default
    pad_to_multiple: int = 1  # collation pads the batch length to a multiple of this
    options: dict[str, Any] = field(default_factory=dict)  # other keyword arguments of the data module


@dataclass
class OptimSection:
    lr: float = 1e-3  # peak learning rate
    weight_decay: float = 0.01  # AdamW decoupled weight decay
    betas: list[float] = field(default_factory=lambda: [0.9, 0.98])  # AdamW betas
    eps: float = 1e-8  # AdamW epsilon
    schedule: str = "linear"  # linear | cosine | constant (after warmup)
    warmup_steps: int = 0  # linear warmup from 0
    min_lr_ratio: float = 0.0  # final lr as a fraction of the peak
    clip_grad_norm: float = 1.0  # 0 disables clipping
    no_decay_groups: bool = False  # exempt norms, biases, CEMA parameters and embeddings from decay
    # AdamW's kernels (ADAMW_KERNELS): fused (one kernel updates every parameter; torchtitan's default) |
    # foreach (a few multi-tensor ops; torch's default on CUDA) | for-loop (a dozen ops per parameter; CPU's)
    implementation: str = "fused"


# optim.implementation -> AdamW's flags (both given, so that they also overwrite a restored param group's)
ADAMW_KERNELS = {
    "fused": dict(fused=True, foreach=None),
    "foreach": dict(fused=None, foreach=True),
    "for-loop": dict(fused=None, foreach=False),
}


@dataclass
class TrainerSection:
    max_steps: int = 1000  # optimizer steps
    max_epochs: int = -1  # -1: bounded by max_steps only
    accelerator: str = "auto"  # auto | cpu | gpu
    devices: Any = "auto"  # number of devices or "auto"
    num_nodes: int = 1
    strategy: str = (
        "auto"  # auto | ddp | fsdp (shard over all ranks) | hsdp (shard in a node, replicate across)
    )
    precision: str = "32-true"  # 32-true | bf16-mixed | 64-true
    accumulate_grad_batches: int = 1
    global_batch_tokens: int = 0  # task=lm, > 0: sets accumulate_grad_batches (runner.apply_global_batch)
    peak_tflops: float = 0.0  # task=lm: per-device peak for MFU (e.g. 989: H100 bf16 dense); 0: no MFU
    val_check_interval: int = 500  # validate (and test) every N training batches
    limit_val_batches: float = 1.0  # fraction (<= 1.0) or number of batches
    limit_test_batches: float = 1.0
    log_every_n_steps: int = 10
    gradient_checkpointing: bool = False  # recompute block activations in backward
    # P > 1: the ranks form a (data-parallel x chunk-parallel) mesh; the P ranks of a group each train on a
    # contiguous, chunk-aligned slice of the same sequences (SPEC §8, mega_suite.chunk_parallel); needs
    # trainer.strategy=fsdp, task=lm, a Megalodon model and data.options.seq_len a multiple of P x C.
    chunk_parallel: int = 1
    chunk_parallel_mode: str = "parallel"  # parallel (prefix of all-gathered states) | sequential (hand-off)
    # torch.compile each block in place (SuiteModule.compile_units). The block specialises on the batch
    # length, so each new length compiles again (Dynamo then runs eagerly past its recompile limit, 8 by
    # default): use it with fixed-length batches (the language models'), not length-bucketed ones.
    compile: bool = False
    compile_backend: str = "inductor"  # inductor | aot_eager (capture only, no code generation) | ...
    # torch.compile's mode (Inductor only): default | reduce-overhead (CUDA graphs: one launch per compiled
    # graph instead of one per kernel, for launch-bound steps) | max-autotune | max-autotune-no-cudagraphs.
    # The CUDA-graph modes (CUDAGRAPH_MODES) are for training on one GPU per process without FSDP (no effect
    # on the CPU): refused with FSDP, gradient accumulation, activation checkpointing and outside mode=fit.
    compile_mode: str = "default"
    # torch.set_float32_matmul_precision for the run: highest (full float32, the default) | high (TF32 on
    # CUDA) | medium. The logits head is computed in float32 (SPEC §5) also under bf16-mixed: on an H100 its
    # forward + backward at the 7B's 4096 tokens took 64.7 ms in float32 and 11.3 ms with TF32, an estimated
    # 16% and 3% of a step (bench/GPU_RESULTS.md, head_precision); under 32-true every matmul is affected.
    float32_matmul_precision: str = "highest"
    deterministic: bool = False
    progress_bar: bool = True


@dataclass
class RunConfig:
    recipe: str = "debug"  # recipe name (recipes/<name>.yaml)
    description: str = ""  # one line shown by `python run.py recipe=list`
    task: str = "classify"  # classify | lm
    mode: str = "fit"  # fit | validate | test | eval_context | plan (memory per GPU, nothing allocated)
    seed: int = 1234
    run_root: str = "runs"  # runs/<recipe>/<timestamp>/
    run_dir: str | None = None  # set to reuse a directory
    resume: str | None = None  # auto | path to a .ckpt or a run directory
    ckpt: str | None = None  # checkpoint for validate / test
    init_from: str | None = None  # fit: start from this checkpoint's model weights (new optimizer, step 0)
    eval_context_lengths: list[int] = field(
        default_factory=list
    )  # mode=eval_context; empty: 4K, 8K, ... longest
    eval_max_documents: int = 0  # mode=eval_context: 0 = every validation document
    monitor: str = "val/acc"  # metric for the best checkpoint
    monitor_mode: str = "max"
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    optim: OptimSection = field(default_factory=OptimSection)
    trainer: TrainerSection = field(default_factory=TrainerSection)


class ConfigError(ValueError):
    """A recipe or override a user wrote is wrong; the message says what and how to fix it."""


@dataclass(frozen=True)
class DataContract:
    """What a data module feeds the model, checked against ``task`` and ``model.*`` by ``load_config``."""

    task: str  # classify | lm
    input_type: str = "token"  # the model.input_type its batches need
    dual_input: bool = False  # batches of document pairs (input1, input2): retrieval


# data.name -> contract. A data module added to datamodules.DATAMODULES must be added here (a test checks it,
# and checks the entries against the modules' own ``input_type`` / ``is_retrieval`` class attributes).
DATA_CONTRACTS: dict[str, DataContract] = {
    "listops": DataContract("classify", "token"),
    "lra_text": DataContract("classify", "token"),
    "lra_retrieval": DataContract("classify", "token", dual_input=True),
    "lra_image": DataContract("classify", "scalar"),
    "lra_pathfinder": DataContract("classify", "scalar"),
    "lra_pathx": DataContract("classify", "scalar"),
    "sc_raw": DataContract("classify", "scalar"),
    "imagenet": DataContract("classify", "patch"),
    "wt103": DataContract("lm"),
    "pg19": DataContract("lm"),
    "pretrain": DataContract("lm"),
    "kjv": DataContract("lm"),
}

# Keyword arguments every data module takes, from data.* and the run's seed (never through data.options).
_SHARED_DATA_KEYS = dict(
    data_dir="data.data_dir",
    batch_size="data.batch_size",
    num_workers="data.num_workers",
    seed="seed",
    max_length="data.max_length",
    pad_to_multiple="data.pad_to_multiple",
)


def _init_parameters(cls: type) -> dict[str, inspect.Parameter]:
    return {k: p for k, p in inspect.signature(cls.__init__).parameters.items() if k != "self"}


def data_module(cfg: DictConfig) -> tuple[type, dict[str, Any]]:
    """The class registered as ``data.name`` and its keyword arguments; a ConfigError for any key it does not
    take (``data.options`` are checked against its ``__init__`` signature)."""
    from datamodules import DATAMODULES

    d = cfg.data
    if d.name not in DATAMODULES:
        near = difflib.get_close_matches(str(d.name), list(DATAMODULES), n=3)
        raise ConfigError(
            f"data.name={d.name!r} is unknown; nearest: {near}; all: {', '.join(sorted(DATAMODULES))}"
        )
    cls = DATAMODULES[d.name]
    params = _init_parameters(cls)
    any_keyword = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    kwargs: dict[str, Any] = dict(data_dir=d.data_dir, batch_size=d.batch_size, num_workers=d.num_workers)
    kwargs["seed"] = cfg.seed
    for key, unset in (("max_length", None), ("pad_to_multiple", 1)):
        value = d[key]
        if value == unset:
            continue
        if key not in params and not any_keyword:
            raise ConfigError(
                f"data.{key}={value} is not used by data.name={d.name!r} ({cls.__name__} takes no {key}); "
                "remove it from the recipe or the command line"
            )
        kwargs[key] = value
    default_length = getattr(cls, "default_max_length", None)
    if getattr(cls, "input_type", None) == "scalar" and d.max_length not in (None, default_length):
        raise ConfigError(
            f"data.max_length={d.max_length}: data.name={d.name!r} has images of exactly {default_length} "
            f"pixels; set data.max_length={default_length} or leave it out"
        )
    options = OmegaConf.to_container(d.options, resolve=True)
    shared = sorted(set(options) & set(_SHARED_DATA_KEYS))
    if shared:
        raise ConfigError(
            f"data.options.{shared[0]} is set through {_SHARED_DATA_KEYS[shared[0]]}, not data.options"
        )
    unknown = sorted(set(options) - set(params))
    if unknown and not any_keyword:
        valid = sorted(set(params) - set(_SHARED_DATA_KEYS))
        raise ConfigError(
            f"data.options {unknown} are not options of data.name={d.name!r} ({cls.__name__}); valid: {valid}"
        )
    kwargs.update(options)
    return cls, kwargs


def data_option(cfg: DictConfig, name: str, default: Any = None) -> Any:
    """A data module argument as the run will pass it: ``data.options`` or the module's own default."""
    cls, kwargs = data_module(cfg)
    if name in kwargs:
        return kwargs[name]
    param = _init_parameters(cls).get(name)
    if param is None or param.default is inspect.Parameter.empty:
        return default
    return param.default


def data_num_classes(cfg: DictConfig) -> int | None:
    """Class count of a classification data module: its class attribute, else its ``num_classes`` argument."""
    cls, _ = data_module(cfg)
    fixed = getattr(cls, "num_classes", None)
    if isinstance(fixed, int):
        return fixed
    return data_option(cfg, "num_classes")


def tokens_per_sequence(cfg: DictConfig) -> float:
    """Mean training tokens per sequence: ``chunk_size * (min_chunks + max_chunks) / 2`` for variable-length
    batches of ``k ~ U{min_chunks..max_chunks}`` chunks (WikiText-103), else ``seq_len``."""
    low, high = data_option(cfg, "min_chunks"), data_option(cfg, "max_chunks")
    chunk = data_option(cfg, "chunk_size")
    if low is not None and high is not None and chunk:
        return chunk * (low + high) / 2
    seq_len = data_option(cfg, "seq_len")
    if not seq_len:
        raise ConfigError(
            f"trainer.global_batch_tokens={cfg.trainer.global_batch_tokens}: data.name={cfg.data.name!r} has no "
            "seq_len to count tokens per sequence"
        )
    return float(seq_len)


def list_recipes() -> dict[str, str]:
    """Recipe name -> one-line description."""
    out = {}
    for path in sorted(RECIPES_DIR.glob("*.yaml")):
        if path.stem.startswith("_"):
            continue
        out[path.stem] = str(_recipe_chain(path.stem).get("description", ""))
    return out


def _read_recipe(name: str) -> DictConfig:
    path = RECIPES_DIR / f"{name}.yaml"
    if not path.exists():
        known = [p.stem for p in RECIPES_DIR.glob("*.yaml")]
        near = difflib.get_close_matches(name, known, n=3)
        raise ConfigError(
            f"unknown recipe {name!r} (no {path}); nearest: {near or 'none'}; `python run.py recipe=list` lists all"
        )
    return OmegaConf.load(path)


def _recipe_chain(name: str, seen: tuple[str, ...] = ()) -> DictConfig:
    """The recipe merged over its ``inherit:`` parents."""
    if name in seen:
        raise ConfigError(f"recipe inheritance cycle: {' -> '.join(seen + (name,))}")
    node = _read_recipe(name)
    parent = node.pop("inherit", None)
    if parent is None:
        return node
    return OmegaConf.merge(_recipe_chain(str(parent), seen + (name,)), node)


def _valid_keys() -> list[str]:
    keys = [f.name for f in fields(RunConfig)]
    sections = (
        ("model", ModelSection),
        ("data", DataSection),
        ("optim", OptimSection),
        ("trainer", TrainerSection),
    )
    for name, cls in sections:
        keys += [f"{name}.{f.name}" for f in fields(cls)]
    return keys


def _explain(exc: OmegaConfBaseException, source: str) -> ConfigError:
    key = getattr(exc, "full_key", None) or getattr(exc, "key", None) or "?"
    value = getattr(exc, "value", None)
    valid = _valid_keys()
    near = difflib.get_close_matches(str(key), valid, n=3, cutoff=0.5)
    kind = "unknown key" if isinstance(exc, ConfigKeyError) else "invalid value"
    msg = f"{source}: {kind} {key!r}"
    if value is not None:
        msg += f" = {value!r}"
    msg += f" ({exc.msg.splitlines()[0] if hasattr(exc, 'msg') and exc.msg else exc})"
    if near and isinstance(exc, ConfigKeyError):
        msg += f"; nearest valid keys: {', '.join(near)}"
    return ConfigError(msg)


def _merge(base: DictConfig, other: DictConfig, source: str) -> DictConfig:
    try:
        return OmegaConf.merge(base, other)
    except OmegaConfBaseException as exc:
        raise _explain(exc, source) from None


def load_config(overrides: list[str]) -> DictConfig:
    """Resolve ``recipe=NAME key=value ...`` into a typed, validated configuration."""
    bad = [o for o in overrides if "=" not in o]
    if bad:
        raise ConfigError(f"overrides must be key=value, got {bad}")
    try:
        cli = OmegaConf.from_dotlist(overrides)
    except OmegaConfBaseException as exc:
        raise ConfigError(f"cannot parse overrides {overrides}: {exc}") from None
    recipe_name = str(cli.get("recipe", "debug"))
    recipe = _recipe_chain(recipe_name)
    recipe["recipe"] = recipe_name
    preset = (
        OmegaConf.select(cli, "model.preset") or OmegaConf.select(recipe, "model.preset") or "megalodon_debug"
    )
    if preset not in PRESETS:
        near = difflib.get_close_matches(str(preset), list(PRESETS), n=3)
        raise ConfigError(
            f"unknown model.preset {preset!r}; nearest: {near}; all: {', '.join(sorted(PRESETS))}"
        )
    cfg = OmegaConf.structured(RunConfig)
    cfg = _merge(cfg, OmegaConf.create({"model": dict(PRESETS[preset], preset=preset)}), f"preset {preset}")
    cfg = _merge(cfg, recipe, f"recipe {recipe_name}")
    cfg = _merge(cfg, cli, "command line")
    OmegaConf.set_readonly(cfg, False)
    # A preset's class count is a placeholder (as its vocab_size): the data's replaces it, a user's must match.
    user_classes = OmegaConf.select(cli, "model.num_classes", default=None)
    if user_classes is None:
        user_classes = OmegaConf.select(recipe, "model.num_classes", default=None)
    _validate(cfg, user_classes)
    return cfg


_CHOICES = {
    "task": ("classify", "lm"),
    "mode": ("fit", "validate", "test", "eval_context", "plan"),
    "monitor_mode": ("max", "min"),
    "optim.schedule": ("linear", "cosine", "constant"),
    "optim.implementation": tuple(ADAMW_KERNELS),
    "trainer.strategy": ("auto", "ddp", "fsdp", "hsdp"),
    "trainer.chunk_parallel_mode": ("parallel", "sequential"),
    "trainer.precision": ("32-true", "32", "bf16-mixed", "bf16-true", "64-true", "64"),
}


def _validate(cfg: DictConfig, user_classes: int | None = None) -> None:
    for key, choices in _CHOICES.items():
        value = OmegaConf.select(cfg, key)
        if value not in choices:
            raise ConfigError(f"{key}={value!r} is invalid; expected one of {', '.join(map(str, choices))}")
    for key in ("data.batch_size", "trainer.max_steps", "trainer.accumulate_grad_batches"):
        value = OmegaConf.select(cfg, key)
        if value < 1:
            raise ConfigError(f"{key}={value} must be >= 1")
    if cfg.optim.lr <= 0:
        raise ConfigError(f"optim.lr={cfg.optim.lr} must be > 0")
    _validate_data(cfg, user_classes)
    _validate_mode(cfg)
    _validate_trainer(cfg)
    try:
        model_config(cfg)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def _validate_data(cfg: DictConfig, user_classes: int | None) -> None:
    """data.* against the data module; task, model.num_classes / input_type / dual_input against its contract."""
    data_module(cfg)
    name, task, m = cfg.data.name, cfg.task, cfg.model
    contract = DATA_CONTRACTS.get(name)
    if contract is None:
        raise ConfigError(f"data.name={name!r} has no entry in mega_suite.settings.DATA_CONTRACTS")
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


COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
FLOAT32_MATMUL_PRECISIONS = ("highest", "high", "medium")  # torch.set_float32_matmul_precision's values
CUDAGRAPH_MODES = ("reduce-overhead", "max-autotune")  # Inductor's modes that capture CUDA graphs

# Inductor options of ``trainer.compile`` on the CPU (mode "default"): a buffer read by more than one kernel
# is materialised rather than recomputed inside each (``realize_reads_threshold``, 4 by default). With the
# default, pg19_small's compiled backward fused the attention's key / value gradient accumulation, the RoPE
# and Q/K-scale backward into one scalar (unvectorised) loop of 4.3 ms per block, a tenth of the step;
# with 1 pg19_small's compiled step runs 1.03-1.17x faster in every paired run (fp32 and bf16-mixed); the
# debug classifier (a 15 ms step) 0.71-1.45x, neither way consistently (bench/RESULTS.md §26). Not
# measured on GPUs: not used there.
CPU_INDUCTOR_OPTIONS = {"realize_reads_threshold": 1}


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
    if t.accumulate_grad_batches > 1:
        raise ConfigError(
            f"{name} cannot accumulate gradients (trainer.accumulate_grad_batches={t.accumulate_grad_batches}, "
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
    check_cudagraph_mode(cfg)
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


def model_config(cfg: DictConfig, **updates: Any):
    """The model config of a run (``updates`` e.g. the data module's vocab_size / num_classes): the
    MegalodonConfig the model section describes, or with ``model.arch=llama`` the LlamaConfig matched to it in
    parameter count, with the data's ``seq_len`` as its context window."""
    from mega_suite.models import ARCHS

    values = OmegaConf.to_container(cfg.model, resolve=True)
    values.pop("preset", None)
    arch = values.pop("arch")
    values.update(updates)
    megalodon = MegalodonConfig(**values)
    if arch not in ARCHS:
        raise ConfigError(
            f"model.arch={arch!r} is not a registered architecture; expected one of {sorted(ARCHS)}"
        )
    if arch == "megalodon":
        return megalodon
    return _llama_config(cfg, megalodon)


def _llama_config(cfg: DictConfig, megalodon: MegalodonConfig):
    import torch

    from mega_suite.models import build_model, count_parameters
    from mega_suite.models.llama import matched_config

    if cfg.task != "lm" or megalodon.is_classifier:
        raise ConfigError("model.arch=llama is a causal language model: it needs task=lm")
    if megalodon.adaptive_cutoffs:
        raise ConfigError(
            "model.arch=llama has no adaptive input / softmax (model.adaptive_cutoffs, WikiText-103): use "
            "model.arch=megalodon for this recipe"
        )
    seq_len = data_option(cfg, "seq_len")
    if not seq_len:
        raise ConfigError("model.arch=llama needs the data's seq_len (data.options.seq_len) as its window")
    with torch.device("meta"):
        target = count_parameters(build_model(megalodon))
    return matched_config(
        target, megalodon.model_dim, megalodon.vocab_size, megalodon.share_emb, max_seq_len=int(seq_len),
        norm_eps=megalodon.norm_eps, dropout=megalodon.dropout,
    )  # fmt: skip


def to_yaml(cfg: DictConfig) -> str:
    return OmegaConf.to_yaml(cfg, resolve=True)
