"""A verification rule as the audit sees it, and the exact laws it induces.

A :class:`Rule` is the exact-twin form of one speculative step: how the draft paths are chosen (a draft law)
and the law of what the verifier emits given them. Everything here is enumerated with
:class:`fractions.Fraction` on small models (:mod:`specresearch.exact`); nothing imports torch.

* ``law(target, draft, paths, prefix) -> {emitted tokens: probability}``, the contract of
  :func:`specresearch.exact.multi.verify_multi_exact`: ``paths`` is a tuple of equal-length token tuples, the
  emitted tokens are the accepted draft tokens followed by one token from the target side.
* ``draft_law``: ``"iid"`` / ``"without_replacement"`` (sampled from q) or ``"topk"`` (the deterministic
  top-k tree) of :func:`specresearch.exact.paths.draft_paths_law`, or a callable
  ``(draft, num_drafts, gamma, prefix) -> {paths: probability}`` for any other choice of candidates.

From a rule and a pair of models the functions below give the step's law, the law of the first ``n_tokens``
of the whole loop (:func:`specresearch.exact.single.loop_law`), its total-variation distance to the target's,
the expected accepted tokens, and the best acceptance any lossless rule reaches with the same draft law.
"""

from __future__ import annotations

import contextlib
import itertools
import random
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from fractions import Fraction

import mpmath

from specresearch.checks import check_int
from specresearch.exact import lp
from specresearch.exact.paths import draft_paths_law
from specresearch.exact.single import (
    as_model,
    loop_law,
    random_rational_model,
    target_distribution,
)

__all__ = [
    "DIGITS",
    "TOLERANCE",
    "Rule",
    "differs",
    "expected_accepted",
    "optimum",
    "output_law",
    "precision",
    "random_model_pairs",
    "search_counterexample",
    "step_law",
    "total_variation",
]

Law = dict[tuple[int, ...], Fraction]
TOLERANCE = 1e-40  # for rules evaluated with 60-digit mpmath numbers (``Rule.numeric``)
DIGITS = 60


@dataclass(frozen=True)
class Rule:
    """One speculative step in exact form: a draft law and the verifier's law given the drafted paths.

    Attributes:
        name: how reports name it.
        law: ``(target, draft, paths, prefix) -> {emitted: P}`` (module docstring).
        draft_law: a name of :func:`specresearch.exact.paths.draft_paths_law` or a callable
            ``(draft, num_drafts, gamma, prefix) -> {paths: P}``.
        num_drafts, gamma: the draft's shape (K paths, or K children per node for ``"topk"``; depth gamma).
        params: the settings the rule was built with (thresholds and the like), for the report.
        claim: what the engine's authors or users say about it at these settings (``"exact"`` or ``"not exact"``),
            or ``""``; the audit checks it, it does not believe it.
        source: where the rule was read (file, function, thread) and what could not be confirmed.
        torch_rule: its batched torch form for the statistical test through the engine (a verifier name of
            :data:`specresearch.core.verify.VERIFIERS` or a callable with that signature), or None.
        numeric: the law holds 60-digit mpmath numbers, not Fractions (:mod:`specresearch.audit.custom`);
            deviations below 1e-40 then count as zero.
    """

    name: str
    law: Callable
    draft_law: str | Callable = "iid"
    num_drafts: int = 1
    gamma: int = 1
    params: dict = field(default_factory=dict)
    claim: str = ""
    source: str = ""
    torch_rule: Callable | str | None = None
    numeric: bool = False

    def __post_init__(self):
        check_int("num_drafts", self.num_drafts, meaning="the number K of draft paths (children per node for topk)")
        check_int("gamma", self.gamma, meaning="the draft depth")
        if not callable(self.law):
            raise ValueError(f"law must be a callable (target, draft, paths, prefix) -> law, got {self.law!r}")

    def paths_law(self, draft, prefix=()) -> dict:
        """``{paths: P}`` of the drafted paths at ``prefix``."""
        if callable(self.draft_law):
            law = self.draft_law(draft, self.num_drafts, self.gamma, tuple(prefix))
            if sum(law.values()) != 1:
                raise ValueError(f"the draft law of rule {self.name!r} sums to {sum(law.values())}, not 1")
            return law
        return draft_paths_law(draft, self.num_drafts, self.gamma, self.draft_law, prefix)


def precision(rule: Rule):
    """A context in which a numeric rule's mpmath arithmetic keeps ``DIGITS`` digits (nothing for exact rules)."""
    return mpmath.workdps(DIGITS) if rule.numeric else contextlib.nullcontext()


def step_law(rule: Rule, target, draft, prefix=()) -> Law:
    """Law of the tokens one step emits, summed over the drafted paths: ``{emitted: P}``, positive entries."""
    with precision(rule):
        return _step_law(rule, as_model(target), as_model(draft), tuple(prefix))


def _step_law(rule: Rule, target, draft, prefix: tuple) -> Law:
    out: dict = defaultdict(Fraction)
    for paths, prob in rule.paths_law(draft, prefix).items():
        for seq, v in rule.law(target, draft, tuple(paths), prefix).items():
            out[seq] += prob * v
    law = {seq: v for seq, v in out.items() if v}
    if abs(sum(law.values()) - 1) > (TOLERANCE if rule.numeric else 0):  # mpf and float compare; mpf and Fraction do not
        raise ValueError(f"rule {rule.name!r} emits a law of total mass {sum(law.values())} at prefix {prefix}, not 1")
    return law


