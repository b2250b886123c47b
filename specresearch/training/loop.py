"""The training loop's shared parts: settings, the learning-rate and batch schedules, resumable checkpoints.

Both draft kinds train through these (:mod:`specresearch.training.distill` for distilled LMs,
:mod:`specresearch.training.feature_distill` for feature heads): AdamW with a linear warm-up then cosine decay
to a tenth, batches drawn as concatenated random permutations of the corpus from one seeded generator, and a
checkpoint (``checkpoint.pt``) written atomically, so a resumed run gives the same weights as an uninterrupted one.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from specresearch import paths
from specresearch.checks import check_field

__all__ = ["TrainConfig", "cache_dir", "learning_rate", "batch_schedule", "atomic_save", "save_checkpoint", "load_checkpoint",
           "CHECKPOINT_FILE"]

CHECKPOINT_FILE = "checkpoint.pt"


@dataclass(frozen=True)
class TrainConfig:
    """Corpus sampling and optimisation settings (AdamW, linear warm-up then cosine decay to 10 %).

    Attributes:
        seed: seeds the corpus sampling, the draft's random init and the batch order.
        steps: optimiser steps; batch_size: sequences per step; seq_len: sequences are cut to this length.
        lr, warmup_steps, weight_decay, grad_clip: AdamW settings (``grad_clip`` = max global grad norm).
        corpus_temperature: temperature of the target when sampling the corpus (> 0).
        corpus_max_new_tokens: continuation length per prompt; corpus_samples_per_prompt: continuations per prompt;
            corpus_batch_size: rows sampled together (it fixes which random draw goes to which row).
        checkpoint_every: steps between checkpoints in the cache directory.
        teacher_top_k: the teacher's distribution at each position is stored as its ``teacher_top_k`` most
            likely tokens (:func:`teacher_targets`, computed once per corpus), renormalised; the loss is
            the KL from that truncated teacher. ``>= V`` is the exact KL.
    """

    seed: int = 0
    steps: int = 300
    batch_size: int = 8
    seq_len: int = 256
    lr: float = 5e-4
    warmup_steps: int = 20
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    corpus_temperature: float = 1.0
    corpus_max_new_tokens: int = 128
    corpus_samples_per_prompt: int = 2
    corpus_batch_size: int = 16
    checkpoint_every: int = 25
    teacher_top_k: int = 64

    def __post_init__(self) -> None:
        positive = ("steps", "batch_size", "seq_len", "corpus_max_new_tokens", "corpus_samples_per_prompt", "corpus_batch_size", "checkpoint_every",
                    "teacher_top_k")
        for field in positive:
            value = getattr(self, field)
            check_field(isinstance(value, int) and value >= 1, field, f"must be an int >= 1, got {value!r}")
        check_field(isinstance(self.seed, int) and self.seed >= 0, "seed", f"must be an int >= 0, got {self.seed!r}")
        check_field(self.seq_len >= 2, "seq_len", f"must be >= 2, got {self.seq_len!r}")
        check_field(math.isfinite(self.lr) and self.lr > 0, "lr", f"must be a finite number > 0, got {self.lr!r}")
        check_field(isinstance(self.warmup_steps, int) and 0 <= self.warmup_steps, "warmup_steps", f"must be an int >= 0, got {self.warmup_steps!r}")
        check_field(self.weight_decay >= 0, "weight_decay", f"must be >= 0, got {self.weight_decay!r}")
        check_field(self.grad_clip > 0, "grad_clip", f"must be > 0, got {self.grad_clip!r}")
        check_field(math.isfinite(self.corpus_temperature) and self.corpus_temperature > 0, "corpus_temperature",
                    f"must be a finite number > 0, got {self.corpus_temperature!r}")


def cache_dir() -> Path:
    """The training cache, ``$SPECRESEARCH_CACHE/distill`` (default ``~/.cache/specresearch/distill``): corpora,
    teacher targets, feature chunks, checkpoints."""
    return paths.cache_dir("distill")


def learning_rate(step: int, lr: float, warmup_steps: int, steps: int) -> float:
    """Linear warm-up over ``warmup_steps``, then cosine decay from ``lr`` to ``lr / 10`` at ``steps``."""
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, steps - warmup_steps)
    return lr * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


def batch_schedule(num_sequences: int, steps: int, batch_size: int, seed: int) -> torch.Tensor:
    """``[steps, batch_size]`` sequence indices: concatenated random permutations (one generator)."""
    generator = torch.Generator().manual_seed(seed)
    needed = steps * batch_size
    epochs = [torch.randperm(num_sequences, generator=generator) for _ in range(-(-needed // num_sequences))]
    return torch.cat(epochs)[:needed].view(steps, batch_size)


def atomic_save(obj, path: str | os.PathLike) -> None:
    """``torch.save`` to ``path`` through a temporary file, so an interrupted write never leaves half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def save_checkpoint(directory, trained: dict[str, torch.Tensor], optimizer, config, **state) -> None:
    """Write ``checkpoint.pt`` under ``directory``: the ``trained`` tensors, the optimiser, ``config`` and ``state``
    (``step``, ``losses``, ``seconds`` and whatever else the loop keeps)."""
    weights = {name: p.detach().clone() for name, p in trained.items()}
    payload = {**state, "weights": weights, "optimizer": optimizer.state_dict(), "config": dataclasses.asdict(config)}
    atomic_save(payload, Path(directory) / CHECKPOINT_FILE)


def load_checkpoint(directory, trained: dict[str, torch.Tensor], optimizer, config, *, defaults: dict | None = None) -> dict:
    """Resume from ``directory``'s checkpoint: copy its weights into ``trained``, restore the optimiser, and return
    the saved state (``step``, ``losses``, ``seconds``, ...); ``{"step": 0, "losses": [], "seconds": 0.0}`` when there
    is none. ``defaults``: config fields added after a checkpoint was written, at the value older runs had.
    Raises ``ValueError`` if the checkpoint was written with another config."""
    path = None if directory is None else Path(directory) / CHECKPOINT_FILE
    if path is None or not path.exists():
        return {"step": 0, "losses": [], "seconds": 0.0}
    payload = torch.load(path, weights_only=True)
    if {**(defaults or {}), **payload["config"]} != dataclasses.asdict(config):
        raise ValueError(f"checkpoint_dir {directory} holds a run with another {type(config).__name__} "
                         f"({payload['config']}); use another directory")
    with torch.no_grad():
        for name, p in trained.items():
            p.copy_(payload["weights"][name])
    optimizer.load_state_dict(payload["optimizer"])
    return {k: v for k, v in payload.items() if k not in ("weights", "optimizer", "config")}
