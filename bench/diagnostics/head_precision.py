"""What the float32 logits head costs a training step, beside the same head with TF32 or bf16 matmuls.

    python -m bench.diagnostics.head_precision                                   # megalodon_7b's head, 4096 tokens, CUDA
    python -m bench.diagnostics.head_precision --device cpu --preset megalodon_cpu_bench --tokens 2048 --vocab 4000

docs/architecture.md#language-model has the logits in float32, and the suite computes the output projection in float32 under autocast
(``OutputProjection``, a float32 island), then the cross-entropy. Its matmul is 6·D·V FLOPs per token in
training (forward, and the two products of backward) against ≈ 6 x the parameters for the model: for the 7B
(D 4096, V 32000) 0.79 of 47 GFLOP per token at 4K, 1.7%. On a GPU without TF32 a float32 matmul runs about
an order of magnitude below bf16 tensor-core speed (and Lightning warns that TF32 is off), so those 1.7% of
the FLOPs may be a large share of the step time. Measured here, one process, alternating, median of
``--repeat`` (CUDA: after a synchronise):

- ``float32``: the head as trained (``F.linear`` in float32, cross-entropy in float32), forward + backward;
- ``float32, TF32`` (CUDA only): the same with ``torch.backends.cuda.matmul.allow_tf32`` (``torch.
  set_float32_matmul_precision("high")``), set around this measurement only;
- ``bf16 matmul``: the projection under bf16 autocast, the logits cast to float32 for the loss.

Beside them: the speed of one of the step's own GEMMs (the FFN's [tokens, D] x [D, F] in bf16) times the
rest of one training step's FLOPs (``flops_per_token`` of the architecture at ``--tokens`` tokens, less the
head's), so that each head's time reads as a share of a step running at that speed: an estimate (the step
also has attention, norms and elementwise work, which make the head's real share smaller), not a measured
step.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import torch.nn.functional as F

from bench.common import machine_description, markdown_table


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def _tf32(enabled: bool):
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = enabled
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous


def head_step(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, mode: str) -> None:
    """Forward and backward of logits = hidden Wᵀ and the mean cross-entropy, as ``mode`` computes them."""
    device = hidden.device.type
    with _tf32(mode == "float32, TF32"):  # read by each matmul as it runs: backward's two as well
        with torch.autocast(device, torch.bfloat16, enabled=mode == "bf16 matmul"):
            logits = F.linear(hidden, weight)
        F.cross_entropy(logits.float(), target).backward()


def timed(fn, device: torch.device) -> float:
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="megalodon_7b", help="the model whose D, V and FLOPs are used")
    ap.add_argument("--vocab", type=int, default=None, help="override the preset's vocabulary size")
    ap.add_argument("--dim", type=int, default=None, help="override the preset's model width D")
    ap.add_argument(
        "--tokens", type=int, default=4096, help="tokens per step, as one sequence (its length sets the "
        "attention context in the step's FLOP count)",
    )  # fmt: skip
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--out", type=Path, default=None, help="also write the Markdown table here")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device here (use --device cpu for a smoke run)")
    if args.tokens < 1 or args.repeat < 1:
        ap.error(f"--tokens {args.tokens} and --repeat {args.repeat} must be >= 1")
    from mega_suite.models import arch_of, get_config

    overrides = {"vocab_size": args.vocab, "model_dim": args.dim}
    cfg = get_config(args.preset, **{key: val for key, val in overrides.items() if val is not None})
    d, v, n = cfg.model_dim, cfg.vocab_size, args.tokens
    step_flops = arch_of(cfg).flops_per_token(cfg, n) * n
    head_flops = 6 * d * v * n

    gen = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(n, d, device=device, generator=gen).requires_grad_()
    weight = (torch.randn(v, d, device=device, generator=gen) * d**-0.5).requires_grad_()
    target = torch.randint(0, v, (n,), device=device, generator=gen)
    # the speed of a GEMM the step has: the FFN's first projection, [n, D] @ [D, F] in bf16
    f = getattr(cfg, "ffn_hidden_dim", 4 * d)
    a = torch.randn(n, d, device=device, dtype=torch.bfloat16, generator=gen)
    b = torch.randn(d, f, device=device, dtype=torch.bfloat16, generator=gen)
    modes = ["float32"] + (["float32, TF32"] if device.type == "cuda" else []) + ["bf16 matmul"]

    def clear():
        hidden.grad = weight.grad = None

    fns = {m: (lambda m=m: (clear(), head_step(hidden, weight, target, m))) for m in modes}
    fns["bf16 GEMM"] = lambda: torch.mm(a, b)
    times = {name: [] for name in fns}
    for fn in fns.values():  # warm-up: allocations, library handles
        fn()
    for _ in range(args.repeat):
        for name, fn in fns.items():
            times[name].append(timed(fn, device))
    med = {name: statistics.median(t) for name, t in times.items()}
    rate = 2 * n * d * f / med.pop("bf16 GEMM")  # FLOP/s of the step's bf16 GEMM
    body_s = (step_flops - head_flops) / rate  # the rest of the step at that speed

    print(
        f"# python -m bench.diagnostics.head_precision {' '.join(argv if argv is not None else sys.argv[1:])}"
    )
    print(
        machine_description(torch.get_num_threads()) if device.type == "cpu" else torch.cuda.get_device_name()
    )
    lines = [
        f"\n{args.preset}: D {d}, V {v}, {n} tokens per step; head 6·D·V = {head_flops / n / 1e9:.3f} GFLOP per "
        f"token of the step's {step_flops / n / 1e9:.2f} ({100 * head_flops / step_flops:.1f}%); the rest of "
        f"the step's FLOPs at the speed of its [{n}, {d}] x [{d}, {f}] bf16 GEMM ({rate / 1e12:.2f} TFLOP/s "
        f"here): {body_s * 1e3:.1f} ms.\n"
    ]
    rows = []
    for name in modes:
        s = med[name]
        rows.append([
            name, f"{s * 1e3:.2f}", f"{head_flops / s / 1e12:.2f}", f"{s / med['bf16 matmul']:.2f}x",
            f"{100 * s / (body_s + s):.0f}%",
        ])  # fmt: skip
    table = markdown_table(
        ["head", "ms (fwd + bwd + loss)", "TFLOP/s", "x bf16 matmul", "share of a step (estimate)"], rows
    )
    lines.append(table)
    text = "\n".join(lines)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
