"""Prompts: prompt files (``data/prompts.jsonl`` schema), chat templating, and left-padded batches for the engine."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

import torch

__all__ = ["load_prompts", "evenly_spaced", "encode_chat", "encode_prompts"]


def load_prompts(path: str | os.PathLike) -> list[dict]:
    """Read a prompt file in the ``data/prompts.jsonl`` schema (``id``, ``category``, ``turns``)."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    for row in rows:
        if not {"id", "category", "turns"} <= row.keys() or not row["turns"]:
            raise ValueError(f"path {path}: every line needs id, category and non-empty turns, got {row!r}")
    return rows


def evenly_spaced(prompts: Sequence[dict], count: int) -> list[dict]:
    """``count`` prompts spread evenly over ``prompts`` (index ``round(i * len / count)``); all of them if
    ``count`` is not smaller than their number."""
    return [prompts[round(i * len(prompts) / count)] for i in range(count)] if count < len(prompts) else list(prompts)


def encode_chat(prompts: Sequence, tokenizer) -> list[torch.Tensor]:
    """Chat-template the FIRST user turn of each prompt (generation prompt added) -> list of ``[P]`` int64.

    ``prompts``: rows of a prompt file (:func:`load_prompts`; multi-turn prompts are cut to their first turn,
    as later turns need the model's earlier answers) or strings.
    """
    return [torch.tensor(_chat_ids(tokenizer, p if isinstance(p, str) else p["turns"][0]), dtype=torch.long)
            for p in prompts]


def _chat_ids(tokenizer, text: str) -> list[int]:
    messages = [{"role": "user", "content": text}]
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))


def encode_prompts(prompts, tokenizer=None, *, chat: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Strings (needs ``tokenizer``) or token-id sequences -> left-padded ``(input_ids, attention_mask)`` [B, L].

    ``chat``: strings are sent as one user turn through the tokenizer's chat template (generation prompt added),
    as ``specresearch generate`` does; token ids are taken as they are.
    """
    if isinstance(prompts, (str, torch.Tensor)) or (prompts and isinstance(prompts[0], int)):
        prompts = [prompts]
    if not prompts:
        raise ValueError("prompts must contain at least one prompt")
    rows = [_encode_one(p, tokenizer, chat) for p in prompts]
    width = max(len(r) for r in rows)
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows], dtype=torch.long)
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], dtype=torch.long)
    return ids, mask


def _encode_one(prompt, tokenizer, chat: bool) -> list[int]:
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("prompts are strings: pass tokenizer=... (or pass token-id lists)")
        if chat and not prompt:
            raise ValueError("prompts must not be empty: a chat prompt needs some text")
        prompt = _chat_ids(tokenizer, prompt) if chat else tokenizer(prompt, add_special_tokens=False)["input_ids"]
    row = [int(t) for t in (prompt.tolist() if isinstance(prompt, torch.Tensor) else prompt)]
    if not row:
        raise ValueError("prompts must not be empty: every prompt needs at least one token")
    return row
