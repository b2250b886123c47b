"""The serving engines' sampling-mode rules, encoded as exact rules (:class:`specresearch.audit.rules.Rule`).

Each builder below states what was encoded, from which file or thread, and what could not be confirmed. The
rules were read from the engines' public source and issue threads (late 2026); the code does not carry over,
only the rule. Notation: p = target law after its processors, q = draft law, x = a draft token.

Shapes: the audit enumerates laws, so the default trees are small (``num_drafts`` = K children per node,
``gamma`` = depth); the engines' own defaults are far larger (EAGLE-2: top-k 10, depth 5-6, 60 nodes) and are
named in each docstring. A verdict on a small tree is a verdict on the rule: the counterexamples found here
occur inside any larger tree with the same rule.

Re-read in the source for this audit: SGLang's kernel (``TreeSpeculativeSamplingTargetOnly``: the comparison
``coin <= prob_acc / threshold_acc || p(x) >= threshold_single``, the reset of prob_acc and the coin after an
acceptance, the residual relu(p - p at the rejected siblings)). The other rules are encoded from a summary of the
files and threads each docstring cites, not re-read line by line here; details that stay unconfirmed are named.

Thresholds are parameters (``audit("sglang", threshold_acc=0.5)``); a float is read as the decimal it prints
as (0.09 -> 9/100), so the exact laws stay rational.
"""

from __future__ import annotations

import itertools
import math
import numbers
from collections import defaultdict
from collections.abc import Callable, Sequence
from fractions import Fraction

from specresearch.audit.rules import Rule
from specresearch.exact.multi import verify_multi_exact
from specresearch.exact.paths import merged_tree, topk_children

__all__ = ["ENGINE_RULES", "LOSSY_SETTINGS", "engine_rule", "method_law"]

_ONE, _ZERO = Fraction(1), Fraction(0)


# ----------------------------------------------------------------------------- shared pieces


def _fraction(name: str, value, lo=_ZERO, hi=_ONE) -> Fraction:
    """A parameter as an exact Fraction in [lo, hi]; floats are read as the decimal they print as."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    out = Fraction(str(value)) if isinstance(value, float) else Fraction(value)
    if not lo <= out <= (hi if hi is not None else out):
        raise ValueError(f"{name} must be in [{lo}, {hi}], got {value!r}")
    return out


def _emit(law: dict, accepted: tuple, mass, row) -> None:
    """Add ``mass`` times "accepted, then one token from row" to ``law``."""
    if mass:
        for token, prob in enumerate(row):
            if prob:
                law[accepted + (token,)] += mass * prob


def _argmax(row) -> int:
    return max(range(len(row)), key=lambda t: (row[t], -t))


def method_law(method: str) -> Callable:
    """The law function of a verifier of :mod:`specresearch.exact.multi` (``"token"``, ``"onehot"``, ...)."""
    return lambda target, draft, paths, prefix: verify_multi_exact(target, draft, paths, method, prefix)


def _chain(draft, num_drafts: int, gamma: int, prefix: tuple) -> dict:
    """The greedy chain (argmax of q at every depth, ties by token id): one path, probability 1."""
    path: tuple = ()
    for _ in range(gamma):
        path += topk_children(draft(prefix + path), 1)
    return {(path,): _ONE}


# ----------------------------------------------------------------------------- rule laws


def _sample_and_compare(target, draft, paths, prefix) -> dict:
    """Sample the target at every position; keep the draft token while they agree; emit the target's token."""
    ((path,),) = [set(paths)]
    law: dict = defaultdict(Fraction)
    mass = _ONE
    for d, x in enumerate(path):
        row = target(prefix + path[:d])
        for t, v in enumerate(row):
            if v and t != x:
                law[path[:d] + (t,)] += mass * v
        mass *= row[x]
    _emit(law, path, mass, target(prefix + path))
    return law


