"""The exported bundle in transformers alone (docs/after_training.md#shareable-weights), both architectures:
it loads and generates in a process where mega_suite, kernels, datamodules, lightning, omegaconf and
sentencepiece cannot be imported, with the suite's greedy tokens (generate and pipeline); every cached one-token
step gives the full forward's logits (Llama past its window too); ``labels=`` gives the shifted mean
cross-entropy; sampling divides the logits by the temperature once; AutoTokenizer adds the training BOS and has
a pad token; without ``trust_remote_code`` loading fails with transformers' error."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import textwrap
import time

import model_oracle as tm
import pytest
import torch
from after_fixtures import tiny_model

import mega_suite.models.sampling as sampling
from datamodules.kjv import ARCHIVE, TOKENIZER
from datamodules.tokenizer import TextTokenizer
from mega_suite.models.bundle import save_bundle
from mega_suite.models.generation import generate

ARCHS = ["megalodon", "llama"]
# Megalodon: chunk 16, layer scale, tied and scaled embeddings; Llama: window 64, stride 32
OVERRIDES = {"megalodon": dict(layer_scale=True, share_emb=True, scale_emb=True), "llama": {}}
BLOCKED = ["mega_suite", "kernels", "datamodules", "lightning", "omegaconf", "sentencepiece"]
PROMPT = "In the beginning God created the heaven and the earth."
NEW_TOKENS = 70  # Llama: prompt + 70 > its window of 64; Megalodon: several chunks of 16
TOLERANCE = 1e-5  # logits, relative to their largest magnitude: float32 rounding of different op orders


def kjv_book(name: str = "kjv/test/44.txt") -> str:
    with tarfile.open(ARCHIVE, "r:xz") as tar:
        return tar.extractfile(name).read().decode("utf-8")


@pytest.fixture(scope="module")
def bundles(tmp_path_factory):
    """arch -> (suite model, bundle folder): tiny models with every parameter moved off its initial value."""
    out = {}
    for i, arch in enumerate(ARCHS):
        model = tiny_model(arch, seed=i, **OVERRIDES[arch])
        with torch.no_grad():
            tm.randomise(model, seed=i, scale=0.1)
        out[arch] = (model, save_bundle(model, tmp_path_factory.mktemp(arch), tokenizer=TOKENIZER))
    return out


@pytest.fixture(scope="module")
def hf_models(bundles):
    from transformers import AutoModelForCausalLM

    return {
        a: AutoModelForCausalLM.from_pretrained(f, trust_remote_code=True).eval()
        for a, (_, f) in bundles.items()
    }


CHILD = """
import json, sys, time
for name in {blocked!r}:  # as if not installed: import fails, importlib.util.find_spec answers None
    sys.modules[name] = None
for name in {blocked!r}:
    try:
        __import__(name)
    except ImportError:
        pass
    else:
        raise SystemExit(f"{{name}} is importable")
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

result = {{}}
for arch, folder in {folders!r}.items():
    r = result[arch] = {{}}
    for trust in (False, None):  # before any trusted load of this class
        kwargs = {{}} if trust is None else {{"trust_remote_code": trust}}
        start = time.time()
        try:
            AutoModelForCausalLM.from_pretrained(folder, **kwargs)
            r[f"trust={{trust}}"] = "loaded"
        except ValueError as exc:
            r[f"trust={{trust}}"] = str(exc)
        r[f"trust={{trust}} seconds"] = time.time() - start
    tok = AutoTokenizer.from_pretrained(folder)
    r["tokenizer"] = {{
        "ids": tok({texts!r})["input_ids"], "pad": tok.pad_token, "pad_id": tok.pad_token_id,
        "bos_id": tok.bos_token_id, "eos_id": tok.eos_token_id,
    }}
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
    prompt = tok({prompt!r}, return_tensors="pt")
    out = model.generate(**prompt, max_new_tokens={new}, do_sample=False)
    r["generate"] = out.tolist()
    pipe = pipeline("text-generation", model=folder, trust_remote_code=True)
    got = pipe({prompt!r}, max_new_tokens={new}, do_sample=False, return_tensors=True)
    r["pipeline"] = [int(t) for t in got[0]["generated_token_ids"]]
