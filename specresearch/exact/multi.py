"""Exact rational twins of the multi-draft verifiers: the specification of ``verify_multi``.

Notation as in :mod:`specresearch.exact`: p = target, q = draft, K = number of draft paths
(``num_drafts``), L = path length (``gamma`` of the single-draft code). Probabilities are
:class:`fractions.Fraction`; K-SEQ's acceptance threshold rho* is algebraic and is computed exactly
with sympy (its laws are sympy numbers; :mod:`specresearch.exact.kseq`). Nothing here imports torch. The rules
are those of the papers cited in docs/multidraft.md; each law function below says which paper and what was
checked.

The contract shared with :mod:`specresearch.core.verify_multi` (the torch side)
-------------------------------------------------------------------------
* A draft of one step is ``paths``: a tuple of K tuples of L token ids, in sampling order. Models are
  exact models (:func:`specresearch.exact.as_model`) and rows are read at ``prefix + path[:i]``.
* Draft laws (:func:`draft_paths_law`):

  - ``"iid"``: the K paths are i.i.d., each drawn autoregressively from q.
  - ``"without_replacement"``: the first tokens are drawn without replacement -- X_{k,1} from q(. |
    prefix) with X_{1,1}..X_{k-1,1} removed and renormalised; every later token of a path is drawn
    from q(. | its own prefix) as usual. **Fewer than K tokens of positive mass**: if only m < K
    first tokens have q > 0, the first m paths are drawn as above and paths m+1..K are copies of path
    m (the whole path). No error is raised; the verifiers below that read the merged tree never see
    the copies, and the ones that read paths treat a copy as a draft of zero current q mass (see each).

* ``verify_multi_exact(target, draft, paths, method, prefix=(), draft_law="iid")`` returns the exact
  law ``{emitted tokens: probability}`` of one step given the drafted paths, where the emitted tokens
  are the accepted draft tokens followed by the one token sampled from the target / residual. Which
  object each method reads:

  - ``"rrs"`` (SpecInfer) reads the **paths**: at depth d the candidates are the d-th tokens of every
    path that extends the accepted prefix, in path order, duplicates kept as separate occurrences.
  - ``"rrs_without_replacement"`` (recursive SD) reads the **merged tree**: the candidates at a node
    are its distinct children in order of first appearance (a token equal to an earlier sibling is
    skipped), and a rejected child is zeroed out of q.
  - ``"kseq"`` (SpecTr, L = 1 only) reads the **paths** (the K first tokens, duplicates kept).
  - ``"gbv"`` reads the **paths** (it selects one of them; duplicates do not matter).
  - ``"traversal"`` reads the **merged tree** (siblings in order of first appearance, leaves visited in
    depth-first post-order).
  - ``"onehot"`` reads the **merged tree** and never reads q: the rule for candidates chosen without the
    verifier's randomness (top-k trees, lookup), see :func:`_onehot_law`.
  - with K = 1 only: ``"token"``, ``"block"``, ``"greedy"`` are the single-draft twins of
    :func:`specresearch.exact.verify_exact`.

* Losslessness, established exactly with :func:`is_lossless_multi` (the full loop, n_tokens = 3) on
  50 random context-dependent models with exact zeros per method and draft law (V = 2..3, K = 2..3,
  L = 1..2; tests/test_exact_multi.py):

  ==========================  =====  ===================  ==============================================
  method                      iid    without_replacement  smallest counterexample (context-free, K = 2)
  ==========================  =====  ===================  ==============================================
  rrs                         yes    no                   V = 3: p = (0, 1/3, 2/3), q = (2/3, 0, 1/3)
  rrs_without_replacement     yes    yes                  --
  kseq                        yes    no                   the two-symbol example, p = (1/3, 2/3), q = (2/3, 1/3)
  gbv                         yes    no                   p = q = (1/2, 1/2)
  traversal                   yes    yes                  --
  onehot                      yes    yes                  -- (and lossless on ``"topk"`` trees)
  ==========================  =====  ===================  ==============================================

  The two tree readers are lossless under both laws because the distinct children of a node, in
  order of first appearance among i.i.d. draws, are themselves draws without replacement. The path
  readers are lossless only for the law they were derived for (:func:`smallest_counterexample`).

* Zero-mass conventions are those of ``verify``: a draft token with current q = 0 is rejected with
  probability 1; a token with p = 0 is never accepted; a residual of zero mass falls back to the
  current target row (as ``exact.single``'s residual).
"""

