"""Batched multi-draft verifiers (K draft paths per row) and the draft-path samplers that feed them.

Notation as in :mod:`specresearch.core.verify`: p = target (``target_probs``), q = draft (``draft_probs``),
K = number of draft paths (``num_drafts``), L = path length (gamma of the single-draft code). A *path* is
x_1..x_L drawn autoregressively from q; the K paths with equal prefixes merged form the *tree*. The exact
twins (the specification) are in :mod:`specresearch.exact.multi`; the rules, with their sources, in
the papers cited in docs/multidraft.md.

Shapes (every verifier):

* ``target_probs`` ``[B, K, L+1, V]``: ``target_probs[b, k, i]`` = p(. | prefix, path k's first i tokens).
* ``draft_probs``  ``[B, K, L, V]``:   ``draft_probs[b, k, i]`` = q(. | same), the law path k's token i+1
  was drawn from (for i = 0 and for the later tokens of drafts without replacement see ``sample_draft_paths``).
* ``draft_tokens`` ``[B, K, L]`` int64, the paths in sampling order.
* ``uniforms``     ``[B, L+1, K]`` in [0, 1) (``draw_multi_uniforms``): ``uniforms[b, i, k]`` is the
  acceptance uniform of path k's token i+1 (of the tree node that path k is the first to reach), and
  ``uniforms[b, L, 0]`` drives the inverse-CDF sample of ``next_token``. With K = 1 this is exactly the
  ``[B, L+1]`` layout of ``verify.draw_uniforms``, drawn from the same generator stream.
* Output: ``MultiVerifyResult(num_accepted [B], path_index [B], next_token [B])``; row b emits
  ``draft_tokens[b, path_index[b], :num_accepted[b]]`` followed by ``next_token[b]``. ``path_index`` is the
  lowest path index whose first ``num_accepted`` tokens are the accepted ones.

Rows of paths that share a prefix are duplicates (the same context); a verifier that reads the merged tree
reads a node's rows from the lowest path through it, and never checks that the duplicates agree.

Which object each verifier reads (the contract of ``exact_multi``):

* ``rrs_verify`` (SpecInfer, Miao et al., ASPLOS 2024, "multi-step speculative sampling") reads the
  **paths**: at depth d the candidates are the d-th tokens of every path that extends the accepted prefix,
  in path order, duplicates kept. Accept x w.p. min(1, p(x)/q(x)); on rejection p <- norm(max(p - q, 0)),
  q unchanged; if every candidate is rejected, sample the residual; after an acceptance descend into x.
  Lossless for i.i.d. paths.
* ``rrs_without_replacement_verify`` (recursive speculative decoding, Jeon et al. 2024) reads the
  **merged tree**: the distinct children of a node in order of first appearance; on rejection of x also
  q <- q with x zeroed, renormalised. For first tokens drawn without replacement.
* ``kseq_verify`` (SpecTr K-SEQ, Sun et al., NeurIPS 2023), L = 1 only, reads the **paths** (the K first
  tokens, duplicates kept): rho* in [1, K] solves 1 - (1 - beta(rho))^K = rho beta(rho), beta(rho) =
  sum_x min(q(x), p(x)/rho); accept X_i w.p. min(1, p(X_i)/(rho* q(X_i))) in order; if none, sample
  norm(max(p - rho* q, 0)).
* ``gbv_verify`` (greedy multi-path block verification, Thomas and Pal 2026) reads the **paths**: select
  X* = the largest path in the lexicographic order of per-node ranks (p/q ascending, q = 0 ranked last,
  ties by token id), compute q^G, the law of X* under i.i.d. paths, along X*, and run ``block_verify``
  on X* with draft rows q^G.
* ``onehot_verify`` reads the **merged tree** and never q: accept x w.p. p(x); on rejection p(x) <- 0,
  renormalised; the rule for candidates chosen without the verifier's randomness (top-k trees, lookup).
* ``traversal_verify`` (Weng et al., NeurIPS 2025) reads the **merged tree**: node weights w_root = 1,
  w_a = min(1, w_b p(x | b) / q(x | b)) for a = child x of b (0 when q(x | b) = 0); nodes are visited in
  depth-first post-order (siblings in order of first appearance). At node a: accept the path to a if
  a is the root or eta_a < w_a, and emit one token from the current p(. | a). Otherwise delete a and
  update its parent b: r = max(w_b p(. | b) - q(. | b), 0), Z = sum r, w_b <- Z / (Z + 1 - w_b),
  p(. | b) <- r / Z, q(. | b) <- q(. | b) with x zeroed and renormalised; the weights below b follow.
  On one chain (K = 1) this is block verification in its backward form (w_b after the update is h_i).

Edge cases, as in ``verify``: a candidate with current q = 0 or p = 0 is never accepted; a residual of
zero mass falls back to the current target row; ``validate=True`` runs ``verify.validate_inputs`` on the
K paths as B*K single drafts plus the multi-draft shape checks.

Torch verifiers
---------------
* Every verifier is vectorised over B; the Python loops run over depths and paths (RRS: L x K steps,
  traversal: at most K L + 1 visited nodes, GBV: L columns for the selection and the rows q^G, K-SEQ:
  fixed 16 regula-falsi steps for rho*). Each step is a few O(V) tensor ops on the rows it concerns (the
  rejected rows of an RRS step, the visited rows of a traversal step, gathered with index tensors), so a
  step costs O(n V) for n such rows; one host sync per step reads n. Timings beside block verification:
  ``benchmarks/bench_verify.py`` (multi-draft table) and ``docs/multidraft.md``.
* Residual rows are kept unnormalised with their mass (p = r / Z), and the samplers sample the unnormalised
  weights, so the first candidate uses exactly ``token_verify``'s arithmetic (``eta * q(x) < p(x)``,
  ``max(p - q, 0)``). With K = 1, and the same generator (or uniforms), ``rrs_verify``,
  ``rrs_without_replacement_verify`` and ``kseq_verify`` (rho* = 1 exactly) return ``token_verify``'s
  output bit for bit, and ``gbv_verify`` (q^G = q exactly, see ``gbv_draft_rows``) and
  ``traversal_verify`` (initial weights by ``verify.block_scales``, the same residual weights and
  h = Z / (Z + 1 - w) clamped to w) return ``block_verify``'s (tests/test_verify_multi.py).
* K-SEQ's rho* is found per row as the root of g(rho) = sum_{j<K} (1 - beta(rho))^j - rho (the SpecTr
  equation divided by beta; strictly decreasing, g(1) >= 0 >= g(K)) in the rows' dtype by 16 steps of regula falsi
  with the Illinois modification (each step one O(V) evaluation of beta); the exact twin finds the algebraic
  root with sympy, and the two agree within 1e-12 (tests). Bisection would need ~50 evaluations.
* GBV's rank order is decided on the float ratios p/q (computed in the probabilities' dtype, one division,
  the same in the selection, the masked sums and the sorts). q^G(t | v) is computed in float64 in the
  normalised form q(t | v) S(a, b) / S(1, c), S(a, b) = sum_{j<K} a^j b^(K-1-j), a = (r + y + q(t))/(r + 1),
  b = (r + y)/(r + 1), c = r/(r + 1), r = A_v / Q_v, y = q-mass ranked below t: the identity
  (a^K - b^K) = (a - b) S(a, b) divides out the q-mass of v, so nothing overflows and K = 1 gives q exactly.
  A full row q^G(. | v) needs the cumulative q-mass in rank order, i.e. a sort of V ratios, which dominates
  GBV's cost; it is computed only for the rows block verification reads in full (``gbv_needed``: the
  candidates eta_i < p_i of rows with tau < L) and, after it, row 0 of the rows with tau = 0, whose next
  token is resampled from the full root residual (``gbv_resample_root``); the scales p_i come from masked
  sums at the drafted tokens.
* The traversal keeps, for the current node's ancestors only (one per depth), their current weight and,
  once a child was deleted, their residual target row and renormalised draft row: post-order visits a
  node's whole subtree before leaving it, so no other node is ever modified while it matters.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specresearch.core.draft_paths import draw_multi_uniforms
from specresearch.core.draws import sample_from_weights
from specresearch.core.multi_weights import (
    fallback,
    gbv_along,
    gbv_draft_rows,
    gbv_needed,
    gbv_resample_root,
    gbv_select,
    kseq_rho,
)
from specresearch.core.verify import block_scales, block_verify, validate_inputs

__all__ = ["MULTI_VERIFIERS", "MultiVerifyResult", "gbv_verify", "kseq_verify", "onehot_verify", "rrs_verify", "rrs_without_replacement_verify", "traversal_verify"]








@dataclass(frozen=True)
class MultiVerifyResult:
    """Outcome of one multi-draft verification step for a batch of B rows of K paths."""

    num_accepted: torch.Tensor  # [B] int64 in 0..L
    path_index: torch.Tensor  # [B] int64: lowest path whose first num_accepted tokens were accepted
    next_token: torch.Tensor  # [B] int64: residual sample, or the bonus token when a whole path was accepted


def rrs_verify(target_probs, draft_probs, draft_tokens, generator=None, *, uniforms=None, validate=True):
    """Multi-step speculative sampling (SpecInfer; Miao et al., ASPLOS 2024, arXiv 2305.09781) on the paths.

    Args:
        target_probs: ``[B, K, L+1, V]``; draft_probs: ``[B, K, L, V]``; draft_tokens: ``[B, K, L]`` int64.
        generator: ``torch.Generator`` for the uniforms (default RNG if it and ``uniforms`` are None).
        uniforms: ``[B, L+1, K]`` pre-drawn uniforms in [0, 1) (``draw_multi_uniforms``).
        validate: check the inputs (module docstring); False skips the checks.
    Returns:
        ``MultiVerifyResult`` (``num_accepted [B]``, ``path_index [B]``, ``next_token [B]``).
    """
    eta = _prepare(target_probs, draft_probs, draft_tokens, generator, uniforms, validate)
    return _recursive_rejection(target_probs, draft_probs, draft_tokens, eta, merged=False)


def rrs_without_replacement_verify(
    target_probs, draft_probs, draft_tokens, generator=None, *, uniforms=None, validate=True
):
    """Recursive speculative decoding (Jeon et al. 2024, arXiv 2402.14160) on the merged tree: distinct
    children in order of first appearance; a rejected child is zeroed out of q. Same arguments and result
    as ``rrs_verify``."""
    eta = _prepare(target_probs, draft_probs, draft_tokens, generator, uniforms, validate)
    return _recursive_rejection(target_probs, draft_probs, draft_tokens, eta, merged=True)


def onehot_verify(target_probs, draft_probs, draft_tokens, generator=None, *, uniforms=None, validate=True):
    """The one-hot rule on the merged tree, for candidates chosen without the verifier's randomness.

    Distinct children in order of first appearance: accept x iff ``eta < p(x)`` (the current p); on
    rejection p(x) <- 0 and p is renormalised; none accepted: sample what is left. q is never read
    (``draft_probs`` is validated for the shared shapes only), so deterministic top-k trees and lookup
    drafts are verified losslessly (EAGLE-2/3's ``evaluate_posterior``; twin:
    :func:`specresearch.exact.multi._onehot_law`). Same arguments and result as ``rrs_verify``.
    """
    eta = _prepare(target_probs, draft_probs, draft_tokens, generator, uniforms, validate)
    return _recursive_rejection(target_probs, draft_probs, draft_tokens, eta, merged=True, onehot=True)


def kseq_verify(target_probs, draft_probs, draft_tokens, generator=None, *, uniforms=None, validate=True):
    """K-SEQ (SpecTr; Sun et al., NeurIPS 2023, arXiv 2310.15141), one step: L must be 1.

    Accept X_i w.p. min(1, p(X_i) / (rho* q(X_i))) for i = 1..K in order; if none is accepted sample
    norm(max(p - rho* q, 0)). Same arguments and result as ``rrs_verify`` (shapes with L = 1).
    """
    if validate and isinstance(draft_tokens, torch.Tensor) and draft_tokens.dim() == 3 and draft_tokens.shape[2] != 1:
        raise ValueError(
            f"kseq_verify verifies one token per draft (L = 1); got draft_tokens of shape {list(draft_tokens.shape)} "
            "(use rrs_verify, gbv_verify or traversal_verify for longer paths)"
        )
    eta = _prepare(target_probs, draft_probs, draft_tokens, generator, uniforms, validate)
    batch, num_drafts, _ = draft_tokens.shape
    rows = torch.arange(batch, device=draft_tokens.device)
    target, draft = target_probs[:, 0, 0], draft_probs[:, 0, 0]  # [B, V]: the shared root rows
    rho = kseq_rho(target, draft, num_drafts)  # [B]
    tokens = draft_tokens[:, :, 0]  # [B, K]
    p_x, q_x = target.gather(1, tokens), draft.gather(1, tokens)  # [B, K]
    passed = (eta[:, 0, :] * rho[:, None] * q_x < p_x) & (q_x > 0)  # rho = 1 (K = 1): token_verify's test
    accepted = passed.any(-1)
    first = passed.long().argmax(-1)  # [B]: first accepted path (0 when none)
    residual = fallback((target - rho[:, None] * draft).clamp(min=0), target)
    weights = torch.where(accepted[:, None], _take_rows(target_probs, rows, first, 1), residual)
    next_token = sample_from_weights(weights, eta[:, 1, 0])
    num_accepted = accepted.long()
    return MultiVerifyResult(num_accepted, _lowest_path(draft_tokens, first, num_accepted), next_token)


def gbv_verify(target_probs, draft_probs, draft_tokens, generator=None, *, uniforms=None, validate=True):
    """Greedy multi-path block verification (Thomas and Pal 2026, arXiv 2602.16961) on the paths.

    Select X* (largest path in the lexicographic order of per-node ranks p/q, q = 0 last, ties by token id),
    then ``verify.block_verify`` (Sun et al. 2025, Algorithm 2) of X* with draft rows q^G ``[B, L, V]``, the law
    of X* under i.i.d. paths (the papers cited in docs/multidraft.md). It consumes ``uniforms[:, :, 0]`` only. Same
    arguments and result as ``rrs_verify``.
    """
    eta = _prepare(target_probs, draft_probs, draft_tokens, generator, uniforms, validate)
    batch, num_drafts, _ = draft_tokens.shape
    rows = torch.arange(batch, device=draft_tokens.device)
    chosen = gbv_select(target_probs, draft_probs, draft_tokens)  # [B]
    target, draft, tokens = target_probs[rows, chosen], draft_probs[rows, chosen], draft_tokens[rows, chosen]
    along = gbv_along(target, draft, tokens, num_drafts)  # r and q^G(x_d), [B, L] each
    needed = gbv_needed(target, draft, tokens, along[1], eta[:, :, 0])  # [B, L]
    rows_g = gbv_draft_rows(target, draft, tokens, num_drafts, needed, along)  # [B, L, V]
    result = block_verify(target, rows_g, tokens, uniforms=eta[:, :, 0], validate=False)
    next_token = gbv_resample_root(target, draft, tokens, num_drafts, along, result, eta[:, -1, 0])
    path_index = _lowest_path(draft_tokens, chosen, result.num_accepted)
    return MultiVerifyResult(result.num_accepted, path_index, next_token)


def traversal_verify(target_probs, draft_probs, draft_tokens, generator=None, *, uniforms=None, validate=True):
    """Traversal verification (Weng et al., NeurIPS 2025, arXiv 2505.12398) on the merged tree.

    Nodes are visited in depth-first post-order; node a (depth e, first reached by path k) is accepted iff
    ``uniforms[b, e-1, k] < w_a`` (the root always), else deleted and its parent updated (module docstring).
    Same arguments and result as ``rrs_verify``.
    """
    eta = _prepare(target_probs, draft_probs, draft_tokens, generator, uniforms, validate)
    return _traversal(target_probs, draft_probs, draft_tokens, eta)


MULTI_VERIFIERS = {
    "rrs": rrs_verify,
    "rrs_without_replacement": rrs_without_replacement_verify,
    "kseq": kseq_verify,
    "gbv": gbv_verify,
    "traversal": traversal_verify,
    "onehot": onehot_verify,
}


def _prepare(target_probs, draft_probs, draft_tokens, generator, uniforms, validate):
    """Validate (optionally) and return the uniforms ``[B, L+1, K]`` in the probabilities' dtype, < 1."""
    if validate:
        _validate(target_probs, draft_probs, draft_tokens, generator, uniforms)
    if uniforms is None:
        batch, num_drafts, length = draft_tokens.shape
        uniforms = draw_multi_uniforms(batch, num_drafts, length, generator, device=target_probs.device)
    dtype = target_probs.dtype
    below_one = 1.0 - torch.finfo(dtype).eps / 2  # as verify: a cast must not round a uniform up to 1
    return uniforms.to(device=target_probs.device, dtype=dtype).clamp(max=below_one)


