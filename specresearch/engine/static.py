"""Captured steps: speculative and autoregressive decoding over static KV caches (:mod:`specresearch.models.static_cache`),
each step one function of preallocated device tensors that never reads the host, so that on a GPU it runs as one
CUDA graph (or under ``torch.compile``: :mod:`specresearch.engine.captured`) and the host reads one small tensor a
step, the accepted counts and the emitted tokens (or one every ``steps_per_read`` steps).

Step kinds (B rows; every shape is fixed for the run):

* **autoregressive**: the target scores the pending token; one token is sampled.
* **chain** (gamma): the draft is re-fed the last step's accepted tokens and next token ``[x_1..x_n, next]`` in one
  call of gamma + 1 slots that keeps n + 1 of them (a feature draft reads the target's features of the slots before
  them, as :func:`specresearch.engine.steps._refeed` gives them), drafts gamma tokens (gamma - 1 one-token calls),
  the target scores ``[pending, x_1..x_gamma]`` in one call, the verifier (``token``, ``block``, ``greedy``) decides,
  and the target keeps 1 + n slots.
* **dynamic / static tree** (EAGLE-2's, K children, depth L, N nodes; :mod:`specresearch.engine.topk_tree`): the
  re-feed, then at each depth d = 2..L the K expanded nodes are fed as ONE tree call of K slots, each seeing its
  ancestors in the drafted region (tree attention, where the growing loop copies rows: the same q), the N nodes of
  largest value kept; their call tensors (depth, ancestors, children) are built on the device from the drafted
  indices; the target scores ``[pending, N nodes]`` in one call; the one-hot rule decides (``greedy_tree_verify`` at
  T = 0) and the target keeps the accepted path (``models.static_cache.keep_path``).

Randomness: before each step its uniforms are drawn from the caller's generator into one buffer ``[B, U]`` (on the
generator's device: a launch, no read; U = 2 gamma + 1 for a chain, (L + 1) K for a tree, 1 for autoregressive),
and the step turns them into tokens by the inverse CDF (:mod:`specresearch.core.draws`). So a captured step replays
with the run's own random numbers, a seed repeats a run, and the eager and the compiled step give the same tokens
from the same uniforms. The order in which uniforms are used differs from :mod:`specresearch.engine.generate`'s, so
at T > 0 a seed gives other (equally distributed) tokens there; at T = 0 both give the target's greedy tokens.

Stopping runs on the device as well: a row that has emitted ``max_new_tokens`` or an EOS stops keeping slots (its
later tokens are discarded), so the host need not answer before the next step. Compared to the growing loop: gamma
is never shortened near the end (the block past ``max_new_tokens`` is cut, as at an EOS), finished rows stay in the
batch, a draft is re-fed gamma + 1 slots a step instead of n + 1, and what decides on the host (a length plan below
gamma, an early stop, GBV) has no captured step: :func:`static_available` says why.
"""

from __future__ import annotations

import collections
import time
import weakref
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from specresearch.config import COMPILE_CHOICES, CUDA_GRAPH_MODES, SamplingConfig
from specresearch.core.draws import inverse_cdf, uniforms
from specresearch.core.verify import block_verify, greedy_verify, token_verify
from specresearch.engine.captured import StepRunner
from specresearch.engine.prompts import encode_prompts
from specresearch.engine.results import (
    GenerationResult,
    _generators,
    _result,
    _Rows,
    check_context,
    eos_ids,
    plan_context,
)
from specresearch.engine.static_trees import CAPTURED_TREE_RULES, draft_tree, tree_uniforms, verify_tree
from specresearch.engine.steps import StepChecks, StepRecord
from specresearch.engine.timing import clock
from specresearch.models.protocols import BindsTarget, HasStaticForm, PlansLength, StaticFeatureModel
from specresearch.models.static_states import allocate_form

__all__ = ["CAPACITY_STEP", "SESSIONS_KEPT", "StaticPlan", "static_available", "static_generate", "build_run", "start_run",
           "cache_capacity", "runner_mode", "capture_refusal", "plan_for"]


