"""Greedy generation through an exported bundle in transformers (``AutoModelForCausalLM`` with
``trust_remote_code``: the standalone model of ``mega_suite/models/hf/`` and its cache) against the suite's
own decoder (``mega_suite.models.generation.generate``: Megalodon's packed ``Decoder``, Llama's key / value
cache), both architectures at the KJV recipe's widths, in one process.

    python -m bench.hf_generate                         # 1 thread, 5 rounds, prompt 32, 128 new tokens
    python -m bench.hf_generate --threads 2 --tokens 256 --prompt 200

Each model is random (seeded): speed and token equality do not depend on training. The bundle is written to a
temporary folder with the KJV tokenizer and loaded back through transformers. The paths take turns round by
round, so a load spike on a shared machine hits both alike. Per path: prompt pass + first token, then the
decode rate of the remaining tokens (timed from the first new token, as ``mode=generate`` reports it); the
ratio is transformers' time per decoded token over the suite's (the issue's target: <= 1.3). EOS is off on
both sides, so every run decodes the same number of tokens; "greedy equal" compares the token ids.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench.common import machine_description, markdown_table, setup_threads

TEXT = (
    "In the beginning God created the heaven and the earth. And the earth was without form, and void; and "
    "darkness was upon the face of the deep. And the Spirit of God moved upon the face of the waters."
)


def build(arch: str, folder: Path):
    """(suite model, transformers model from its bundle, tokenizer) of the KJV recipe's ``arch``."""
    from transformers import AutoModelForCausalLM

    from datamodules.kjv import TOKENIZER
    from datamodules.tokenizer import TextTokenizer
    from mega_suite.config import load_config
    from mega_suite.config.resolve import model_config
    from mega_suite.models import build_model
    from mega_suite.models.bundle import save_bundle

    tok = TextTokenizer(TOKENIZER)
    torch.manual_seed(0)
    model = build_model(
        model_config(load_config(["recipe=kjv", f"model.arch={arch}"]), vocab_size=tok.vocab_size)
    ).eval()
    save_bundle(model, folder, tokenizer=TOKENIZER)
    hf = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    hf.generation_config.eos_token_id = None  # decode every token on both sides
    return model, hf, tok


def prompt_ids(tok, length: int) -> torch.Tensor:
    ids = tok.encode(TEXT)
    while len(ids) < length:
        ids += tok.encode(TEXT, bos=False)
    return torch.tensor([ids[:length]])


class _Mark:
    """Called after every new token (the suite's ``stop``, a transformers stopping criterion): the first call
    ends the prompt pass."""

    def __init__(self):
        self.first = None

    def __call__(self, *args, **kwargs):
        if self.first is None:
            self.first = time.perf_counter()
        if len(args) == 2:  # transformers: (input_ids, scores) -> a bool per row
            return torch.zeros(args[0].shape[0], dtype=torch.bool)
        return False


@torch.no_grad()
def run_suite(model, prompt: torch.Tensor, new: int):
    from mega_suite.models.generation import generate

    mark = _Mark()
    start = time.perf_counter()
    out = generate(model, prompt, new, greedy=True, eos_id=None, stop=mark)
    end = time.perf_counter()
    return out, mark.first - start, (end - mark.first) / (new - 1)


@torch.no_grad()
def run_hf(hf, prompt: torch.Tensor, new: int):
    from transformers import StoppingCriteriaList

    mark = _Mark()
    start = time.perf_counter()
    out = hf.generate(
        prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new, do_sample=False,
        stopping_criteria=StoppingCriteriaList([mark]),
    )  # fmt: skip
    end = time.perf_counter()
    return out, mark.first - start, (end - mark.first) / (new - 1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.hf_generate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prompt", type=int, default=32, help="prompt tokens (BOS included)")
    parser.add_argument("--tokens", type=int, default=128, help="new tokens per generation (>= 2)")
    parser.add_argument("--archs", default="megalodon,llama")
    args = parser.parse_args(argv)
    if args.tokens < 2:
        parser.error(f"--tokens {args.tokens}: need at least 2 (the decode rate is timed after the first)")
    setup_threads(args.threads)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for arch in args.archs.split(","):
            model, hf, tok = build(arch, Path(tmp) / arch)
            prompt = prompt_ids(tok, args.prompt)
            run_suite(model, prompt, 4), run_hf(hf, prompt, 4)  # warm-up: packs, allocations
            times = {"suite": [], "hf": []}
            outs = {}
            for _ in range(args.rounds):
                for name, fn, m in (("suite", run_suite, model), ("hf", run_hf, hf)):
                    out, first, per_token = fn(m, prompt, args.tokens)
                    times[name].append((first, per_token))
                    outs[name] = out
            med = {
                k: (statistics.median(f for f, _ in v), statistics.median(p for _, p in v))
                for k, v in times.items()
            }
            ratio = med["hf"][1] / med["suite"][1]
            rows.append([
                arch, f"{med['suite'][0] * 1e3:.1f}", f"{med['hf'][0] * 1e3:.1f}",
                f"{1 / med['suite'][1]:.1f}", f"{1 / med['hf'][1]:.1f}", f"{ratio:.2f}",
                "yes" if torch.equal(outs["suite"], outs["hf"]) else "NO",
            ])  # fmt: skip
    print(f"# transformers generate (bundle) vs the suite's decoder: prompt {args.prompt}, {args.tokens} new tokens, "
          f"median of {args.rounds} rounds\n")  # fmt: skip
    print(machine_description(args.threads) + "\n")
    headers = [
        "arch", "suite prompt+1st ms", "hf prompt+1st ms", "suite tok/s", "hf tok/s", "hf/suite per token",
        "greedy equal",
    ]  # fmt: skip
    print(markdown_table(headers, rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