from __future__ import annotations

import itertools
import numbers
from collections import defaultdict
from collections.abc import Sequence
from fractions import Fraction

import sympy

from specresearch.checks import check_int
from specresearch.exact import single as exact
from specresearch.exact.kseq import RhoField, kseq_law, kseq_public_law, kseq_rho
from specresearch.exact.paths import (
    _ONE,
    _ZERO,
    Paths,
    Row,
    _check_draft_law,
    _check_length,
    _check_num_drafts,
    draft_paths_law,
    merged_tree,
)

__all__ = ["MULTI_METHODS", "verify_multi_exact", "step_distribution_multi", "expected_accepted_multi", "speculative_distribution_multi", "is_lossless_multi", "gbv_draft_rows", "smallest_counterexample"]


MULTI_METHODS = ("rrs", "rrs_without_replacement", "kseq", "gbv", "traversal", "onehot")










_SINGLE = {"token", "block", "greedy"}


def _check_method(method, num_drafts: int, length: int) -> str:
    if method in _SINGLE:
        if num_drafts != 1:
            raise ValueError(f"method {method!r} is single-draft; use num_drafts=1 or one of {MULTI_METHODS}")
        return method
    if method not in MULTI_METHODS:
        raise ValueError(f"method must be one of {MULTI_METHODS} (or token/block/greedy with K = 1), got {method!r}")
    if method == "kseq" and length != 1:
        raise ValueError(f"method 'kseq' (SpecTr K-SEQ) is single-step: the path length must be 1, got {length}")
    return method


def _check_paths(paths, vocab: int) -> Paths:
    """K >= 1 tuples of L >= 1 token ids in [0, vocab), all of the same length."""
    if isinstance(paths, (str, bytes)) or not isinstance(paths, Sequence) or not paths:
        raise ValueError("paths must be a non-empty sequence of K token-id sequences (one per draft path)")
    out = []
    for k, path in enumerate(paths):
        if isinstance(path, (str, bytes)) or not isinstance(path, Sequence) or not path:
            raise ValueError(f"paths[{k}] must be a non-empty sequence of token ids")
        for i, x in enumerate(path):
            if isinstance(x, bool) or not isinstance(x, numbers.Integral) or not 0 <= x < vocab:
                raise ValueError(f"paths[{k}][{i}] must be an integer in [0, {vocab}), got {x!r}")
        out.append(tuple(int(x) for x in path))
    if len({len(p) for p in out}) != 1:
        raise ValueError(f"paths must all have the same length L, got lengths {[len(p) for p in out]}")
    return tuple(out)


def _residual(target_row: Sequence, draft_row: Sequence, scale=_ONE) -> tuple:
    """norm(max(scale * p - q, 0)), falling back to p when that has zero mass (as ``verify``)."""
    weights = [max(scale * p - q, _ZERO) for p, q in zip(target_row, draft_row)]
    total = sum(weights, _ZERO)
    return tuple(target_row) if total == 0 else tuple(w / total for w in weights)


def _without(row: Sequence, token: int) -> tuple:
    """q with ``token`` zeroed and renormalised; all zeros when nothing is left."""
    rest = [_ZERO if t == token else v for t, v in enumerate(row)]
    total = sum(rest, _ZERO)
    return tuple(rest) if total == 0 else tuple(v / total for v in rest)


def _accept(p, q):
    """min(1, p / q), and 0 when q = 0 (never accept a draft the draft model could not produce)."""
    return min(_ONE, p / q) if q > 0 else _ZERO


