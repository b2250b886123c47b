"""Vectorised Monte Carlo of one speculative step for context-free (i.i.d.) models.

Used by notebooks to check the torch verifiers against the exact values of ``specresearch.exact``:
draft blocks are drawn from q, verified in ONE batched call of ``verify.VERIFIERS[method]``, and the
mean number of accepted draft tokens is reported with its standard error (normal approximation; 95%
interval by default, any z on request).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from specresearch.checks import check_int
from specresearch.core.draws import draw_uniforms
from specresearch.core.verify import VERIFIERS

__all__ = ["Z95", "MonteCarloEstimate", "simulate_accepted"]

Z95 = 1.959963984540054  # Phi^{-1}(0.975)


@dataclass(frozen=True)
class MonteCarloEstimate:
    """Sample mean of a per-trial quantity and its standard error (sd / sqrt(trials))."""

    mean: float
    stderr: float
    trials: int

    def interval(self, z: float = Z95) -> tuple[float, float]:
        """Two-sided normal-approximation interval mean +- z * stderr (z = 1.96: 95%)."""
        return self.mean - z * self.stderr, self.mean + z * self.stderr

    @property
    def low(self) -> float:
        return self.interval()[0]

    @property
    def high(self) -> float:
        return self.interval()[1]

    def contains(self, value, z: float = Z95) -> bool:
        """True iff ``value`` (float or Fraction) lies in ``interval(z)``."""
        low, high = self.interval(z)
        return low <= float(value) <= high


def _row(probs, name: str) -> torch.Tensor:
    row = torch.tensor([float(v) for v in probs], dtype=torch.float64)  # [V]
    if row.dim() != 1 or row.numel() < 1 or bool((row < 0).any()) or abs(float(row.sum()) - 1) > 1e-12:
        raise ValueError(f"{name} must be one probability row (non-negative, summing to 1), got {list(probs)}")
    return row


def _estimate(values: torch.Tensor) -> MonteCarloEstimate:
    """Mean and standard error sd / sqrt(n) of ``values [n]``."""
    n = values.numel()
    stderr = float(values.std(unbiased=True)) / math.sqrt(n)
    return MonteCarloEstimate(mean=float(values.mean()), stderr=stderr, trials=n)


def simulate_accepted(target, draft, gamma, method, trials, seed) -> MonteCarloEstimate:
    """Estimate E[num_accepted] of one step of ``method`` for i.i.d. target/draft rows.

    Args:
        target: V probabilities p (Fractions or floats), the same at every position.
        draft: V probabilities q.
        gamma: draft block length >= 1.
        method: a key of ``verify.VERIFIERS`` ("token", "block", "greedy").
        trials: number of independent steps (one batched verifier call of that size), >= 2.
        seed: seed of the ``torch.Generator`` drawing the drafts and the uniforms.
    Returns:
        ``MonteCarloEstimate`` of the mean number of accepted draft tokens. The same seed for two
        methods gives the same draft blocks and uniforms (common random numbers).
    """
    target_row, draft_row = _row(target, "target"), _row(draft, "draft")
    if target_row.numel() != draft_row.numel():
        raise ValueError(f"target has {target_row.numel()} entries but draft has {draft_row.numel()}")
    check_int("gamma", gamma)
    if method not in VERIFIERS:
        raise ValueError(f"method must be one of {sorted(VERIFIERS)}, got {method!r}")
    check_int("trials", trials, minimum=2)
    generator = torch.Generator().manual_seed(seed)
    vocab = target_row.numel()
    tokens = torch.multinomial(draft_row, trials * gamma, replacement=True, generator=generator)
    tokens = tokens.view(trials, gamma)  # [trials, gamma]
    uniforms = draw_uniforms(trials, gamma, generator=generator)  # [trials, gamma+1]
    result = VERIFIERS[method](
        target_row.expand(trials, gamma + 1, vocab), draft_row.expand(trials, gamma, vocab), tokens, uniforms=uniforms
    )
    return _estimate(result.num_accepted.double())
