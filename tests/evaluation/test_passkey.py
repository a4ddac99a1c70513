"""mode=passkey: prompts of the asked length with the needle at the asked depth; what each architecture sees
(Megalodon the whole prompt, Llama its window); the command writes its table, figure and JSON."""

from __future__ import annotations

import json
import re

import pytest
import torch
from after_fixtures import tiny_bundle, tiny_model

from datamodules.kjv import TOKENIZER
from datamodules.tokenizer import TextTokenizer
from mega_suite.evaluation import passkey


@pytest.fixture(scope="module")
def tok():
    return TextTokenizer(TOKENIZER)


def test_a_prompt_has_its_length_and_the_needle_at_its_depth(tok):
    hay = passkey.haystack(tok, "filler")
    for depth in (0.1, 0.5, 0.9):
        ids, at = passkey.make_prompt(tok, hay, 300, depth, "12345", offset=7)
        assert len(ids) == 300 and ids[0] == tok.bos_id
        needle = tok.encode(" " + passkey.NEEDLE.format(key="12345"), bos=False)
        assert ids[at : at + len(needle)] == needle
        assert (
            abs(
                (at - 1) / (300 - 1 - len(needle) - len(tok.encode(" " + passkey.QUESTION, bos=False)))
                - depth
            )
            < 0.01
        )
        assert tok.decode(ids).endswith(passkey.QUESTION)


def test_each_architecture_answers_from_what_it_sees(tok, monkeypatch):
    """A stand-in generate that answers with the key when the needle is in its prompt: Megalodon (the whole
    prompt) always finds it, Llama (its window) only when the needle lies in its last tokens."""

    def oracle(model, prompt, new, **kw):
        text = tok.decode(prompt[0].tolist())
        found = re.search(r"The pass key is (\d+)\.", text)
        answer = tok.encode(" " + (found.group(1) if found else "0"), bos=False)
        return torch.cat([prompt, torch.tensor([answer])], 1)

    monkeypatch.setattr(passkey, "generate", oracle)
    hay = passkey.haystack(tok, "filler")
    mega = passkey.evaluate(tiny_model("megalodon"), tok, [64, 256], 5, hay, seed=0)
    llama = passkey.evaluate(tiny_model("llama"), tok, [64, 256], 5, hay, seed=0)
    assert [r["accuracy"] for r in mega] == [1.0, 1.0] and [r["context_seen"] for r in mega] == [64, 256]
    assert [r["context_seen"] for r in llama] == [56, 56]  # the window of 64, less the answer's tokens
    assert llama[1]["needle_in_view"] == 0.0 and llama[1]["accuracy"] == 0.0  # needle 10%..90% deep in 256
    assert llama[0]["accuracy"] == llama[0]["needle_in_view"] < 1.0


def test_the_command_writes_table_figure_and_json(tmp_path, capsys):
    import run

    records = []
    for arch in ("megalodon", "llama"):
        bundle = tiny_bundle(arch, tmp_path / f"b_{arch}")
        out = tmp_path / arch
        assert run.main(["recipe=kjv", "mode=passkey", f"ckpt={bundle}", "passkey.lengths=[64,128]",
                         "passkey.samples=2", f"run_dir={out}", "trainer.accelerator=cpu"]) == 0  # fmt: skip
        record = json.loads((out / "passkey.json").read_text())
        assert [r["length"] for r in record["rows"]] == [64, 128] and (out / "passkey.png").is_file()
        assert "context seen" in (out / "passkey.md").read_text()
        records.append(out)
    from mega_suite.cli import main

    assert main(["passkey", *[str(r) for r in records], "--out", str(tmp_path / "both")]) == 0
    text = (tmp_path / "both" / "passkey.md").read_text()
    assert "megalodon accuracy" in text and "llama context seen" in text


# The rule (docs/after_training.md#passkey): right when the first number the model writes is the key. A number
# is a maximal run of digits, with its decimal part when a point is followed by a digit; a full stop ends it.
ANSWERS = [
    (" 12345", True),
    ("12345", True),
    (" 12345.", True),
    (" 12345. Remember it.", True),
    (" 12345, and", True),
    ("12345th", True),
    (" 12 12345", False),  # the key, but not first
    (" 0 is wrong; 12345", False),
    (" 123456", False),  # starts with the key: a longer number
    (" 012345", False),
    (" 12345.6", False),  # a decimal number that starts with the key
    (" 1234", False),
    (" 1234 5", False),
    (" no number", False),
    ("", False),
    (" twelve thousand 12345", True),  # words are not numbers: 12345 is the first number written
]


@pytest.mark.parametrize("answer, right", ANSWERS)
def test_the_scorer_takes_the_first_number_the_model_writes(answer, right):
    got, digits = passkey.score(answer, "12345")
    assert got is right
    assert 0.0 <= digits <= 1.0 and (digits == 1.0 if right else True)


def test_the_share_of_digits_right_compares_the_first_number_position_by_position():
    assert passkey.score(" 12945", "12345") == (False, 0.8)
    assert passkey.score(" 99 12345", "12345") == (False, 0.0)  # the first number, not the best one
    assert passkey.score(" nothing", "12345") == (False, 0.0)


@pytest.mark.parametrize("template, right", [(" {key}.", True), (" 7 {key}", False), (" {key}.5", False),
                                             (" 1{key}", False), (" The key: {key}", True)])  # fmt: skip
def test_a_run_scores_each_answer_by_the_first_number(template, right, tok, monkeypatch):
    """``evaluate`` end to end with a stand-in model that writes ``template`` around the prompt's key."""

    def answer(model, prompt, new, **kw):
        key = re.search(r"The pass key is (\d+)\.", tok.decode(prompt[0].tolist())).group(1)
        return torch.cat([prompt, torch.tensor([tok.encode(template.format(key=key), bos=False)])], 1)

    monkeypatch.setattr(passkey, "generate", answer)
    hay = passkey.haystack(tok, "filler")
    rows = passkey.evaluate(tiny_model("megalodon"), tok, [64], 3, hay, seed=0)
    assert rows[0]["accuracy"] == float(right), template