_RAW = SamplingConfig()  # a tree ranks its candidates by the draft's own softmax (engine.topk_tree)
_CHAIN_VERIFIERS = {"token": token_verify, "block": block_verify, "greedy": greedy_verify}


@dataclass(frozen=True)
class StaticPlan:
    """What one run's steps are: ``kind`` ``"autoregressive"``, ``"chain"`` (``verifier``, ``gamma``) or ``"tree"``
    (K = ``num_drafts``, depth ``gamma``, ``tree_nodes`` nodes; ``law``: ``"dynamic"`` / ``"static"`` top-k trees
    verified by ``"onehot"``, or ``"iid"`` / ``"without_replacement"`` sampled paths, K gamma nodes, verified by
    ``verifier``: ``engine.static_trees``)."""

    kind: str
    verifier: str = "block"
    gamma: int = 1
    num_drafts: int = 1
    tree_nodes: int = 0
    law: str = "dynamic"

    @property
    def width(self) -> int:
        """Tokens the target scores a step (and the most a row emits)."""
        return {"autoregressive": 1, "chain": self.gamma + 1, "tree": 1 + self.tree_nodes}[self.kind]

    @property
    def refeed(self) -> int:
        """Slots of the draft's re-feed call: the accepted tokens and the next one."""
        return self.gamma + 1

    def draft_width(self) -> int:
        """Slots the draft writes past its length in a step."""
        drafted = self.gamma - 1 if self.kind == "chain" else (self.gamma - 1) * self.num_drafts
        return self.refeed + drafted

    def num_uniforms(self) -> int:
        return {"autoregressive": 1, "chain": 2 * self.gamma + 1}.get(self.kind) or tree_uniforms(self)


def static_available(target, draft=None, *, verifier: str = "block", num_drafts: int = 1, draft_law: str = "iid",
                     stop_below=None, expectations=(), gamma: int | None = None) -> str | None:
    """Why a run has no captured form (a sentence to show the user), or None when it has one; ``gamma``: the drafted
    tokens a step (a tree's depth), which a draft that plans fewer (``PlansLength``) cannot draft there."""
    if not isinstance(target, HasStaticForm):
        return f"target {type(target).__name__} has no static form (a models.causal_lm.CausalLM has)"
    for role, lm in (("target", target), ("draft", draft)):
        if getattr(lm, "static_refusal", None):  # recurrent layers, DeepSeek Sparse Attention (CausalLM)
            return f"{role} {lm.static_refusal}"
    if getattr(target, "placement", None) is not None:
        return f"the target is split ({target.placement}): a static cache needs it on one device"
    if draft is None:
        return None
    if not isinstance(draft, HasStaticForm):
        return (f"draft {type(draft).__name__} has no static form (static_form(): models.protocols.StaticModel): "
                "every draft the toolkit builds has one (whole models, EAGLE-1/2/3, P-EAGLE and toolkit heads, Medusa, "
                "DFlash-family blocks, Gemma 4 assistants, prompt lookup, dial drafts)")
    tree = num_drafts != 1 or draft_law != "iid" or verifier not in _CHAIN_VERIFIERS
    planned = gamma
    if gamma is not None and isinstance(draft, PlansLength):
        fixed = getattr(draft, "fixed_length", None)  # a per-step plan (a chain's): drafts.combined's
        planned = draft.plan_length(gamma) if fixed is None else gamma if tree else fixed(gamma)
        if planned is None:
            return (f"draft {type(draft).__name__} plans each step's length on the host (a length plan below gamma = "
                    f"{gamma}): captured steps draft gamma every step; use a gamma it drafts every step, or no plan")
    if planned is not None and planned < gamma:
        return (f"draft {type(draft).__name__} drafts at most {planned} tokens a step and captured steps draft all "
                f"gamma = {gamma} (or a tree's depth): use gamma <= {planned}")
    if stop_below is not None or expectations:
        return "adaptive chains (stop_below) and expectations= are the growing loop's"
    if not tree:
        return None
    for role, lm in (("target", target), ("draft", draft)):
        if getattr(lm, "recurrent", False):  # models.static_states: the static form of recurrent layers scores chains
            return (f"the {role} {type(getattr(lm, 'model', lm)).__name__} has recurrent layers, whose captured steps "
                    "score chains: its trees run path by path in the growing loop")
    if draft_law in ("dynamic", "static") or verifier in CAPTURED_TREE_RULES:
        return None
    if verifier == "gbv":
        return "GBV's verifier reads the host (it computes q^G only for the rows that need it): use another tree rule"
    return f"verifier {verifier!r} has no captured step"