result["imported"] = sorted(n for n in {blocked!r} if sys.modules.get(n) is not None)
print()  # after transformers' question, which input() prints without a newline
print("RESULT", json.dumps(result))
"""


@pytest.fixture(scope="module")
def clean_run(bundles, tmp_path_factory):
    """One process without the suite's packages: tokenizer, loading with and without trust_remote_code,
    generate and pipeline for both bundles. stdin is closed, as in a script."""
    texts = [PROMPT, kjv_book()[:3000], "  two  spaces\nand a newline"]
    code = CHILD.format(
        blocked=BLOCKED, folders={a: str(f) for a, (_, f) in bundles.items()}, texts=texts, prompt=PROMPT,
        new=NEW_TOKENS,
    )  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    env.update(HF_HUB_OFFLINE="1", HF_MODULES_CACHE=str(tmp_path_factory.mktemp("hf_modules")))
    cwd = tmp_path_factory.mktemp("clean")  # not the repository: its packages are not on the path either
    start = time.time()
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], cwd=cwd, env=env, stdin=subprocess.DEVNULL,
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT ")), texts, time.time() - start


@pytest.mark.parametrize("arch", ARCHS)
def test_the_bundle_generates_the_suites_greedy_tokens_without_the_suite(arch, bundles, clean_run):
    result, _, _ = clean_run
    assert result["imported"] == []
    model, folder = bundles[arch]
    prompt = torch.tensor([TextTokenizer(TOKENIZER).encode(PROMPT)])
    eos = json.loads((folder / "config.json").read_text())["eos_token_id"]
    expected = generate(model, prompt, NEW_TOKENS, greedy=True, eos_id=eos)
    assert expected.shape[1] > 64  # Llama: beyond its window
    assert result[arch]["generate"] == expected.tolist()
    assert result[arch]["pipeline"] == expected[0].tolist()


def test_autotokenizer_encodes_as_the_run_adds_bos_and_has_a_pad_token(bundles, clean_run):
    result, texts, _ = clean_run
    tok = TextTokenizer(TOKENIZER)
    for arch in ARCHS:
        got = result[arch]["tokenizer"]
        assert got["ids"] == [tok.encode(t) for t in texts]  # BOS tokens, as the training documents begin
        assert got["bos_id"] == tok.bos_id and got["ids"][0][0] == tok.bos_id
        assert got["pad"] is not None and got["pad_id"] == got["eos_id"] == tok.eos_id


def test_the_fast_tokenizer_encodes_a_whole_book_as_sentencepiece(bundles):
    from tokenizers import Tokenizer

    fast = Tokenizer.from_file(str(bundles["llama"][1] / "tokenizer.json"))
    tok = TextTokenizer(TOKENIZER)
    book = kjv_book()
    assert fast.encode(book, add_special_tokens=False).ids == tok.encode(book, bos=False)
    lines = [line for line in book.splitlines() if line.strip()][:200]
    assert [e.ids for e in fast.encode_batch(lines)] == [tok.encode(line) for line in lines]


def test_without_trust_remote_code_loading_fails_at_once_with_transformers_error(clean_run):
    result, _, seconds = clean_run
    for arch in ARCHS:
        for trust in ("False", "None"):
            message = result[arch][f"trust={trust}"]
            assert "trust_remote_code=True" in message, message
            assert result[arch][f"trust={trust} seconds"] < 5  # no question waiting for an answer
    assert seconds < 240


def _reference_logits(arch: str, model, tokens: torch.Tensor) -> torch.Tensor:
    """The suite's logits at every position: Megalodon's full pass; Llama's sliding-window stream (what its
    decoder computes at each position, ``mega_suite.models.llama.decode``)."""
    with torch.no_grad():
        return model(tokens, use_cache=arch == "llama")[0]


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    err = (got - want).abs().max().item() / want.abs().max().item()
    assert err <= TOLERANCE, f"{what}: relative error {err:.2e}"


@pytest.mark.parametrize("arch", ARCHS)
def test_every_cached_one_token_step_equals_the_full_forward(arch, bundles, hf_models):
    model, hf = bundles[arch][0], hf_models[arch]
    length = 110 if arch == "llama" else 50  # Llama: the window (64, stride 32) moves at 64 and 96
    tokens = torch.randint(3, model.cfg.vocab_size, (2, length), generator=torch.Generator().manual_seed(3))
    want = _reference_logits(arch, model, tokens)
    with torch.no_grad():
        _close(hf(tokens, use_cache=False).logits, want, "full forward without cache")
        if arch == "llama":  # inside the window the same ops in the same order as the suite's full pass
            assert torch.equal(hf(tokens[:, :64], use_cache=False).logits, model(tokens[:, :64])[0])
        out = hf(tokens[:, :5], use_cache=True)
        cache = out.cache
        _close(out.logits, want[:, :5], "prompt with cache")
        for t in range(5, length):
            out = hf(tokens[:, t : t + 1], cache=cache, use_cache=True)
            assert out.cache is cache and cache.get_seq_length() == t + 1
            _close(out.logits[:, 0], want[:, t], f"one-token step at position {t}")


@pytest.mark.parametrize("arch", ARCHS)
def test_labels_give_the_shifted_mean_cross_entropy(arch, bundles, hf_models):
    model, hf = bundles[arch][0], hf_models[arch]
    tokens = torch.randint(3, model.cfg.vocab_size, (2, 20), generator=torch.Generator().manual_seed(4))
    labels = tokens.clone()
    labels[0, 7] = labels[1, 15] = -100
    out = hf(tokens, labels=labels)
    logp = torch.log_softmax(out.logits.detach().double(), -1)[:, :-1]  # position t predicts token t + 1
    target = labels[:, 1:]
    valid = target != -100
    nll = -logp.gather(-1, target.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    expected = nll[valid].mean()
    assert abs(out.loss.item() - expected.item()) < 1e-5
    unshifted = -torch.log_softmax(out.logits.detach().double(), -1).gather(-1, tokens.unsqueeze(-1)).mean()
    assert abs(out.loss.item() - unshifted.item()) > 1e-2  # the test tells the two apart
    out.loss.backward()  # differentiable: fine-tuning through transformers
    assert hf.model.embed.weight.grad is not None and hf.model.embed.weight.grad.abs().sum() > 0
    hf.zero_grad(set_to_none=True)


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_sampling_divides_the_logits_by_the_temperature_once(temperature, bundles, hf_models, monkeypatch):
    model, hf = bundles["megalodon"][0], hf_models["megalodon"]
    prompt = torch.tensor([TextTokenizer(TOKENIZER).encode(PROMPT)])
    with torch.no_grad():
        logits = model(prompt)[0][:, -1].double()
    oracle = torch.softmax(logits / temperature, -1)  # float64

    # transformers: the processed scores of the bundle's default sampling (no top-k cut) are logits / T
    out = hf.generate(
        prompt, max_new_tokens=1, temperature=temperature, output_scores=True, output_logits=True,
        return_dict_in_generate=True,
    )  # fmt: skip
    torch.testing.assert_close(
        out.logits[0].double(), logits, atol=TOLERANCE * logits.abs().max().item(), rtol=0
    )
    torch.testing.assert_close(torch.softmax(out.scores[0].double(), -1), oracle, atol=1e-6, rtol=1e-4)

    # the suite's sampler: the distribution handed to torch.multinomial
    seen = []
    real = torch.multinomial

    def spy(probs, *args, **kwargs):
        seen.append(probs.detach().double())
        return real(probs, *args, **kwargs)

    monkeypatch.setattr(sampling.torch, "multinomial", spy)
    sampling.sample_next(logits.float(), temperature=temperature)
    torch.testing.assert_close(seen[0], oracle, atol=1e-6, rtol=1e-4)
    assert (seen[0] - torch.softmax(logits, -1)).abs().max() > 1e-3  # T != 1 changes the distribution


@pytest.mark.parametrize("arch", ARCHS)
def test_beam_search_reorders_the_cache(arch, bundles, hf_models):
    """Beam search with the cache (reordered rows at every step) chooses what it chooses recomputing the
    prefix without one."""
    hf = hf_models[arch]
    prompt = torch.randint(3, 4096, (2, 50), generator=torch.Generator().manual_seed(5))  # Llama: past 64
    kwargs = dict(max_new_tokens=20, num_beams=3, num_return_sequences=2, do_sample=False)
    assert torch.equal(hf.generate(prompt, **kwargs), hf.generate(prompt, use_cache=False, **kwargs))
