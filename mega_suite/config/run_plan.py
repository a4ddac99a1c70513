"""The run plan: a command resolved once, files included, before anything is created
(docs/configuration.md#the-run-plan).

``make_plan(cfg)`` takes a configuration ``load_config`` validated and checks everything else the command
names: each checkpoint (``ckpt=``, ``init_from=``, ``resume=``, ``lm_eval.checkpoints``) through the one
reader, the folder it will write (``mega_suite.storage.runs``: a new one, the run it continues, or an
evaluation's beside its run), the tokenizer, the prompt file, the lm-eval task folder, the haystack, the
machine (accelerator, devices) and whether the model fits in its memory. Any problem is one ``UserError``;
nothing exists yet. The runner, the Lightning modules and ``mode=plan`` then read the plan and never change
it (``cfg`` is read-only); its description is saved in the run folder (``plan.json``).
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig, OmegaConf

from mega_suite.config.checks import check_compile_backend
from mega_suite.config.resolve import (
    accumulation,
    data_arguments,
    data_option,
    device_count,
    model_config,
    tokens_per_sequence,
    tokens_per_step,
)
from mega_suite.config.schema import EVAL_MODES, ConfigError
from mega_suite.models import arch_of

if TYPE_CHECKING:  # torch comes with the checkpoint reader: configuration errors are answered before it
    from mega_suite.storage.checkpoints import Checkpoint
    from mega_suite.storage.runs import Output

SHARDING_STRATEGIES = ("fsdp", "hsdp")  # built on the meta device, sharded, then initialised
LAUNCHED = (
    "MEGA_SUITE_RUN"  # "folder<pathsep>resumed checkpoint" that rank 0 claimed, for ranks 1.. it launches
)
_FROM_DATA = ("vocab_size", "num_classes")  # model.* keys whose value follows the data


@dataclass(frozen=True)
class RunPlan:
    cfg: DictConfig  # the validated configuration (read-only)
    output: Output | None  # where the command writes (None: mode=plan writes nothing)
    resume: Checkpoint | None  # the checkpoint a fit continues
    init_from: Checkpoint | None  # fit: the weights it starts from
    evaluated: tuple[
        Checkpoint, ...
    ]  # the checkpoints an evaluation reads (ckpt=, lm_eval.checkpoints, resume)
    tokenizer: Path | None  # tokenizer= (generate / lm_eval / passkey)
    prompt: str | None  # mode=generate: the prompt's text (prompt_file read)
    data_kwargs: dict[str, Any]  # the data module's keyword arguments (data.*, data.options, the seed)
    model: Any  # MegalodonConfig | LlamaConfig; vocab_size / num_classes from the data once it is prepared
    devices: int  # per node
    nodes: int
    launched: bool = False  # a rank > 0 that Lightning's launcher started: rank 0 claimed the folder
    notes: tuple[str, ...] = ()  # decisions to print (resume fallbacks, schedule changes)

    @property
    def mode(self) -> str:
        return self.cfg.mode

    @property
    def sharded(self) -> bool:
        return self.cfg.trainer.strategy in SHARDING_STRATEGIES

    @property
    def world(self) -> int:
        return self.devices * self.nodes

    @property
    def data_class(self) -> type:
        from datamodules import DATAMODULES

        return DATAMODULES[self.cfg.data.name]

    @property
    def seq_len(self) -> int:
        """The data's seq_len (language models with fixed-length sequences; else 0)."""
        return int(data_option(self.cfg, "seq_len", 0) or 0) if self.cfg.task == "lm" else 0

    @property
    def tokens_per_sequence(self) -> float:
        """Mean training tokens per sequence (language models; 0 for classifiers)."""
        return tokens_per_sequence(self.cfg) if self.cfg.task == "lm" else 0.0

    @property
    def accumulate_grad_batches(self) -> int:
        return accumulation(self.cfg, self.devices)

    @property
    def tokens_per_step(self) -> float | None:
        value = tokens_per_step(self.cfg, self.devices)
        return value[0] if value else None

    @property
    def label_smoothing(self) -> float:
        """Classifiers: the data module's (DeiT's 0.1 for ImageNet)."""
        return 0.0 if self.cfg.task == "lm" else float(data_option(self.cfg, "label_smoothing", 0.0))

    @property
    def flops_per_token(self) -> float:
        """Training FLOPs per token of the model (language models; 0 otherwise): what MFU is counted from."""
        if self.cfg.task != "lm":
            return 0.0
        return arch_of(self.model).flops_per_token(self.model, self.seq_len)

    def build_data(self):
        return self.data_class(**self.data_kwargs)

    def with_data(self, dm: Any) -> RunPlan:
        """The plan with the model's vocabulary size and class count taken from the prepared data module."""
        updates = {}
        if getattr(dm, "vocab_size", None):
            updates["vocab_size"] = int(dm.vocab_size)
        if self.cfg.task == "classify" and getattr(dm, "num_classes", None):
            updates["num_classes"] = int(dm.num_classes)
        return dataclasses.replace(self, model=model_config(self.cfg, **updates)) if updates else self

    def global_batch_line(self) -> str | None:
        """How ``trainer.global_batch_tokens`` became an accumulation, for the log (None when unset)."""
        target = self.cfg.trainer.global_batch_tokens
        if target <= 0:
            return None
        per_step = self.cfg.data.batch_size * self.tokens_per_sequence * self.world
        return (
            f"global batch {target} tokens = {per_step:g} tokens per step x {self.accumulate_grad_batches} "
            f"accumulation ({per_step * self.accumulate_grad_batches:g} tokens)"
        )

    def describe(self, folder: Path | None = None) -> dict[str, Any]:
        """What ``plan.json`` records: the derived values and every file the command read."""

        def ckpt(c: Checkpoint | None) -> dict | None:
            return (
                None
                if c is None
                else {"path": str(c.path), "format": c.format, "kind": c.kind, "step": c.global_step}
            )

        per_step = tokens_per_step(self.cfg, self.devices)
        return {
            "mode": self.mode,
            "recipe": self.cfg.recipe,
            "folder": str(folder or (self.output.path if self.output else "")),
            "model": {"arch": arch_of(self.model).name, **dataclasses.asdict(self.model)},
            "data": {"name": self.cfg.data.name, "arguments": self.data_kwargs},
            "devices": self.devices,
            "nodes": self.nodes,
            "accumulate_grad_batches": self.accumulate_grad_batches,
            "tokens_per_step": per_step[0] if per_step else None,
            "tokens_per_step_how": per_step[1] if per_step else None,
            "resume": ckpt(self.resume),
            "init_from": ckpt(self.init_from),
            "evaluated": [ckpt(c) for c in self.evaluated],
            "tokenizer": str(self.tokenizer) if self.tokenizer else None,
            "notes": list(self.notes),
        }

    def write(self, folder: Path) -> None:
        from mega_suite.storage.atomic import write_text

        write_text(folder / "plan.json", json.dumps(self.describe(folder), indent=1, default=str) + "\n")


