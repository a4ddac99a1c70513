"""The keys of generate / lm_eval / passkey and of periodic checkpoints are checked at load: each is refused
outside its mode, and each mode names what it is missing."""

from __future__ import annotations

import pytest

from mega_suite.config import ConfigError, load_config

BASE = ["recipe=kjv"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["prompt=hi"], r"prompt=hi is read by mode=generate only \(mode=fit\)"),
        (["lm_eval.tasks=[boolq]"], r"lm_eval.tasks=\['boolq'\] is read by mode=lm_eval only"),
        (["mode=generate", "ckpt=x", "passkey.samples=3"], r"passkey.samples=3 is read by mode=passkey only"),
        (["tokenizer=t.model"], r"tokenizer=t.model is read by mode=generate/lm_eval/passkey only"),
        (["mode=generate", "prompt=hi"], r"mode=generate needs ckpt=PATH"),
        (["mode=generate", "ckpt=x"], r'needs prompt="TEXT" or prompt_file=PATH'),
        (["mode=generate", "ckpt=x", "prompt=a", "prompt_file=b"], r"one of them"),
        (["mode=generate", "ckpt=x", "prompt=a", "top_p=1.5"], r"top_p=1.5 is out of range; expected"),
        (["mode=generate", "ckpt=x", "prompt=a", "temperature=-1"], r"temperature=-1.0 is out of range; expected"),
        (["mode=lm_eval", "ckpt=x"], r"needs lm_eval.tasks"),
        (["mode=lm_eval", "ckpt=x", "lm_eval.tasks=[a]", "lm_eval.checkpoints=[b]"], r"not both"),
        (["mode=passkey", "ckpt=x", "passkey.lengths=[32]"], r"passkey.lengths=\[32\] is out of range; expected"),
        (["trainer.keep_checkpoints=2"], r"trainer.keep_checkpoints=2 counts the checkpoints of trainer.save_every_n_steps"),
        (["trainer.save_every_n_steps=-1"], r"trainer.save_every_n_steps=-1 is out of range"),
    ],
)  # fmt: skip
def test_a_misplaced_or_missing_key_is_named(args, message):
    with pytest.raises(ConfigError, match=message):
        load_config([*BASE, *args])


def test_the_keys_load_in_their_modes():
    cfg = load_config(
        [*BASE, "mode=generate", "ckpt=x", "prompt=hi", "temperature=0", "top_k=5", "compile=true"]
    )
    assert cfg.prompt == "hi" and cfg.top_k == 5 and cfg.compile
    cfg = load_config(
        [*BASE, "mode=lm_eval", "lm_eval.checkpoints=[run]", "lm_eval.tasks=[a,b]", "lm_eval.limit=0.5"]
    )
    assert list(cfg.lm_eval.tasks) == ["a", "b"] and cfg.lm_eval.limit == 0.5
    cfg = load_config([*BASE, "trainer.save_every_n_steps=100", "trainer.keep_checkpoints=3"])
    assert cfg.trainer.save_every_n_steps == 100
