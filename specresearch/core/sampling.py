"""Logits -> probabilities: temperature, top-k, top-p (nucleus) and epsilon truncation.

The one place where sampling transforms live (docs/README.md, "Layout"): plain decoding (``decoding.py``) and
speculative decoding (``generate.py``) both call :func:`logits_to_probs`, so target and draft are
transformed identically and the draft distribution handed to a verifier is exactly the one its tokens
were drawn from. The methods are those of the decoding survey (sections "Top k Sampling", "Top P sampling",
"Epsilon Sampling", "Temperature Scaling"); their exact rational twins are in ``exact_sampling.py``.

Every transform maps logits ``[..., V]`` to logits ``[..., V]`` in which removed tokens are ``-inf``, so
they chain. :func:`logits_to_probs` applies, in this order (the order of transformers' ``generate``):

1. temperature ``T``: ``logits / T``; ``T = 0`` is the limit T -> 0, a one-hot at the FIRST maximal
   logit (``torch.argmax`` semantics);
2. top-k: keep exactly ``k`` tokens;
3. top-p: keep the SMALLEST set of most likely tokens whose probability mass is ``>= p``;
4. epsilon: drop tokens with probability ``< epsilon`` (after steps 1-3, i.e. renormalised); the
   most likely token(s) are never dropped;

then a softmax. Ties (tokens of equal probability at a top-k / top-p boundary) are broken by token id:
tokens are ranked by a *stable* descending sort, so among equal probabilities the LOWER token id ranks
first and is the one kept. Top-k therefore keeps exactly ``k`` tokens and top-p the smallest prefix of
that ranking, deterministically.

Reuse of transformers' logits processors (``transformers.generation.logits_process``):
- ``TemperatureLogitsWarper`` and ``EpsilonLogitsWarper`` are used as they are: they act element-wise /
  along the last axis, ignore ``input_ids`` and do exactly the above for ``T > 0`` and ``0 < epsilon < 1``.
- ``TopKLogitsWarper`` is NOT used: it removes ``scores < k-th largest score``, so every token tied with
  the k-th keeps its place and more than ``k`` tokens can survive.
- ``TopPLogitsWarper`` is NOT used: it sorts ascending with the default (unstable) ``torch.sort`` and
  removes tokens whose ascending cumulative probability is ``<= 1 - top_p``. Without ties that is the
  same set as ours (the kept suffix has mass ``>= p`` and dropping one more token leaves ``< p``; up to
  float rounding at an exact boundary), but at ties the token it keeps is unspecified (in practice the
  HIGHER id, e.g. ``p = (0.5, 0.2, 0.2, 0.1)``, ``top_p = 0.7`` keeps tokens {0, 2}; we keep {0, 1}).
  It also needs 2-D ``scores [B, V]`` (``scatter(1, ...)``); ours take ``[..., V]``. ``tests/test_sampling.py`` pins the
  agreement without ties and the difference at ties.
"""

from __future__ import annotations

import math

import torch
from transformers.generation.logits_process import (
    EpsilonLogitsWarper,
    TemperatureLogitsWarper,
)

from specresearch.config import SamplingConfig
from specresearch.core.draws import sample_from_weights, uniforms, wide

__all__ = [
    "SamplingConfig",
    "apply_temperature",
    "top_k_filter",
    "top_p_filter",
    "epsilon_filter",
    "transform_logits",
    "logits_to_probs",
    "check_logits",
    "logits_flags",
    "LOGITS_ERRORS",
    "sample_tokens",
]


def check_logits(logits: torch.Tensor, name: str = "logits") -> None:
    """Raise ``ValueError`` unless ``logits [..., V]`` is floating, NaN-free, has no +inf and no all--inf row."""
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point():
        raise ValueError(f"{name} must be a floating-point torch.Tensor [..., V], got {type(logits).__name__}"
                         f"{'' if not isinstance(logits, torch.Tensor) else ' of dtype ' + str(logits.dtype)}")
    if logits.ndim == 0 or logits.shape[-1] == 0:
        raise ValueError(f"{name} must have shape [..., V] with V >= 1, got {tuple(logits.shape)}")
    if logits.numel() and bool(torch.isfinite(logits.amax(dim=-1)).all()):
        return  # one pass: a row's maximum is NaN if the row has a NaN, +inf if it has +inf, -inf if all -inf
    for flag, error in zip(logits_flags(logits).tolist(), LOGITS_ERRORS):
        if flag:
            raise ValueError(f"{name} {error}")


