"""What a careless or unlucky user does to every mode and tool (issue 36): the probe cases, the tiny world they run
in, and a classifier of their outcome.

``python -m bench.user_probe [--repo PATH] [--only SUBSTRING] [--jobs N]`` builds the world once (a tiny ListOps
and KJV run, damaged and planted checkpoints, a user's own files), then runs every case as a real command of the
checkout at ``--repo`` (default: this one) on a fresh copy of it, and prints one row per case: held, or how it
failed. Run it on an older commit (``git worktree add``) and on this one to get a before / after table. The test
suite runs the same cases in-process (``tests/training/test_one_way_in.py``).

A case **holds** when its command does what is right: a refusal exits 2 with one ``error:`` line (naming what it
must) and no traceback, creates nothing and changes nothing of the user's; an accepted command exits 0 and does
what was asked; and in no case does a payload planted in a file run (it creates ``PWNED`` in the world).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pickle
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARKER = (
    "PWNED"  # the folder a planted payload creates when it runs, in the command's working folder (the world)
)
TINY = [
    "model.num_layers=2", "model.model_dim=16", "model.z_dim=8", "model.value_dim=16", "model.ffn_hidden_dim=16",
    "model.chunk_size=32", "trainer.progress_bar=false", "trainer.limit_val_batches=2", "trainer.limit_test_batches=2",
    "trainer.log_every_n_steps=1", "trainer.accelerator=cpu",
]  # fmt: skip
DEBUG = ["recipe=debug", "model.norm_num_groups=4", "data.max_length=128", "data.batch_size=4", *TINY]
KJV = [
    "recipe=kjv", "model.cema_ndim=2", "model.norm_num_groups=4", "data.batch_size=2", "data.options.seq_len=64",
    "optim.warmup_steps=2", *TINY,
]  # fmt: skip


class Payload:
    """Unpickled, it creates the marker folder: stands for any code planted in a file."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


# ---------------------------------------------------------------------------------------------------- the world