def _flat_index(shape, index):
    """Row-major index into the leading dimensions ``shape`` of the rows ``index`` (one tensor or int per dim)."""
    flat = index[0]
    for size, i in zip(shape[1:], index[1:]):
        flat = flat * size + i
    return flat


def _take_rows(probs, *index):
    """``probs[index]`` for ``probs [..., V]`` and one index per leading dimension, a fresh ``[n, V]`` copy:
    ``index_select`` on the flat view when ``probs`` is contiguous (far faster than advanced indexing, as in
    ``verify``), advanced indexing otherwise."""
    if not probs.is_contiguous():
        return probs[index]
    return probs.view(-1, probs.shape[-1]).index_select(0, _flat_index(probs.shape[:-1], index))


def _put_rows(buffer, values, *index):
    """``buffer[index] = values`` for a contiguous work buffer ``[..., V]`` (``values [n, V]``)."""
    buffer.view(-1, buffer.shape[-1]).index_copy_(0, _flat_index(buffer.shape[:-1], index), values)


def _lowest_path(draft_tokens, path, num_accepted):
    """Lowest k whose first ``num_accepted`` tokens equal those of path ``path``; ``[B]`` int64."""
    batch, _, length = draft_tokens.shape
    chosen = draft_tokens[torch.arange(batch, device=path.device), path]  # [B, L]
    inside = torch.arange(length, device=path.device) < num_accepted[:, None]  # [B, L]
    agrees = (draft_tokens == chosen[:, None]) | ~inside[:, None]  # [B, K, L]
    return agrees.all(-1).long().argmax(-1)


