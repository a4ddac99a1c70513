"""Ours beside the public pure-PyTorch port (pszemraj/megalodon-hf), same model, same run, alternating.

    python -m bench.peer --peer /path/to/megalodon-hf                  # 2K,4K,8K training, ingest, decode
    python -m bench.peer --peer /path/to/megalodon-hf --lengths 2K --rounds 3 --decode-tokens 50
    python -m bench.peer --peer /path/to/megalodon-hf --malloc tcmalloc   # both sides under tcmalloc

The port (Apache-2.0) is not vendored: give the path of a local checkout (``git clone
https://github.com/pszemraj/megalodon-hf``); without one the benchmark says so and exits 0. The port imports
``transformers`` for its config / output classes only; when transformers is not installed a minimal stand-in
(``PretrainedConfig`` = attribute bag, ``PreTrainedModel`` = ``nn.Module`` with ``post_init`` tying the
weights, the two output dataclasses) is put in ``sys.modules`` inside the port's processes (said in the output).

Model: ``megalodon_cpu_bench`` (4 layers, D 512, Z 128, E 1024, FFN 1024 SwiGLU, N 16, G 64, C 2048, V 512),
mapped to the port's config field by field (``PEER_FIELDS``). The port always ties its output head to the
embedding (V x D = 0.26M fewer parameters); everything else matches. fp32, batch 1, 2 threads (``--threads``).

Each measurement runs in a fresh spawned process (peak memory = its VmHWM, see ``bench/common.py``), ours
then theirs, for ``--rounds`` rounds; the ratio is printed per pair of runs, never against a figure taken at
another time. Measurements:

- training: forward on [1, L] random tokens, cross-entropy on the next tokens, backward, AdamW step; tokens/s
  of the best of ``--repeat`` steps after one warm-up step, peak RSS, and what training adds to the built
  model (the peak less the RSS before the first step: activations, gradients, AdamW's moments; torch's
  ≈ 0.55 GiB of mapped libraries and the weights, the same on both sides, left out);
- prompt ingest: ``--prompt`` tokens through the streaming cache in one call (no autograd), beside its
  compute floor (the forward's analytic matmul FLOPs at the fp32 ``torch.mm`` peak measured in the same
  process: a lower bound);
- decode: then ``--decode-tokens`` greedy single-token steps; median ms/token. The same process measures the
  fp32 weight-read floor (``weight_read_floor``: one GEMV over a matrix as large as all the model's weights)
  and, for ours, the same greedy steps through ``decode.StaticDecoder(compile=True)`` after a fresh ingest
  ("compiled"; its compile time is not counted).

``--malloc``: the allocator of every measuring process, both sides alike (``system``: glibc's malloc, the
default; ``tcmalloc`` / ``jemalloc``: preloaded as ``run.py`` does by default where tcmalloc is installed,
``mega_suite.tools.malloc``). The port's speed depends on it much more than ours (bench/reports/2026-11-24-tcmalloc.md).
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time
import types
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as `python bench/peer.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.nn.functional as F
from torch import nn

from bench.common import (
    Measurement,
    fmt_bytes,
    fmt_length,
    machine_description,
    markdown_table,
    measure,
    parse_lengths,
    peak_rss_bytes,
    reset_peak_rss,
    rss_bytes,
    run_isolated,
    setup_threads,
    weight_read_floor,
)
from mega_suite.tools import malloc

PRESET = "megalodon_cpu_bench"
# our config field -> the port's MegalodonConfig keyword (same meaning)
PEER_FIELDS = {
    "vocab_size": "vocab_size",
    "model_dim": "model_dim",
    "num_layers": "num_layers",
    "num_heads": "num_heads",
    "z_dim": "z_dim",
    "value_dim": "value_dim",
    "ffn_hidden_dim": "ffn_hidden_dim",
    "cema_ndim": "cema_ndim",
    "chunk_size": "chunk_size",
    "norm_num_groups": "norm_num_groups",
    "norm_eps": "norm_eps",
    "swiglu": "swiglu",
    "rope_base": "rope_base",
    "scale_emb": "scale_emb",
    "dropout": "dropout",
    "attention_dropout": "attention_dropout",
    "hidden_dropout": "hidden_dropout",
}


def peer_source(path: str | None) -> Path | None:
    """The directory holding the port's ``megalodon`` package (``PATH/src`` or ``PATH``), or None."""
    if not path:
        return None
    root = Path(path).expanduser()
    for cand in (root / "src", root):
        if (cand / "megalodon" / "modeling_megalodon.py").is_file():
            return cand
    return None