def _typical(row, x: int, epsilon: Fraction, delta: Fraction) -> bool:
    """Medusa's typical acceptance p(x) > min(eps, delta exp(-H(p))), decided exactly.

    exp(-H(p)) = prod p_i^p_i is algebraic: with D the common denominator of the p_i, p(x) > delta exp(-H) iff
    p(x)^D > delta^D prod p_i^(p_i D), a comparison of rationals.
    """
    px = row[x]
    if px > epsilon:
        return True
    if delta == 0:
        return px > 0
    positive = [v for v in row if v]
    power = math.lcm(*(v.denominator for v in positive))
    rhs = delta**power
    for v in positive:
        rhs *= v ** (v.numerator * (power // v.denominator))
    return px**power > rhs


def _medusa_typical_law(epsilon: Fraction, delta: Fraction, fast: bool) -> Callable:
    def law(target, draft, paths, prefix):
        best, best_len, best_likelihood = paths[0], -1, _ZERO
        for path in paths:  # the longest typical prefix; ties (fast) by the prefix's likelihood, then the first
            n, likelihood = 0, _ONE
            while n < len(path) and _typical(target(prefix + path[:n]), path[n], epsilon, delta):
                likelihood *= target(prefix + path[:n])[path[n]]
                n += 1
            if n > best_len or (fast and n == best_len and n > 0 and likelihood > best_likelihood):
                best, best_len, best_likelihood = path, n, likelihood
        accepted = best[:best_len]
        row = target(prefix + accepted)
        if fast:
            return {accepted + (_argmax(row),): _ONE}
        return {accepted + (t,): v for t, v in enumerate(row) if v}

    return law


def _medusa_nucleus_law(target, draft, paths, prefix) -> dict:
    """One draw y ~ p for every candidate path and position, independent across paths (shared prefixes included);
    a path's accepted length is its first mismatch; the first path of the longest length wins; then a fresh draw from
    p after its accepted prefix. Enumerated over every tuple of accepted lengths."""
    def lengths(path: tuple) -> list[Fraction]:  # P(accepted length = l), l = 0 .. len(path)
        out, reach = [], _ONE
        for n, x in enumerate(path):
            px = target(prefix + path[:n])[x]
            out.append(reach * (1 - px))
            reach *= px
        return out + [reach]

    law, laws = defaultdict(Fraction), [lengths(path) for path in paths]
    for ls in itertools.product(*(range(len(path) + 1) for path in paths)):
        mass = math.prod((laws[i][l] for i, l in enumerate(ls)), start=_ONE)
        if mass:
            best = max(range(len(paths)), key=lambda i: (ls[i], -i))
            accepted = paths[best][: ls[best]]
            _emit(law, accepted, mass, target(prefix + accepted))
    return law


def _sglang_law(threshold_single: Fraction, threshold_acc: Fraction) -> Callable:
    """One coin per node; siblings in turn with prob_acc += p(x); accept when coin <= prob_acc / threshold_acc or
    p(x) >= threshold_single; all rejected: sample p with the rejected siblings zeroed."""

    def clip(v: Fraction) -> Fraction:
        return min(_ONE, v / threshold_acc) if threshold_acc else (_ONE if v else _ZERO)

    def law(target, draft, paths, prefix):
        children, out = merged_tree(paths), defaultdict(Fraction)

        def descend(u: tuple, mass: Fraction) -> None:
            row = target(prefix + u)
            below, reached = _ZERO, _ONE  # reached = P(coin > below / threshold_acc)
            for x in children[u]:
                cum = below + row[x]
                accept = reached if row[x] >= threshold_single else clip(cum) - clip(below)
                if accept:
                    descend(u + (x,), mass * accept)
                reached -= accept
                below = cum
                if row[x] >= threshold_single:
                    break
            leftover = [_ZERO if t in children[u] else v for t, v in enumerate(row)]
            total = sum(leftover, _ZERO)
            _emit(out, u, mass * reached, [v / total for v in leftover] if total else row)

        descend((), _ONE)
        return out

    return law


def _relaxed_accepts(row, x: int, top_k: int, delta: Fraction) -> bool:
    """TensorRT-LLM's ``mtpRelaxedAcceptanceKernel``: x among the target's top_k tokens with p(x) >= max p - delta, the
    threshold in probabilities (the kernel's "logprobs" are ``torch.softmax`` outputs); the top token always passes."""
    return x in topk_children(row, top_k) and row[x] >= max(row) - delta


def _relaxed_law(top_k: int, delta: Fraction) -> Callable:
    def law(target, draft, paths, prefix):
        ((path,),) = [set(paths)]
        out = defaultdict(Fraction)
        for d, x in enumerate(path):
            row = target(prefix + path[:d])
            if not _relaxed_accepts(row, x, top_k, delta):
                out[path[:d] + (_argmax(row),)] += _ONE  # the "golden token": the target's top-1
                return out
        out[path + (_argmax(target(prefix + path)),)] += _ONE
        return out

    return law


def _p_split_tree(p_split: Fraction) -> Callable:
    """llama.cpp examples/speculative: every path continues with the draft's top token; another token with
    q > p_split opens a new path while fewer than ``num_drafts`` paths exist. Probability 1."""

    def p_split_tree(draft, num_drafts, gamma, prefix):
        paths = [()]
        for _ in range(gamma):
            grown = []
            for i, u in enumerate(paths):
                row = draft(prefix + u)
                ranked = topk_children(row, len(row))
                grown.append(u + ranked[:1])
                for t in ranked[1:]:
                    if row[t] > p_split and len(grown) + len(paths) - i - 1 < num_drafts:  # paths after this one
                        grown.append(u + (t,))
            paths = grown
        return {tuple(paths): _ONE}

    return p_split_tree


# ----------------------------------------------------------------------------- the engines


def eagle2(num_drafts: int = 2, gamma: int = 1) -> Rule:
    """EAGLE-2/3 (SafeAILab/EAGLE at cb7e084, re-read: ``eagle/model/cnets.py`` ``topK_genrate``, l. 670 on, defaults
    l. 479: top-k 8, depth 5, 63 tokens, chosen by cumulative draft log-probability; ``eagle/model/utils.py``
    ``evaluate_posterior``, l. 337-420): a deterministic tree of the draft's top-k children (here the full top-K
    tree), verified depth by depth (l. 379) over the distinct children of the accepted prefix with q treated as 1
    (l. 398): accept x if r <= p(x) (l. 396, Python's ``random.random``); on rejection p(x) <- 0 and renormalise
    (l. 406), next sibling; a depth with a rejection and no acceptance ends in a draw from what is left (l. 409), one
    with no candidate in a fresh draw of p: the one-hot rule. Maintainers say it is exact (EAGLE issues 93, 221). The
    node-budget pruning is deterministic given the context, so it leaves the verdict unchanged."""
    return Rule("eagle2", method_law("onehot"), "topk", num_drafts, gamma, {}, "exact", eagle2.__doc__)


def eagle1(num_drafts: int = 2, gamma: int = 1) -> Rule:
    """EAGLE-1 (same repository, the older ``cnets.py`` ``sample``): children drawn without replacement from the
    processed draft law, min(1, p/q) with q the without-replacement conditional, residual max(p - q, 0) with the
    rejected token removed from q: recursive rejection sampling without replacement. Encoded with the toolkit's
    ``"without_replacement"`` law, which draws the K first tokens without replacement and continues each path
    from q: at gamma = 1 that is EAGLE-1's tree; deeper EAGLE-1 trees also branch below the root (not encoded)."""
    return Rule("eagle1", method_law("rrs_without_replacement"), "without_replacement", num_drafts, gamma, {}, "exact", eagle1.__doc__)


def medusa_typical(num_drafts: int = 2, gamma: int = 1, *, epsilon=0.09, delta=0.3, fast: bool = True) -> Rule:
    """Medusa typical acceptance (FasterDecoding/Medusa at commit e2a5d20, ``medusa/model/utils.py``
    ``evaluate_posterior`` l. 474-515; ``medusa/model/medusa_model.py`` ``medusa_generate`` l. 235-249, 340-342):
    candidates from a deterministic top-k tree (the heads' top-k, Cartesian; here the draft's top-K tree); a
    candidate's token is accepted when p(x) > min(epsilon, delta exp(-H(p))), prefix-wise; the candidate with the
    longest accepted prefix wins, ties broken by the accepted prefix's likelihood (l. 496-501; then the first); then
    the next token is the target's argmax (``fast=True``, the default: ``generate_candidates`` l. 281). Defaults
    epsilon = 0.09, delta = 0.3 as ``medusa_generate`` passes them (the utils' signatures list them swapped).
    ``fast=False`` encodes the code's other branch (the first longest candidate, l. 513, then a fresh sample from p),
    though at e2a5d20 it does not run: l. 504 passes six arguments to ``get_typical_posterior_mask`` (l. 404), which
    takes five. Encoded with the exact entropy; Medusa adds 1e-5 inside the log (not encoded). Not exact by design."""
    epsilon, delta = _fraction("epsilon", epsilon), _fraction("delta", delta, hi=None)
    params = {"epsilon": epsilon, "delta": delta, "fast": fast}
    return Rule("medusa-typical", _medusa_typical_law(epsilon, delta, bool(fast)), "topk", num_drafts, gamma, params, "not exact", medusa_typical.__doc__)


def medusa_nucleus(num_drafts: int = 2, gamma: int = 1) -> Rule:
    """Medusa's nucleus mode (``evaluate_posterior`` with ``sampling="nucleus"``, ``utils.py`` l. 517-528, at commit
    e2a5d20): ``get_nucleus_posterior_mask`` (l. 350-402) draws one sample of the target (after its nucleus
    truncation, taken here as p) for every candidate path and position, independently (``torch.multinomial`` over the
    flattened [candidates x positions] rows, l. 372-376), so paths that share a prefix are compared with different
    samples there; a candidate's accepted length is its first mismatch, the first longest candidate wins (l. 527),
    and the next token is a fresh draw from p after its accepted prefix (``generate_candidates`` l. 285-286), not the
    compared sample. For a single chain P(x) = p(x)(2 - p(x))."""
    return Rule("medusa-nucleus", _medusa_nucleus_law, "topk", num_drafts, gamma, {}, "not exact", medusa_nucleus.__doc__)


def sglang(num_drafts: int = 2, gamma: int = 1, *, threshold_single=1.0, threshold_acc=1.0) -> Rule:
    """SGLang (``sgl-kernel/csrc/speculative/speculative_sampling.cuh`` ``TreeSpeculativeSamplingTargetOnly`` at
    sgl-project/sglang b227f63, re-read; ``server_args.py``): a deterministic top-k tree of the draft's softmax; draft
    probabilities passed as zeros. One coin per accepted node (l. 66, renewed l. 84); siblings in turn with
    prob_acc += p(x) (l. 74-78); accept when coin <= prob_acc / threshold_acc or p(x) >= threshold_single (l. 80;
    prob_acc reset l. 82); a rejected sibling's p copied into the draft row (l. 92), so that all rejected samples
    relu(p - p at the rejected siblings) with a second coin (l. 100 to the kernel's end; nothing subtracted for the
    bonus token, l. 112-115). Exact at the defaults (1.0, 1.0), where it is an inverse-CDF draw over the siblings."""
    params = {"threshold_single": _fraction("threshold_single", threshold_single),
              "threshold_acc": _fraction("threshold_acc", threshold_acc)}
    claim = "exact" if params["threshold_single"] == params["threshold_acc"] == 1 else "not exact"
    return Rule("sglang", _sglang_law(params["threshold_single"], params["threshold_acc"]), "topk", num_drafts, gamma, params, claim, sglang.__doc__)


def vllm_greedy(num_drafts: int = 1, gamma: int = 2) -> Rule:
    """vLLM V1 (``vllm/v1/sample/rejection_sampler.py`` at vllm-project/vllm 7f6fc1c, re-read: ``RejectionSampler.forward``,
    ``apply_sampling_constraints``, ``rejection_random_sample_kernel``, ``sample_recovered_tokens_kernel``;
    ``vllm/config/speculative.py``) with the default ``draft_sample_method="greedy"``: argmax drafts without draft
    probabilities (``NO_DRAFT_PROBS``), so q = 1: accept if p(x) >= u (u float64); rejected: the recovered token,
    argmax of p with x zeroed over one exponential draw per request (a Gumbel-style sample of p without x); bonus token
    from the target's own sampler. The one-hot rule on a greedy chain. p is the target after penalties, allowed and
    bad words, then temperature, top-k and top-p (``apply_sampling_constraints``): truncation is part of p, so top-k /
    top-p need no parameter here. ``min_p`` and ``logit_bias`` are refused with speculative decoding at request
    validation (vLLM issue 42744: the rejection sampler would not apply them to verified positions; vLLM 0.34 still
    refuses them, in ``SamplingParams._validate_spec_decode``). Its Model Runner V2 (vLLM 0.34) processes p the same
    way, the drafted tokens before a position counted as output by the penalties and the bad words, and drafts at the
    temperature alone (``benchmarks/audit_vllm_params.py`` runs it)."""
    return Rule("vllm-greedy", method_law("onehot"), "topk", num_drafts, gamma, {}, "exact", vllm_greedy.__doc__)


def vllm_probabilistic(num_drafts: int = 1, gamma: int = 2) -> Rule:
    """vLLM with ``draft_sample_method="probabilistic"`` (same file and commit as :func:`vllm_greedy`): drafts sampled
    from q and q passed; accept if q(x) > 0 and p(x)/q(x) >= u; recovered token argmax of max(p - q, 0) over one
    exponential draw per request (a sample of the normalised residual; one per step is used): token verification
    (Leviathan et al. 2023, arXiv 2211.17192)."""
    return Rule("vllm-probabilistic", method_law("token"), "iid", num_drafts, gamma, {}, "exact", vllm_probabilistic.__doc__,
                torch_rule="token")


def vllm_block(num_drafts: int = 1, gamma: int = 2) -> Rule:
    """vLLM Model Runner V2 with ``rejection_sample_method="block"``: block verification (Sun et al. 2025,
    arXiv 2403.10444, Algorithm 2) of sampled drafts."""
    return Rule("vllm-block", method_law("block"), "iid", num_drafts, gamma, {}, "exact", vllm_block.__doc__, torch_rule="block")


def _ensemble_law(weight: Fraction) -> Callable:
    """transformers' static ensemble verification: accept with min(1, 1 - w + w p/q), residual norm(max(p - q, 0))
    (p itself where that has no mass), one chain of sampled drafts."""
    from specresearch.audit.custom import rule_from_acceptance  # a rule's exact law from its acceptance function

    return rule_from_acceptance(lambda p_x, q_x: min(_ONE, 1 - weight + weight * p_x / q_x), "ratio").law


def hf_assisted(num_drafts: int = 1, gamma: int = 2, *, assistant: str = "sampled", ensemble_weight=None) -> Rule:
    """transformers assisted generation (5.24: ``generation/utils.py`` ``_assisted_decoding`` l. 4113-4124 and
    ``_speculative_sampling`` l. 4444-4504): token verification with the assistant's processed scores as q.
    ``assistant="sampled"``: the assistant samples with the main generation config, so q is the law its tokens came
    from (exact). ``assistant="greedy"``: a greedy assistant whose softmax is still passed as q (transformers issue
    32867): the ratio test then uses a q that is not the law of the drafts. transformers 5.25 ships this with its Gemma 4
    assistants at ``do_sample=True``: ``SinglePositionMultiTokenCandidateGenerator`` (``candidate_generator.py``)
    drafts ``outputs.logits.argmax`` and returns ``outputs.logits`` as the candidates' logits (issue 47932 lists it);
    ``audit.execute``'s ``transformers-gemma4-assistant`` runs it. ``ensemble_weight`` w in (0, 1): the
    generation config's ``assistant_ensemble_weight`` (DIVERSE's static ensemble verification, opt-in since 5.x,
    ``configuration_utils.py`` l. 350-355): accept with min(1, 1 - w + w p/q), i.e. against w p + (1 - w) q, residual
    max(p - q, 0) renormalised, p where it has no mass (l. 4469-4496): lossy by design."""
    if assistant not in ("sampled", "greedy"):
        raise ValueError(f"assistant must be 'sampled' or 'greedy', got {assistant!r}")
    if ensemble_weight is not None:
        weight = _fraction("ensemble_weight", ensemble_weight)
        if not 0 < weight < 1 or assistant != "sampled":
            raise ValueError(f"ensemble_weight must lie in (0, 1) with a sampling assistant, got {ensemble_weight!r} "
                             f"with assistant={assistant!r}")
        return Rule("hf-assisted", _ensemble_law(weight), "iid", num_drafts, gamma, {"ensemble_weight": weight},
                    "not exact", hf_assisted.__doc__)
    draft_law = "iid" if assistant == "sampled" else _chain
    return Rule("hf-assisted", method_law("token"), draft_law, num_drafts, gamma, {"assistant": assistant},
                "exact" if assistant == "sampled" else "not exact", hf_assisted.__doc__, torch_rule="token" if assistant == "sampled" else None)


def hf_lookup(num_drafts: int = 1, gamma: int = 2) -> Rule:
    """transformers prompt lookup (a candidate generator that returns no q): the target is sampled at every
    position and the candidates kept until the first mismatch, then the target's own sample. The candidates are
    any deterministic choice; here the draft's greedy chain stands in for the lookup."""
    return Rule("hf-lookup", _sample_and_compare, _chain, num_drafts, gamma, {}, "exact", hf_lookup.__doc__)


def _synthetic_law(probs: tuple) -> Callable:
    """llama.cpp's synthetic acceptance: at depth d the draft token is kept with probability ``probs[d]`` whatever p
    says; otherwise the target's own sample is emitted and the step ends (even when it equals the draft token)."""
    def law(target, draft, paths, prefix):
        ((path,),) = [set(paths)]
        out: dict = defaultdict(Fraction)
        mass = _ONE
        for d in range(len(path)):
            _emit(out, path[:d], mass * (1 - probs[d]), target(prefix + path[:d]))
            mass *= probs[d]
        _emit(out, path, mass, target(prefix + path))
        return out
    return law


def llamacpp_server(num_drafts: int = 1, gamma: int = 2, *, synth_rates=None) -> Rule:
    """llama.cpp server (llama.cpp 0c1e570, vendored in the llama-cpp-python 0.3.36 sdist): the draft's tokens
    (``common/speculative.cpp``: a top-k 10 draft sampler, its first candidate, drafting stops below ``p_min``) are
    verified by ``common_sampler_sample_and_accept_n`` (``common/sampling.cpp`` l. 678-709): the target sampled at
    every position with the request's sampler chain, the draft kept while equal, the target's token emitted (exact;
    a drafted end-of-generation token ends the run early, not encoded). ``synth_rates``: the server's synthetic
    acceptance mode for benchmarking (``--spec-synth-rates P0,P1,...``, non-increasing unconditional probabilities
    of reaching each depth, ``common/arg.cpp`` l. 4169-4186 and ``common/speculative.cpp`` l. 2365-2397, turned
    into conditional ones rate_d / rate_(d-1) at l. 2718-2727; ``tools/server/server-context.cpp`` l. 57-97): the
    draft token is kept with that probability whatever the target says, else the target's own sample ends the step.
    llama.cpp warns that its output is then not valid: lossy by design. ``--spec-synth-len L`` resolves to rates
    p, p^2, ... with the mean length L (l. 2399-2432); give those rates here. Encoded with coins independent of the
    target's draws, as the server has them for requests without a seed; a request seed also seeds the coins'
    generator (``server-context.cpp`` l. 1792), which then repeat the sampler's draws (measured: docs/audit.md)."""
    if synth_rates is None:
        return Rule("llamacpp-server", _sample_and_compare, _chain, num_drafts, gamma, {}, "exact",
                    llamacpp_server.__doc__)
    rates = [_fraction("synth_rates", rate) for rate in synth_rates]
    if len(rates) < gamma or any(b > a for a, b in zip(rates, rates[1:])):
        raise ValueError(f"synth_rates must hold at least gamma = {gamma} non-increasing values in [0, 1] (llama.cpp "
                         f"takes one per position up to its n_max), got {list(synth_rates)!r}")
    probs = tuple(rate / before if before else _ZERO for rate, before in zip(rates, [_ONE] + rates[:-1]))[:gamma]
    return Rule("llamacpp-server", _synthetic_law(probs), _chain, num_drafts, gamma, {"synth_rates": tuple(rates)},
                "not exact", llamacpp_server.__doc__)


def list_aligned(p: Sequence, q: Sequence) -> list:
    """q as llama.cpp's example subtracts it from p's list: both candidate lists (the tokens each law keeps, its
    support) sorted by token id and paired position by position, so p's i-th token (by id) loses the q of q's i-th
    token. Where the two lists hold the same tokens this is q itself; where q's list is shorter or holds other tokens
    (a sampler chain truncates each model's list on its own: top-k, top-p, min-p) a token loses another token's q.
    -> the q each of p's tokens loses (0 outside p's list and past the end of q's)."""
    shifted, q_ids = [0 * q[0]] * len(p), [i for i, v in enumerate(q) if v > 0]
    for rank, token in enumerate(i for i, v in enumerate(p) if v > 0):
        if rank < len(q_ids):
            shifted[token] = q[q_ids[rank]]
    return shifted


def _random_order_rrs(lists: str) -> Callable:
    """At each node the children are verified in a uniformly random order (every order equally likely): r <= p/q
    with the node's q, after each rejection the residual norm(max(p - q', 0)), q unchanged; all rejected: a draw
    from the residual. ``lists="support"``: q' = :func:`list_aligned` (p, q), the candidate lists being the laws'
    supports (p's list keeps its tokens, zeros included, so q' is paired against the target's list at the node), and a
    child the target's list lacks is tested with the p read for the child tried before it (0 for the first);
    ``"full"``: q' = q, every token on both lists."""

    def law_fn(target, draft, paths, prefix) -> dict:
        children, law = merged_tree(paths), defaultdict(Fraction)

        def descend(u: tuple, mass: Fraction) -> None:
            q, orders, listed = draft(prefix + u), list(itertools.permutations(children[u])), target(prefix + u)
            shifted = list_aligned(listed, q) if lists == "support" else q
            for order in orders:
                current, left, read = listed, mass / len(orders), _ZERO
                for x in order:
                    if lists == "full" or listed[x] > 0:  # on the target's list (its zeros after a residual too)
                        read = current[x]
                    # else the example's p_tgt keeps what it read for the path tried before (0 for the first)
                    accept = min(_ONE, read / q[x]) if q[x] else _ONE
                    if accept:
                        descend(u + (x,), left * accept)
                    left *= 1 - accept
                    excess = [max(c - d, _ZERO) for c, d in zip(current, shifted)]
                    total = sum(excess, _ZERO)
                    current = tuple(e / total for e in excess) if total else current
                _emit(law, u, left, current)

        descend((), _ONE)
        return law

    return law_fn


def llamacpp_example(num_drafts: int = 1, gamma: int = 3, *, p_split=0.1, lists: str = "support") -> Rule:
    """llama.cpp ``examples/speculative`` (the ``vendor/llama.cpp`` of the llama-cpp-python 0.3.36 sdist,
    ``examples/speculative/speculative.cpp``; SpecInfer's Algorithm 2, PR 5625): the draft's top candidates
    (l. 509-590: the top token of the draft's sampled list, and another path for each next token with q >
    ``p_split`` while fewer than ``n_parallel`` paths exist), verified at each depth by picking an active path
    **uniformly at random** (l. 280-282), accepting its token when r <= p/q with the path's draft list (l. 303-325),
    else replacing the target's list by max(p - q, 0) renormalised (l. 326-362) and picking again; all rejected: a
    draw from the residual (l. 379-395). The subtraction sorts both lists by token id and subtracts position by
    position (l. 335-351), so where the sampler chain left the two models different lists (top-k 40, top-p 0.95,
    min-p 0.05 by default, each on its own model) a token loses another token's q: encoded as such
    with ``lists="support"`` (the default: p and q are the laws the sampler chain leaves, their supports its lists;
    :func:`list_aligned`), while ``lists="full"`` puts every token on both lists (untruncated sampling: p - q).
    Found by running the example (``audit.execute("llamacpp-example")``), which rejects the plain p - q on the
    embedded pair's lists.
    Defaults are the example's: ``n_parallel`` 1 (``common/common.h`` l. 457), ``n_max`` 3 drafted tokens (l.
    328), ``p_split`` 0.1 (l. 331). Not encoded: after a rejection the example marks the other paths with the same
    token inactive but erases the rejected path again instead of them (l. 364-376), so such a path is verified once
    more against the residual; that needs two paths sharing a token at one depth (a tree deeper than one token), so
    trees of several paths are encoded at gamma = 1 only. Encoded: ``p_tgt`` is set only when the path's token is
    on the target's list (l. 276, 299-304; the list keeps its tokens through the residuals, zeros included) and is
    not reset between the paths tried, so a path whose token the target's list lacks is tested with the p read for
    the path tried before it (0 if it is the first): with two paths such a token can be emitted, which the target's
    sampler chain excludes. Not exact: q is not the law of a deterministic draft."""
    p_split = _fraction("p_split", p_split)
    if num_drafts > 1 and gamma > 1:
        raise ValueError("llamacpp-example: trees of several paths are encoded at gamma = 1 only (deeper trees share "
                         "tokens between paths, which the example verifies again: see the docstring)")
    if lists not in ("support", "full"):
        raise ValueError(f"lists must be 'support' or 'full', got {lists!r}")
    return Rule("llamacpp-example", _random_order_rrs(lists), _p_split_tree(p_split), num_drafts, gamma,
                {"p_split": p_split} | ({} if lists == "support" else {"lists": lists}), "not exact",
                llamacpp_example.__doc__)


def trtllm_relaxed(num_drafts: int = 1, gamma: int = 2, *, relaxed_topk: int | None = None, relaxed_delta=0.6) -> Rule:
    """TensorRT-LLM MTP. Strict acceptance (``relaxed_topk=None``, the default) is exact-match verification: the
    target's token compared with the draft's, which with a sampled target token is lossless (the sampling-mode
    encoding; ``llmapi/llm_args.py`` describes "exact-match verification on non-greedy batches"; in ``MTPWorker`` at
    NVIDIA/TensorRT-LLM 23ee85e the target's token is its argmax, greedy only). Relaxed acceptance
    (``use_relaxed_acceptance_for_thinking``, re-read at that commit: ``tensorrt_llm/_torch/speculative/mtp.py``
    ``MTPWorker.sample_and_accept_draft_tokens``, ``process_generation_logits``, ``topk_kernel``; the op's kernel
    ``cpp/tensorrt_llm/kernels/speculativeDecoding/mtpKernels.cu`` ``mtpRelaxedAcceptanceKernel`` at b35ac1b): the
    target's top ``relaxed_topk`` of ``torch.softmax`` (probabilities, though the code names them logprobs); a draft
    token is accepted if it is one of them with p(x) >= max p - delta (the top token always), depth by depth; after
    the accepted prefix comes the target's top-1 token (the "golden token"), never a sample. Applied only between
    the begin- and end-of-thinking tokens (delta set at the begin token, 0 at the end: greedy). Lines are not cited:
    the sources were read through the code index, which numbers characters."""
    if relaxed_topk is None:
        return Rule("trtllm-relaxed", _sample_and_compare, _chain, num_drafts, gamma, {"relaxed_topk": None}, "exact", trtllm_relaxed.__doc__)
    if isinstance(relaxed_topk, bool) or not isinstance(relaxed_topk, int) or relaxed_topk < 1:
        raise ValueError(f"relaxed_topk must be None or a positive int, got {relaxed_topk!r}")
    delta = _fraction("relaxed_delta", relaxed_delta, hi=None)
    return Rule("trtllm-relaxed", _relaxed_law(relaxed_topk, delta), _chain, num_drafts, gamma,
                {"relaxed_topk": relaxed_topk, "relaxed_delta": delta}, "not exact", trtllm_relaxed.__doc__)


ENGINE_RULES = {
    "eagle2": eagle2,
    "eagle1": eagle1,
    "medusa-typical": medusa_typical,
    "medusa-nucleus": medusa_nucleus,
    "sglang": sglang,
    "vllm-greedy": vllm_greedy,
    "vllm-probabilistic": vllm_probabilistic,
    "vllm-block": vllm_block,
    "hf-assisted": hf_assisted,
    "hf-lookup": hf_lookup,
    "llamacpp-server": llamacpp_server,
    "llamacpp-example": llamacpp_example,
    "trtllm-relaxed": trtllm_relaxed,
}

# A lossy (or known-bad) setting of each engine that has one, for the engines table and the frontier.
LOSSY_SETTINGS = {
    "sglang": {"threshold_acc": 0.5},
    "hf-assisted": {"assistant": "greedy"},
    "trtllm-relaxed": {"relaxed_topk": 10, "relaxed_delta": 0.6},
    "llamacpp-server": {"synth_rates": (0.5, 0.25)},
}


def engine_rule(name: str, **params) -> Rule:
    """The rule of engine ``name`` (a key of ``ENGINE_RULES``) with ``params`` (shape and thresholds)."""
    if name not in ENGINE_RULES:
        raise ValueError(f"unknown engine rule {name!r}; one of {sorted(ENGINE_RULES)}")
    try:
        return ENGINE_RULES[name](**params)
    except TypeError as error:  # an unknown keyword: name the settable ones
        import inspect

        settable = list(inspect.signature(ENGINE_RULES[name]).parameters)
        raise ValueError(f"engine rule {name!r} takes {settable}; got {sorted(params)} ({error})") from None
