"""One Megalodon block vs one Llama-style block: forward + backward time and peak memory on CPU.

    python -m bench.block                      # L = 4K, 8K, 16K, 32K (about 5 minutes on 2 cores)
    python -m bench.block --quick              # L = 1K, 2K, one timed iteration
    python -m bench.block --glibc-no-mmap      # full run, malloc keeps freed blocks (bench/reports/2026-11-22-cpu-baseline.md)
    python -m bench.block --lengths 4K,8K --repeat 3

Megalodon: ``mega_suite.models.megalodon.block.MegalodonBlock``, LM form, D 512, Z 128, E 1024, FFN 1024 SwiGLU, N 16,
h 1, chunk C = 4096, fp32, batch 1 (the ``megalodon_cpu_bench`` preset with C overridden).
Llama: RMSNorm -> q/k/v/o projections of width D -> RoPE -> causal full attention through
``F.scaled_dot_product_attention(is_causal=True)`` -> RMSNorm -> SwiGLU FFN of the same width F.

Each (model, L) runs in a fresh process (peak memory, see ``bench/common.py``); the step is forward, then
backward of a fixed random cotangent into the input and every parameter (gradients reset to None).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as `python bench/block.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from bench.common import (
    GLIBC_NO_MMAP,
    Measurement,
    fmt_bytes,
    fmt_length,
    fmt_ratio,
    fmt_time,
    machine_description,
    markdown_table,
    measure,
    met,
    parse_lengths,
    run_isolated,
    setup_threads,
    use_glibc_no_mmap,
)

# Targets of the issue for one block (reported, not enforced).
TARGET_TIME_SCALING = 9.0  # Megalodon time(32K) / time(4K)
TARGET_MEM_SCALING = 9.0  # Megalodon mem(32K) / mem(4K)
TARGET_SPEEDUP_LONG = 2.0  # at 32K: Llama time / Megalodon time >= 2
TARGET_SLOWDOWN_SHORT = 1.3  # at 4K: Megalodon time / Llama time <= 1.3


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + self.eps) * self.weight


class LlamaBlock(nn.Module):
    """x + Attn(RMSNorm(x)), then + SwiGLU(RMSNorm(.)); rotate-half RoPE, causal SDPA over the full L."""

    def __init__(self, dim: int = 512, heads: int = 8, ffn_dim: int = 1024, rope_base: float = 10000.0):
        super().__init__()
        self.heads, self.head_dim, self.rope_base = heads, dim // heads, rope_base
        self.attn_norm, self.ffn_norm = RMSNorm(dim), RMSNorm(dim)
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))
        self.w1 = nn.Linear(dim, ffn_dim, bias=False)
        self.w3 = nn.Linear(dim, ffn_dim, bias=False)
        self.w2 = nn.Linear(ffn_dim, dim, bias=False)
        self._rope_cache: dict[tuple[int, torch.device], tuple[Tensor, Tensor]] = {}

    def _cos_sin(self, length: int, device: torch.device) -> tuple[Tensor, Tensor]:
        key = (length, device)
        if key not in self._rope_cache:  # precomputed once per length and device, as Llama code does
            d = self.head_dim
            inv_freq = self.rope_base ** (-torch.arange(0, d, 2, dtype=torch.float32, device=device) / d)
            angle = torch.arange(length, dtype=torch.float32, device=device)[:, None] * inv_freq
            angle = torch.cat([angle, angle], -1)  # [L, d]
            self._rope_cache[key] = (angle.cos(), angle.sin())
        return self._rope_cache[key]

    @staticmethod
    def _rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        x1, x2 = x.chunk(2, -1)
        return x * cos + torch.cat([-x2, x1], -1) * sin

    def forward(self, x: Tensor) -> Tensor:
        b, length, dim = x.shape
        h = self.attn_norm(x)
        q, k, v = (
            w(h).view(b, length, self.heads, self.head_dim).transpose(1, 2)
            for w in (self.wq, self.wk, self.wv)
        )
        cos, sin = self._cos_sin(length, x.device)
        q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.wo(o.transpose(1, 2).reshape(b, length, dim))
        u = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(u)) * self.w3(u))


# The 7B widths (GPU check): Megalodon's ``megalodon_7b`` block against a Llama-2-7B block (D 4096,
# 32 heads of 128, SwiGLU FFN 11008).
LLAMA_7B = dict(dim=4096, heads=32, ffn_dim=11008)


def build_block(
    kind: str,
    chunk_size: int,
    llama_heads: int,
    preset: str = "megalodon_cpu_bench",
    llama: dict | None = None,
) -> nn.Module:
    """Megalodon: one block of ``preset`` with chunk C = ``chunk_size``; Llama: ``llama`` (dim, heads,
    ffn_dim), by default the CPU-bench widths D 512, F 1024 with ``llama_heads`` heads."""
    if kind == "megalodon":
        from mega_suite import get_config
        from mega_suite.models.megalodon.block import MegalodonBlock

        return MegalodonBlock(get_config(preset, chunk_size=chunk_size))
    return LlamaBlock(**(llama or dict(dim=512, heads=llama_heads, ffn_dim=1024)))


def bench_block(
    kind: str, length: int, chunk_size: int, llama_heads: int, warmup: int, repeat: int
) -> Measurement:
    """In a fresh process: forward + backward of one block on [1, L, 512] fp32."""

    def build():
        torch.manual_seed(0)
        block = build_block(kind, chunk_size, llama_heads)
        x = torch.randn(1, length, 512, requires_grad=True)
        cotangent = torch.randn(1, length, 512)
        return block, x, cotangent

    def step_of(state):
        block, x, cotangent = state

        def step():
            out = block(x)
            out = out[0] if isinstance(out, tuple) else out
            out.backward(cotangent)
            x.grad = None
            block.zero_grad(set_to_none=True)

        return step

    m = measure(build, step_of, warmup, repeat)
    m.extra["params"] = sum(p.numel() for p in build_block(kind, chunk_size, llama_heads).parameters())
    return m


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--lengths",
        default=None,
        help="comma list (default 4K,8K,16K,32K; --quick: 1K,2K), e.g. 4K,8K,16384",
    )
    ap.add_argument("--chunk-size", type=int, default=4096, help="Megalodon attention chunk C")
    ap.add_argument("--llama-heads", type=int, default=8, help="Llama heads (head width D / heads)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=2, help="timed iterations (best is reported)")
    ap.add_argument("--mem-cap-gb", type=float, default=16.0, help="abort a run whose RSS exceeds this")
    ap.add_argument(
        "--glibc-no-mmap",
        action="store_true",
        help=f"run the measurements with GLIBC_TUNABLES={GLIBC_NO_MMAP}",
    )
    ap.add_argument("--quick", action="store_true", help="L = 1K, 2K, one timed iteration (smoke run)")
    args = ap.parse_args()
    if args.quick:
        args.repeat = 1
    if args.lengths is None:
        args.lengths = "1K,2K" if args.quick else "4K,8K,16K,32K"
    lengths = parse_lengths(args.lengths)
    setup_threads()
    if args.glibc_no_mmap:
        use_glibc_no_mmap()

    print(f"# bench/block.py  ({' '.join(sys.argv[1:]) or 'defaults'})")
    print(machine_description())
    res: dict[tuple[str, int], Measurement] = {}
    for length in lengths:
        for kind in ("megalodon", "llama"):
            m = run_isolated(
                bench_block, args.mem_cap_gb, kind=kind, length=length, chunk_size=args.chunk_size,
                llama_heads=args.llama_heads, warmup=args.warmup, repeat=args.repeat,
            )  # fmt: skip
            res[kind, length] = m
            shown = (
                f"best {fmt_time(m.best)} of {len(m.times)}, peak +{fmt_bytes(m.delta_bytes, 'MiB')}, "
                f"CPU util {m.cpu_utilisation:.2f}, sys {100 * m.sys_share:.0f}%"
                if m.ok
                else m.status
            )
            print(f"  {kind:9s} L={fmt_length(length):>4s}: {shown}", flush=True)
            if m.status == "error":
                print(m.message)

    def t(kind, length):
        m = res.get((kind, length))
        return m.best if m is not None and m.ok else None

    def mem(kind, length):
        m = res.get((kind, length))
        return m.delta_bytes if m is not None and m.ok else None

    def ratio(a, b):
        return a / b if a is not None and b is not None else None

    params = {
        k: next((m.extra.get("params") for (kk, _), m in res.items() if kk == k and m.ok), None)
        for k in ("megalodon", "llama")
    }
    print(
        f"\nOne block, fp32, batch 1, forward + backward; Megalodon C = {args.chunk_size} "
        f"({params['megalodon'] / 1e6:.2f}M params), Llama {args.llama_heads} heads "
        f"({params['llama'] / 1e6:.2f}M params). Time: best of {args.repeat} after {args.warmup} warm-up; "
        "memory: peak RSS minus RSS after construction, fresh process per cell. "
        "CPU util = CPU s / wall s (2.0 = both cores busy; lower = contention or serial code).\n"
        if params["megalodon"] and params["llama"]
        else ""
    )
    rows = []
    for length in lengths:
        tm, tl, mm, ml = (
            t("megalodon", length),
            t("llama", length),
            mem("megalodon", length),
            mem("llama", length),
        )
        rows.append([
            fmt_length(length),
            fmt_time(tm) if tm else res["megalodon", length].status,
            fmt_time(tl) if tl else res["llama", length].status,
            fmt_ratio(ratio(tm, tl)),
            f"{length / tm:.0f}" if tm else "-",
            f"{length / tl:.0f}" if tl else "-",
            fmt_bytes(mm, "MiB"),
            fmt_bytes(ml, "MiB"),
            fmt_ratio(ratio(mm, ml)),
            "/".join(f"{res[k, length].cpu_utilisation:.1f}" if res[k, length].ok else "-" for k in ("megalodon", "llama")),
        ])  # fmt: skip
    print(markdown_table(
        ["L", "Megalodon time", "Llama time", "time M/L", "M tok/s", "L tok/s", "Megalodon mem", "Llama mem", "mem M/L", "CPU util M/L"],
        rows,
    ))  # fmt: skip

    lo, hi = min(lengths), max(lengths)
    if lo == hi:
        return
    span = f"{fmt_length(hi)}/{fmt_length(lo)}"
    print(f"\nScaling from {fmt_length(lo)} to {fmt_length(hi)} (length x{hi / lo:g}):\n")
    print(markdown_table(
        ["block", f"time({span})", f"mem({span})"],
        [[k, fmt_ratio(ratio(t(k, hi), t(k, lo))), fmt_ratio(ratio(mem(k, hi), mem(k, lo)))] for k in ("megalodon", "llama")],
    ))  # fmt: skip

    if (lo, hi) == (4096, 32768):
        ts, ms = (
            ratio(t("megalodon", hi), t("megalodon", lo)),
            ratio(mem("megalodon", hi), mem("megalodon", lo)),
        )
        speed32, slow4 = ratio(t("llama", hi), t("megalodon", hi)), ratio(t("megalodon", lo), t("llama", lo))
        print("\nTargets of the issue:\n")
        checks = [
            (f"Megalodon time(32K)/time(4K) <= {TARGET_TIME_SCALING:g}", ts, ts is not None and ts <= TARGET_TIME_SCALING),
            (f"Megalodon mem(32K)/mem(4K) <= {TARGET_MEM_SCALING:g}", ms, ms is not None and ms <= TARGET_MEM_SCALING),
            (f"32K: Megalodon >= {TARGET_SPEEDUP_LONG:g}x faster than Llama", speed32, speed32 is not None and speed32 >= TARGET_SPEEDUP_LONG),
            (f"4K: Megalodon <= {TARGET_SLOWDOWN_SHORT:g}x slower than Llama", slow4, slow4 is not None and slow4 <= TARGET_SLOWDOWN_SHORT),
        ]  # fmt: skip
        print(
            markdown_table(
                ["target", "measured", "status"], [[n, fmt_ratio(v), met(ok)] for n, v, ok in checks]
            )
        )


if __name__ == "__main__":
    main()
