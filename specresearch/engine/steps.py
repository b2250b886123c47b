"""What the generation loops share: the per-step record and the small stages of a step (probabilities with an error
naming the stage, one token per row, the draft's next pending block)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specresearch.config import SamplingConfig
from specresearch.core.sampling import LOGITS_ERRORS, check_logits, logits_flags, logits_to_probs, sample_tokens

__all__ = ["StepRecord", "StepChecks"]


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
    # [B] tokens the target scored for each row: the pending token and the drafted tokens (a tree's distinct nodes)
    scored: tuple[int, ...] = ()

    @property
    def overhead_seconds(self) -> float:
        """Everything but the two models' forward passes: sampling, verification, bookkeeping."""
        return self.seconds - self.target_seconds - self.draft_seconds


def _check(logits: torch.Tensor, stage: str) -> None:
    """``check_logits`` with :func:`_probs`' error, for a step that reads the logits' argmax alone."""
    try:
        check_logits(logits)
    except ValueError as error:
        raise ValueError(f"{stage}: {error}") from error


def _probs(logits: torch.Tensor, sampling: SamplingConfig, stage: str) -> torch.Tensor:
    """``logits_to_probs``, with an error that names the model / stage whose logits were bad."""
    try:
        return logits_to_probs(logits, sampling)
    except ValueError as error:
        raise ValueError(f"{stage}: {error}") from error


class StepChecks:
    """The logits checks of one step, read back once with the step's tokens instead of once per model call (a host
    read each on a GPU). A row whose logits fail gets uniform probabilities, so the step runs on to its one read;
    :meth:`raise_first` then raises ``check_logits``' error for the first failing stage."""

    def __init__(self):
        self.stages: list[str] = []
        self.flags: list[torch.Tensor] = []

    def probs(self, logits: torch.Tensor, sampling: SamplingConfig, stage: str) -> torch.Tensor:
        """``logits_to_probs`` with its value checks deferred (``_probs`` otherwise)."""
        probs = logits_to_probs(logits, sampling, validate=False)
        flags = logits_flags(logits)
        self.stages.append(stage)
        self.flags.append(flags)
        return probs.masked_fill(flags.any(), 1.0 / probs.shape[-1])

    def check(self, logits: torch.Tensor, stage: str) -> None:
        """Defer ``check_logits`` for a stage that reads the logits' argmax alone."""
        self.stages.append(stage)
        self.flags.append(logits_flags(logits))

    def tensor(self) -> torch.Tensor:
        """``[3 * calls]`` int64, to read back with the step's other values."""
        return torch.cat(self.flags) if self.flags else torch.zeros(0, dtype=torch.long)

    def raise_first(self, values: list[int]) -> None:
        """``values``: :meth:`tensor` read back. Raises ``ValueError`` naming the first stage whose logits failed."""
        for i, stage in enumerate(self.stages):
            for flag, error in zip(values[3 * i : 3 * i + 3], LOGITS_ERRORS):
                if flag:
                    raise ValueError(f"{stage}: logits {error}")


def read_step(checks: StepChecks, *tensors: torch.Tensor) -> list[list[int]]:
    """The one host read of a step: ``tensors`` (``[B]`` or ``[B, n]`` int64 each) side by side with the checks'
    flags. Raises the checks' error; returns one list per row, the tensors' columns in order."""
    columns = torch.cat([t.reshape(t.shape[0], -1).long() for t in tensors], 1)
    flags = checks.tensor().to(columns.device)
    values = torch.cat([columns.reshape(-1), flags]).tolist()
    checks.raise_first(values[columns.numel():])
    width = columns.shape[1]
    return [values[b * width : (b + 1) * width] for b in range(columns.shape[0])]


def _sample(probs: torch.Tensor, sampling: SamplingConfig, generators) -> torch.Tensor:
    """One token per row from ``probs [B, V]`` -> ``[B]``; greedy configs take the (one-hot) argmax.

    ``generators``: one shared ``torch.Generator``, or a list with one per row (``sampling.sample_tokens``).
    """
    if sampling.greedy:
        return probs.argmax(-1)
    return sample_tokens(probs, generators)


def _draft_pending(draft_tokens, result, gamma, accepted: list[int] | None = None):
    """Next pending block of the draft: ([x_gamma, next_token] [B, 2], valid [B, 2]), or [B, 1] when no row took all.
    ``accepted``: ``num_accepted`` already read back (no host read here)."""
    full = result.num_accepted == gamma  # [B]
    if not (gamma in accepted if accepted is not None else bool(full.any())):
        return result.next_token[:, None], None
    tokens = torch.stack([draft_tokens[:, -1], result.next_token], 1)
    return tokens, torch.stack([full, torch.ones_like(full)], 1)


def _accepted_block(draft_tokens, result, longest: int):
    """``[x_1..x_n, next_token]`` of each row, right-aligned in ``[B, longest + 1]`` (``longest``: max n, read back
    already). -> (tokens, valid, source): ``source[b, j]`` the path position of slot j (0 the pending token)."""
    n = result.num_accepted  # [B]
    width = longest + 1
    source = torch.arange(width, device=n.device)[None] - (width - 1 - n[:, None])  # [B, width]
    valid = source >= 0
    source = source.clamp(min=0)
    tokens = torch.cat([draft_tokens, draft_tokens[:, :1]], 1).scatter(1, n[:, None], result.next_token[:, None])
    return tokens.gather(1, source), valid, source


def _refeed(draft, draft_tokens, result, features, longest: int):
    """After verification, a reading draft is re-fed ``[x_1..x_n, next_token]`` (right-aligned, ``valid`` mask)
    with the target's true features of the slots before them, ``[pending, x_1..x_n]`` (``features [B, gamma+1, F]``;
    ``longest``: max n, read back already). Returns the draft's pending block and its validity ``[B, max n + 1]``."""
    tokens, valid, source = _accepted_block(draft_tokens, result, longest)
    block_features = features.gather(1, source[:, :, None].expand(-1, -1, features.shape[-1])) * valid[:, :, None]
    draft.observe(block_features)
    return tokens, valid
