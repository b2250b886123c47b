"""The speculative and autoregressive generation loops.

One speculative step (Leviathan et al. 2023, arXiv 2211.17192, Algorithm 1), as small stages:

1. ``_draft``: the draft extends each row by gamma tokens x_1..x_gamma, sampling x_{i+1} from
   q_i = ``logits_to_probs(draft logits, sampling)`` -- exactly the q handed to the verifier;
2. ``_score``: ONE target call on ``[pending, x_1..x_gamma]`` gives p_0..p_gamma ``[B, gamma+1, V]``
   through the same ``logits_to_probs``;
3. ``_verify``: ``verify.VERIFIERS[verifier]`` returns ``num_accepted [B]`` and ``next_token [B]``;
4. ``_rollback``: each model forgets the drafts its row rejected (per-row rollback, see ``models``).

Cache convention: a model's cache holds every emitted token except the *pending* one(s), which are fed
first in the next step. The target's pending token is the last ``next_token``; the draft's pending
block is ``[x_gamma, next_token]`` where the x_gamma slot is valid only for rows that accepted all
gamma drafts (the draft never fed x_gamma, since it only sampled it). So each step costs exactly one
target call and gamma draft calls.

Feature-reading drafts (``feature_drafts.FeatureReader``, EAGLE-style): the target is asked for the
draft's ``feature_layers`` at prefill and in the scoring call (the target wrapper only returns what it is
asked for); after verification the draft drops every slot it drafted on its own predicted features and
is re-fed the accepted tokens and the next token with the target's true features (``_refeed``), through
``draft.observe``. Verifiers see nothing of this.

Stopping: a row stops at its first EOS (kept in the output) or after exactly ``max_new_tokens``
tokens; a block that overshoots is truncated. The last steps shorten gamma to the tokens still
needed (gamma chosen from past lengths only, so the output law is unchanged). A draft that plans its
length (``models.protocols.PlansLength``, e.g. ``LookupOrDraft(draft_gamma=1)``) may shorten a step further; it is
asked after scoring its pending block, before the step samples anything, so the length again depends on
the context only. A finished row leaves the batch: the target and the draft keep the other rows
(``RowExpander.select_rows``, which every shipped model has, packing dead cache slots), so no model is fed past a
row's end and every row's context stays within prompt + max_new_tokens + gamma. With a model that cannot select
rows, finished rows ride along and their tokens are ignored. Step records stay one entry per prompt.

Draft trees (``num_drafts`` > 1, or a multi-draft verifier) run one :mod:`specresearch.engine.tree` step instead:
K paths, one target call on their merged tree, a multi-draft rule. Adaptive chains (``stop_below``) end a block before
token i > 1 once the draft's top probability there falls below the threshold; the draft then has fed its last token,
so its pending block is the next token alone.

Temperature 0: ``logits_to_probs`` gives one-hot distributions, drafts are argmaxes, and every
verifier reduces to greedy verification, so the output equals greedy autoregressive decoding.

Randomness: one ``torch.Generator`` seeded once from ``seed`` drives draft sampling and verification;
the same seed and inputs reproduce the same tokens. ``seed`` may instead be one int per prompt: each row
then has its own generator (per-row draft samples and per-row verification uniforms) and its gamma is
never shortened, so every step consumes the same randomness per row and a row's tokens do not depend on
the other rows of the batch (identical alone or batched, up to float differences of batched logits).
The one exception: a draft's length plan is batch-wide, so with per-row seeds it is followed only for a
batch of one row, and a planning draft's row differs alone and batched.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from typing import Callable, Sequence

import torch

from specresearch.checks import check_int
from specresearch.config import SamplingConfig
from specresearch.core.draws import draw_uniforms
from specresearch.core.tree_expectations import TREE_EXPECTATIONS
from specresearch.core.verify import VERIFIERS, expected_num_accepted
from specresearch.engine.prompts import encode_prompts
from specresearch.engine.results import (
    GenerationResult,
    _generators,
    _result,
    _Rows,
    _untimed,
    check_context,
    eos_ids,
    plan_context,
)
from specresearch.engine.static import capture_refusal, plan_for, runner_mode, static_available, static_generate
from specresearch.engine.steps import StepChecks, StepRecord, _draft_pending, _refeed, _sample, read_step
from specresearch.engine.timing import clock, step_clock
from specresearch.engine.topk_tree import dynamic_tree_step
from specresearch.engine.tree import TOPK_LAWS, TREE_VERIFIERS, check_tree_args, tree_randomness, tree_step
from specresearch.models.protocols import (
    BindsTarget,
    FeatureReader,
    PlansLength,
    RowExpander,
    check_language_model,
    check_same_vocab,
)

__all__ = [
    "StepRecord",
    "GenerationResult",
    "speculative_generate",
    "autoregressive_generate",
    "encode_prompts",
]


class _Batch:
    """Which prompts the models' batch still holds: a finished row leaves it (``select_rows``) when every model
    can select rows (``RowExpander``: every model the toolkit ships); otherwise it rides along, ignored."""

    def __init__(self, size: int, models):
        self.size, self.rows = size, list(range(size))
        self.can_shrink = all(isinstance(m, RowExpander) for m in models)

    def widen(self, values, fill) -> list:
        """Per-row values of the batch's rows -> one per prompt (``fill`` for prompts no longer in the batch)."""
        out = [fill] * self.size
        for value, b in zip(values, self.rows):
            out[b] = value
        return out

    def shrink(self, done: list[bool]) -> torch.Tensor | None:
        """Drop the rows now done. -> the batch rows kept (index into the old batch), or None if nothing changes."""
        keep = [i for i, b in enumerate(self.rows) if not done[b]]
        if not self.can_shrink or not keep or len(keep) == len(self.rows):
            return None
        self.rows = [self.rows[i] for i in keep]
        return torch.tensor(keep, dtype=torch.long)

    def record(self, step: StepRecord, active) -> StepRecord:
        """``step``'s per-row fields widened to one per prompt."""
        return replace(step, num_accepted=tuple(self.widen(step.num_accepted, 0)), active=tuple(active),
                       expected={m: tuple(self.widen(v, 0.0)) for m, v in step.expected.items()},
                       overlap=tuple(self.widen(step.overlap, 0.0)) if step.overlap else (),
                       scored=tuple(self.widen(step.scored, 0)) if step.scored else ())


