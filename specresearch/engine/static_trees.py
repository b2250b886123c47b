"""The tree steps of the captured loop (:mod:`specresearch.engine.static`): a draft tree built on the device, scored
by the target in one call, verified by a rule that reads no host value.

* **Top-k trees** (``draft_law`` ``"dynamic"`` / ``"static"``; :mod:`specresearch.engine.topk_tree`'s trees): EAGLE-2's
  drafting with each depth's K expanded nodes fed as one tree call of the draft (each node sees its ancestors in the
  drafted region, as the growing loop's row copies see them), the N nodes of largest value kept, their call tensors
  (depth, ancestors, children) built from the drafted indices; the one-hot rule (``greedy_tree_verify`` at T = 0).
* **Sampled paths** (``draft_law`` ``"iid"`` / ``"without_replacement"``; :mod:`specresearch.engine.tree`'s K paths):
  at each depth the draft is fed the K paths' last tokens as one tree call (each sees its own path), each path's next
  token drawn from its own q; the target scores the pending token and all K L path nodes without merging equal
  prefixes (an equal prefix is scored twice and gives the same rows: the growing loop merges them to save the
  width), the paths' rows are gathered back and a multi-draft rule decides (``core.verify_multi``: RRS, RRS without
  replacement, K-SEQ, traversal, one-hot, all of whose forms read no host value; GBV's does, and has no captured
  step).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specresearch.config import SamplingConfig
from specresearch.core.draft_paths import first_tokens_without_replacement
from specresearch.core.draws import inverse_cdf, wide
from specresearch.core.verify_multi import MULTI_VERIFIERS
from specresearch.core.verify_tree import greedy_tree_verify, onehot_tree_verify
from specresearch.engine.steps import StepChecks
from specresearch.engine.topk_tree import _best

__all__ = ["CAPTURED_TREE_RULES", "StaticTree", "draft_tree", "verify_tree", "tree_uniforms"]

_RAW = SamplingConfig()  # a top-k tree ranks its candidates by the draft's own softmax (engine.topk_tree)
CAPTURED_TREE_RULES = ("rrs", "rrs_without_replacement", "kseq", "traversal", "onehot")  # rules of sampled paths


@dataclass(frozen=True)
class StaticTree:
    """One step's tree as the target's call takes it, and what its rule needs."""

    call_tokens: torch.Tensor  # [B, 1+N] the pending token, then the nodes
    depth: torch.Tensor  # [B, 1+N] 0 for the pending token
    visible: torch.Tensor  # [B, 1+N, 1+N] each call row's ancestors and itself
    children: torch.Tensor | None = None  # [B, 1+N, K] a top-k tree's children, in the order tried; -1 padding
    along: torch.Tensor | None = None  # [B, K, L+1] sampled paths: path k's call rows (0 the pending token)
    draft_tokens: torch.Tensor | None = None  # [B, K, L]
    draft_probs: torch.Tensor | None = None  # [B, K, L, V]


def tree_uniforms(plan) -> int:
    """Uniforms a tree step reads per row: the paths' draws (sampled paths) and the rule's ``[L+1, K]``."""
    drafted = plan.num_drafts * plan.gamma if plan.law in ("iid", "without_replacement") else 0
    return drafted + (plan.gamma + 1) * plan.num_drafts


def draft_tree(run, logits: torch.Tensor, carry, checks: StepChecks) -> StaticTree:
    """The step's tree from the draft's logits ``[B, V]`` (and prediction ``[B, H]``, or None) at the pending token."""
    if run.plan.law in ("dynamic", "static"):
        drafted = _draft_topk(run, logits, carry, checks)
        call_tokens, depth, visible, children = _node_tensors(drafted, run.state.pending, run.plan.gamma,
                                                              run.plan.num_drafts)
        return StaticTree(call_tokens, depth, visible, children=children)
    return _draft_paths(run, logits, carry, checks)


def verify_tree(run, tree: StaticTree, logits: torch.Tensor, checks: StepChecks):
    """The rule on the target's logits ``[B, 1+N, V]`` -> (accepted ``[B]``, the kept path's call rows ``[B, L+1]``
    (0 the pending token first), next token ``[B]``)."""
    plan, s = run.plan, run.state
    K, L, batch = plan.num_drafts, plan.gamma, logits.shape[0]
    stage = "target model logits (scoring the draft tree)"
    rule = s.uniforms[:, s.uniforms.shape[1] - (L + 1) * K:].view(batch, L + 1, K)
    if tree.children is not None:  # a top-k tree: the one-hot rule on its nodes
        if run.sampling.greedy:
            checks.check(logits, stage)
            result = greedy_tree_verify(logits.argmax(-1), tree.call_tokens, tree.children, L, validate=False)
        else:
            result = onehot_tree_verify(checks.probs(logits, run.sampling, stage), tree.call_tokens, tree.children, L,
                                        validate=False, uniforms=rule)
        along = torch.cat([torch.zeros_like(result.path_nodes[:, :1]), result.path_nodes], 1)
        return result.num_accepted, along, result.next_token
    probs = checks.probs(logits, run.sampling, stage)  # [B, 1+N, V]
    rows = probs.gather(1, tree.along.reshape(batch, -1, 1).expand(-1, -1, probs.shape[-1]))
    target_probs = rows.view(batch, K, L + 1, -1)
    result = MULTI_VERIFIERS[plan.verifier](target_probs, tree.draft_probs, tree.draft_tokens, uniforms=rule,
                                            validate=False)
    along = tree.along[torch.arange(batch, device=probs.device), result.path_index]  # [B, L+1]
    return result.num_accepted, along, result.next_token


def _draft_paths(run, logits: torch.Tensor, carry, checks: StepChecks) -> StaticTree:
    """K paths of depth L (module docstring): the draft fed each depth's K tokens as one tree call."""
    plan, s, sampling = run.plan, run.state, run.sampling
    K, L = plan.num_drafts, plan.gamma
    q = checks.probs(logits, sampling, "draft model logits (drafting token 1)")  # [B, V]
    batch = q.shape[0]
    u = s.uniforms
    if plan.law == "without_replacement" and not sampling.greedy:
        tokens, source = first_tokens_without_replacement(q, u[:, :K])
    else:
        tokens, source = _pick_each(run, q[:, None].expand(-1, K, -1), u[:, :K]), None
    drafted, probs = [tokens], [q[:, None].expand(-1, K, -1)]
    inputs = None if carry is None else carry[:, None].expand(-1, K, -1)
    own = torch.eye(K, dtype=torch.bool, device=q.device)
    for d in range(2, L + 1):
        group = d - 2
        depth = torch.full((batch, K), group, dtype=torch.long, device=q.device)
        visible = own.repeat(1, group + 1)[None].expand(batch, -1, -1)  # path k's earlier slots and itself
        out, hidden = run._draft_call(tokens, inputs, offset=group * K, depth=depth, visible=visible)
        q = checks.probs(out, sampling, f"draft model logits (drafting token {d})")  # [B, K, V]
        tokens = _pick_each(run, q, u[:, (d - 1) * K : d * K])
        if source is not None:  # a copy path (the first tokens ran out of mass) repeats its source path
            tokens = tokens.gather(1, source)
        drafted.append(tokens)
        probs.append(q)
        inputs = hidden
    draft_tokens, draft_probs = torch.stack(drafted, 2), torch.stack(probs, 2)  # [B, K, L], [B, K, L, V]
    index = torch.arange(K * L, device=q.device).view(L, K).t()  # [K, L]: node (k, d) sits at call row 1 + d K + k
    along = torch.cat([torch.zeros(K, 1, dtype=torch.long, device=q.device), 1 + index], 1)[None].expand(batch, -1, -1)
    visible = torch.eye(1 + K * L, dtype=torch.bool, device=q.device)
    for k in range(K):  # each node sees the pending token and its path's nodes before it
        path = along[0, k]
        visible[path[:, None], path[None, :]] = torch.ones(L + 1, L + 1, dtype=torch.bool, device=q.device).tril()
    depth = torch.cat([torch.zeros(1, dtype=torch.long, device=q.device),
                       torch.arange(1, L + 1, device=q.device).repeat_interleave(K)])
    call_tokens = torch.cat([s.pending[:, None], draft_tokens.transpose(1, 2).reshape(batch, -1)], 1)
    return StaticTree(call_tokens, depth[None].expand(batch, -1), visible[None].expand(batch, -1, -1),
                      along=along, draft_tokens=draft_tokens, draft_probs=draft_probs)