def _emit(law: dict, accepted: tuple, mass, token_law: Sequence) -> None:
    """Add ``mass`` times "accepted tokens, then one token from token_law" to ``law``."""
    if not mass:
        return
    for token, prob in enumerate(token_law):
        if prob:
            law[accepted + (token,)] += mass * prob


def _sequential_law(target, draft, prefix: tuple, candidates, step) -> dict:
    """The law of the rules that try a node's candidates in turn (RRS, RRS without replacement, one-hot).

    At the accepted prefix u the candidates ``candidates(u)`` are tried in order; ``step(p_row, q_row, x)`` gives the
    acceptance probability of x and the (p, q) rows after rejecting it; an accepted x is descended into with fresh
    rows; when every candidate is rejected (or u is a leaf) one token is emitted from the current p. ``draft`` None:
    the rule never reads q.
    """
    law: dict = defaultdict(Fraction)

    def descend(u: tuple, mass: Fraction) -> None:
        p_row, tried = target(prefix + u), candidates(u)
        q_row = draft(prefix + u) if tried and draft is not None else None
        for x in tried:
            accept, next_p, next_q = step(p_row, q_row, x)
            if accept:
                descend(u + (x,), mass * accept)
            mass *= 1 - accept
            p_row, q_row = next_p, next_q
        _emit(law, u, mass, p_row)

    descend((), _ONE)
    return law


def _rrs_law(target, draft, paths: Paths, prefix: tuple) -> dict:
    """Multi-step speculative sampling, SpecInfer (Miao et al., ASPLOS 2024, arXiv 2305.09781).

    Reads the paths: at the accepted prefix u (depth d) the candidates are the d-th tokens of all
    paths extending u, in path order, duplicates kept. Candidate x is accepted w.p. min(1, p(x)/q(x));
    on rejection p <- norm(max(p - q, 0)) with q unchanged. Lossless for i.i.d. paths: given the
    tokens above depth d, the d-th tokens of the paths through u are i.i.d. q(. | u).
    Duplicates must stay separate occurrences (multidraft.md's "(check)"): the same rule on the
    merged tree (each distinct child tried once, q unchanged) is lossy with i.i.d. drafts -- an
    ad-hoc run of :func:`smallest_counterexample` on that variant finds V = 3, p = (0, 1/3, 2/3),
    q = (2/3, 0, 1/3), K = 2. Dropping duplicates needs the q update of RRS without replacement.
    The reference code released with GBV (its SpecInfer solver, citing lines 27-40 of SpecInfer's Algorithm 2)
    does the same: one occurrence per path, q unchanged, p <- norm(max(p - q, 0)); it tries the occurrences in
    a uniformly random order, which for i.i.d. paths has the same law as path order.
    """
    def candidates(u: tuple) -> list:
        return [path[len(u)] for path in paths if len(path) > len(u) and path[: len(u)] == u]

    return _sequential_law(target, draft, prefix, candidates, lambda p_row, q_row, x: (
        _accept(p_row[x], q_row[x]), _residual(p_row, q_row), q_row))


def _rrs_without_replacement_law(target, draft, paths: Paths, prefix: tuple) -> dict:
    """Recursive speculative decoding (Jeon et al. 2024, arXiv 2402.14160), on the merged tree.

    At a node the distinct children are tried in order: accept x w.p. min(1, p(x)/q(x)); on
    rejection p <- norm(max(p - q, 0)) and q <- q with x zeroed and renormalised (Jeon et al.'s
    recursive rejection sampling, which assumes the siblings were drawn without replacement).
    """
    children = merged_tree(paths)
    return _sequential_law(target, draft, prefix, children.__getitem__, lambda p_row, q_row, x: (
        _accept(p_row[x], q_row[x]), _residual(p_row, q_row), _without(q_row, x)))


def _gbv_order_key(p_row: Row, q_row: Row, token: int):
    """Rank of ``token`` at a node: by p/q ascending (q = 0 ranks last), ties by token id."""
    q = q_row[token]
    return (0, p_row[token] / q, token) if q > 0 else (1, _ZERO, token)


