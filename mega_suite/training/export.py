"""``python -m mega_suite.training.checkpoint export RUN_DIR|CKPT OUT_DIR [--dtype bf16]`` (and ``consolidate``; the
command line of ``checkpoint.py`` is here, above the trained-model loader it uses): a run's weights
(a Lightning checkpoint, a sharded FSDP2 directory or a consolidated state dict) as a shareable bundle
(``mega_suite.models.bundle``: safetensors, config.json, the tokenizer, the transformers wrapper;
docs/after_training.md#shareable-weights).

The model is rebuilt from the run's ``config.yaml`` (beside ``checkpoints/``) with the vocabulary of the
weights and loaded strictly, so a bundle always holds a model that loads; the tokenizer is the run
directory's copy, else its data's."""

from __future__ import annotations

from pathlib import Path

import torch
from omegaconf import OmegaConf

from mega_suite.config import ConfigError
from mega_suite.config.schema import RunConfig
from mega_suite.models.bundle import DTYPES, BundleError, is_bundle, save_bundle
from mega_suite.training.checkpoint import consolidate
from mega_suite.training.trained import checkpoint_path, load_trained, run_config_of, run_dir_of


def export(
    source: str | Path, out_dir: str | Path, dtype: str | None = None, max_shard_size: str = "5GB"
) -> Path:
    """Write the bundle of ``source`` (a run directory, a checkpoint or a bundle) into ``out_dir``."""
    if dtype is not None and dtype not in DTYPES:
        raise BundleError(f"--dtype {dtype}: expected one of {sorted(DTYPES)}")
    path = checkpoint_path(source)
    if is_bundle(path):  # re-export (another dtype or shard size): the bundle carries its configuration
        cfg = OmegaConf.structured(RunConfig)
    else:
        run_dir = run_dir_of(path)
        if run_dir is None:
            raise BundleError(
                f"{path}: no config.yaml beside its checkpoints/ folder, so the model's configuration is unknown; "
                "export from the run directory that wrote it"
            )
        cfg, _ = run_config_of(run_dir, None)
        if cfg is None:
            raise BundleError(f"{run_dir / 'config.yaml'} cannot be read as a run configuration")
    OmegaConf.set_readonly(cfg, False)
    cfg.trainer.accelerator = "cpu"
    cfg.tokenizer = None
    trained = load_trained(cfg, path)
    tok = trained.tokenizer
    extra = {"bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id, "source_checkpoint": str(trained.source)}
    if trained.step is not None:
        extra["step"] = trained.step
    if trained.tokens is not None:
        extra["training_tokens"] = trained.tokens
    return save_bundle(
        trained.model, out_dir, tokenizer=tok.path, dtype=DTYPES[dtype] if dtype else None,
        max_shard_size=max_shard_size, extra=extra,
    )  # fmt: skip


def export_command(args) -> int:
    import sys

    try:
        out = export(args.source, args.out, args.dtype, args.max_shard_size)
    except (BundleError, ConfigError, FileNotFoundError, ValueError) as exc:
        print(f"error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    files = sorted(p.name for p in out.iterdir())
    print(f"wrote {out}: {', '.join(files)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m mega_suite.training.checkpoint")
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("consolidate", help="a run's (sharded) checkpoint -> one reference-format .pt file")
    c.add_argument("source", help="run directory (uses checkpoints/last.ckpt) or checkpoint path")
    c.add_argument("out", help="output .pt file")
    e = sub.add_parser(
        "export", help="a run's (sharded) checkpoint -> a safetensors bundle (docs/after_training.md)"
    )
    e.add_argument("source", help="run directory (uses checkpoints/last.ckpt), checkpoint or bundle")
    e.add_argument("out", help="output folder: model.safetensors, config.json, the tokenizer")
    e.add_argument(
        "--dtype", default=None, help="parameters' dtype in the files: bf16, fp16, fp32 (default: as saved)"
    )
    e.add_argument(
        "--max-shard-size", default="5GB", help="split model.safetensors above this size (default 5GB)"
    )
    args = parser.parse_args(argv)
    if args.command == "export":
        return export_command(args)
    out = consolidate(args.source, args.out)
    print(f"wrote {out} ({len(torch.load(out, weights_only=True))} tensors)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
