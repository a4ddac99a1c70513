"""Every bounded key is checked at load against the domain declared beside it (``schema.RANGES``): a value just
outside is one ConfigError naming the key, the value and what was expected; the boundary values are accepted.
Every numeric key of the schema has a domain or is named here as unbounded, and every domain has a case here,
so removing a check (or adding a key without one) fails a test."""

from __future__ import annotations

import dataclasses
import re

import pytest

from mega_suite.config import (
    ConfigError,
    DataSection,
    ModelSection,
    OptimSection,
    RunConfig,
    TrainerSection,
    load_config,
)
from mega_suite.config.schema import RANGES

# key -> (values just outside the domain, values on or inside its edges); the recipe is debug (listops)
CASES = {
    "seed": (["-1", "4294967296"], ["0", "4294967295"]),
    "eval_max_documents": (["-1"], ["0"]),
    "eval_context_lengths": (["[0]", "[4096,-1]"], ["[]", "[1]"]),
    "model.num_layers": (["0"], ["1"]),
    "model.model_dim": (["0"], ["4"]),
    "model.num_heads": (["0"], ["1"]),
    "model.z_dim": (["0"], ["2"]),
    "model.value_dim": (["0"], ["1"]),
    "model.ffn_hidden_dim": (["0"], ["1"]),
    "model.cema_ndim": (["0"], ["1"]),
    "model.norm_num_groups": (["0"], ["1"]),
    "model.chunk_size": (["0"], ["1"]),
    "model.norm_eps": (["0", "-1e-5", "nan"], ["1e-12"]),
    "model.rope_base": (["0", "inf"], ["1.5"]),
    "model.dropout": (["-0.1", "1.0"], ["0.0", "0.99"]),
    "model.hidden_dropout": (["-0.1", "1.0"], ["0.0"]),
    "model.attention_dropout": (["1.0"], ["0.5"]),
    "model.drop_path": (["1.0", "-1"], ["0.0"]),
    "model.vocab_size": (["0"], ["1"]),
    "model.adaptive_cutoffs": (["[0]", "[-5,10]"], ["[]", "[3]"]),
    "model.adaptive_factor": (["0", "-2"], ["1.0"]),
    "model.num_classes": (["-1"], []),  # the data's count (10 for listops) is the one value accepted
    "model.image_size": (["0"], ["1"]),
    "model.patch_size": (["0"], ["1"]),
    "model.in_chans": (["0"], ["1"]),
    "data.batch_size": (["0"], ["1"]),
    "data.num_workers": (["-1"], ["0"]),
    "data.max_length": (["0"], ["1", "null"]),
    "data.pad_to_multiple": (["0"], ["1"]),
    "optim.lr": (["0", "-1", "nan", "inf"], ["1e-30"]),
    "optim.weight_decay": (["-0.01", "inf"], ["0"]),
    "optim.betas": (
        ["[2,0.9]", "[0.9,1.0]", "[-0.1,0.9]", "[0.9]", "[0.9,0.98,0.9]"],
        ["[0,0]", "[0.9,0.999]"],
    ),
    "optim.eps": (["0", "-1"], ["1e-30"]),
    "optim.warmup_steps": (["-1"], ["0"]),
    "optim.min_lr_ratio": (["-0.1", "1.5"], ["0", "1"]),
    "optim.clip_grad_norm": (["-1", "nan"], ["0"]),
    "trainer.max_steps": (["0", "-1"], ["1"]),
    "trainer.max_epochs": (["0", "-2"], ["-1", "1"]),
    "trainer.devices": (["0", "-1", "[]", "[0,0]", "[-1]", "1.5"], ["1", "auto", "[0,1]"]),
    "trainer.num_nodes": (["0"], ["1"]),
    "trainer.accumulate_grad_batches": (["0"], ["1"]),
    "trainer.global_batch_tokens": (["-1"], ["0"]),
    "trainer.peak_tflops": (["-1", "inf"], ["0"]),
    "trainer.val_check_interval": (["0", "-1"], ["1"]),
    "trainer.limit_val_batches": (["-1", "-0.5", "1.5", "2.5"], ["0", "0.5", "1.0", "2", "100"]),
    "trainer.limit_test_batches": (["-1", "1.5"], ["0", "3"]),
    "trainer.log_every_n_steps": (["0"], ["1"]),
    "trainer.chunk_parallel": (["0", "-2"], ["1"]),
    "trainer.save_every_n_steps": (["-1"], ["0", "5"]),
    "trainer.keep_checkpoints": (["-1"], ["0"]),
    "max_new_tokens": (["0"], ["1"]),
    "temperature": (["-0.5", "nan"], ["0", "0.7"]),
    "top_k": (["0"], ["1"]),
    "top_p": (["0", "1.5"], ["1", "0.9"]),
    "lm_eval.num_fewshot": (["-1"], ["0"]),
    "lm_eval.limit": (["0", "-2"], ["0.5", "10"]),
    "lm_eval.max_gen_toks": (["0"], ["1"]),
    "lm_eval.batch_size": (["0", "-1"], ["1", "64"]),
    "passkey.samples": (["0"], ["1"]),
    "passkey.lengths": (["[32]", "[1024,10]"], ["[64]", "[1024,2048]"]),
}

