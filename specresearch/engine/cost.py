"""What a speculative step costs on this machine, and the draft length it makes best.

A chain step with gamma drafted tokens makes gamma draft calls and one target call scoring gamma + 1 tokens;
autoregressive decoding makes one target call scoring 1 token per token. With r_n = T(n) / T(1) the cost of a target
call scoring n tokens and c = one draft call / T(1), a step that emits E(gamma) tokens on average runs

    S(gamma) = E(gamma) / (r_{gamma+1} + gamma c + o)

times as fast as autoregressive decoding, o being the step's own work (sampling, verification, bookkeeping) over T(1)
(Leviathan et al., arXiv 2211.17192, take r flat at 1 and o = 0; on a CPU r is not flat and not even monotone:
``benchmarks/bench_score_cost.py``). That model misses what grows with gamma besides the target call (re-feeding a
feature head the accepted tokens, longer verification), so the choice rests on whole steps instead: s_gamma = the mean
seconds of a chain step that drafts gamma tokens over the mean seconds of an autoregressive step, both timed through
the engine, and S(gamma) = E(gamma) / s_gamma; r, c and o are kept to explain it. r, c, o and s depend on the machine,
E on the pair and the prompts. :func:`cost_curve` times them once per machine and models and keeps them in
``<cache_dir>/score_cost.json`` (keyed by the CPU, torch's version, the thread count, the device and the models'
shapes, like the skinny-rows choice). The steps are timed in rounds, each against its own autoregressive run:
another configuration replaces the measured default only where every round agrees, and a measurement whose rounds
disagree by more than ``STEADY``, or that began on a machine already busy, is used for that run but not kept.
:func:`default_config` is what ``specresearch generate`` and
``specresearch.generate`` run: the measured default ``config.GENERATE_GAMMA`` unless this machine's curve predicts
another gamma faster by more than ``MARGIN`` (the step model's error where it was checked, ``docs/trees.md``); with the
default draft and verifier it also weighs EAGLE-2's dynamic trees (``config.GENERATE_TREES``) by their whole steps on
this machine, so where scoring a tree costs about what scoring a token does (a GPU) the default at T = 0 can be a tree.
"""

from __future__ import annotations

import hashlib
import os
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

import torch

from specresearch.config import (
    GENERATE_GAMMA,
    GENERATE_MARGIN,
    GENERATE_TAU,
    GENERATE_TAU_GREEDY,
    GENERATE_TREES,
)
from specresearch.engine.timing import TimedCall, interleaved_medians
from specresearch.paths import answers_file, cached_answer, cpu_key, keep_answer

__all__ = ["CostCurve", "MARGIN", "STEADY", "score_seconds", "measure_cost_curve", "steady", "cost_curve",
           "predicted_speedup", "best_gamma", "best_config", "default_config", "resolve_config", "fit_default_draft",
           "tree_options"]

COST_FILE = "score_cost.json"
MARGIN = GENERATE_MARGIN  # another gamma than the measured default must be predicted this much faster to replace it
# Trees are timed only where a call scoring up to max_tokens tokens costs at most this much a call scoring 1: a tree's
# call scores 11 to 33 tokens, so where r already climbs (this CPU: r_4 = 1.24-1.55) a tree step cannot pay.
FLAT = 1.15
# A measurement is kept only where its rounds agree within this much (the largest (max - min) / median of a step
# ratio): three rounds on the quiet reference CPU differed by 3-9 % (cost_curve_amd.json).
STEADY = 0.15


