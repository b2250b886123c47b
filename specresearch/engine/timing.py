"""Timing on any device: a clock that waits for queued device work, interleaved medians of calls, and a counter of
host reads (each one waits for a GPU).

Benchmarks and measurements time through these, never tests: a wall-clock figure is a record, not an assertion.
"""

from __future__ import annotations

import collections
import statistics
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["clock", "step_clock", "TimedCall", "interleaved_medians", "HostReads", "HOST_READS", "Kernels"]

# Tensor methods that hand a value to the host (so, on a GPU, wait for the work queued before them).
HOST_READS = frozenset({"tolist", "item", "__bool__", "__int__", "__float__", "__index__", "nonzero", "cpu", "numpy",
                        "equal", "unique", "masked_select", "argwhere"})
# tensors made from host data: a copy to the device each call, which a CUDA graph cannot capture inside a step
HOST_WRITES = frozenset({"tensor", "as_tensor", "from_numpy"})


class HostReads(TorchFunctionMode):
    """Counts host reads while active (``with HostReads() as reads: ...``): ``reads.count`` in all, and
    ``reads.by_origin["specresearch"]`` / ``["other"]`` by whose code made the read (the innermost frame in
    this package or in an installed library). Works on any device, so a CPU run counts what a GPU would wait for.
    ``reads.calls`` counts the torch operations called from Python (the modules' own included, attribute reads such
    as ``.shape`` not): each costs the host microseconds and most launch a kernel, which bounds a small model's step
    on a GPU. ``reads.writes`` counts the tensors made from host data (``torch.tensor`` of a list, ...)."""

    def __init__(self):
        super().__init__()
        self.count = 0
        self.writes = 0
        self.calls = 0
        self.by_origin = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        self.calls += name != "__get__"
        self.writes += name in HOST_WRITES
        if name in HOST_READS:
            self.count += 1
            files = [f.filename for f in traceback.extract_stack()[:-1]]
            inner = next((f for f in reversed(files) if "site-packages" in f or "specresearch" in f), "")
            self.by_origin["other" if "site-packages" in inner else "specresearch"] += 1
        return func(*args, **(kwargs or {}))


class Kernels(TorchDispatchMode):
    """Counts the operators that launch device work while active (``with Kernels() as kernels: ...``):
    ``kernels.count``, and ``kernels.by_op`` by ATen operator. Counted below autograd and the composite operators,
    where a call has become the kernels that run (one ``F.linear`` is one ``mm``; an RMS norm five pointwise and
    reduction kernels); views and aliases (``view``, ``transpose``, ``expand``, ``_unsafe_view``, ``detach``, ...),
    which only change a tensor's metadata, are left out (``kernels.views``). What a CUDA graph of an eager step holds,
    one kernel per count, counted on any device: the CPU dispatches the same operators but for a few whose CUDA forms
    differ (attention's kernel: one call either way)."""

    METADATA = frozenset({"_unsafe_view", "detach", "lift_fresh", "alias", "_reshape_alias"})

    def __init__(self):
        super().__init__()
        self.count = 0
        self.views = 0
        self.by_op = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if func.is_view or name in self.METADATA:
            self.views += 1
        else:
            self.count += 1
            self.by_op[name] += 1
        return func(*args, **(kwargs or {}))


def clock(device: torch.device | str = "cpu") -> float:
    """Wall time after ``device`` has finished its queued work (CUDA kernels run asynchronously)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def step_clock(device: torch.device | str, timing: bool | None) -> Callable[[], float]:
    """The generation loops' clock. ``timing`` True: :func:`clock`, which waits for the device (on CUDA a host sync
    per reading, four a step); False: the host's clock, no wait (a loop then waits once, at its end, and step times
    are host times). None: on where it costs nothing (no CUDA device)."""
    device = torch.device(device)
    if timing if timing is not None else device.type != "cuda":
        return lambda: clock(device)
    return time.perf_counter


@dataclass(frozen=True)
class TimedCall:
    """One thing to time: ``setup`` (untimed), ``call`` (timed), ``reset`` (untimed, e.g. roll the cache back)."""

    call: Callable[[], object]
    setup: Callable[[], object] | None = None
    reset: Callable[[], object] | None = None


def interleaved_medians(calls: Sequence[TimedCall], *, repeats: int, warmup: int = 5, device="cpu") -> list[float]:
    """Median seconds of each of ``calls`` over ``repeats`` rounds (after ``warmup`` rounds); within a round the
    calls run in turn, so a shared, noisy machine slows them alike."""
    times = [[] for _ in calls]
    for _ in range(warmup + repeats):
        for timed, record in zip(calls, times):
            if timed.setup is not None:
                timed.setup()
            start = clock(device)
            timed.call()
            record.append(clock(device) - start)
            if timed.reset is not None:
                timed.reset()
    return [statistics.median(record[warmup:]) for record in times]