def _install_transformers_standin() -> str:
    """Put the few ``transformers`` names the port imports into ``sys.modules`` if it is not installed."""
    try:
        import transformers  # noqa: F401

        return "transformers " + getattr(transformers, "__version__", "stand-in")
    except ImportError:
        pass

    class PretrainedConfig:
        def __init__(self, **kwargs):
            self.use_return_dict = True
            for k, v in kwargs.items():
                setattr(self, k, v)

    class PreTrainedModel(nn.Module):
        def __init__(self, config, *args, **kwargs):
            super().__init__()
            self.config = config

        def post_init(self) -> None:
            self.tie_weights()

        def tie_weights(self) -> None:
            for m in self.modules():
                if hasattr(m, "_tie_weights"):
                    m._tie_weights()

    @dataclass
    class BaseModelOutputWithPast:
        last_hidden_state: object = None
        past_key_values: object = None
        hidden_states: object = None
        attentions: object = None

    @dataclass
    class CausalLMOutputWithPast:
        loss: object = None
        logits: object = None
        past_key_values: object = None
        hidden_states: object = None
        attentions: object = None

    tf, cu = types.ModuleType("transformers"), types.ModuleType("transformers.configuration_utils")
    ut, lg = types.ModuleType("transformers.utils"), types.ModuleType("transformers.utils.logging")
    mo = types.ModuleType("transformers.modeling_outputs")
    cu.PretrainedConfig = tf.PretrainedConfig = PretrainedConfig
    tf.PreTrainedModel = PreTrainedModel
    lg.get_logger = logging.getLogger
    ut.logging = lg
    mo.BaseModelOutputWithPast, mo.CausalLMOutputWithPast = BaseModelOutputWithPast, CausalLMOutputWithPast
    tf.configuration_utils, tf.utils, tf.modeling_outputs = cu, ut, mo
    sys.modules.update({
        "transformers": tf, "transformers.configuration_utils": cu, "transformers.utils": ut,
        "transformers.utils.logging": lg, "transformers.modeling_outputs": mo,
    })  # fmt: skip
    return "transformers not installed: minimal stand-in (config bag, nn.Module base, output dataclasses)"


class Side:
    """One implementation behind a common interface: build, logits of a full pass, streaming calls."""

    def __init__(self, which: str, peer: str | None):
        from mega_suite import create_model

        torch.manual_seed(0)
        ours = create_model(PRESET)
        self.which, self.vocab = which, ours.cfg.vocab_size
        if which == "ours":
            from mega_suite.models.megalodon.decode import Decoder

            self.model, self.note = ours, ""
            self.decoder = Decoder(ours)  # the one-token path for single-token streaming calls
            return
        self.note = _install_transformers_standin()
        sys.path.insert(0, str(peer_source(peer)))
        from megalodon import MegalodonConfig, MegalodonForCausalLM

        kwargs = {theirs: getattr(ours.cfg, mine) for mine, theirs in PEER_FIELDS.items()}
        del ours
        torch.manual_seed(0)
        self.model = MegalodonForCausalLM(MegalodonConfig(**kwargs))

    def logits(self, tokens):
        if self.which == "ours":
            return self.model(tokens)[0]
        return self.model(tokens, use_cache=False).logits

    def stream(self, tokens, cache):
        """(logits [B, L, V], cache) continuing ``cache`` (None: a new stream)."""
        if self.which == "ours":
            return self.decoder(tokens, cache)
        out = self.model(tokens, past_key_values=cache, use_cache=True)
        return out.logits, out.past_key_values


def bench_train(which: str, peer: str | None, length: int, warmup: int, repeat: int) -> Measurement:
    def build():
        side = Side(which, peer)
        side.model.train()
        opt = torch.optim.AdamW(side.model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)
        return side, opt, torch.randint(0, side.vocab, (1, length + 1))

    def step_of(state):
        side, opt, tokens = state

        def step():
            logits = side.logits(tokens[:, :-1])
            F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten()).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        return step

    m = measure(build, step_of, warmup, repeat)
    side = Side(which, peer)
    m.extra["params"] = sum(p.numel() for p in side.model.parameters())
    m.extra["note"] = side.note
    return m


