"""Exact (rational) analysis: verifier twins, output laws, losslessness, expected tokens, LP optima, theory, sympy.

Nothing in this room imports torch. Every probability is a :class:`fractions.Fraction`.

* :mod:`~specresearch.exact.single` -- single-draft twins (token, block, greedy) and the full loop's law.
* :mod:`~specresearch.exact.multi` -- multi-draft twins (K paths) and their loop; :mod:`~specresearch.exact.kseq`.
* :mod:`~specresearch.exact.sampling` -- exact sampling transforms (top-k, top-p, epsilon).
* :mod:`~specresearch.exact.lp` -- LP certificates of optimality (single and multi-draft).
* :mod:`~specresearch.exact.theory`, :mod:`~specresearch.exact.theory_multi` -- closed forms.
* :mod:`~specresearch.exact.symbolic` -- the references' theorems as sympy proofs.

The single-draft API is re-exported here, so ``from specresearch import exact; exact.is_lossless(...)`` reads as
the room's front.
"""

from specresearch.exact.single import *  # noqa: F401,F403
from specresearch.exact.single import __all__  # noqa: F401