def _gbv_selected(target, draft, paths: Paths, prefix: tuple) -> tuple:
    """X*: the largest drafted path in the lexicographic order of per-node p/q ranks."""
    def key(path):
        return tuple(_gbv_order_key(target(prefix + path[:d]), draft(prefix + path[:d]), x) for d, x in enumerate(path))

    return max(paths, key=key)


def gbv_draft_rows(target, draft, path, num_drafts, prefix=()) -> list[Row]:
    """Rows q^G(. | path[:d]) of the law of the selected path X* along ``path`` (i.i.d. drafts).

    Thomas and Pal 2026 (arXiv 2602.16961): X* is the maximum of K i.i.d. paths in the
    lexicographic order of per-node p/q ranks, so P(X* extends v) = (A_v + Q_v)^K - A_v^K with Q_v =
    q(v) and A_v = the q-mass of the same-length prefixes ordered below v, and
    q^G(t | v) = [(A_v + y(t) + z(t))^K - (A_v + y(t))^K] / [(A_v + Q_v)^K - A_v^K],
    z(t) = Q_v q(t | v), y(t) = Q_v * q(tokens ranked below t | v).

    Returns:
        L rows of V Fractions (row d is the conditional law of X*'s token d+1 given path[:d]); past a
        prefix of draft probability 0 the rows are q's (block verification accepts nothing there).
    """
    target, draft, prefix = exact.as_model(target), exact.as_model(draft), tuple(prefix)
    k = _check_num_drafts(num_drafts)
    rows, below, mass = [], _ZERO, _ONE  # A_v, Q_v
    for d, x in enumerate(path):
        p_row, q_row = target(prefix + tuple(path[:d])), draft(prefix + tuple(path[:d]))
        order = sorted(range(len(q_row)), key=lambda t: _gbv_order_key(p_row, q_row, t))
        cum, y = _ZERO, {}
        for t in order:
            y[t], cum = cum, cum + mass * q_row[t]
        norm = (below + mass) ** k - below**k
        if norm == 0:  # a prefix the draft cannot produce: nothing below it is accepted; keep q
            rows.append(tuple(q_row))
        else:
            rows.append(tuple(((below + y[t] + mass * q_row[t]) ** k - (below + y[t]) ** k) / norm for t in range(len(q_row))))
        below, mass = below + y[x], mass * q_row[x]
    return rows


def _gbv_law(target, draft, paths: Paths, prefix: tuple) -> dict:
    """Greedy multi-path block verification (Thomas and Pal 2026, arXiv 2602.16961).

    Select X* (see :func:`gbv_draft_rows`), then block verification (Sun et al. 2025, Algorithm 2,
    :func:`specresearch.exact.verify_exact` with ``"block"``) of X* with target p and draft rows q^G.
    Block verification is valid for any autoregressive draft law, so this is lossless exactly when
    q^G is the law of X*, i.e. for i.i.d. paths.

    Checked against the reference code released with the paper (its ``gbv_verify`` and ``compute_skew``): the
    selection (the child of highest rank at every depth), the recursion A_(v t) = A_v + Q_v q(tokens below t | v)
    and q^G are the same. One difference, kept on purpose: that code ranks by min(1, p/q), so the tokens with
    p >= q tie, and its selection keeps the first such child drafted while its q^G orders the tie by token id.
    The two orders disagree there and the rule is then lossy (``test_gbv_selection_and_law_must_rank_ties_alike``);
    here one order (p/q unclipped, q = 0 last, ties by token id) serves both.
    """
    best = _gbv_selected(target, draft, paths, prefix)
    draft_rows = gbv_draft_rows(target, draft, best, len(paths), prefix)
    target_rows = [target(prefix + best[:d]) for d in range(len(best) + 1)]
    law: dict = defaultdict(Fraction)
    for (n, token), prob in exact.verify_exact(target_rows, draft_rows, list(best), "block").items():
        law[best[:n] + (token,)] += prob
    return law


