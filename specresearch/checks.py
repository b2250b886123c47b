"""Argument checks shared across the package: one mistake, one message.

Pure Python (no torch, no sympy), so the verifiers and the exact twins can both use it.
"""

from __future__ import annotations

import numbers

__all__ = ["check_int"]


def check_int(name: str, value, minimum: int = 1, meaning: str = "") -> None:
    """Raise ``ValueError`` unless ``value`` is an integer (``bool`` is not one) with ``value >= minimum``.

    The message reads ``"<name> must be an integer >= <minimum> (<meaning>), got <value!r>"``.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        detail = f" ({meaning})" if meaning else ""
        raise ValueError(f"{name} must be an integer >= {minimum}{detail}, got {value!r}")