def capture_refusal(target, draft, mode: str) -> str | None:
    """Why the run's models cannot run their steps as ``mode`` (``CausalLM.capture_refusal``: a forward that reads the
    host, or that torch.compile cannot trace whole), or None."""
    for role, lm in (("target", target), ("draft", draft)):
        why = lm.capture_refusal(mode) if hasattr(lm, "capture_refusal") else None
        if why:
            return f"the {role} {why}"
    return None


def runner_mode(compile: str, device, why_not: str | None, refusal=None) -> str | None:
    """The :class:`~specresearch.engine.captured.StepRunner` mode ``compile`` asks for on ``device``, or None for the
    growing loop; ``why_not``: :func:`static_available`'s answer for the run (``auto`` then takes the growing loop,
    any other choice but ``off`` raises it); ``refusal(mode)``: why the models cannot run as that mode
    (:func:`capture_refusal`; ``auto`` then takes the growing loop, ``on`` and the modes named raise it)."""
    if compile not in COMPILE_CHOICES:
        raise ValueError(f"compile must be one of {COMPILE_CHOICES}, got {compile!r}")
    cuda = torch.device(device).type == "cuda"
    if compile in CUDA_GRAPH_MODES and not cuda:  # before the run is built, in the caller's words
        raise ValueError(f"compile={compile!r} captures CUDA graphs, and the target is on {torch.device(device)}: "
                         "compile='on' compiles the step for its device (inductor off CUDA), 'static' runs the "
                         "captured steps eagerly, 'off' the growing loop")
    if compile == "off" or (compile == "auto" and (why_not is not None or not cuda)):
        return None
    if why_not is not None:
        raise ValueError(f"compile={compile!r} runs captured steps, but {why_not} (compile='off' runs it)")
    mode = ("cudagraph" if cuda else "inductor") if compile in ("auto", "on") else {"static": "eager"}.get(compile, compile)
    why = refusal(mode) if refusal is not None else None
    if why is None:
        return mode
    if compile == "auto":
        return None
    raise ValueError(f"compile={compile!r} runs the captured steps as {mode!r}, but {why}: compile='static' runs them "
                     "eagerly, 'off' the growing loop")


def plan_for(verifier: str, gamma: int, num_drafts: int = 1, draft_law: str = "iid", tree_nodes: int | None = None,
             autoregressive: bool = False) -> StaticPlan:
    """The :class:`StaticPlan` of ``speculative_generate``'s arguments (a run :func:`static_available` accepts)."""
    if autoregressive:
        return StaticPlan("autoregressive")
    if num_drafts == 1 and draft_law == "iid" and verifier in _CHAIN_VERIFIERS:
        return StaticPlan("chain", verifier, gamma)
    if draft_law in ("dynamic", "static"):
        return StaticPlan("tree", "onehot", gamma, num_drafts, tree_nodes or num_drafts * gamma, draft_law)
    return StaticPlan("tree", verifier, gamma, num_drafts, num_drafts * gamma, draft_law)


