"""What a speculative step costs on this machine, and the draft length it makes best.

A chain step with gamma drafted tokens makes gamma draft calls and one target call scoring gamma + 1 tokens;
autoregressive decoding makes one target call scoring 1 token per token. With r_n = T(n) / T(1) the cost of a target
call scoring n tokens and c = one draft call / T(1), a step that emits E(gamma) tokens on average runs

    S(gamma) = E(gamma) / (r_{gamma+1} + gamma c + o)

times as fast as autoregressive decoding, o being the step's own work (sampling, verification, bookkeeping) over T(1).
That model misses what grows with gamma besides the target call (re-feeding a feature head the accepted tokens, longer
verification), and on a CPU whose r is not monotone its choice flips on a few percent of timing noise. So the
default is chosen on the measured cost of whole steps instead: s_gamma = the median seconds of a chain step at gamma
through the engine, over T(1), and S(gamma) = E(gamma) / s_gamma; r, c and o are kept to explain it (Leviathan et al., arXiv 2211.17192, take r flat at 1 and o = 0; on a CPU r
is not flat and not even monotone: ``benchmarks/bench_score_cost.py``). r, c and o depend on the machine, E on the
pair and the prompts. :func:`cost_curve` times r and c once per machine and keeps them in ``<cache_dir>/score_cost.json``
(keyed by the CPU, torch's version, the thread count, the device and the models' shapes, like the skinny-rows
choice); :func:`best_gamma` picks gamma. ``specresearch generate --gamma auto`` (and ``specresearch.generate(gamma="auto")``)
use it. The default gamma stays the measured one (``config.GENERATE_GAMMA``): on the 2-core AMD EPYC the predictions
err by more than the gaps between gammas (``benchmarks/records/cost_curve_amd.json``, docs/trees.md).
"""

from __future__ import annotations

import hashlib
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from specresearch.engine.timing import TimedCall, interleaved_medians
from specresearch.paths import cached_answer, cpu_name, keep_answer

__all__ = ["CostCurve", "score_seconds", "measure_cost_curve", "cost_curve", "predicted_speedup", "best_gamma", "default_gamma"]

COST_FILE = "score_cost.json"


@dataclass(frozen=True)
class CostCurve:
    """``ratios[n - 1]`` = r_n for n = 1..len (r_1 = 1); ``draft_ratio`` = c and ``overhead_ratio`` = o (0 without a
    draft); ``step_ratios[gamma - 1]`` = s_gamma, a whole chain step at gamma over T(1) (empty without a draft)."""

    ratios: tuple[float, ...]
    draft_ratio: float
    target_seconds: float  # T(1), for the record
    overhead_ratio: float = 0.0
    step_ratios: tuple[float, ...] = ()

    def r(self, n: int) -> float:
        return self.ratios[n - 1]


def score_seconds(target, ks: Sequence[int] = (1, 2, 3, 5), context_length: int = 64, repeats: int = 20,
                  warmup: int = 3) -> dict[int, float]:
    """Median wall time of one cached target call that scores k new tokens (B = 1), for each k of ``ks``.

    The ks are timed in turn within each repeat (``interleaved_medians``) and the cache is rolled back after every
    call. ``target``: a ``models.CausalLM`` (or anything with ``prefill``, ``score`` and ``rollback``). A
    measurement, never asserted on in tests.
    """
    if not ks or any(k < 1 for k in ks) or context_length < 1 or repeats < 1:
        raise ValueError(f"ks must be non-empty ints >= 1, context_length and repeats >= 1; got {ks}, {context_length}, {repeats}")
    ids = ((torch.arange(context_length + max(ks)) % 1000 + 100) % target.vocab_size)[None].to(target.device)  # [1, n]
    target.prefill(ids[:, :context_length], torch.ones_like(ids[:, :context_length]))
    calls = [TimedCall(lambda k=k: target.score(ids[:, context_length : context_length + k]), reset=lambda k=k: target.rollback(k))
             for k in ks]
    with torch.no_grad():
        medians = interleaved_medians(calls, repeats=repeats, warmup=warmup, device=target.device)
    return dict(zip(ks, medians))