def _first_occurrences(tokens, alive):
    """``[B, K]``: path k is alive and no lower alive path has the same token (``tokens [B, K]``)."""
    num_drafts = tokens.shape[1]
    lower = torch.ones(num_drafts, num_drafts, dtype=torch.bool, device=tokens.device).tril(-1)  # [k, k'] k' < k
    repeated = ((tokens[:, :, None] == tokens[:, None, :]) & alive[:, None, :] & lower).any(-1)
    return alive & ~repeated


def _recursive_rejection(target_probs, draft_probs, draft_tokens, eta, merged, onehot=False):
    """RRS (``merged=False``: paths, duplicates kept) or RRS without replacement (``merged=True``: distinct
    children, rejected tokens zeroed out of q). The current p is ``residual / mass`` and the current q
    ``draft / draft_mass``; both start as the rows themselves with mass exactly 1. ``onehot=True`` (with
    ``merged=True``): every candidate's q is its one-hot row, so the test is ``eta * mass < p(x)`` and a
    rejection zeroes x in the residual (``max(p - e_x, 0)``); ``draft_probs`` is not read."""
    batch, num_drafts, length = draft_tokens.shape
    rows = torch.arange(batch, device=draft_tokens.device)
    alive = torch.ones(batch, num_drafts, dtype=torch.bool, device=rows.device)  # paths extending the accepted prefix
    searching = torch.ones(batch, dtype=torch.bool, device=rows.device)
    path = torch.zeros_like(rows)  # a path through the accepted prefix: its rows are the node's rows
    num_accepted = torch.zeros_like(rows)
    weights = target_probs.new_zeros(batch, target_probs.shape[-1])  # [B, V]: sampling weights of decided rows
    for d in range(length):
        residual, draft = _take_rows(target_probs, rows, path, d), _take_rows(draft_probs, rows, path, d)  # [B, V]
        mass, draft_mass = residual.new_ones(batch), residual.new_ones(batch)
        tokens = draft_tokens[:, :, d]  # [B, K]
        candidates = alive & searching[:, None]
        if merged:
            candidates = _first_occurrences(tokens, candidates)
        accepted, choice = torch.zeros_like(searching), path.clone()
        for k in range(num_drafts):
            trying = candidates[:, k] & ~accepted
            x = tokens[:, k : k + 1]  # [B, 1]
            if onehot:
                draft = torch.zeros_like(residual).scatter_(1, x, 1.0)
            p_x, q_x = residual.gather(1, x).squeeze(1), draft.gather(1, x).squeeze(1)
            passed = trying & (eta[:, d, k] * q_x * mass < p_x * draft_mass) & (q_x > 0)
            accepted, choice = accepted | passed, torch.where(passed, k, choice)
            rejected = trying & ~passed
            residual, mass = _reject(residual, mass, draft, draft_mass, rejected)
            if merged and not onehot:
                draft, draft_mass = _remove_token(draft, draft_mass, x, rejected)
        stopped = searching & ~accepted
        weights = torch.where(stopped[:, None], residual, weights)
        searching = searching & accepted
        num_accepted += searching.long()
        path = torch.where(searching, choice, path)
        alive = alive & (tokens == tokens.gather(1, path[:, None]))
    weights = torch.where(searching[:, None], _take_rows(target_probs, rows, path, length), weights)  # bonus rows
    next_token = sample_from_weights(weights, eta[:, length, 0])
    return MultiVerifyResult(num_accepted, _lowest_path(draft_tokens, path, num_accepted), next_token)


