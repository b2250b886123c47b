"""How trained drafts are stored: the shipped folder, manifests, storage dtypes, the target's fingerprint.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch

from specresearch.paths import data_dir

__all__ = ["drafts_dir", "shipped_drafts", "embedding_fingerprint", "manifest_path", "read_manifest", "write_manifest"]


_STORAGE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


_MANIFEST_FILE = "manifest.json"




def shipped_drafts(root: str | os.PathLike | None = None) -> list[str]:
    """Names of the trained drafts under ``root`` (default :func:`drafts_dir`), sorted."""
    directory = Path(root) if root is not None else drafts_dir()
    return sorted(p.name for p in directory.glob("*") if manifest_path(p).exists())


def drafts_dir() -> Path:
    """``data/drafts`` of the source checkout (the package is installed editable), where drafts ship."""
    return data_dir("drafts")


def embedding_fingerprint(model) -> dict:
    """Sizes and float64 moments of the input embedding: identifies the target up to dtype rounding."""
    weight = model.get_input_embeddings().weight.detach().double()
    return {
        "vocab_size": int(weight.shape[0]),
        "hidden_size": int(weight.shape[1]),
        "embedding_sum": float(weight.sum()),
        "embedding_sq_sum": float((weight * weight).sum()),
    }


def _check_fingerprint(target, expected: dict, where: Path) -> None:
    actual = embedding_fingerprint(target)
    same_shape = all(actual[k] == expected[k] for k in ("vocab_size", "hidden_size"))
    close = all(math.isclose(actual[k], expected[k], rel_tol=1e-3, abs_tol=1e-3) for k in ("embedding_sum", "embedding_sq_sum"))
    if not (same_shape and close):
        raise ValueError(f"target does not match the target the draft in {where} was trained on: {actual} vs {expected}")


def manifest_path(directory: str | os.PathLike) -> Path:
    """The manifest file of a trained draft's directory (distilled or feature head)."""
    return Path(directory) / _MANIFEST_FILE


def read_manifest(directory: str | os.PathLike) -> dict:
    """The manifest of a trained draft's directory (distilled or feature head)."""
    return json.loads(manifest_path(directory).read_text())


def write_manifest(directory: str | os.PathLike, record: dict) -> None:
    """Write ``record`` as the manifest of a trained draft's directory (sorted keys, indented)."""
    manifest_path(directory).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