def _traversal_law(target, draft, paths: Paths, prefix: tuple) -> dict:
    """Traversal verification (Weng et al., NeurIPS 2025, arXiv 2505.12398), on the merged tree.

    Weights w_root = 1, w_(b, x) = min(1, w_b p(x | b) / q(x | b)) (0 when q = 0). Leaves are visited
    in depth-first post-order, siblings in order of first appearance. At the current node a: accept
    the path to a w.p. w_a (always at the root) and emit one token from the current p(. | a). Else
    delete a and update its parent b: r = max(w_b p(. | b) - q(. | b), 0), Z = sum r,
    w_b <- Z / (Z + 1 - w_b) (0 when Z = 0), p(. | b) <- r / Z (kept when Z = 0), q(. | b) <- q with x
    zeroed and renormalised; the weights below b are recomputed and the next node is b if it has no
    child left, else the first leaf below b's next child. On a chain this is block verification in
    its backward form (the h_i of Sun et al. Algorithm 2 are the updated w_b).

    Checked step by step against what of the paper could be read here (sources in docs/multidraft.md): the
    weights, the post-order walk (its Figure 1 order X3, X4, X1, X5, X2: tests/test_verify_multi.py), accepting the
    whole path at once, the three parent updates (p, q without the token, w_b) and the bonus token from the
    current p, against the formulas of its Algorithm 3 as two public summaries of the paper quote them and against
    the ``traversal_verify`` of the reference code released with GBV (Thomas and Pal); no step differs. Its worked
    example (a parent of ratio 0.5 and a child of ratio 4/3 kept as a sequence with probability 2/3, token by token
    with 1/2) is reproduced exactly (``test_traversal_reproduces_the_papers_worked_example``), its theorem 3.4 (a
    chain is block verification) holds on every chain, and the rule is lossless for both draft laws on every tested
    model (tests/test_exact_multi.py). A reading with w_b <- min(1, Z / (1 - q(x))), seen in another public
    re-implementation, is not (``test_traversal_parent_weight_renormalised_by_the_draft_mass_is_not_lossless``).
    The sibling update zeroes the rejected token in q, i.e. it treats siblings as drawn without replacement;
    reading the merged tree makes i.i.d. drafts fine too (distinct children in order of first appearance are such
    draws).
    """
    children = {u: list(c) for u, c in merged_tree(paths).items()}
    p_rows = {u: target(prefix + u) for u in children}
    q_rows = {u: draft(prefix + u) for u, c in children.items() if c}
    weights = {(): _ONE}

    def reweigh(b: tuple) -> None:
        for x in children[b]:
            weights[b + (x,)] = _accept(weights[b] * p_rows[b][x], q_rows[b][x])
            reweigh(b + (x,))

    def first_leaf(u: tuple) -> tuple:
        while children[u]:
            u = u + (children[u][0],)
        return u

    reweigh(())
    law: dict = defaultdict(Fraction)
    node, mass = first_leaf(()), _ONE
    while mass:
        accept = _ONE if node == () else weights[node]
        _emit(law, node, mass * accept, p_rows[node])
        mass *= 1 - accept
        if not mass:
            break
        parent, x = node[:-1], node[-1]
        w, p_row, q_row = weights[parent], p_rows[parent], q_rows[parent]
        r = [max(w * p - q, _ZERO) for p, q in zip(p_row, q_row)]
        z = sum(r, _ZERO)
        weights[parent] = z / (z + 1 - w) if z > 0 else _ZERO
        p_rows[parent] = tuple(v / z for v in r) if z > 0 else p_row
        q_rows[parent] = _without(q_row, x)
        children[parent].remove(x)
        reweigh(parent)
        node = first_leaf(parent)
    return law


