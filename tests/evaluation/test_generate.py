"""mode=generate: the command's greedy text is decode(generate(encode(prompt))) for both architectures, a
fixed seed repeats a sampled text, Llama's key / value cache gives the argmax of a full forward pass over its
window at every step, and the new input errors are one line each."""

from __future__ import annotations

import json

import pytest
import torch
from after_fixtures import tiny_bundle, tiny_model

from datamodules.tokenizer import TextTokenizer
from mega_suite.models.llama.decode import LlamaDecoder
from mega_suite.models.llama.decode import generate as llama_generate
from mega_suite.models.megalodon.decode import generate as megalodon_generate

PROMPT = "In the beginning God created the heaven and the earth. And the earth was without form"


def cli(args: list[str], capsys) -> tuple[int, str, list[str]]:
    import run

    capsys.readouterr()
    code = run.main(["recipe=kjv", "trainer.accelerator=cpu", *args])
    out = capsys.readouterr()
    return code, out.out, [line for line in out.err.splitlines() if line.startswith("error:")]


@pytest.fixture(scope="module")
def bundles(tmp_path_factory):
    root = tmp_path_factory.mktemp("generate")
    return {arch: tiny_bundle(arch, root / arch) for arch in ("megalodon", "llama")}


@pytest.mark.parametrize("arch", ["megalodon", "llama"])
def test_the_commands_greedy_text_is_decode_of_generate_of_encode(arch, bundles, tmp_path, capsys):
    code, out, _ = cli([f"ckpt={bundles[arch]}", "mode=generate", f"prompt={PROMPT}", "max_new_tokens=30",
                        "temperature=0", f"run_dir={tmp_path}"], capsys)  # fmt: skip
    assert code == 0
    tok = TextTokenizer(bundles[arch] / "tokenizer.model")
    library = megalodon_generate if arch == "megalodon" else llama_generate
    ids = library(tiny_model(arch), torch.tensor([tok.encode(PROMPT)]), 30, greedy=True, eos_id=tok.eos_id)
    expected = tok.decode(ids[0].tolist())
    assert (tmp_path / "generate.txt").read_text() == expected + "\n"
    assert expected in out and "tokens/s" in out
    record = json.loads((tmp_path / "generate.json").read_text())
    assert record["new_ids"] == ids[0, len(tok.encode(PROMPT)) :].tolist()


def test_a_fixed_seed_repeats_and_another_seed_differs(bundles, tmp_path, capsys):
    texts = []
    for seed in (3, 3, 4):
        run_dir = tmp_path / f"s{seed}-{len(texts)}"
        args = [f"ckpt={bundles['megalodon']}", "mode=generate", "prompt=And God said", "max_new_tokens=20",
                "temperature=1.0", "top_k=50", "top_p=0.95", f"seed={seed}", f"run_dir={run_dir}"]  # fmt: skip
        assert cli(args, capsys)[0] == 0
        texts.append((run_dir / "generate.txt").read_text())
    assert texts[0] == texts[1] and texts[0] != texts[2]


@pytest.mark.parametrize("stride", [0, 24])
def test_llama_greedy_generation_is_the_argmax_of_its_full_window_forward(stride):
    model = tiny_model("llama", eval_stride=stride)  # window 64; stride 32 (default) or 24
    decoder = LlamaDecoder(model)
    prompt = torch.randint(0, 4096, (2, 20), generator=torch.Generator().manual_seed(0))
    out = llama_generate(decoder, prompt, 120, greedy=True)  # well past the window
    seen = set()
    for t in range(prompt.shape[1] - 1, out.shape[1] - 1):
        lo = decoder.context_start(t)
        seen.add(t + 1 - lo)
        with torch.no_grad():
            full, _ = model(out[:, lo : t + 1])  # a fresh full pass over exactly the tokens t sees
        assert torch.equal(full[:, -1].argmax(-1), out[:, t + 1]), t
    assert max(seen) == 64 and min(seen) < 64  # the whole window, then the sliding one
    # and the cache's logits are the model's streaming evaluation's (the sliding window) for any split
    stream, _ = model(out, use_cache=True)
    first, cache = decoder(out[:, :50])
    rest, _ = decoder(out[:, 50:], cache)
    torch.testing.assert_close(torch.cat([first, rest], 1), stream, rtol=0, atol=1e-5)


def test_compile_true_decodes_through_the_compiled_static_decoder(bundles, tmp_path, capsys, monkeypatch):
    # the compiled StaticDecoder's own equality with the eager step is tests/models/test_decode.py's
    import mega_suite.models.megalodon.decode.generation as streaming

    calls = []
    real = streaming.generate
    monkeypatch.setattr(
        streaming,
        "generate",
        lambda *a, **k: calls.append(k["compile"]) or real(*a, **{**k, "compile": False}),
    )
    args = [f"ckpt={bundles['megalodon']}", "mode=generate", "prompt=And God said", "max_new_tokens=3",
            "temperature=0", "compile=true", f"run_dir={tmp_path}"]  # fmt: skip
    assert cli(args, capsys)[0] == 0 and calls == [True]
    assert json.loads((tmp_path / "generate.json").read_text())["compile"] is True
    code, _, errors = cli([f"ckpt={bundles['llama']}", "mode=generate", "prompt=x", "compile=true",
                           f"run_root={tmp_path}"], capsys)  # fmt: skip
    assert code == 2 and "compile=true applies to a compiled static decoder, which llama has not" in errors[0]


def test_input_errors_are_one_line(bundles, tmp_path, capsys):
    long_prompt = " ".join(["the LORD"] * 40)  # more than Llama's 64-token window
    cases = [
        ([f"ckpt={bundles['llama']}", f"prompt={long_prompt}"], "no room to generate"),
        ([f"ckpt={bundles['megalodon']}", "prompt=x", f"tokenizer={tmp_path / 'missing.model'}"], "missing.model: no such file"),
        ([f"ckpt={bundles['megalodon']}", f"prompt_file={tmp_path / 'none.txt'}"], "prompt_file="),
        ([f"ckpt={tmp_path / 'nothing'}", "prompt=x"], "no such checkpoint"),
        (["prompt=x"], "needs ckpt=PATH"),
    ]  # fmt: skip
    for args, expected in cases:
        code, _, errors = cli(["mode=generate", f"run_root={tmp_path}", *args], capsys)
        assert code == 2 and len(errors) == 1 and expected in errors[0], (args, errors)
    # a megalodon prompt of any length is fine
    code, _, _ = cli(["mode=generate", f"ckpt={bundles['megalodon']}", f"prompt={long_prompt}", "max_new_tokens=2",
                      f"run_root={tmp_path}"], capsys)  # fmt: skip
    assert code == 0