def _reject(residual, mass, draft, draft_mass, rejected):
    """After rejecting a candidate on the ``rejected`` rows: p <- norm(max(p - q, 0)) with p = residual / mass,
    q = draft / draft_mass, kept unnormalised (mass 1, draft_mass 1: exactly max(p - q, 0), as token_verify);
    a zero-mass residual keeps the current row. Computed on every row and kept on the rejected ones (no host read:
    a captured step's form). Returns the new ``residual`` [B, V] and ``mass`` [B]."""
    scale = torch.where(draft_mass > 0, mass / draft_mass, torch.zeros_like(mass))
    updated = (residual - scale[:, None] * draft).clamp_(min=0)  # [B, V]; q = 0 row: p unchanged
    updated_mass = updated.sum(-1)
    keep = rejected & (updated_mass > 0)
    return torch.where(keep[:, None], updated, residual), torch.where(keep, updated_mass, mass)


def _remove_token(draft, draft_mass, x, rejected):
    """q <- q with token x ``[B, 1]`` zeroed (renormalised through ``draft_mass``) on the ``rejected`` rows."""
    removed = draft.scatter(1, x, 0.0)
    return torch.where(rejected[:, None], removed, draft), torch.where(rejected, removed.sum(-1), draft_mass)


def _owners(draft_tokens):
    """``[B, K, L]``: the lowest path whose first e+1 tokens equal path k's (the owner of path k's node at
    depth e+1)."""
    same = draft_tokens[:, :, None, :] == draft_tokens[:, None, :, :]  # [B, K, K', L]
    prefix_same = same.long().cumprod(-1)
    return prefix_same.argmax(2)  # first k' (argmax returns the first maximum)