class _State:
    """The run's device tensors, preallocated; every step reads and writes them in place."""

    def __init__(self, plan: StaticPlan, batch: int, device, feature_size: int, log_steps: int, eos: torch.Tensor):
        width, refeed = plan.width, plan.refeed
        self.pending = torch.zeros(batch, dtype=torch.long, device=device)
        self.refeed_tokens = torch.zeros(batch, refeed, dtype=torch.long, device=device)
        self.refeed_count = torch.ones(batch, dtype=torch.long, device=device)
        self.refeed_features = torch.zeros(batch, refeed, feature_size, device=device) if feature_size else None
        self.uniforms = torch.zeros(batch, plan.num_uniforms(), dtype=torch.float64, device=device)
        self.active = torch.ones(batch, dtype=torch.bool, device=device)
        self.emitted = torch.zeros(batch, dtype=torch.long, device=device)
        self.limit = torch.zeros((), dtype=torch.long, device=device)
        self.eos = eos.to(device)
        self.log = torch.zeros(log_steps, batch, 2 + width, dtype=torch.long, device=device)  # active, n, tokens
        self.cursor = torch.zeros((), dtype=torch.long, device=device)
        self.flags = torch.zeros(log_steps, 3 * _flag_calls(plan), dtype=torch.long, device=device)

    def small(self) -> list[torch.Tensor]:
        """Every tensor a step changes but the caches' buffers (what a capture's warm-up must give back)."""
        return [t for t in (self.pending, self.refeed_tokens, self.refeed_count, self.refeed_features, self.active,
                            self.emitted, self.log, self.cursor, self.flags) if t is not None]


def _flag_calls(plan: StaticPlan) -> int:
    """Logits checks a step makes (one per model call whose logits it reads)."""
    return {"autoregressive": 1, "chain": plan.gamma + 1, "tree": plan.gamma + 1}[plan.kind]


