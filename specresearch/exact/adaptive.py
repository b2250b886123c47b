"""Drafts of adaptive length, exactly: the draft keeps drafting while a stopping rule that reads only the draft side says
so, up to a maximum, and the block it drafted is verified as usual.

Why it stays lossless: a verifier is valid for any draft law (Sun et al. 2025, arXiv 2403.10444: block verification
for any autoregressive draft; Leviathan et al. 2023, arXiv 2211.17192, per token). A stopping rule that reads the
context, the drafted tokens and the draft's rows, never the target or the verifier's random numbers, only changes the
law of the drafted block, a law on blocks of several lengths; given the drafted block the step is an ordinary step of
that length. :func:`adaptive_step_law` enumerates that law and :func:`is_lossless_adaptive` checks the whole loop
(tests/test_adaptive.py: token and block verification, context-dependent stopping rules, random models with zeros).

A stopping rule is ``stop(prefix, block, rows) -> bool``: after drafting ``block`` (1 token or more) from the draft
rows ``rows`` at context ``prefix``, True ends the block. :func:`confidence_rule` is the engine's rule: stop once the
draft's top probability at the next position falls below a threshold (``top="token"``), or the drafted path's
probability does (``top="path"``).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from fractions import Fraction

from specresearch.checks import check_int
from specresearch.exact.single import as_model, loop_law, target_distribution, verify_exact

__all__ = ["adaptive_step_law", "adaptive_distribution", "is_lossless_adaptive", "confidence_rule"]


def confidence_rule(threshold, top: str = "token") -> Callable:
    """Stop when the draft's confidence falls below ``threshold``: its top probability at the next position
    (``"token"``) or the probability of the block drafted so far (``"path"``)."""
    threshold = Fraction(threshold)
    if top not in ("token", "path"):
        raise ValueError(f"top must be 'token' or 'path', got {top!r}")

    def stop(prefix, block, rows, draft) -> bool:
        if top == "token":
            return max(draft(prefix + block)) < threshold
        prob = Fraction(1)
        for row, x in zip(rows, block):
            prob *= row[x]
        return prob < threshold

    return stop


def _blocks(draft, prefix: tuple, max_gamma: int, stop: Callable):
    """(block, probability, draft rows) of every block the adaptive draft can produce (lengths 1..max_gamma)."""
    out = []

    def grow(block: tuple, prob: Fraction, rows: tuple) -> None:
        if block and (len(block) == max_gamma or stop(prefix, block, rows, draft)):
            out.append((block, prob, rows))
            return
        row = draft(prefix + block)
        for x, qx in enumerate(row):
            if qx:
                grow(block + (x,), prob * qx, rows + (row,))

    grow((), Fraction(1), ())
    return out


def adaptive_step_law(target, draft, max_gamma: int, method: str, stop: Callable, prefix=()) -> dict:
    """Law of the tokens one step emits when the draft stops by ``stop`` (module docstring), up to ``max_gamma``."""
    check_int("max_gamma", max_gamma, meaning="the longest block")
    target, draft, prefix = as_model(target), as_model(draft), tuple(prefix)
    law: dict = defaultdict(Fraction)
    for block, prob, rows in _blocks(draft, prefix, max_gamma, stop):
        target_rows = [target(prefix + block[:i]) for i in range(len(block) + 1)]
        for (n, token), p in verify_exact(target_rows, list(rows), list(block), method).items():
            law[block[:n] + (token,)] += prob * p
    return {k: v for k, v in law.items() if v}


def adaptive_distribution(target, draft, max_gamma: int, method: str, stop: Callable, n_tokens: int, prefix=()) -> dict:
    """Exact law of the first ``n_tokens`` tokens of the loop with adaptive blocks."""
    target, draft = as_model(target), as_model(draft)
    return loop_law(lambda pre: adaptive_step_law(target, draft, max_gamma, method, stop, pre), n_tokens, prefix)


def is_lossless_adaptive(target, draft, max_gamma: int, method: str, stop: Callable, n_tokens: int, prefix=()) -> bool:
    """True iff the adaptive loop's first ``n_tokens`` tokens have exactly the target's law."""
    return adaptive_distribution(target, draft, max_gamma, method, stop, n_tokens, prefix) == target_distribution(target, n_tokens, prefix)
