"""Chunk attention on a GPU: materialised probabilities vs the fused flash-style kernel vs SDPA.

    python -m bench.attention_gpu              # CUDA: time every path; without CUDA: the FLOP table only
    python -m bench.attention_gpu --flops      # the FLOP table only (any machine)

Shapes are the 7B preset's at 4K (B 1, h 4, L = C = 4096, dk 256, bf16, causal) with dv 256 (SDPA's flash /
cuDNN kernels apply: dk == dv) and dv 2048 (the model's value width). Each path is timed forward and
forward + backward (``triton.testing.do_bench`` medians). The yardstick is the minimal FLOPs: the (query, key)
pairs a chunk needs (the lower triangle when causal), 2 FLOPs per multiply-add, QKᵀ and PV forward and four
products backward (dV, dP, dQ, dK), so forward + backward = 3x forward; no recomputation counted. "/ GEMM" divides
the rate so achieved by a dense bf16 GEMM's (n = 8192) measured in the same process. The probs path's own
FLOPs (its row-block rectangles, the recomputed QKᵀ) are printed beside it.

Targets (issue 29): forward + backward at dv 2048 >= 50% of the GEMM rate; at dv 256 <= 1.1x SDPA.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as `python bench/attention_gpu.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

# (B, h, L, C, dk, dv): the 7B at 4K with the SDPA-comparable value width and the model's own.
SHAPES = [(1, 4, 4096, 4096, 256, 256), (1, 4, 4096, 4096, 256, 2048)]
TARGET_FRACTION_DV2048 = 0.5
TARGET_SDPA_RATIO_DV256 = 1.1


def _chunk_sizes(length: int, chunk: int) -> list[int]:
    c = min(chunk, length)
    return [c] * (length // c) + ([length % c] if length % c else [])


def minimal_flops(batch: int, heads: int, length: int, chunk: int, dk: int, dv: int, causal: bool) -> int:
    """Forward + backward FLOPs of chunked attention counting only the (query, key) pairs a chunk needs:
    forward QKᵀ (dk) and PV (dv), backward dV, dP (dv each), dQ, dK (dk each): 3x the forward."""
    pairs = sum(n * (n + 1) // 2 if causal else n * n for n in _chunk_sizes(length, chunk))
    return 2 * batch * heads * pairs * 3 * (dk + dv)


def executed_probs_flops(
    batch: int, heads: int, length: int, chunk: int, dk: int, dv: int, causal: bool, row_block: int,
    recompute: bool = True,
) -> int:  # fmt: skip
    """FLOPs the probs path's GEMMs execute: per chunk (a ragged last one padded to c), the row blocks'
    rectangles (causal) or the square; forward QKᵀ + PV, backward dP, dV, dQ, dK and (recompute) QKᵀ again."""
    c = min(chunk, length)
    nc = math.ceil(length / c)
    if causal:
        logits = sum((min(c, r0 + row_block) - r0) * min(c, r0 + row_block) for r0 in range(0, c, row_block))
    else:
        logits = c * c
    per_logit = (dk + dv) + (2 * dv + 2 * dk) + (dk if recompute else 0)
    return 2 * batch * heads * nc * logits * per_logit


def flop_rows() -> list[list[str]]:
    from kernels.attention.probs import default_row_block

    rows = []
    for b, h, length, chunk, dk, dv in SHAPES:
        c = min(chunk, length)
        rb = default_row_block(c, True)
        mini = minimal_flops(b, h, length, chunk, dk, dv, True)
        done = executed_probs_flops(b, h, length, chunk, dk, dv, True, rb)
        square = executed_probs_flops(b, h, length, chunk, dk, dv, True, c)
        rows.append([_shape(b, h, length, chunk, dk, dv), f"{mini / 1e9:.1f}", f"{rb}",
                     f"{done / 1e9:.1f} ({done / mini:.2f}x)", f"{square / 1e9:.1f} ({square / mini:.2f}x)"])  # fmt: skip
    return rows


def _shape(b, h, length, chunk, dk, dv) -> str:
    return f"B{b} h{h} L{length} C{chunk} dk{dk} dv{dv} causal"


def _table(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


# ------------------------------------------------------------------------------------------------ GPU


def gemm_tflops(dtype: torch.dtype = torch.bfloat16, n: int = 8192) -> float:
    """Measured TFLOP/s of a dense n x n x n GEMM in ``dtype``."""
    import triton.testing

    a = torch.randn(n, n, device="cuda", dtype=dtype)
    b = torch.randn(n, n, device="cuda", dtype=dtype)
    ms = triton.testing.do_bench(lambda: a @ b, return_mode="median")
    return 2 * n**3 / (ms * 1e-3) / 1e12


def _median_ms(fn, grad_to_none=None) -> float | None:
    import triton.testing

    try:
        return triton.testing.do_bench(fn, grad_to_none=grad_to_none, return_mode="median")
    except (RuntimeError, ValueError, torch.OutOfMemoryError) as e:
        print(f"    skipped: {type(e).__name__}: {str(e).splitlines()[0][:160]}", flush=True)
        torch.cuda.empty_cache()
        return None


def _sdpa_split_v(q, k, v, chunk, causal):
    """SDPA with the value width cut into tiles of dk (its fused kernels need dk == dv): each call recomputes
    QKᵀ and the softmax, as the fused Triton kernel does per value tile."""
    from kernels.attention import sdpa

    dk = q.shape[-1]
    return torch.cat([sdpa.chunk_attention(q, k, vt, chunk, causal) for vt in v.split(dk, -1)], -1)


def _paths(dk: int, dv: int, c: int) -> dict:
    from kernels.attention import probs, sdpa
    from kernels.attention import triton as fused

    rb = probs.default_row_block(c, True)
    paths = {
        f"probs (recompute P, row_block {rb})": lambda q, k, v, C: probs.chunk_attention(q, k, v, C, True),
        f"probs (saved P, row_block {rb})": lambda q, k, v, C: probs.chunk_attention(
            q, k, v, C, True, save_probs=True
        ),
        "probs (recompute P, one square)": lambda q, k, v, C: probs.chunk_attention(
            q, k, v, C, True, row_block=c
        ),
        "probs (recompute P, row_block 512)": lambda q, k, v, C: probs.chunk_attention(
            q, k, v, C, True, row_block=512
        ),
        "fused Triton (flash-style)": lambda q, k, v, C: fused.chunk_attention(q, k, v, C, True),
    }
    if dk == dv:
        paths["SDPA per chunk"] = lambda q, k, v, C: sdpa.chunk_attention(q, k, v, C, True)
    else:
        paths[f"SDPA, V in {dv // dk} tiles"] = lambda q, k, v, C: _sdpa_split_v(q, k, v, C, True)
    return paths


def bench(dtype: torch.dtype = torch.bfloat16) -> list[str]:
    """Time every path at every shape; returns the target lines."""
    peak = gemm_tflops(dtype)
    print(f"\ndense {dtype} GEMM (n 8192): {peak:.0f} TFLOP/s\n", flush=True)
    headers = ["shape", "path", "fwd ms", "fwd+bwd ms", "minimal GFLOP", "TFLOP/s (minimal)", "/ GEMM"]
    rows, targets = [], []
    for b, h, length, chunk, dk, dv in SHAPES:
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k = (
            torch.randn(b, length, h, dk, device="cuda", dtype=dtype, generator=g) / dk**0.25 for _ in "qk"
        )
        v = torch.randn(b, length, h, dv, device="cuda", dtype=dtype, generator=g)
        do = torch.randn_like(v)
        leaves = [t.requires_grad_() for t in (q, k, v)]
        flops = minimal_flops(b, h, length, chunk, dk, dv, True)
        times = {}
        for name, fn in _paths(dk, dv, min(chunk, length)).items():
            with torch.no_grad():
                fwd = _median_ms(lambda fn=fn, a=leaves, c=chunk: fn(*a, c))
            both = _median_ms(
                lambda fn=fn, a=leaves, c=chunk, ct=do: fn(*a, c).backward(ct), grad_to_none=leaves
            )
            times[name] = both
            rate = None if both is None else flops / (both * 1e-3) / 1e12
            rows.append([_shape(b, h, length, chunk, dk, dv), name, "-" if fwd is None else f"{fwd:.3f}",
                         "-" if both is None else f"{both:.3f}", f"{flops / 1e9:.1f}",
                         "-" if rate is None else f"{rate:.0f}", "-" if rate is None else f"{rate / peak:.0%}"])  # fmt: skip
            print(" | ".join(rows[-1]), flush=True)
            torch.cuda.empty_cache()
        timed = [(t, n) for n, t in times.items() if t is not None and n.startswith("probs")]
        if not timed:
            continue
        best = min(timed)
        if dv == 2048:
            frac = flops / (best[0] * 1e-3) / 1e12 / peak
            targets.append(f"dv 2048: best probs ({best[1]}) {frac:.0%} of the GEMM rate "
                           f"(target >= {TARGET_FRACTION_DV2048:.0%})")  # fmt: skip
        sdpa_ms = times.get("SDPA per chunk")
        if dv == dk and sdpa_ms:
            for name in ("fused Triton (flash-style)", best[1]):
                if times.get(name):
                    targets.append(f"dv {dv}: {name} {times[name] / sdpa_ms:.2f}x SDPA "
                                   f"(target <= {TARGET_SDPA_RATIO_DV256}x)")  # fmt: skip
    print()
    print(_table(headers, rows))
    return targets


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--flops", action="store_true", help="print the FLOP table only")
    args = parser.parse_args(argv)
    headers = ["shape", "minimal GFLOP (fwd+bwd)", "row_block", "probs executes GFLOP", "one square GFLOP"]
    print(_table(headers, flop_rows()))
    if args.flops:
        return 0
    if not torch.cuda.is_available():
        print("\nbench.attention_gpu times GPU kernels: no CUDA device here, FLOP table only.")
        return 0
    print(f"\n# {torch.cuda.get_device_name()} | torch {torch.__version__}")
    for line in bench():
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
