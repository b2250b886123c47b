"""Exact (rational) analysis: verifier twins, output laws, losslessness, expected tokens, LP optima, theory, sympy.

Nothing in this room imports torch. Every probability is a :class:`fractions.Fraction`.

* :mod:`~specresearch.exact.single` -- single-draft twins (token, block, greedy) and the full loop's law.
* :mod:`~specresearch.exact.multi` -- multi-draft twins (K paths) and their loop; :mod:`~specresearch.exact.kseq`.
* :mod:`~specresearch.exact.sampling` -- exact sampling transforms (top-k, top-p, epsilon).
* :mod:`~specresearch.exact.lp` -- LP certificates of optimality (single and multi-draft).
* :mod:`~specresearch.exact.theory`, :mod:`~specresearch.exact.theory_multi` -- closed forms.
* :mod:`~specresearch.exact.symbolic` -- the references' theorems as sympy proofs.

This front re-exports the single-draft API and routes ``num_drafts=`` / ``draft_law=`` of
:func:`expected_accepted`, :func:`speculative_distribution` and :func:`is_lossless` to the multi-draft twins, so
``from specresearch import exact; exact.is_lossless(p, q, 1, "kseq", 2, num_drafts=2)`` reads as one API.
"""

from __future__ import annotations

from fractions import Fraction

from specresearch.exact import lp  # noqa: F401 (exact.lp: the LP certificates, one attribute away)
from specresearch.exact import multi as _multi
from specresearch.exact import single as _single
from specresearch.exact.single import *  # noqa: F401,F403
from specresearch.exact.single import __all__  # noqa: F401 (the same public names)


def _is_multi(method, num_drafts, draft_law) -> bool:
    """Route to :mod:`specresearch.exact.multi` unless this is a single-draft call."""
    return not (num_drafts == 1 and draft_law == "iid" and (callable(method) or method in _single.METHODS))


def expected_accepted(target, draft, gamma, method, prefix=(), *, num_drafts=1, draft_law="iid") -> Fraction:
    """E[num_accepted] of one speculative step (accepted draft tokens, 0..gamma).

    With ``num_drafts`` = K > 1 (or a multi-draft method, or ``draft_law="without_replacement"``) the step drafts
    K paths of length gamma by ``draft_law`` and verifies them with ``method``
    (:func:`specresearch.exact.multi.expected_accepted_multi`; K-SEQ may return an exact sympy surd); otherwise
    :func:`specresearch.exact.single.expected_accepted`.
    """
    if _is_multi(method, num_drafts, draft_law):
        return _multi.expected_accepted_multi(target, draft, num_drafts, gamma, method, prefix, draft_law)
    return _single.expected_accepted(target, draft, gamma, method, prefix)


def speculative_distribution(target, draft, gamma, method, n_tokens, prefix=(), *, num_drafts=1, draft_law="iid") -> dict:
    """Exact law of the first ``n_tokens`` tokens of the full speculative loop (single- or multi-draft steps:
    :func:`specresearch.exact.single.speculative_distribution`,
    :func:`specresearch.exact.multi.speculative_distribution_multi`)."""
    if _is_multi(method, num_drafts, draft_law):
        return _multi.speculative_distribution_multi(target, draft, num_drafts, gamma, method, n_tokens, prefix, draft_law)
    return _single.speculative_distribution(target, draft, gamma, method, n_tokens, prefix)


def is_lossless(target, draft, gamma, method, n_tokens, prefix=(), *, num_drafts=1, draft_law="iid") -> bool:
    """True iff the speculative loop's first ``n_tokens`` have exactly the target's law (single- or multi-draft
    steps: :func:`specresearch.exact.single.is_lossless`, :func:`specresearch.exact.multi.is_lossless_multi`)."""
    if _is_multi(method, num_drafts, draft_law):
        return _multi.is_lossless_multi(target, draft, num_drafts, gamma, method, n_tokens, prefix, draft_law)
    return _single.is_lossless(target, draft, gamma, method, n_tokens, prefix)