class _Run:
    """The models, the plan and the state of one run; its ``step`` is the function a runner compiles or captures."""

    def __init__(self, plan, sampling, target, draft, state):
        self.plan, self.sampling, self.target, self.draft, self.state = plan, sampling, target, draft, state
        self.reads = isinstance(draft, StaticFeatureModel)

    def start(self, ids: torch.Tensor, mask: torch.Tensor, max_new_tokens: int) -> None:
        """Begin a batch of left-padded prompts ``ids / mask [B, L]``, in the run's buffers (their addresses, which a
        captured step reads, never change): the state reset in place and the prompts prefilled."""
        s, device = self.state, self.target.device
        for tensor in (s.refeed_tokens, s.emitted, s.cursor, s.log, s.flags):
            tensor.zero_()
        if s.refeed_features is not None:
            s.refeed_features.zero_()
        s.active.fill_(True)
        s.limit.fill_(max_new_tokens)
        _prefill(self.target, self.draft, ids.to(device), mask.to(device), s)

    def small_state(self) -> list[torch.Tensor]:
        """Every tensor a step changes but the caches' buffers: the run's state and the models' row extents (a
        model's ``held_rows`` where it wraps others, each with its own: ``drafts.combined``, ``drafts.dial``)."""
        models = [m for m in (self.target, self.draft) if m is not None]
        rows = [r for m in models for r in getattr(m, "held_rows", [m.rows])]
        kept = [t for m in models for t in getattr(m, "held_states", [])]  # recurrent layers' kept states
        return self.state.small() + [t for r in rows for t in (r.length, r.positions)] + kept

    stages: list[str] = []  # the step's logits checks, by stage (the same every step), for the host's error

    def step(self) -> None:
        checks = StepChecks()
        if self.plan.kind == "autoregressive":
            n, block = self._autoregressive(checks)
        elif self.plan.kind == "chain":
            n, block = self._chain(checks)
        else:
            n, block = self._tree(checks)
        self._finish(n, block, checks)
        self.stages = checks.stages

    # -- stages ---------------------------------------------------------------------------------------------------

    def _pick(self, probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """One token per row of ``probs [B, V]`` from uniforms ``u [B]`` (the argmax when greedy)."""
        return probs.argmax(-1) if self.sampling.greedy else inverse_cdf(probs, u)

    def _draft_call(self, tokens, inputs, **where):
        """The draft's call -> (logits ``[B, k, V]``, its predictions for a feature draft else None)."""
        if self.reads:
            return self.draft.forward(tokens, inputs=inputs, **where)
        return self.draft.forward(tokens, **where)[0], None

    def _refeed(self):
        """Re-feed the last step's accepted tokens and next token; -> the draft's logits ``[B, V]`` and prediction
        ``[B, H]`` (or None) at the pending token, the slot the step drafts from. A draft with a ``refeed`` of its own
        (a block drafter, which runs its block there: ``drafts.dflash_static``) is re-fed through it."""
        s = self.state
        inputs = self.draft.fuse(s.refeed_features) if self.reads else None
        refeed = getattr(self.draft, "refeed", None)
        logits, hidden = refeed(s.refeed_tokens, inputs=inputs) if refeed else self._draft_call(s.refeed_tokens, inputs)
        last = (s.refeed_count - 1)[:, None]  # [B, 1]
        self.draft.commit(s.refeed_count * s.active)
        logits = logits.gather(1, last[:, :, None].expand(-1, -1, logits.shape[-1]))[:, 0]
        return logits, None if hidden is None else hidden.gather(1, last[:, :, None].expand(-1, -1, hidden.shape[-1]))[:, 0]

    def _autoregressive(self, checks: StepChecks):
        s = self.state
        logits, _ = self.target.forward(s.pending[:, None])
        token = self._pick(checks.probs(logits[:, 0], self.sampling, "target model logits (autoregressive step)"),
                           s.uniforms[:, 0])
        self.target.commit(s.active.long())
        return torch.zeros_like(token), token[:, None]

    def _chain(self, checks: StepChecks):
        s, gamma, sampling = self.state, self.plan.gamma, self.sampling
        logits, carry = self._refeed()
        tokens, probs = [], []
        for i in range(gamma):
            q = checks.probs(logits, sampling, f"draft model logits (drafting token {i + 1})")  # [B, V]
            tokens.append(self._pick(q, s.uniforms[:, i]))
            probs.append(q)
            if i < gamma - 1:
                out, hidden = self._draft_call(tokens[-1][:, None], None if carry is None else carry[:, None], offset=i)
                logits, carry = out[:, 0], None if hidden is None else hidden[:, 0]
        drafts, q = torch.stack(tokens, 1), torch.stack(probs, 1)  # [B, gamma], [B, gamma, V]
        layers = self.draft.feature_layers if self.reads else None
        logits, features = self.target.forward(torch.cat([s.pending[:, None], drafts], 1), hidden_layers=layers)
        p = checks.probs(logits, sampling, "target model logits (scoring the drafts)")  # [B, gamma + 1, V]
        verify = _CHAIN_VERIFIERS[self.plan.verifier]
        extra = {"scan": False} if verify is block_verify else {}  # every h_i at once: no host read
        result = verify(p, q, drafts, uniforms=s.uniforms[:, gamma:], validate=False, **extra)
        n = result.num_accepted
        self.target.commit((n + 1) * s.active)
        block = torch.cat([drafts, drafts[:, :1]], 1).scatter(1, n[:, None], result.next_token[:, None])
        if features is not None:
            s.refeed_features.copy_(features)
        return n, block

    def _tree(self, checks: StepChecks):
        """A tree step (``engine.static_trees``): draft, one target call on the tree, the rule, keep the path."""
        s, plan = self.state, self.plan
        logits, carry = self._refeed()
        tree = draft_tree(self, logits, carry, checks)
        layers = self.draft.feature_layers if self.reads else None
        logits, features = self.target.forward(tree.call_tokens, depth=tree.depth, visible=tree.visible,
                                               hidden_layers=layers)
        n, along, next_token = verify_tree(self, tree, logits, checks)  # along: [B, L+1] call rows of the kept path
        self.target.keep_path(along, (n + 1) * s.active)
        chosen = tree.call_tokens.gather(1, along[:, 1:])  # [B, L]
        block = torch.cat([chosen, chosen[:, :1]], 1).scatter(1, n[:, None], next_token[:, None])
        if features is not None:
            s.refeed_features.copy_(features.gather(1, along[:, :, None].expand(-1, -1, features.shape[-1])))
        return n, torch.cat([block, block[:, :1].expand(-1, plan.width - block.shape[1])], 1)

    def _finish(self, n: torch.Tensor, block: torch.Tensor, checks: StepChecks) -> None:
        """The step's bookkeeping: the log row (whether each row was active, n, the emitted block), stopping (the
        limit, an EOS among the kept tokens), the next pending token and re-feed."""
        s = self.state
        width = block.shape[1]
        kept = torch.arange(width, device=n.device)[None] <= n[:, None]  # [B, W]: x_1..x_n and the next token
        room = (s.limit - s.emitted)[:, None] > torch.arange(width, device=n.device)[None]
        eos = ((block[:, :, None] == s.eos).any(-1) & kept & room).any(1) if s.eos.numel() else torch.zeros_like(s.active)
        row = torch.cat([s.active.long()[:, None], n[:, None], block], 1)
        s.log.index_copy_(0, s.cursor[None], row[None])
        s.flags.index_copy_(0, s.cursor[None], checks.tensor().to(n.device)[None])
        s.cursor.add_(1)
        s.emitted.add_((n + 1) * s.active)
        s.active.logical_and_(~eos & (s.emitted < s.limit))
        s.pending.copy_(block.gather(1, n[:, None])[:, 0])
        s.refeed_tokens.copy_(block[:, : s.refeed_tokens.shape[1]])
        s.refeed_count.copy_(n + 1)


def static_generate(target, draft, prompts, *, plan: StaticPlan, max_new_tokens: int = 64,
                    sampling: SamplingConfig = SamplingConfig(), seed: int | torch.Generator | Sequence[int] = 0,
                    tokenizer=None, eos_token_id=None, on_step: Callable[[list[list[int]]], None] | None = None,
                    stop_when: Callable[[int, list[int]], bool] | None = None, mode: str = "eager",
                    steps_per_read: int = 1) -> GenerationResult:
    """Decode ``prompts`` with captured steps (module docstring): ``target`` (and ``draft``, None for
    autoregressive) are models with a static form (``models.protocols.HasStaticForm``), run as ``plan`` says.

    ``mode``: how a step runs (:class:`~specresearch.engine.captured.StepRunner`: ``"eager"``, ``"inductor"``,
    ``"cudagraph"``, ``"reduce-overhead"``). ``steps_per_read``: steps between host reads (their tokens come back
    together; ``on_step`` and ``stop_when`` then see them together). Other arguments as
    :func:`specresearch.engine.generate.speculative_generate`'s. -> ``GenerationResult`` whose step records have NaN
    target / draft seconds (a captured step is not split) and each step's share of its read's wall time; the first
    run of a target with these shapes and settings compiles or captures its step before the first (``mode`` other
    than eager: ``compile_seconds``, which ``seconds`` leaves out; a later run replays it).
    """
    ids, mask = encode_prompts(prompts, tokenizer)
    batch, device = ids.shape[0], target.device
    check_context(target, ids, max_new_tokens, plan.width)
    plan_context(target, ids, mask, max_new_tokens)
    if draft is not None:
        check_context(draft, ids, max_new_tokens, plan.draft_width())
        plan_context(draft, ids, mask, max_new_tokens)
    for role, lm in (("target", target), ("draft", draft)):  # planned: a run that changes a rotary set (prefix_sets)
        if getattr(lm, "static_refusal", None):
            raise ValueError(f"{role} {lm.static_refusal}: run the growing loop (compile='off')")
    eos = eos_ids(eos_token_id, tokenizer, target)
    generators = _generators(seed, batch, device)
    run, runner = _session(target, draft, plan, sampling, batch, cache_capacity(ids.shape[1] + max_new_tokens, plan), eos,
                           steps_per_read, mode)
    t0 = clock(device)
    run.start(ids, mask, max_new_tokens)
    prefill_seconds = clock(device) - t0
    compile_seconds = 0.0
    if not runner.prepared:  # the first run of these shapes compiles or captures its step: timed apart, not a step
        t0 = clock(device)
        runner.prepare()
        compile_seconds = clock(device) - t0
    state = run.state
    rows = _Rows(max_new_tokens, eos, [[] for _ in range(batch)], [False] * batch, stop_when)
    steps: list[StepRecord] = []
    start = time.perf_counter()
    while not all(rows.done):
        for _ in range(steps_per_read):
            if not sampling.greedy:
                state.uniforms.copy_(_draw(generators, state.uniforms.shape, device))
            runner()
        records, still = _read(state, steps_per_read, run.stages)
        now = time.perf_counter()
        for active, accepted, blocks in records:
            kept = rows.add([block[: n + 1] if a else [] for a, n, block in zip(active, accepted, blocks)])
            steps.append(StepRecord(tuple(n if a else 0 for a, n in zip(active, accepted)), tuple(active),
                                    plan.gamma if plan.kind != "autoregressive" else 0, 1,
                                    0 if draft is None else plan.gamma, (now - start) / len(records), float("nan"),
                                    float("nan"), scored=(plan.width,) * batch))
            if on_step is not None:
                on_step(kept)
        start = now
        if any(done and running for done, running in zip(rows.done, still)):  # ended on the host (stop_when)
            state.active.copy_(torch.tensor([not done for done in rows.done], device=device))
    return _result(rows, steps, prefill_seconds, tokenizer, "autoregressive" if draft is None else "speculative",
                   compile_seconds)


CAPACITY_STEP = 64  # a static cache has a power of two of slots, at least this many: prompts of other lengths
SESSIONS_KEPT = 8  # sessions (a run, its buffers and its compiled or captured step) a target keeps, the latest used


def cache_capacity(length: int, plan: StaticPlan) -> tuple[int, int]:
    """(target, draft) cache slots for prompt + new tokens ``length``: room for two steps past it, rounded up to a
    power of two (at least ``CAPACITY_STEP``)."""
    def bucket(need: int) -> int:
        return max(CAPACITY_STEP, 1 << (need - 1).bit_length())
    return bucket(length + 2 * plan.width + 1), bucket(length + 2 * plan.draft_width() + 1)


_SESSIONS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # target -> {key: (draft, run, runner)}


def _session(target, draft, plan, sampling, batch, capacity, eos, steps_per_read, mode):
    """The run and step runner for these shapes and settings: kept on ``target`` (the last few), so a second call
    with the same shapes replays the step compiled or captured by the first."""
    kept = _SESSIONS.setdefault(target, collections.OrderedDict())
    key = (id(draft), plan, sampling, batch, capacity, tuple(sorted(eos)), steps_per_read, mode)
    if key in kept:
        kept.move_to_end(key)
        return kept[key][1:]
    run = build_run(target, draft, plan=plan, sampling=sampling, batch=batch, capacity=capacity, eos=eos,
                    steps_per_read=steps_per_read)
    kept[key] = (draft, run, StepRunner(run.step, mode, run.small_state, target.device))  # draft: kept alive (id)
    while len(kept) > SESSIONS_KEPT:
        kept.popitem(last=False)
    return kept[key][1:]


def build_run(target, draft, *, plan: StaticPlan, sampling: SamplingConfig, batch: int, capacity: tuple[int, int],
              eos=frozenset(), steps_per_read: int = 1) -> "_Run":
    """The static forms of ``target`` and ``draft`` (None: autoregressive) allocated for ``batch`` rows and
    ``capacity`` (target, draft) slots, and the run's state; :meth:`_Run.start` then begins a batch of prompts."""
    device = target.device
    static_target = target.static_form()
    static_draft = None if draft is None else draft.static_form()
    if isinstance(static_draft, BindsTarget):  # a draft that reads its target's cache (drafts.gemma4): the static one's
        static_draft.bind(static_target)
    reads = isinstance(static_draft, StaticFeatureModel)
    state = _State(plan, batch, device, static_draft.feature_size if reads else 0, steps_per_read,
                   torch.tensor(sorted(eos), dtype=torch.long))
    for form, slots in ((static_target, capacity[0]), (static_draft, capacity[1])):
        if form is not None:  # recurrent layers record the tokens written between two commits: span
            allocate_form(form, batch, slots, span=max(plan.width, plan.refeed))
    return _Run(plan, sampling, static_target, static_draft, state)


def start_run(target, draft, ids: torch.Tensor, mask: torch.Tensor, *, plan: StaticPlan, sampling: SamplingConfig,
              max_new_tokens: int, eos=frozenset(), steps_per_read: int = 1) -> "_Run":
    """A new run (:func:`build_run`) started on the left-padded prompts ``ids / mask [B, L]``: its ``step()`` is one
    captured step (what :func:`static_generate` runs, and what tests compile)."""
    run = build_run(target, draft, plan=plan, sampling=sampling, batch=ids.shape[0],
                    capacity=cache_capacity(ids.shape[1] + max_new_tokens, plan), eos=eos, steps_per_read=steps_per_read)
    run.start(ids, mask, max_new_tokens)
    return run


def _prefill(target, draft, ids: torch.Tensor, mask: torch.Tensor, state: _State) -> None:
    """Write all but the last prompt token into both caches; the last is the target's pending token and the draft's
    first re-feed (with, for a feature draft, the target's feature of the slot before it)."""
    reads = isinstance(draft, StaticFeatureModel)
    _, features = target.prefill(ids, mask, leave=1, hidden_layers=draft.feature_layers if reads else None)
    state.pending.copy_(ids[:, -1])
    state.refeed_tokens[:, 0] = ids[:, -1]
    state.refeed_count.fill_(1)
    if draft is None:
        return
    if not reads:
        draft.prefill(ids, mask, leave=1)
        return
    batch = ids.shape[0]
    before = torch.zeros(batch, ids.shape[1], draft.feature_size, device=ids.device)
    if features is not None:  # slot j reads the feature of slot j - 1 (zeros before the first, and after padding)
        before[:, 1:] = features * mask[:, :-1, None]
    draft.prefill(ids, mask, leave=1, inputs=draft.fuse(before[:, :-1]))
    state.refeed_features[:, 0] = before[:, -1]


def _draw(generators, shape, device) -> torch.Tensor:
    """A step's uniforms ``[B, U]``: from the shared generator, or a row from each row's."""
    if isinstance(generators, torch.Generator):
        return uniforms(shape, generators, device)
    return torch.stack([uniforms(shape[1], g, device) for g in generators])


def _read(state: _State, steps: int, stages: list[str]):
    """The host read of ``steps`` steps' log rows, with their logits checks (which raise here, naming the stage) and
    the rows still running -> ([per step (active per row, accepted per row, emitted block per row)], still running
    per row); the log's cursor is rewound."""
    log, flags = state.log, state.flags
    values = torch.cat([log.reshape(-1), flags.reshape(-1), state.active.long()]).tolist()
    state.cursor.zero_()
    batch, width = log.shape[1], log.shape[2]
    checks = StepChecks()
    checks.stages = list(stages)
    per_step = flags.shape[1]
    for i in range(steps):
        start = log.numel() + i * per_step
        checks.raise_first(values[start : start + per_step])
    records = []
    for i in range(steps):
        rows = [values[(i * batch + b) * width : (i * batch + b + 1) * width] for b in range(batch)]
        records.append(([bool(r[0]) for r in rows], [r[1] for r in rows], [r[2:] for r in rows]))
    return records, [bool(v) for v in values[-batch:]]