# --------------------------------------------------------------------------------------------------------------
# Making the plan
# --------------------------------------------------------------------------------------------------------------


def make_plan(cfg: DictConfig) -> RunPlan:
    """The plan of a configuration ``load_config`` validated: every file checked, nothing created."""
    cfg = OmegaConf.create(OmegaConf.to_container(cfg))  # the caller's object is never the plan's
    OmegaConf.set_readonly(cfg, True)
    mode = cfg.mode
    _check_inputs(cfg)  # no torch: the files and task names a mode reads, answered at once
    check_compile_backend(cfg)
    check_accelerator(cfg)
    data_kwargs = data_arguments(cfg)
    model = model_config(cfg)
    devices = device_count(cfg)
    from mega_suite.storage.checkpoints import open_checkpoint  # torch: after every check that needs none
    from mega_suite.storage.runs import Output, evaluation_output, training_output

    resume, init_from, evaluated, output, notes = None, None, (), None, []
    launched = os.environ.get(LAUNCHED)
    if launched:  # a rank Lightning's launcher started: the folder and checkpoint rank 0 resolved and claimed
        folder, _, resumed = launched.partition(os.pathsep)
        resume = open_checkpoint(resumed, "resume") if resumed else None
        output = Output(
            Path(folder), "train" if mode == "fit" else "eval", fresh=False, resuming=resume is not None
        )
    if cfg.init_from:
        init_from = open_checkpoint(cfg.init_from, "init_from")
        check_config_match(init_from, cfg, "init_from")
    if mode == "fit" and not launched:
        output, resume = training_output(
            Path(cfg.run_root), cfg.recipe, cfg.run_dir, cfg.resume, cfg.model.arch
        )
        notes += list(output.notes)
        if resume is not None:
            check_config_match(resume, cfg, "resume")
            check_optimizer(resume, cfg)
            notes += check_schedule(resume, cfg)
    elif mode in EVAL_MODES:
        evaluated = tuple(_evaluated(cfg))
        if mode in ("validate", "test", "eval_context"):
            for found in evaluated:
                check_config_match(found, cfg, "ckpt")
        if not launched:
            output = evaluation_output(Path(cfg.run_root), cfg.recipe, mode, cfg.run_dir, list(evaluated))
    if output is not None and not launched:
        check_writable(output.path, "run_dir" if cfg.run_dir else "run_root", cfg.run_dir or cfg.run_root)
    plan = RunPlan(
        cfg=cfg, output=output, resume=resume, init_from=init_from, evaluated=evaluated,
        tokenizer=_tokenizer(cfg), prompt=_prompt(cfg), data_kwargs=data_kwargs, model=model, devices=devices,
        nodes=int(cfg.trainer.num_nodes), launched=bool(launched), notes=tuple(notes),
    )  # fmt: skip
    if mode != "plan":
        check_fits_in_memory(plan)
    return plan


