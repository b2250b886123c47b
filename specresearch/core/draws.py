"""Randomness for the verifiers: uniforms drawn from a generator, and inverse-CDF sampling from weights.

Every sampler in :mod:`specresearch.core` turns uniforms into tokens through these, so a test can hand a
verifier pre-drawn uniforms and replay it exactly.
"""

from __future__ import annotations

import torch

__all__ = ["uniforms", "wide", "draw_uniforms", "sample_from_weights", "inverse_cdf"]


def uniforms(shape, generator=None, device=None, dtype=torch.float64) -> torch.Tensor:
    """Uniforms in [0, 1) of ``shape``, drawn on the generator's device (so a CPU generator serves CUDA
    probabilities, and a CUDA generator draws on the GPU) and returned on ``device`` (default: where drawn).
    ``dtype`` float64 by default, float32 on an Apple GPU, which has no float64."""
    source = generator.device if generator is not None else torch.device(device or "cpu")
    drawn = torch.rand(shape, generator=generator, device=source, dtype=torch.float32 if source.type == "mps" else dtype)
    target = source if device is None else torch.device(device)
    return drawn.to(target, torch.float32 if target.type == "mps" else drawn.dtype)


def wide(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` in float64 where its device has it (an Apple GPU has none: float32 there). For the few sums
    that keep float64 (docs/engine_and_models.md, "Devices")."""
    return tensor.float() if tensor.device.type == "mps" else tensor.double()


def draw_uniforms(batch, gamma, generator=None, device=None, dtype=torch.float64):
    """Draw the ``[batch, gamma+1]`` uniforms in [0, 1) a verifier consumes (eta_1..eta_gamma, then the
    inverse-CDF uniform), on ``device`` (default the generator's; drawn on the generator's, see :func:`uniforms`).
    Drawing once and passing them to several verifiers gives common random numbers.
    """
    if batch < 1:
        raise ValueError(f"batch must be >= 1; got {batch}")
    if gamma < 1:
        raise ValueError(f"gamma must be >= 1 (at least one drafted token); got {gamma}")
    return uniforms((batch, gamma + 1), generator, device, dtype)


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