def bench_stream(which: str, peer: str | None, prompt_len: int, new_tokens: int) -> Measurement:
    """Prompt ingest through the streaming cache, then greedy single-token decode; and the floor."""
    side = Side(which, peer)
    side.model.eval()
    floor = weight_read_floor(side.model)
    prompt = torch.randint(0, side.vocab, (1, prompt_len))
    baseline = rss_bytes()
    reset_peak_rss()
    times, ingest = [], []
    with torch.inference_mode():
        for _ in range(2):  # the second ingest is the timed one (first-call allocations)
            t0 = time.perf_counter()
            logits, cache = side.stream(prompt, None)
            ingest.append(time.perf_counter() - t0)
        token = logits[:, -1:].argmax(-1)
        for _ in range(new_tokens):
            t0 = time.perf_counter()
            logits, cache = side.stream(token, cache)
            token = logits[:, -1:].argmax(-1)
            times.append(time.perf_counter() - t0)
    extra = {"ingest_s": min(ingest), "floor_s": floor, "note": side.note}
    if (
        which == "ours"
    ):  # our fastest decode too: the compiled fixed-buffer step (bench/reports/2026-11-24-compiled-cpu-decode.md)
        from mega_suite.models.megalodon import decode

        with torch.no_grad():
            logits, cache = side.stream(prompt, None)
            dec = decode.StaticDecoder(side.decoder, cache, compile=True)
            token, compiled = logits[:, -1].argmax(-1), []
            for _ in range(new_tokens):
                t0 = time.perf_counter()
                token = dec.step(token).argmax(-1)
                compiled.append(time.perf_counter() - t0)
        extra["compiled_s"] = statistics.median(compiled)
        # the ingest's compute floor: its matmul FLOPs (forward = a third of the training count: the dense
        # weights, 2 per weight per token, and causal attention within the chunk) at the fp32 peak of a
        # 4096^3 torch.mm measured now -- a lower bound, since the model's narrower GEMMs run below that peak
        from bench.cpu_bar import matmul_peak_gflops
        from mega_suite.models.megalodon import flops_per_token

        forward = flops_per_token(side.model.cfg, prompt_len) / 3 * prompt_len
        extra["ingest_floor_s"] = forward / (matmul_peak_gflops() * 1e9)
    return Measurement(times=times, baseline_bytes=baseline, peak_bytes=peak_rss_bytes(), extra=extra)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--peer", default=None, help="path of a local megalodon-hf checkout (the port)")
    ap.add_argument("--lengths", default="2K,4K,8K", help="training lengths (comma list; '' to skip)")
    ap.add_argument("--rounds", type=int, default=2, help="ours / theirs pairs per configuration")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=1, help="timed training steps per run (best is reported)")
    ap.add_argument("--prompt", type=int, default=512, help="prompt tokens ingested before decoding")
    ap.add_argument("--decode-tokens", type=int, default=100)
    ap.add_argument("--mem-cap-gb", type=float, default=18.0)
    ap.add_argument("--threads", type=int, default=2, help="torch threads of both sides")
    ap.add_argument("--malloc", default="system", choices=("system", *malloc.LIBRARIES))
    args = ap.parse_args()
    src = peer_source(args.peer)
    if src is None:
        print(
            f"bench/peer.py: no megalodon-hf checkout at --peer {args.peer!r} (expected "
            "PATH/src/megalodon/modeling_megalodon.py); clone https://github.com/pszemraj/megalodon-hf "
            "and pass its path. Skipped."
        )
        return
    setup_threads(args.threads)
    # every measuring process is spawned (a fresh interpreter): it starts under the environment's allocator
    for key in ("LD_PRELOAD", malloc.MARK):
        os.environ.pop(key, None)
    lib = None if args.malloc == "system" else malloc.find(args.malloc)
    if args.malloc != "system" and lib is None:
        sys.exit(f"--malloc {args.malloc}: not installed (no {' / '.join(malloc.LIBRARIES[args.malloc])})")
    if lib is not None:
        os.environ.update(malloc.restart_env(dict(os.environ), lib))
    print(f"# bench/peer.py  ({' '.join(sys.argv[1:])})")
    print(machine_description(args.threads))
    print(f"port: {src}")
    print(f"allocator of both sides: {lib or 'glibc malloc'}")
    peer = str(args.peer)

    def pair(fn, **kw) -> list[tuple[Measurement, Measurement]]:
        out = []
        for _ in range(args.rounds):
            a = run_isolated(fn, args.mem_cap_gb, args.threads, which="ours", peer=peer, **kw)
            b = run_isolated(fn, args.mem_cap_gb, args.threads, which="peer", peer=peer, **kw)
            for m in (a, b):
                if not m.ok:
                    print(f"  run failed: {m.status} {m.message}", flush=True)
            out.append((a, b))
        return out

    lengths = parse_lengths(args.lengths) if args.lengths else []
    rows, notes = [], set()
    for length in lengths:
        for i, (a, b) in enumerate(pair(bench_train, length=length, warmup=args.warmup, repeat=args.repeat)):
            if not (a.ok and b.ok):
                rows.append([fmt_length(length), str(i + 1), a.status, b.status] + ["-"] * 7)
                continue
            notes.add(b.extra["note"])
            ta, tb = length / a.best, length / b.best
            # what training adds to the built model: activations, gradients, AdamW's two moments and the
            # allocator's slack -- the process peak less its RSS before the first step (torch's libraries,
            # the imports and the weights, the same on both sides)
            ga, gb = a.delta_bytes, b.delta_bytes
            reset = a.extra.get("hwm_reset", True) and b.extra.get("hwm_reset", True)
            added = (
                (fmt_bytes(ga), fmt_bytes(gb), f"{ga / gb:.2f}") if reset else ("n/a: peak not reset",) * 3
            )
            rows.append([
                fmt_length(length), str(i + 1), f"{ta:.0f}", f"{tb:.0f}", f"{ta / tb:.2f}x",
                fmt_bytes(a.peak_bytes), fmt_bytes(b.peak_bytes), f"{a.peak_bytes / b.peak_bytes:.2f}",
                *added,
            ])  # fmt: skip
            print("  " + " | ".join(rows[-1]), flush=True)
    srows = []
    for i, (a, b) in enumerate(pair(bench_stream, prompt_len=args.prompt, new_tokens=args.decode_tokens)):
        if not (a.ok and b.ok):
            srows.append([str(i + 1), a.status, b.status] + ["-"] * 12)  # 15 columns
            continue
        notes.add(b.extra["note"])
        ia, ib = a.extra["ingest_s"], b.extra["ingest_s"]
        da, db, dc = a.median * 1e3, b.median * 1e3, a.extra["compiled_s"] * 1e3
        fl = a.extra["floor_s"] * 1e3
        fi = a.extra["ingest_floor_s"]
        srows.append([
            str(i + 1), f"{ia:.3f} s", f"{ib:.3f} s", f"{ib / ia:.2f}x", f"{fi:.3f} s", f"{ia / fi:.2f}x",
            f"{ib / fi:.2f}x", f"{da:.2f}", f"{dc:.2f}", f"{db:.2f}",
            f"{da / db:.2f}", f"{dc / db:.2f}", f"{fl:.2f}", f"{da / fl:.2f}x", f"{dc / fl:.2f}x",
        ])  # fmt: skip
        print("  " + " | ".join(srows[-1]), flush=True)

    print(f"\nModel {PRESET} (ours) and the port with the same config; fp32, batch 1. {'; '.join(notes)}.\n")
    if rows:
        print(
            f"Training (best of {args.repeat} step(s) after {args.warmup} warm-up; peak = VmHWM of a fresh "
            "process; added = the peak less the process's RSS once the model is built, before the first "
            "step), one row per ours / port pair:\n"
        )
        print(markdown_table(
            ["L", "pair", "ours tok/s", "port tok/s", "speed ours/port", "ours peak", "port peak", "mem ours/port",
             "ours added", "port added", "added ours/port"],
            rows,
        ))  # fmt: skip
    print(
        f"\nPrompt ingest ({args.prompt} tokens, one streaming call, no autograd) and greedy decode "
        f"({args.decode_tokens} single-token steps, median); ingest floor = the prompt's forward matmul "
        "FLOPs at the fp32 peak of a 4096^3 torch.mm, decode floor = one fp32 GEMV over all weights, both "
        "measured in ours' process:\n"
    )
    print(markdown_table(
        ["pair", "ours ingest", "port ingest", "ingest port/ours", "ingest floor", "ours / floor", "port / floor",
         "ours ms/tok", "ours compiled ms/tok",
         "port ms/tok", "decode ours/port", "compiled/port", "fp32 floor ms", "ours / floor",
         "compiled / floor"],
        srows,
    ))  # fmt: skip


if __name__ == "__main__":
    main()
