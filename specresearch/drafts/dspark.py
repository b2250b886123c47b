"""DSpark's Markov head (vllm-project/speculators 0.9.0, ``models/dspark``: the drafter of deepseek-ai's DSpark
checkpoints as speculators trains them and vLLM 0.34 serves them), read by :mod:`specresearch.drafts.dflash`, which
adds it to the DFlash block: drafted position j's logits gain ``markov_w2(e)``, ``e = markov_w1[x]`` of the token x
before the predicted one. Our code, their facts.
"""

from __future__ import annotations

import torch

__all__ = ["MarkovHead"]


class MarkovHead(torch.nn.Module):
    """DSpark's sequential logit bias over the draft vocabulary (speculators' ``MarkovHead``, ``vanilla`` or
    ``gated``): ``markov_w2(e)`` with ``e = markov_w1[previous token]`` (the target's ids), gated by
    ``sigmoid(gate_proj([hidden, e]))`` where ``gated``; ``hidden`` is the block's normed output at the slot."""

    def __init__(self, vocab: int, draft_vocab: int, rank: int, hidden: int, gated: bool) -> None:
        super().__init__()
        self.markov_w1 = torch.nn.Embedding(vocab, rank)
        self.markov_w2 = torch.nn.Linear(rank, draft_vocab, bias=False)
        self.gate_proj = torch.nn.Linear(hidden + rank, rank) if gated else None

    def forward(self, previous: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """``previous [...]`` token ids, ``hidden [..., H]`` -> the bias ``[..., draft vocabulary]``."""
        embedding = self.markov_w1(previous)
        if self.gate_proj is not None:
            embedding = torch.sigmoid(self.gate_proj(torch.cat([hidden, embedding], -1))) * embedding
        return self.markov_w2(embedding)
