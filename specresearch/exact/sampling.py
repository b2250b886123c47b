"""Exact rational twins of the sampling transforms of :mod:`specresearch.core.sampling` (no torch).

Each function maps one probability row (a sequence of V exact rationals summing to 1) to the row
:func:`specresearch.core.sampling.logits_to_probs` computes from ``log(row)``, in exact arithmetic, with the
same conventions: transforms in the order temperature, top-k, top-p, epsilon; tokens ranked by a stable
descending sort (ties -> lower token id first); ``T = 0`` is a one-hot at the first maximum; epsilon never
removes the token(s) tied at the maximum. Reference: 001 (top-k, top-p, epsilon, temperature sections).

Which transforms are exact: top-k, top-p and epsilon are restrictions of the row to a set of tokens,
renormalised, so they are rational for rational rows. Temperature maps ``p`` to ``p^(1/T) / sum p^(1/T)``,
rational only when ``1/T`` is an integer: ``T = 1`` (identity), ``T = 1/2, 1/3, ...``, and ``T = 0`` (the
argmax limit); any other ``T`` raises ``ValueError``.

Float parameters of a :class:`~specresearch.config.SamplingConfig` are read as the decimal they print as
(``Fraction(repr(x))``: ``0.9`` means 9/10, ``0.2`` means 1/5), i.e. what the user typed.

:func:`transformed_model` applies a config to a whole model (``specresearch.exact`` model convention), so
``exact.speculative_distribution(transformed_model(target, c), transformed_model(draft, c), ...)`` can be
compared with ``exact.target_distribution(transformed_model(target, c), ...)``: speculative decoding is
lossless with respect to the *transformed* target (tests/test_sampling.py).
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

from specresearch.config import SamplingConfig
from specresearch.exact.single import as_model

__all__ = [
    "exact_param",
    "exact_temperature",
    "exact_top_k",
    "exact_top_p",
    "exact_epsilon",
    "exact_transform",
    "transformed_model",
]

Row = tuple[Fraction, ...]


def exact_param(value, name: str) -> Fraction:
    """A config parameter as a Fraction: rationals exactly, floats as the decimal they print as."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a real number, got {type(value).__name__} {value!r}")
    if isinstance(value, numbers.Rational):
        return Fraction(int(value.numerator), int(value.denominator))
    return Fraction(repr(float(value)))


def _row(row: Sequence) -> Row:
    """Validate a probability row through the exact model checker (exact rationals summing to 1)."""
    return as_model(row)(())


def _restrict(row: Row, keep: set[int]) -> Row:
    """Zero every token outside ``keep`` and renormalise."""
    mass = sum(row[i] for i in keep)
    assert mass > 0, "a transform must keep some probability mass"
    return tuple(row[i] / mass if i in keep else Fraction(0) for i in range(len(row)))


def _ranking(row: Row) -> list[int]:
    """Token ids by decreasing probability; Python's sort is stable, so ties -> lower id first."""
    return sorted(range(len(row)), key=lambda i: -row[i])


def exact_temperature(row: Sequence, temperature) -> Row:
    """``softmax(log(row) / T)`` exactly: one-hot at the first maximum for ``T = 0``; ``row^k`` renormalised
    for ``T = 1/k`` (k a positive integer). Other temperatures are irrational: ``ValueError``."""
    row, t = _row(row), exact_param(temperature, "temperature")
    if t == 0:
        best = _ranking(row)[0]
        return tuple(Fraction(int(i == best)) for i in range(len(row)))
    power = 1 / t if t > 0 else None
    if power is None or power.denominator != 1:
        raise ValueError(
            f"temperature must be 0 or 1/k for a positive integer k to stay rational, got {temperature!r}; "
            "use e.g. 1, 0.5, 0.25 or Fraction(1, 3)"
        )
    powered = [p ** int(power) for p in row]
    return tuple(x / sum(powered) for x in powered)


def exact_top_k(row: Sequence, top_k: int) -> Row:
    """Keep exactly the ``top_k`` most likely tokens (ties -> lower id), renormalised."""
    SamplingConfig(top_k=top_k)  # validates
    row = _row(row)
    return _restrict(row, set(_ranking(row)[:top_k]))


def exact_top_p(row: Sequence, top_p) -> Row:
    """Keep the smallest most-likely prefix of the ranking with mass ``>= top_p``, renormalised."""
    SamplingConfig(top_p=top_p)  # validates
    row, p = _row(row), exact_param(top_p, "top_p")
    keep, mass = set(), Fraction(0)
    for token in _ranking(row):
        if mass >= p:
            break
        keep.add(token)
        mass += row[token]
    return _restrict(row, keep)


def exact_epsilon(row: Sequence, epsilon) -> Row:
    """Drop tokens with probability ``< epsilon`` except those tied at the maximum, renormalised."""
    SamplingConfig(epsilon=epsilon)  # validates
    row, eps = _row(row), exact_param(epsilon, "epsilon")
    top = max(row)
    return _restrict(row, {i for i, p in enumerate(row) if p >= eps or p == top})


def exact_transform(row: Sequence, config: SamplingConfig) -> Row:
    """The exact twin of ``logits_to_probs(log(row), config)``: temperature, top-k, top-p, epsilon."""
    if not isinstance(config, SamplingConfig):
        raise ValueError(f"config must be a SamplingConfig, got {type(config).__name__}")
    row = exact_temperature(row, 0 if config.greedy else config.temperature)
    if config.top_k is not None:
        row = exact_top_k(row, config.top_k)
    if config.top_p is not None:
        row = exact_top_p(row, config.top_p)
    if config.epsilon is not None and config.epsilon > 0:
        row = exact_epsilon(row, config.epsilon)
    return row


@dataclass(frozen=True)
class _TransformedModel:
    """``prefix -> exact_transform(model(prefix), config)``; hashable so ``exact`` can memoise it."""

    model: object
    config: SamplingConfig

    def __call__(self, prefix: tuple[int, ...]) -> Row:
        return exact_transform(self.model(tuple(prefix)), self.config)


def transformed_model(model, config: SamplingConfig):
    """Apply ``config`` to every row of an exact model (any form ``exact.as_model`` accepts).

    Returns a callable ``prefix tuple -> tuple of V Fractions``, usable wherever ``exact`` takes a model.
    """
    if not isinstance(config, SamplingConfig):
        raise ValueError(f"config must be a SamplingConfig, got {type(config).__name__}")
    return _TransformedModel(as_model(model), config)
