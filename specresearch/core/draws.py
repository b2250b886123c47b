"""Randomness for the verifiers: uniforms drawn from a generator, and inverse-CDF sampling from weights.

Every sampler in :mod:`specresearch.core` turns uniforms into tokens through these, so a test can hand a
verifier pre-drawn uniforms and replay it exactly.
"""

from __future__ import annotations

import torch

__all__ = ["draw_uniforms", "sample_from_weights", "inverse_cdf"]


def draw_uniforms(batch, gamma, generator=None, device=None, dtype=torch.float64):
    """Draw the ``[batch, gamma+1]`` uniforms in [0, 1) a verifier consumes (eta_1..eta_gamma, then the
    inverse-CDF uniform). Drawing once and passing them to several verifiers gives common random numbers.
    """
    if batch < 1:
        raise ValueError(f"batch must be >= 1; got {batch}")
    if gamma < 1:
        raise ValueError(f"gamma must be >= 1 (at least one drafted token); got {gamma}")
    if device is None and generator is not None:
        device = generator.device
    return torch.rand(batch, gamma + 1, generator=generator, device=device, dtype=dtype)


def sample_from_weights(weights, u):
    """Inverse-CDF sample from unnormalised ``weights [B, V]`` with uniforms ``u [B]``; ``[B]`` int64.

    Never returns a zero-weight token of a row with positive mass (the sampler of every verifier here)."""
    return inverse_cdf(weights, u)


def inverse_cdf(weights, u, out=None):
    """Index j with cdf[j-1] <= u * total < cdf[j] for unnormalised ``weights [B, V]`` and ``u [B]``
    (the cdf goes into ``out`` [B, V] when given, e.g. a free work buffer).

    ``right=True`` makes cdf[j] > cdf[j-1], so weights[j] > 0; if rounding puts u * total at or past the
    last cdf value we clamp to the first index where the cdf reaches its total (the last positive weight).
    """
    cdf = torch.cumsum(weights, -1, out=out)  # [B, V]
    total = cdf[:, -1:].contiguous()  # [B, 1]
    picked = torch.searchsorted(cdf, u[:, None] * total, right=True)
    last_positive = torch.searchsorted(cdf, total, right=False)
    return torch.minimum(picked, last_positive).squeeze(1)
