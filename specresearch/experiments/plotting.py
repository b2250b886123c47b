"""Figure helpers shared by the notebooks: one place decides where figures are written."""

from __future__ import annotations

import os
from pathlib import Path

FIGURES_ENV = "SPECRESEARCH_FIGURES"


def figures_dir() -> Path:
    """Directory for PNG figures: ``$SPECRESEARCH_FIGURES`` or ``reports/figures`` under the cwd."""
    path = Path(os.environ.get(FIGURES_ENV, "reports/figures"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def save_figure(fig, name: str, dpi: int = 120) -> Path:
    """Save a matplotlib figure as ``<figures_dir>/<name>.png`` and return the path."""
    if not name or "/" in name or name.endswith(".png"):
        raise ValueError(f"name must be a bare file stem like '01_counterexample', got {name!r}")
    path = figures_dir() / f"{name}.png"
    fig.savefig(path, dpi=dpi, bbox_inches="tight")
    return path


def quick_mode() -> bool:
    """True when ``SPECRESEARCH_QUICK=1``: notebooks shrink their parameters (used by the tests)."""
    return os.environ.get("SPECRESEARCH_QUICK", "0") == "1"
