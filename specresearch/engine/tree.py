"""Draft trees in the generation engine: K draft paths per row, scored by the target in ONE call, verified by a
multi-draft rule (:data:`specresearch.core.verify_multi.MULTI_VERIFIERS`).

One tree step, as small stages:

1. ``_draft_paths``: the draft's rows are copied K times (``RowExpander.repeat_rows``) and each copy drafts one
   path of gamma tokens, i.i.d. from q or with the K first tokens drawn without replacement
   (``draft_law``, as :func:`specresearch.core.draft_paths.sample_draft_paths`): ``draft_tokens [B, K, L]`` and
   the rows they were drawn from, ``draft_probs [B, K, L, V]``.
2. ``_tree``: equal prefixes merge into one node, so a row's tree holds each distinct prefix once.
3. ``_score_tree``: one target call on [pending, tree nodes] (``TreeScorer.score_tree``: a 4-D attention mask,
   each node sees the cached prefix and its own ancestors, position = prefix length + depth); the node rows are
   gathered back along the paths, ``target_probs [B, K, L+1, V]``.
4. the verifier returns (num_accepted, path_index, next_token); the target keeps exactly the accepted path in its
   cache (``TreeScorer.end_tree``) and the draft keeps the row of the accepted path (``select_rows``), then
   forgets what that path drafted beyond the accepted tokens, as in a chain step.

Losslessness is the verifier's, under the draft law it was derived for (``docs/multidraft.md``; the engine adds no
randomness of its own: one generator, or one per row, drives drafting and verification as in the chain engine).
At temperature 0 every path is the draft's greedy chain and every rule reduces to greedy verification.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specresearch.checks import check_int
from specresearch.core.draft_paths import DRAFT_LAWS, draw_multi_uniforms, first_tokens_without_replacement
from specresearch.core.draws import uniforms
from specresearch.core.tree_expectations import TREE_EXPECTATIONS, expected_accepted_tree
from specresearch.core.verify_multi import MULTI_VERIFIERS
from specresearch.engine.steps import StepRecord, _draft_pending, _probs, _refeed, _sample
from specresearch.engine.timing import clock
from specresearch.models.protocols import FeatureReader, RowExpander, TreeScorer

__all__ = ["TOPK_LAWS", "TREE_DRAFT_LAWS", "TREE_VERIFIERS", "check_tree_args", "node_tensors", "parse_verifier", "tree_randomness",
           "tree_step"]

TREE_VERIFIERS = MULTI_VERIFIERS
TREE_DRAFT_LAWS = (*DRAFT_LAWS, "dynamic", "static")  # top-k trees (engine.topk_tree), one-hot rule only
TOPK_LAWS = ("dynamic", "static")


def check_tree_args(target, draft, verifier, num_drafts: int, draft_law: str, gamma: int, expectations,
                    tree_nodes=None) -> None:
    """Clear errors for a tree run the engine cannot do, before any model work."""
    if not callable(verifier) and verifier not in TREE_VERIFIERS:
        one = " (a top-k tree's: verifier='onehot')" if draft_law in TOPK_LAWS else ""
        raise ValueError(f"with num_drafts > 1 or draft_law {draft_law!r} the verifier must be a multi-draft rule "
                         f"{sorted(TREE_VERIFIERS)}{one}, got {verifier!r}")
    if draft_law not in TREE_DRAFT_LAWS:
        raise ValueError(f"draft_law must be one of {TREE_DRAFT_LAWS}, got {draft_law!r}")
    if draft_law in TOPK_LAWS and verifier != "onehot":
        raise ValueError(f"draft_law {draft_law!r} (a deterministic top-k tree) is verified by 'onehot', the rule for "
                         f"candidates chosen without the verifier's randomness; got {verifier!r}")
    if tree_nodes is not None:
        if draft_law not in TOPK_LAWS:
            raise ValueError(f"tree_nodes is for draft_law 'dynamic' or 'static', got draft_law {draft_law!r}")
        check_int("tree_nodes", tree_nodes, meaning="nodes kept in the dynamic tree")
    if verifier == "kseq" and gamma != 1:
        raise ValueError(f"verifier 'kseq' (SpecTr K-SEQ) is single-step: gamma must be 1, got {gamma}")
    if not isinstance(target, TreeScorer):
        raise ValueError(f"target {type(target).__name__} cannot score a tree in one call (begin_tree / score_tree / end_tree)")
    if not isinstance(draft, RowExpander):
        raise ValueError(f"draft {type(draft).__name__} cannot draft trees: the engine drafts K paths with drafts that "
                         "copy and select rows (repeat_rows / select_rows: every draft the toolkit ships)")
    if isinstance(draft, FeatureReader) and not getattr(target, "returns_hidden_states", False):
        raise ValueError("draft reads the target's hidden states: target must return them (a models.causal_lm.CausalLM)")
    if expectations and (draft_law in TOPK_LAWS or any(m not in TREE_EXPECTATIONS for m in expectations)):
        raise ValueError(f"expectations= on sampled trees takes rules of {TREE_EXPECTATIONS} "
                         f"(core.tree_expectations), got {tuple(expectations)!r} with draft_law {draft_law!r}")
    if "kseq" in expectations and gamma != 1:
        raise ValueError(f"the 'kseq' expectation is single-step: gamma must be 1, got {gamma}")


def parse_verifier(spec: str) -> tuple[str, int, str, int | None]:
    """``"block"`` -> ("block", 1, "iid", None); ``"traversal:4"`` -> 4 i.i.d. paths;
    ``"rrs_without_replacement:4:without_replacement"`` names the draft law too; ``"onehot:4:dynamic:16"`` a dynamic
    tree of top-4 children and 16 nodes (-> ("onehot", 4, "dynamic", 16)). The spelling of a tree run in ``bench``'s
    ``verifiers`` and its records."""
    from specresearch.core.verify import VERIFIERS

    parts = spec.split(":") if isinstance(spec, str) else []
    name, rest = (parts[0], parts[1:]) if parts else (None, [])
    ok = name in VERIFIERS or name in TREE_VERIFIERS
    if ok and rest and not rest[0].isdigit():
        ok = False
    num_drafts = int(rest[0]) if ok and rest else 1
    draft_law = rest[1] if ok and len(rest) > 1 else "iid"
    nodes = rest[2] if ok and len(rest) > 2 else None
    dynamic_ok = draft_law not in TOPK_LAWS or name == "onehot"
    nodes_ok = nodes is None or (draft_law in TOPK_LAWS and nodes.isdigit() and int(nodes) >= 1)
    if (not ok or len(rest) > 3 or num_drafts < 1 or draft_law not in TREE_DRAFT_LAWS or not dynamic_ok or not nodes_ok
            or (name in VERIFIERS and (num_drafts, draft_law) != (1, "iid"))):
        raise ValueError(f"a verifier is {sorted(VERIFIERS)} or a multi-draft rule NAME[:K[:LAW]] with NAME in "
                         f"{sorted(TREE_VERIFIERS)}, K >= 1 paths and LAW in {DRAFT_LAWS}, or a top-k tree "
                         f"onehot:K:dynamic[:NODES] / onehot:K:static[:NODES]; got {spec!r}")
    return name, num_drafts, draft_law, None if nodes is None else int(nodes)


def _first_uniforms(generators, batch: int, num_drafts: int, device) -> torch.Tensor:
    """``[B, K]`` uniforms for the first tokens drawn without replacement (one generator, or one per row)."""
    if isinstance(generators, torch.Generator):
        return uniforms((batch, num_drafts), generators, device)
    return torch.stack([uniforms(num_drafts, g, device) for g in generators])


def _draft_paths(draft, pending, pending_valid, num_drafts, gamma, draft_law, sampling, generators, device):
    """K paths of ``gamma`` tokens per row, each drafted by its own copy of the row.
    -> (draft_tokens [B, K, L], draft_probs [B, K, L, V])."""
    batch = pending.shape[0]
    draft.repeat_rows(num_drafts)
    valid = None if pending_valid is None else pending_valid.repeat_interleave(num_drafts, 0)
    logits = draft.score(pending.repeat_interleave(num_drafts, 0), valid)[:, -1]  # [B*K, V]
    per_copy = generators if isinstance(generators, torch.Generator) else [g for g in generators for _ in range(num_drafts)]
    tokens, probs, source = [], [], None
    for i in range(gamma):
        q = _probs(logits.to(device), sampling, f"draft model logits (drafting token {i + 1})")  # [B*K, V]
        if i == 0 and draft_law == "without_replacement" and not sampling.greedy:
            u = _first_uniforms(generators, batch, num_drafts, device)
            drawn, source = first_tokens_without_replacement(q.view(batch, num_drafts, -1)[:, 0], u)  # [B, K]
            x = drawn.reshape(-1)
        else:
            x = _sample(q, sampling, per_copy)
            if source is not None:  # a copy path (the first tokens ran out of mass) repeats its source path
                x = x.view(batch, num_drafts).gather(1, source).reshape(-1)
        tokens.append(x)
        probs.append(q)
        if i < gamma - 1:
            logits = draft.score(x[:, None])[:, -1]
    vocab = probs[0].shape[-1]
    return torch.stack(tokens, 1).view(batch, num_drafts, gamma), torch.stack(probs, 1).view(batch, num_drafts, gamma, vocab)


def _tree(draft_tokens: torch.Tensor):
    """Merge equal prefixes. -> (node tokens [B, n], depth [B, n] (1 = a root child), visible [B, 1+n, 1+n] (the
    call's nodes: index 0 the pending token, then the tree's; each sees itself and its ancestors), path_nodes
    [B, K, L] (call index of path k's token d)). Rows with fewer nodes are padded with nodes that see the root only."""
    batch, num_drafts, length = draft_tokens.shape
    rows = draft_tokens.tolist()
    nodes, parents, path_nodes = [], [], []
    for paths in rows:
        index: dict = {}
        tokens, parent, along = [], [], []
        for path in paths:
            at = []
            for d in range(length):
                prefix = tuple(path[: d + 1])
                if prefix not in index:
                    index[prefix] = len(tokens) + 1  # call index: 0 is the pending token
                    tokens.append(path[d])
                    parent.append(index[prefix[:-1]] if d else 0)
                at.append(index[prefix])
            along.append(at)
        nodes.append(tokens)
        parents.append(parent)
        path_nodes.append(along)
    return (*node_tensors(nodes, parents), torch.tensor(path_nodes, dtype=torch.long))


def node_tensors(tokens: list[list[int]], parents: list[list[int]]):
    """A batch of trees given per row as node tokens and their parents' call indices (0: the root, the pending token;
    node i is call row i + 1; parents precede children). -> (node tokens [B, n], depth [B, n] (1 = a root child),
    visible [B, 1+n, 1+n]: each call row sees itself and its ancestors). Rows with fewer nodes are padded with nodes
    that see the root only."""
    width = max(len(t) for t in tokens)
    # built as lists and made tensors once: three torch calls a step, not a few per node
    node_tokens, depth, visible = [], [], []
    for row_tokens, row_parents in zip(tokens, parents):
        seen = [[j == 0 or j == i for j in range(width + 1)] for i in range(width + 1)]
        levels = [0] * (width + 1)
        for i, parent in enumerate(row_parents, start=1):
            seen[i] = [mine or theirs for mine, theirs in zip(seen[i], seen[parent])]
            levels[i] = levels[parent] + 1
        node_tokens.append(list(row_tokens) + [0] * (width - len(row_tokens)))
        depth.append([levels[i] or 1 for i in range(1, width + 1)])  # padding nodes: depth 1, they see the root only
        visible.append(seen)
    return (torch.tensor(node_tokens, dtype=torch.long), torch.tensor(depth, dtype=torch.long),
            torch.tensor(visible, dtype=torch.bool))


def _node_counts(path_nodes: torch.Tensor) -> list[int]:
    """Nodes of each row's merged tree, from ``path_nodes [B, K, L]`` (call indices, one per distinct prefix)."""
    return [len(set(row)) for row in path_nodes.reshape(path_nodes.shape[0], -1).tolist()]


def _score_tree(target, pending, draft_tokens, sampling, hidden_layers=None):
    """One target call on the tree. -> (target_probs [B, K, L+1, V] along the paths, path_nodes [B, K, L], call width,
    the call's hidden states [B, 1+n, F] of ``hidden_layers`` for a draft that reads them, else None)."""
    node_tokens, depth, visible, path_nodes = _tree(draft_tokens.cpu())
    device = draft_tokens.device
    tokens = torch.cat([pending, node_tokens.to(device)], 1)
    depth = torch.cat([torch.zeros_like(depth[:, :1]), depth], 1)
    target.begin_tree()
    if hidden_layers is None:
        logits, features = target.score_tree(tokens, depth, visible), None
    else:
        logits, features = target.score_tree(tokens, depth, visible, hidden_layers=hidden_layers)
    probs = _probs(logits.to(device), sampling, "target model logits (scoring the draft tree)")  # [B, 1+n, V]
    batch, num_drafts, length = draft_tokens.shape
    along = torch.cat([torch.zeros(batch, num_drafts, 1, dtype=torch.long), path_nodes], 2).to(device)  # [B, K, L+1]
    rows = probs.gather(1, along.view(batch, -1, 1).expand(-1, -1, probs.shape[-1]))
    return rows.view(batch, num_drafts, length + 1, -1), path_nodes.to(device), tokens.shape[1], features


def _kept_nodes(path_nodes, result, width: int) -> torch.Tensor:
    """[B, 1+n]: the pending token and the nodes of the accepted path's accepted prefix."""
    batch, _, length = path_nodes.shape
    chosen = path_nodes[torch.arange(batch, device=path_nodes.device), result.path_index]  # [B, L]
    accepted = torch.arange(length, device=path_nodes.device)[None] < result.num_accepted[:, None]
    kept = torch.zeros(batch, width, dtype=torch.bool, device=path_nodes.device)
    kept[:, 0] = True
    return kept.scatter(1, torch.where(accepted, chosen, torch.zeros_like(chosen)), True)


def tree_randomness(generators, num_drafts: int, gamma: int, device) -> dict:
    """The verifier's randomness: ``{"generator": g}`` for one generator, else ``{"uniforms": [B, L+1, K]}``, one
    row per row's generator."""
    if isinstance(generators, torch.Generator):
        return {"generator": generators}
    return {"uniforms": torch.cat([draw_multi_uniforms(1, num_drafts, gamma, g, device=device) for g in generators])}


def tree_step(target, draft, target_pending, draft_pending, draft_valid, *, verifier, num_drafts: int, gamma: int,
              draft_law: str, sampling, generators, device, active: Sequence[bool], tick=None, expectations=()):
    """One tree step (module docstring); ``verifier`` a name of ``TREE_VERIFIERS`` or a callable with the multi-draft
    verifier signature (``tick``: the loop's clock, default :func:`clock`); ``expectations``: rules of
    ``TREE_EXPECTATIONS`` whose E[accepted | this tree] the record keeps (untimed). -> (emitted tokens per row, next target
    pending, next draft pending and validity, StepRecord)."""
    tick = tick or (lambda: clock(device))
    t0 = tick()
    draft_tokens, draft_probs = _draft_paths(draft, draft_pending, draft_valid, num_drafts, gamma, draft_law, sampling,
                                             generators, device)
    t1 = tick()
    reads = isinstance(draft, FeatureReader)
    target_probs, path_nodes, width, features = _score_tree(target, target_pending, draft_tokens, sampling,
                                                            draft.feature_layers if reads else None)
    t2 = tick()
    verify = verifier if callable(verifier) else TREE_VERIFIERS[verifier]
    result = verify(target_probs, draft_probs, draft_tokens, validate=False, **tree_randomness(generators, num_drafts, gamma, device))
    target.end_tree(_kept_nodes(path_nodes, result, width))
    batch = draft_tokens.shape[0]
    rows = torch.arange(batch, device=device)
    draft.select_rows(rows * num_drafts + result.path_index)
    chosen = draft_tokens[rows, result.path_index]  # [B, L]
    accepted = result.num_accepted.tolist()
    if reads:  # as a chain step: drop the slots drafted on the head's own features, re-feed with the target's
        draft.rollback(gamma - 1)
        along = torch.cat([torch.zeros_like(chosen[:, :1]), path_nodes[rows, result.path_index]], 1)  # [B, L+1]
        path_features = features.gather(1, along[:, :, None].expand(-1, -1, features.shape[-1]))
        draft_pending, draft_valid = _refeed(draft, chosen, result, path_features, max(accepted))
    else:
        draft.rollback((gamma - 1 - result.num_accepted).clamp(min=0))
        draft_pending, draft_valid = _draft_pending(chosen, result, gamma)
    emitted = [d[:n] + [t] for d, n, t in zip(chosen.tolist(), accepted, result.next_token.tolist())]
    scored = tuple(1 + n for n in _node_counts(path_nodes))
    seconds = tick() - t0
    expected = {m: tuple(expected_accepted_tree(target_probs.double(), draft_probs.double(), draft_tokens, m).tolist())
                for m in expectations}  # untimed: analysis only
    record = StepRecord(tuple(accepted), tuple(active), gamma, 1, gamma, seconds, t2 - t1, t1 - t0, expected=expected,
                        scored=scored)
    return emitted, result.next_token[:, None], draft_pending, draft_valid, record