def _post_order(owners):
    """Depth-first post-order of every row's merged tree (siblings by first appearance), root last.

    Node (k, e), e = 1..L, exists when path k owns it; its key is (owner at depth 1, .., owner at depth e,
    K, .., K) and the root's is (K, .., K): lexicographic order of these keys is post-order. Slots that are
    not nodes get K + 1 and sort after the root. Returns (path ``[B, S]``, depth ``[B, S]``), S = K L + 1.
    """
    batch, num_drafts, length = owners.shape
    device = owners.device
    depth = torch.arange(1, length + 1, device=device)  # node depths e
    keep = torch.arange(length, device=device)[None, :] < depth[:, None]  # [e, j]: digit j is set when j < e
    digits = torch.where(keep, owners[:, :, None, :], num_drafts)  # [B, K, L(e), L(j)]
    is_node = owners == torch.arange(num_drafts, device=device)[None, :, None]  # [B, K, L]
    digits[..., 0] = torch.where(is_node, digits[..., 0], num_drafts + 1)
    root = torch.full((batch, 1, length), num_drafts, device=device, dtype=digits.dtype)
    digits = torch.cat([digits.reshape(batch, num_drafts * length, length), root], 1)  # [B, S, L]
    slot_path = torch.arange(num_drafts, device=device).repeat_interleave(length)
    slot_path = torch.cat([slot_path, slot_path.new_zeros(1)]).expand(batch, -1)
    slot_depth = torch.cat([depth.repeat(num_drafts), depth.new_zeros(1)]).expand(batch, -1)
    order = torch.arange(digits.shape[1], device=device).expand(batch, -1)
    for j in range(length - 1, -1, -1):  # least significant digit first, stable sorts
        step = digits[:, :, j].gather(1, order).argsort(dim=-1, stable=True)
        order = order.gather(1, step)
    return slot_path.gather(1, order), slot_depth.gather(1, order)


