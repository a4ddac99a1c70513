"""The configuration's schema: typed omegaconf structured configs, one dataclass per section, with the
domain of every bounded key declared beside it (docs/configuration.md)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Union

from mega_suite.errors import ConfigError as ConfigError  # raised by every check (with the other user errors)
from mega_suite.models.megalodon.config import MegalodonConfig


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
    global_batch_tokens: int = 0  # task=lm, > 0: sets accumulate_grad_batches (config.resolve.accumulation)
    peak_tflops: float = 0.0  # task=lm: per-device peak for MFU (e.g. 989: H100 bf16 dense); 0: no MFU
    val_check_interval: int = 500  # validate (and test) every N training batches
    # as Lightning: a whole number counts batches (1: one batch), a float is a fraction (1.0: all)
    limit_val_batches: Union[int, float] = 1.0  # noqa: UP007 (OmegaConf reads typing.Union, not int | float)
    limit_test_batches: Union[int, float] = 1.0  # noqa: UP007
    log_every_n_steps: int = 10
    gradient_checkpointing: bool = False  # recompute block activations in backward
    # P > 1: the ranks form a (data-parallel x chunk-parallel) mesh; the P ranks of a group each train on a
    # contiguous, chunk-aligned slice of the same sequences (docs/architecture.md#chunk-parallelism, mega_suite.distributed.chunk_parallel); needs
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
    # CUDA) | medium. The logits head is computed in float32 (docs/architecture.md#float32-islands) also under
    # bf16-mixed; TF32 makes it a small share of a 7B step on a GPU (bench/reports/2026-11-24-gpu-results-leases.md); under 32-true every
    # matmul is affected.
    float32_matmul_precision: str = "highest"
    deterministic: bool = False
    progress_bar: bool = True
    # > 0: also keep a checkpoint every N optimizer steps (checkpoints/step<N>.ckpt), for scores against
    # training tokens (mode=lm_eval lm_eval.checkpoints=RUN_DIR); keep_checkpoints: the newest K of them (0: all)
    save_every_n_steps: int = 0
    keep_checkpoints: int = 0


@dataclass
class LmEvalSection:  # mode=lm_eval: EleutherAI's lm-evaluation-harness (docs/after_training.md#lm_eval)
    tasks: list[str] = field(default_factory=list)  # harness task / group names, or local ones (include_path)
    num_fewshot: int | None = None  # None: each task's own
    limit: float | None = None  # examples per task (a fraction when < 1); None: all
    include_path: str | None = None  # a folder of local task YAMLs (JSON data_files relative to each YAML)
    checkpoints: list[str] = field(
        default_factory=list
    )  # score several: checkpoint paths, or one run directory
    max_gen_toks: int = 256  # generate-until tasks that set no max_gen_toks
    batch_size: int = (
        16  # requests per pass; 16: near the fastest of 4, 16, 64 on the CPU (bench/lm_eval_batch.py)
    )


@dataclass
class PasskeySection:  # mode=passkey: needle-in-a-haystack retrieval (docs/after_training.md#passkey)
    lengths: list[int] = field(default_factory=list)  # prompt lengths in tokens; empty: 1K, 2K, ... 64K
    samples: int = 5  # prompts per length (needle depths spread evenly from 10% to 90%)
    haystack: str = "filler"  # filler (repeated sentences) | a text file or a folder of .txt files


@dataclass
class RunConfig:
    recipe: str = "debug"  # recipe name (recipes/<name>.yaml)
    description: str = ""  # one line shown by `python run.py recipe=list`
    task: str = "classify"  # classify | lm
    # fit | validate | test | eval_context | plan (memory per GPU, nothing allocated) | generate | lm_eval | passkey
    mode: str = "fit"
    seed: int = 1234
    run_root: str = "runs"  # runs/<recipe>/<timestamp>/
    run_dir: str | None = None  # set to reuse a directory
    resume: str | None = None  # auto | path to a .ckpt or a run directory
    ckpt: str | None = (
        None  # validate / test / eval_context / generate / lm_eval / passkey; an exported bundle too
    )
    init_from: str | None = None  # fit: start from this checkpoint's model weights (new optimizer, step 0)
    eval_context_lengths: list[int] = field(
        default_factory=list
    )  # mode=eval_context; empty: 4K, 8K, ... longest
    eval_max_documents: int = 0  # mode=eval_context: 0 = every validation document
    # mode=generate (docs/after_training.md#generate): the prompt (or a file holding it) and the sampling
    prompt: str | None = None
    prompt_file: str | None = None
    max_new_tokens: int = 128
    temperature: float = 1.0  # 0: greedy
    top_k: int | None = None
    top_p: float | None = None
    compile: bool = False  # Megalodon: decode through the compiled StaticDecoder
    # generate / lm_eval / passkey: the tokenizer file; default the run directory's or bundle's copy, else the
    # data's (data.options.tokenizer_path)
    tokenizer: str | None = None
    lm_eval: LmEvalSection = field(default_factory=LmEvalSection)
    passkey: PasskeySection = field(default_factory=PasskeySection)
    monitor: str = "val/acc"  # metric for the best checkpoint
    monitor_mode: str = "max"
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    optim: OptimSection = field(default_factory=OptimSection)
    trainer: TrainerSection = field(default_factory=TrainerSection)


COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
FLOAT32_MATMUL_PRECISIONS = ("highest", "high", "medium")  # torch.set_float32_matmul_precision's values
CUDAGRAPH_MODES = ("reduce-overhead", "max-autotune")  # Inductor's modes that capture CUDA graphs


# Keys holding paths: ``~`` is expanded at load (also in lists: lm_eval.checkpoints)
PATH_KEYS = (
    "data.data_dir", "run_root", "run_dir", "resume", "ckpt", "init_from", "tokenizer", "prompt_file",
    "lm_eval.include_path", "lm_eval.checkpoints", "passkey.haystack",
)  # fmt: skip

EVAL_MODES = ("validate", "test", "eval_context", "generate", "lm_eval", "passkey")  # read a trained model
GENERATE_KEYS = ("prompt", "prompt_file", "max_new_tokens", "temperature", "top_k", "top_p", "compile")

# key (or section) -> the modes that read it. Set to anything but its default in another mode it is refused
# at load: a key that does nothing there is a mistake the user should hear of (config.checks).
MODE_KEYS: dict[str, tuple[str, ...]] = {
    "ckpt": EVAL_MODES,
    "init_from": ("fit",),
    "resume": ("fit", "validate", "test"),
    "eval_context_lengths": ("eval_context",),
    "eval_max_documents": ("eval_context",),
    **{key: ("generate",) for key in GENERATE_KEYS},
    "tokenizer": ("generate", "lm_eval", "passkey"),
    "lm_eval": ("lm_eval",),
    "passkey": ("passkey",),
}

# key -> its allowed values, checked at load (config.checks)
CHOICES = {
    "task": ("classify", "lm"),
    "mode": ("fit", "validate", "test", "eval_context", "plan", "generate", "lm_eval", "passkey"),
    "monitor_mode": ("max", "min"),
    "optim.schedule": ("linear", "cosine", "constant"),
    "optim.implementation": tuple(ADAMW_KERNELS),
    "trainer.strategy": ("auto", "ddp", "fsdp", "hsdp"),
    "trainer.chunk_parallel_mode": ("parallel", "sequential"),
    "trainer.precision": ("32-true", "32", "bf16-mixed", "bf16-true", "64-true", "64"),
    "trainer.accelerator": ("auto", "cpu", "gpu", "cuda"),
}


# --------------------------------------------------------------------------------------------------------------
# The domain of every bounded key, checked at load (config.checks) before anything is created
# --------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Domain:
    """The values a numeric key accepts: bounds (closed, or open with ``*_open``), whole numbers only
    (``integer``), always finite, plus the values in ``also`` (a sentinel such as -1, None or "auto").
    ``each``: the key is a list whose every element must lie in the domain (``length``: how many)."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    integer: bool = False
    also: tuple = ()
    each: bool = False
    length: int | None = None

    @property
    def top(self) -> float | None:
        """The upper bound: a whole number's is at most INT_MAX (a count past it is a typo, not a plan)."""
        return INT_MAX if self.integer and self.high is None else self.high

    def expected(self) -> str:
        kind = "a whole number" if self.integer else "a finite number"
        if self.low is not None and self.top is not None:
            left, right = "(" if self.low_open else "[", ")" if self.high_open else "]"
            text = f"{kind} in {left}{_num(self.low)}, {_num(self.top)}{right}"
        elif self.low is not None:
            text = f"{kind} {'>' if self.low_open else '>='} {_num(self.low)}"
        elif self.high is not None:
            text = f"{kind} {'<' if self.high_open else '<='} {_num(self.high)}"
        else:
            text = kind
        if self.also:
            text += " or " + " or ".join(repr(v) if isinstance(v, str) else str(v) for v in self.also)
        if self.each:
            text = f"a list of {self.length or 'any number of'} values, each {text}"
        return text

    def problem(self, value: Any) -> str | None:
        """None when ``value`` lies in the domain, else what was expected."""
        if self.each:
            values = list(value) if isinstance(value, (list, tuple)) or hasattr(value, "__len__") else None
            if values is None or isinstance(value, str):
                return self.expected()
            if self.length is not None and len(values) != self.length:
                return self.expected()
            return next((self.expected() for v in values if not self._holds(v)), None)
        return None if self._holds(value) else self.expected()

    def _holds(self, value: Any) -> bool:
        if any(value is v or (type(value) is type(v) and value == v) for v in self.also):
            return True
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False
        if not math.isfinite(value) or (self.integer and value != int(value)):
            return False
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return self.top is None or (value < self.top if self.high_open else value <= self.top)