def measure_cost_curve(target, draft=None, *, max_tokens: int = 5, context_length: int = 64, repeats: int = 9) -> CostCurve:
    """Time r_1..r_max_tokens for ``target`` (contexts of ``context_length`` tokens, interleaved medians of
    ``repeats``) and, with ``draft`` (any draft kind), c and o: the median seconds of its calls and of the steps' own
    work in a greedy gamma-1 run of 16 tokens through the engine (which times each step's parts), over T(1); and s_gamma
    for gamma = 1..max_tokens - 1: the median seconds of the steps of a 24-token run at T = 1, over T(1)."""
    from specresearch.config import SamplingConfig
    from specresearch.engine.generate import speculative_generate

    seconds = score_seconds(target, tuple(range(1, max_tokens + 1)), context_length, repeats)
    ratios = tuple(seconds[n] / seconds[1] for n in range(1, max_tokens + 1))
    if draft is None:
        return CostCurve(ratios, 0.0, seconds[1])
    prompt = ((torch.arange(context_length) % 1000 + 100) % target.vocab_size).tolist()

    def steps(gamma: int, max_new_tokens: int, temperature: float):
        run = speculative_generate(target, draft, [prompt], verifier="block", gamma=gamma, max_new_tokens=max_new_tokens,
                                   sampling=SamplingConfig(temperature=temperature), seed=0, step_timing=True)
        return [s for s in run.steps if s.gamma == gamma and s.draft_calls] or run.steps

    greedy = steps(1, 16, 0.0)
    draft_ratio = statistics.median(s.draft_seconds / s.draft_calls for s in greedy) / seconds[1]
    overhead_ratio = statistics.median(s.overhead_seconds for s in greedy) / seconds[1]
    step_ratios = tuple(statistics.median(s.seconds for s in steps(g, 24, 1.0)) / seconds[1] for g in range(1, max_tokens))
    return CostCurve(ratios, draft_ratio, seconds[1], overhead_ratio, step_ratios)


def _shapes(model) -> str:
    """The shapes of a model's parameters, or its class name when it has none visible."""
    inner = getattr(model, "model", None)
    inner = getattr(model, "head", None) if inner is None else inner
    if isinstance(inner, torch.nn.Module):
        return ";".join(f"{tuple(p.shape)}{p.dtype}" for p in inner.parameters())
    return type(model).__name__


def _key(target, draft, max_tokens: int) -> str:
    device = torch.device(target.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()
    shapes = hashlib.sha1(f"{_shapes(target)}|{_shapes(draft) if draft is not None else ''}".encode()).hexdigest()[:12]
    return f"{name}|torch {torch.__version__}|threads {torch.get_num_threads()}|{device.type}|{max_tokens}|{shapes}"


def cost_curve(target, draft=None, *, max_tokens: int = 5, cache: bool = True) -> CostCurve:
    """:func:`measure_cost_curve`, timed once per machine and models (module docstring; a few seconds on a CPU), kept
    in ``<cache_dir>/score_cost.json`` for later processes (delete the file to time again). ``cache=False`` times
    anew."""
    key = _key(target, draft, max_tokens)
    stored = cached_answer(COST_FILE, key) if cache else None
    if isinstance(stored, dict):
        try:
            return CostCurve(tuple(stored["ratios"]), stored["draft_ratio"], stored["target_seconds"],
                             stored["overhead_ratio"], tuple(stored["step_ratios"]))
        except (KeyError, TypeError):
            pass  # an entry of another shape: time again
    curve = measure_cost_curve(target, draft, max_tokens=max_tokens)
    if cache:
        keep_answer(COST_FILE, key, {"ratios": list(curve.ratios), "draft_ratio": curve.draft_ratio,
                                     "overhead_ratio": curve.overhead_ratio, "step_ratios": list(curve.step_ratios),
                                     "target_seconds": curve.target_seconds})
    return curve


def predicted_speedup(curve: CostCurve, expected_tokens: Mapping[int, float], *, model: str = "steps") -> dict[int, float]:
    """S(gamma) for each gamma of ``expected_tokens`` (E: tokens per step) that the curve covers: E(gamma) / s_gamma
    (``model="steps"``, when the curve has step costs) or E(gamma) / (r_{gamma+1} + gamma c + o) (``"calls"``)."""
    if model not in ("steps", "calls"):
        raise ValueError(f"model must be 'steps' or 'calls', got {model!r}")
    if model == "steps" and curve.step_ratios:
        return {g: e / curve.step_ratios[g - 1] for g, e in expected_tokens.items() if g <= len(curve.step_ratios)}
    return {g: e / (curve.r(g + 1) + g * curve.draft_ratio + curve.overhead_ratio) for g, e in expected_tokens.items()
            if g + 1 <= len(curve.ratios)}


def best_gamma(curve: CostCurve, expected_tokens: Mapping[int, float]) -> int:
    """The gamma of largest :func:`predicted_speedup` (ties: the shorter)."""
    speed = predicted_speedup(curve, expected_tokens)
    if not speed:
        raise ValueError(f"the cost curve covers up to {len(curve.ratios)} tokens per call: no gamma of "
                         f"{sorted(expected_tokens)} fits")
    return max(sorted(speed), key=lambda g: (speed[g], -g))


def default_gamma(target, draft, expected_tokens: Mapping[int, float] | None = None) -> int:
    """The gamma of ``specresearch generate --gamma auto``: :func:`best_gamma` on this machine's cached
    :func:`cost_curve` and ``expected_tokens`` (default ``config.GENERATE_TAU``, the default draft's head's tokens per
    step by gamma, from a committed record)."""
    from specresearch.config import GENERATE_TAU

    expected = dict(expected_tokens or GENERATE_TAU)
    return best_gamma(cost_curve(target, draft, max_tokens=max(expected) + 1), expected)
