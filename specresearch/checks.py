"""Argument checks shared across the package: one mistake, one message.

Pure Python (no torch, no sympy), so the verifiers and the exact twins can both use it.
"""

from __future__ import annotations

import math
import numbers

__all__ = ["check_int", "check_field", "check_real", "named_preset", "OutdatedDependency"]


class OutdatedDependency(ImportError):
    """A dependency older than the package supports; the message names both versions and the fix."""


def check_int(name: str, value, minimum: int = 1, meaning: str = "") -> None:
    """Raise ``ValueError`` unless ``value`` is an integer (``bool`` is not one) with ``value >= minimum``.

    The message reads ``"<name> must be an integer >= <minimum> (<meaning>), got <value!r>"``.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        detail = f" ({meaning})" if meaning else ""
        raise ValueError(f"{name} must be an integer >= {minimum}{detail}, got {value!r}")


def check_field(condition: bool, field: str, message: str) -> None:
    """Raise ``ValueError("<field> <message>")`` unless ``condition``: config validation that names the field."""
    if not condition:
        raise ValueError(f"{field} {message}")


def check_real(name: str, value, low: float | None = None, high: float | None = None, high_open: bool = False) -> None:
    """Raise ``ValueError`` unless ``value`` is a real number (not ``bool``, not NaN), within ``[low, high]``
    (``[low, high)`` with ``high_open``) when bounds are given."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or math.isnan(value):
        raise ValueError(f"{name} must be a real number (not NaN or {type(value).__name__}), got {value!r}")
    if low is None and high is None:
        return
    if value < low or value > high or (high_open and value == high):
        raise ValueError(f"{name} must be a number in [{low}, {high}{')' if high_open else ']'}, got {value!r}")


def named_preset(presets: dict, name: str):
    """``presets[name]``, or a ``ValueError`` listing the names (the ``from_name`` of every config with presets)."""
    if name not in presets:
        raise ValueError(f"name must be one of {sorted(presets)}, got {name!r}")
    return presets[name]
