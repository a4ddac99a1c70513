"""Every Triton kernel compiled for real GPU targets (sm_80 = A100, sm_90 = H100) without a GPU.

The kernels' interpreter tests (tests/kernels/test_triton_*.py) check the maths on CPU tensors, but the interpreter
never lowers a kernel: a kernel that does not fit the registers, the shared memory or the instruction set
of a real GPU passes them. Here Triton's own compiler (``triton.compile`` of an ``ASTSource`` for a
``GPUTarget``) and its bundled ``ptxas`` build every kernel to a cubin, no device needed.

What gets compiled is what the launchers launch. A child process (without ``TRITON_INTERPRET``, so the
modules hold real ``JITFunction`` / ``Autotuner`` objects and the GPU autotune lists) replaces the launch
methods by recorders and calls each launcher on meta tensors of the shapes in ``SCENARIOS`` (the 7B preset's
widths dk 256, dv 2048, C 4096; classifiers in float32 with padding and DropKey; streaming with a carried
state, ...). An autotuned launch records every configuration the autotuner would time there (after its
pruning). Each recorded launch is specialised exactly as ``JITFunction.run`` does (integer and alignment
specialisation by ``native_specialize_impl``) and compiled for each architecture. To keep the count down,
a launch is compiled when its kernel configuration (block sizes, warps, stages) or its specialisation
(the other constexprs and argument types) is new for that architecture: every autotune configuration and
every specialisation is compiled at least once per architecture, and the first scenario (the 7B shapes) in
full.

Asserted: every compile succeeds; every kernel the modules define is launched by some scenario (a kernel
missing from ``SCENARIOS`` fails); every autotune configuration is compiled for each architecture; shared
memory fits the target (227 KB per block on H100, 163 KB on A100). Registers, spills and shared memory per
compile are printed as a table and written to ``<tmp>/mega_suite_triton_compile.md``. Compiled kernels land
in Triton's cache (``TRITON_CACHE_DIR``), so a second run takes seconds; register counts of cached kernels
come from running the bundled ``ptxas -v`` on the cached PTX.

Standalone: ``python tests/kernels/test_triton_compile.py [--out FILE]`` prints the same table.
``MEGA_SUITE_COMPILE_MODULES=kernels.attention.probs`` (comma-separated) compiles and checks only those modules.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MODULES = (
    "kernels.cema.triton",
    "kernels.cema.tensor_cores",
    "kernels.timestep_norm.triton",
    "kernels.attention.triton",
    "kernels.attention.probs",
    "kernels.gemv.triton",
    "kernels.qk_norm_rope.triton",
)
ARCHS = (80, 90)
# Largest shared memory one block may opt in to (CUDA programming guide, compute capabilities table).
MAX_SHARED = {80: 163 * 1024, 90: 227 * 1024}
REPORT = Path(tempfile.gettempdir()) / "mega_suite_triton_compile.md"


def _selected_modules() -> tuple[str, ...]:
    """MODULES, or the ones named in MEGA_SUITE_COMPILE_MODULES (comma-separated)."""
    names = [n.strip() for n in os.environ.get("MEGA_SUITE_COMPILE_MODULES", "").split(",") if n.strip()]
    unknown = [n for n in names if n not in MODULES]
    if unknown:
        raise ValueError(f"MEGA_SUITE_COMPILE_MODULES names {unknown}; expected any of {MODULES}")
    return tuple(names) or MODULES


# ------------------------------------------------------------------------------------------------ scenarios
# Each runs one launcher on meta tensors; the recorders collect the kernel launches. Imports are local:
# this module is also imported by pytest, where TRITON_INTERPRET may be set.


def _meta(*shape, dtype=None, grad=False):
    import torch

    t = torch.randn(*shape, dtype=dtype or torch.float32, device="meta")
    return t.requires_grad_() if grad else t


def _attention(b, length, h, dk, dv, chunk, causal, dtype, padding, dropout):
    import torch

    from kernels.attention import triton as fused

    q, k = _meta(b, length, h, dk, dtype=dtype), _meta(b, length, h, dk, dtype=dtype)
    v = _meta(b, length, h, dv, dtype=dtype)
    kpm = torch.zeros(b, length, dtype=torch.bool, device="meta") if padding else None
    seed = torch.zeros(1, dtype=torch.int64, device="meta") if dropout else None
    o, lse = fused.attention_forward(q, k, v, kpm, seed, chunk, causal, dropout)
    fused.attention_backward(torch.empty_like(o), q, k, v, o, lse, kpm, seed, chunk, causal, dropout)


def _probs(b, length, h, dk, dv, chunk, causal, dtype, padding, dropout, save=False):
    """kernels.attention.probs: the launchers of the custom ops, on inputs padded to whole chunks."""
    import torch

    from kernels.attention import probs

    c = min(chunk, length)
    padded = -(-length // c) * c
    q, k = _meta(b, padded, h, dk, dtype=dtype), _meta(b, padded, h, dk, dtype=dtype)
    v = _meta(b, padded, h, dv, dtype=dtype)
    kpm = torch.zeros(b, length, dtype=torch.bool, device="meta") if padding else None
    seed = torch.zeros(1, dtype=torch.int64, device="meta") if dropout else None
    rb = probs.default_row_block(c, causal)
    o, lse, p = probs.probs_forward(q, k, v, kpm, seed, chunk, causal, dropout, length, rb, save)
    probs.probs_backward(
        torch.empty_like(o), q, k, v, o, lse, p, kpm, seed, chunk, causal, dropout, length, rb
    )


def _cema(b, length, d, n, dtype, bidirectional=False, padding=False, state=False, interleaved=True):
    """The custom ops' implementations, called directly: the ops themselves run their fake kernels on meta
    tensors. ``interleaved``: q and γ as the halves of [R, N, 2] tensors, as the model passes them (the
    coefficient kernel's outputs); else contiguous planes."""
    import torch

    from kernels.cema import triton as fused

    rows = 2 * d if bidirectional else d
    x = _meta(b, length, d, dtype=dtype)
    p, omega = _meta(rows, n), _meta(d)
    if interleaved:
        q, g = _meta(rows, n, 2), _meta(rows, n, 2)
        q_re, q_im, g_re, g_im = q[..., 0], q[..., 1], g[..., 0], g[..., 1]
    else:
        q_re, q_im, g_re, g_im = (_meta(rows, n) for _ in range(4))
    h0 = (_meta(b, d, n), _meta(b, d, n)) if state else (None, None)
    pad = torch.zeros(b, length, dtype=torch.int8, device="meta") if padding else None
    y, h_re, h_im, states_f, states_b = fused._cema_forward(
        x, p, q_re, q_im, g_re, g_im, omega, *h0, pad, bidirectional, None
    )
    gh = (torch.ones_like(h_re), torch.ones_like(h_im)) if state else (None, None)
    fused._cema_backward(
        torch.ones_like(y), *gh, x, p, q_re, q_im, g_re, g_im, omega, pad, states_f, states_b, bidirectional,
        state, None,
    )  # fmt: skip


def _cema_tc(b, length, d, n, dtype, bidirectional=False, padding=False, state=False):
    """kernels.cema.tensor_cores: the custom ops' implementations on meta tensors, as ``_cema`` (q, γ
    interleaved)."""
    import torch

    from kernels.cema import tensor_cores as tc

    rows = 2 * d if bidirectional else d
    x = _meta(b, length, d, dtype=dtype)
    p, omega, q, g = _meta(rows, n), _meta(d), _meta(rows, n, 2), _meta(rows, n, 2)
    h0 = (_meta(b, d, n), _meta(b, d, n)) if state else (None, None)
    pad = torch.zeros(b, length, dtype=torch.int8, device="meta") if padding else None
    chunk = tc.resolve_chunk(length, None)
    planes = (q[..., 0], q[..., 1], g[..., 0], g[..., 1])
    y, h_re, h_im, hb, hs = tc._tc_forward(x, p, *planes, omega, *h0, pad, bidirectional, chunk)
    gh = (torch.ones_like(h_re), torch.ones_like(h_im)) if state else (None, None)
    tc._tc_backward(torch.ones_like(y), *gh, x, p, *planes, omega, pad, hb, hs, bidirectional, state, chunk)


def _norm(b, length, d, groups, dtype, padding=False, state=False):
    """As ``_cema``: the custom ops' implementations, called directly. Without ``state`` as training calls
    them: empty state tensors."""
    import torch

    from kernels.timestep_norm import triton as fused

    x = _meta(b, length, d, dtype=dtype)
    weight, bias = _meta(d), _meta(d)
    count0 = torch.zeros(b if state else 0, dtype=torch.int64, device="meta")
    mean0, var0 = (_meta(b, groups), _meta(b, groups)) if state else (_meta(0), _meta(0))
    pad = torch.zeros(b, length, dtype=torch.int8, device="meta") if padding else None
    y, mean, var, mean_f, starts, n_final, shift = fused._tsn_forward(
        x, weight, bias, mean0, var0, count0, pad, groups, 1e-5, None
    )
    fused._tsn_backward(
        torch.ones_like(y), torch.ones_like(mean), torch.ones_like(var), x, pad, weight, count0, mean0, mean_f,
        starts, n_final, shift, groups, 1e-5, None,
    )  # fmt: skip


def _cema_coefficients(rows, n):
    """The coefficient kernels' implementations (custom ops ``cema_coefficients_fwd`` / ``_bwd``)."""
    from kernels.cema import triton as fused

    params = _meta(rows, n, 1), _meta(rows, n, 1), _meta(rows, 1, 1), _meta(rows, n, 2)
    p, q, g = fused._coefficients_forward(*params)
    fused._coefficients_backward(p, q, g, *params[:3])


def _dropkey_mask():
    import torch

    from kernels.attention import triton as fused

    fused.dropkey_mask(torch.zeros(1, dtype=torch.int64, device="meta"), 1, 2, 1000, 1000, 0.1)


def _gemv(o, i, dtype, bias, add):
    from kernels.gemv import triton as fused

    vec = _meta(o) if bias or add else None
    fused.row_gemv(_meta(o, i, dtype=dtype), _meta(i), vec if bias else None, vec if add else None)


def _qk(b, length, h, zd, dtype, out_dtype):
    """The custom ops' implementations, called directly (as ``_cema``)."""
    import torch

    from kernels.qk_norm_rope import triton as fused

    z, gamma, beta, inv = (
        _meta(b, length, h, zd, dtype=dtype),
        _meta(2, h * zd),
        _meta(2, h * zd),
        _meta(zd // 2),
    )
    q, k = fused._forward(z, gamma, beta, inv, 0, length, 1e-5, out_dtype)
    fused._backward(torch.empty_like(q), torch.empty_like(k), z, gamma, inv, 0, length, 1e-5)


def _qk_rows(b, length, h, zd, dtype, out_dtype, chunk=None):
    """The rows variant's custom ops' implementations (whole tokens per program, a cos / sin table)."""
    import torch

    from kernels.qk_norm_rope import triton as fused

    chunk = chunk or length
    z, gamma, beta = _meta(b, length, h, zd, dtype=dtype), _meta(2, h * zd), _meta(2, h * zd)
    table = _meta(chunk, zd // 2, 2)
    q, k = fused._rows_forward(z, gamma, beta, table, 0, chunk, 1e-5, out_dtype)
    fused._rows_backward(torch.empty_like(q), torch.empty_like(k), z, gamma, table, 0, chunk, 1e-5)


def _bf16():
    import torch

    return torch.bfloat16


def _f32():
    import torch

    return torch.float32


SCENARIOS: dict[str, list[tuple[str, object]]] = {
    "kernels.attention.triton": [
        # 7B (also 200M, 1.3B): 4 heads of dk = z/h = 256, dv = v/h = 2048, C = 4096, bf16, causal
        ("7B LM bf16 causal dk256 dv2048 C4096", lambda: _attention(1, 4096, 4, 256, 2048, 4096, True, _bf16(), False, 0.0)),
        # LRA classifiers: float32, bidirectional, padding, DropKey, L not a multiple of 16, dV fused
        ("classifier fp32 pad+dropkey dk64 dv128 L1000", lambda: _attention(2, 1000, 1, 64, 128, 1000, False, _f32(), True, 0.1)),
        ("DropKey mask (tests)", _dropkey_mask),
    ],
    "kernels.attention.probs": [
        # 7B: S, dP in float32 [4, 4096, 4096], one 4096-wide row per forward program, P recomputed / saved
        ("7B LM bf16 causal dk256 dv2048 C4096", lambda: _probs(1, 4096, 4, 256, 2048, 4096, True, _bf16(), False, 0.0)),
        ("7B LM bf16 causal, P saved for backward", lambda: _probs(1, 4096, 4, 256, 2048, 4096, True, _bf16(), False, 0.0, save=True)),
        ("classifier fp32 pad+dropkey dk64 dv512 L1000", lambda: _probs(2, 1000, 1, 64, 512, 1000, False, _f32(), True, 0.1)),
        ("bf16 C16384 dropkey: rows in two passes", lambda: _probs(1, 16384, 1, 64, 512, 16384, True, _bf16(), False, 0.1)),
    ],
    "kernels.cema.triton": [
        ("7B LM bf16 D4096 N16", lambda: _cema(1, 4096, 4096, 16, _bf16())),
        ("streaming bf16: carried state in/out", lambda: _cema(1, 4096, 1024, 16, _bf16(), state=True)),
        ("classifier fp32 bidirectional pad D80", lambda: _cema(2, 1000, 80, 16, _f32(), bidirectional=True, padding=True)),
        ("debug preset fp32 D16 N4, contiguous q, γ planes", lambda: _cema(2, 64, 16, 4, _f32(), interleaved=False)),
        ("7B coefficients D4096 N16", lambda: _cema_coefficients(4096, 16)),
        ("classifier coefficients 2x80 N16", lambda: _cema_coefficients(160, 16)),
    ],
    "kernels.cema.tensor_cores": [
        ("7B LM bf16 D4096 N16", lambda: _cema_tc(1, 4096, 4096, 16, _bf16())),
        ("streaming bf16: carried state in/out", lambda: _cema_tc(1, 4096, 1024, 16, _bf16(), state=True)),
        ("classifier fp32 bidirectional pad D80", lambda: _cema_tc(2, 1000, 80, 16, _f32(), bidirectional=True, padding=True)),
    ],
    "kernels.gemv.triton": [
        # the 7B decode packs, bf16 weights: m-pack [Z+E+D, D] with bias, fc2 [D, F] with the residual added
        ("7B decode m-pack bf16 13312x4096 +bias", lambda: _gemv(13312, 4096, _bf16(), True, False)),
        ("7B decode fc2 bf16 4096x8192 +residual", lambda: _gemv(4096, 8192, _bf16(), False, True)),
        ("7B decode W_v fp32 8192x4096 (float32 weights)", lambda: _gemv(8192, 4096, _f32(), False, False)),
    ],
    "kernels.qk_norm_rope.triton": [
        ("7B LM bf16 h4 zd256", lambda: _qk(1, 4096, 4, 256, _bf16(), _bf16())),
        ("classifier fp32 h1 zd64", lambda: _qk(2, 1000, 1, 64, _f32(), _f32())),
        ("7B LM bf16 h4 zd256 C4096, rows variant", lambda: _qk_rows(1, 32768, 4, 256, _bf16(), _bf16(), 4096)),
        ("classifier fp32 h1 zd64, rows variant", lambda: _qk_rows(2, 1000, 1, 64, _f32(), _f32())),
        ("h3 zd12 fp32: padded heads and pairs, rows variant", lambda: _qk_rows(2, 100, 3, 12, _f32(), _f32())),
    ],
    "kernels.timestep_norm.triton": [
        ("7B LM bf16 D4096 G64", lambda: _norm(1, 4096, 4096, 64, _bf16())),
        ("classifier fp32 pad D80 G16", lambda: _norm(2, 1000, 80, 16, _f32(), padding=True)),
        ("streaming bf16: carried state D4096 G64", lambda: _norm(1, 4096, 4096, 64, _bf16(), state=True)),
    ],
}  # fmt: skip


# ------------------------------------------------------------------------------------------ child process


def _kernels_of(module) -> dict[str, object]:
    """The module's launchable kernels: its JITFunctions (autotuned ones through their Autotuner's .fn)
    that no other JITFunction of the module calls or passes on (those are inlined helpers, or a scan's
    combine function)."""
    import re

    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import JITFunction

    fns = {}
    for obj in vars(module).values():
        fn = obj.fn if isinstance(obj, Autotuner) else obj
        if isinstance(fn, JITFunction) and fn.fn.__module__ == module.__name__:
            fns[fn.__name__] = fn
    called = {
        name
        for name in fns
        for other in fns.values()
        if other.__name__ != name and re.search(rf"\b{name}\s*\(|[(,]\s*{name}\s*[,)]", other.src)
    }
    return {name: fn for name, fn in fns.items() if name not in called}


def _autotune_configs(module) -> dict[str, list[tuple]]:
    from triton.runtime.autotuner import Autotuner

    return {
        obj.fn.__name__: [_config_key(c.all_kwargs()) for c in obj.configs]
        for obj in vars(module).values()
        if isinstance(obj, Autotuner)
    }


_OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg")
_TUNED = ("BLOCK_M", "BLOCK_N", "BLOCK_DV", "BLOCK_O", "BLOCK_I")


def _config_key(config: dict) -> tuple:
    """An autotune configuration's identity: its block sizes, warps and stages."""
    return tuple(sorted((k, v) for k, v in config.items() if k in _TUNED or k in ("num_warps", "num_stages")))


def _record_launches():
    """Run every scenario with recording launch methods; returns [(module, scenario, fn, args, kwargs)]."""
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import JITFunction

    records, current = [], {}

    def jit_run(self, *args, grid, warmup, **kwargs):
        records.append((current["module"], current["scenario"], self, args, kwargs, None))

    def tuned_run(self, *args, grid=None, warmup=False, **kwargs):
        self.nargs = dict(zip(self.arg_names, args))
        for cfg in self.prune_configs(kwargs):
            tuned = cfg.all_kwargs()
            records.append(
                (current["module"], current["scenario"], self.fn, args, {**kwargs, **tuned}, tuned)
            )
        self.nargs = None

    JITFunction.run, Autotuner.run = jit_run, tuned_run
    selected = _selected_modules()
    for module, scenarios in SCENARIOS.items():
        if module not in selected:
            continue
        for name, launch in scenarios:
            current.update(module=module, scenario=name)
            launch()
    return records


def _specialise(fn, args, kwargs, backend):
    """(signature, constexprs, attrs, options) exactly as ``JITFunction.run`` builds them for a launch."""
    from triton._C.libtriton import native_specialize_impl
    from triton._utils import find_paths_if, get_iterable_path

    kwargs = dict(kwargs)
    options = {k: kwargs.pop(k) for k in list(kwargs) if k in _OPTIONS}
    bound = fn.signature.bind(*args, **kwargs)
    bound.apply_defaults()
    values = list(bound.arguments.values())
    spec = [
        ("constexpr", v)
        if kp.is_constexpr
        else native_specialize_impl(
            backend, v, kp.is_const, not kp.do_not_specialize, not kp.do_not_specialize_on_alignment
        )
        for kp, v in zip(fn.params, values)
    ]
    types = [s[0] for s in spec]
    signature = {kp.name: t for kp, t in zip(fn.params, types)}
    constexprs = {
        p: get_iterable_path(values, p) for p in find_paths_if(types, lambda _, t: t == "constexpr")
    }
    attr_vals = ["" if s[0] == "constexpr" else s[1] for s in spec]
    attrs = {
        p: backend.parse_attr(get_iterable_path(attr_vals, p))
        for p in find_paths_if(attr_vals, lambda _, a: isinstance(a, str))
    }
    return signature, constexprs, attrs, options


def _ptxas_numbers(log: str, name: str) -> dict:
    """Registers and spills of the entry function ``name`` from ``ptxas -v`` output (other functions of
    the same log, e.g. called device functions, have blocks of their own)."""
    import re

    block = log[log.find(f"Compiling entry function '{name}'") :]
    regs = re.search(r"Used (\d+) registers", block)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", block)
    return {
        "regs": int(regs.group(1)) if regs else None,
        "spill_stores": int(spill.group(1)) if spill else None,
        "spill_loads": int(spill.group(2)) if spill else None,
    }


def _ptxas_rerun(ptx: str, arch: int, fp_fusion: bool) -> str:
    """``ptxas -v`` on a cached kernel's PTX, with the flags of Triton's own cubin step."""
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        cmd = [get_ptxas(arch).path, "-lineinfo", *([] if fp_fusion else ["--fmad=false"]), "-v",
               "--regAllocOptLevel=2", f"--gpu-name={sm_arch_from_capability(arch)}", str(src),
               "-o", str(src.with_suffix(".o"))]  # fmt: skip
        return subprocess.run(cmd, capture_output=True, text=True, check=True).stderr


def _compile(job):
    """Compile one launch for one architecture; a dict row for the report (error text on failure)."""
    import contextlib
    import io
    import time

    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend

    fn, args, kwargs, arch = job
    target = GPUTarget("cuda", arch, 32)
    start = time.perf_counter()
    try:
        signature, constexprs, attrs, options = _specialise(fn, args, kwargs, make_backend(target))
        knobs.nvidia.dump_ptxas_log = True  # ptxas -v output, printed by Triton when it compiles
        log = io.StringIO()
        with contextlib.redirect_stdout(log):
            kernel = triton.compile(
                ASTSource(fn, signature, constexprs, attrs), target=target, options=options
            )
        log = log.getvalue()
        if "Used" not in log:  # cache hit: nothing was printed
            log = _ptxas_rerun(kernel.asm["ptx"], arch, kernel.metadata.enable_fp_fusion)
        return dict(
            ok=True,
            shared=kernel.metadata.shared,
            seconds=time.perf_counter() - start,
            **_ptxas_numbers(log, fn.__name__),
        )
    except Exception as err:  # noqa: BLE001 -- reported per row, the test fails on it
        return dict(
            ok=False, error=f"{type(err).__name__}: {err}"[-3000:], seconds=time.perf_counter() - start
        )


_JOBS: list = []


def _compile_job(index: int) -> dict:
    return _compile(_JOBS[index])


def _describe(kwargs: dict, constexprs: dict, fn) -> str:
    names = {(i,): n for i, n in enumerate(fn.arg_names)}
    shown = {names[p]: v for p, v in constexprs.items() if p in names and names[p] not in _TUNED}
    flags = [k for k, v in shown.items() if v is True]
    dims = [
        f"{k}={v}" for k, v in shown.items() if isinstance(v, int) and not isinstance(v, bool) and k.isupper()
    ]
    other = [f"{k}={v}" for k, v in shown.items() if isinstance(v, str)]
    return " ".join(dims + flags + other)


def child_main(out: Path) -> None:
    """Record, compile (in parallel where there are cores) and write the rows and coverage as JSON."""
    import importlib
    import multiprocessing as mp
    import warnings

    warnings.filterwarnings("ignore", message="TRITON_DEFAULT_FP_FUSION")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend

    sys.path.insert(0, str(ROOT))
    modules = {name: importlib.import_module(name) for name in _selected_modules()}
    records = _record_launches()

    jobs, rows, seen = [], [], set()
    for arch in ARCHS:
        backend = make_backend(GPUTarget("cuda", arch, 32))
        for module, scenario, fn, args, kwargs, tuned in records:
            signature, constexprs, attrs, options = _specialise(fn, args, kwargs, backend)
            cfg = _config_key(tuned) if tuned else _config_key(dict(options))
            spec = (
                fn.__name__,
                tuple(
                    sorted((p, repr(v)) for p, v in constexprs.items() if fn.arg_names[p[0]] not in _TUNED)
                ),
                tuple(sorted(signature.items())),
                tuple(sorted((p, repr(a)) for p, a in attrs.items())),
            )
            first = scenario == SCENARIOS[module][0][0]
            if not first and (arch, fn.__name__, cfg) in seen and (arch, spec) in seen:
                continue
            full = (arch, spec, cfg)
            if full in seen:
                continue
            seen |= {(arch, fn.__name__, cfg), (arch, spec), full}
            jobs.append((fn, args, kwargs, arch))
            rows.append(
                dict(
                    arch=arch, module=module, scenario=scenario, kernel=fn.__name__,
                    specialisation=_describe(kwargs, constexprs, fn), config=dict(cfg), tuned=tuned is not None,
                )
            )  # fmt: skip

    if os.environ.get("MEGA_SUITE_COMPILE_DRY_RUN"):  # list what would compile, compile nothing
        from collections import Counter

        print(Counter((r["arch"], r["scenario"], r["kernel"]) for r in rows), len(rows))
        return
    _JOBS[:] = jobs  # forked workers inherit them: JITFunctions and meta tensors do not pickle
    workers = max(1, min(len(os.sched_getaffinity(0)), 8))
    if workers > 1:
        with mp.get_context("fork").Pool(workers) as pool:
            results = pool.map(_compile_job, range(len(jobs)), chunksize=1)
    else:
        results = [_compile_job(i) for i in range(len(jobs))]
    for row, result in zip(rows, results):
        row.update(result)

    coverage = {
        name: dict(kernels=sorted(_kernels_of(mod)), autotune={k: [dict(c) for c in v] for k, v in _autotune_configs(mod).items()})
        for name, mod in modules.items()
    }  # fmt: skip
    launched = sorted({(module, fn.__name__) for module, _, fn, _, _, _ in records})
    out.write_text(json.dumps(dict(rows=rows, coverage=coverage, launched=launched, workers=workers)))


def format_table(rows: list[dict]) -> str:
    lines = [
        "| arch | kernel | specialisation | config | regs | spills st/ld (B) | shared (B) | s | ok |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        cfg = " ".join(f"{k.replace('BLOCK_', '').replace('num_', '')}={v}" for k, v in r["config"].items())
        spills = "" if r.get("spill_stores") is None else f"{r['spill_stores']}/{r['spill_loads']}"
        lines.append(
            f"| sm_{r['arch']} | {r['kernel']} | {r['specialisation']} | {cfg} | {r.get('regs', '')} | {spills} "
            f"| {r.get('shared', '')} | {r['seconds']:.1f} | {'yes' if r['ok'] else 'NO'} |"
        )
    return "\n".join(lines)


def run_child(out: Path, timeout: float = 1800) -> dict:
    """The compile job in a fresh interpreter without TRITON_INTERPRET (the interpreter's @jit objects
    cannot be lowered); returns its JSON."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, __file__, "--child", str(out)],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    if proc.returncode != 0:
        raise AssertionError(
            f"compile child failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
        )
    return json.loads(out.read_text())


# -------------------------------------------------------------------------------------------------- tests


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    pytest.importorskip("triton")
    data = run_child(tmp_path_factory.mktemp("triton_compile") / "result.json")
    table = format_table(data["rows"])
    REPORT.write_text(
        "# Triton kernels compiled for sm_80 / sm_90 (tests/kernels/test_triton_compile.py)\n\n"
        + table
        + "\n"
    )
    print(f"\n{table}\n(written to {REPORT})")
    return data


@pytest.mark.slow
def test_every_kernel_compiles_for_sm80_and_sm90(compiled):
    failed = [r for r in compiled["rows"] if not r["ok"]]
    assert not failed, "kernels that do not compile:\n" + "\n".join(
        f"sm_{r['arch']} {r['kernel']} [{r['specialisation']}] {r['config']}: {r['error']}" for r in failed
    )
    assert {r["arch"] for r in compiled["rows"]} == set(ARCHS)
    assert all(r["regs"] and r["regs"] <= 255 for r in compiled["rows"]), "register count not parsed"


@pytest.mark.slow
def test_every_kernel_of_the_modules_is_launched_by_a_scenario(compiled):
    launched = {tuple(x) for x in compiled["launched"]}
    for module, cov in compiled["coverage"].items():
        assert cov["kernels"], f"no kernels found in {module}"
        missing = [k for k in cov["kernels"] if (module, k) not in launched]
        assert not missing, f"{module}: kernels no scenario launches (add them to SCENARIOS): {missing}"


@pytest.mark.slow
def test_every_autotune_config_is_compiled_for_each_arch(compiled):
    done = {
        (r["arch"], r["kernel"], tuple(sorted(r["config"].items())))
        for r in compiled["rows"]
        if r["ok"] and r["tuned"]
    }
    for module, cov in compiled["coverage"].items():
        for kernel, configs in cov["autotune"].items():
            assert len(configs) > 1, (
                f"{module}.{kernel}: GPU autotune list not seen (TRITON_INTERPRET leaked?)"
            )
            for arch in ARCHS:
                for cfg in configs:
                    assert (arch, kernel, tuple(sorted(cfg.items()))) in done, (
                        f"sm_{arch} {kernel} {cfg} not compiled"
                    )


@pytest.mark.slow
def test_shared_memory_fits_the_target(compiled):
    """Every non-autotuned launch fits its target; of an autotuned launch's candidates at least one does
    (the autotuner discards a configuration that raises OutOfResources on the device)."""
    groups: dict = {}
    for r in compiled["rows"]:
        if r["ok"]:
            groups.setdefault((r["arch"], r["kernel"], r["scenario"], r["tuned"]), []).append(r)
    for (arch, kernel, scenario, tuned), rows in groups.items():
        fits = [r["shared"] <= MAX_SHARED[arch] for r in rows]
        assert any(fits) if tuned else all(fits), (
            f"sm_{arch} {kernel} [{scenario}]: shared memory over the limit"
        )


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        child_main(Path(sys.argv[2]))
    else:
        out = Path(sys.argv[sys.argv.index("--out") + 1]) if "--out" in sys.argv else REPORT
        with tempfile.TemporaryDirectory() as tmp:
            data = run_child(Path(tmp) / "result.json")
        out.write_text(format_table(data["rows"]) + "\n")
        print(format_table(data["rows"]))