def logits_flags(logits: torch.Tensor) -> torch.Tensor:
    """What :func:`check_logits` would raise for, as a tensor and without reading it back: ``[3]`` int64, read off the
    rows' maxima in one pass (a row's maximum is NaN if it has a NaN, else +inf if it has +inf, -inf if every entry
    is): some row has a NaN, some row without NaN has +inf, some row is entirely -inf. The first flag set names the
    error :func:`check_logits` raises; none is set iff it raises none."""
    top = logits.amax(dim=-1)
    return torch.stack([torch.isnan(top).any(), torch.isposinf(top).any(), torch.isneginf(top).any()]).long()


LOGITS_ERRORS = ("contains NaN; check the model output (e.g. an overflow in float16: try bfloat16 or float32; NaN "
                 "weights or inputs; a custom attention mask that hides every key from a query)",
                 "contains +inf; logits must be finite or -inf (for masked tokens)",
                 "has a row where every entry is -inf (all tokens masked); nothing can be sampled")


def _first_argmax_one_hot(logits: torch.Tensor) -> torch.Tensor:
    """Logits form of the one-hot at the first maximum: 0 there, -inf elsewhere. [..., V] -> [..., V]."""
    index = logits.argmax(dim=-1, keepdim=True)  # torch.argmax returns the first maximal index
    out = torch.full_like(logits, -math.inf)
    return out.scatter(-1, index, 0.0)


