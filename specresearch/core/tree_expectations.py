"""Expected accepted tokens of the sequential tree rules on a drafted tree, exactly (no sampling): the counterfactual
of every such rule on the same tree, as ``verify.expected_num_accepted`` is for chains.

The rules that try a node's candidates in turn (RRS, RRS without replacement, the one-hot rule) make, given the
drafted tree and the target's rows, a deterministic sequence of acceptance probabilities at each node: trying
candidate i after candidates 1..i-1 were rejected accepts with a_i, computed from the rows as updated by those
rejections (the verifiers' own update rules, ``core.verify_multi``). So with E(u) the expected accepted tokens below
node u,

    E(u) = sum_i prod_{j<i} (1 - a_j) a_i (1 + E(u x_i)),   E(leaf) = 0,

and E(root) is the rule's E[num_accepted | tree].

Traversal verification reads the tree bottom-up, but it too is a fixed sequence of trials given the tree: it visits
the nodes in depth-first post-order, accepts the path to the visited node a with its current weight w_a, and on a
rejection deletes a and updates the parent's weight and rows (``exact.multi``'s twin states the update). Which node
comes next and with what weight depends only on the rejections before it, so with v_1, v_2, ... the nodes visited
while everything is rejected (the root last, accepted surely),

    E = sum_i prod_{j<i} (1 - w_{v_j}) w_{v_i} depth(v_i).

GBV selects one path X* from the drafts alone (no randomness) and block-verifies it against q^G, the law of X*
under i.i.d. paths, so its expectation is block verification's closed form (``verify.expected_num_accepted``) on X*
with the full q^G rows (``multi_weights.gbv_draft_rows``).

``"token"`` and ``"block"`` are the single-draft baselines on the same draws: token or block verification of the
first path alone, which is what a one-draft run would have verified at that step (the first path is a draft of q).

K-SEQ (L = 1) tries the K first tokens in turn, each accepted with min(1, p(x_i) / (rho* q(x_i))) against the same
rows, so E = 1 - prod_i (1 - min(1, p(x_i) / (rho* q(x_i)))) with rho* of ``multi_weights.kseq_rho``.

Exact in the rows' floating point; checked against the rational twins' laws (``exact.multi.verify_multi_exact``) in
``tests/test_tree_expectations.py``.
"""

from __future__ import annotations

import torch

from specresearch.core.multi_weights import gbv_draft_rows, gbv_select, kseq_rho
from specresearch.core.verify import expected_num_accepted

__all__ = ["TREE_EXPECTATIONS", "expected_accepted_tree"]

TREE_EXPECTATIONS = ("rrs", "rrs_without_replacement", "onehot", "traversal", "gbv", "kseq", "token", "block")


def expected_accepted_tree(target_probs, draft_probs, draft_tokens, method: str) -> torch.Tensor:
    """E[num_accepted | the drafted paths] of ``method`` (module docstring), per row.

    Args:
        target_probs ``[B, K, L+1, V]``, draft_probs ``[B, K, L, V]``, draft_tokens ``[B, K, L]``: as the multi-draft
            verifiers take them (``core.verify_multi``).
        method: one of ``TREE_EXPECTATIONS``.
    Returns:
        ``[B]`` in the dtype of ``target_probs`` (float64 recommended), each in 0..L.
    """
    if method not in TREE_EXPECTATIONS:
        raise ValueError(f"method must be one of {TREE_EXPECTATIONS}, got {method!r}")
    if method == "gbv":
        return _gbv_expected(target_probs, draft_probs, draft_tokens)
    if method == "kseq":
        return _kseq_expected(target_probs, draft_probs, draft_tokens)
    if method in ("token", "block"):  # the first path alone
        return expected_num_accepted(target_probs[:, 0], draft_probs[:, 0], draft_tokens[:, 0], method,
                                     validate=False).to(target_probs.dtype)
    batch, num_drafts, length = draft_tokens.shape
    tokens = draft_tokens.tolist()
    out = []
    for b in range(batch):
        if method == "traversal":
            out.append(_traversal_expected(target_probs[b], draft_probs[b], tokens[b]))
        else:
            out.append(_expected(target_probs[b], draft_probs[b], tokens[b], list(range(num_drafts)), 0, method))
    return torch.tensor(out, dtype=target_probs.dtype, device=target_probs.device)