def _evaluated(cfg: DictConfig) -> list[Checkpoint]:
    """The checkpoints an evaluation reads, each checked: ``ckpt=``; ``lm_eval.checkpoints`` (a run folder:
    its periodic ``step<N>.ckpt``); ``mode=validate|test`` with ``resume=``: the run's newest checkpoint."""
    from mega_suite.storage.checkpoints import open_checkpoint
    from mega_suite.storage.runs import newest_run

    if cfg.ckpt:
        return [open_checkpoint(cfg.ckpt, "ckpt")]
    if cfg.mode == "lm_eval" and cfg.lm_eval.checkpoints:
        sources = list(cfg.lm_eval.checkpoints)
        if len(sources) == 1 and Path(sources[0]).is_dir():
            steps = step_checkpoints(Path(sources[0]))
            if steps:
                return [open_checkpoint(p, "lm_eval.checkpoints") for p in steps]
        return [open_checkpoint(s, "lm_eval.checkpoints") for s in sources]
    if cfg.mode in ("validate", "test"):
        if not cfg.resume:
            raise ConfigError(f"mode={cfg.mode} needs ckpt=PATH (or resume=auto / a run folder)")
        if cfg.resume == "auto":
            folder = Path(cfg.run_root) / cfg.recipe
            run = Path(cfg.run_dir) if cfg.run_dir else newest_run(folder, cfg.recipe, cfg.model.arch)
            if run is None:
                raise ConfigError(
                    f"mode={cfg.mode} resume=auto: no run of recipe={cfg.recipe} with a checkpoint in "
                    f"{Path(cfg.run_root) / cfg.recipe}; give ckpt=PATH"
                )
            return [open_checkpoint(run, "resume=auto")]
        return [open_checkpoint(cfg.resume, "resume")]
    return []  # eval_context without ckpt=: the freshly initialised model


def step_checkpoints(run: Path) -> list[Path]:
    """The periodic checkpoints of a run folder (``checkpoints/step<N>.ckpt``), by step."""
    import re

    pattern = re.compile(r"step(\d+)\.ckpt$")
    found = [
        (int(m.group(1)), p)
        for p in (run / "checkpoints").glob("step*.ckpt")
        if (m := pattern.search(p.name))
    ]
    return [p for _, p in sorted(found)]


def _tokenizer(cfg: DictConfig) -> Path | None:
    if not cfg.tokenizer:
        return None
    path = Path(cfg.tokenizer)
    if not path.is_file():
        raise ConfigError(
            f"tokenizer={cfg.tokenizer}: no such file (a SentencePiece .model or a tokenizer.json)"
        )
    if path.suffix not in (".model", ".json"):
        raise ConfigError(f"tokenizer={cfg.tokenizer}: expected a SentencePiece .model or a tokenizer.json")
    return path


def _prompt(cfg: DictConfig) -> str | None:
    if cfg.mode != "generate":
        return None
    if not cfg.prompt_file:
        return str(cfg.prompt)
    path = Path(cfg.prompt_file)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"prompt_file={cfg.prompt_file}: no such file") from None
    except IsADirectoryError:
        raise ConfigError(f"prompt_file={cfg.prompt_file} is a folder, not a text file") from None
    except UnicodeDecodeError:
        raise ConfigError(f"prompt_file={cfg.prompt_file} is not UTF-8 text") from None
    except OSError as exc:
        raise ConfigError(f"prompt_file={cfg.prompt_file} cannot be read: {exc.strerror or exc}") from None
    if not text.strip():
        raise ConfigError(f"prompt_file={cfg.prompt_file} is empty: nothing to continue")
    return text


