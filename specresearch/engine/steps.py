"""What the generation loops share: the per-step record and the small stages of a step (probabilities with an error
naming the stage, one token per row, the draft's next pending block)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specresearch.config import SamplingConfig
from specresearch.core.sampling import logits_to_probs, sample_tokens

__all__ = ["StepRecord"]


@dataclass(frozen=True)
class StepRecord:
    """What one step did: one target call, ``draft_calls`` draft calls (0 for autoregressive steps)."""

    num_accepted: tuple[int, ...]  # [B] drafts accepted per row (0..gamma); 0 for autoregressive steps
    active: tuple[bool, ...]  # [B] row still generating when the step started
    gamma: int  # drafts proposed per row this step (0 for autoregressive steps)
    target_calls: int
    draft_calls: int
    seconds: float  # wall time of the whole step
    target_seconds: float  # of which inside the target's forward passes
    draft_seconds: float  # of which inside the draft's forward passes
    # Opt-in (``speculative_generate(expectations=...)``): per method, E[num_accepted | this step's block]
    # per row ([B] each, ``verify.expected_num_accepted``), and per row the mean over the block's
    # positions i < gamma of sum_x min(p_i(x), q_i(x)) ([B]).
    expected: dict[str, tuple[float, ...]] = field(default_factory=dict, hash=False)
    overlap: tuple[float, ...] = ()

    @property
    def overhead_seconds(self) -> float:
        """Everything but the two models' forward passes: sampling, verification, bookkeeping."""
        return self.seconds - self.target_seconds - self.draft_seconds


def _probs(logits: torch.Tensor, sampling: SamplingConfig, stage: str) -> torch.Tensor:
    """``logits_to_probs``, with an error that names the model / stage whose logits were bad."""
    try:
        return logits_to_probs(logits, sampling)
    except ValueError as error:
        raise ValueError(f"{stage}: {error}") from error


def _sample(probs: torch.Tensor, sampling: SamplingConfig, generators) -> torch.Tensor:
    """One token per row from ``probs [B, V]`` -> ``[B]``; greedy configs take the (one-hot) argmax.

    ``generators``: one shared ``torch.Generator``, or a list with one per row (``sampling.sample_tokens``).
    """
    if sampling.greedy:
        return probs.argmax(-1)
    return sample_tokens(probs, generators)


def _draft_pending(draft_tokens, result, gamma):
    """Next pending block of the draft: ([x_gamma, next_token] [B, 2], valid [B, 2]), or [B, 1] when no row took all."""
    full = result.num_accepted == gamma  # [B]
    if not bool(full.any()):
        return result.next_token[:, None], None
    tokens = torch.stack([draft_tokens[:, -1], result.next_token], 1)
    return tokens, torch.stack([full, torch.ones_like(full)], 1)