def _traversal(target_probs, draft_probs, draft_tokens, eta):
    """Traversal verification, vectorised over B; loop step t visits the t-th node (post-order) of every row that is
    still undecided: every row computes, the undecided ones keep what they computed (no host read, so a captured
    step can run it; the loop runs over all K L + 1 slots).

    State for the current node's ancestors (slot = depth 0..L-1): ``weight [B, L+1]`` (the chain's current
    weights), and once a child was deleted ``modified``, ``residual`` / ``mass`` (p = residual / mass) and
    ``draft`` / ``draft_mass`` (q with deleted children zeroed).
    """
    batch, num_drafts, length = draft_tokens.shape
    vocab = target_probs.shape[-1]
    rows = torch.arange(batch, device=draft_tokens.device)
    order_path, order_depth = _post_order(_owners(draft_tokens))  # [B, S]
    index = draft_tokens[..., None]
    p_x = target_probs[:, :, :length].gather(-1, index).squeeze(-1)  # [B, K, L]
    q_x = draft_probs.gather(-1, index).squeeze(-1)
    fresh_ratio = torch.where(q_x > 0, p_x / q_x, torch.zeros_like(p_x))  # [B, K, L]
    first_chain = block_scales(p_x[:, 0], q_x[:, 0])  # [B, L]: path 0's weights, as block_verify's p_i
    weight = torch.cat([torch.ones_like(first_chain[:, :1]), first_chain], 1)  # [B, L+1]
    residual = target_probs.new_zeros(batch, length, vocab)  # read only where ``modified``
    draft = torch.zeros_like(residual)
    mass, draft_mass = residual.new_ones(batch, length), residual.new_ones(batch, length)
    modified = torch.zeros(batch, length, dtype=torch.bool, device=rows.device)
    done = torch.zeros(batch, dtype=torch.bool, device=rows.device)
    num_accepted, path = torch.zeros_like(rows), torch.zeros_like(rows)
    weights = target_probs.new_zeros(batch, vocab)  # sampling weights of the decided rows
    state = (residual, draft, mass, draft_mass, modified, weight)
    for t in range(order_path.shape[1]):
        k, e = order_path[:, t], order_depth[:, t]
        parent = (e - 1).clamp(min=0)
        passed = ~done & ((e == 0) | (eta[rows, parent, k] < weight.gather(1, e[:, None]).squeeze(1)))
        # an accepted leaf emits from p, an accepted inner node from its residual (its children were all deleted)
        emitted = torch.where((e == length)[:, None], _take_rows(target_probs, rows, k, length),
                              _take_rows(state[0], rows, e.clamp(max=length - 1)))
        weights = torch.where(passed[:, None], emitted, weights)
        num_accepted, path = torch.where(passed, e, num_accepted), torch.where(passed, k, path)
        rejected = ~done & ~passed
        done = done | passed
        if t + 1 == order_path.shape[1]:
            break
        state = _delete_node(target_probs, draft_probs, draft_tokens, state, rejected, k, e)
        nxt_k, nxt_e = order_path[:, t + 1], order_depth[:, t + 1]
        descend = rejected & (nxt_e != parent)  # next node: first leaf below a remaining sibling
        _chain_weights(state, fresh_ratio, draft_tokens, descend, nxt_k, e)
    next_token = sample_from_weights(weights, eta[:, length, 0])
    return MultiVerifyResult(num_accepted, _lowest_path(draft_tokens, path, num_accepted), next_token)