def _onehot_law(target, draft, paths: Paths, prefix: tuple) -> dict:
    """The one-hot rule, for candidates chosen without the verifier's random numbers (top-k trees, lookup).

    At a node the distinct children are tried in order: accept x w.p. p(x) (the current p); on rejection
    p(x) <- 0 and p is renormalised; if every child is rejected, emit a token from what is left; after an
    acceptance descend into x with a fresh p(. | u, x). It is RRS without replacement with q = the
    one-hot row of each candidate, which is how EAGLE-2/3 (``evaluate_posterior``, "qx = 1.0") and
    vLLM's greedy drafts treat a deterministic draft.

    Lossless for ANY choice of candidates that does not look at the verifier's uniforms: at a node with
    candidates x_1..x_m, P(emit x_i) = p(x_i) and P(emit y, y not a candidate) = (1 - p(x_1..x_m)) * p(y) /
    (1 - p(x_1..x_m)) = p(y). Its acceptance at a node is p(candidates), the largest any lossless rule
    can reach for that candidate set (a lossless rule emits y ~ p, and accepts a child only when y is
    one); :func:`specresearch.exact.lp.optimal_verifier_lp` with ``draft_law="topk"`` checks this exactly.
    """
    children = merged_tree(paths)
    return _sequential_law(target, None, prefix, children.__getitem__, lambda p_row, q_row, x: (
        p_row[x], _without(p_row, x), q_row))


_LAWS = {
    "onehot": _onehot_law,
    "rrs": _rrs_law,
    "rrs_without_replacement": _rrs_without_replacement_law,
    "kseq": kseq_public_law,
    "gbv": _gbv_law,
    "traversal": _traversal_law,
}


def _single_law(method: str):
    def law_fn(target, draft, paths: Paths, prefix: tuple) -> dict:
        (path,) = paths
        target_rows = [target(prefix + path[:d]) for d in range(len(path) + 1)]
        draft_rows = [draft(prefix + path[:d]) for d in range(len(path))]
        law: dict = defaultdict(Fraction)
        for (n, token), prob in exact.verify_exact(target_rows, draft_rows, list(path), method).items():
            law[path[:n] + (token,)] += prob
        return law

    return law_fn


def _law_fn(method: str):
    return _single_law(method) if method in _SINGLE else _LAWS[method]


def verify_multi_exact(target, draft, paths, method, prefix=(), draft_law="iid") -> dict[tuple[int, ...], Fraction]:
    """Exact law of the tokens one multi-draft step emits, given the drafted paths.

    The exact twin of ``verify_multi.<method>`` for one batch row (see the module docstring for what
    each method reads: the paths or the merged tree).

    Args:
        target, draft: exact models (:func:`specresearch.exact.as_model`), read at ``prefix + u``.
        paths: K tuples of L token ids, in sampling order (``draft_paths_law`` gives their law).
        method: one of ``MULTI_METHODS``; with K = 1 also ``"token"``, ``"block"``, ``"greedy"``.
        prefix: the context of the step.
        draft_law: the law the paths were drawn with; checked and recorded for the caller, but no
            verifier reads it (a verifier run under the wrong law is exactly what the losslessness
            checks look for).
    Returns:
        ``{accepted tokens + next token: probability}``, positive entries summing to 1. Fractions, except
        K-SEQ with an irrational rho*, whose entries are exact sympy numbers.
    """
    target, draft, prefix = exact.as_model(target), exact.as_model(draft), tuple(prefix)
    _check_draft_law(draft_law)
    vocab = len(target(prefix))
    paths = _check_paths(paths, vocab)
    method = _check_method(method, len(paths), len(paths[0]))
    if len(draft(prefix)) != vocab:
        raise ValueError(f"target and draft must share a vocabulary: rows of {vocab} and {len(draft(prefix))} entries")
    law = {seq: v for seq, v in _law_fn(method)(target, draft, paths, prefix).items() if v != 0}
    assert sympy.simplify(sum(law.values()) - 1) == 0 if method == "kseq" else sum(law.values()) == 1
    return law


def _check_step_args(draft, num_drafts, gamma, method, draft_law):
    num_drafts, gamma = _check_num_drafts(num_drafts), _check_length(gamma)
    return num_drafts, gamma, _check_method(method, num_drafts, gamma), _check_draft_law(draft_law)


# Draft tuples in one step's law from which enumerating it shows a progress bar: (V^gamma)^K grows fast (V = 4, K = 3,
# gamma = 3: 262,144 tuples, 60 s for traversal's expected acceptance here), and a bare loop says nothing meanwhile.
PROGRESS_FROM = 20_000


