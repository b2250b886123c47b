"""The exact law of the draft paths of one step: sampled (i.i.d. or without replacement) or a deterministic
top-k tree, enumerated as fractions.
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

__all__ = ["DRAFT_LAWS", "DETERMINISTIC_LAWS", "draft_paths_law", "merged_tree", "topk_children"]


DRAFT_LAWS = ("iid", "without_replacement")  # sampled paths: K draws from q
DETERMINISTIC_LAWS = ("topk",)  # a tree chosen from q without randomness (EAGLE-2, SGLang, Medusa, lookup)


def _check_num_drafts(num_drafts) -> int:
    check_int("num_drafts", num_drafts, meaning="the number K of draft paths")
    return num_drafts


def _check_length(length) -> int:
    check_int("length", length, meaning="gamma, the path length L")
    return length


def _check_draft_law(draft_law) -> str:
    if draft_law not in DRAFT_LAWS + DETERMINISTIC_LAWS:
        raise ValueError(f"draft_law must be one of {DRAFT_LAWS + DETERMINISTIC_LAWS}, got {draft_law!r}")
    return draft_law


def merged_tree(paths) -> dict:
    """The merged tree: {node: distinct child tokens in order of first appearance} for every node."""
    children: dict = defaultdict(list)
    for path in paths:
        for d in range(len(path) + 1):
            children.setdefault(path[:d], [])
            if d < len(path) and path[d] not in children[path[:d]]:
                children[path[:d]].append(path[d])
    return dict(children)


def topk_children(row: Row, k: int) -> tuple[int, ...]:
    """The ``k`` tokens of largest q in ``row`` (q descending, ties by token id), only tokens with q > 0."""
    ranked = sorted((t for t, v in enumerate(row) if v), key=lambda t: (-row[t], t))
    return tuple(ranked[:k])


def _topk_paths(draft, prefix: tuple, num_children: int, length: int) -> tuple:
    """Every root-to-leaf path of the full top-k tree of depth ``length``, in depth-first order."""
    paths = [()]
    for _ in range(length):
        paths = [u + (t,) for u in paths for t in topk_children(draft(prefix + u), num_children)]
    return tuple(paths)


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
        draft_law: ``"iid"`` (K independent paths), ``"without_replacement"`` (first tokens distinct,
            later tokens from q as usual; with only m < K first tokens of positive mass, paths
            m+1..K copy path m -- see :mod:`specresearch.exact.multi`), or ``"topk"``: the full tree
            whose every node has the K tokens of largest q as children (:func:`topk_children`; fewer
            where fewer have q > 0), drawn with probability 1 -- its paths are the tree's K^L
            root-to-leaf paths, so ``len(paths)`` is not K.
        prefix: the context of the step.
    Returns:
        ``{paths: P}``, ``paths`` a tuple of K tuples of L token ids in sampling order; sums to 1.
    """
    num_drafts, length = _check_num_drafts(num_drafts), _check_length(length)
    draft_law, draft, prefix = _check_draft_law(draft_law), exact.as_model(draft), tuple(prefix)
    if draft_law == "topk":
        return {_topk_paths(draft, prefix, num_drafts, length): _ONE}
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