INT_MAX = 2**31 - 1  # the largest whole number a count or size key accepts


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


class BatchLimit(Domain):
    """``trainer.limit_*_batches``: a fraction of the batches in [0, 1], or a whole number of them."""

    def expected(self) -> str:
        return "a fraction in [0, 1] or a whole number of batches >= 1"

    def _holds(self, value: Any) -> bool:
        return Domain(0, 1)._holds(value) or Domain(1, integer=True)._holds(value)


class Limit(Domain):
    """``lm_eval.limit``: a fraction of each task's examples in (0, 1), or a whole number of them."""

    def expected(self) -> str:
        return f"a fraction in (0, 1) or a whole number of examples in [1, {INT_MAX}] or None"

    def _holds(self, value: Any) -> bool:
        if value is None:
            return True
        return Domain(0, 1, low_open=True, high_open=True)._holds(value) or Domain(1, integer=True)._holds(
            value
        )


class Devices(Domain):
    """``trainer.devices``: "auto", a count >= 1, or a list of device indices."""

    def expected(self) -> str:
        return "a number of devices >= 1, 'auto', or a list of distinct device indices >= 0"

    def problem(self, value: Any) -> str | None:
        if value == "auto" or Domain(1, integer=True)._holds(value):
            return None
        if isinstance(value, str) or not hasattr(value, "__len__"):
            return self.expected()
        values = list(value)
        index = Domain(0, integer=True)
        if values and len(set(values)) == len(values) and all(index._holds(v) for v in values):
            return None
        return self.expected()