@dataclass(frozen=True)
class CostCurve:
    """``ratios[n - 1]`` = r_n for n = 1..len (r_1 = 1); ``draft_ratio`` = c and ``overhead_ratio`` = o (0 without a
    draft); ``step_ratios[gamma - 1]`` = s_gamma, a whole chain step drafting gamma tokens over an autoregressive
    step (empty without a draft); ``tree_steps``: ((K, depth, nodes), s) for each dynamic tree timed, a whole tree
    step over an autoregressive step. ``step_rounds`` / ``tree_rounds``: the same ratios round by round (one tuple a
    round, in the order of ``step_ratios`` / ``tree_steps``), of which those are the medians; ``load``: the one-minute
    load average when timing began (None where unknown)."""

    ratios: tuple[float, ...]
    draft_ratio: float
    target_seconds: float  # T(1), for the record
    overhead_ratio: float = 0.0
    step_ratios: tuple[float, ...] = ()
    tree_steps: tuple[tuple[tuple[int, int, int], float], ...] = ()
    step_rounds: tuple[tuple[float, ...], ...] = ()
    tree_rounds: tuple[tuple[float, ...], ...] = ()
    load: float | None = None

    def r(self, n: int) -> float:
        return self.ratios[n - 1]

    def spread(self) -> float:
        """The largest (max - min) / median over the rounds of any step ratio (0 with fewer than two rounds)."""
        columns = [*zip(*self.step_rounds), *zip(*self.tree_rounds)] if len(self.step_rounds) > 1 else []
        return max(((max(c) - min(c)) / statistics.median(c) for c in columns), default=0.0)

    def rounds(self) -> list[CostCurve]:
        """One curve a round (its own step ratios and tree steps; r, c and o shared); ``[self]`` without rounds."""
        if not self.step_rounds:
            return [self]
        tree_rounds = self.tree_rounds or [tuple(s for _, s in self.tree_steps)] * len(self.step_rounds)
        return [replace(self, step_ratios=tuple(steps), step_rounds=(), tree_rounds=(),
                        tree_steps=tuple(zip((shape for shape, _ in self.tree_steps), trees)))
                for steps, trees in zip(self.step_rounds, tree_rounds)]


