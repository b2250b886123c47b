"""What both generation loops (:mod:`specresearch.engine.generate`'s and the captured steps of
:mod:`specresearch.engine.static`) hand back and share: the result of a call, the rows being built, the prompt and
seed checks, the clock's last wait."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Callable, Sequence

import torch

from specresearch.engine.steps import StepRecord
from specresearch.engine.timing import clock
from specresearch.models.protocols import PlansContext

__all__ = ["eos_ids", "GenerationResult", "check_context"]


@dataclass(frozen=True)
class GenerationResult:
    """Tokens and per-step records of one generation call."""

    tokens: tuple[tuple[int, ...], ...]  # [B] rows of new tokens (prompt excluded), each <= max_new_tokens
    steps: tuple[StepRecord, ...]
    prefill_seconds: float
    text: tuple[str, ...] | None = None  # decoded rows when a tokenizer was given, special tokens (an EOS) left out
    method: str = "speculative"
    compile_seconds: float = 0.0  # compiling or capturing a captured step before the first (engine.static); not in seconds

    @property
    def num_tokens(self) -> int:
        return sum(len(row) for row in self.tokens)

    @property
    def seconds(self) -> float:
        return self.prefill_seconds + sum(s.seconds for s in self.steps)

    @property
    def tokens_per_second(self) -> float:
        return self.num_tokens / self.seconds

    @property
    def target_calls(self) -> int:
        return sum(s.target_calls for s in self.steps)

    @property
    def draft_calls(self) -> int:
        return sum(s.draft_calls for s in self.steps)

    @property
    def block_efficiency(self) -> float:
        """Mean tokens emitted per target call per active row, num_accepted + 1, before truncation."""
        counts = [n + 1 for s in self.steps for n, a in zip(s.num_accepted, s.active) if a]
        return sum(counts) / len(counts)

    @property
    def tokens_per_scored(self) -> float:
        """Tokens emitted per token the target scored (pending + drafted tokens; a tree's distinct nodes), over the
        active rows: what a step's target call buys per unit of its width, the measure for trees of different sizes."""
        emitted = [(n + 1, c) for s in self.steps for n, a, c in zip(s.num_accepted, s.active, s.scored) if a]
        return sum(e for e, _ in emitted) / sum(c for _, c in emitted) if emitted else float("nan")

    @property
    def acceptance_rate(self) -> float:
        """Estimate of alpha: accepted drafts / drafts examined (a rejection ends a step's examination).

        The maximum-likelihood estimate when acceptances are i.i.d. Bernoulli(alpha), the assumption
        behind E[tokens] = (1 - alpha^(gamma+1)) / (1 - alpha) (Leviathan et al. 2023). Exact for token
        verification under that assumption; a summary statistic for block verification.
        """
        rows = [(n, s.gamma) for s in self.steps for n, a in zip(s.num_accepted, s.active) if a and s.gamma]
        accepted = sum(n for n, _ in rows)
        examined = accepted + sum(n < g for n, g in rows)
        return accepted / examined if examined else float("nan")

    def speedup_over(self, baseline: "GenerationResult") -> float:
        """Wall-clock speedup in tokens per second over ``baseline`` (e.g. an autoregressive result)."""
        return self.tokens_per_second / baseline.tokens_per_second


@dataclass
class _Rows:
    """Per-row output being built: tokens so far and whether the row is done."""

    limit: int
    eos: frozenset[int]
    tokens: list[list[int]] = field(default_factory=list)
    done: list[bool] = field(default_factory=list)
    stop: Callable[[int, list[int]], bool] | None = None  # (row, its tokens so far) -> True ends it, like EOS

    def add(self, emitted: list[list[int]]) -> list[list[int]]:
        """Append each active row's emitted tokens, cut at EOS / the limit; return what was kept."""
        kept = []
        for b, new in enumerate(emitted):
            new = [] if self.done[b] else new[: self.limit - len(self.tokens[b])]
            stop = next((i for i, t in enumerate(new) if t in self.eos or self._stops(b, new[: i + 1])), None)
            new = new if stop is None else new[: stop + 1]
            self.tokens[b].extend(new)
            self.done[b] = self.done[b] or stop is not None or len(self.tokens[b]) >= self.limit
            kept.append(new)
        return kept

    def _stops(self, b: int, head: list[int]) -> bool:
        return self.stop is not None and self.stop(b, self.tokens[b] + head)

    def remaining(self) -> int:
        return max(self.limit - len(t) for t, d in zip(self.tokens, self.done) if not d)


def check_context(model, ids: torch.Tensor, max_new_tokens: int, lookahead: int = 0) -> None:
    """Raise unless the prompt ids are in the model's vocabulary and prompt + new tokens + lookahead fit its
    positions (``max_context``, if it has one)."""
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= model.vocab_size:
        raise ValueError(
            f"prompt token ids must be in [0, vocab_size={model.vocab_size}), got values in [{low}, {high}]: "
            "encode the prompt with this model's tokenizer (its tokenizer may be larger than its logits)"
        )
    limit = getattr(model, "max_context", None)
    need = ids.shape[1] + max_new_tokens + lookahead
    if limit is not None and need > limit:
        raise ValueError(
            f"prompt of {ids.shape[1]} tokens + max_new_tokens={max_new_tokens} + gamma lookahead {lookahead} "
            f"needs {need} positions but the model's context is {limit}: shorten the prompt or lower max_new_tokens"
        )


def plan_context(model, ids: torch.Tensor, mask: torch.Tensor, max_new_tokens: int) -> None:
    """Tell ``model`` the run's context where its calls depend on it (``PlansContext``): the longest prompt plus
    ``max_new_tokens``, the positions a token may be emitted at, so that a run emits the same tokens whatever its
    steps' lookahead (gamma, a tree's depth) and batch; and its shortest prompt (``mask [B, L]``: a run whose prompts
    all pass Phi-3's original length keeps one set)."""
    if isinstance(model, PlansContext):
        model.plan_context(ids.shape[1] + max_new_tokens, int(mask.sum(-1).min()))


def _generators(seed, batch: int, device) -> torch.Generator | list[torch.Generator]:
    """One generator shared by the batch (``seed`` an int, or a ``torch.Generator`` used as it is) or a list, one per
    row (one int per prompt)."""
    if isinstance(seed, torch.Generator):
        return seed
    if isinstance(seed, int) and not isinstance(seed, bool):
        return torch.Generator(device=device).manual_seed(seed)
    seeds = list(seed) if isinstance(seed, Sequence) else []
    if len(seeds) != batch or not all(isinstance(s, int) and not isinstance(s, bool) for s in seeds):
        raise ValueError(f"seed must be an int, a torch.Generator or a list of one int per prompt ({batch} prompts), "
                         f"got {seed!r}")
    return [torch.Generator(device=device).manual_seed(s) for s in seeds]


def eos_ids(eos_token_id, tokenizer, target=None) -> frozenset[int]:
    """The ids that end a row: ``eos_token_id`` as given; without it, with a tokenizer, the tokenizer's EOS and those
    of ``target``'s transformers generation config, where transformers' ``generate`` stops too (Gemma's
    ``<end_of_turn>``, Phi-3's ``<|end|>``: a chat turn ends there, not at the tokenizer's EOS)."""
    if eos_token_id is None and tokenizer is not None:
        config = getattr(getattr(target, "model", None), "generation_config", None)
        ids = [tokenizer.eos_token_id, *_ids(getattr(config, "eos_token_id", None))]
        return frozenset(i for i in ids if i is not None)
    return frozenset(_ids(eos_token_id))


def _ids(eos_token_id) -> list[int]:
    if eos_token_id is None:
        return []
    return [eos_token_id] if isinstance(eos_token_id, int) else [int(i) for i in eos_token_id]


def _untimed(steps: list[StepRecord], tick, device) -> list[StepRecord]:
    """With per-step timing off (host clock): wait for the device once and give the last step the wait, so the steps'
    seconds add up to the call's; the per-step target / draft split is NaN (host dispatch times mean nothing)."""
    if tick is not time.perf_counter or not steps:
        return steps
    end = time.perf_counter()
    wait = clock(device) - end
    nan = float("nan")
    steps = [replace(s, target_seconds=nan, draft_seconds=nan) for s in steps]
    steps[-1] = replace(steps[-1], seconds=steps[-1].seconds + wait)
    return steps


def _result(rows: _Rows, steps, prefill_seconds, tokenizer, method, compile_seconds: float = 0.0) -> GenerationResult:
    tokens = tuple(tuple(r) for r in rows.tokens)
    text = None if tokenizer is None else tuple(tokenizer.decode(list(r), skip_special_tokens=True) for r in tokens)
    return GenerationResult(tokens, tuple(steps), prefill_seconds, text, method, compile_seconds)