def _delete_node(target_probs, draft_probs, draft_tokens, state, rejected, k, e):
    """Delete node (path k, depth e >= 1) of the ``rejected [B]`` rows and update its parent (slot e - 1); every
    row computes, the rejected ones keep it. -> the new ``state`` (``weight`` and ``modified`` updated in place)."""
    residual, draft, mass, draft_mass, modified, weight = state
    rows = torch.arange(rejected.shape[0], device=rejected.device)
    slot = (e - 1).clamp(min=0)
    was_modified = modified[rows, slot]
    own_p, own_q = _take_rows(residual, rows, slot), _take_rows(draft, rows, slot)  # [B, V]
    cur_p = torch.where(was_modified[:, None], own_p, _take_rows(target_probs, rows, k, slot))  # fresh rows, or
    cur_q = torch.where(was_modified[:, None], own_q, _take_rows(draft_probs, rows, k, slot))  # the updated ones
    cur_mass = torch.where(was_modified, mass[rows, slot], torch.ones_like(mass[rows, slot]))
    cur_draft_mass = torch.where(was_modified, draft_mass[rows, slot], torch.ones_like(cur_mass))
    w = weight[rows, slot]
    # r = max(w p - q, 0) with p = cur_p / cur_mass, q = cur_q / cur_draft_mass; verify's arithmetic when both are 1
    q_now = cur_q / torch.where(cur_draft_mass > 0, cur_draft_mass, torch.ones_like(cur_draft_mass))[:, None]
    r = torch.addcmul(q_now, cur_p, (w / cur_mass)[:, None], value=-1).clamp_(max=0).neg_()
    total = r.sum(-1)
    weight[rows, slot] = torch.where(rejected, (total / (total + 1 - w)).nan_to_num_(0.0).minimum(w), w)  # h
    has_mass = total > 0
    keep = rejected[:, None]
    residual = _with_rows(residual, torch.where(keep, torch.where(has_mass[:, None], r, cur_p), own_p), rows, slot)
    mass = mass.index_put((rows, slot), torch.where(rejected, torch.where(has_mass, total, cur_mass), mass[rows, slot]))
    removed = cur_q.scatter(1, draft_tokens[rows, k, slot][:, None], 0)
    draft = _with_rows(draft, torch.where(keep, removed, own_q), rows, slot)
    draft_mass = draft_mass.index_put((rows, slot), torch.where(rejected, removed.sum(-1), draft_mass[rows, slot]))
    modified[rows, slot] = modified[rows, slot] | rejected
    length = modified.shape[1]
    inner = rejected & (e < length)  # the deleted node's own slot is free again
    below = e.clamp(max=length - 1)
    modified[rows, below] = modified[rows, below] & ~inner
    return residual, draft, mass, draft_mass, modified, weight