def score_seconds(target, ks: Sequence[int] = (1, 2, 3, 5), context_length: int = 64, repeats: int = 20,
                  warmup: int = 3) -> dict[int, float]:
    """Median wall time of one cached target call that scores k new tokens (B = 1), for each k of ``ks``.

    The ks are timed in turn within each repeat (``interleaved_medians``) and the cache is rolled back after every
    call. ``target``: a ``models.causal_lm.CausalLM`` (or anything with ``prefill``, ``score`` and ``rollback``). A
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


def measure_cost_curve(target, draft=None, *, max_tokens: int = 5, context_length: int = 64, repeats: int = 9,
                       new_tokens: int = 48, trees: Sequence[tuple[int, int, int]] = (), rounds: int = 2) -> CostCurve:
    """Time r_1..r_max_tokens for ``target`` (contexts of ``context_length`` tokens, interleaved medians of
    ``repeats``) and, with ``draft`` (any draft kind), c, o and s_gamma for gamma = 1..max_tokens - 1.

    c and o: the median seconds of the draft's calls and of the steps' own work in a greedy gamma-1 run of 16 tokens
    through the engine (which times each step's parts), over T(1). s_gamma: the mean seconds of the steps of a
    ``new_tokens``-token block-verification run at T = 1 that draft gamma tokens, over the mean seconds of an
    autoregressive step of a run of as many tokens on the same prompt, after a warm-up run; in ``rounds`` rounds, each
    with its own autoregressive run and the gammas in alternating order, s_gamma being the median over the rounds
    (``step_rounds`` keeps each). A draft that plans its own
    lengths (``ngram+NAME``, which drafts one token where lookup finds no match) is timed on the draft it wraps
    (``.draft``), whose chains gamma sets; a planning draft that wraps none raises ``ValueError``. ``trees``: (K,
    depth, nodes) of dynamic trees whose steps to time the same way (the steps that score the full tree), where r
    stays within ``FLAT`` up to ``max_tokens`` and at the tree's own width (nodes + 1 tokens), and the draft draws
    trees (elsewhere none is timed).
    """
    from specresearch.config import SamplingConfig
    from specresearch.engine.generate import (
        autoregressive_generate,
        speculative_generate,
    )
    from specresearch.models.protocols import PlansLength, RowExpander

    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    load = _load()
    seconds = score_seconds(target, tuple(range(1, max_tokens + 1)), context_length, repeats)
    ratios = tuple(seconds[n] / seconds[1] for n in range(1, max_tokens + 1))
    if draft is None:
        return CostCurve(ratios, 0.0, seconds[1], load=load)
    if isinstance(draft, PlansLength):
        if getattr(draft, "draft", None) is None:
            raise ValueError(f"{type(draft).__name__} plans its own draft lengths and wraps no draft whose chains "
                             "gamma sets: time its steps with a draft of fixed length")
        draft = draft.draft
    prompt = ((torch.arange(context_length) % 1000 + 100) % target.vocab_size).tolist()
    sampled = SamplingConfig(temperature=1.0)

    def steps(gamma: int, max_new_tokens: int, sampling):
        run = speculative_generate(target, draft, [prompt], verifier="block", gamma=gamma, max_new_tokens=max_new_tokens,
                                   sampling=sampling, seed=0, step_timing=True)
        return [s for s in run.steps if s.gamma == gamma] or run.steps  # (the last steps may be shorter)

    steps(max_tokens - 1, 8, sampled)  # warm-up: the first calls of a process are slower
    greedy = steps(1, 16, SamplingConfig(temperature=0.0))
    draft_ratio = statistics.median(s.draft_seconds / s.draft_calls for s in greedy) / seconds[1]
    overhead_ratio = statistics.median(s.overhead_seconds for s in greedy) / seconds[1]

    def tree_seconds(shape) -> float:  # the mean seconds of the steps that score the full tree
        run = speculative_generate(target, draft, [prompt], max_new_tokens=new_tokens, sampling=sampled, seed=0,
                                   step_timing=True, **tree_options(shape))
        full = max(s.scored[0] for s in run.steps)
        return statistics.mean(s.seconds for s in run.steps if s.scored[0] == full)

    shapes = [tuple(shape) for shape in trees] if max(ratios) <= FLAT and isinstance(draft, RowExpander) else []
    if shapes:  # and r at each tree's own width (its nodes and the pending token) within FLAT too: else it cannot pay
        wide = score_seconds(target, (1, *sorted({nodes + 1 for _, _, nodes in shapes})), context_length, repeats)
        shapes = [shape for shape in shapes if wide[shape[2] + 1] / wide[1] <= FLAT]
    step_rounds, tree_rounds = [], []
    for i in range(rounds):
        plain = autoregressive_generate(target, [prompt], max_new_tokens=new_tokens, sampling=sampled, seed=0,
                                        step_timing=True)
        step = statistics.mean(s.seconds for s in plain.steps)
        gammas = range(1, max_tokens) if i % 2 == 0 else range(max_tokens - 1, 0, -1)
        chain = {g: statistics.mean(s.seconds for s in steps(g, new_tokens, sampled)) / step for g in gammas}
        step_rounds.append(tuple(chain[g] for g in range(1, max_tokens)))
        tree_rounds.append(tuple(tree_seconds(shape) / step for shape in shapes))
    step_ratios = tuple(statistics.median(column) for column in zip(*step_rounds))
    tree_steps = tuple(zip(shapes, (statistics.median(column) for column in zip(*tree_rounds))))
    return CostCurve(ratios, draft_ratio, seconds[1], overhead_ratio, step_ratios, tree_steps, tuple(step_rounds),
                     tuple(tree_rounds) if shapes else (), load)


def _load() -> float | None:
    """The one-minute load average (None where the platform has none)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def steady(curve: CostCurve) -> tuple[bool, str]:
    """Whether a measurement is fit to keep for later processes, and why not: its rounds agree within ``STEADY`` and
    timing did not begin with every core already busy (a load average of at least ``os.cpu_count()``)."""
    if curve.spread() > STEADY:
        return False, f"its rounds differ by {curve.spread():.0%}"
    if curve.load is not None and curve.load >= (os.cpu_count() or 1):
        return False, f"the load average was {curve.load:.1f} on {os.cpu_count()} cores when timing began"
    return True, ""


def tree_options(shape: tuple[int, int, int]) -> dict:
    """``speculative_generate``'s options for EAGLE-2's dynamic tree of shape (K children, depth, nodes)."""
    children, depth, nodes = shape
    return {"verifier": "onehot", "num_drafts": children, "gamma": depth, "draft_law": "dynamic", "tree_nodes": nodes}


def _shapes(model) -> str:
    """The shapes of a model's parameters (of the draft a planning draft wraps, which is what is timed), the products
    its linear layers take and whether they are fused, or its class name when it has none visible."""
    model = getattr(model, "draft", None) or model
    inner = getattr(model, "model", None)
    inner = getattr(model, "head", None) if inner is None else inner
    if isinstance(inner, torch.nn.Module):
        # with the products its linear layers take per row count (models.kernels): another choice is timed again
        paths = sorted({(tuple(getattr(m, "skinny_rows", ())), tuple(getattr(m, "kernel_rows", ())))
                        for m in inner.modules() if isinstance(m, torch.nn.Linear)})
        # and whether its projections are fused (models.fused: the same parameters, other products)
        fused = any(hasattr(m, "group") for m in inner.modules() if isinstance(m, torch.nn.Linear))
        return ";".join(f"{tuple(p.shape)}{p.dtype}" for p in inner.parameters()) + f"|paths {paths}|fused {fused}"
    return type(model).__name__


def _key(target, draft, max_tokens: int, trees: Sequence[tuple[int, int, int]] = ()) -> str:
    device = torch.device(target.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_key()
    shapes = hashlib.sha1(f"{_shapes(target)}|{_shapes(draft) if draft is not None else ''}".encode()).hexdigest()[:12]
    # "steps/ar/rounds": s_gamma over an autoregressive step, in rounds (entries of another measurement are timed again)
    key = (f"{name}|torch {torch.__version__}|threads {torch.get_num_threads()}|{device.type}|{max_tokens}|{shapes}"
           "|steps/ar/rounds")
    return key + (f"|trees {sorted(tuple(t) for t in trees)}" if trees else "")


def cost_curve(target, draft=None, *, max_tokens: int = 5, trees: Sequence[tuple[int, int, int]] = (),
               cache: bool = True, announce: Callable[[str], None] | None = None) -> CostCurve:
    """:func:`measure_cost_curve`, timed once per machine and models (module docstring; ~25 s on a 2-core CPU), kept
    in ``<cache_dir>/score_cost.json`` for later processes (delete the file to time again) where it is
    :func:`steady`; an unsteady one serves this call only. ``cache=False`` times anew; ``announce(message)`` is told
    before timing starts and when a measurement is not kept (the CLI prints both)."""
    key = _key(target, draft, max_tokens, trees)
    stored = cached_answer(COST_FILE, key) if cache else None
    if isinstance(stored, dict):
        try:
            return CostCurve(tuple(stored["ratios"]), stored["draft_ratio"], stored["target_seconds"],
                             stored["overhead_ratio"], tuple(stored["step_ratios"]),
                             tuple((tuple(shape), s) for shape, s in stored["tree_steps"]),
                             tuple(tuple(r) for r in stored["step_rounds"]),
                             tuple(tuple(r) for r in stored["tree_rounds"]), stored["load"])
        except (KeyError, TypeError, ValueError):
            pass  # an entry of another shape: time again
    if announce is not None:
        announce(f"timing this machine's step costs once, for the default configuration (kept in "
                 f"{answers_file(COST_FILE)})")
    curve = measure_cost_curve(target, draft, max_tokens=max_tokens, trees=trees)
    fit, why = steady(curve)
    if cache and fit:
        keep_answer(COST_FILE, key, {"ratios": list(curve.ratios), "draft_ratio": curve.draft_ratio,
                                     "overhead_ratio": curve.overhead_ratio, "step_ratios": list(curve.step_ratios),
                                     "target_seconds": curve.target_seconds,
                                     "tree_steps": [[list(shape), s] for shape, s in curve.tree_steps],
                                     "step_rounds": [list(r) for r in curve.step_rounds],
                                     "tree_rounds": [list(r) for r in curve.tree_rounds], "load": curve.load})
    elif cache and announce is not None:
        announce(f"the step timings are used for this run but not kept: {why} (is the machine busy?)")
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


def best_gamma(curve: CostCurve, expected_tokens: Mapping[int, float], *, incumbent: int | None = None,
               margin: float = 0.0) -> int:
    """The gamma of largest :func:`predicted_speedup` (ties: the shorter); with ``incumbent``, that gamma only when
    it is predicted faster than the incumbent by more than ``margin`` (a fraction), in the medians and in every round
    the curve was timed in (:meth:`CostCurve.rounds`), else the incumbent."""
    best = _best_gamma(curve, expected_tokens, incumbent, margin)
    if incumbent is not None and best != incumbent and any(
            _best_gamma(one, expected_tokens, incumbent, margin) == incumbent for one in curve.rounds()):
        return incumbent
    return best


def _best_gamma(curve, expected_tokens, incumbent, margin) -> int:
    speed = predicted_speedup(curve, expected_tokens)
    if not speed:
        raise ValueError(f"the cost curve covers up to {len(curve.ratios)} tokens per call: no gamma of "
                         f"{sorted(expected_tokens)} fits")
    best = max(sorted(speed), key=lambda g: (speed[g], -g))
    if incumbent is not None and incumbent in speed and speed[best] <= (1 + margin) * speed[incumbent]:
        return incumbent
    return best


def best_config(curve: CostCurve, expected_tokens: Mapping[int, float],
                tree_tokens: Mapping[tuple[int, int, int], float], *, incumbent: int | None = GENERATE_GAMMA,
                margin: float = 0.0) -> dict:
    """``speculative_generate``'s options for the fastest predicted configuration: the chain of :func:`best_gamma`
    (``{"gamma": g}``), or a dynamic tree of ``tree_tokens`` (shape -> tokens per step; :func:`tree_options`) that the
    curve timed and that is predicted faster than that chain by more than ``margin``; with ``incumbent``, anything but
    the incumbent chain only where every round of the curve picks it too."""
    chosen = _best_config(curve, expected_tokens, tree_tokens, incumbent, margin)
    if incumbent is not None and chosen != {"gamma": incumbent} and any(
            _best_config(one, expected_tokens, tree_tokens, incumbent, margin) == {"gamma": incumbent}
            for one in curve.rounds()):
        return {"gamma": incumbent}
    return chosen


def _best_config(curve, expected_tokens, tree_tokens, incumbent, margin) -> dict:
    gamma = best_gamma(curve, expected_tokens, incumbent=incumbent, margin=margin)
    chain = predicted_speedup(curve, expected_tokens)[gamma]
    timed = dict(curve.tree_steps)
    speed = {shape: tau / timed[shape] for shape, tau in tree_tokens.items() if shape in timed}
    if speed:
        shape = max(sorted(speed), key=lambda t: speed[t])
        if speed[shape] > (1 + margin) * chain:
            return tree_options(shape)
    return {"gamma": gamma}


def default_config(target, draft, temperature: float = 1.0, *, trees: bool = True, margin: float = MARGIN,
                   announce: Callable[[str], None] | None = None) -> dict:
    """The options of ``specresearch generate`` and ``specresearch.generate`` with the default draft and verifier:
    :func:`best_config` over the head's chains (``config.GENERATE_TAU_GREEDY`` at T = 0, else ``GENERATE_TAU``) and,
    with ``trees``, its dynamic trees (``config.GENERATE_TREES``; those the curve timed), each at that temperature,
    against this machine's cached :func:`cost_curve`. On the reference CPU: gamma 1. A target with recurrent layers
    (``models.recurrent``) weighs chains only: its trees run a row per path, in the growing loop (no captured steps)."""
    trees = trees and not getattr(target, "recurrent", False)
    column = 0 if temperature == 0 else 1
    expected = dict(GENERATE_TAU_GREEDY if column == 0 else GENERATE_TAU)
    shapes = {shape: taus[column] for shape, taus in GENERATE_TREES.items()} if trees else {}
    curve = cost_curve(target, draft, max_tokens=max(expected) + 1, trees=tuple(shapes), announce=announce)
    return best_config(curve, expected, shapes, incumbent=GENERATE_GAMMA, margin=margin)


def fit_default_draft(draft, chosen: dict) -> None:
    """Let a combined draft's wrapped draft draft the chosen chain's length where lookup finds no match.

    :func:`default_config` weighs the wrapped draft's chains of each gamma (``cost_curve`` times them). A
    ``drafts.combined.LookupOrDraft`` built by name drafts one token off a match (``draft_gamma=1``), so with a
    chosen ``{"gamma": g}`` its ``draft_gamma`` becomes g: the step the curve predicted, or the one asked for. Trees
    and other drafts are left as they are. Used where the draft is the default one (``specresearch generate`` and
    ``specresearch.generate``, whether gamma is chosen or given, ``bench --default-config``); a draft the caller named
    keeps the lengths its name gave it.
    """
    if "num_drafts" not in chosen and getattr(draft, "draft_gamma", None) is not None:
        draft.draft_gamma = chosen["gamma"]


def resolve_config(gamma: int | str, target, draft, *, temperature: float = 1.0, num_drafts: int = 1,
                   stop_below: float | None = None, trees: bool = False,
                   announce: Callable[[str], None] | None = None) -> dict:
    """``speculative_generate``'s length and shape options for ``gamma``: ``{"gamma": gamma}`` as given; for
    ``"auto"`` (``specresearch generate`` and ``specresearch.generate``) :func:`default_config` for a chain, trees
    weighed only with ``trees`` (the default draft and verifier), and ``config.GENERATE_GAMMA`` with ``num_drafts > 1``
    or ``stop_below`` (the curve describes chains and dynamic trees)."""
    if gamma != "auto":
        return {"gamma": gamma}
    if num_drafts == 1 and stop_below is None:
        return default_config(target, draft, temperature, trees=trees, announce=announce)
    return {"gamma": GENERATE_GAMMA}
