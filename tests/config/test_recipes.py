"""Every recipe trains two steps and validates on a tiny copy of its data set in the real layout.

The recipes' data pipelines, tasks and model flags (bidirectional/causal, input encoder, adaptive softmax,
tied/scaled embeddings, SwiGLU, retrieval) are the real ones; only the widths are shrunk so the whole file
runs in about a minute on two cores.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from lra_fixtures import write_pathfinder
from modality_fixtures import (
    train_sentencepiece,
    write_image_folder,
    write_jsonl_corpus,
    write_pg19,
    write_speech_commands,
    write_wikitext,
)

from mega_suite.config import list_recipes, load_config
from mega_suite.training.runner import run

SMALL = [
    "model.num_layers=1",
    "model.model_dim=16",
    "model.z_dim=8",
    "model.value_dim=16",
    "model.ffn_hidden_dim=16",
    "model.norm_num_groups=4",
    "model.cema_ndim=4",
    "data.batch_size=2",
    "data.num_workers=0",
    "trainer.max_steps=2",
    "trainer.val_check_interval=2",
    "trainer.limit_val_batches=2",
    "trainer.limit_test_batches=2",
    "trainer.log_every_n_steps=1",
    "trainer.progress_bar=false",
    "trainer.precision=32-true",
    "trainer.strategy=auto",
    "trainer.devices=1",
    "trainer.accelerator=cpu",
    "trainer.global_batch_tokens=0",
    "trainer.gradient_checkpointing=false",
]


@pytest.fixture(scope="module")
def data_root(tmp_path_factory, lra) -> Path:
    root = tmp_path_factory.mktemp("recipes")
    write_speech_commands(root)
    write_image_folder(root / "imagenet")
    write_wikitext(root)
    write_pg19(root)
    docs = write_jsonl_corpus(root / "corpus")
    train_sentencepiece(root / "spm.model", docs)
    write_pathfinder(root / "pathx", 128, per_file=10, n_files=2)  # enough images for a 10% val split
    return root


def overrides_for(recipe: str, lra_dir: Path, root: Path) -> list[str]:
    data = load_config([f"recipe={recipe}"]).data.name
    if data in ("listops", "lra_text", "lra_retrieval", "lra_image", "lra_pathfinder", "lra_pathx"):
        extra = [f"data.data_dir={lra_dir}", "model.chunk_size=64"]
        if data in ("listops", "lra_text", "lra_retrieval"):
            extra.append("data.max_length=256")
        if data == "lra_image":
            extra.append("data.options.val_size=5")
        if data == "lra_pathx":
            extra[0] = f"data.data_dir={root / 'pathx'}"
        return extra
    if data == "sc_raw":
        return [f"data.data_dir={root}", "model.chunk_size=1000"]
    if data == "imagenet":
        return [
            f"data.data_dir={root / 'imagenet'}",
            "data.options.num_classes=3",
            "data.options.image_size=32",
            "model.image_size=32",
            "model.chunk_size=4",
            "model.model_dim=16",
        ]
    if data == "wt103":
        return [
            f"data.data_dir={root}",
            "data.options.seq_len=64",
            "data.options.chunk_size=32",
            "data.options.min_chunks=1",
            "data.options.max_chunks=2",
            "data.options.eval_seq_len=64",
            "model.chunk_size=32",
            "model.adaptive_cutoffs=[5,15]",
        ]
    if data == "pg19":
        return [
            f"data.data_dir={root}",
            "data.options.seq_len=64",
            "data.options.vocab_size=300",
            "data.options.eval_seq_len=64",
            "model.chunk_size=32",
        ]
    if data == "kjv":  # the committed corpus, unpacked into an empty folder as on a fresh clone
        return [
            f"data.data_dir={root / 'fresh_clone'}",
            "data.options.seq_len=64",
            "data.options.eval_seq_len=512",
            "model.chunk_size=32",
        ]
    if data == "pretrain":
        return [
            f"data.data_dir={root / 'corpus'}",
            f"data.options.tokenizer_path={root / 'spm.model'}",
            "data.options.seq_len=64",
            "data.options.val_fraction=0.3",
            "model.chunk_size=32",
            "model.num_heads=1",
        ]
    raise AssertionError(f"recipe {recipe} uses data {data!r}, which has no fixture here")


RECIPES = sorted(list_recipes())


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_trains_two_steps_and_validates(recipe, lra, data_root, tmp_path):
    args = [
        f"recipe={recipe}",
        f"run_root={tmp_path}",
        *SMALL,
        *overrides_for(recipe, lra.data_dir, data_root),
    ]
    cfg = load_config(args)
    metrics = run(cfg)
    run_dir = Path(metrics["run_dir"])
    state = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert state["global_step"] == 2
    assert list(run_dir.glob("events.out.tfevents.*"))
    assert math.isfinite(metrics["train/loss"])
    if cfg.task == "classify":
        assert 0.0 <= metrics["val/acc"] <= 1.0 and 0.0 <= metrics["test/acc"] <= 1.0
    else:
        assert math.isfinite(metrics["val/loss"])


LM_RECIPES = [r for r in list_recipes() if r in ("pg19", "pg19_small", "llm_200m", "llm_1b", "llm_7b", "kjv")]


@pytest.mark.parametrize("recipe", LM_RECIPES)
def test_llama_baseline_trains_on_every_lm_recipe(recipe, lra, data_root, tmp_path):
    """model.arch=llama: the same recipe trains the Llama matched to its Megalodon, through the same CausalLM,
    logged and checkpointed the same way (WikiText-103's adaptive softmax is Megalodon-only: a clear error)."""
    args = [
        f"recipe={recipe}",
        f"run_root={tmp_path}",
        *SMALL,
        *overrides_for(recipe, lra.data_dir, data_root),
    ]
    cfg = load_config([*args, "model.arch=llama"])
    metrics = run(cfg)
    state = torch.load(
        Path(metrics["run_dir"]) / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True
    )
    assert state["global_step"] == 2
    assert any(k.endswith("attention.wq.weight") for k in state["state_dict"])
    assert math.isfinite(metrics["train/loss"]) and math.isfinite(metrics["val/loss"])


def test_llama_rejects_adaptive_softmax_and_classification(lra, data_root, tmp_path):
    from mega_suite.config import ConfigError

    wt103 = ["recipe=wt103", f"run_root={tmp_path}", *SMALL, *overrides_for("wt103", lra.data_dir, data_root)]
    with pytest.raises(ConfigError, match="adaptive"):
        load_config([*wt103, "model.arch=llama"])
    with pytest.raises(ConfigError, match="task=lm"):
        load_config(["recipe=debug", f"data.data_dir={lra.data_dir}", "model.arch=llama"])
    with pytest.raises(ConfigError, match="model.arch='gpt'"):
        load_config(["recipe=debug", f"data.data_dir={lra.data_dir}", "model.arch=gpt"])
