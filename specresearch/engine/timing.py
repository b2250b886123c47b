"""Timing on any device: a clock that waits for queued device work, and interleaved medians of calls.

Benchmarks and measurements time through these, never tests: a wall-clock figure is a record, not an assertion.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

__all__ = ["clock", "step_clock", "TimedCall", "interleaved_medians"]


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