def _select(index: torch.Tensor, *tensors):
    """Rows ``index`` of each tensor (None stays None)."""
    return tuple(None if t is None else t[index.to(t.device)] for t in tensors)


def _check_generation_args(max_new_tokens: int, gamma: int = 1, verifier="token") -> None:
    check_int("max_new_tokens", max_new_tokens)
    check_int("gamma", gamma, meaning="draft tokens per step")
    if not callable(verifier) and verifier not in VERIFIERS:
        raise ValueError(f"verifier must be one of {sorted(VERIFIERS)} or a callable, got {verifier!r} (draft trees, "
                         f"num_drafts > 1, take one of {sorted(TREE_VERIFIERS)})")


def _uniforms(generators, gamma: int, device) -> dict:
    """Verification randomness: the shared generator, or per-row uniforms ``[B, gamma+1]`` from per-row generators."""
    if isinstance(generators, torch.Generator):
        return {"generator": generators}
    return {"uniforms": torch.stack([draw_uniforms(1, gamma, g, device=device)[0] for g in generators])}


def _start(model, ids: torch.Tensor, mask: torch.Tensor) -> None:
    """Put all but the last prompt token in the model's cache (the last one becomes the pending token)."""
    if ids.shape[1] > 1:
        model.prefill(ids[:, :-1], mask[:, :-1])
    else:
        model.reset(ids.shape[0])


