"""Exact twins of the engine's dynamic draft trees (``draft_law="dynamic"``, :mod:`specresearch.engine.topk_tree`):
EAGLE-2's tree (Li et al., arXiv 2406.16858, "context-aware dynamic draft tree") and the one-hot rule read off it.

The tree of one step, from the draft q at the step's context:

1. depth 1: the root's ``num_children`` tokens of largest q are its children; a node's value is the product of q
   along its path (the draft's estimate of the chance the path is accepted);
2. depth d = 2..``depth``: the ``num_children`` nodes of depth d - 1 with the largest values are expanded, each with
   its ``num_children`` tokens of largest q;
3. the ``tree_nodes`` nodes of largest value are kept (ties: the node drafted first). A child's value is at most its
   parent's, so the kept nodes form a tree.

Children are tried in the order they were drafted (q descending). The tree reads q only, never a random number, so
the one-hot rule is lossless on it (:func:`specresearch.exact.multi._onehot_law`'s argument);
:func:`is_lossless_dynamic` checks the loop exactly.
"""

from __future__ import annotations

from fractions import Fraction

from specresearch.checks import check_int
from specresearch.exact import single as exact
from specresearch.exact.multi import _sequential_law, _without
from specresearch.exact.paths import topk_children

__all__ = ["dynamic_tree", "onehot_tree_law", "dynamic_step_law", "dynamic_distribution", "is_lossless_dynamic"]


def _check(num_children, depth, tree_nodes) -> None:
    check_int("num_children", num_children, meaning="children per expanded node (top-k)")
    check_int("depth", depth, meaning="the tree's greatest depth (gamma)")
    check_int("tree_nodes", tree_nodes, meaning="nodes kept in the tree")


def dynamic_tree(draft, num_children: int, depth: int, tree_nodes: int, prefix=(), static: bool = False) -> dict[tuple, tuple[int, ...]]:
    """The step's tree as ``{node (a token tuple): its children's tokens in the order tried}``, every kept node
    present (leaves map to ``()``); module docstring for the construction. ``static``: the tree whose shape does
    not read q's values (the first ``num_children`` nodes of a depth are expanded, the first ``tree_nodes``
    drafted are kept; EAGLE-1's kind, EAGLE-2's baseline)."""
    _check(num_children, depth, tree_nodes)
    draft, prefix = exact.as_model(draft), tuple(prefix)
    drafted: list[tuple[Fraction, tuple]] = []  # (value, node) in drafting order
    frontier = [(Fraction(1), ())]
    for _ in range(depth):
        layer = []
        for value, node in frontier:
            row = draft(prefix + node)
            layer += [(value * row[t], node + (t,)) for t in topk_children(row, num_children)]
        drafted += layer
        frontier = layer[:num_children] if static else _best(layer, num_children)
    kept = {node for _, node in (drafted[:tree_nodes] if static else _best(drafted, tree_nodes))}
    tree: dict = {(): ()}
    for _, node in drafted:
        if node in kept:
            tree[node] = ()
            tree[node[:-1]] += (node[-1],)
    return tree


def _best(nodes: list, count: int) -> list:
    """The ``count`` entries of largest value, ties to the earlier entry, in their original order."""
    ranked = sorted(range(len(nodes)), key=lambda i: (-nodes[i][0], i))[:count]
    return [nodes[i] for i in sorted(ranked)]


def onehot_tree_law(target, tree: dict, prefix=()) -> dict[tuple[int, ...], Fraction]:
    """Exact law of the one-hot rule on ``tree`` (``{node: children in order}``, as :func:`dynamic_tree`):
    ``{accepted tokens + next token: probability}``. The twin of
    :func:`specresearch.core.verify_tree.onehot_tree_verify`."""
    target, prefix = exact.as_model(target), tuple(prefix)
    law = _sequential_law(target, None, prefix, lambda u: tree.get(u, ()),
                          lambda p_row, q_row, x: (p_row[x], _without(p_row, x), q_row))
    return {seq: v for seq, v in law.items() if v}


def dynamic_step_law(target, draft, num_children: int, depth: int, tree_nodes: int, prefix=(), static: bool = False) -> dict:
    """Law of one step: the dynamic (or ``static``) tree at ``prefix``, verified by the one-hot rule."""
    return onehot_tree_law(target, dynamic_tree(draft, num_children, depth, tree_nodes, prefix, static), prefix)


def dynamic_distribution(target, draft, num_children: int, depth: int, tree_nodes: int, n_tokens: int, prefix=(),
                         static: bool = False) -> dict:
    """Exact law of the first ``n_tokens`` tokens of the loop of dynamic-tree (or ``static``) steps (Fractions)."""
    _check(num_children, depth, tree_nodes)
    check_int("n_tokens", n_tokens)
    target, draft = exact.as_model(target), exact.as_model(draft)
    return exact.loop_law(lambda pre: dynamic_step_law(target, draft, num_children, depth, tree_nodes, pre, static),
                          n_tokens, tuple(prefix))


def is_lossless_dynamic(target, draft, num_children: int, depth: int, tree_nodes: int, n_tokens: int, prefix=(),
                        static: bool = False) -> bool:
    """True iff the loop's first ``n_tokens`` tokens have exactly the target's law."""
    spec = dynamic_distribution(target, draft, num_children, depth, tree_nodes, n_tokens, prefix, static)
    return spec == exact.target_distribution(exact.as_model(target), n_tokens, tuple(prefix))