def _draft_tuples(draft, num_drafts: int, gamma: int, draft_law: str, prefix: tuple, method: str):
    """``draft_paths_law``'s (paths, probability) pairs, behind a progress bar from ``PROGRESS_FROM`` of them."""
    law = draft_paths_law(draft, num_drafts, gamma, draft_law, prefix)
    if len(law) < PROGRESS_FROM:
        return law.items()
    from tqdm.auto import tqdm

    return tqdm(law.items(), total=len(law), unit="drafts", leave=False,
                desc=f"exact {method} step law, K = {num_drafts}, gamma = {gamma}, V = {len(draft(prefix))}")


def _step_law(target, draft, num_drafts: int, gamma: int, method: str, draft_law: str, prefix: tuple) -> dict:
    """{emitted: P} of one step with Fractions (every method but K-SEQ)."""
    law_fn, out = _law_fn(method), defaultdict(Fraction)
    for paths, prob in _draft_tuples(draft, num_drafts, gamma, draft_law, prefix, method):
        for seq, p in law_fn(target, draft, paths, prefix).items():
            out[seq] += prob * p
    return {seq: v for seq, v in out.items() if v}


def _kseq_step_law(target, draft, num_drafts: int, draft_law: str, prefix: tuple):
    """(field, {emitted: element of Q(rho*)}) of one K-SEQ step; rho* depends on the prefix only."""
    field, out = RhoField(kseq_rho(target(prefix), draft(prefix), num_drafts)), {}
    for paths, prob in _draft_tuples(draft, num_drafts, 1, draft_law, prefix, "kseq"):
        _, law = kseq_law(target, draft, paths, prefix, field)
        for seq, v in law.items():
            out[seq] = out.get(seq, field.zero) + field.num(prob) * v
    return field, out


def step_distribution_multi(target, draft, num_drafts, gamma, method, prefix=(), draft_law="iid") -> dict:
    """Law of one multi-draft step, ``{accepted tokens + next token: probability}``.

    The K paths of length ``gamma`` (= L) are drawn by ``draft_law`` (:func:`draft_paths_law`) and
    verified by ``method`` (:func:`verify_multi_exact`); the law is summed over all drafts.
    """
    num_drafts, gamma, method, draft_law = _check_step_args(draft, num_drafts, gamma, method, draft_law)
    target, draft, prefix = exact.as_model(target), exact.as_model(draft), tuple(prefix)
    if method == "kseq":
        field, law = _kseq_step_law(target, draft, num_drafts, draft_law, prefix)
        return {seq: field.public(v) for seq, v in law.items() if v != field.zero}
    return _step_law(target, draft, num_drafts, gamma, method, draft_law, prefix)


def expected_accepted_multi(target, draft, num_drafts, gamma, method, prefix=(), draft_law="iid"):
    """E[accepted draft tokens] of one multi-draft step (0..gamma; the bonus token excluded).

    A Fraction, or for K-SEQ with irrational rho* an exact sympy number (e.g. a quadratic surd).
    """
    law = step_distribution_multi(target, draft, num_drafts, gamma, method, prefix, draft_law)
    total = sum(prob * (len(seq) - 1) for seq, prob in law.items())
    return sympy.radsimp(sympy.expand(total)) if method == "kseq" and not isinstance(total, (int, Fraction)) else Fraction(total)


def speculative_distribution_multi(target, draft, num_drafts, gamma, method, n_tokens, prefix=(), draft_law="iid") -> dict:
    """Exact law of the first ``n_tokens`` tokens of the multi-draft speculative loop (Fractions).

    As :func:`specresearch.exact.speculative_distribution`, one step = K paths drawn by ``draft_law``
    and verified by ``method``. Not available for K-SEQ, whose step laws live in a different number
    field Q(rho*) at every prefix; :func:`is_lossless_multi` checks K-SEQ step by step instead.
    """
    num_drafts, gamma, method, draft_law = _check_step_args(draft, num_drafts, gamma, method, draft_law)
    if method == "kseq":
        raise ValueError("method 'kseq' has irrational step laws; use is_lossless_multi, which checks it step by step")
    target, draft = exact.as_model(target), exact.as_model(draft)
    step_law = lambda pre: _step_law(target, draft, num_drafts, gamma, method, draft_law, pre)  # noqa: E731
    return exact.loop_law(step_law, _check_n_tokens(n_tokens), prefix)