def _draft(draft, pending, pending_valid, gamma, sampling, generators, device, checks, plans=False, stop_below=None):
    """Sample gamma tokens from the draft on ``device`` (``plans``: as many as ``draft.plan_length(gamma)``
    says, asked after the pending block is scored; ``stop_below``: stop before token i > 1 once the draft's top
    probability there, softmax of its raw logits, is below it in every row). -> (tokens [B, n], draft_probs [B, n, V],
    drafted tokens the draft was fed: n - 1, or n when it stopped early)."""
    logits = draft.score(pending, pending_valid)[:, -1]
    if plans:
        gamma = _planned(draft, gamma)
    tokens, probs = [], []
    for i in range(gamma):
        q = checks.probs(logits.to(device), sampling, f"draft model logits (drafting token {i + 1})")  # [B, V]
        if i and stop_below is not None and bool((logits.float().softmax(-1).max(-1).values < stop_below).all()):
            return torch.stack(tokens, 1), torch.stack(probs, 1), i
        tokens.append(_sample(q, sampling, generators))
        probs.append(q)
        if i < gamma - 1:
            logits = draft.score(tokens[-1][:, None])[:, -1]
    return torch.stack(tokens, 1), torch.stack(probs, 1), gamma - 1


def _planned(draft, gamma: int) -> int:
    n = draft.plan_length(gamma)
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= gamma:
        raise ValueError(f"{type(draft).__name__}.plan_length({gamma}) must return an integer in 1..{gamma}, got {n!r}")
    return n


def _score(target, pending, draft_tokens, sampling, checks, hidden_layers=None):
    """One target call on ``[pending, drafts]`` [B, 1+gamma] -> (target_probs [B, gamma+1, V], features).

    ``features`` [B, gamma+1, F]: the target's hidden states of ``hidden_layers`` when a draft reads them,
    else None."""
    tokens = torch.cat([pending, draft_tokens], dim=1)
    if hidden_layers is None:
        logits, features = target.score(tokens), None
    else:
        logits, features = target.score(tokens, hidden_layers=hidden_layers)
    return checks.probs(logits.to(draft_tokens.device), sampling, "target model logits (scoring the drafts)"), features


def _rollback(target, draft, accepted: list[int], gamma: int) -> None:
    """Target fed [pending, x_1..x_gamma]; the draft fed [pending block, x_1..x_{gamma-1}]: drop rejections."""
    target.rollback([gamma - n for n in accepted])
    draft.rollback([max(gamma - 1 - n, 0) for n in accepted])


def _start_reading(target, draft, ids: torch.Tensor, mask: torch.Tensor) -> None:
    """Prefill for a draft that reads the target's features (``feature_drafts.FeatureReader``): the target is
    asked for ``draft.feature_layers``; each prompt slot and the pending token read the feature of the slot
    before (zeros where that slot is padding or absent)."""
    if not getattr(target, "returns_hidden_states", False):
        raise ValueError("draft reads the target's hidden states: target must return them (a models.causal_lm.CausalLM)")
    if ids.shape[1] == 1:
        target.reset(len(ids))
        draft.reset(len(ids))
        draft.observe(torch.zeros(len(ids), 1, draft.feature_size, device=target.device))
        return
    _, features = target.prefill(ids[:, :-1], mask[:, :-1], hidden_layers=draft.feature_layers)  # [B, L-1, F]
    before = torch.cat([torch.zeros_like(features[:, :1]), features], 1)  # [B, L, F]
    before = before * torch.cat([torch.zeros_like(mask[:, :1]), mask[:, :-1]], 1)[:, :, None]
    draft.observe(before[:, :-1])
    draft.prefill(ids[:, :-1], mask[:, :-1])
    draft.observe(before[:, -1:])


