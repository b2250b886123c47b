"""How trained drafts are stored: the shipped folder, manifests, storage dtypes, the target's fingerprint.

Weights files: training writes ``<name>.safetensors``; a shipped draft keeps it xz-compressed (``<name>.safetensors.xz``,
lossless, about 30% smaller: the repository stays small enough to send to a GPU machine). :func:`weights_path`
finds either; the compressed one is decompressed once into the cache, keyed by its sha256. Digests are computed on
the decompressed bytes, so a draft has one digest whichever way it is stored.
"""

from __future__ import annotations

import hashlib
import json
import lzma
import math
import os
from pathlib import Path

import torch

from specresearch.paths import cache_dir, data_dir

__all__ = ["drafts_dir", "shipped_drafts", "embedding_fingerprint", "check_fingerprint", "manifest_path", "read_manifest",
           "write_manifest", "weights_path", "pack_weights", "draft_digest", "published_weights", "read_tensors",
           "check_tensors"]

_PACKED = ".xz"


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


def check_fingerprint(target, expected: dict, where: Path) -> None:
    """Raise unless ``target`` is the target the draft saved in ``where`` was trained on (``expected``: its manifest's
    :func:`embedding_fingerprint`), saying what a draft for another target is."""
    actual = embedding_fingerprint(target)
    same_shape = all(actual[k] == expected[k] for k in ("vocab_size", "hidden_size"))
    close = all(math.isclose(actual[k], expected[k], rel_tol=1e-3, abs_tol=1e-3) for k in ("embedding_sum", "embedding_sq_sum"))
    if not (same_shape and close):
        shapes = "same sizes, other embedding weights" if same_shape else (
            f"hidden size {expected['hidden_size']}, vocabulary {expected['vocab_size']}; this target's: "
            f"{actual['hidden_size']}, {actual['vocab_size']}")
        raise ValueError(f"the draft in {where} was trained for another target ({shapes}): a trained draft serves "
                         "its own target (the shipped ones the embedded smollm2-135m-instruct); for this one use prompt "
                         "lookup ('ngram'), 'truncated:N' (its own first N layers) or a draft trained for it")


def manifest_path(directory: str | os.PathLike) -> Path:
    """The manifest file of a trained draft's directory (distilled or feature head)."""
    return Path(directory) / _MANIFEST_FILE


def read_manifest(directory: str | os.PathLike) -> dict:
    """The manifest of a trained draft's directory (distilled or feature head)."""
    return json.loads(manifest_path(directory).read_text())


def write_manifest(directory: str | os.PathLike, record: dict) -> None:
    """Write ``record`` as the manifest of a trained draft's directory (sorted keys, indented)."""
    manifest_path(directory).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")


def weights_path(directory: str | os.PathLike, name: str) -> Path:
    """The weights file ``name`` of a draft's directory, ready to load: ``directory/name`` itself, or the cached
    decompressed copy of ``directory/name.xz`` (made on first use). Raises ``FileNotFoundError`` if neither exists."""
    plain, packed = Path(directory) / name, Path(directory) / (name + _PACKED)
    if plain.exists() or not packed.exists():
        if not plain.exists():
            raise FileNotFoundError(f"no weights file {name} (or {name}{_PACKED}) in {directory}")
        return plain
    key = hashlib.sha256(packed.read_bytes()).hexdigest()[:16]
    cached = cache_dir("drafts", f"{Path(directory).name}-{key}", name)
    if not cached.exists():
        cached.parent.mkdir(parents=True, exist_ok=True)
        partial = cached.with_name(f"{name}.{os.getpid()}.partial")
        partial.write_bytes(lzma.decompress(packed.read_bytes()))
        os.replace(partial, cached)  # atomic: a concurrent reader sees the whole file or none
    return cached


def pack_weights(directory: str | os.PathLike, name: str) -> Path:
    """Compress ``directory/name`` to ``name.xz`` (xz preset 9, lossless) and remove the plain file: how a draft is
    shipped under ``data/drafts/``. -> the packed file."""
    plain = Path(directory) / name
    packed = plain.with_name(name + _PACKED)
    packed.write_bytes(lzma.compress(plain.read_bytes(), preset=9))
    plain.unlink()
    return packed


def draft_digest(directory: str | os.PathLike) -> str:
    """sha256 (16 hex digits) of a draft directory's files in name order, packed files by their decompressed bytes:
    the weights' digest the benchmark records carry."""
    digest = hashlib.sha256()
    files = {p.name.removesuffix(_PACKED): p for p in Path(directory).rglob("*") if p.is_file()}
    for name in sorted(files):
        file = files[name]
        digest.update(weights_path(file.parent, name).read_bytes() if file.name.endswith(_PACKED) else file.read_bytes())
    return digest.hexdigest()[:16]


def published_weights(directory: str | os.PathLike, names=("model.safetensors", "pytorch_model.bin")) -> Path | None:
    """The first of ``names`` present in a published draft's ``directory`` (its weights file), or None."""
    return next((Path(directory) / n for n in names if (Path(directory) / n).is_file()), None)


def read_tensors(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """A published draft's tensors by name from a ``.safetensors`` file or a ``torch.save`` file (weights only)."""
    path = Path(path)
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(path)
    return torch.load(path, map_location="cpu", weights_only=True)


def check_tensors(directory, tensors: dict, expected: dict, optional: set[str], what: str) -> None:
    """Refuse in one line a tensor of a published draft that is missing, unknown or of another shape than
    ``expected`` (name -> shape; those in ``optional`` may be absent), naming the layout ``what``."""
    missing, unknown = sorted(set(expected) - optional - set(tensors)), sorted(set(tensors) - set(expected))
    if missing or unknown:
        raise ValueError(f"{directory}: not the {what} layout: missing {missing}, unknown {unknown} (expected "
                         f"{len(expected) - len(optional)} tensors such as {sorted(set(expected) - optional)[:4]})")
    for name, value in tensors.items():
        if tuple(value.shape) != tuple(expected[name]):
            raise ValueError(f"{directory}: tensor {name} has shape {tuple(value.shape)}, expected {expected[name]} "
                             f"for this config and target")
