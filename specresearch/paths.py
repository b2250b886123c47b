"""Where things live: the source checkout's ``data/`` folder and the per-machine cache.

Pure Python, like :mod:`specresearch.checks`: every room may use it.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["repo_root", "data_dir", "cache_dir"]


def repo_root() -> Path:
    """The source checkout (the package is installed editable): ``data/``, ``benchmarks/``, ``docs/`` live here."""
    return Path(__file__).resolve().parent.parent


def data_dir(*parts: str) -> Path:
    """``<checkout>/data/<parts...>``: shipped drafts, prompt sets, committed corpora."""
    return repo_root().joinpath("data", *parts)


def cache_dir(*parts: str) -> Path:
    """``$SPECRESEARCH_CACHE/<parts...>`` (default ``~/.cache/specresearch``): converted models, corpora,
    checkpoints, per-machine choices. An empty ``SPECRESEARCH_CACHE`` means the default."""
    root = os.environ.get("SPECRESEARCH_CACHE") or Path.home() / ".cache" / "specresearch"
    return Path(root).joinpath(*parts)
