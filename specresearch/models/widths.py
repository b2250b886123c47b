"""The width of a model's logits: its own number of output rows, and logits cut or padded to another width.

A draft that shares its target's tokenizer may have another number of output rows (Qwen2.5-0.5B's 151,936 against
Qwen2.5-7B's 152,064; the rows past the tokenizer's ids are padding): ``CausalLM(draft, vocab_size=...)`` gives logits
over the target's ids, its own cut or padded with -inf, and reads an id past its own rows as its last row. Both
``CausalLM`` and its static form (``models.static_lm``) use the two functions here.
"""

from __future__ import annotations

import torch

__all__ = ["output_rows", "fit_width", "readable"]


def output_rows(model) -> int:
    """A transformers causal LM's number of output rows (its logits' width)."""
    head = model.get_output_embeddings()  # out_features: nn.Linear, or a head over a token subset
    return int(getattr(head, "out_features", head.weight.shape[0])) if head is not None else int(model.config.get_text_config().vocab_size)


def fit_width(logits: torch.Tensor, width: int | None) -> torch.Tensor:
    """``logits [..., V]`` over ``width`` ids (``CausalLM``'s ``vocab_size``): cut, or padded with -inf; as they are
    for ``None``."""
    if width is None or width == logits.shape[-1]:
        return logits
    if width < logits.shape[-1]:
        return logits[..., :width]
    return torch.nn.functional.pad(logits, (0, width - logits.shape[-1]), value=float("-inf"))


def readable(tokens: torch.Tensor, lm) -> torch.Tensor:
    """``tokens`` as ``lm`` (a ``CausalLM``) reads them: an id past a narrower model's own rows (``vocab_size=``
    wider than its own) becomes its last row."""
    if lm.logits_width is None or lm.logits_width <= lm.own_vocab_size:
        return tokens
    return tokens.clamp(max=lm.own_vocab_size - 1)
