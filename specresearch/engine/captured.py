"""How a captured step runs: eagerly, compiled by ``torch.compile``, or captured once as a CUDA graph and replayed.

A step here is a function of no arguments that reads and writes preallocated tensors in place
(:mod:`specresearch.engine.static`), never reads the host and never changes a shape, so each of these runs it:

* ``"eager"``: as it is (the CPU default: the step's kernels, not Python, bound a small model's step there);
* ``"inductor"``: ``torch.compile(step, fullgraph=True, dynamic=False)`` on any device (one graph, no break);
* ``"reduce-overhead"``: the same with ``mode="reduce-overhead"`` (inductor's CUDA graphs), CUDA only;
* ``"cudagraph"``: ``torch.cuda.CUDAGraph`` captures the eager step after a warm-up on a side stream and every call
  replays it, CUDA only. The warm-up runs the step for real, so the small state it changes (``state``: lengths,
  pending tokens, logs; not the caches' buffers, which a step writes only past the rows' lengths) is saved before it
  and put back after each call (:func:`warm_up`); capture itself runs nothing.

Random numbers never come from inside the step: its uniforms are drawn into a buffer before each call (the
engine's ``_draw``), so a replay uses the run's generator and a seed repeats a run in every mode.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence

import torch

from specresearch.config import CUDA_GRAPH_MODES
from specresearch.models.static_cache import mark_static

__all__ = ["RUNNER_MODES", "StepRunner", "SavedState", "warm_up"]

RUNNER_MODES = ("eager", "inductor", "reduce-overhead", "cudagraph")
RECOMPILE_LIMIT = 64  # compiled forms of the step dynamo keeps (one per run's shapes and settings)


class SavedState:
    """A copy of a step's small state (``state``: the tensors it changes in place), taken now; :meth:`put_back`
    writes it back into the same tensors (their addresses kept, as a captured step needs), as often as asked."""

    def __init__(self, state: Sequence[torch.Tensor]):
        self.state = list(state)
        self.saved = [t.clone() for t in self.state]

    def put_back(self) -> None:
        for tensor, value in zip(self.state, self.saved):
            tensor.copy_(value)


def warm_up(step: Callable[[], None], state: Sequence[torch.Tensor], times: int = 2) -> None:
    """Run ``step`` ``times`` times, each from the state it found (``state`` put back after every call): a warm-up
    changes nothing, and never runs a step from a state no real call would see (two steps in a row from one read
    would write the log past its ``steps_per_read`` rows: the device-side assert of the first GPU run)."""
    saved = SavedState(state)
    for _ in range(times):
        step()
        saved.put_back()


class StepRunner:
    """Calls ``step`` as ``mode`` says (module docstring); ``state``: the tensors the step changes but the caches'
    buffers (or a function giving them, asked when the step is prepared: buffers that appear with a run's prefill,
    such as recurrent layers' kept states, ``models.static_states``); ``device``: where they live."""

    def __init__(self, step: Callable[[], None], mode: str,
                 state: Sequence[torch.Tensor] | Callable[[], Sequence[torch.Tensor]], device):
        if mode not in RUNNER_MODES:
            raise ValueError(f"mode must be one of {RUNNER_MODES}, got {mode!r}")
        device = torch.device(device)
        if mode in CUDA_GRAPH_MODES and device.type != "cuda":
            raise ValueError(f"mode {mode!r} captures CUDA graphs: it needs a CUDA device, the models are on {device} "
                             "(use 'inductor' or 'eager')")
        self.step, self.mode, self.device = step, mode, device
        self._state = state if callable(state) else list(state)
        mark_static(*self.state)
        self._graph: torch.cuda.CUDAGraph | None = None
        self._call = step
        self.prepared = mode == "eager"  # nothing to compile or capture
        if mode in ("inductor", "reduce-overhead"):
            # every run's step is the same code, compiled again for each run's tensors: let dynamo keep as many
            # compiled forms as the engine keeps runs (engine.static.SESSIONS_KEPT per target), not its default 8
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
            options = {"mode": "reduce-overhead"} if mode == "reduce-overhead" else {}
            self._call = torch.compile(step, fullgraph=True, dynamic=False, **options)

    @property
    def state(self) -> list[torch.Tensor]:
        return list(self._state()) if callable(self._state) else self._state

    def prepare(self) -> None:
        """Compile or capture the step now, if not yet done (eager: nothing), so that no call pays for it: the
        compiled step is warmed up from the state it finds (given back after each call, :func:`warm_up`; a line on
        stderr says so), a CUDA graph captured. The caller may time it apart (``GenerationResult.compile_seconds``)."""
        if self.prepared:
            return
        if self.mode == "cudagraph":
            self._graph = self._capture()
        else:  # reduce-overhead: the first call compiles, the second records inductor's graph
            print(f"[specresearch] compiling a captured step ({self.mode}, {self.device.type}): once per step kind, "
                  "sampling and cache size in a process (on a CPU a minute or two, less once inductor's disk cache "
                  "holds it)", file=sys.stderr, flush=True)
            warm_up(self._call, self.state)
        self.prepared = True

    def __call__(self) -> None:
        if not self.prepared:  # compiled or captured once, here if the caller did not ask for it first
            self.prepare()
        if self._graph is not None:
            self._graph.replay()
        else:
            self._call()

    def _capture(self) -> "torch.cuda.CUDAGraph":
        """Warm the step up on a side stream (its state given back), then capture it."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            warm_up(self.step, self.state)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.step()
        return graph