def _expected(p_rows, q_rows, paths: list[list[int]], alive: list[int], depth: int, method: str) -> float:
    """E below the node shared by the paths ``alive`` at ``depth`` (their first ``depth`` tokens agree)."""
    if depth == len(paths[0]):
        return 0.0
    first = alive[0]
    p = p_rows[first, depth].double().clone()  # the target's row at the node
    q = q_rows[first, depth].double().clone() if method != "onehot" else None
    candidates = [k for k in alive]
    if method != "rrs":  # distinct children, in order of first appearance
        seen, distinct = set(), []
        for k in candidates:
            if paths[k][depth] not in seen:
                seen.add(paths[k][depth])
                distinct.append(k)
        candidates = distinct
    reach, total = 1.0, 0.0
    for k in candidates:
        x = paths[k][depth]
        p_mass = float(p.sum())
        if method == "onehot":
            accept = float(p[x]) / p_mass if p_mass > 0 else 0.0
        else:
            q_mass = float(q.sum())
            q_x = float(q[x]) / q_mass if q_mass > 0 else 0.0
            accept = min(1.0, (float(p[x]) / p_mass) / q_x) if q_x > 0 and p_mass > 0 else 0.0
        if accept > 0:
            child = [j for j in alive if paths[j][depth] == x]
            total += reach * accept * (1.0 + _expected(p_rows, q_rows, paths, child, depth + 1, method))
        reach *= 1.0 - accept
        if reach <= 0:
            break
        if method == "onehot":  # rejected: x leaves p
            p[x] = 0.0
        else:  # p <- max(p - q, 0) on the normalised rows; a zero residual keeps p (as the verifiers do)
            residual = (p / p_mass - q / q.sum()).clamp(min=0)
            if float(residual.sum()) > 0:
                p = residual
            if method == "rrs_without_replacement":  # and x leaves q
                q[x] = 0.0
    return total


def _traversal_expected(p_rows, q_rows, paths: list[list[int]]) -> float:
    """Traversal verification's E[num_accepted | the paths] (module docstring): its trials while every visit is
    rejected, with the verifier's weights and updates (``exact.multi._traversal_law`` in floating point)."""
    length = len(paths[0])
    children: dict[tuple, list[int]] = {}
    path_of: dict[tuple, int] = {}
    for k, path in enumerate(paths):  # the merged tree: distinct children in order of first appearance
        for depth in range(length + 1):
            node = tuple(path[:depth])
            path_of.setdefault(node, k)
            kids = children.setdefault(node, [])
            if depth < length and path[depth] not in kids:
                kids.append(path[depth])
    p = {u: p_rows[path_of[u], len(u)].double().clone() for u in children}
    q = {u: q_rows[path_of[u], len(u)].double().clone() for u in children if children[u]}
    weights = {(): 1.0}

    def reweigh(parent: tuple) -> None:
        for x in children[parent]:
            q_x = float(q[parent][x])
            weights[parent + (x,)] = min(1.0, weights[parent] * float(p[parent][x]) / q_x) if q_x > 0 else 0.0
            reweigh(parent + (x,))

    def first_leaf(node: tuple) -> tuple:
        while children[node]:
            node = node + (children[node][0],)
        return node

    reweigh(())
    node, reach, total = first_leaf(()), 1.0, 0.0
    while reach > 0:
        accept = 1.0 if node == () else weights[node]
        total += reach * accept * len(node)
        reach *= 1.0 - accept
        if node == () or reach <= 0:
            break
        parent, x = node[:-1], node[-1]
        w = weights[parent]
        residual = (w * p[parent] - q[parent]).clamp(min=0)
        z = float(residual.sum())
        weights[parent] = z / (z + 1.0 - w) if z > 0 else 0.0
        if z > 0:
            p[parent] = residual / z
        q_row = q[parent].clone()
        q_row[x] = 0.0
        mass = float(q_row.sum())
        q[parent] = q_row / mass if mass > 0 else q_row
        children[parent].remove(x)
        reweigh(parent)
        node = first_leaf(parent)
    return total


def _gbv_expected(target_probs, draft_probs, draft_tokens) -> torch.Tensor:
    """GBV's E[num_accepted | the paths] (module docstring), ``[B]``."""
    rows = torch.arange(draft_tokens.shape[0], device=draft_tokens.device)
    chosen = gbv_select(target_probs, draft_probs, draft_tokens)
    target, draft, tokens = target_probs[rows, chosen], draft_probs[rows, chosen], draft_tokens[rows, chosen]
    rows_g = gbv_draft_rows(target, draft, tokens, draft_tokens.shape[1])  # [B, L, V], every row in full
    return expected_num_accepted(target, rows_g, tokens, "block", validate=False).to(target_probs.dtype)


def _kseq_expected(target_probs, draft_probs, draft_tokens) -> torch.Tensor:
    """K-SEQ's E[num_accepted | the first tokens] (module docstring), ``[B]``; L must be 1."""
    if draft_tokens.shape[2] != 1:
        raise ValueError(f"K-SEQ verifies one token per draft (L = 1); got paths of {draft_tokens.shape[2]} tokens")
    target, draft = target_probs[:, 0, 0].double(), draft_probs[:, 0, 0].double()  # [B, V]: the shared root rows
    rho = kseq_rho(target, draft, draft_tokens.shape[1])  # [B]
    tokens = draft_tokens[:, :, 0]
    p_x, q_x = target.gather(1, tokens), draft.gather(1, tokens)  # [B, K]
    accept = torch.where(q_x > 0, (p_x / (rho[:, None] * q_x)).clamp(max=1), torch.zeros_like(p_x))
    return (1 - (1 - accept).prod(-1)).to(target_probs.dtype)
