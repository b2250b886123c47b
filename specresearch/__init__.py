"""specresearch: a research toolkit for speculative decoding with exact twins and machine-checked proofs.

Notation (fixed once for the whole package, following Leviathan et al. 2023):
p = target model (``target_probs``), q = draft model (``draft_probs``), gamma = draft block length,
alpha = E[sum_x min(p, q)]. Reference 002 swaps p and q; the code never does.

The package is eight rooms whose imports point down (docs/README.md, "Layout"; tests/test_layout.py checks it):
``audit`` (the engines' rules decided exactly) over ``experiments`` and ``training``, over ``engine``, over ``drafts`` and ``models``, over ``core`` (batched torch
verifiers) and ``exact`` (rational twins, no torch); ``checks``, ``config`` and ``paths`` are leaf modules.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
