"""mega-suite entry point: ``python run.py recipe=NAME key=value ...``.

python run.py                      # list the recipes
python run.py recipe=lra_listops   # train (mode=fit), logs and checkpoints under runs/lra_listops/<time>/
python run.py recipe=lra_listops resume=auto            # continue the latest run of that recipe
python run.py recipe=lra_listops mode=test ckpt=PATH    # evaluate a checkpoint (into PATH's run, eval/)
python run.py recipe=lra_listops mode=plan              # memory per GPU, nothing allocated

Any key is overridable (docs/configuration.md); the tools (export, consolidate, compare, tokenizer) are
``mega-suite --help``. A mistake is one ``error:`` line and exit code 2, reported before anything is created.

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


def summary(metrics: dict) -> str:
    """The final metrics as a person reads them: ``name value`` pairs, four significant digits."""
    folder = metrics.get("run_dir")
    values = [
        f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
        for k, v in sorted(metrics.items())
        if k != "run_dir"
    ]
    return "done" + (f": {', '.join(values)}" if values else "") + (f" (in {folder})" if folder else "")


def main(argv: list[str]) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return 0
    from mega_suite.config import list_recipes, load_config  # no torch: errors come at once

    if not any(a.startswith("recipe=") for a in argv) or "recipe=list" in argv:
        print("recipes (python run.py recipe=NAME [key=value ...]):")
        for name, description in list_recipes().items():
            print(f"  {name:24s} {description}")
        return 0
    from datamodules.errors import DataError
    from mega_suite.cli import Interrupted, signals_as_exceptions
    from mega_suite.errors import UserError
    from mega_suite.training.errors import CheckpointSaveError, NonFiniteLossError

    try:
        with signals_as_exceptions():
            cfg = load_config(argv)
            from mega_suite.config.run_plan import make_plan

            plan = make_plan(cfg)  # every file and folder checked; nothing created
            if cfg.mode == "plan":
                from mega_suite.tools.plan import plan_table

                print(plan_table(plan))
                return 0
            from mega_suite.training.runner import run

            try:
                metrics = run(plan)
            except NonFiniteLossError:  # the runner printed it, with the checkpoint kept (if any)
                return 3
    except (UserError, DataError, FileNotFoundError, CheckpointSaveError) as exc:
        # Lightning re-raises the original exception from fit/validate/test (after its own teardown).
        print(f"error: {one_line(exc)}", file=sys.stderr)
        return 2
    except (KeyboardInterrupt, Interrupted) as exc:  # outside training (data preparation, loading, scoring)
        reason = "SIGINT" if isinstance(exc, KeyboardInterrupt) else str(exc)
        print(f"error: stopped by {reason}; partial files were removed", file=sys.stderr)
        return 130
    from lightning.pytorch.utilities import rank_zero_only

    if rank_zero_only.rank == 0:  # every rank returns here; their lines would interleave in a shared pipe
        sys.stdout.write(f"[mega-suite] {summary(metrics)}\n")  # one write
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