# Numeric keys with no bound: each is a choice among values checked elsewhere, or any value is meaningful.
UNBOUNDED = set()


def _load(*overrides: str):
    return load_config(["recipe=debug", *overrides])


@pytest.mark.parametrize("key, bad", [(k, v) for k, (bads, _) in CASES.items() for v in bads])
def test_a_value_outside_the_domain_is_one_error_naming_key_value_and_expectation(key, bad):
    with pytest.raises(ConfigError) as info:
        _load(f"{key}={bad}")
    message = str(info.value)
    assert message.startswith(f"{key}="), message
    assert "expected" in message and str(RANGES[key].expected()) in message, message
    assert "\n" not in message


@pytest.mark.parametrize("key, good", [(k, v) for k, (_, goods) in CASES.items() for v in goods])
def test_the_edges_of_the_domain_are_accepted(key, good):
    extra = ["model.z_dim=2", "model.value_dim=2", "model.num_heads=1"] if key.startswith("model.") else []
    if key == "model.model_dim":
        extra.append("model.norm_num_groups=4")
    if key == "trainer.chunk_parallel":
        extra = []
    try:
        _load(*extra, f"{key}={good}")
    except ConfigError as exc:  # another check may refuse the combination, never this key's range
        assert "out of range" not in str(exc), exc


def _numeric_keys() -> set[str]:
    out = {f.name for f in dataclasses.fields(RunConfig) if _numeric(f)}
    for prefix, section in (("model", ModelSection), ("data", DataSection), ("optim", OptimSection),
                            ("trainer", TrainerSection)):  # fmt: skip
        out |= {f"{prefix}.{f.name}" for f in dataclasses.fields(section) if _numeric(f)}
    return out


def _numeric(f: dataclasses.Field) -> bool:
    text = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    return bool(re.search(r"\b(int|float)\b", text)) or f.name == "devices"


def test_every_numeric_key_has_a_declared_domain_and_every_domain_a_case():
    assert set(CASES) == set(RANGES), set(CASES) ^ set(RANGES)
    missing = _numeric_keys() - set(RANGES) - UNBOUNDED
    assert not missing, f"numeric keys without a declared domain: {sorted(missing)}"


def test_ranges_are_checked_before_the_model_is_built():
    """model.norm_num_groups=0 used to reach the model's own check, which divides by it (ZeroDivisionError)."""
    with pytest.raises(ConfigError, match=r"model\.norm_num_groups=0 is out of range"):
        _load("model.norm_num_groups=0")


@pytest.mark.parametrize(
    "value, lightning_gets",
    [("1", 1), ("4", 4), ("1.0", 1.0), ("0.25", 0.25), ("0", 0), ("3.0", 3)],
)
def test_batch_limits_follow_lightning_a_whole_number_counts_batches_a_float_is_a_fraction(
    value, lightning_gets
):
    """``trainer.limit_val_batches=1`` is one batch, as in Lightning (the schema's float once made it 1.0: every
    batch, minutes of validation on the main job); ``1.0`` is the whole split."""
    from mega_suite.training.runner import batch_limit

    cfg = load_config(
        ["recipe=debug", f"trainer.limit_val_batches={value}", f"trainer.limit_test_batches={value}"]
    )
    for key in ("limit_val_batches", "limit_test_batches"):
        got = batch_limit(cfg.trainer[key])
        assert got == lightning_gets and type(got) is type(lightning_gets), (key, value, got)