def output_law(rule: Rule, target, draft, n_tokens: int, prefix=()) -> Law:
    """Exact law of the first ``n_tokens`` tokens of the speculative loop run with ``rule``."""
    check_int("n_tokens", n_tokens)
    target, draft = as_model(target), as_model(draft)
    with precision(rule):
        return loop_law(lambda pre: _step_law(rule, target, draft, pre), n_tokens, prefix)


def total_variation(law_a: dict, law_b: dict) -> Fraction:
    """1/2 sum |a - b| over the union of both supports, exactly."""
    keys = set(law_a) | set(law_b)
    return sum((abs(law_a.get(k, 0) - law_b.get(k, 0)) for k in keys), Fraction(0)) / 2


def differs(rule: Rule, law: dict, want: dict) -> bool:
    """True when two laws differ: exactly, or by more than ``TOLERANCE`` in total variation for a numeric rule."""
    with precision(rule):
        return total_variation(law, want) > TOLERANCE if rule.numeric else law != want


def expected_accepted(rule: Rule, target, draft, prefix=()) -> Fraction:
    """E[accepted draft tokens] of one step (the emitted token from the target side excluded)."""
    with precision(rule):
        return sum((v * (len(seq) - 1) for seq, v in step_law(rule, target, draft, prefix).items()), Fraction(0))


def _tree_optimum(target, paths, prefix: tuple) -> Fraction:
    """Sum over the tree's nodes of the target's probability of the path to them: the best E[accepted] of any
    lossless rule on a fixed candidate tree (it emits y ~ p and can accept only the part of y in the tree)."""
    nodes = {path[:d] for path in paths for d in range(1, len(path) + 1)}
    total = Fraction(0)
    for node in nodes:
        prob = Fraction(1)
        for d, x in enumerate(node):
            prob *= target(prefix + node[:d])[x]
        total += prob
    return total


def optimum(rule: Rule, target, draft, prefix=()) -> Fraction | None:
    """The largest E[accepted] of any lossless rule with the same draft law, exactly.

    A deterministic tree: the sum of the target's path probabilities over its nodes (:func:`_tree_optimum`, equal
    to the LP with ``draft_law="topk"``, tests/test_audit.py). Sampled paths: the LP of
    :mod:`specresearch.exact.lp` (``optimal_acceptance`` for gamma = 1, ``optimal_verifier_lp`` over K paths
    otherwise). None for a callable draft law whose paths are random.
    """
    target, draft, prefix = as_model(target), as_model(draft), tuple(prefix)
    law = rule.paths_law(draft, prefix)
    if len(law) == 1:
        (paths,) = law
        return _tree_optimum(target, paths, prefix)
    if callable(rule.draft_law):
        return None
    if rule.gamma == 1:
        return lp.optimal_acceptance(target, draft, rule.num_drafts, rule.draft_law, prefix)
    return lp.optimal_verifier_lp(target, draft, rule.gamma, prefix, num_drafts=rule.num_drafts, draft_law=rule.draft_law).optimum


def _rows(vocab: int, denominator: int):
    """Every probability row over ``vocab`` tokens whose entries are multiples of 1 / denominator."""
    for counts in itertools.product(range(denominator + 1), repeat=vocab - 1):
        if sum(counts) <= denominator:
            yield tuple(Fraction(c, denominator) for c in counts) + (Fraction(denominator - sum(counts), denominator),)


def search_counterexample(rule: Rule, n_tokens: int, *, max_vocab: int = 3, max_denominator: int = 4):
    """The first context-free pair (p, q) on which ``rule``'s loop law of ``n_tokens`` differs from the target's.

    Searched in the order (V, common denominator, p, q), V = 2..max_vocab, denominators 2..max_denominator, every
    row a multiple of 1 / denominator: the answer is smallest in V first and denominator second.
    Returns ``(p, q)`` as tuples of Fractions, or None when every pair in range is lossless.
    """
    seen = set()
    for vocab in range(2, max_vocab + 1):
        for denominator in range(2, max_denominator + 1):
            rows = [row for row in _rows(vocab, denominator) if row not in seen]
            for p, q in itertools.product(rows, repeat=2):
                if differs(rule, output_law(rule, p, q, n_tokens), target_distribution(p, n_tokens)):
                    return p, q
            seen.update(rows)
    return None


def random_model_pairs(num_models: int, seed: int = 0, vocabs: Sequence[int] = (2, 3)) -> list:
    """``num_models`` (target, draft) pairs of random context-dependent rational models with exact zeros
    (:func:`specresearch.exact.random_rational_model`), vocabularies cycling through ``vocabs``."""
    rng = random.Random(seed)
    pairs = []
    for i in range(num_models):
        vocab = vocabs[i % len(vocabs)]
        pairs.append((random_rational_model(vocab, rng, zero_prob=0.25, denominator=6),
                      random_rational_model(vocab, rng, zero_prob=0.25, denominator=6)))
    return pairs
