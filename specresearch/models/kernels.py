"""Kernels for small models: skinny linear products and half-precision weights on CPU, grouped-query attention; and
the experts a float64 mixture-of-experts model can run (:func:`experts_in_float64`).

Speed on CPUs: a speculative step scores gamma + 1 tokens in one call, so the target's linear layers
multiply 2-9 rows by each weight, and autoregressive decoding 1. A forward of a small model is bound by
streaming its weights from memory, but MKL (PyTorch's CPU BLAS) computes ``x @ W^T`` with 1 row as a GEMV
that streams W at half the rate of a GEMM here, with 2 or 3 rows as one GEMV per row, and from 4 rows on as
a blocked GEMM that packs W first. ``(W @ x^T)^T`` with ``x`` contiguous is a GEMM with N = rows that streams
W once; with one row it is a GEMV again, so one row is padded to two. :class:`CausalLM` switches the
model's ``nn.Linear`` layers to :class:`SkinnyLinear`, which does that for 1-8 rows on CPU (same
parameters; ``skinny_linear=False`` opts out): on the machine this was measured on, a one-token call of
the embedded target costs 0.6-0.9 of ``nn.Linear``'s and a two-token call 0.4-0.65 (1-2 threads;
``benchmarks/bench_score_cost.py``, figures in ``docs/feature_drafts.md``). On another CPU (a Xeon with
AVX-512 and AMX) the plain product is twice as fast for one row, so by default :class:`CausalLM` times
both on the model's own weights when it loads (:func:`choose_skinny_rows`, ~7 s for the embedded
target) and computes only the row counts where the skinny product wins its own way.

Half-precision weights for drafts (:func:`use_half_weights`): a draft's weights stored in float16 halve
the bytes streamed per call; its activations, biases and everything between the linear layers stay
float32. :func:`skinny_linear` sees the dtypes differ and multiplies 1-4 rows in float16 (a oneDNN
product that streams W at twice the float32 rate here) and more rows in float32 against the upcast
weights (float16 products slow down with rows on this CPU). The weights are the float16-rounded ones
either way; the draft's q is whatever it computes, so losslessness is untouched. A float16 product of an input row
``x`` cannot overflow while ``max|x| * max_o sum_i |W[o, i]| < 65,504`` (every partial sum is bounded by it):
:func:`use_half_weights` stores each layer's limit on ``max|x|`` (``half_limit``, half of that bound) and a row
above it is divided by a power of two first and multiplied back in float32. Powers of two commute with float
rounding, so rows under the limit compute bit for bit what they did, and rows over it no longer give inf: the
target's features at a prompt's first token (its attention sink) reach 22,000 in SmolLM2-135M, which made the
float16 feature head's logits NaN on one-token raw prompts. Where a layer has kernel rows (:func:`use_kernel_rows`;
``drafts.registry.half_weight_draft`` times them on the float16 weights), the compiled kernel takes those rows
instead: it widens the float16 weights to float32 as it reads them, so nothing is scaled and nothing can overflow.

Int8 weights for drafts (:func:`use_int8_weights`): a quarter of float32's bytes, each output row ``o`` stored as
``round(W[o] / scale[o])`` with ``scale[o] = max_i |W[o, i]| / 127`` (symmetric, per row; ``weight_scale``, a buffer
beside the weight). :func:`skinny_linear` hands 1-8 rows to the compiled kernel, which converts the weights as it
reads them and multiplies each row's float32 sum by its scale; any other call multiplies the weights converted to
the input's dtype (a copy per call: int8 pays off only where the kernel runs). As with float16, the draft's q is
whatever it computes, so losslessness is untouched; what the rounding costs in acceptance is measured
(``docs/feature_drafts.md``).
"""

from __future__ import annotations

import os

import torch

from specresearch.models.native import (
    KERNEL_ROWS,
    kernel_linear,
    kernel_source,
    skinny_kernel,
)