def build_world(root: Path, repo: Path | None = None, python: str = sys.executable) -> Path:
    """Everything the cases read. Its runs, bundle and consolidated weights are made by the checkout at
    ``repo`` through its own command line (so that an older checkout is probed on the files it wrote itself),
    or by this one in-process when ``repo`` is None (the test suite's)."""
    import torch
    import torch.distributed.checkpoint as dcp

    from datamodules import KJVDataModule
    from datamodules.listops_generator import generate_listops

    def train(*args: str) -> Path:
        folder = Path(next(a for a in args if a.startswith("run_dir=")).partition("=")[2])
        if repo is None:
            from mega_suite.config import load_config
            from mega_suite.training.runner import run

            run(load_config(list(args)))
        else:
            subprocess.run(
                [python, str(repo / "run.py"), *args], env=_env(repo, root), check=True, capture_output=True
            )
        return folder

    def tool(*args: str) -> None:
        if repo is None:
            from mega_suite.cli import main

            assert main(list(args)) == 0
        else:
            command = [python, "-m", "mega_suite.training.checkpoint", *args]
            subprocess.run(command, env=_env(repo, root), check=True, capture_output=True)

    root.mkdir(parents=True, exist_ok=True)
    generate_listops(root / "listops", 96, 16, 16, seed=0, progress=False)
    KJVDataModule(str(root / "kjv"), batch_size=2, seq_len=64).prepare_data()
    runs = root / "runs"
    fast = ["trainer.max_steps=2", "trainer.val_check_interval=2"]
    debug = {
        "run_dir": train(
            *DEBUG, f"data.data_dir={root / 'listops'}", f"run_dir={runs / 'debug' / 'run1'}", *fast
        )
    }
    kjv = {"run_dir": train(*KJV, f"data.data_dir={root / 'kjv'}", f"run_dir={runs / 'kjv' / 'run1'}", *fast)}
    kjv_last = Path(kjv["run_dir"]) / "checkpoints" / "last.ckpt"

    bad = root / "bad"
    bad.mkdir()
    (bad / "empty.ckpt").write_bytes(b"")
    (bad / "random.ckpt").write_bytes(os.urandom(4096))
    (bad / "truncated.ckpt").write_bytes(kjv_last.read_bytes()[: kjv_last.stat().st_size // 2])
    (bad / "notckpt").mkdir()
    (bad / "notckpt" / "readme.txt").write_text("a folder, not a checkpoint\n")
    tool("consolidate", str(kjv_last), str(bad / "weights.pt"))
    tool("export", str(kjv["run_dir"]), str(root / "bundle"))
    shutil.copytree(root / "bundle", bad / "bundle-truncated")
    weights = bad / "bundle-truncated" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    shutil.copytree(root / "bundle", bad / "bundle-badconfig")
    (bad / "bundle-badconfig" / "config.json").write_text("{ not json")
    (bad / "prompt-empty.txt").write_text("")

    planted = root / "planted"
    marker = MARKER  # relative: every command of a case runs in its copy of the world
    payload = pickle.dumps(Payload(marker))
    # a sharded checkpoint whose .metadata is a payload
    (planted / "sharded-metadata").mkdir(parents=True)
    (planted / "sharded-metadata" / ".metadata").write_bytes(payload)
    # a well-formed sharded checkpoint of the KJV model with a payload among its stored items
    state = torch.load(kjv_last, map_location="cpu", weights_only=True)
    model_state = {k: v for k, v in state["state_dict"].items() if k.startswith("model.")}
    dcp.save(
        {"state_dict": model_state, "extra": Payload(marker)},
        checkpoint_id=str(planted / "sharded-item"),
        no_dist=True,
    )
    # a checkpoint file holding a payload; a sharded folder whose meta.pt does
    torch.save({"state_dict": model_state, "payload": Payload(marker)}, planted / "payload.ckpt")
    shutil.copytree(planted / "sharded-item", planted / "sharded-meta-pt")
    (planted / "sharded-meta-pt" / "__0_0.distcp").write_bytes(b"")  # never reached: meta.pt is read first
    torch.save({"global_step": Payload(marker)}, planted / "sharded-meta-pt" / "meta.pt")
    # a run folder whose last checkpoint is the planted .metadata: resume=auto scans it
    scanned = root / "planted-runs" / "debug" / "20990101-000000"
    shutil.copytree(debug["run_dir"], scanned, ignore=shutil.ignore_patterns(".lock"))
    shutil.rmtree(scanned / "checkpoints")
    (scanned / "checkpoints").mkdir()
    shutil.copytree(planted / "sharded-metadata", scanned / "checkpoints" / "last.ckpt")
    # a bundle whose remote code is a payload (only transformers' trust_remote_code runs it, by design)
    shutil.copytree(root / "bundle", planted / "bundle-code")
    for name in ("modeling_mega_suite.py", "configuration_mega_suite.py"):
        (planted / "bundle-code" / name).write_text(f"import os\nos.mkdir({marker!r})\n")
    # CIFAR-10 python batches, the first a payload
    cifar = planted / "cifar" / "cifar-10-batches-py"
    cifar.mkdir(parents=True)
    for name in [
        "data_batch_1",
        "data_batch_2",
        "data_batch_3",
        "data_batch_4",
        "data_batch_5",
        "test_batch",
    ]:
        (cifar / name).write_bytes(payload)

    user = root / "user"
    (user / "notes").mkdir(parents=True)
    (user / "notes" / "notes.txt").write_text("my notes\n")
    (user / "notes" / "tokenizer.model").write_text("my own tokenizer\n")
    (user / "notes" / "compare.md").write_text("my own comparison\n")
    (user / "existing.pt").write_bytes(b"PK\x03\x04 my own file")
    (user / "my.model").write_text("my own tokenizer file\n")
    (user / "file.txt").write_text("a file\n")
    corpus = root / "corpus"
    corpus.mkdir()
    (corpus / "a.jsonl").write_text(
        "".join(json.dumps({"text": f"document {i} " * 20}) + "\n" for i in range(60))
    )
    # resume=auto's choice: a run named "baseline" with an older checkpoint than a timestamped one
    two = root / "two-runs" / "debug"
    shutil.copytree(debug["run_dir"], two / "20260101-000000", ignore=shutil.ignore_patterns(".lock"))
    shutil.copytree(debug["run_dir"], two / "baseline", ignore=shutil.ignore_patterns(".lock"))
    past = time.time() - 3600
    for ckpt in (two / "baseline" / "checkpoints").iterdir():
        os.utime(ckpt, (past, past))
    # after a Llama comparison on the same recipe: the Llama run is newer than the Megalodon run
    pair = root / "pair-runs" / "kjv"
    shutil.copytree(kjv["run_dir"], pair / "megalodon", ignore=shutil.ignore_patterns(".lock", "eval"))
    for ckpt in (pair / "megalodon" / "checkpoints").iterdir():
        os.utime(ckpt, (past, past))
    train(*KJV, "model.arch=llama", f"data.data_dir={root / 'kjv'}", f"run_dir={pair / 'llama'}", *fast)
    (root / "home").mkdir(exist_ok=True)  # the commands above ran with HOME there (caches)
    (root / "world.json").write_text(json.dumps({"debug": str(debug["run_dir"]), "kjv": str(kjv["run_dir"])}))
    return root


# ---------------------------------------------------------------------------------------------------- the cases


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    group: str  # the class: planted code, checkpoints, plan, run folders, overwriting, paths
    command: Callable[
        [Path], list[str]
    ]  # world -> argv: ["run", ...] for run.py, ["tool", cmd, ...] for a tool
    refuse: bool = True  # exit 2 with one error line; else: exit 0
    says: tuple[str, ...] = ()  # what the error line must name (refusals; "{home}" is the HOME it ran with)
    check: Callable[[Path], str | None] | None = None  # an accepted command's result: None when right


def _run(w: Path, name: str) -> Path:
    """A run of the world (world.json: its path in this copy)."""
    return Path(json.loads((w / "world.json").read_text())[name])


def debug(w: Path, *extra: str) -> list[str]:
    return ["run", *DEBUG, f"data.data_dir={w / 'listops'}", f"run_root={w / 'runs'}", *extra]


def kjv(w: Path, *extra: str) -> list[str]:
    return ["run", *KJV, f"data.data_dir={w / 'kjv'}", f"run_root={w / 'runs'}", *extra]


def generate(w: Path, ckpt, *extra: str) -> list[str]:
    return kjv(w, "mode=generate", f"ckpt={ckpt}", "prompt=In the beginning", "max_new_tokens=2", *extra)


def lm_eval(w: Path, *extra: str) -> list[str]:
    return kjv(
        w, "mode=lm_eval", f"lm_eval.include_path={ROOT / 'corpora/kjv/tasks'}", "lm_eval.limit=2", *extra
    )


def passkey(w: Path, ckpt) -> list[str]:
    return kjv(w, "mode=passkey", f"ckpt={ckpt}", "passkey.lengths=[128]", "passkey.samples=1")


def tool(*args) -> list[str]:
    return ["tool", *map(str, args)]


def _generated(w: Path, run: str, prompt: str) -> str | None:
    found = sorted(_run(w, run).glob("eval/generate-*/generate.json"))
    if not found:
        return "no generate.json in the run's eval/ folder"
    got = json.loads(found[-1].read_text())["prompt"]
    return None if got == prompt else f"the prompt became {got!r}"


def _resumed_newest(w: Path) -> str | None:
    import torch

    steps = {
        p.name: torch.load(p / "checkpoints" / "last.ckpt", weights_only=True)["global_step"]
        for p in (w / "two-runs" / "debug").iterdir()
    }
    return None if steps == {"20260101-000000": 3, "baseline": 2} else f"steps after resume=auto: {steps}"


def _resumed_megalodon(w: Path) -> str | None:
    import torch

    steps = {
        p.name: torch.load(p / "checkpoints" / "last.ckpt", weights_only=True)["global_step"]
        for p in (w / "pair-runs" / "kjv").iterdir()
    }
    return None if steps == {"megalodon": 3, "llama": 2} else f"steps after resume=auto: {steps}"


def _eval_beside(w: Path) -> str | None:
    found = list(_run(w, "debug").glob("eval/test-*/metrics.json"))
    return None if found else "no <run>/eval/test-*/metrics.json"


CASES: list[Case] = [
    # ---- code planted in a file a command reads
    Case("test ckpt=sharded folder, .metadata a payload", "planted code",
         lambda w: debug(w, "mode=test", f"ckpt={w / 'planted/sharded-metadata'}"), says=("ckpt=",)),
    Case("validate ckpt=sharded folder, a stored item a payload", "planted code",
         lambda w: kjv(w, "mode=validate", f"ckpt={w / 'planted/sharded-item'}"), says=("ckpt=",)),
    Case("generate ckpt=sharded .metadata payload", "planted code",
         lambda w: generate(w, w / "planted/sharded-metadata"), says=("ckpt=",)),
    Case("generate ckpt=sharded item payload", "planted code",
         lambda w: generate(w, w / "planted/sharded-item"), says=("ckpt=",)),
    Case("lm_eval ckpt=sharded item payload", "planted code",
         lambda w: lm_eval(w, f"ckpt={w / 'planted/sharded-item'}", "lm_eval.tasks=[kjv_cloze]"), says=("ckpt=",)),
    Case("passkey ckpt=sharded .metadata payload", "planted code",
         lambda w: passkey(w, w / "planted/sharded-metadata"), says=("ckpt=",)),
    Case("eval_context ckpt=sharded item payload", "planted code",
         lambda w: kjv(w, "mode=eval_context", f"ckpt={w / 'planted/sharded-item'}"), says=("ckpt=",)),
    Case("fit init_from=sharded .metadata payload", "planted code",
         lambda w: debug(w, f"init_from={w / 'planted/sharded-metadata'}"), says=("init_from=",)),
    Case("fit resume=sharded item payload", "planted code",
         lambda w: kjv(w, f"resume={w / 'planted/sharded-item'}"), says=("resume=",)),
    Case("fit resume=auto scanning a run whose last.ckpt is planted", "planted code",
         lambda w: debug(w, "resume=auto", f"run_root={w / 'planted-runs'}"), says=("resume=auto",)),
    Case("export of a sharded .metadata payload", "planted code",
         lambda w: tool("export", w / "planted/sharded-metadata", w / "out-bundle"), says=("SOURCE=",)),
    Case("export of a sharded item payload", "planted code",
         lambda w: tool("export", w / "planted/sharded-item", w / "out-bundle"), says=("SOURCE=",)),
    Case("consolidate of a sharded item payload", "planted code",
         lambda w: tool("consolidate", w / "planted/sharded-item", w / "out.pt"), says=("SOURCE=",)),
    Case("consolidate of a sharded .metadata payload", "planted code",
         lambda w: tool("consolidate", w / "planted/sharded-metadata", w / "out.pt"), says=("SOURCE=",)),
    Case("test ckpt=a checkpoint file holding a payload", "planted code",
         lambda w: kjv(w, "mode=test", f"ckpt={w / 'planted/payload.ckpt'}"), says=("ckpt=",)),
    Case("test ckpt=sharded folder, meta.pt a payload", "planted code",
         lambda w: kjv(w, "mode=test", f"ckpt={w / 'planted/sharded-meta-pt'}"), says=("ckpt=",)),
    Case("lra_image with a CIFAR batch that is a payload", "planted code",
         lambda w: ["run", "recipe=lra_image", f"data.data_dir={w / 'planted/cifar'}", f"run_root={w / 'runs'}",
                    "trainer.max_steps=1", "trainer.accelerator=cpu"], says=("data_batch_1",)),
    Case("generate from a bundle whose remote code is a payload", "planted code",
         lambda w: generate(w, w / "planted/bundle-code"), refuse=False),
    # ---- checkpoints: one reader, one rule, for every mode and tool
    *[Case(f"{mode} ckpt={what}", "checkpoints", (lambda m, f: lambda w: (
        generate(w, w / f"bad/{f}") if m == "generate" else passkey(w, w / f"bad/{f}") if m == "passkey"
        else lm_eval(w, f"ckpt={w / f'bad/{f}'}", "lm_eval.tasks=[kjv_cloze]")))(mode, file), says=("ckpt=", why))
      for mode in ("generate", "lm_eval", "passkey")
      for what, file, why in (("an empty file", "empty.ckpt", "empty"), ("random bytes", "random.ckpt", "not a torch file"),
                              ("a truncated file", "truncated.ckpt", "truncated"), ("a missing file", "gone.ckpt", "no such"))],
    Case("generate ckpt=a folder that is no checkpoint", "checkpoints",
         lambda w: generate(w, w / "bad/notckpt"), says=("ckpt=", "not a checkpoint")),
    Case("generate ckpt=a bundle with truncated safetensors", "checkpoints",
         lambda w: generate(w, w / "bad/bundle-truncated"), says=("ckpt=", "bundle")),
    Case("generate ckpt=a bundle whose config.json is not JSON", "checkpoints",
         lambda w: generate(w, w / "bad/bundle-badconfig"), says=("ckpt=", "config.json")),
    Case("lm_eval ckpt=a bundle with truncated safetensors", "checkpoints",
         lambda w: lm_eval(w, f"ckpt={w / 'bad/bundle-truncated'}", "lm_eval.tasks=[kjv_cloze]"), says=("ckpt=",)),
    Case("test ckpt=a bundle with truncated safetensors", "checkpoints",
         lambda w: kjv(w, "mode=test", f"ckpt={w / 'bad/bundle-truncated'}"), says=("ckpt=",)),
    Case("lm_eval.checkpoints=[a truncated file]", "checkpoints",
         lambda w: lm_eval(w, f"lm_eval.checkpoints=[{w / 'bad/truncated.ckpt'}]", "lm_eval.tasks=[kjv_cloze]"),
         says=("lm_eval.checkpoints=", "truncated")),
    Case("consolidate a missing source", "checkpoints",
         lambda w: tool("consolidate", w / "bad/gone", w / "out.pt"), says=("no such",)),
    Case("consolidate random bytes", "checkpoints",
         lambda w: tool("consolidate", w / "bad/random.ckpt", w / "out.pt"), says=("not a torch file",)),
    Case("consolidate a truncated file", "checkpoints",
         lambda w: tool("consolidate", w / "bad/truncated.ckpt", w / "out.pt"), says=("truncated",)),
    Case("consolidate a folder that is no checkpoint", "checkpoints",
         lambda w: tool("consolidate", w / "bad/notckpt", w / "out.pt"), says=("not a checkpoint",)),
    Case("export a truncated file", "checkpoints",
         lambda w: tool("export", w / "bad/truncated.ckpt", w / "out-bundle"), says=("truncated",)),
    Case("export a missing source", "checkpoints",
         lambda w: tool("export", w / "bad/gone", w / "out-bundle"), says=("no such",)),
    Case("fit init_from=random bytes", "checkpoints",
         lambda w: debug(w, f"init_from={w / 'bad/random.ckpt'}"), says=("init_from=", "not a torch file")),
    Case("test ckpt=a run folder (as generate takes one)", "checkpoints",
         lambda w: debug(w, "mode=test", f"ckpt={_run(w, 'debug')}"), refuse=False, check=_eval_beside),
    Case("validate ckpt=a run's checkpoints/ folder", "checkpoints",
         lambda w: debug(w, "mode=validate", f"ckpt={_run(w, 'debug') / 'checkpoints'}"), refuse=False),
    # ---- the run plan: everything checked before anything is created
    Case("data.options.seq_len=abc", "plan", lambda w: kjv(w, "data.options.seq_len=abc"), says=("data.options.seq_len",)),
    Case("data.options.seq_len=[1,2]", "plan", lambda w: kjv(w, "data.options.seq_len=[1,2]"), says=("data.options.seq_len",)),
    Case("data.options.seq_len=-5", "plan", lambda w: kjv(w, "data.options.seq_len=-5"), says=("data.options.seq_len",)),
    Case("data.options.seq_len=1.5", "plan", lambda w: kjv(w, "data.options.seq_len=1.5"), says=("data.options.seq_len",)),
    Case("data.options.split_seed=-1 (pretrain option on kjv)", "plan",
         lambda w: kjv(w, "data.options.split_seed=-1"), says=("data.options",)),
    Case("data.options.spm_model_type=wordpiece", "plan",
         lambda w: kjv(w, "data.options.spm_model_type=wordpiece"), says=("data.options.spm_model_type",)),
    Case("data.options.generate_sizes=[1,2]", "plan",
         lambda w: debug(w, "data.options.generate_sizes=[1,2]"), says=("data.options.generate_sizes",)),
    Case("data.options.bucket_batches=yes", "plan",
         lambda w: debug(w, "data.options.bucket_batches=yes"), says=("data.options.bucket_batches",)),
    Case("an unset environment variable in an override", "plan",
         lambda w: debug(w, "trainer.max_steps=${oc.env:MEGA_PROBE_UNSET}"), says=("trainer.max_steps",)),
    Case("an interpolation of a missing key", "plan",
         lambda w: debug(w, "trainer.max_steps=${nowhere.steps}"), says=("trainer.max_steps",)),
    Case("a YAML tag that fails (!!int abc)", "plan", lambda w: debug(w, "trainer.max_steps=!!int abc"), says=("trainer.max_steps",)),
    Case("trainer.max_steps past int64", "plan", lambda w: debug(w, "trainer.max_steps=9223372036854775808"), says=("trainer.max_steps",)),
    Case("trainer.max_steps = 10^20", "plan", lambda w: debug(w, "trainer.max_steps=100000000000000000000"), says=("trainer.max_steps",)),
    Case("data.batch_size = 3e9", "plan", lambda w: debug(w, "data.batch_size=3000000000"), says=("data.batch_size",)),
    Case("eval_context_lengths under mode=fit", "plan", lambda w: kjv(w, "eval_context_lengths=[512]"), says=("eval_context_lengths",)),
    Case("eval_max_documents under mode=test", "plan",
         lambda w: kjv(w, "mode=test", f"ckpt={_run(w, 'kjv')}", "eval_max_documents=3"), says=("eval_max_documents",)),
    Case("lm_eval.limit=1.5", "plan",
         lambda w: lm_eval(w, f"ckpt={_run(w, 'kjv')}", "lm_eval.tasks=[kjv_cloze]", "lm_eval.limit=1.5"), says=("lm_eval.limit",)),
    Case("lm_eval.limit=0", "plan",
         lambda w: lm_eval(w, f"ckpt={_run(w, 'kjv')}", "lm_eval.tasks=[kjv_cloze]", "lm_eval.limit=0"), says=("lm_eval.limit",)),
    Case("a model too large to allocate", "plan",
         lambda w: debug(w, "model.model_dim=65536", "model.ffn_hidden_dim=262144", "model.value_dim=131072",
                         "model.num_layers=64"), says=("parameters",)),
    Case("recipe=../../etc/passwd", "plan", lambda w: ["run", "recipe=../../etc/passwd", f"run_root={w / 'runs'}"], says=("recipe=",)),
    Case("recipe=../recipes/kjv (climbing out of recipes/)", "plan",
         lambda w: ["run", "recipe=../recipes/kjv", f"run_root={w / 'runs'}"], says=("recipe=",)),
    Case("recipe=a missing .yaml file", "plan", lambda w: ["run", f"recipe={w / 'mine.yaml'}"], says=("recipe=",)),
    Case("temperature=abc", "plan", lambda w: generate(w, _run(w, "kjv"), "temperature=abc"), says=("temperature",)),
    Case("max_new_tokens=0", "plan", lambda w: generate(w, _run(w, "kjv"), "max_new_tokens=0"), says=("max_new_tokens",)),
    Case("prompt_file= a missing file", "plan",
         lambda w: kjv(w, "mode=generate", f"ckpt={_run(w, 'kjv')}", f"prompt_file={w / 'nope.txt'}"), says=("prompt_file=",)),
    Case("prompt_file= a folder", "plan",
         lambda w: kjv(w, "mode=generate", f"ckpt={_run(w, 'kjv')}", f"prompt_file={w / 'user'}"), says=("prompt_file=",)),
    Case("prompt_file= an empty file", "plan",
         lambda w: kjv(w, "mode=generate", f"ckpt={_run(w, 'kjv')}", f"prompt_file={w / 'bad/prompt-empty.txt'}"), says=("prompt_file=",)),
    Case("tokenizer= a missing file", "plan",
         lambda w: generate(w, _run(w, "kjv"), f"tokenizer={w / 'nope.model'}"), says=("tokenizer=",)),
    Case("tokenizer= a text file", "plan",
         lambda w: generate(w, _run(w, "kjv"), f"tokenizer={w / 'user/file.txt'}"), says=("tokenizer=",)),
    Case("passkey.haystack= a missing file", "plan",
         lambda w: kjv(w, "mode=passkey", f"ckpt={_run(w, 'kjv')}", f"passkey.haystack={w / 'nope.txt'}"), says=("passkey.haystack",)),
    Case("lm_eval.include_path= a missing folder", "plan",
         lambda w: kjv(w, "mode=lm_eval", f"ckpt={_run(w, 'kjv')}", "lm_eval.tasks=[x]", f"lm_eval.include_path={w / 'nope'}"),
         says=("lm_eval.include_path",)),
    Case("lm_eval.tasks= an unknown local task", "plan",
         lambda w: lm_eval(w, f"ckpt={_run(w, 'kjv')}", "lm_eval.tasks=kjv_clozee"), says=("kjv_clozee",)),
    Case("resume=auto under mode=generate", "plan",
         lambda w: generate(w, _run(w, "kjv"), "resume=auto"), says=("resume=auto",)),
    Case("resume=auto under mode=eval_context", "plan",
         lambda w: kjv(w, "mode=eval_context", "resume=auto"), says=("resume=auto",)),
    Case("trainer.devices=[0,0]", "plan", lambda w: debug(w, "trainer.devices=[0,0]"), says=("trainer.devices",)),
    Case("data.data_dir=~/missing is named expanded", "plan",
         lambda w: ["run", "recipe=lra_text", "data.data_dir=~/mega-probe-missing", f"run_root={w / 'runs'}"],
         says=("{home}/mega-probe-missing",)),
    Case('prompt="Note: yes" is taken verbatim', "plan",
         lambda w: generate(w, _run(w, "kjv"), "prompt=Note: yes"), refuse=False, check=lambda w: _generated(w, "kjv", "Note: yes")),
    Case("prompt=yes stays the word yes", "plan",
         lambda w: generate(w, _run(w, "kjv"), "prompt=yes"), refuse=False, check=lambda w: _generated(w, "kjv", "yes")),
    Case("prompt=[a, ${b}] stays that text", "plan",
         lambda w: generate(w, _run(w, "kjv"), "prompt=[a, ${b}]"), refuse=False,
         check=lambda w: _generated(w, "kjv", "[a, ${b}]")),
    Case("lm_eval.tasks=kjv_cloze (one name, no brackets)", "plan",
         lambda w: lm_eval(w, f"ckpt={_run(w, 'kjv')}", "lm_eval.tasks=kjv_cloze"), refuse=False),
    # ---- run folders: one writer
    Case("run_dir= a folder of the user's files", "run folders",
         lambda w: debug(w, f"run_dir={w / 'user/notes'}"), says=("run_dir=",)),
    Case("run_dir= another run's checkpoints/ folder", "run folders",
         lambda w: debug(w, f"run_dir={_run(w, 'debug') / 'checkpoints'}"), says=("run_dir=",)),
    Case("run_dir= a file", "run folders", lambda w: debug(w, f"run_dir={w / 'user/file.txt'}"), says=("run_dir=",)),
    Case("run_dir= inside another run", "run folders",
         lambda w: debug(w, f"run_dir={_run(w, 'debug') / 'sub'}"), says=("run_dir=",)),
    Case("generate run_dir= a folder of the user's files", "run folders",
         lambda w: generate(w, _run(w, "kjv"), f"run_dir={w / 'user/notes'}"), says=("run_dir=",)),
    Case("resume=auto while another process holds the run", "run folders",
         lambda w: debug(w, "resume=auto", f"run_dir={_run(w, 'debug')}", "trainer.max_steps=3"), says=("in use",)),
    Case("resume=auto lowering trainer.max_steps", "run folders",
         lambda w: debug(w, "resume=auto", f"run_dir={_run(w, 'debug')}", "trainer.max_steps=1"), says=("trainer.max_steps",)),
    Case("resume=auto takes the run with the newest checkpoint, not the last name", "run folders",
         lambda w: debug(w, "resume=auto", f"run_root={w / 'two-runs'}", "trainer.max_steps=3"), refuse=False,
         check=_resumed_newest),
    Case("resume=auto after a Llama comparison continues the Megalodon run", "run folders",
         lambda w: kjv(w, "resume=auto", f"run_root={w / 'pair-runs'}", "trainer.max_steps=3"), refuse=False,
         check=_resumed_megalodon),
    Case("a refused generate leaves no folder (unknown key)", "run folders",
         lambda w: generate(w, _run(w, "kjv"), "top_kk=3"), says=("top_kk",)),
    Case("a refused lm_eval leaves no folder (unknown task)", "run folders",
         lambda w: lm_eval(w, f"ckpt={_run(w, 'kjv')}", "lm_eval.tasks=[no_such_task_here]"), says=("no_such_task_here",)),
    Case("a refused passkey leaves no folder (bad lengths)", "run folders",
         lambda w: kjv(w, "mode=passkey", f"ckpt={_run(w, 'kjv')}", "passkey.lengths=[8]"), says=("passkey.lengths",)),
    Case("mode=test resume=auto evaluates into <run>/eval", "run folders",
         lambda w: debug(w, "mode=test", "resume=auto"), refuse=False, check=_eval_beside),
    # ---- nothing of the user's is overwritten
    Case("export OUT= a folder of the user's files", "overwriting",
         lambda w: tool("export", _run(w, "kjv"), w / "user/notes"), says=("OUT=",)),
    Case("export OUT= inside a run", "overwriting",
         lambda w: tool("export", _run(w, "kjv"), _run(w, "kjv") / "exported"), says=("OUT=",)),
    Case("export OUT= an existing bundle, no --overwrite", "overwriting",
         lambda w: tool("export", _run(w, "kjv"), w / "bundle"), says=("OUT=",)),
    Case("consolidate OUT= the user's file", "overwriting",
         lambda w: tool("consolidate", _run(w, "kjv"), w / "user/existing.pt"), says=("OUT=",)),
    Case("consolidate OUT= a folder", "overwriting",
         lambda w: tool("consolidate", _run(w, "kjv"), w / "user/notes"), says=("OUT=",)),
    Case("tokenizer --out the user's file", "overwriting",
         lambda w: tool("tokenizer", w / "corpus", "--vocab-size", "40", "--val-fraction", "0.2", "--out", w / "user/my.model"),
         says=("--out",)),
    Case("compare --out over the user's compare.md", "overwriting",
         lambda w: tool("compare", _run(w, "debug"), "--out", w / "user/notes"), says=("compare.md",)),
    Case("one ListOps split missing: the others are kept", "overwriting",
         lambda w: (os.remove(w / "listops/listops-1000/basic_test.tsv"), debug(w))[1], says=("basic_test.tsv",)),
    # ---- paths
    Case("run_root=~/... is the home folder", "paths",
         lambda w: debug(w, "run_root=~/probe-runs", "trainer.max_steps=1", "trainer.val_check_interval=1"), refuse=False,
         check=lambda w: None if list((w / "home/probe-runs/debug").glob("*/checkpoints/last.ckpt")) else "no run under ~/probe-runs"),
    Case("a recipe given by path runs under run_root/<its name>", "paths",
         lambda w: (shutil.copyfile(ROOT / "recipes/debug.yaml", w / "mine.yaml"),
                    ["run", f"recipe={w / 'mine.yaml'}", *DEBUG[1:], f"data.data_dir={w / 'listops'}", f"run_root={w / 'runs'}",
                     "trainer.max_steps=1", "trainer.val_check_interval=1"])[1], refuse=False,
         check=lambda w: None if list((w / "runs/mine").glob("*/checkpoints/last.ckpt")) else "no run under run_root/mine"),
]  # fmt: skip


# ---------------------------------------------------------------------------------------------------- running


def command_line(argv: list[str], repo: Path, python: str) -> list[str]:
    """A case's argv as a real command of the checkout at ``repo`` (names that exist before and after issue 36)."""
    if argv[0] == "run":
        return [python, str(repo / "run.py"), *argv[1:]]
    module = {
        "export": "mega_suite.training.checkpoint", "consolidate": "mega_suite.training.checkpoint",
        "compare": "mega_suite.evaluation.compare", "tokenizer": "mega_suite.tools.tokenizer",
    }[argv[1]]  # fmt: skip
    rest = argv[2:] if argv[1] in ("compare", "tokenizer") else argv[1:]
    return [python, "-m", module, *rest]


def snapshot(root: Path) -> dict[str, tuple]:
    """Every file and folder of a world: (is a folder, size, modification time). Left out: locks, and what
    libraries cache in the home folder (matplotlib's font list, the lm-eval task index)."""
    out = {}
    for p in root.rglob("*"):
        rel = p.relative_to(root)
        if (
            p.name == ".lock"
            or "__pycache__" in p.parts
            or (rel.parts[0] == "home" and len(rel.parts) > 1 and rel.parts[1].startswith("."))
        ):
            continue
        st = p.lstat()
        out[str(rel)] = (p.is_dir(), 0 if p.is_dir() else st.st_size, st.st_mtime_ns)
    return out


def classify(case: Case, code: int, out: str, err: str, world: Path, before: dict) -> str:
    """The case's outcome in words ("held" when right)."""
    if (world / MARKER).exists():
        return "ran planted code"
    after = snapshot(world)
    changed = [k for k, v in before.items() if k in after and after[k] != v and not v[0]]
    removed = [k for k in before if k not in after and not k.startswith(("two-runs", "pair-runs", "listops"))]
    if case.refuse:
        if changed or removed:
            return f"changed or removed the user's files ({', '.join((changed + removed)[:3])})"
    if "Traceback" in out + err:
        return "traceback"
    if not case.refuse:
        if code != 0:
            return f"refused a valid command (exit {code})"
        problem = case.check(world) if case.check else None
        return "held" if problem is None else f"wrong result: {problem}"
    if code == 0:
        return "did the wrong thing, exit 0"
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    if code != 2 or len(lines) != 1:
        return f"exit {code}, {len(lines)} error lines"
    if any(name.format(home=world / "home") not in lines[0] for name in case.says):
        return "an error line that does not name the cause"
    created = [k for k in after if k not in before]
    if created:
        return f"refused, but left files or folders ({', '.join(created[:3])})"
    return "held"


def run_case(
    case: Case, built: Path, scratch: Path, repo: Path, python: str, timeout: int
) -> tuple[str, str]:
    world = scratch / f"w{abs(hash(case.name)) % 10**8}"
    shutil.copytree(built, world, symlinks=True)
    (world / "world.json").write_text((world / "world.json").read_text().replace(str(built), str(world)))
    argv = case.command(world)
    before = snapshot(world)
    env = _env(repo, world)
    holder = None
    if "another process holds" in case.name:  # a resumed run of the same folder in progress: its lock held
        holder = hold_lock(_run(world, "debug"))
    try:
        proc = subprocess.run(command_line(argv, repo, python), cwd=world, env=env, capture_output=True, text=True,
                              timeout=timeout)  # fmt: skip
        outcome = classify(case, proc.returncode, proc.stdout, proc.stderr, world, before)
        last = (proc.stderr.strip().splitlines() or [""])[-1][:160]
    except subprocess.TimeoutExpired:
        outcome, last = f"no answer in {timeout} s", ""
    finally:
        if holder is not None:
            holder.close()
        shutil.rmtree(world, ignore_errors=True)
    return outcome, last


def _env(repo: Path, world: Path) -> dict[str, str]:
    env = dict(os.environ, HOME=str(world / "home"), HF_HUB_OFFLINE="1", MEGA_MALLOC="system", PYTHONUNBUFFERED="1",
               PYTHONPATH=str(repo))  # fmt: skip
    env.pop("MEGA_SUITE_RUN", None)
    return env


def hold_lock(folder: Path):
    import fcntl

    handle = open(folder / ".lock", "a+")  # noqa: SIM115
    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    handle.write(f"pid {os.getpid()} (the probe)\n")
    handle.flush()
    return handle


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.user_probe", description=__doc__.split("\n\n")[0])
    p.add_argument("--repo", default=str(ROOT), help="the checkout whose commands run (default: this one)")
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--only", default="", help="cases whose name contains this")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--timeout", type=int, default=300)
    p.add_argument("--world", default=None, help="a world built before (else built by --repo's commands)")
    p.add_argument("--json", default=None, help="also write the outcomes here")
    a = p.parse_args(argv)
    import tempfile

    scratch = Path(tempfile.mkdtemp(prefix="user-probe-"))
    built = Path(a.world) if a.world else build_world(scratch / "world", Path(a.repo), a.python)
    cases = [c for c in CASES if a.only in c.name]
    start = time.time()
    with ThreadPoolExecutor(a.jobs) as pool:
        results = list(
            pool.map(lambda c: run_case(c, built, scratch, Path(a.repo), a.python, a.timeout), cases)
        )
    print("| case | class | outcome | last line |\n|---|---|---|---|")
    for case, (outcome, last) in zip(cases, results):
        print(f"| {case.name} | {case.group} | {outcome} | {last.replace('|', '/')} |")
    held = sum(o == "held" for o, _ in results)
    print(f"\n{held} of {len(cases)} held ({a.repo}, {time.time() - start:.0f} s)")
    if a.json:
        Path(a.json).write_text(json.dumps({c.name: o for c, (o, _) in zip(cases, results)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
