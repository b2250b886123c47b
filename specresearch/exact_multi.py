"""Exact rational twins of the multi-draft verifiers: the specification of ``verify_multi``.

Notation as in :mod:`specresearch.exact`: p = target, q = draft, K = number of draft paths
(``num_drafts``), L = path length (``gamma`` of the single-draft code). Probabilities are
:class:`fractions.Fraction`; K-SEQ's acceptance threshold rho* is algebraic and is computed exactly
with sympy (its laws are sympy numbers, see :func:`kseq_rho`). Nothing here imports torch. The rules
are those of ``references/multidraft.md``; each law function below says which paper and what was
checked.

The contract shared with :mod:`specresearch.verify_multi` (the torch side)
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
  - with K = 1 only: ``"token"``, ``"block"``, ``"greedy"`` are the single-draft twins of
    :func:`specresearch.exact.verify_exact`.

* Zero-mass conventions are those of ``verify``: a draft token with current q = 0 is rejected with
  probability 1; a token with p = 0 is never accepted; a residual of zero mass falls back to the
  current target row (as ``exact._residual``).
"""

from __future__ import annotations

__all__ = [
    "MULTI_METHODS",
    "DRAFT_LAWS",
    "draft_paths_law",
    "verify_multi_exact",
    "step_distribution_multi",
    "expected_accepted_multi",
    "speculative_distribution_multi",
    "is_lossless_multi",
    "kseq_rho",
]

MULTI_METHODS = ("rrs", "rrs_without_replacement", "kseq", "gbv", "traversal")
DRAFT_LAWS = ("iid", "without_replacement")