__all__ = ["SkinnyLinear", "skinny_linear", "use_skinny_linears", "choose_skinny_rows", "use_kernel_rows", "choose_kernel_rows", "use_half_weights", "half_input_limit", "use_int8_weights", "int8_rows",
           "FLOAT64_EXPERTS", "experts_in_float64"]


SKINNY_ROWS = range(1, 9)  # row counts :func:`skinny_linear` computes as (W @ x^T)^T on CPU


HALF_ROWS = 4  # up to this many rows, half weights multiply in their own dtype (module docstring)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                  skinny_rows=SKINNY_ROWS, half_limit: float | None = None, kernel_rows=(),
                  weight_scale: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``; on CPU with 1-8 rows computed as ``(W @ x^T)^T`` (module docstring).

    ``x``: ``[..., in]``; rows = ``x.numel() / in``. The product takes ``x`` contiguous (a column-major ``x``,
    such as the previous layer's transposed output, sends MKL down a path ~3x slower) and one row padded
    to two (MKL's one-column product is a GEMV). The same function up to float rounding (~1e-6 relative);
    any other row count (outside ``skinny_rows``), device or an empty input takes ``F.linear`` unchanged. A
    ``weight`` whose dtype differs from ``x``'s (half weights, :func:`use_half_weights`) is multiplied as the
    module docstring says; ``half_limit`` (from :func:`half_input_limit`, computed here when None) bounds its rows.
    Row counts in ``kernel_rows`` go to the compiled kernel (:func:`specresearch.models.native.kernel_linear`) when it
    takes the call and no gradient is asked for. An int8 ``weight`` (:func:`use_int8_weights`) with its rows'
    ``weight_scale`` goes to the kernel whenever it takes the call (anything else converts the whole weight), else
    ``F.linear(x, weight.to(x.dtype)) * weight_scale + bias``.
    """
    rows = x.numel() // max(x.shape[-1], 1)
    if weight.dtype == torch.int8:  # int8 weights with a scale per output row (use_int8_weights)
        if weight_scale is None:
            raise ValueError("an int8 weight needs its rows' weight_scale (models.kernels.use_int8_weights)")
        y = None if torch.is_grad_enabled() and x.requires_grad else kernel_linear(x, weight, bias, weight_scale)
        if y is None:
            y = torch.nn.functional.linear(x, weight.to(x.dtype)) * weight_scale.to(x.dtype)
            y = y if bias is None else y + bias
        return y
    if rows in kernel_rows and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)):
        y = kernel_linear(x, weight, bias)
        if y is not None:
            return y
    if weight.dtype != x.dtype:  # half weights, float32 activations (use_half_weights)
        if rows <= HALF_ROWS:
            limit = half_input_limit(weight) if half_limit is None else half_limit
            scale = torch.exp2(torch.ceil(torch.log2(x.abs().amax(-1, keepdim=True) / limit))).clamp(min=1.0)  # no host sync
            y = torch.nn.functional.linear((x / scale).to(weight.dtype), weight).to(x.dtype) * scale
        else:
            y = torch.nn.functional.linear(x, weight.to(x.dtype))
        return y if bias is None else y + bias
    if rows not in skinny_rows or x.device.type != "cpu":
        return torch.nn.functional.linear(x, weight, bias)
    flat = x.reshape(rows, x.shape[-1])
    flat = (flat.expand(2, -1) if rows == 1 else flat).contiguous()
    y = torch.mm(weight, flat.t()).t()[:rows].contiguous()  # [rows, out], row-major for what follows
    if bias is not None:
        y = y + bias
    return y.reshape(*x.shape[:-1], weight.shape[0])


class SkinnyLinear(torch.nn.Linear):
    """``nn.Linear`` whose forward is :func:`skinny_linear`: 1-8 rows on CPU as ``(W @ x^T)^T``.

    The same function (up to float rounding), parameters and state dict; any other number of rows (>= 9:
    MKL's blocked GEMM wins again) or device takes ``nn.Linear``'s path unchanged.
    """

    SKINNY_ROWS = SKINNY_ROWS
    skinny_rows = SKINNY_ROWS  # the row counts this layer computes its own way (use_skinny_linears may narrow them)

    half_limit = None  # set by use_half_weights: the largest |input| a float16 product of this weight takes
    kernel_rows = ()  # row counts the compiled kernel computes (use_kernel_rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return skinny_linear(x, self.weight, self.bias, skinny_rows=self.skinny_rows, half_limit=self.half_limit,
                             kernel_rows=self.kernel_rows, weight_scale=getattr(self, "weight_scale", None))


def use_skinny_linears(model: torch.nn.Module, rows=SKINNY_ROWS) -> int:
    """Switch every plain ``nn.Linear`` of ``model`` to :class:`SkinnyLinear` in place (parameters and state
    dict untouched), computing ``rows`` (a subset of ``SKINNY_ROWS``) its own way; returns how many were
    switched. Subclasses of ``nn.Linear`` are left as they are, and so is every ``nn.Linear`` when ``rows`` is
    empty; every module that carries a ``skinny_rows`` attribute (:class:`SkinnyLinear`, a draft's
    vocabulary-subset head) is given ``rows``."""
    rows = tuple(rows)
    if not set(rows) <= set(SKINNY_ROWS):
        raise ValueError(f"rows must lie in {tuple(SKINNY_ROWS)}, got {rows}")
    switched = 0
    for module in model.modules():
        if type(module) is torch.nn.Linear and rows:
            module.__class__ = SkinnyLinear
            switched += 1
        if hasattr(module, "skinny_rows"):
            module.skinny_rows = rows if rows != tuple(SKINNY_ROWS) else SKINNY_ROWS
    return switched


SKINNY_ROWS_ENV = "SPECRESEARCH_SKINNY_ROWS"


_CHOSEN_ROWS: dict[tuple, tuple[int, ...]] = {}


TIMED_MIN_BYTES = 8 << 20  # float32 weights under this stay in a CPU's caches: timing products on them is noise


class _Product:
    """A fused group's product as the calibrations time it: its weight and bias, and its first member's options."""

    def __init__(self, member: torch.nn.Module, weight: torch.Tensor, bias: torch.Tensor | None):
        self.member, self.weight, self.bias = member, weight, bias

    def __getattr__(self, name):
        return getattr(self.member, name)


def _products(model: torch.nn.Module, attribute: str) -> list:
    """The products a forward of ``model`` computes, in module order: its ``nn.Linear`` layers and the modules that
    carry ``attribute``, a fused group (``models.fused``: members with a ``computes`` weight) once, by its whole
    weight, where its first member stands."""
    layers = []
    for module in model.modules():
        if not (isinstance(module, torch.nn.Linear) or hasattr(module, attribute)):
            continue
        computes = getattr(type(module), "computes", None)
        if computes is None:
            layers.append(module)
        elif (weights := module.computes)[0] is not None:
            layers.append(_Product(module, *weights))
    return layers


def _fits_in_cache(weights) -> bool:
    """True when ``weights`` take less than ``TIMED_MIN_BYTES``: neither the skinny rows nor the kernel's are timed for
    them (which rows won would change from run to run), and the present products are kept."""
    return sum(w.numel() * w.element_size() for w in weights) < TIMED_MIN_BYTES


def choose_skinny_rows(model: torch.nn.Module, *, repeats: int = 5, margin: float = 0.9, timer=None) -> tuple[int, ...]:
    """The row counts (of ``SKINNY_ROWS``) for which :func:`skinny_linear` beats ``F.linear`` on this machine,
    timed on ``model``'s own float32 linear layers (and modules that carry ``skinny_rows``). For each row
    count, one sweep multiplies an input by every such layer's weight in module order, as a forward
    streams them; ``repeats`` rounds each time both paths' sweeps of every row count in turn, and a row
    count is chosen when its median skinny sweep takes less than ``margin`` times its median plain one. A first
    timing says so on stderr and keeps to a budget (:func:`_race`, :func:`_fitted_subset`): it sweeps the first
    weights up to ``SWEEP_BYTES`` (fewer where one sweep shows slow memory), stops timing a row count that clearly
    loses after two rounds, and stops its rounds after ``CALIBRATION_SECONDS``.
    A sweep reads each weight once, so a model larger than the CPU's caches is timed from memory, as its
    forwards run (one weight per shape timed over and over stays in cache, where the plain one-row
    product looked 3x faster than the skinny one on an AMD EPYC whose forwards ran it 1.4x slower); a model whose
    float32 linear weights take less than ``TIMED_MIN_BYTES`` (8 MiB) stays in cache and is not timed: ().
    Which is faster depends on the CPU (docs/engine_and_models.md). ``$SPECRESEARCH_SKINNY_ROWS`` pins the answer without timing: ``all``,
    ``none`` or row counts such as ``1,2,3``; ``auto`` (or unset) times once per machine: answers are kept per layer
    shapes and thread count for the process and in ``<cache_dir>/skinny_rows.json`` for later processes, keyed by the
    CPU's model name and flags (``paths.cpu_key``) and torch's version (delete the file to time again). ``timer(fn, path, rows) -> seconds`` (path ``"skinny"`` or
    ``"plain"``) replaces the clock that times one sweep ``fn()`` (tests).
    """
    pinned = os.environ.get(SKINNY_ROWS_ENV, "auto").strip().lower()
    if pinned != "auto":
        if pinned in ("all", "none"):
            return tuple(SKINNY_ROWS) if pinned == "all" else ()
        try:
            rows = tuple(sorted({int(r) for r in pinned.split(",") if r.strip()}))
        except ValueError:
            rows = None
        if rows is None or not set(rows) <= set(SKINNY_ROWS):
            raise ValueError(f"${SKINNY_ROWS_ENV} must be auto, all, none or row counts in {tuple(SKINNY_ROWS)} "
                             f"separated by commas, got {pinned!r}")
        return rows
    weights = [layer.weight.detach() for layer in _products(model, "skinny_rows")
               if layer.weight.device.type == "cpu" and layer.weight.dtype == torch.float32]
    if not weights or _fits_in_cache(weights):
        return ()
    key = (tuple(tuple(w.shape) for w in weights), torch.get_num_threads())
    if timer is None and key in _CHOSEN_ROWS:
        return _CHOSEN_ROWS[key]
    if timer is None and (stored := _stored_rows(key)) is not None:
        _CHOSEN_ROWS[key] = stored
        return stored

    def sweeps(subset):
        made = {}
        for rows in SKINNY_ROWS:
            inputs = {w.shape[1]: torch.randn(rows, w.shape[1], generator=torch.Generator().manual_seed(rows))
                      for w in subset}
            made[rows] = {"skinny": lambda x=inputs: [skinny_linear(x[w.shape[1]], w) for w in subset],
                          "plain": lambda x=inputs: [torch.nn.functional.linear(x[w.shape[1]], w) for w in subset]}
        return made

    real = timer is None
    subset = _fitted_subset(weights, lambda part: sweeps(part)[1]["plain"], repeats) if real else weights
    if real:
        _announce("the skinny product's row counts", subset, ROWS_FILE)
    chosen = _race(sweeps(subset), ("skinny", "plain"), repeats, margin, timer)
    if real:
        _CHOSEN_ROWS[key] = chosen
        _store_rows(key, chosen)
    return chosen


CALIBRATION_SECONDS = 8.0  # each of choose_skinny_rows and choose_kernel_rows: a first token waits for both
SWEEP_BYTES = 128 << 20  # a sweep's weights: more than a CPU's caches hold, a quarter of the embedded target's
# the fewest a sweep reads however slow the memory (at 0.1 GB/s the warm-up and one round of 16 sweeps take ~8 s)
SWEEP_FLOOR_BYTES = 24 << 20


def _clock(fn, path, rows) -> float:
    import time

    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _fitted_subset(weights: list[torch.Tensor], plain_sweep, repeats: int, seconds: float = CALIBRATION_SECONDS):
    """The weights a calibration sweeps: the first ones in module order (a forward's order) up to ``SWEEP_BYTES``, as
    many shapes as a few layers have, then fewer where one measured sweep (``plain_sweep(part)`` -> its function)
    says that 16 paths x (1 + ``repeats``) sweeps would pass ``seconds``, down to ``SWEEP_FLOOR_BYTES``: a machine
    whose memory streams at 0.1 GB/s calibrates on fewer weights, and ``_race``'s deadline ends its rounds."""
    subset = _prefix(weights, SWEEP_BYTES)
    with torch.no_grad():
        once = _clock(plain_sweep(subset), "plain", 1)
    affordable = seconds / max(16 * 1.3 * (1 + repeats) * once, 1e-9)  # fraction of the subset the budget sweeps
    if affordable < 1:  # but not under SWEEP_FLOOR_BYTES: the rounds' deadline bounds a slower machine
        subset = _prefix(subset, max(affordable * sum(w.numel() * w.element_size() for w in subset), SWEEP_FLOOR_BYTES))
    return subset


def _prefix(weights: list[torch.Tensor], limit: float) -> list[torch.Tensor]:
    """The first ``weights`` until they hold ``limit`` bytes (at least one)."""
    kept, total = [], 0
    for w in weights:
        if kept and total >= limit:
            break
        kept.append(w)
        total += w.numel() * w.element_size()
    return kept


def _announce(what: str, subset: list[torch.Tensor], file: str) -> None:
    """Say on stderr what is timed, that it happens once per machine, and its bound."""
    import sys

    megabytes = sum(w.numel() * w.element_size() for w in subset) / 2**20
    print(f"[specresearch] timing {what} on this CPU ({megabytes:.0f} MB of the model's weights, at most "
          f"~{CALIBRATION_SECONDS:.0f} s); once per machine, kept in <cache>/{file}", file=sys.stderr, flush=True)


def _race(sweeps: dict, paths: tuple[str, str], repeats: int, margin: float, timer=None,
          seconds: float = CALIBRATION_SECONDS) -> tuple[int, ...]:
    """Round-robin timing of ``sweeps[rows][path]()`` for the two ``paths`` (candidate, baseline): the row counts whose
    median candidate sweep takes less than ``margin`` times the median baseline one. A row count whose every candidate
    sweep is slower than every baseline sweep after two rounds is not timed again (it clearly loses); with the real
    clock (``timer`` None) the rounds stop once ``seconds`` have passed (at least one round is timed)."""
    import statistics
    import time

    candidate, baseline = paths
    clock, started = timer or _clock, time.perf_counter()
    times = {(rows, path): [] for rows in sweeps for path in paths}
    alive = list(sweeps)
    with torch.no_grad():
        for row_paths in sweeps.values():
            for fn in row_paths.values():
                fn()  # warm
        for done in range(1, repeats + 1):  # round robin: a passing slow spell of the host touches every row count alike
            for rows in alive:
                for path in paths:
                    times[rows, path].append(clock(sweeps[rows][path], path, rows))
            if done >= 2:
                alive = [r for r in alive if min(times[r, candidate]) <= max(times[r, baseline])]
            if timer is None and time.perf_counter() - started > seconds:
                break
    return tuple(rows for rows in sweeps
                 if statistics.median(times[rows, candidate]) < margin * statistics.median(times[rows, baseline]))


def _machine_key(key: tuple) -> str:
    """The cache entry of a skinny-rows answer: this CPU (``paths.cpu_key``: its name and instruction-set flags),
    torch's version, the thread count and a digest of the layer shapes."""
    import hashlib

    from specresearch.paths import cpu_key

    shapes = hashlib.sha1(repr(key[0]).encode()).hexdigest()[:12]
    return f"{cpu_key()}|torch {torch.__version__}|{key[1]} threads|{shapes}"


ROWS_FILE = "skinny_rows.json"


def _stored_rows(key: tuple) -> tuple[int, ...] | None:
    """The answer timed earlier on this machine for these shapes and threads, or None."""
    from specresearch.paths import cached_answer

    stored = cached_answer(ROWS_FILE, _machine_key(key))
    return tuple(stored) if isinstance(stored, list) and set(stored) <= set(SKINNY_ROWS) else None


def _store_rows(key: tuple, rows: tuple[int, ...]) -> None:
    """Keep the answer for the next process (the timing takes seconds)."""
    from specresearch.paths import keep_answer

    keep_answer(ROWS_FILE, _machine_key(key), list(rows))


def use_kernel_rows(model: torch.nn.Module, rows=KERNEL_ROWS) -> int:
    """Let ``model``'s linear layers compute ``rows`` (of ``native.KERNEL_ROWS``) with the compiled kernel; returns
    how many layers take them. Plain float32 ``nn.Linear`` layers become :class:`SkinnyLinear` computing no row count
    their own skinny way (``skinny_rows = ()``), so their other row counts stay ``F.linear``'s; every module that
    carries a ``kernel_rows`` attribute (:class:`SkinnyLinear`, a draft's vocabulary-subset head) is given ``rows``,
    float16 weights included (the kernel widens them as it reads them). Empty ``rows`` switches the kernel off again
    (and switches no layer)."""
    rows = tuple(rows)
    if not set(rows) <= set(KERNEL_ROWS):
        raise ValueError(f"rows must lie in {tuple(KERNEL_ROWS)}, got {rows}")
    count = 0
    for module in model.modules():
        if type(module) is torch.nn.Linear and rows and module.weight.dtype == torch.float32:
            module.__class__ = SkinnyLinear
            module.skinny_rows = ()
        if hasattr(module, "kernel_rows"):
            module.kernel_rows = rows
            count += 1
    return count


KERNEL_ROWS_FILE = "kernel_rows.json"
_CHOSEN_KERNEL_ROWS: dict[tuple, tuple[int, ...]] = {}


def choose_kernel_rows(model: torch.nn.Module, *, repeats: int = 5, margin: float = 0.9, timer=None) -> tuple[int, ...]:
    """The row counts for which the compiled kernel (:mod:`specresearch.models.native`) beats the path ``model``'s
    linear layers with float32 weights or half weights (:func:`use_half_weights`) take now (their ``skinny_rows`` and
    half-weight product, else ``F.linear``) on this machine; () where there is no kernel or the model's linear weights
    (int8 ones included, which the kernel always takes) take less than ``TIMED_MIN_BYTES`` (8 MiB: they stay in cache, where streaming them is not what a call waits for). Timed as :func:`choose_skinny_rows` times: one sweep reads every layer's weight once in module order,
    ``repeats`` round-robin rounds of both paths for every row count, a row count chosen when its median kernel sweep
    takes less than ``margin`` times its median present one, within the same budget. Answers are kept per layer shapes, the layers' skinny
    rows, thread count and kernel source (C and Python), for the process and in ``<cache_dir>/kernel_rows.json``. ``timer(fn, path,
    rows) -> seconds`` (path ``"kernel"`` or ``"present"``) replaces the clock (tests)."""
    import hashlib

    if skinny_kernel() is None and timer is None:
        return ()
    # float32 weights, and float16 ones that multiply float32 activations (use_half_weights: a half_limit), not those
    # of a float16 model, whose activations the kernel does not take
    layers = [m for m in _products(model, "kernel_rows")
              if m.weight.device.type == "cpu" and m.weight.shape[1] % 16 == 0 and m.weight.is_contiguous()
              and (m.weight.dtype == torch.float32
                   or m.weight.dtype == torch.float16 and getattr(m, "half_limit", None) is not None)]
    # whether a forward streams its weights from memory: every linear weight of the model counts (an int8 draft's
    # float16 input layers are timed, but its int8 layers stream beside them)
    streamed = [m.weight for m in _products(model, "kernel_rows")]
    if not layers or _fits_in_cache(streamed):
        return ()
    present_rows = tuple(tuple(getattr(m, "skinny_rows", ())) for m in layers)
    # the kernel's source and its Python wrapper's code (whose own work is part of what is timed; its bytecode, which
    # an install without .py files has too): either changed, re-time
    source = hashlib.sha1(kernel_source().encode() + kernel_linear.__code__.co_code).hexdigest()[:12]
    key = (tuple((*m.weight.shape, str(m.weight.dtype)) for m in layers), torch.get_num_threads(), (present_rows, source))
    entry = _machine_key(key) + f"|{hashlib.sha1(repr(key[2]).encode()).hexdigest()[:12]}"  # in kernel_rows.json
    if timer is None and key in _CHOSEN_KERNEL_ROWS:
        return _CHOSEN_KERNEL_ROWS[key]
    if timer is None:
        from specresearch.paths import cached_answer

        stored = cached_answer(KERNEL_ROWS_FILE, entry)
        if isinstance(stored, list) and set(stored) <= set(KERNEL_ROWS):
            _CHOSEN_KERNEL_ROWS[key] = tuple(stored)
            return tuple(stored)

    def present(m, x):
        bias = getattr(m, "bias", None)
        if hasattr(m, "skinny_rows"):
            return skinny_linear(x, m.weight, bias, skinny_rows=m.skinny_rows, half_limit=getattr(m, "half_limit", None))
        return torch.nn.functional.linear(x, m.weight, bias)

    def sweeps(part):
        made = {}
        for rows in KERNEL_ROWS:
            inputs = {m.weight.shape[1]: torch.randn(rows, m.weight.shape[1], generator=torch.Generator().manual_seed(rows))
                      for m in part}
            made[rows] = {"kernel": lambda x=inputs: [kernel_linear(x[m.weight.shape[1]], m.weight,
                                                                    getattr(m, "bias", None)) for m in part],
                          "present": lambda x=inputs: [present(m, x[m.weight.shape[1]]) for m in part]}
        return made

    real = timer is None
    if real:  # the calibration's weights (_fitted_subset), as modules
        by_weight = {id(m.weight): m for m in layers}
        chosen_weights = _fitted_subset([m.weight for m in layers],
                                        lambda part: sweeps([by_weight[id(w)] for w in part])[1]["present"], repeats)
        layers = [by_weight[id(w)] for w in chosen_weights]
        _announce("the compiled kernel's row counts", chosen_weights, KERNEL_ROWS_FILE)
    chosen = _race(sweeps(layers), ("kernel", "present"), repeats, margin, timer)
    if real:
        from specresearch.paths import keep_answer

        _CHOSEN_KERNEL_ROWS[key] = chosen
        keep_answer(KERNEL_ROWS_FILE, entry, list(chosen))
    return chosen


def use_half_weights(model: torch.nn.Module, types: tuple[type, ...] = (), *, shared_with: torch.nn.Module | None = None,
                     dtype: torch.dtype = torch.float16) -> int:
    """Give every ``nn.Linear`` (and module of ``types``: modules whose forward multiplies by ``self.weight``
    through :func:`skinny_linear`) of ``model`` a new weight, its old one in ``dtype``; returns how many.

    For inference: the new weights do not require grad. Plain ``nn.Linear`` layers become
    :class:`SkinnyLinear` (whose forward handles the mixed dtypes on any device); biases and every other
    parameter stay as they are. A weight tied to another module (an output head tied to the input
    embedding) is untied: only the linear layer gets the half copy. ``shared_with``: a model (the target)
    none of whose modules may be changed: a layer ``model`` shares with it raises ``ValueError`` before
    anything is done.
    """
    if dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"dtype must be torch.float16 or torch.bfloat16, got {dtype}")
    chosen = _weight_layers(model, types, shared_with, "half weights")
    for module in chosen:
        module.weight = torch.nn.Parameter(module.weight.detach().to(dtype), requires_grad=False)
        module.half_limit = half_input_limit(module.weight)
    return len(chosen)


def use_int8_weights(model: torch.nn.Module, types: tuple[type, ...] = (), *,
                     shared_with: torch.nn.Module | None = None) -> int:
    """Give every ``nn.Linear`` (and module of ``types``, as :func:`use_half_weights`) of ``model`` its weight in
    int8 with a float32 scale per output row (module docstring; the buffer ``weight_scale``); returns how many.

    For inference, as :func:`use_half_weights`: the new weights do not require grad, plain ``nn.Linear`` layers become
    :class:`SkinnyLinear`, a tied weight is untied, and a layer shared with ``shared_with`` raises before anything is
    done. A row of zeros gets scale 1 (its int8 row is zeros).
    """
    chosen = _weight_layers(model, types, shared_with, "int8 weights")
    for module in chosen:
        rows, scale = int8_rows(module.weight.detach())
        module.weight = torch.nn.Parameter(rows, requires_grad=False)
        module.register_buffer("weight_scale", scale, persistent=False)
    return len(chosen)


def int8_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight [out, in]`` -> its int8 rows and their float32 scales ``[out]`` (module docstring): ``round(W[o] /
    scale[o])`` with ``scale[o] = max_i |W[o, i]| / 127``, 1 for a row of zeros."""
    weight = weight.float()
    scale = weight.abs().amax(-1) / 127
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return torch.round(weight / scale[:, None]).clamp(-127, 127).to(torch.int8), scale.contiguous()


def _weight_layers(model: torch.nn.Module, types: tuple[type, ...], shared_with: torch.nn.Module | None,
                   what: str) -> list[torch.nn.Module]:
    """``model``'s ``nn.Linear`` layers (made :class:`SkinnyLinear`) and modules of ``types``, after checking that
    none of them belongs to ``shared_with``; fused projections (``models.fused.FusedLinear``: a layer with ``unfuse``)
    are unfused first, each layer then given its own weight."""
    chosen = [m for m in model.modules() if isinstance(m, (torch.nn.Linear, *types))]
    theirs = set() if shared_with is None else {id(m) for m in shared_with.modules()}
    shared = [type(m).__name__ for m in chosen if id(m) in theirs]
    if shared:
        raise ValueError(f"{what}: {len(shared)} layer(s) ({shared[0]}, ...) belong to the target too; "
                         "changing them would change the target")
    for module in chosen:
        if hasattr(module, "unfuse"):
            module.unfuse()
    for module in chosen:
        if type(module) is torch.nn.Linear:
            module.__class__ = SkinnyLinear
    return chosen


def half_input_limit(weight: torch.Tensor) -> float:
    """The largest ``max|x|`` of an input row whose product with the half ``weight [out, in]`` stays below half of
    float16's largest value, partial sums included (module docstring)."""
    return float(torch.finfo(torch.float16).max / 2 / weight.float().abs().sum(-1).max().clamp(min=1e-30))


FLOAT64_EXPERTS = ("eager", "batched_mm")  # transformers' experts implementations that torch computes in float64


def experts_in_float64(model, *, may_switch: bool = True) -> dict[str, str]:
    """A float64 mixture-of-experts model (Mixtral) whose experts run torch's ``grouped_mm`` (transformers' default),
    which takes no float64, is switched to ``"eager"`` (transformers' loop over the experts: the same function), or,
    with ``may_switch=False`` (the caller's model must stay as it is), refused with one line saying what to load.
    Any other model is left as it is. Returns the implementations switched from, by sub-config (``""``: the
    model's own)."""
    if model.dtype != torch.float64 or not hasattr(model, "get_experts_implementation"):
        return {}
    switched = {key: kind for key, kind in model.get_experts_implementation().items()
                if kind is not None and kind not in FLOAT64_EXPERTS}
    if switched and not may_switch:
        raise ValueError(f"{type(model).__name__} is float64 and its experts run {sorted(set(switched.values()))}, "
                         "which takes no float64: load it with experts_implementation='eager'")
    if switched:
        model.set_experts_implementation({key: "eager" for key in switched})
    return switched
