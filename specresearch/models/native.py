"""A compiled product for 1-8 rows on x86 CPUs with AVX-512: what makes a call scoring a tree or a long block cost
little more than one scoring a single token (used by :mod:`specresearch.models.kernels`).

Why: a small model's forward is bound by streaming its weights from memory, so scoring 8 tokens could cost what
scoring 1 does. MKL's products for 3-8 rows do not get there on one thread: on a 2-core AMD EPYC a call of the
embedded target scoring 4 / 8 tokens costs 1.29 / 2.04 one-token calls with them, 1.15 / 1.35 with this kernel
(``benchmarks/bench_native.py``, record ``native_amd``; docs/trees.md). The kernel multiplies
``y[r, o] = sum_i x[r, i] W[o, i] (+ b[o])`` for n <= 8 rows by reading each weight once, ``OB`` weight rows at a
time, with 16-lane partial sums in registers for every pair of weight row and input row (n * OB accumulators, at
most 25 of AVX-512's 32 registers) and the next blocks' rows prefetched. The partial sums are reduced in a fixed
order, so a row's result does not depend on how many rows share the call (``tests/test_native.py``), and it equals
``F.linear`` up to float rounding (~1e-6 relative).

How: the C source (:func:`kernel_source`) is compiled once per machine with the system C compiler (``$CC``, else
``cc``) and ``-O3 -march=native`` into ``<cache_dir>/native/`` and loaded with ``ctypes`` (no torch headers, about
two seconds to build). Where there is no compiler, no AVX-512, another architecture, or ``$SPECRESEARCH_NATIVE=0``,
:func:`skinny_kernel` is None and nothing changes. Whether it is used for a row count is timed on the model's own
weights, as the skinny rows are (``kernels.choose_kernel_rows``; here it wins for 3-8 rows). It has no gradient
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

__all__ = ["KERNEL_ROWS", "kernel_source", "skinny_kernel", "kernel_linear", "native_enabled"]


KERNEL_ROWS = range(1, 9)  # row counts the kernel computes
_BLOCK = {1: 8, 2: 8, 3: 7, 4: 6, 5: 5, 6: 4, 7: 3, 8: 3}  # weight rows per block: n * OB + OB + 1 <= 32 registers
_PREFETCH = 4  # blocks ahead
NATIVE_ENV = "SPECRESEARCH_NATIVE"


def _block(n: int, ob: int, name: str, prefetch: bool) -> str:
    ahead = f"w + (o + {_PREFETCH * ob} + b) * in + i"
    fetch = (f"        for (int b = 0; b < {ob}; b++) _mm_prefetch((const char *)({ahead}), _MM_HINT_T0);\n"
             if prefetch else "")
    return f"""
static inline void {name}(const float *x, const float *w, const float *bias, float *y, long in, long out, long o) {{
    __m512 acc[{ob}][{n}];
    _Pragma("GCC unroll 8") for (int b = 0; b < {ob}; b++)
        _Pragma("GCC unroll 8") for (int r = 0; r < {n}; r++) acc[b][r] = _mm512_setzero_ps();
    for (long i = 0; i < in; i += 16) {{
        __m512 u[{ob}];
        _Pragma("GCC unroll 8") for (int b = 0; b < {ob}; b++) u[b] = _mm512_loadu_ps(w + (o + b) * in + i);
{fetch}        _Pragma("GCC unroll 8") for (int r = 0; r < {n}; r++) {{
            __m512 xv = _mm512_loadu_ps(x + r * in + i);
            _Pragma("GCC unroll 8") for (int b = 0; b < {ob}; b++) acc[b][r] = _mm512_fmadd_ps(u[b], xv, acc[b][r]);
        }}
    }}
    _Pragma("GCC unroll 8") for (int b = 0; b < {ob}; b++)
        _Pragma("GCC unroll 8") for (int r = 0; r < {n}; r++)
            y[r * out + o + b] = _mm512_reduce_add_ps(acc[b][r]) + (bias ? bias[o + b] : 0.0f);
}}"""


def kernel_source() -> str:
    """The C source: one block function per row count (and a one-row tail), ``skinny_f32`` dispatching on n. It
    returns 0, or 1 when it cannot take the call (n outside 1-8, ``in`` not a multiple of 16)."""
    parts = ["#include <immintrin.h>", "#ifndef __AVX512F__", "#error needs AVX-512F", "#endif"]
    for n in KERNEL_ROWS:
        ob = _BLOCK[n]
        parts += [_block(n, 1, f"tail_{n}", False), _block(n, ob, f"block_{n}", True), f"""
static void rows_{n}(const float *x, const float *w, const float *bias, float *y, long in, long out) {{
    long o = 0;
    for (; o + {ob} <= out; o += {ob}) block_{n}(x, w, bias, y, in, out, o);
    for (; o < out; o++) tail_{n}(x, w, bias, y, in, out, o);
}}"""]
    cases = "\n".join(f"    case {n}: rows_{n}(x, w, bias, y, in, out); return 0;" for n in KERNEL_ROWS)
    parts.append(f"""
int skinny_f32(const float *x, const float *w, const float *bias, float *y, long n, long in, long out) {{
    if (in % 16) return 1;
    switch (n) {{
{cases}
    default: return 1;
    }}
}}""")
    return "\n".join(parts) + "\n"


def native_enabled() -> bool:
    """False where ``$SPECRESEARCH_NATIVE`` is ``0`` (or ``off`` / ``false``)."""
    return os.environ.get(NATIVE_ENV, "1").strip().lower() not in ("0", "off", "false", "no")


@functools.cache
def _load(path: str):
    library = ctypes.CDLL(path)
    function = library.skinny_f32
    function.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_long] * 3
    function.restype = ctypes.c_int
    return function


@functools.cache
def _build() -> str | None:
    """Compile the source once per machine (cached by source, CPU name and flags, and compiler); None when it cannot be
    built here."""
    from specresearch.paths import cache_dir, cpu_fields, cpu_key

    if platform.machine().lower() not in ("x86_64", "amd64") or "avx512f" not in cpu_fields().get("flags", "").split():
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


def skinny_kernel():
    """The compiled ``skinny_f32`` (a ctypes function), or None where it cannot be built or is switched off."""
    if not native_enabled():
        return None
    path = _build()
    return None if path is None else _load(path)


def kernel_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """``F.linear(x, weight, bias)`` by the compiled kernel for float32 CPU tensors of 1-8 rows, or None where the
    kernel does not take the call (no kernel, other dtype or device, more rows, a width not a multiple of 16)."""
    kernel = skinny_kernel()
    rows = x.numel() // max(x.shape[-1], 1)
    if (kernel is None or rows not in KERNEL_ROWS or x.dtype != torch.float32 or weight.dtype != torch.float32
            or x.device.type != "cpu" or weight.device.type != "cpu" or weight.shape[1] % 16
            or not weight.is_contiguous()):
        return None
    if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
        return None
    flat = x.reshape(rows, x.shape[-1]).contiguous()
    out = torch.empty(rows, weight.shape[0], dtype=torch.float32)
    if kernel(flat.data_ptr(), weight.data_ptr(), None if bias is None else bias.data_ptr(), out.data_ptr(), rows,
              weight.shape[1], weight.shape[0]):
        return None
    return out.reshape(*x.shape[:-1], weight.shape[0])