def _check_inputs(cfg: DictConfig) -> None:
    """The folders and files the modes read besides checkpoints."""
    if cfg.mode == "lm_eval":  # a misspelt task name before any checkpoint is opened (no torch needed)
        from mega_suite.config.lm_eval_tasks import check_task_names

        check_task_names(list(cfg.lm_eval.tasks), cfg.lm_eval.include_path)
    if cfg.mode == "passkey" and cfg.passkey.haystack != "filler":
        path = Path(cfg.passkey.haystack)
        if not path.exists():
            raise ConfigError(
                f"passkey.haystack={cfg.passkey.haystack}: no such file or folder (or 'filler')"
            )
        if path.is_dir() and not any(path.glob("*.txt")):
            raise ConfigError(f"passkey.haystack={cfg.passkey.haystack} holds no .txt files")


# --------------------------------------------------------------------------------------------------------------
# Checks of the machine and of checkpoints against the run
# --------------------------------------------------------------------------------------------------------------


def check_accelerator(cfg: DictConfig) -> None:
    """``trainer.accelerator=gpu|cuda`` needs CUDA devices, as many as ``trainer.devices`` asks; on the CPU
    ``trainer.devices`` counts processes."""
    import torch

    t = cfg.trainer
    devices = t.devices
    if t.accelerator in ("gpu", "cuda"):
        if not torch.cuda.is_available():
            raise ConfigError(
                f"trainer.accelerator={t.accelerator} but no CUDA device is visible here; use "
                "trainer.accelerator=cpu (or auto)"
            )
        have = torch.cuda.device_count()
        want = devices if isinstance(devices, int) else len(devices) if not isinstance(devices, str) else 1
        if want > have:
            raise ConfigError(f"trainer.devices={devices} but {have} CUDA device(s) are visible here")
    cpu = t.accelerator == "cpu" or (t.accelerator == "auto" and not torch.cuda.is_available())
    if cpu and not isinstance(devices, (int, str)):
        raise ConfigError(
            f"trainer.devices={list(devices)}: on the CPU trainer.devices is a number of processes, not a list "
            "of device indices"
        )


def check_writable(path: Path, key: str, value: str) -> None:
    """The folder (or the nearest folder above it that exists) can be written."""
    probe = Path(path)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not os.access(probe, os.W_OK):
        try:
            read_only = bool(os.statvfs(probe).f_flag & os.ST_RDONLY)
        except OSError:
            read_only = False
        reason = "the file system is read-only" if read_only else "permission denied"
        raise ConfigError(
            f"{key}={value}: cannot create the folder {path} ({probe}: {reason}); set {key}= to a writable folder"
        )