def _with_rows(buffer, values, rows, slot):
    """``buffer`` ``[B, L, V]`` with row (b, slot[b]) replaced by ``values[b]`` for every b."""
    return buffer.index_put((rows, slot), values)


def _chain_weights(state, fresh_ratio, draft_tokens, descend, k, e):
    """Weights of the chain from the updated parent (slot e - 1) down path k to depth L, for the ``descend [B]`` rows:
    the first node reads the parent's current rows, deeper nodes the fresh ratios p(x)/q(x) of path k."""
    residual, draft, mass, draft_mass, _, weight = state
    rows = torch.arange(descend.shape[0], device=descend.device)
    slot = (e - 1).clamp(min=0)
    x = draft_tokens[rows, k, slot]
    p_now = residual[rows, slot, x] / mass[rows, slot]
    q_now = draft[rows, slot, x] / draft_mass[rows, slot]
    top = torch.where(q_now > 0, weight[rows, slot] * p_now / q_now, torch.zeros_like(p_now)).clamp(max=1)
    weight[rows, e] = torch.where(descend, top, weight[rows, e])
    length = draft_tokens.shape[2]
    for depth in range(2, length + 1):
        below = descend & (depth > e)
        w = (weight[rows, depth - 1] * fresh_ratio[rows, k, depth - 1]).clamp(max=1)
        weight[rows, depth] = torch.where(below, w, weight[rows, depth])


def _validate(target_probs, draft_probs, draft_tokens, generator, uniforms):
    ranks = {"target_probs": (target_probs, 4), "draft_probs": (draft_probs, 4), "draft_tokens": (draft_tokens, 3)}
    for name, (value, rank) in ranks.items():
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor; got {type(value).__name__}")
        if value.dim() != rank:
            raise ValueError(f"{name} must be {rank}-D (multi-draft: a K axis after B); got shape {list(value.shape)}")
    batch, num_drafts, length = draft_tokens.shape
    vocab = target_probs.shape[-1]
    if batch < 1 or num_drafts < 1 or length < 1:
        raise ValueError(f"draft_tokens must be [B, K, L] with B, K, L >= 1; got {list(draft_tokens.shape)}")
    if tuple(target_probs.shape) != (batch, num_drafts, length + 1, vocab):
        raise ValueError(
            f"target_probs must be [B, K, L+1, V] = {[batch, num_drafts, length + 1, vocab]} to match draft_tokens "
            f"{list(draft_tokens.shape)}; got {list(target_probs.shape)} (one row per path token plus the bonus row)"
        )
    if tuple(draft_probs.shape) != (batch, num_drafts, length, vocab):
        raise ValueError(
            f"draft_probs must be [B, K, L, V] = {[batch, num_drafts, length, vocab]}; got {list(draft_probs.shape)}"
        )
    validate_inputs(target_probs.flatten(0, 1), draft_probs.flatten(0, 1), draft_tokens.flatten(0, 1))
    if uniforms is not None:
        if generator is not None:
            raise ValueError("pass either generator or uniforms, not both (uniforms already fix the randomness)")
        if not isinstance(uniforms, torch.Tensor) or not uniforms.dtype.is_floating_point:
            raise ValueError("uniforms must be a floating torch.Tensor of shape [B, L+1, K] (see draw_multi_uniforms)")
        if tuple(uniforms.shape) != (batch, length + 1, num_drafts):
            expected = [batch, length + 1, num_drafts]
            raise ValueError(f"uniforms must be [B, L+1, K] = {expected}; got {list(uniforms.shape)}")
        if not bool(((uniforms >= 0) & (uniforms < 1)).all()):
            low, high = float(uniforms.min()), float(uniforms.max())
            raise ValueError(f"uniforms must lie in [0, 1); got values in [{low}, {high}]")
