"""Toy and tiny random-weight models for tests and exact checks.
"""

from __future__ import annotations

import torch

from specresearch.models.causal_lm import CausalLM, check_prompt
from specresearch.models.slots import SlotMask

__all__ = ["ToyLM", "tiny_llama_config", "tiny_llama"]


class ToyLM:
    """A toy language model from a fixed table, behind the same interface as :class:`CausalLM`.

    ``table [V]``: i.i.d. tokens with next-token logits ``table`` whatever the context.
    ``table [V, V]``: a Markov chain; the logits after token ``t`` are ``table[t]``.
    Entries are logits (use ``probs.log()`` for a probability table; ``-inf`` gives exact zeros).
    """

    def __init__(self, table: torch.Tensor):
        if table.ndim not in (1, 2) or (table.ndim == 2 and table.shape[0] != table.shape[1]):
            raise ValueError(f"table must be [V] (i.i.d.) or [V, V] (Markov), got shape {tuple(table.shape)}")
        self.table = table.float()
        self.vocab_size = table.shape[-1]
        self.device = table.device
        self._slots: SlotMask | None = None

    @classmethod
    def random(cls, vocab_size: int, *, markov: bool = True, concentration: float = 1.0,
               generator: torch.Generator | None = None) -> "ToyLM":
        """A random table: logits ~ N(0, 1) / concentration (lower concentration = peakier rows)."""
        shape = (vocab_size, vocab_size) if markov else (vocab_size,)
        return cls(torch.randn(shape, generator=generator) / concentration)

    @property
    def cache_length(self) -> int:
        return 0 if self._slots is None else self._slots.length

    def reset(self, batch_size: int) -> None:
        self._slots = SlotMask(torch.zeros(batch_size, 0, dtype=torch.bool, device=self.device))

    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        check_prompt(input_ids, attention_mask)
        self.reset(input_ids.shape[0])
        self._slots.append(attention_mask.bool())
        return self._logits(input_ids[:, -1:])[:, -1]  # left padding: the last column is the last token

    def score(self, tokens: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
        self._slots.append(torch.ones_like(tokens, dtype=torch.bool) if valid is None else valid)
        return self._logits(tokens)

    def rollback(self, n) -> None:
        if self._slots.rollback(n)[1]:
            self._slots.compaction()

    def begin_tree(self) -> None:
        self._slots.begin_tree()

    def score_tree(self, tokens: torch.Tensor, depth: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """Tree nodes (as :meth:`CausalLM.score_tree`); a Markov table reads only each node's own token."""
        self._slots.append_tree(visible, depth)
        return self._logits(tokens)

    def end_tree(self, kept: torch.Tensor) -> None:
        self._slots.end_tree(kept)
        self._slots.compaction()

    def repeat_rows(self, k: int) -> None:
        self._slots.repeat_rows(k)

    def select_rows(self, index: torch.Tensor) -> None:
        self._slots.select_rows(index)
        self._slots.compaction()

    def _logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """Next-token logits after each token. [B, k] -> [B, k, V]."""
        if self.table.ndim == 1:
            return self.table.expand(*tokens.shape, self.vocab_size)
        return self.table[tokens]


def tiny_llama_config(vocab_size: int = 64, hidden_size: int = 32, num_layers: int = 2, **overrides):
    """A ``LlamaConfig`` for a tiny random-weight model (tests, simulations)."""
    from transformers import LlamaConfig

    settings = dict(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=512, bos_token_id=0, eos_token_id=1, pad_token_id=1,
    )
    settings.update(overrides)
    return LlamaConfig(**settings)


def tiny_llama(vocab_size: int = 64, *, seed: int = 0, init_std: float = 0.02, **config) -> CausalLM:
    """A tiny random Llama wrapped in :class:`CausalLM` on the CPU, reproducible from ``seed``.

    ``init_std`` sets the weight scale: the default 0.02 gives nearly uniform next-token distributions;
    ~0.3-1.0 gives peaked, context-dependent ones (more interesting for speculative decoding).
    """
    from transformers import AutoModelForCausalLM

    cfg = tiny_llama_config(vocab_size, initializer_range=init_std, **config)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    return CausalLM(model, device="cpu")