def apply_temperature(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Temperature scaling ``logits / T`` (the decoding survey, "Temperature Scaling"). [..., V] -> [..., V].

    ``T = 0`` returns the logits of the limit distribution: 0 at the first argmax, -inf elsewhere.
    ``T > 0`` uses transformers' ``TemperatureLogitsWarper`` (a plain division; ``input_ids`` unused).
    """
    SamplingConfig(temperature=temperature)  # validates
    if temperature == 0:
        return _first_argmax_one_hot(logits)
    if temperature == 1:
        return logits
    return TemperatureLogitsWarper(float(temperature))(None, logits)


def _descending_rank(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Stable descending sort: returns (sorted logits, token ids in rank order), ties -> lower id first."""
    return torch.sort(logits, dim=-1, descending=True, stable=True)


def _unsort(mask_sorted: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """Scatter a mask given in rank order back to token order. [..., V] -> [..., V]."""
    return torch.empty_like(mask_sorted).scatter(-1, order, mask_sorted)


def top_k_filter(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """Keep exactly the ``top_k`` highest logits, -inf elsewhere (the decoding survey, "Top k Sampling").

    Ties at the k-th place are broken towards the lower token id (stable sort), unlike transformers'
    ``TopKLogitsWarper``, which keeps every token tied with the k-th. [..., V] -> [..., V].
    """
    SamplingConfig(top_k=top_k)  # validates
    if top_k >= logits.shape[-1]:
        return logits
    _, order = _descending_rank(logits)
    keep_sorted = torch.arange(logits.shape[-1], device=logits.device) < top_k  # [V]
    keep = _unsort(keep_sorted.expand_as(order), order)
    return logits.masked_fill(~keep, -math.inf)


def top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Nucleus filter: keep the smallest most-likely set with probability mass ``>= top_p`` (the decoding survey, "Top P").

    Tokens are ranked by a stable descending sort (ties -> lower token id first); a token is kept iff the
    mass of the tokens ranked strictly before it is ``< top_p`` (cumulative sum in float64). So the first
    token is always kept, the kept mass is ``>= top_p``, and removing the last kept token leaves ``< top_p``.
    ``top_p = 1`` returns the logits unchanged. [..., V] -> [..., V].
    """
    SamplingConfig(top_p=top_p)  # validates
    if top_p == 1:
        return logits
    sorted_logits, order = _descending_rank(logits)
    sorted_probs = torch.softmax(wide(sorted_logits), dim=-1)
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # exclusive cumulative mass
    mass_before[..., 0] = 0.0  # exact, so the most likely token is always kept
    keep = _unsort(mass_before < float(top_p), order)
    return logits.masked_fill(~keep, -math.inf)


def epsilon_filter(logits: torch.Tensor, epsilon: float) -> torch.Tensor:
    """Epsilon sampling: drop tokens with probability ``< epsilon`` (the decoding survey, "Epsilon Sampling").

    Uses transformers' ``EpsilonLogitsWarper`` (``min_tokens_to_keep=1``): the token(s) tied at the maximum
    logit are never dropped, so a row whose tokens are all below ``epsilon`` keeps its most likely one(s).
    Probabilities are the softmax of ``logits`` in their own dtype. ``epsilon = 0`` is the identity.
    [..., V] -> [..., V].
    """
    SamplingConfig(epsilon=epsilon)  # validates
    if epsilon == 0:
        return logits
    return EpsilonLogitsWarper(float(epsilon))(None, logits)


def transform_logits(logits: torch.Tensor, config: SamplingConfig) -> torch.Tensor:
    """Temperature, then top-k, top-p, epsilon; returns logits with removed tokens at -inf. [..., V] -> [..., V]."""
    if not isinstance(config, SamplingConfig):
        raise ValueError(f"config must be a SamplingConfig, got {type(config).__name__}")
    check_logits(logits)
    return _transform(logits, config)


def _transform(logits: torch.Tensor, config: SamplingConfig) -> torch.Tensor:
    """:func:`transform_logits` without the checks (callers have validated). [..., V] -> [..., V]."""
    if config.greedy:
        return _first_argmax_one_hot(logits)
    out = apply_temperature(logits, config.temperature)
    if config.top_k is not None:
        out = top_k_filter(out, config.top_k)
    if config.top_p is not None:
        out = top_p_filter(out, config.top_p)
    if config.epsilon is not None:
        out = epsilon_filter(out, config.epsilon)
    return out


def logits_to_probs(logits: torch.Tensor, config: SamplingConfig, *, validate: bool = True) -> torch.Tensor:
    """The sampling distribution of ``config`` for next-token ``logits``. [..., V] -> [..., V].

    float32 / float64 inputs keep their dtype; other floating dtypes (half, bfloat16) are computed in
    float32. Greedy configs give an exact one-hot at the first argmax. Raises ``ValueError`` for NaN,
    +inf, a row that is entirely -inf, or a non-floating tensor; ``validate=False`` skips the value checks (a
    host read on a GPU): the caller checks :func:`logits_flags` later.
    """
    if not isinstance(config, SamplingConfig):
        raise ValueError(f"config must be a SamplingConfig, got {type(config).__name__}")
    if validate:
        check_logits(logits)
    if logits.dtype not in (torch.float32, torch.float64):
        logits = logits.float()
    if config.greedy:  # the softmax of _first_argmax_one_hot's logits, without computing it
        return torch.zeros_like(logits).scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
    return torch.softmax(_transform(logits, config), dim=-1)


def sample_tokens(probs: torch.Tensor, generator: torch.Generator | list[torch.Generator] | None = None) -> torch.Tensor:
    """One token per row of ``probs [B, V]`` -> ``[B]`` int64, by the inverse CDF of one uniform per row.

    The sampler of plain and speculative decoding (the verifiers' own, ``verify.sample_from_weights``): a
    zero-probability token is never drawn, and each call consumes exactly one float64 uniform per row,
    whatever the probabilities (so runs that share a generator stay aligned: common random numbers).
    ``generator``: one ``torch.Generator`` for all rows, one per row (a list of B), or None (global RNG).
    On a 49k-token row it costs a cumsum and two binary searches (~0.05 ms on one CPU thread, against
    ~1 ms for ``torch.multinomial``).
    """
    if probs.ndim != 2:
        raise ValueError(f"probs must be [B, V], got shape {tuple(probs.shape)}")
    if isinstance(generator, (list, tuple)):
        if len(generator) != probs.shape[0]:
            raise ValueError(f"generator must be one torch.Generator or one per row ({probs.shape[0]}), got {len(generator)}")
        u = torch.cat([uniforms(1, g, probs.device) for g in generator])
    else:
        u = uniforms(probs.shape[0], generator, probs.device)
    return sample_from_weights(probs, u)
