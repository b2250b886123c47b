"""A compiled product for 1-8 rows on x86 CPUs with AVX-512 or AVX2: what makes a call scoring a tree or a long block
cost little more than one scoring a single token (used by :mod:`specresearch.models.kernels`).

Why: a small model's forward is bound by streaming its weights from memory, so scoring 8 tokens could cost what
scoring 1 does. MKL's products for 2-8 rows do not get there on one thread: on a 2-core AMD EPYC with AVX-512 a call
of the embedded target scoring 4 / 8 tokens costs 1.29 / 2.04 one-token calls with them, 1.15 / 1.35 with this kernel
(``benchmarks/bench_native.py``, record ``native_amd``; docs/trees.md); on one with AVX2 only, scoring 4 / 8 tokens
1.40 / 2.31 with them, 1.07 / 1.43 with it (record ``native_avx2_amd``). The kernel multiplies
``y[r, o] = sum_i x[r, i] W[o, i] (+ b[o])`` for n <= 8 rows by reading each weight once, ``OB`` weight rows at a
time, with 16-lane (AVX-512) or 8-lane (AVX2) partial sums in registers for every pair of weight row and input row
(n * OB accumulators, OB weight vectors and one input vector fit AVX-512's 32 registers or AVX2's 16; AVX2's 2-row
block holds its two input vectors instead and lets the FMAs read the weights) and the next blocks' rows prefetched;
AVX2 takes 5-8 rows in groups of 4 and fewer that share each block, the later groups reading it from the cache.
The partial sums are reduced in a fixed order, so a row's result does not depend on how many rows share the call
(``tests/test_native.py``), and it equals ``F.linear`` up to float rounding (~1e-6 relative).
Float16 weights (a draft's, ``kernels.use_half_weights``) are read as they are stored and widened to float32 in
registers (F16C), so the stream is half as long and the arithmetic float32's: ``F.linear(x, weight.float())``. On
the AVX2 EPYC the float16 feature head's ten products took 2.7 / 2.9 ms for 1 / 2 rows this way against 5.0 / 8.3 ms
by ``kernels.skinny_linear``'s float16 path (torch's float16 product of the scaled rows). Int8 weights with a float32
scale per output row (``kernels.use_int8_weights``) are converted as they are read and each row's sum multiplied by its
scale: a quarter of float32's stream, though on Zen 1 the conversion's arithmetic, more than the stream, bounds a
call of few rows (docs/feature_drafts.md, "Weight storage").

How: the C source for this CPU's instruction set (:func:`kernel_source`, :func:`instruction_set`) is compiled once per
machine with the system C compiler (``$CC``, else ``cc``) and ``-O3 -march=native`` into ``<cache_dir>/native/`` and
loaded with ``ctypes`` (no torch headers, about two seconds to build). Where there is no compiler, neither AVX-512 nor
AVX2 with FMA, no F16C, another architecture, or ``$SPECRESEARCH_NATIVE=0``, :func:`skinny_kernel` is None and nothing
changes.
Whether it is used for a row count is timed on the model's own weights, as the skinny rows are
(``kernels.choose_kernel_rows``; with AVX-512 here it won for 3-8 rows, with AVX2 for 2-8 and at some loads 1, and
for a float16 draft's layers for 1-8). It has no gradient
(``kernels.skinny_linear`` uses it only where none is asked for) and runs on one thread (with two, MKL's products use
both cores and the timing keeps them).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile

import torch

__all__ = ["KERNEL_ROWS", "instruction_set", "kernel_source", "skinny_kernel", "kernel_linear", "native_enabled"]


KERNEL_ROWS = range(1, 9)  # row counts the kernel computes
# Per instruction set: the vector type and its operations, the registers, and the weight rows per block (n * OB
# accumulators + OB weight vectors + 1 input vector <= the registers, so none spills; for the row counts in
# _INPUTS_HELD n * OB accumulators + n input vectors).
_ISAS = {
    "avx512": dict(vector="__m512", load="_mm512_loadu_ps", zero="_mm512_setzero_ps", fma="_mm512_fmadd_ps",
                   reduce="_mm512_reduce_add_ps", lanes=16, registers=32, macro="__AVX512F__",
                   load_half="_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)({})))",
                   load_int8="_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)({}))))"),
    "avx2": dict(vector="__m256", load="_mm256_loadu_ps", zero="_mm256_setzero_ps", fma="_mm256_fmadd_ps",
                 reduce="_sum256", lanes=8, registers=16, macro="__AVX2__",
                 load_half="_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)({})))",
                 load_int8="_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)({}))))"),
}
# Weight storage the kernel reads: the C type of a weight element and the torch dtype it takes. Float16 weights are
# widened to float32 as they are loaded (F16C), int8 ones converted (each output row's sum is then multiplied by its
# scale), so both multiply float32 inputs with float32 partial sums.
WEIGHT_TYPES = {torch.float32: ("f32", "float"), torch.float16: ("f16", "unsigned short"), torch.int8: ("i8", "signed char")}
_BLOCKS = {"avx512": {1: 8, 2: 8, 3: 7, 4: 6, 5: 5, 6: 4, 7: 3, 8: 3},
           "avx2": {n: 15 // (n + 1) for n in KERNEL_ROWS}}  # 7, 5, 3, 3, 2, 2, 1, 1 of AVX2's 16 registers
# Row counts whose float32 block keeps the n input vectors in registers instead of the OB weight vectors, and its OB:
# each weight vector is then read by the FMAs themselves (once per input row, the second time from L1), so n * OB
# accumulators + n inputs fill the registers. On the AVX2 EPYC this form's 2-row block (OB 7) took 0.90-0.97 of the
# other's (OB 5) in four micro-benchmark runs of the target's weights; for other row counts neither form won. A float16
# or int8 weight vector is widened into a register first, which this form has none left for, so they keep _BLOCKS.
_INPUTS_HELD = {"avx512": {}, "avx2": {2: 7}}
# Row counts computed in groups of rows that share each block of weight rows (the first group's OB): the first group
# streams the block from memory, the later ones read it again from L1. AVX2's 4-row block is as fast as its 1-row one
# (memory-bound), while one pass over 5-8 rows has too few weight rows per block (OB 2, 1). On the AVX2 EPYC (Zen 1)
# the products of the target's layers for 5 / 6 / 7 / 8 rows took 1.05 / 1.22 / 1.24 / 1.36 of MKL's one-row ones so,
# 1.42 / 1.50 / 1.37 / 1.48 in one pass; groups of 3 + 2 and 3 + 3, or of 2 rows, were slower. At 8 rows the FMAs
# bound it there: two 128-bit FMA pipes at 2 GHz need ~1.24 of MKL's one-row time for 8 rows' arithmetic.
_GROUPS = {"avx512": {}, "avx2": {5: (4, 1), 6: (4, 2), 7: (4, 3), 8: (4, 4)}}


def _weight_rows(isa: str, n: int, widened: bool) -> tuple[int, bool]:
    """(OB, whether the inputs are held) of the block for ``n`` rows (``widened``: float16 or int8 weights)."""
    held = None if widened else _INPUTS_HELD[isa].get(n)
    return (held, True) if held else (_BLOCKS[isa][n], False)


_PREFETCH = 4  # blocks ahead
NATIVE_ENV = "SPECRESEARCH_NATIVE"
_SUM256 = """
static inline float _sum256(__m256 v) {  /* a fixed order: (lanes 0-3 + 4-7), then pairs, then the two halves */
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}"""


def instruction_set() -> str | None:
    """The kernel's instruction set on this CPU: ``"avx512"`` (AVX-512F), ``"avx2"`` (AVX2 and FMA), or None (neither,
    no F16C, or not x86)."""
    from specresearch.paths import cpu_fields

    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    flags = set(cpu_fields().get("flags", "").split())
    if "f16c" not in flags:  # float16 weights are widened with it (every CPU with AVX2 or AVX-512 has it)
        return None
    return "avx512" if "avx512f" in flags else "avx2" if {"avx2", "fma"} <= flags else None


def _block(n: int, ob: int, name: str, prefetch: bool, isa: str, suffix: str = "f32", held: bool = False) -> str:
    v = _ISAS[isa]
    weight_type = {s: c for s, c in WEIGHT_TYPES.values()}[suffix]
    at = "w + (o + b) * in + i"
    load_weight = {"f32": f'{v["load"]}({at})', "f16": v["load_half"].format(at), "i8": v["load_int8"].format(at)}[suffix]
    scaled = " * scale[o + b]" if suffix == "i8" else ""
    if held:  # the inputs in registers, the weights read by the FMAs
        first = f"""        {v["vector"]} xv[{n}];
        _Pragma("GCC unroll 8") for (int r = 0; r < {n}; r++) xv[r] = {v["load"]}(x + r * in + i);
