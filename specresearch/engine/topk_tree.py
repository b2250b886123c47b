"""Dynamic draft trees in the engine (``speculative_generate(..., draft_law="dynamic", verifier="onehot")``): the
EAGLE-2 tree (Li et al., arXiv 2406.16858), drafted deterministically, scored in one target call, verified by the
one-hot rule (:func:`specresearch.core.verify_tree.onehot_tree_verify`).

One step, with K = ``num_drafts`` and depth L = ``gamma``:

1. ``draft_dynamic_tree``: the draft scores its pending block; the root's K tokens of largest q are its children.
   At each depth d = 2..L the K nodes of depth d - 1 with the largest value (the product of q along the path) are
   expanded, each with its K tokens of largest q: the draft's rows are copied K times (``repeat_rows``), each copy
   follows one expanded node (``select_rows`` reorders the copies as the beam moves) and is fed its token. Of the
   K + (L - 1) K^2 drafted nodes the ``tree_nodes`` of largest value are kept (ties: the shallower, then the
   earlier); a child's value is at most its parent's, so they form a tree. q here is the softmax of the draft's raw
   logits, at every temperature (the one-hot rule never reads it, so any choice is lossless; this one keeps
   branching at T = 0, where the sampled law is one-hot).
2. One target call scores [pending, the kept nodes] with a 4-D mask (``TreeScorer.score_tree``).
3. The one-hot rule walks the tree from the root; the target keeps the accepted path (``end_tree``). The draft
   forgets the whole tree (one copy kept, its L - 1 fed tokens rolled back) and is fed the accepted tokens and the
   next token in the following step (a feature head with the target's features along the accepted path).

``draft_law="static"`` is the baseline EAGLE-2 compares against, a tree whose shape does not depend on q (EAGLE-1's
static trees): the same top-K children, but at each depth the first K nodes drafted are expanded (the children of
the most probable nodes of the depth above, in q order) and the first ``tree_nodes`` drafted are kept (shallow
first); only the tokens come from q.

Either tree reads q only, never the verifier's random numbers, so the loop is lossless at every temperature
(exact twin and loop check: :mod:`specresearch.exact.dynamic`). ``tree_nodes`` defaults to K * L (EAGLE-2's
defaults, top-k 10, depth 6, 60 nodes, are such a pair).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specresearch.config import SamplingConfig
from specresearch.core.draws import wide
from specresearch.core.verify_tree import children_table, greedy_tree_verify, onehot_tree_verify
from specresearch.engine.steps import StepChecks, StepRecord, _accepted_block, _refeed, read_step
from specresearch.engine.timing import clock
from specresearch.engine.tree import node_tensors
from specresearch.models.protocols import FeatureReader

__all__ = ["DynamicTree", "draft_dynamic_tree", "dynamic_tree_step"]

_RAW = SamplingConfig()  # the draft's own softmax ranks the candidates


@dataclass(frozen=True)
class DynamicTree:
    """The kept nodes of each row, in drafting order (parents before children), as call rows 1..n."""

    node_tokens: torch.Tensor  # [B, n] int64 (padding nodes: token 0)
    depth: torch.Tensor  # [B, n] int64, 1 = a child of the root
    visible: torch.Tensor  # [B, 1+n, 1+n] bool: each call row sees itself and its ancestors (row 0: the root)
    children: torch.Tensor  # [B, 1+n, C] int64 call indices in the order tried (q descending), -1 padding
    parents: list[list[int]]  # per row, the parent call index of each kept node (0: the root)


def _best(values: torch.Tensor, count: int, static: bool = False) -> torch.Tensor:
    """``[B, count]`` indices of the largest ``values [B, M]`` (ties to the lower index), in increasing order;
    ``static``: the first ``count`` of positive value, whatever their values."""
    key = torch.where(values > 0, 1.0, 0.0).to(values.dtype) if static else values
    order = torch.sort(-key, dim=1, stable=True).indices[:, :count]
    return order.sort(dim=1).values


def draft_dynamic_tree(draft, pending, pending_valid, num_drafts: int, gamma: int, tree_nodes: int, device,
                       static: bool = False) -> DynamicTree:
    """Draft one dynamic tree per row (module docstring, stage 1). The draft is left with K copies per row when
    gamma > 1 (one per expanded node of depth L - 1), each having been fed L - 1 tokens. ``static``: the static
    tree of the same K, L and node count instead (``draft_law="static"``)."""
    checks = StepChecks()  # read back with the tree (_read_tree)
    logits = draft.score(pending, pending_valid)[:, -1]
    q = checks.probs(logits.to(device), _RAW, "draft model logits (drafting the tree's first depth)")
    batch = q.shape[0]
    beam_value, beam_token = q.topk(num_drafts, dim=1)  # [B, K]
    beam_value = wide(beam_value)
    values, tokens = [beam_value], [beam_token]
    parents = [torch.full_like(beam_token, -1)]  # drafted-node index of each node's parent, -1: the root
    beam_index = torch.arange(num_drafts, device=q.device)[None].expand(batch, -1)
    count = num_drafts
    if gamma > 1:
        draft.repeat_rows(num_drafts)
    rows = torch.arange(batch, device=q.device)[:, None]
    for d in range(2, gamma + 1):
        logits = draft.score(beam_token.reshape(-1, 1))[:, -1]
        q = checks.probs(logits.to(device), _RAW, f"draft model logits (drafting the tree's depth {d})")  # [B*K, V]
        child_q, child_token = q.topk(num_drafts, dim=1)
        child_value = (beam_value[:, :, None] * wide(child_q).view(batch, num_drafts, num_drafts)).view(batch, -1)
        child_token = child_token.view(batch, -1)
        values.append(child_value)
        tokens.append(child_token)
        parents.append(beam_index.repeat_interleave(num_drafts, 1))
        if d < gamma:
            chosen = _best(child_value, num_drafts, static)  # [B, K]
            draft.select_rows((rows * num_drafts + chosen // num_drafts).reshape(-1))
            beam_value, beam_token = child_value.gather(1, chosen), child_token.gather(1, chosen)
            beam_index = count + chosen
        count += child_token.shape[1]
    values, tokens, parents = torch.cat(values, 1), torch.cat(tokens, 1), torch.cat(parents, 1)
    kept = _best(values, min(tree_nodes, values.shape[1]), static)  # [B, N]
    positive = values.gather(1, kept) > 0
    return _node_form(*_read_tree(checks, kept, positive, tokens, parents), device)


def _read_tree(checks: StepChecks, kept, positive, tokens, parents) -> tuple[list, list, list, list]:
    """The drafted tree's one host read (its layout decides the target call's width), with the drafting's deferred
    logits checks: raises their error. -> ``kept``, ``positive``, ``tokens``, ``parents`` as lists of rows."""
    rows = read_step(checks, kept, positive, tokens, parents)
    n, m = kept.shape[1], tokens.shape[1]
    bounds = [0, n, 2 * n, 2 * n + m, 2 * n + 2 * m]
    return tuple([row[a:b] for row in rows] for a, b in zip(bounds, bounds[1:]))


def _node_form(kept, positive, tokens, parents, device) -> DynamicTree:
    """The call rows of the kept nodes (host lists -> tensors)."""
    rows_tokens, rows_parents = [], []
    for kept_b, positive_b, tokens_b, parents_b in zip(kept, positive, tokens, parents):
        call = {}  # drafted-node index -> call index
        row_tokens, row_parents = [], []
        for index, ok in zip(kept_b, positive_b):
            if ok:
                call[index] = len(row_tokens) + 1
                row_tokens.append(tokens_b[index])
                row_parents.append(call[parents_b[index]] if parents_b[index] >= 0 else 0)
        rows_tokens.append(row_tokens)
        rows_parents.append(row_parents)
    node_tokens, depth, visible = node_tensors(rows_tokens, rows_parents)
    width = node_tokens.shape[1]
    padded = [p + [-1] * (width - len(p)) for p in rows_parents]
    return DynamicTree(node_tokens.to(device), depth.to(device), visible, children_table(padded).to(device), rows_parents)


def dynamic_tree_step(target, draft, target_pending, draft_pending, draft_valid, *, num_drafts: int, gamma: int,
                      tree_nodes: int, sampling, randomness: dict, device, active: Sequence[bool], tick=None,
                      static: bool = False):
    """One dynamic-tree step (module docstring). ``randomness``: the verifier's ``generator=`` or ``uniforms=``
    (``[B, L+1, K]``). -> (emitted tokens per row, next target pending, next draft pending and validity, StepRecord)."""
    tick = tick or (lambda: clock(device))
    t0 = tick()
    tree = draft_dynamic_tree(draft, draft_pending, draft_valid, num_drafts, gamma, tree_nodes, device, static)
    t1 = tick()
    reads = isinstance(draft, FeatureReader)
    call_tokens = torch.cat([target_pending, tree.node_tokens], 1)
    depth = torch.cat([torch.zeros_like(tree.depth[:, :1]), tree.depth], 1)
    target.begin_tree()
    if reads:
        logits, features = target.score_tree(call_tokens, depth, tree.visible, hidden_layers=draft.feature_layers)
    else:
        logits, features = target.score_tree(call_tokens, depth, tree.visible), None
    stage, checks = "target model logits (scoring the draft tree)", StepChecks()  # read back with the result
    if sampling.greedy:  # the one-hot rule on one-hot rows, from their argmax alone (greedy_tree_verify)
        checks.check(logits, stage)
        t2 = tick()
        result = greedy_tree_verify(logits.argmax(-1).to(device), call_tokens, tree.children, gamma, validate=False)
    else:
        probs = checks.probs(logits.to(device), sampling, stage)  # [B, 1+n, V]
        t2 = tick()
        result = onehot_tree_verify(probs, call_tokens, tree.children, gamma, validate=False, **randomness)
    chosen = call_tokens.gather(1, result.path_nodes)  # [B, L]; past num_accepted: not read
    rows = read_step(checks, result.num_accepted, chosen, result.next_token)  # the step's one read of its result
    accepted = [row[0] for row in rows]
    emitted = [row[1 : 1 + n] + [row[-1]] for row, n in zip(rows, accepted)]
    batch = call_tokens.shape[0]
    on_path = torch.arange(gamma, device=device)[None] < result.num_accepted[:, None]
    kept = torch.zeros(batch, call_tokens.shape[1], dtype=torch.bool, device=device)
    kept[:, 0] = True
    target.end_tree(kept.scatter(1, torch.where(on_path, result.path_nodes, 0), True))
    if gamma > 1:
        draft.select_rows(torch.arange(batch, device=device) * num_drafts)
        draft.rollback(gamma - 1)
    if reads:
        along = torch.cat([torch.zeros_like(result.path_nodes[:, :1]), result.path_nodes], 1)  # [B, L+1]
        path_features = features.gather(1, along[:, :, None].expand(-1, -1, features.shape[-1]))
        draft_pending, draft_valid = _refeed(draft, chosen, result, path_features, max(accepted))
    else:
        draft_pending, draft_valid, _ = _accepted_block(chosen, result, max(accepted))
    scored = tuple(1 + len(p) for p in tree.parents)
    record = StepRecord(tuple(accepted), tuple(active), gamma, 1, gamma, tick() - t0, t2 - t1, t1 - t0, scored=scored)
    return emitted, result.next_token[:, None], draft_pending, draft_valid, record
