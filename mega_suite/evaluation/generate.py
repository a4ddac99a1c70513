"""``mode=generate``: a prompt through the run's tokenizer and a trained model, the continuation printed and
written to the run directory (``generate.txt``, ``generate.json``), with its speed (docs/after_training.md#generate).

Megalodon decodes through its streaming cache (``Decoder``; ``compile=true``: the compiled
``StaticDecoder``), Llama through its key / value cache inside its window (``models/llama/decode.py``). A
prompt is encoded as the training documents were, ``BOS tokens``; generation stops at EOS or after
``max_new_tokens``. ``temperature=0`` is greedy; ``seed`` seeds the sampling.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from mega_suite.config import ConfigError
from mega_suite.models import arch_of
from mega_suite.models.generation import generate


def check_room(model, prompt_tokens: int) -> None:
    """A Llama prompt must leave room inside its window for at least one new token (a longer one would be cut
    without notice); Megalodon's context is unbounded."""
    window = getattr(model.cfg, "max_seq_len", None)
    if window is not None and prompt_tokens >= window:
        raise ConfigError(
            f"the prompt is {prompt_tokens} tokens (BOS included) but Llama's context window is {window} "
            f"(model.max_seq_len): no room to generate; shorten the prompt to under {window} tokens"
        )


@torch.no_grad()
def check_generate(cfg: DictConfig, trained: Any, text: str) -> None:
    """What ``run_generate`` would refuse, checked before anything is written."""
    if cfg.compile and not arch_of(trained.model.cfg).compiled_decoder:
        raise ConfigError(f"compile=true applies to a compiled static decoder, which {trained.arch} has not")
    check_room(trained.model, len(trained.tokenizer.encode(text)))


def run_generate(cfg: DictConfig, trained: Any, run_dir: Path, text: str) -> dict[str, Any]:
    """Generate from ``trained`` (model, tokenizer) as ``cfg`` says, continuing ``text``; returns the metrics."""
    model, tok = trained.model, trained.tokenizer
    device = next(model.parameters()).device
    ids = tok.encode(text)
    check_room(model, len(ids))
    prompt = torch.tensor([ids], device=device)
    generator = torch.Generator(device=device).manual_seed(int(cfg.seed))
    first: list[float] = []

    def mark(_out: torch.Tensor) -> bool:  # called after each new token: the first call ends the prompt pass
        if not first:
            first.append(time.perf_counter())
        return False

    start = time.perf_counter()
    out = generate(
        model, prompt, int(cfg.max_new_tokens), temperature=float(cfg.temperature), top_k=cfg.top_k,
        top_p=cfg.top_p, greedy=float(cfg.temperature) == 0.0, eos_id=tok.eos_id, generator=generator,
        stop=mark, compile=bool(cfg.compile),
    )  # fmt: skip
    end = time.perf_counter()
    new = out[0, len(ids) :].tolist()
    full = tok.decode(out[0].tolist())
    continuation = tok.decode(new)
    first_at = first[0] if first else end
    steps = max(0, len(new) - 1)  # tokens decoded one at a time after the prompt pass
    rate = steps / (end - first_at) if steps and end > first_at else float("nan")
    speed = (
        f"prompt {len(ids)} tokens + first token in {first_at - start:.3f} s; {steps} more tokens in "
        f"{end - first_at:.3f} s: {rate:.1f} tokens/s ({trained.arch}, {device.type}"
        + (", compiled static decoder" if cfg.compile else "")
        + ")"
    )
    (run_dir / "generate.txt").write_text(full + "\n")
    record = dict(
        prompt=text, continuation=continuation, text=full, prompt_ids=ids, new_ids=new, ckpt=str(trained.source),
        arch=trained.arch, max_new_tokens=int(cfg.max_new_tokens), temperature=float(cfg.temperature),
        top_k=cfg.top_k, top_p=cfg.top_p, seed=int(cfg.seed), compile=bool(cfg.compile),
        prompt_seconds=first_at - start, decode_seconds=end - first_at, tokens_per_second=rate,
    )  # fmt: skip
    (run_dir / "generate.json").write_text(json.dumps(record, indent=1) + "\n")
    print(full)
    print(f"[mega-suite] {speed}")
    print(f"[mega-suite] wrote {run_dir / 'generate.txt'} and generate.json")
    return {"new_tokens": float(len(new)), "tokens_per_second": rate}