def at_least(low: int) -> Domain:
    return Domain(low, integer=True)


POSITIVE = Domain(0, low_open=True)  # finite and > 0
NON_NEGATIVE = Domain(0)  # finite and >= 0
PROBABILITY = Domain(0, 1, high_open=True)  # a dropout rate

RANGES: dict[str, Domain] = {
    "seed": Domain(0, 2**32 - 1, integer=True),  # numpy's and Lightning's seeds are unsigned 32-bit
    "eval_max_documents": at_least(0),
    "eval_context_lengths": Domain(1, integer=True, each=True),
    # model.* (the architecture's own checks, e.g. divisibility, come after these)
    "model.num_layers": at_least(1),
    "model.model_dim": at_least(1),
    "model.num_heads": at_least(1),
    "model.z_dim": at_least(1),
    "model.value_dim": at_least(1),
    "model.ffn_hidden_dim": at_least(1),
    "model.cema_ndim": at_least(1),
    "model.norm_num_groups": at_least(1),
    "model.chunk_size": at_least(1),
    "model.norm_eps": POSITIVE,
    "model.rope_base": POSITIVE,
    "model.dropout": PROBABILITY,
    "model.hidden_dropout": PROBABILITY,
    "model.attention_dropout": PROBABILITY,
    "model.drop_path": PROBABILITY,
    "model.vocab_size": at_least(1),
    "model.adaptive_cutoffs": Domain(
        1, integer=True, each=True
    ),  # increasing, < vocab_size: the model's check
    "model.adaptive_factor": POSITIVE,
    "model.num_classes": at_least(0),
    "model.image_size": at_least(1),
    "model.patch_size": at_least(1),
    "model.in_chans": at_least(1),
    # data.*
    "data.batch_size": at_least(1),
    "data.num_workers": at_least(0),
    "data.max_length": Domain(1, integer=True, also=(None,)),
    "data.pad_to_multiple": at_least(1),
    # optim.*
    "optim.lr": POSITIVE,
    "optim.weight_decay": NON_NEGATIVE,
    "optim.betas": Domain(0, 1, high_open=True, each=True, length=2),
    "optim.eps": POSITIVE,
    "optim.warmup_steps": at_least(0),
    "optim.min_lr_ratio": Domain(0, 1),
    "optim.clip_grad_norm": NON_NEGATIVE,  # 0: no clipping
    # trainer.*
    "trainer.max_steps": at_least(1),
    "trainer.max_epochs": Domain(1, integer=True, also=(-1,)),  # -1: bounded by max_steps only
    "trainer.devices": Devices(),
    "trainer.num_nodes": at_least(1),
    "trainer.accumulate_grad_batches": at_least(1),
    "trainer.global_batch_tokens": at_least(0),
    "trainer.peak_tflops": NON_NEGATIVE,
    "trainer.val_check_interval": at_least(1),
    "trainer.limit_val_batches": BatchLimit(),
    "trainer.limit_test_batches": BatchLimit(),
    "trainer.log_every_n_steps": at_least(1),
    "trainer.chunk_parallel": at_least(1),
    "trainer.save_every_n_steps": at_least(0),  # 0: no periodic checkpoints
    "trainer.keep_checkpoints": at_least(0),  # 0: keep every periodic checkpoint
    # mode=generate
    "max_new_tokens": at_least(1),
    "temperature": NON_NEGATIVE,  # 0: greedy
    "top_k": Domain(1, integer=True, also=(None,)),
    "top_p": Domain(0, 1, low_open=True, also=(None,)),
    # mode=lm_eval, mode=passkey
    "lm_eval.num_fewshot": Domain(0, integer=True, also=(None,)),
    "lm_eval.limit": Limit(),
    "lm_eval.max_gen_toks": at_least(1),
    "lm_eval.batch_size": at_least(1),
    "passkey.samples": at_least(1),
    "passkey.lengths": Domain(64, integer=True, each=True),
}