def _pick_each(run, probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per (row, path) of ``probs [B, K, V]`` from ``u [B, K]`` (the argmax when greedy) -> ``[B, K]``."""
    if run.sampling.greedy:
        return probs.argmax(-1)
    batch, K, vocab = probs.shape
    return inverse_cdf(probs.reshape(batch * K, vocab), u.reshape(-1)).view(batch, K)


@dataclass(frozen=True)
class _Drafted:
    """The drafted nodes of a tree step, in drafting order (as ``engine.topk_tree.draft_dynamic_tree`` orders them)."""

    kept: torch.Tensor  # [B, N] drafted indices of the kept nodes, increasing
    tokens: torch.Tensor  # [B, M] every drafted node's token
    parents: torch.Tensor  # [B, M] its parent's drafted index, -1: the root
    depth: torch.Tensor  # [M] its depth (1: a child of the root)


def _draft_topk(run, logits: torch.Tensor, carry, checks: StepChecks) -> _Drafted:
    """EAGLE-2's drafting (``engine.topk_tree.draft_dynamic_tree``) with each depth's K expanded nodes fed as one tree
    call: node j of depth d - 1 sees its ancestors (the region's earlier groups) and itself."""
    plan = run.plan
    K, L = plan.num_drafts, plan.gamma
    q = checks.probs(logits, _RAW, "draft model logits (drafting the tree's first depth)")
    batch = q.shape[0]
    beam_value, beam_token = q.topk(K, dim=1)  # [B, K]
    beam_value = wide(beam_value)
    values, tokens, parents = [beam_value], [beam_token], [torch.full_like(beam_token, -1)]
    beam_index = torch.arange(K, device=q.device)[None].expand(batch, -1)
    inputs = None if carry is None else carry[:, None].expand(-1, K, -1)
    region = max(L - 1, 1) * K
    # [B, region, region] 0 / 1: which drafted slots each one sees (int, not bool: inductor's CPU code for a bool
    # gather inside a masked update does not compile in torch 2.13)
    seen = torch.eye(region, dtype=torch.long, device=q.device)[None].repeat(batch, 1, 1)
    count = K
    for d in range(2, L + 1):
        group = d - 2
        rows = slice(group * K, (group + 1) * K)
        depth = torch.full((batch, K), group, dtype=torch.long, device=q.device)
        out, hidden = run._draft_call(beam_token, inputs, offset=group * K, depth=depth,
                                      visible=seen[:, rows, : (group + 1) * K] > 0)
        q = checks.probs(out, _RAW, f"draft model logits (drafting the tree's depth {d})")  # [B, K, V]
        child_q, child_token = q.topk(K, dim=-1)  # [B, K, K]
        child_value = (beam_value[:, :, None] * wide(child_q)).reshape(batch, -1)
        child_token = child_token.reshape(batch, -1)
        values.append(child_value)
        tokens.append(child_token)
        parents.append(beam_index.repeat_interleave(K, 1))
        if d < L:
            chosen = _best(child_value, K, plan.law == "static")  # [B, K]
            parent = chosen // K  # the beam node (of this group) each chosen node descends from
            beam_value, beam_token = child_value.gather(1, chosen), child_token.gather(1, chosen)
            beam_index = count + chosen
            inputs = None if hidden is None else hidden.gather(1, parent[:, :, None].expand(-1, -1, hidden.shape[-1]))
            lineage = seen[:, rows].gather(1, parent[:, :, None].expand(-1, -1, region))  # [B, K, region]
            seen[:, (group + 1) * K : (group + 2) * K] |= lineage
        count += K * K
    values, tokens, parents = torch.cat(values, 1), torch.cat(tokens, 1), torch.cat(parents, 1)
    # [1] * K, then each depth 2..L K * K times: made on the device (a tensor from a host list inside a step is a copy
    # a CUDA graph cannot capture)
    depth = torch.cat([torch.ones(K, dtype=torch.long, device=q.device),
                       torch.arange(2, L + 1, device=q.device)[:, None].expand(-1, K * K).reshape(-1)])
    kept = _best(values, min(plan.tree_nodes, values.shape[1]), plan.law == "static")  # [B, N]
    return _Drafted(kept, tokens, parents, depth)


def _node_tensors(drafted: _Drafted, pending: torch.Tensor, length: int, num_drafts: int):
    """The target call of a drafted tree, on the device: (call tokens ``[B, 1+N]`` (the pending token first), depth
    ``[B, 1+N]``, visible ``[B, 1+N, 1+N]`` (ancestors and itself), children ``[B, 1+N, K]`` (call indices in
    drafting order, -1 padding))."""
    kept = drafted.kept
    batch, nodes = kept.shape
    device = kept.device
    parent = drafted.parents.gather(1, kept)  # [B, N] drafted index, -1: the root
    call_parent = torch.where(parent >= 0, torch.searchsorted(kept, parent.clamp(min=0)) + 1, 0)  # a kept node's
    call_parent = torch.cat([torch.zeros_like(call_parent[:, :1]), call_parent], 1)  # [B, 1+N]; the root's: itself
    call_tokens = torch.cat([pending[:, None], drafted.tokens.gather(1, kept)], 1)
    depth = torch.cat([torch.zeros_like(kept[:, :1]), drafted.depth[kept]], 1)
    eye = torch.eye(nodes + 1, dtype=torch.bool, device=device)[None].expand(batch, -1, -1)
    visible = eye
    for _ in range(length):  # each row: itself and its parent's row (a path has at most L nodes below the root)
        visible = eye | visible.gather(1, call_parent[:, :, None].expand(-1, -1, nodes + 1))
    index = torch.arange(1, nodes + 1, device=device)
    siblings = (call_parent[:, 1:, None] == call_parent[:, None, 1:]) & (index[None, None] < index[None, :, None])
    rank = siblings.sum(-1)  # [B, N]: earlier siblings (children are tried in drafting order)
    children = torch.full((batch, (nodes + 1) * num_drafts), -1, dtype=torch.long, device=device)
    children.scatter_(1, call_parent[:, 1:] * num_drafts + rank, index[None].expand(batch, -1))
    return call_tokens, depth, visible, children.view(batch, nodes + 1, num_drafts)