def speculative_generate(
    target,
    draft,
    prompts,
    *,
    verifier: str | Callable = "block",
    gamma: int = 4,
    max_new_tokens: int = 64,
    sampling: SamplingConfig = SamplingConfig(),
    seed: int | torch.Generator | Sequence[int] = 0,
    tokenizer=None,
    eos_token_id: int | Sequence[int] | None = None,
    on_step: Callable[[list[list[int]]], None] | None = None,
    stop_when: Callable[[int, list[int]], bool] | None = None,
    expectations: Sequence[str] = (),
    num_drafts: int = 1,
    draft_law: str = "iid",
    tree_nodes: int | None = None,
    stop_below: float | None = None,
    step_timing: bool | None = None,
    compile: str = "off",
) -> GenerationResult:
    """Speculative decoding of ``prompts`` with ``target`` and ``draft`` (module docstring; arXiv 2211.17192).

    Args:
        target, draft: ``models.protocols.LanguageModel`` s with the same ``vocab_size``.
        prompts: strings (with ``tokenizer``) or token-id sequences; one prompt or a list (batched, left-padded).
        verifier: ``"token"``, ``"block"`` or ``"greedy"`` (``verify.VERIFIERS``), or a callable with the
            verifier signature (it is called with ``validate=False``).
        gamma: draft tokens per step (>= 1); a draft with ``plan_length`` (``models.protocols.PlansLength``) may draft
            fewer in a step (with per-row seeds only when there is one prompt).
        max_new_tokens: tokens produced per row (>= 1), fewer only when the row emits EOS.
        sampling: applied identically to target and draft logits (``sampling.logits_to_probs``).
        seed: seeds the single ``torch.Generator`` used for all randomness (or is that generator); or one int per
            prompt for per-row generators (batch-independent rows; see the module docstring).
        eos_token_id: int or ids ending a row (default, with a tokenizer: its EOS and those of the target's
            transformers generation config, where ``generate`` stops; without either, none).
        on_step: called after each step with the tokens each row kept (for streaming).
        stop_when: ``stop_when(b, tokens)`` is asked for each new token of row b with the row's new tokens up to
            and including it; True ends the row after that token, as EOS does (inside an accepted block too).
        expectations: methods (``"token"``, ``"block"``, ``"greedy"``) whose expected accepted count given
            each step's drafted block is stored in ``StepRecord.expected`` (with ``StepRecord.overlap``);
            the verifier that did not run costs only its closed form. Does not change the tokens. On sampled
            draft trees: rules of ``core.tree_expectations.TREE_EXPECTATIONS`` on each step's tree.
        num_drafts, draft_law: K draft paths per step drawn ``"iid"`` or with the first tokens
            ``"without_replacement"``, scored by the target in one call as a tree and verified by a multi-draft
            ``verifier`` (``rrs``, ``rrs_without_replacement``, ``kseq``, ``gbv``, ``traversal``, ``onehot``;
            :mod:`specresearch.engine.tree`). The default, one path, is the chain step above. ``draft_law="dynamic"``
            drafts EAGLE-2's deterministic tree instead, top ``num_drafts`` children per expanded node, depth
            ``gamma``, the ``tree_nodes`` (default K * gamma) most probable nodes kept, verified by ``"onehot"``
            (:mod:`specresearch.engine.topk_tree`); ``"static"`` the tree of the same K, gamma and node count whose
            shape does not depend on q (EAGLE-1's, the baseline of EAGLE-2).
        stop_below: adaptive drafting (chains): draft up to ``gamma`` tokens, stopping before token i > 1 once the
            draft's top probability there (the softmax of its raw logits, so the rule means the same at every
            temperature; at T = 0 the sampled law is one-hot) is below ``stop_below`` in every row (with per-row seeds, only for one
            prompt: the stop is batch-wide). Lossless: the stop reads the draft's rows only, never the verifier's
            random numbers (``specresearch.exact.adaptive``).
        step_timing: time each step's draft, target and overhead (``engine.timing.step_clock``: on a GPU each reading
            waits for the device, four host syncs a step). Default: on the CPU, off on CUDA, where the call's total
            is still exact (one wait at the end) and the per-step split is NaN.
        compile: ``"off"`` this loop; ``"on"`` / ``"auto"`` / ``"static"`` / a runner mode: captured steps over
            static caches (:mod:`specresearch.engine.static`, ``COMPILE_CHOICES``: chains and dynamic / static trees
            with a whole-model draft, a feature head, a DFlash block or a Gemma 4 assistant); ``"auto"`` takes them on
            CUDA where the run has them.
    Returns:
        ``GenerationResult`` with tokens ``[B][<= max_new_tokens]`` and one ``StepRecord`` per step.
    """
    check_language_model(target, "target")
    check_language_model(draft, "draft")
    if isinstance(draft, BindsTarget):  # a draft that reads its target's cache (drafts.gemma4): this run's
        draft.bind(target)
    tree = num_drafts != 1 or draft_law != "iid" or (isinstance(verifier, str) and verifier in TREE_VERIFIERS)
    check_int("num_drafts", num_drafts, meaning="draft paths per step")
    if stop_below is not None and (isinstance(stop_below, bool) or not isinstance(stop_below, (int, float)) or not 0 <= stop_below <= 1):
        raise ValueError(f"stop_below must be None or a probability in [0, 1], got {stop_below!r}")
    if stop_below is not None and (tree or expectations):
        raise ValueError("stop_below (adaptive chains) does not combine with draft trees or expectations=")
    if tree:
        check_tree_args(target, draft, verifier, num_drafts, draft_law, gamma, expectations, tree_nodes)
    elif tree_nodes is not None:
        raise ValueError(f"tree_nodes is for draft_law 'dynamic' or 'static', got draft_law {draft_law!r}")
    else:
        _check_generation_args(max_new_tokens, gamma, verifier)
    check_int("max_new_tokens", max_new_tokens)
    check_int("gamma", gamma, meaning="draft tokens per step")
    if isinstance(expectations, str) or (not tree and any(m not in VERIFIERS for m in expectations)):
        raise ValueError(f"expectations must be a sequence of {sorted(VERIFIERS)} (on draft trees: of "
                         f"{TREE_EXPECTATIONS}), got {expectations!r}")
    check_same_vocab(target, draft)
    ids, mask = encode_prompts(prompts, tokenizer)
    plan_context(target, ids, mask, max_new_tokens)  # before the choice of steps: a run that changes a rotary set has no
    plan_context(draft, ids, mask, max_new_tokens)  # static form (models.prefix_sets)
    why_not = static_available(target, draft, verifier=verifier, num_drafts=num_drafts, draft_law=draft_law,
                               stop_below=stop_below, expectations=expectations, gamma=gamma)
    mode = runner_mode(compile, target.device, why_not, partial(capture_refusal, target, draft))
    if mode is not None:
        return static_generate(target, draft, prompts, plan=plan_for(verifier, gamma, num_drafts, draft_law, tree_nodes),
                               max_new_tokens=max_new_tokens, sampling=sampling, seed=seed, tokenizer=tokenizer,
                               eos_token_id=eos_token_id, on_step=on_step, stop_when=stop_when, mode=mode)
    verify = verifier if callable(verifier) or tree else VERIFIERS[verifier]
    check_context(target, ids, max_new_tokens, gamma)
    check_context(draft, ids, max_new_tokens, gamma)
    device = target.device
    generators = _generators(seed, len(ids), device)
    rows = _Rows(max_new_tokens, eos_ids(eos_token_id, tokenizer, target), [[] for _ in ids], [False] * len(ids), stop_when)
    t0 = clock(device)
    reads = isinstance(draft, FeatureReader)  # reads the target's hidden states: re-fed true features each step
    if reads:
        _start_reading(target, draft, ids.to(device), mask.to(device))
    else:
        _start(target, ids.to(device), mask.to(device))
        _start(draft, ids.to(draft.device), mask.to(draft.device))
    prefill_seconds = clock(device) - t0
    tick = step_clock(device, step_timing)
    target_pending = ids[:, -1:].to(device)
    draft_pending, draft_valid = target_pending, None
    steps = []
    per_row = isinstance(generators, list)  # per-row seeds: never shorten gamma (module docstring)
    plans = isinstance(draft, PlansLength) and (not per_row or len(ids) == 1)  # a plan is batch-wide
    adaptive = stop_below is not None and (not per_row or len(ids) == 1)  # so is an early stop
    batch = _Batch(len(ids), (target, draft))
    while not all(rows.done):
        index = batch.shrink(rows.done)
        if index is not None:  # finished rows leave the batch
            target.select_rows(index.to(device))
            draft.select_rows(index.to(draft.device))
            target_pending, draft_pending, draft_valid = _select(index, target_pending, draft_pending, draft_valid)
            generators = [generators[i] for i in index.tolist()] if per_row else generators
        step_gamma = gamma if per_row else min(gamma, max(1, rows.remaining() - 1))
        active = tuple(not d for d in rows.done)
        if tree:
            if verifier == "kseq":
                step_gamma = 1
            step_active = [active[b] for b in batch.rows]
            if draft_law in TOPK_LAWS:
                emitted, target_pending, draft_pending, draft_valid, record = dynamic_tree_step(
                    target, draft, target_pending, draft_pending, draft_valid, num_drafts=num_drafts, gamma=step_gamma,
                    tree_nodes=tree_nodes or num_drafts * gamma, sampling=sampling,
                    randomness=tree_randomness(generators, num_drafts, step_gamma, device), device=device,
                    active=step_active, tick=tick, static=draft_law == "static")
            else:
                emitted, target_pending, draft_pending, draft_valid, record = tree_step(
                    target, draft, target_pending, draft_pending, draft_valid, verifier=verifier, num_drafts=num_drafts,
                    gamma=step_gamma, draft_law=draft_law, sampling=sampling, generators=generators, device=device,
                    active=step_active, tick=tick, expectations=expectations)
            kept = rows.add(batch.widen(emitted, []))
            steps.append(batch.record(record, active))
            if on_step is not None:
                on_step(kept)
            continue
        t0 = tick()
        checks = StepChecks()  # the step's logits checks, read back once with its tokens
        draft_tokens, draft_probs, fed = _draft(draft, draft_pending, draft_valid, step_gamma, sampling, generators, device,
                                                checks, plans, stop_below if adaptive else None)
        step_gamma = draft_tokens.shape[1]
        t1 = tick()
        target_probs, features = _score(target, target_pending, draft_tokens, sampling, checks,
                                        draft.feature_layers if reads else None)
        t2 = tick()
        randomness = _uniforms(generators, step_gamma, device)
        result = verify(target_probs, draft_probs, draft_tokens, validate=False, **randomness)
        host = read_step(checks, result.num_accepted, result.next_token, draft_tokens)  # the step's one host read
        accepted = [row[0] for row in host]
        emitted = [row[2 : 2 + n] + [row[1]] for row, n in zip(host, accepted)]
        target_pending = result.next_token[:, None]
        if reads:  # drop every slot drafted on the draft's own features; re-feed the accepted ones with true features
            target.rollback([step_gamma - n for n in accepted])
            draft.rollback(fed)
            draft_pending, draft_valid = _refeed(draft, draft_tokens, result, features, max(accepted))
        elif fed == step_gamma:  # stopped early: the draft was fed its last token too
            target.rollback([step_gamma - n for n in accepted])
            draft.rollback([fed - n for n in accepted])
            draft_pending, draft_valid = result.next_token[:, None], None
        else:
            _rollback(target, draft, accepted, step_gamma)
            draft_pending, draft_valid = _draft_pending(draft_tokens, result, step_gamma, accepted)
        kept = rows.add(batch.widen(emitted, []))
        seconds = tick() - t0
        extra = _expectations(target_probs, draft_probs, draft_tokens, expectations)  # untimed: analysis only
        record = StepRecord(tuple(accepted), active, step_gamma, 1, fed + 1, seconds, t2 - t1, t1 - t0, **extra,
                            scored=(step_gamma + 1,) * len(accepted))
        steps.append(batch.record(record, active))
        if on_step is not None:
            on_step(kept)
    return _result(rows, _untimed(steps, tick, device), prefill_seconds, tokenizer, "speculative")