def memory_available() -> tuple[int, str]:
    """Bytes one process may allocate for the model, and where (the GPU's memory, else the host's RAM)."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory, "the GPU's memory"
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "this machine's RAM"


def check_fits_in_memory(plan: RunPlan) -> None:
    """A model whose weights (and, to train, gradients and AdamW state) cannot fit on one process is refused
    with its size before anything is allocated (``mode=plan`` prints the whole budget)."""
    from mega_suite.models import build_on_meta, count_parameters

    params = count_parameters(build_on_meta(plan.model))
    per_param = 16 if plan.mode == "fit" else 4  # float32 weights (+ gradients + 2 AdamW moments)
    shard = plan.world if plan.sharded else 1
    need = params * per_param / shard
    have, where = memory_available()
    if need > have:
        what = "weights, gradients and AdamW state" if plan.mode == "fit" else "float32 weights"
        raise ConfigError(
            f"the model has {params / 1e6:,.1f}M parameters: {need / 2**30:,.1f} GiB of {what} per process, more "
            f"than {where} ({have / 2**30:,.1f} GiB); use a smaller model.*, shard it (trainer.strategy=fsdp over "
            "more devices), or see mode=plan"
        )


def check_config_match(found: Checkpoint, cfg: DictConfig, key: str) -> None:
    """A checkpoint that records its run's model section must have been trained with this run's (the keys
    the data sets aside)."""
    saved = (found.run_config or {}).get("model")
    if not isinstance(saved, dict):
        return
    ours = OmegaConf.to_container(cfg.model, resolve=True)
    differ = [k for k in _ordered(ours) if k not in _FROM_DATA and k in saved and saved[k] != ours[k]]
    if differ:
        raise ConfigError(trained_with(found, key, differ, saved, ours, cfg))


_FIRST = ("arch", "preset", "num_classes", "num_layers", "model_dim", "num_heads", "z_dim", "value_dim")


def _ordered(values: dict) -> list[str]:
    """The model keys, those that name the model and its size first."""
    return [k for k in _FIRST if k in values] + [k for k in values if k not in _FIRST]


def trained_with(
    found: Checkpoint, key: str, differ: list[str], saved: dict, ours: dict, cfg: DictConfig
) -> str:
    shown = differ[:6]
    more = f" and {len(differ) - len(shown)} more" if len(differ) > len(shown) else ""
    run = found.run_config or {}
    theirs = ", ".join(f"model.{k}={saved[k]}" for k in shown) + more
    mine = ", ".join(f"model.{k}={ours[k]}" for k in shown) + more
    where = ", ".join(f"{k}={run[k]}" for k in ("recipe", "task") if run.get(k) is not None)
    return (
        f"{key}={found.path}: checkpoint was trained with {theirs}"
        + (f" ({where})" if where else "")
        + f"; this run builds {mine} (recipe={cfg.recipe}, task={cfg.task}): use the recipe and model.* it was "
        "trained with"
    )


def check_model(found: Checkpoint, model, model_cfg: Any, cfg: DictConfig, key: str) -> None:
    """The checkpoint holds the model this run builds: every tensor name and shape (checked without loading
    the weights); the message names the config values or the tensors that differ."""
    from mega_suite.storage.checkpoints import strip_prefixes

    ours = {strip_prefixes(k): tuple(v.shape) for k, v in model.state_dict().items()}
    ours = {k: v for k, v in ours.items() if k != "rope.freqs"}
    theirs = {k: v for k, v in found.shapes.items() if k != "rope.freqs"}
    if ours == theirs:
        return
    if found.model:
        mine = {"arch": type(model_cfg).__name__, **dataclasses.asdict(model_cfg)}
        differ = [k for k in _ordered(mine) if k in found.model and k != "arch" and found.model[k] != mine[k]]
        if differ:
            raise ConfigError(trained_with(found, key, differ, found.model, mine, cfg))
    missing, unexpected = sorted(set(ours) - set(theirs)), sorted(set(theirs) - set(ours))
    shapes = [
        f"{k} {theirs[k]} in the checkpoint, {ours[k]} here"
        for k in sorted(set(ours) & set(theirs))
        if ours[k] != theirs[k]
    ]
    parts = []
    if shapes:
        parts.append(
            "shapes differ: "
            + "; ".join(shapes[:4])
            + (f" (and {len(shapes) - 4} more)" if len(shapes) > 4 else "")
        )
    if missing:
        parts.append(f"{len(missing)} tensors of this model are not in it ({', '.join(missing[:3])}, ...)")
    if unexpected:
        parts.append(f"it has {len(unexpected)} tensors this model lacks ({', '.join(unexpected[:3])}, ...)")
    raise ConfigError(
        f"{key}={found.path} holds another model than this run builds (recipe={cfg.recipe}, "
        f"model.preset={cfg.model.preset}): {'; '.join(parts)}"
    )


def check_optimizer(found: Checkpoint, cfg: DictConfig) -> None:
    """Resuming restores the optimizer: its parameter groups must be the ones this run builds."""
    want = 2 if cfg.optim.no_decay_groups else 1
    if found.optimizer_groups is not None and found.optimizer_groups != want:
        raise ConfigError(
            f"resume={found.path}: its optimizer has {found.optimizer_groups} parameter group(s), this run builds "
            f"{want} (optim.no_decay_groups={str(bool(cfg.optim.no_decay_groups)).lower()}): resume with the "
            "value it was trained with, or start from its weights with init_from="
        )


def check_schedule(found: Checkpoint, cfg: DictConfig) -> list[str]:
    """``trainer.max_steps`` sets the learning-rate schedule's length: lowering it on resume would jump the
    rate to another point of a shorter schedule, so it is refused; raising it (training longer) is said."""
    saved = ((found.run_config or {}).get("trainer") or {}).get("max_steps")
    ours = cfg.trainer.max_steps
    if not isinstance(saved, int) or saved == ours:
        return []
    step = found.global_step or 0
    if ours < saved:
        raise ConfigError(
            f"resume: trainer.max_steps={ours} is lower than the {saved} the run was started with; its "
            f"learning-rate schedule spans {saved} steps (step {step} now), and a shorter one would move the rate "
            f"to another point at once. Keep trainer.max_steps={saved} and stop the run when you like (Ctrl-C "
            "saves it), or start a new schedule from its weights with init_from="
        )
    if cfg.optim.schedule == "constant":
        return [f"resume: trainer.max_steps {saved} -> {ours}: training {ours - saved} steps longer"]
    return [
        f"resume: trainer.max_steps {saved} -> {ours}: the {cfg.optim.schedule} schedule is stretched to {ours} "
        f"steps from step {step} on (the learning rate follows the longer schedule); recorded in the resumed "
        "configuration"
    ]
