"""mega-suite entry point: ``python run.py recipe=NAME key=value ...``.

python run.py                      # list the recipes
python run.py recipe=lra_listops   # train (mode=fit), logs and checkpoints under runs/lra_listops/<time>/
python run.py recipe=lra_listops resume=auto            # continue the latest run of that recipe
python run.py recipe=lra_listops mode=test ckpt=PATH    # evaluate a checkpoint

On Linux the process first restarts itself with tcmalloc preloaded where it is installed (leaner
than glibc's malloc for training on the CPU; ``mega_suite.tools.malloc``); ``MEGA_MALLOC=system`` keeps glibc's.
"""

from __future__ import annotations

import os
import sys


def one_line(exc: BaseException) -> str:
    """The message of a user-caused error on one line. An error raised in a DataLoader worker arrives as
    ``Caught X in DataLoader worker process N.\nOriginal Traceback ...\nmodule.X: message``: keep the message."""
    text = str(exc)
    marker = f"{type(exc).__name__}: "
    if text.startswith("Caught ") and "\nOriginal Traceback" in text and marker in text:
        text = text[text.rindex(marker) + len(marker) :]
    return " ".join(text.split())


def main(argv: list[str]) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from mega_suite.config import ConfigError, list_recipes, load_config

    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return 0
    if not any(a.startswith("recipe=") for a in argv) or "recipe=list" in argv:
        print("recipes (python run.py recipe=NAME [key=value ...]):")
        for name, description in list_recipes().items():
            print(f"  {name:24s} {description}")
        return 0
    from datamodules import DataError
    from mega_suite.training.errors import CheckpointSaveError, NonFiniteLossError

    try:
        cfg = load_config(argv)
        if cfg.mode == "plan":
            from mega_suite.tools.plan import plan

            print(plan(cfg))
            return 0
        from mega_suite.training.runner import run

        try:
            metrics = run(cfg)
        except NonFiniteLossError:  # the runner printed it, with the checkpoint kept (if any)
            return 3
    except (ConfigError, DataError, FileNotFoundError, CheckpointSaveError) as exc:
        # Lightning re-raises the original exception from fit/validate/test (after its own teardown).
        print(f"error: {one_line(exc)}", file=sys.stderr)
        return 2
    from lightning.pytorch.utilities import rank_zero_only

    if rank_zero_only.rank == 0:  # every rank returns here; their lines would interleave in a shared pipe
        sys.stdout.write(f"[mega-suite] done: {dict(metrics)}\n")  # one write
        sys.stdout.flush()
    return 0


def start() -> int:
    """The command line's entry: the allocator first (``mega_suite.tools.malloc``: may restart the process with
    tcmalloc preloaded; imports no torch), then ``main``."""
    from mega_suite.tools import malloc

    try:
        note = malloc.reexec(__file__)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if note and all(os.environ.get(k, "0") == "0" for k in ("RANK", "LOCAL_RANK", "SLURM_PROCID")):
        print(f"[mega-suite] {note}", file=sys.stderr, flush=True)
    return main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(start())
