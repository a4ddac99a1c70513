"""The configuration's schema: typed omegaconf structured configs, one dataclass per section, with the
domain of every bounded key declared beside it (docs/configuration.md)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

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
    limit_val_batches: float = 1.0  # fraction (<= 1.0) or number of batches
    limit_test_batches: float = 1.0
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


class ConfigError(ValueError):
    """A recipe or override a user wrote is wrong; the message says what and how to fix it."""


COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
FLOAT32_MATMUL_PRECISIONS = ("highest", "high", "medium")  # torch.set_float32_matmul_precision's values
CUDAGRAPH_MODES = ("reduce-overhead", "max-autotune")  # Inductor's modes that capture CUDA graphs


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
}
