"""The exact law of K draft paths: i.i.d. or without replacement, enumerated as fractions.
"""

from __future__ import annotations

import functools
import itertools
from collections import defaultdict
from fractions import Fraction

from specresearch.checks import check_int
from specresearch.exact import single as exact

Row = tuple[Fraction, ...]
Paths = tuple[tuple[int, ...], ...]
_ZERO = Fraction(0)
_ONE = Fraction(1)

__all__ = ["DRAFT_LAWS", "draft_paths_law"]


DRAFT_LAWS = ("iid", "without_replacement")


def _check_num_drafts(num_drafts) -> int:
    check_int("num_drafts", num_drafts, meaning="the number K of draft paths")
    return num_drafts


def _check_length(length) -> int:
    check_int("length", length, meaning="gamma, the path length L")
    return length


def _check_draft_law(draft_law) -> str:
    if draft_law not in DRAFT_LAWS:
        raise ValueError(f"draft_law must be one of {DRAFT_LAWS}, got {draft_law!r}")
    return draft_law


def _single_paths(draft, prefix: tuple, length: int) -> dict:
    """{path: q(path | prefix)} over the paths of positive probability, drawn autoregressively."""
    paths = {(): _ONE}
    for _ in range(length):
        paths = {u + (t,): qu * qt for u, qu in paths.items() for t, qt in enumerate(draft(prefix + u)) if qt}
    return paths


def _distinct_heads(row: Row, num: int):
    """Yield (first tokens, probability) of ``num`` draws without replacement from ``row``.

    When fewer than ``num`` tokens have positive mass the draws stop early (the caller pads).
    """
    if num == 0:
        yield (), _ONE
        return
    left = sum(row, _ZERO)
    if left == 0:
        yield (), _ONE
        return
    for x, qx in enumerate(row):
        if qx:
            rest = tuple(_ZERO if t == x else v for t, v in enumerate(row))
            for tail, prob in _distinct_heads(rest, num - 1):
                yield (x,) + tail, qx / left * prob


def draft_paths_law(draft, num_drafts, length, draft_law="iid", prefix=()) -> dict[Paths, Fraction]:
    """Exact law of the K drafted paths of one step: ``{paths: probability}`` (positive entries only).

    Args:
        draft: the draft model q (anything :func:`specresearch.exact.as_model` accepts).
        num_drafts: K >= 1 paths.
        length: L >= 1 tokens per path.
        draft_law: ``"iid"`` (K independent paths) or ``"without_replacement"`` (first tokens distinct,
            later tokens from q as usual; with only m < K first tokens of positive mass, paths
            m+1..K copy path m -- see the module docstring).
        prefix: the context of the step.
    Returns:
        ``{paths: P}``, ``paths`` a tuple of K tuples of L token ids in sampling order; sums to 1.
    """
    num_drafts, length = _check_num_drafts(num_drafts), _check_length(length)
    draft_law, draft, prefix = _check_draft_law(draft_law), exact.as_model(draft), tuple(prefix)
    if draft_law == "iid":
        singles = _single_paths(draft, prefix, length)
        law = {}
        for combo in itertools.product(singles.items(), repeat=num_drafts):
            paths = tuple(path for path, _ in combo)
            law[paths] = functools.reduce(lambda a, b: a * b, (prob for _, prob in combo), _ONE)
        return law
    law: dict = defaultdict(Fraction)
    for heads, head_prob in _distinct_heads(draft(prefix), num_drafts):
        tails = [_single_paths(draft, prefix + (x,), length - 1) for x in heads]
        for combo in itertools.product(*(t.items() for t in tails)):
            paths = tuple((x,) + tail for x, (tail, _) in zip(heads, combo))
            paths += (paths[-1],) * (num_drafts - len(paths))
            prob = head_prob
            for _, tail_prob in combo:
                prob *= tail_prob
            law[paths] += prob
    return dict(law)