"""
        rest = f"""        _Pragma("GCC unroll 8") for (int b = 0; b < {ob}; b++) {{
            {v["vector"]} u = {load_weight};
            _Pragma("GCC unroll 8") for (int r = 0; r < {n}; r++) acc[b][r] = {v["fma"]}(u, xv[r], acc[b][r]);
        }}
"""
    else:  # the block's weight vectors in registers, one input vector at a time
        first = f"""        {v["vector"]} u[{ob}];
        _Pragma("GCC unroll 8") for (int b = 0; b < {ob}; b++) u[b] = {load_weight};
"""
        rest = f"""        _Pragma("GCC unroll 8") for (int r = 0; r < {n}; r++) {{
            {v["vector"]} xv = {v["load"]}(x + r * in + i);
            _Pragma("GCC unroll 8") for (int b = 0; b < {ob}; b++) acc[b][r] = {v["fma"]}(u[b], xv, acc[b][r]);
        }}
"""
    ahead = f"w + (o + {_PREFETCH * ob} + b) * in + i"
    fetch = (f"        for (int b = 0; b < {ob}; b++) _mm_prefetch((const char *)({ahead}), _MM_HINT_T0);\n"
             if prefetch else "")
    return f"""
static inline void {name}(const float *x, const {weight_type} *w, const float *scale, const float *bias, float *y,
                          long in, long out, long o) {{
    {v["vector"]} acc[{ob}][{n}];
    _Pragma("GCC unroll 8") for (int b = 0; b < {ob}; b++)
        _Pragma("GCC unroll 8") for (int r = 0; r < {n}; r++) acc[b][r] = {v["zero"]}();
    for (long i = 0; i < in; i += {v["lanes"]}) {{
{first}{fetch}{rest}    }}
    _Pragma("GCC unroll 8") for (int b = 0; b < {ob}; b++)
        _Pragma("GCC unroll 8") for (int r = 0; r < {n}; r++)
            y[r * out + o + b] = {v["reduce"]}(acc[b][r]){scaled} + (bias ? bias[o + b] : 0.0f);
}}"""


def kernel_source(isa: str | None = None) -> str:
    """The C source for ``isa`` (default: this CPU's, :func:`instruction_set`, else AVX-512): per weight storage
    (:data:`WEIGHT_TYPES`: float32, float16, int8) a ``rows_n`` function per row count calling its groups' blocks
    (:func:`_rows`) and one-row tails, and ``skinny_f32`` / ``skinny_f16`` / ``skinny_i8`` dispatching on n (each takes
    a ``scale`` pointer, which only int8's reads). Each returns 0, or 1 when it cannot take the call (n outside 1-8,
    ``in`` not a multiple of 16)."""
    isa = isa or instruction_set() or "avx512"
    spec = _ISAS[isa]
    parts = ["#include <immintrin.h>", f"#ifndef {spec['macro']}", f"#error needs {isa}", "#endif",
             "#ifndef __F16C__", "#error needs F16C", "#endif"]
    if isa == "avx2":
        parts.append(_SUM256)
    for suffix, c_type in WEIGHT_TYPES.values():
        widened = suffix != "f32"
        made: set[str] = set()
        parts += [_block(n, 1, f"tail_{n}_{suffix}", False, isa, suffix, _weight_rows(isa, n, widened)[1])
                  for n in KERNEL_ROWS if n not in _GROUPS[isa]]
        parts += [part for n in KERNEL_ROWS for part in _rows(isa, n, suffix, c_type, made)]
        cases = "\n".join(f"    case {n}: rows_{n}_{suffix}(x, w, scale, bias, y, in, out); return 0;" for n in KERNEL_ROWS)
        parts.append(f"""
int skinny_{suffix}(const float *x, const {c_type} *w, const float *scale, const float *bias, float *y, long n, long in,
                    long out) {{
    if (in % 16) return 1;
    switch (n) {{
{cases}
    default: return 1;
    }}
}}""")
    return "\n".join(parts) + "\n"


def _rows(isa: str, n: int, suffix: str, c_type: str, made: set) -> list[str]:
    """``rows_n``, and the blocks it calls that ``made`` does not hold yet: per block of OB weight rows, each group of
    rows of ``_GROUPS[isa]`` (one group of n elsewhere) in turn. The first group's block prefetches and streams the
    weights from memory and sets OB (its form's, ``_weight_rows``); the later groups' read the same OB rows again from
    the cache. A row's sums are accumulated alike in every block, so its result is the same bit for bit. The
    leftover weight rows go through the one-row tails."""
    groups = _GROUPS[isa].get(n, (n,))
    ob, held = _weight_rows(isa, groups[0], suffix != "f32")
    parts, calls, tails, start = [], [], [], 0
    for k, g in enumerate(groups):
        name = f"block_{g}x{ob}{'_ahead' if k == 0 else ''}{'_held' if held and k == 0 else ''}_{suffix}"
        if name not in made:
            made.add(name)
            parts.append(_block(g, ob, name, k == 0, isa, suffix, held and k == 0))
        at = f"x + {start} * in, w, scale, bias, y + {start} * out, in, out, o"
        calls.append(f"{name}({at});")
        tails.append(f"tail_{g}_{suffix}({at});")
        start += g
    parts.append(f"""
static void rows_{n}_{suffix}(const float *x, const {c_type} *w, const float *scale, const float *bias, float *y, long in,
                          long out) {{
    long o = 0;
    for (; o + {ob} <= out; o += {ob}) {{ {" ".join(calls)} }}
    for (; o < out; o++) {{ {" ".join(tails)} }}
}}""")
    return parts


def native_enabled() -> bool:
    """False where ``$SPECRESEARCH_NATIVE`` is ``0`` (or ``off`` / ``false``)."""
    return os.environ.get(NATIVE_ENV, "1").strip().lower() not in ("0", "off", "false", "no")


@functools.cache
def _load(path: str) -> dict:
    library = ctypes.CDLL(path)
    functions = {}
    for dtype, (suffix, _) in WEIGHT_TYPES.items():
        function = getattr(library, f"skinny_{suffix}")
        function.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_long] * 3
        function.restype = ctypes.c_int
        functions[dtype] = function
    return functions


@functools.cache
def _build() -> str | None:
    """Compile the source once per machine (cached by source, CPU name and flags, and compiler); None when it cannot be
    built here."""
    from specresearch.paths import cache_dir, cpu_key

    if instruction_set() is None:
        return None
    compiler = shutil.which(os.environ.get("CC") or "cc") or shutil.which("gcc")
    if compiler is None:
        return None
    source = kernel_source()
    digest = hashlib.sha256("|".join((source, cpu_key(), compiler)).encode()).hexdigest()[:16]
    target = cache_dir("native", f"skinny-{digest}.so")
    if target.exists():
        return str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as folder:
        c_file, so_file = os.path.join(folder, "skinny.c"), os.path.join(folder, "skinny.so")
        with open(c_file, "w") as handle:
            handle.write(source)
        done = subprocess.run([compiler, "-O3", "-march=native", "-shared", "-fPIC", "-o", so_file, c_file],
                              capture_output=True, text=True, stdin=subprocess.DEVNULL)
        if done.returncode != 0:
            return None
        os.replace(so_file, target)  # atomic: a process beside this one sees the whole file or none
    return str(target)


def skinny_kernel() -> dict | None:
    """The compiled products, ``{weight dtype: ctypes function}`` (``skinny_f32``, ``skinny_f16``, ``skinny_i8``), or
    None where they cannot be built or are switched off."""
    if not native_enabled():
        return None
    path = _build()
    return None if path is None else _load(path)


def kernel_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  scale: torch.Tensor | None = None) -> torch.Tensor | None:
    """``F.linear(x, weight, bias)`` by the compiled kernel for a float32 CPU ``x`` of 1-8 rows and a float32 or
    float16 weight (float32 bias), or None where the kernel does not take the call (no kernel, other dtypes or device,
    more rows, a width not a multiple of 16 or not the weight's). A float16 weight is widened as it is read: the
    result is the float32 product with the float16-rounded weights, ``F.linear(x, weight.float(), bias)`` up to float
    rounding. An int8 weight takes its rows' float32 ``scale [out]`` (``kernels.use_int8_weights``) and gives
    ``F.linear(x, weight.float()) * scale + bias``; without one it is declined.

    Called once per linear layer of a forward, so its own work is kept small (~19 µs a call on the AVX2 EPYC,
    ``F.linear``'s ~8): a contiguous ``x`` is read where it lies (its rows are already ``[rows, in]`` in memory)
    and the result is allocated in its final shape. Inside ``torch.compile`` the call is the custom operator
    ``specresearch::kernel_linear`` (what it takes is decided from shapes and dtypes alone), so a compiled step keeps
    the kernel and traces as one graph.
    """
    if not _takes(x, weight, bias, scale):
        return None
    if torch.compiler.is_compiling():
        return _kernel_op(x, weight, bias, scale)
    return _run_kernel(x, weight, bias, scale)


@torch._dynamo.assume_constant_result  # a compiled step reads it once, as a constant (building it is no tensor work)
def _kernel_dtypes() -> str:
    """The weight dtypes the compiled kernel takes here, by name ("float32 float16 int8"; empty where it cannot be
    built or is switched off): a string, which a compiled graph can guard on."""
    kernels = skinny_kernel()
    return "" if kernels is None else " ".join(str(dtype).removeprefix("torch.") for dtype in kernels)


def _takes(x, weight, bias, scale) -> bool:
    """Whether the kernel takes the call, from shapes, dtypes and devices only."""
    width = x.shape[-1]
    rows = x.numel() // max(width, 1)
    if (rows not in KERNEL_ROWS or x.dtype is not torch.float32 or not x.is_cpu
            or not weight.is_cpu or width % 16 or width != weight.shape[1] or not weight.is_contiguous()):
        return False
    if torch.compiler.is_compiling():  # read once, as a constant
        available = str(weight.dtype).removeprefix("torch.") in _kernel_dtypes().split()
    else:
        kernels = skinny_kernel()
        available = kernels is not None and weight.dtype in kernels
    if not available or (bias is not None and (bias.dtype is not torch.float32 or not bias.is_contiguous())):
        return False
    return weight.dtype is not torch.int8 or (scale is not None and scale.dtype is torch.float32 and scale.is_contiguous()
                                              and scale.shape == weight.shape[:1] and scale.is_cpu)


def _run_kernel(x, weight, bias, scale) -> torch.Tensor | None:
    """The ctypes call (the caller checked :func:`_takes`); None if the kernel declined at run time."""
    x = x.contiguous()  # itself where it already is
    out = torch.empty(*x.shape[:-1], weight.shape[0], dtype=torch.float32)  # whatever torch's default dtype
    rows = x.numel() // max(x.shape[-1], 1)
    if skinny_kernel()[weight.dtype](x.data_ptr(), weight.data_ptr(), None if scale is None else scale.data_ptr(),
                                     None if bias is None else bias.data_ptr(), out.data_ptr(), rows, x.shape[-1],
                                     weight.shape[0]):
        return None
    return out


@torch.library.custom_op("specresearch::kernel_linear", mutates_args=())
def _kernel_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               scale: torch.Tensor | None) -> torch.Tensor:
    """:func:`kernel_linear` as one operator for ``torch.compile`` (the same product; ``F.linear`` if it declines)."""
    out = _run_kernel(x, weight, bias, scale)
    if out is not None:
        return out
    y = torch.nn.functional.linear(x, weight.float())
    y = y if scale is None else y * scale
    return y if bias is None else y + bias


@_kernel_op.register_fake
def _(x, weight, bias, scale):
    return x.new_empty(*x.shape[:-1], weight.shape[0], dtype=torch.float32)