def _check_n_tokens(n_tokens) -> int:
    check_int("n_tokens", n_tokens)
    return n_tokens


def _kseq_lossless(target, draft, num_drafts: int, draft_law: str, n_tokens: int, prefix: tuple) -> bool:
    """K-SEQ emits (x, y ~ p(. | x)) or (y,), so by condition (L) of :mod:`specresearch.exact.lp` the loop
    reproduces the target iff at every prefix the first emitted token has law p(. | prefix). Checked
    exactly in Q(rho*) at every prefix of length < n_tokens (the loop's first n_tokens read no other)."""
    frontier = [prefix]
    for _ in range(n_tokens):
        for pre in frontier:
            field, law = _kseq_step_law(target, draft, num_drafts, draft_law, pre)
            first: dict = defaultdict(lambda: field.zero)
            for seq, v in law.items():
                first[seq[0]] += v
            if any(first[t] != field.num(pt) for t, pt in enumerate(target(pre))):
                return False
        frontier = [pre + (t,) for pre in frontier for t, pt in enumerate(target(pre)) if pt]
    return True


def is_lossless_multi(target, draft, num_drafts, gamma, method, n_tokens, prefix=(), draft_law="iid") -> bool:
    """True iff the multi-draft loop's first ``n_tokens`` tokens have exactly the target's law.

    Every method but K-SEQ: :func:`speculative_distribution_multi` against
    :func:`specresearch.exact.target_distribution` (greedy compared with the argmax path). K-SEQ: the
    equivalent step-by-step check in Q(rho*) (see ``_kseq_lossless``).
    """
    num_drafts, gamma, method, draft_law = _check_step_args(draft, num_drafts, gamma, method, draft_law)
    target_m, draft_m, prefix = exact.as_model(target), exact.as_model(draft), tuple(prefix)
    if method == "kseq":
        return _kseq_lossless(target_m, draft_m, num_drafts, draft_law, _check_n_tokens(n_tokens), prefix)
    spec = speculative_distribution_multi(target_m, draft_m, num_drafts, gamma, method, n_tokens, prefix, draft_law)
    want = exact.target_distribution(target_m, n_tokens, prefix, greedy=method == "greedy")
    return spec == want


def _rational_rows(vocab: int, denominator: int):
    """Every probability row over ``vocab`` tokens whose entries are multiples of 1 / denominator."""
    for counts in itertools.product(range(denominator + 1), repeat=vocab - 1):
        if sum(counts) <= denominator:
            yield tuple(Fraction(c, denominator) for c in counts) + (Fraction(denominator - sum(counts), denominator),)


def smallest_counterexample(method, draft_law, num_drafts=2, *, max_vocab=3, max_denominator=6, n_tokens=1):
    """The first context-free (target, draft) pair on which ``method`` under ``draft_law`` is lossy.

    Searched in the order (V, common denominator, target row, draft row), V = 2..max_vocab, every row
    a multiple of 1 / denominator; a pair fails when :func:`is_lossless_multi` with paths of length 1
    is False. So the answer is smallest in V first and denominator second.

    Returns:
        ``(target_row, draft_row)`` as tuples of Fractions, or None when every pair in range is lossless.
    """
    num_drafts, draft_law = _check_num_drafts(num_drafts), _check_draft_law(draft_law)
    _check_method(method, num_drafts, 1)
    for vocab in range(2, max_vocab + 1):
        for denominator in range(2, max_denominator + 1):
            for target in _rational_rows(vocab, denominator):
                for draft in _rational_rows(vocab, denominator):
                    if not is_lossless_multi(target, draft, num_drafts, 1, method, n_tokens, draft_law=draft_law):
                        return target, draft
    return None
