"""Measuring a draft against its target: acceptance (alpha) along target continuations and the cost ratio c.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from specresearch.config import SamplingConfig
from specresearch.core.sampling import logits_to_probs
from specresearch.engine.timing import TimedCall, interleaved_medians
from specresearch.models.causal_lm import cache_argument, output_cache
from specresearch.training.corpus import Corpus, sample_continuations
from specresearch.training.teacher import _collate, _masked_logits

__all__ = ["DraftMeasurement", "measure_draft", "forward_seconds", "measure_cost_ratio"]


@dataclass(frozen=True)
class DraftMeasurement:
    """Acceptance statistics of a draft along target-generated continuations.

    Attributes:
        alpha: temperature -> mean over positions of sum_x min(p_T(x), q_T(x)), p_T / q_T the target /
            draft distributions at temperature T, along continuations the target sampled at T.
        greedy_agreement: fraction of positions of the target's greedy continuations at which
            argmax q == argmax p.
        positions: temperature -> number of positions averaged (0.0 for the greedy continuations).
    """

    alpha: dict[float, float]
    greedy_agreement: float
    positions: dict[float, int]

    def as_dict(self) -> dict:
        return {"alpha": {str(t): a for t, a in self.alpha.items()}, "greedy_agreement": self.greedy_agreement,
                "positions": {str(t): n for t, n in self.positions.items()}}


@torch.no_grad()
def measure_draft(target, draft, prompt_ids: Sequence[torch.Tensor], *, temperatures: Sequence[float] = (0.2, 0.6, 1.0),
                  max_new_tokens: int = 64, seed: int = 0, eos_token_ids: Sequence[int] = (), prompts_per_batch: int = 2,
                  progress: bool = True) -> DraftMeasurement:
    """alpha at each temperature and the greedy agreement rate on held-out prompts (Leviathan et al. 2023, arXiv 2211.17192).

    For each prompt ``[P]`` the target generates one greedy continuation and one sampled continuation
    per temperature (a ``torch.Generator`` seeded with ``seed``); target and draft are then scored on
    those sequences and the statistics pooled over positions (each generated token's predicting
    position). The result depends on ``prompts_per_batch`` only through float rounding.
    """
    if any(t <= 0 for t in temperatures):
        raise ValueError(f"temperatures must all be > 0 (greedy agreement is always measured), got {temperatures}")
    rows = (0.0, *temperatures)
    generator = torch.Generator().manual_seed(seed)
    sums, counts = dict.fromkeys(rows, 0.0), dict.fromkeys(rows, 0)
    for start in tqdm(range(0, len(prompt_ids), prompts_per_batch), desc="measure", disable=not progress):
        prompts = [ids for ids in prompt_ids[start : start + prompts_per_batch] for _ in rows]
        continuations = sample_continuations(target, prompts, rows * (len(prompts) // len(rows)), max_new_tokens, generator, eos_token_ids)
        corpus = Corpus(tuple(torch.cat([ids, c]) for ids, c in zip(prompts, continuations)), tuple(len(ids) for ids in prompts))
        batch = _collate(corpus, range(len(prompts)), seq_len=max(len(s) for s in corpus.sequences))
        stats = _position_stats(_masked_logits(target, *batch), _masked_logits(draft, *batch), batch[2], rows)
        for t, (total, n) in stats.items():
            sums[t], counts[t] = sums[t] + total, counts[t] + n
    alpha = {t: sums[t] / counts[t] for t in temperatures}
    return DraftMeasurement(alpha, sums[0.0] / counts[0.0], counts)


def _position_stats(target_logits, draft_logits, loss_mask, temperatures) -> dict[float, tuple[float, int]]:
    """Per temperature: (sum of the per-position statistic, number of positions).

    ``target_logits``/``draft_logits`` are ``[N, V]`` at the ``loss_mask [B, L]`` positions; batch row b
    was generated at ``temperatures[b % len(temperatures)]``. The statistic is sum_x min(p_T, q_T) for
    T > 0 and [argmax q == argmax p] for T = 0.
    """
    temperature_of = loss_mask.nonzero()[:, 0] % len(temperatures)  # [N]
    out = {}
    for k, t in enumerate(temperatures):
        tl, dl = target_logits[temperature_of == k].float(), draft_logits[temperature_of == k].float()
        if t == 0:
            values = (tl.argmax(-1) == dl.argmax(-1)).double()
        else:
            cfg = SamplingConfig(temperature=t)
            values = torch.minimum(logits_to_probs(tl, cfg), logits_to_probs(dl, cfg)).sum(-1).double()
        out[t] = (float(values.sum()), len(values))
    return out


@torch.no_grad()
def forward_seconds(models: Sequence, context_length: int = 64, repeats: int = 30, warmup: int = 5) -> list[float]:
    """Median wall time of ONE single-token forward with a KV cache of ``context_length`` tokens (B = 1).

    The models are timed in turn within each repeat (so a shared, noisy CPU affects them alike) and the
    cache is cropped back after every call, so each call sees the same context. A benchmark measurement,
    never asserted on in tests. Returns one median per model, in seconds.
    """
    ids = torch.arange(context_length, dtype=torch.long)[None] % models[0].config.vocab_size  # [1, context_length]
    caches = [output_cache(m(input_ids=ids, use_cache=True, logits_to_keep=1)) for m in models]
    calls = [TimedCall(lambda m=m, c=c: m(input_ids=ids[:, -1:], use_cache=True, **{cache_argument(m): c}),
                       reset=lambda c=c: c.crop(-1))  # drop the token just appended: every call sees the same context
             for m, c in zip(models, caches)]
    return interleaved_medians(calls, repeats=repeats, warmup=warmup)


def measure_cost_ratio(target, draft, context_length: int = 64, repeats: int = 30) -> dict:
    """c = draft forward time / target forward time (single token, cached, B = 1) on this machine."""
    target_s, draft_s = forward_seconds([target, draft], context_length, repeats)
    return {"c": draft_s / target_s, "draft_ms": 1e3 * draft_s, "target_ms": 1e3 * target_s,
            "context_length": context_length, "torch_threads": torch.get_num_threads()}