def _expectations(target_probs, draft_probs, draft_tokens, methods) -> dict:
    """``StepRecord`` fields ``expected`` and ``overlap`` for ``methods`` (none when it is empty)."""
    if not methods:
        return {}
    expected = {m: tuple(expected_num_accepted(target_probs, draft_probs, draft_tokens, m, validate=False).tolist())
                for m in methods}
    overlap = torch.minimum(target_probs[:, :-1], draft_probs).sum(-1).mean(-1)  # [B]
    return {"expected": expected, "overlap": tuple(overlap.tolist())}


def autoregressive_generate(
    target,
    prompts,
    *,
    max_new_tokens: int = 64,
    sampling: SamplingConfig = SamplingConfig(),
    seed: int | torch.Generator | Sequence[int] = 0,
    tokenizer=None,
    eos_token_id: int | Sequence[int] | None = None,
    on_step: Callable[[list[list[int]]], None] | None = None,
    step_timing: bool | None = None,
    compile: str = "off",
) -> GenerationResult:
    """Plain decoding from ``target``: one target call per token, same sampling and stopping rules.

    ``seed``: an int, a ``torch.Generator`` (used as it is), or one int per prompt (per-row generators: a row's tokens
    do not depend on the batch). The classic decoding methods (:mod:`specresearch.engine.decoding`) run in this loop.
    ``step_timing``, ``compile``: as :func:`speculative_generate`'s (captured steps: one target call a step).
    """
    _check_generation_args(max_new_tokens)
    check_language_model(target, "target", ("prefill", "score"))
    ids, mask = encode_prompts(prompts, tokenizer)
    plan_context(target, ids, mask, max_new_tokens)  # before the choice of steps, as speculative_generate's
    mode = runner_mode(compile, target.device, static_available(target), partial(capture_refusal, target, None))
    if mode is not None:
        return static_generate(target, None, prompts, plan=plan_for("", 0, autoregressive=True),
                               max_new_tokens=max_new_tokens, sampling=sampling, seed=seed, tokenizer=tokenizer,
                               eos_token_id=eos_token_id, on_step=on_step, mode=mode)
    check_context(target, ids, max_new_tokens)
    device = target.device
    generators = _generators(seed, len(ids), device)
    rows = _Rows(max_new_tokens, eos_ids(eos_token_id, tokenizer, target), [[] for _ in ids], [False] * len(ids))
    t0 = clock(device)
    _start(target, ids.to(device), mask.to(device))
    prefill_seconds = clock(device) - t0
    tick = step_clock(device, step_timing)
    pending = ids[:, -1:].to(device)
    steps = []
    batch = _Batch(len(ids), (target,))
    while not all(rows.done):
        index = batch.shrink(rows.done)
        if index is not None:  # finished rows leave the batch
            target.select_rows(index.to(device))
            (pending,) = _select(index, pending)
            generators = [generators[i] for i in index.tolist()] if isinstance(generators, list) else generators
        active = tuple(not d for d in rows.done)
        t0 = tick()
        logits = target.score(pending)[:, -1]
        t1 = tick()
        checks = StepChecks()
        probs = checks.probs(logits, sampling, "target model logits (autoregressive step)")
        pending = _sample(probs, sampling, generators)[:, None]
        kept = rows.add(batch.widen(read_step(checks, pending), []))
        steps.append(StepRecord((0,) * len(active), active, 0, 1, 0, tick() - t0, t1 - t0, 0.0,
                                scored=tuple(int(a) for a in active)))
        if on_step is not None:
            on_step(kept)
    return _result(rows, _untimed(steps, tick, device), prefill_seconds, tokenizer, "autoregressive")


