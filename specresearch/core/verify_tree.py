"""Verification of a draft tree given as nodes (a token and a parent each), for trees whose paths differ in length:
the deterministic top-k trees of EAGLE-2 (Li et al., arXiv 2406.16858) that the engine drafts with
``draft_law="dynamic"`` (:mod:`specresearch.engine.topk_tree`).

The rule is the one-hot rule of :func:`specresearch.core.verify_multi.onehot_verify`, read off the nodes instead of
K equal-length paths: at the accepted node the children are tried in order, child x accepted iff ``eta < p(x)``
(p the target's row there, renormalised after each rejection); a rejected x is zeroed out of p; when every child is
rejected, or the node is a leaf, one token is sampled from what is left. It never reads the draft's probabilities,
so it is lossless for any tree chosen without the verifier's random numbers. Exact twin:
:func:`specresearch.exact.dynamic.onehot_tree_law`.

A tree of B rows is given as the target call's rows: index 0 is the pending token (the root), 1..n the nodes.
``children [B, 1+n, C]`` lists each call row's children by call index in the order they are tried, -1 padding.

At T = 0 (p one-hot at its first argmax) the rule accepts, at each node, the first child whose token is the target's
argmax there, and emits the argmax at the last accepted node: :func:`greedy_tree_verify` gives that without walking
the tree depth by depth (a few dozen tensor calls a step whatever the depth, against ~20 a depth; on a GPU each costs
the host microseconds).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specresearch.core.draft_paths import draw_multi_uniforms
from specresearch.core.draws import sample_from_weights

__all__ = ["TreeVerifyResult", "children_table", "greedy_tree_verify", "onehot_tree_verify"]


@dataclass(frozen=True)
class TreeVerifyResult:
    """Outcome of verifying one tree per row."""

    num_accepted: torch.Tensor  # [B] int64 in 0..L
    path_nodes: torch.Tensor  # [B, L] call indices of the accepted nodes, root excluded; 0 past num_accepted
    next_token: torch.Tensor  # [B] int64: the residual sample, or the bonus token after an accepted leaf


def children_table(parents: Sequence[Sequence[int]]) -> torch.Tensor:
    """``children [B, 1+n, C]`` from each row's parent call indices (``parents[b][i]``: the parent of call row
    i + 1, 0 the root, -1 a padding node). Children keep the order of the nodes; C is the most any node has."""
    width = max((len(p) for p in parents), default=0)
    lists = [[[] for _ in range(width + 1)] for _ in parents]
    for b, row in enumerate(parents):
        for i, parent in enumerate(row, start=1):
            if parent >= 0:
                lists[b][parent].append(i)
    most = max(max((len(c) for row in lists for c in row), default=0), 1)
    padded = [[kids + [-1] * (most - len(kids)) for kids in row] for row in lists]
    return torch.tensor(padded, dtype=torch.long).reshape(len(parents), width + 1, most)  # one call, not one a node


def onehot_tree_verify(target_probs, call_tokens, children, length: int, generator=None, *, uniforms=None,
                       validate=True) -> TreeVerifyResult:
    """The one-hot rule on a tree of nodes (module docstring).

    Args:
        target_probs: ``[B, 1+n, V]`` the target's row at every call row (root first).
        call_tokens: ``[B, 1+n]`` int64, the call's tokens (index 0, the pending token, is not read).
        children: ``[B, 1+n, C]`` int64 (:func:`children_table`).
        length: L, the tree's greatest depth (a path accepts at most L tokens).
        generator: ``torch.Generator`` for the uniforms (default RNG when it and ``uniforms`` are None).
        uniforms: ``[B, L+1, K]`` in [0, 1) with K >= C (``draw_multi_uniforms``): ``[b, d, c]`` decides the c-th
            child tried at depth d, ``[b, L, 0]`` the sampled token.
        validate: check shapes and values; False skips the checks.
    Returns:
        ``TreeVerifyResult``.
    """
    batch, width, vocab = target_probs.shape
    if validate:
        _validate(target_probs, call_tokens, children, length, uniforms)
    if uniforms is None:
        uniforms = draw_multi_uniforms(batch, children.shape[2], length, generator, device=target_probs.device)
    below_one = 1.0 - torch.finfo(target_probs.dtype).eps / 2
    eta = uniforms.to(target_probs.device, target_probs.dtype).clamp(max=below_one)
    rows = torch.arange(batch, device=target_probs.device)
    node = torch.zeros_like(rows)  # the accepted node (call index)
    searching = torch.ones(batch, dtype=torch.bool, device=rows.device)
    num_accepted = torch.zeros_like(rows)
    path_nodes = torch.zeros(batch, length, dtype=torch.long, device=rows.device)
    weights = target_probs.new_zeros(batch, vocab)  # [B, V]: what the stopped rows sample from
    tried = children.shape[2]
    earlier = torch.ones(tried, tried, dtype=torch.bool, device=rows.device).tril(-1)  # [c, j]: j before c
    for d in range(length + 1):
        # All of a node's children at once (a few tensor calls a depth, whatever K: on a GPU each call costs the host):
        # child c is reached only when the children before it were rejected, each zeroed out of p, so it is accepted
        # iff eta_c * (mass of p - their mass) < p(x_c); the first such child is the accepted one.
        probs, kids = target_probs[rows, node], children[rows, node]  # [B, V], [B, C]
        tokens = call_tokens.gather(1, kids.clamp(min=0))  # [B, C]
        repeated = ((tokens[:, :, None] == tokens[:, None, :]) & earlier).any(2)  # a sibling's token again: p(x) is 0
        valid = (kids >= 0) & ~repeated
        p_kids = probs.gather(1, tokens) * valid
        rejected_before = p_kids.cumsum(1) - p_kids
        passed = valid & (eta[:, min(d, length), :tried] * (probs.sum(-1, keepdim=True) - rejected_before) < p_kids)
        accepted = searching & passed.any(1)
        choice = kids.gather(1, passed.int().argmax(1, keepdim=True)).squeeze(1)  # the first child that passed
        # a row that stops here samples p with every child zeroed (all were tried and rejected; a leaf has none)
        zeroed = probs.new_zeros(batch, vocab).scatter_add_(1, tokens, valid.to(probs.dtype)) > 0
        weights = torch.where((searching & ~accepted)[:, None], probs.masked_fill(zeroed, 0.0), weights)
        searching = accepted
        if d < length:
            path_nodes[:, d] = torch.where(searching, choice, 0)
        num_accepted += searching.long()
        node = torch.where(searching, choice, node)
    next_token = sample_from_weights(weights, eta[:, length, 0])
    return TreeVerifyResult(num_accepted, path_nodes, next_token)


def greedy_tree_verify(target_tokens, call_tokens, children, length: int, *, validate=True) -> TreeVerifyResult:
    """:func:`onehot_tree_verify` when the target's rows are one-hot (T = 0), from their argmax tokens alone.

    A node is accepted iff its token is the argmax at its parent, no earlier sibling (in ``children``' order) has that
    token, and its parent is accepted; ``next_token`` is the argmax at the deepest accepted node. The same result as
    the one-hot rule on the one-hot rows, whatever its uniforms (none are drawn here). Nodes must come after their
    parents (call index order), as :func:`children_table`'s callers give them.

    Args:
        target_tokens: ``[B, 1+n]`` int64, the target's argmax at every call row (root first).
        call_tokens: ``[B, 1+n]`` int64, the call's tokens (index 0, the pending token, is not read).
        children: ``[B, 1+n, C]`` int64 (:func:`children_table`).
        length: L, the tree's greatest depth.
        validate: check shapes and values; False skips the checks.
    """
    batch, width = call_tokens.shape
    tried = children.shape[2]
    if validate:
        _validate_greedy(target_tokens, call_tokens, children, length)
    device = call_tokens.device
    kids = children.reshape(batch, -1)  # [B, (1+n) C]
    listed = kids >= 0
    slot = torch.where(listed, kids, width)  # unlisted entries land in a column that is dropped
    owner = torch.arange(width, device=device).repeat_interleave(tried).expand(batch, -1)
    rank = torch.arange(tried, device=device).repeat(width).expand(batch, -1)
    parent = torch.full((batch, width + 1), -1, dtype=torch.long, device=device).scatter_(1, slot, owner)[:, :width]
    order = torch.zeros(batch, width + 1, dtype=torch.long, device=device).scatter_(1, slot, rank)[:, :width]
    match = (parent >= 0) & (call_tokens == target_tokens.gather(1, parent.clamp(min=0)))
    # a sibling tried earlier with the same token is the one the one-hot rule accepts (this one then has p = 0)
    sibling = parent[:, :, None] == parent[:, None, :]  # [B, i, j]
    shadowed = (sibling & match[:, None, :] & (order[:, None, :] < order[:, :, None])).any(2)
    accepted = match & ~shadowed
    accepted[:, 0] = True  # the root
    up = parent.clamp(min=0)
    for _ in range(length - 1):  # accepted with every ancestor: one gather a level (a path has at most L nodes)
        accepted = accepted & accepted.gather(1, up)
    num_accepted = accepted[:, 1:].sum(1)
    index = torch.arange(width, device=device).expand(batch, -1)
    path = torch.where(accepted, index, width).sort(1).values[:, 1 : length + 1]  # parents first: the path in order
    path_nodes = torch.where(path < width, path, 0)
    deepest = path_nodes.gather(1, (num_accepted - 1).clamp(min=0)[:, None]).squeeze(1)  # 0 (the root) if none
    next_token = target_tokens.gather(1, deepest[:, None]).squeeze(1)
    return TreeVerifyResult(num_accepted, path_nodes, next_token)


def _validate_greedy(target_tokens, call_tokens, children, length) -> None:
    if call_tokens.dim() != 2 or tuple(target_tokens.shape) != tuple(call_tokens.shape):
        raise ValueError(f"target_tokens and call_tokens must both be [B, 1+n], got {tuple(target_tokens.shape)} and "
                         f"{tuple(call_tokens.shape)}")
    batch, width = call_tokens.shape
    if children.dim() != 3 or tuple(children.shape[:2]) != (batch, width):
        raise ValueError(f"children must be [B, 1+n, C] = [{batch}, {width}, C], got {tuple(children.shape)}")
    if isinstance(length, bool) or not isinstance(length, int) or length < 1:
        raise ValueError(f"length must be an int >= 1, got {length!r}")
    node = torch.arange(width, device=children.device)[None, :, None]
    if bool(((children < -1) | (children >= width) | ((children >= 0) & (children <= node))).any()):
        raise ValueError("children must hold call indices in [0, 1+n) or -1, each after its parent")


def _validate(target_probs, call_tokens, children, length, uniforms) -> None:
    if target_probs.dim() != 3 or not target_probs.is_floating_point():
        raise ValueError(f"target_probs must be a float [B, 1+n, V] tensor, got {tuple(target_probs.shape)}")
    batch, width, vocab = target_probs.shape
    if tuple(call_tokens.shape) != (batch, width) or children.dim() != 3 or tuple(children.shape[:2]) != (batch, width):
        raise ValueError(f"call_tokens must be [B, 1+n] = {(batch, width)} and children [B, 1+n, C]; got "
                         f"{tuple(call_tokens.shape)} and {tuple(children.shape)}")
    if isinstance(length, bool) or not isinstance(length, int) or length < 1:
        raise ValueError(f"length must be an int >= 1, got {length!r}")
    if bool(((children < -1) | (children >= width)).any()):
        raise ValueError("children must hold call indices in [0, 1+n) or -1")
    if bool(((call_tokens < 0) | (call_tokens >= vocab)).any()):
        raise ValueError(f"call_tokens must be token ids in [0, {vocab})")
    if bool((target_probs < 0).any()) or not torch.allclose(target_probs.sum(-1), torch.ones((), dtype=target_probs.dtype),
                                                            atol=1e-4):
        raise ValueError("target_probs rows must be probability distributions")
    if uniforms is not None and (uniforms.dim() != 3 or tuple(uniforms.shape[:2]) != (batch, length + 1)
                                 or uniforms.shape[2] < children.shape[2]):
        raise ValueError(f"uniforms must be [B, L+1, K >= C] = [{batch}, {length + 1}, >= {children.shape[2]}], got "
                         f"{tuple(uniforms.shape)}")
