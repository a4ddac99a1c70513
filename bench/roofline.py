"""Analytic FLOPs and bytes of the kernels and the block at the 7B widths: the roofline beside every GPU figure.

    python -m bench.roofline                  # the table against the H100 SXM spec sheet (any machine)
    python -m bench.gpu_bench --roofline-only # the same table, from the GPU benchmark's entry point

Pure Python (no torch), so the table prints on any machine. On a GPU, ``bench.gpu_bench`` measures the
ceilings in its own process (device copy bandwidth, dense bf16 GEMM rate, float32 SGEMM rate) and divides
each measured time by the floor computed here.

Conventions (docs/kernels.md#gpu-benchmark):

- **FLOPs** are the minimal arithmetic of the maths, 2 per multiply-add, forward + backward; nothing an
  implementation recomputes is counted. ``flops`` run on the tensor cores (GEMMs, attention: the bf16 GEMM
  rate bounds them); ``simt_flops`` on the CUDA cores in float32 (scans, norms: the float32 rate bounds them).
- **Bytes** are the minimal traffic through device memory: each kernel reads its inputs once and writes its
  outputs once; a backward reads what its forward saved. Activations are bf16 (2 bytes) except inside the
  float32 islands (TimestepNorm and CEMA run on float32 in the model).
- **Floor** of a piece of work = max(flops / bf16 rate + simt_flops / float32 rate, bytes / copy bandwidth):
  no implementation runs faster. For a block, ``parts_floor_s`` adds the parts' own floors instead (its
  kernels run one after another, so a memory-bound part cannot hide under a GEMM): the tighter bound.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field

# ------------------------------------------------------------------------------------------------ ceilings


@dataclass(frozen=True)
class Ceilings:
    """The three rates a floor divides by, and where they come from."""

    copy_bytes_per_s: float  # device-to-device copy, bytes read + written per second
    bf16_flops_per_s: float  # dense bf16 GEMM (tensor cores)
    fp32_flops_per_s: float  # float32 SIMT arithmetic (CUDA cores; a TF32-off SGEMM when measured)
    source: str


# NVIDIA H100 SXM5 80 GB datasheet: HBM3 3.35 TB/s, dense BF16 989.4 TFLOP/s (1979 with sparsity), FP32 66.9
# TFLOP/s. Spec-sheet figures, not measurements: a device reaches less (bench/GPU_RESULTS.md measures them).
H100_SXM_SPEC = Ceilings(3.35e12, 989.4e12, 66.9e12, "H100 SXM5 spec sheet (not measured)")


# ------------------------------------------------------------------------------------------------ work


@dataclass(frozen=True)
class Work:
    """FLOPs and bytes of one piece of work (forward + backward unless its name says otherwise)."""

    name: str
    flops: float = 0.0  # tensor-core FLOPs (bf16 GEMM rate)
    simt_flops: float = 0.0  # float32 CUDA-core FLOPs
    bytes: float = 0.0
    parts: tuple[Work, ...] = field(default=(), compare=False)

    @property
    def total_flops(self) -> float:
        return self.flops + self.simt_flops

    @property
    def intensity(self) -> float:
        """FLOPs per byte (both kinds of FLOPs)."""
        return self.total_flops / self.bytes if self.bytes else float("inf")

    def arithmetic_s(self, c: Ceilings) -> float:
        return self.flops / c.bf16_flops_per_s + self.simt_flops / c.fp32_flops_per_s

    def memory_s(self, c: Ceilings) -> float:
        return self.bytes / c.copy_bytes_per_s

    def floor_s(self, c: Ceilings) -> float:
        return max(self.arithmetic_s(c), self.memory_s(c))

    def parts_floor_s(self, c: Ceilings) -> float:
        """Sum of the parts' floors (kernels run in sequence); the work's own floor when it has no parts."""
        return sum(p.floor_s(c) for p in self.parts) if self.parts else self.floor_s(c)

    def bound(self, c: Ceilings) -> str:
        return "memory" if self.memory_s(c) >= self.arithmetic_s(c) else "compute"


def combine(name: str, parts: list[Work]) -> Work:
    """A work made of ``parts``: their FLOPs and bytes summed, the parts kept for ``parts_floor_s``."""
    return Work(
        name,
        flops=sum(p.flops for p in parts),
        simt_flops=sum(p.simt_flops for p in parts),
        bytes=sum(p.bytes for p in parts),
        parts=tuple(parts),
    )


# ------------------------------------------------------------------------------------------------ kernels

BF16, F32 = 2, 4
_DTYPE = {2: "bf16", 4: "fp32"}  # names by element size: the benchmark's 16-bit dtype is bf16


def chunk_sizes(length: int, chunk: int) -> list[int]:
    """The chunks of a sequence: full chunks of ``chunk`` tokens and a ragged last one."""
    c = min(chunk, length)
    return [c] * (length // c) + ([length % c] if length % c else [])


def attention_pairs(length: int, chunk: int, causal: bool) -> int:
    """(query, key) pairs a chunked attention needs: the lower triangle (diagonal included) when causal."""
    return sum(n * (n + 1) // 2 if causal else n * n for n in chunk_sizes(length, chunk))


def attention(
    batch: int,
    heads: int,
    length: int,
    chunk: int,
    dk: int,
    dv: int,
    causal: bool = True,
    itemsize: int = BF16,
) -> Work:
    """Chunked softmax attention, forward + backward.

    FLOPs: per (query, key) pair, QKᵀ (dk) and PV (dv) forward; dV = PᵀdO and dP = dO Vᵀ (dv each), dQ and dK
    (dk each) backward: 3 (dk + dv) multiply-adds, 2 FLOPs each. Bytes: forward reads Q, K, V and writes O;
    backward reads Q, K, V, O, dO and writes dQ, dK, dV; the row log-sum-exp (float32) written and read once.
    """
    pairs = batch * heads * attention_pairs(length, chunk, causal)
    rows = batch * heads * length
    return Work(
        f"attention B{batch} h{heads} L{length} C{chunk} dk{dk} dv{dv}{'' if causal else ' bidir'}",
        flops=2 * 3 * (dk + dv) * pairs,
        bytes=rows * (6 * (dk + dv) * itemsize + 2 * F32),
    )


def timestep_norm(batch: int, length: int, dim: int, groups: int, itemsize: int = BF16) -> Work:
    """Causal group norm (docs/architecture.md#timestepnorm), forward + backward into x, weight and bias.

    Bytes: forward reads x and writes y, backward reads x and dy and writes dx (5 passes over [B, L, D]);
    weight and bias (float32) read by each pass and their gradients written. FLOPs per element: forward 7 (the
    step's sum and sum of squares 3, (x - mean) * rstd * w + b 4), backward 13 (dy * w, x̂, the step's two
    sums, dx, dw and db accumulations); the per-step prefix over G groups is negligible and not counted.
    """
    n = batch * length * dim
    return Work(
        f"TimestepNorm B{batch} L{length} D{dim} G{groups} {_DTYPE.get(itemsize, itemsize)}",
        simt_flops=20 * n,
        bytes=5 * n * itemsize + 6 * dim * F32,
    )


CEMA_FWD_FLOPS_PER_MODE = 14  # h = q h + p x (complex q h 6, p x 2, add 2), y += Re(gamma h) (4)
CEMA_BWD_FLOPS_PER_MODE = 36  # adjoint 10, dx 2, h recomputed 10, dq 8, dp 2, dgamma 4


def cema(batch: int, length: int, dim: int, ndim: int, itemsize: int = BF16) -> Work:
    """Complex EMA of order N as its recurrence (docs/architecture.md#cema), forward + backward.

    FLOPs per element and mode: forward 14, backward 36 (the adjoint recurrence, dx, the state recomputed
    from the saved chunk states rather than stored (N complex values per element would be 16N bytes),
    dq, dp, dgamma), plus the omega residual (2 forward, 4 backward). These are float32 CUDA-core FLOPs for a
    scan; a tensor-core (chunked GEMM) form executes more FLOPs on a faster unit. Bytes: 5 passes over
    [B, L, D] as TimestepNorm's; the coefficients ([D, N] complex) are negligible and not counted.
    """
    n = batch * length * dim
    per_element = (CEMA_FWD_FLOPS_PER_MODE + CEMA_BWD_FLOPS_PER_MODE) * ndim + 6
    name = f"CEMA B{batch} L{length} D{dim} N{ndim} {_DTYPE.get(itemsize, itemsize)}"
    return Work(name, simt_flops=per_element * n, bytes=5 * n * itemsize)


def qk_norm_rope(batch: int, length: int, heads: int, head_dim: int, itemsize: int = BF16) -> Work:
    """Q/K normalisation + scale + offset + RoPE from Z (kernels/qk_norm_rope), forward + backward.

    Bytes: forward reads Z and writes Q and K, backward reads Z, dQ and dK and writes dZ (7 passes over
    [B, L, Z]); gamma, beta [2, Z] float32 read, their gradients written. FLOPs per Z element: the sum of
    squares 2, then for each of Q and K: normalise 1, scale 1, offset 1, rotate 3 (forward 14); backward
    twice the forward (28).
    """
    z = heads * head_dim
    n = batch * length * z
    return Work(
        f"Q/K norm + RoPE B{batch} L{length} h{heads} zd{head_dim} {_DTYPE.get(itemsize, itemsize)}",
        simt_flops=42 * n,
        bytes=7 * n * itemsize + 10 * z * F32,
    )


def gemv(rows: int, cols: int, itemsize: int = BF16) -> Work:
    """One-row GEMV y = W x + b (decoding; forward only): W [O, I] read once, x [I] float32, y [O] float32."""
    return Work(
        f"GEMV O{rows} I{cols} {_DTYPE.get(itemsize, itemsize)} weights (forward)",
        simt_flops=2 * rows * cols,
        bytes=rows * cols * itemsize + cols * F32 + 2 * rows * F32,
    )


def linear(tokens: int, fan_in: int, fan_out: int, name: str = "") -> Work:
    """One bf16-mixed Linear [T, i] x [i, o], forward + backward (dX and dW): 6 T i o FLOPs.

    Bytes: activations in bf16: X read by the forward and dW, dX written; Y written, dY read by dX and dW
    (2 T (3i + 3o)); the float32 weight read once by autocast's cast, its bf16 copy written and read by the
    forward and dX, its gradient written in float32 (14 i o)."""
    return Work(
        name or f"Linear {fan_in}->{fan_out}",
        flops=6 * tokens * fan_in * fan_out,
        bytes=2 * tokens * (3 * fan_in + 3 * fan_out) + 14 * fan_in * fan_out,
    )


def elementwise(
    name: str, elements: float, passes: int, itemsize: int = BF16, flops_per_element: float = 0
) -> Work:
    """A memory-bound op: ``passes`` reads or writes of ``elements`` values, forward and backward together."""
    return Work(name, simt_flops=flops_per_element * elements, bytes=passes * elements * itemsize)


# ------------------------------------------------------------------------------------------------ blocks

# The 7B widths (tests check them against the presets megalodon_7b and bench.block.LLAMA_7B).
MEGALODON_7B = dict(
    dim=4096, z_dim=1024, value_dim=8192, ffn_dim=8192, heads=4, ndim=16, groups=64, chunk=4096
)
LLAMA_7B = dict(dim=4096, heads=32, ffn_dim=11008)


def megalodon_block(
    length: int, batch: int = 1, dim: int = 4096, z_dim: int = 1024, value_dim: int = 8192, ffn_dim: int = 8192,
    heads: int = 4, ndim: int = 16, groups: int = 64, chunk: int = 4096,
) -> Work:  # fmt: skip
    """One Megalodon LM block (SwiGLU FFN), bf16-mixed, forward + backward (docs/architecture.md#the-block).

    TimestepNorm and CEMA on float32 (islands); RMSNorm, the six projections, Q/K norm + RoPE, chunked
    attention (h heads of Z/h and E/h), the SiLU of V, the gate o * SiLU(W_r M), the LayerNorm and SwiGLU of the
    FFN and the two residuals. Minimal: the Linears the model rebuilds in its backward are not counted."""
    t = batch * length
    d, z, e, f = dim, z_dim, value_dim, ffn_dim
    parts = [
        timestep_norm(batch, length, d, groups, itemsize=F32),
        cema(batch, length, d, ndim, itemsize=F32),
        elementwise("RMSNorm", t * d, 5, flops_per_element=8),
        linear(t, d, z, "W_z"),
        linear(t, d, e, "W_v"),
        linear(t, d, e, "W_r"),
        linear(t, d, d, "W_h1"),
        linear(t, e, d, "W_h2"),
        qk_norm_rope(batch, length, heads, z // heads),
        attention(batch, heads, length, chunk, z // heads, e // heads, causal=True),
        elementwise("SiLU(V), o * SiLU(r)", t * e, 13, flops_per_element=20),
        elementwise("residuals", t * d, 6, flops_per_element=2),
        elementwise("LayerNorm", t * d, 5, flops_per_element=20),
        linear(t, d, f, "FFN W1"),
        linear(t, d, f, "FFN W3"),
        linear(t, f, d, "FFN W2"),
        elementwise("SwiGLU", t * f, 8, flops_per_element=16),
    ]
    return combine(f"Megalodon block B{batch} L{length}", parts)


def llama_block(length: int, batch: int = 1, dim: int = 4096, heads: int = 32, ffn_dim: int = 11008) -> Work:
    """One Llama-2 block (bench/block.py's LlamaBlock), bf16-mixed, forward + backward: two RMSNorms, the Q, K, V,
    O projections, RoPE on Q and K, causal attention over the whole length, SwiGLU FFN, two residuals."""
    t = batch * length
    d, f = dim, ffn_dim
    parts = [
        elementwise("RMSNorm x2", t * d, 10, flops_per_element=8),
        *(linear(t, d, d, f"W_{w}") for w in "qkvo"),
        elementwise("RoPE on Q, K", t * 2 * d, 4, flops_per_element=6),
        attention(batch, heads, length, length, d // heads, d // heads, causal=True),
        elementwise("residuals", t * d, 6, flops_per_element=2),
        linear(t, d, f, "FFN W1"),
        linear(t, d, f, "FFN W3"),
        linear(t, f, d, "FFN W2"),
        elementwise("SwiGLU", t * f, 8, flops_per_element=16),
    ]
    return combine(f"Llama block B{batch} L{length}", parts)


# ------------------------------------------------------------------------------------------------ the 7B set

BLOCK_LENGTHS = (4096, 32768)


def kernel_works() -> dict[str, Work]:
    """The kernels at the shapes ``bench.gpu_bench`` times them (the 7B widths), keyed by short names."""
    m = MEGALODON_7B
    return {
        "timestep_norm": timestep_norm(1, 32768, m["dim"], m["groups"]),
        "timestep_norm_f32": timestep_norm(
            1, 32768, m["dim"], m["groups"], itemsize=F32
        ),  # the block's dtype
        "cema": cema(1, 32768, m["dim"], m["ndim"], itemsize=F32),  # a float32 island in the model
        "attention_dv256": attention(1, m["heads"], 4096, 4096, 256, 256),
        "attention_dv2048": attention(1, m["heads"], 4096, 4096, 256, m["value_dim"] // m["heads"]),
        "qk_norm_rope": qk_norm_rope(1, 32768, m["heads"], m["z_dim"] // m["heads"]),
        "gemv_ffn_in": gemv(2 * m["ffn_dim"], m["dim"]),
        "gemv_ffn_out": gemv(m["dim"], m["ffn_dim"]),
    }


def block_works() -> dict[tuple[str, int], Work]:
    """(kind, length) -> the block's work at the 7B widths, batch 1."""
    out = {}
    for length in BLOCK_LENGTHS:
        out["megalodon", length] = megalodon_block(length, **MEGALODON_7B)
        out["llama", length] = llama_block(length, **LLAMA_7B)
    return out


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f}" if seconds < 0.1 else f"{seconds * 1e3:.1f}"


def row(work: Work, c: Ceilings) -> list[str]:
    return [
        work.name,
        f"{work.flops / 1e9:.1f}",
        f"{work.simt_flops / 1e9:.1f}",
        f"{work.bytes / 1e9:.3f}",
        f"{work.intensity:.0f}",
        _ms(work.floor_s(c)),
        _ms(work.parts_floor_s(c)),
        work.bound(c),
    ]


HEADERS = [
    "work (fwd + bwd)",
    "tensor GFLOP",
    "fp32 GFLOP",
    "GB",
    "FLOP/B",
    "floor ms",
    "Σ parts floor ms",
    "bound",
]


def markdown_table(headers: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    return "\n".join(lines + ["| " + " | ".join(str(x) for x in r) + " |" for r in rows])


def table(c: Ceilings = H100_SXM_SPEC) -> str:
    """The roofline table of every kernel and block at the 7B widths, with the block floors' M / L ratios."""
    works = list(kernel_works().values())
    blocks = block_works()
    rows = [row(w, c) for w in works + list(blocks.values())]
    ratio_rows = []
    for length in BLOCK_LENGTHS:
        m, ll = blocks["megalodon", length], blocks["llama", length]
        ratio_rows.append([
            f"{length // 1024}K", f"{m.total_flops / ll.total_flops:.3f}", f"{m.floor_s(c) / ll.floor_s(c):.3f}",
            f"{m.parts_floor_s(c) / ll.parts_floor_s(c):.3f}",
        ])  # fmt: skip
    ridge = c.bf16_flops_per_s / c.copy_bytes_per_s
    return (
        f"Ceilings: {c.source}: copy {c.copy_bytes_per_s / 1e12:.2f} TB/s, dense bf16 "
        f"{c.bf16_flops_per_s / 1e12:.0f} TFLOP/s, float32 {c.fp32_flops_per_s / 1e12:.1f} TFLOP/s "
        f"(bf16 ridge {ridge:.0f} FLOP/B).\n\n"
        + markdown_table(HEADERS, rows)
        + "\n\nBlock floors, Megalodon / Llama (equal efficiency on both would give these ratios):\n\n"
        + markdown_table(["L", "FLOPs M / L", "floor M / L", "Σ parts floor M / L"], ratio_rows)
        + "\n"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.parse_args(argv)
    print(table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
