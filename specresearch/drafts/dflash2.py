"""DFlash2's two additions to the DFlash block (vllm-project/speculators 0.9.0, ``models/dflash2``: z-lab's DFlash2 as
speculators trains it and vLLM 0.34 serves it, ``qwen3_dflash2.py`` and ``spec_decode/dflash2``), read by
:mod:`specresearch.drafts.dflash`. Our code, their facts:

* **local convolutions** (``attention_conv`` and ``mlp_conv`` of every layer): a grouped dynamic causal convolution
  along the block, before and after the attention (and the MLP). One projection of the sublayer's normed input gives
  both sides' per-row, per-group kernel offsets, ``kernel_projection(x) -> [2, taps, groups]``; side s's tap t
  multiplies row i - t of the block (none before the block's first row) by ``base_kernel[s, t] + offset[s, t,
  group of the channel]``, the offsets those of row i. The input side convolves the normed input the attention's
  queries, keys and values (or the MLP) read; the output side convolves the sublayer's output before the residual.
  The context's keys and values are not convolved.
* **a candidate selector**: the drafted position's logits (the block's head, as DFlash's) choose ``selector_top_k``
  candidates, each rescored by ``unary + sum_r predecessor_codebook[x, r] * hidden_projection(h)[r] *
  successor_codebook[c, r]``, x the token before the predicted one (the anchor, then the drafted tokens), h the
  block's normed output at the position. vLLM's drafter draws from the softmax of those scores over the candidates
  (its walk, at the request's temperature) and hands the same scores, ``-inf`` elsewhere, to its rejection sampler:
  the draft's law is zero off the candidates. Here the other tokens get the dtype's lowest value (zero mass, no
  ``-inf`` downstream, as :class:`~specresearch.drafts.distilled.SubsetHead`).
"""

from __future__ import annotations

import torch

__all__ = ["DFLASH2_KEYS", "CandidateSelector", "GroupedConv", "dflash2_refusal", "dflash2_shapes"]

DFLASH2_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


class GroupedConv(torch.nn.Module):
    """A sublayer's two convolutions along the block (module docstring): ``base_kernel [2, taps, H]``,
    ``kernel_projection [2 taps groups, H]``."""

    def __init__(self, hidden: int, taps: int, group: int) -> None:
        super().__init__()
        self.taps, self.groups, self.group = taps, hidden // group, group
        self.base_kernel = torch.nn.Parameter(torch.zeros(2, taps, hidden))
        self.kernel_projection = torch.nn.Linear(hidden, 2 * taps * self.groups, bias=False)

    def _convolve(self, x: torch.Tensor, offsets: torch.Tensor, side: int) -> torch.Tensor:
        """``x [N, m, H]`` (a block a row), ``offsets [N, m, taps, groups]`` -> ``[N, m, H]``."""
        n, m, _ = x.shape
        grouped = x.view(n, m, self.groups, self.group)
        out = torch.zeros_like(grouped)
        for tap in range(min(self.taps, m)):
            shifted = torch.nn.functional.pad(grouped[:, : m - tap], (0, 0, 0, 0, tap, 0))
            kernel = self.base_kernel[side, tap].view(1, 1, self.groups, self.group) + offsets[:, :, tap, :, None]
            out = out + kernel * shifted
        return out.view(n, m, -1)

    def prepare(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The convolved input and the output side's offsets."""
        offsets = self.kernel_projection(x).view(*x.shape[:2], 2, self.taps, self.groups)
        return self._convolve(x, offsets[:, :, 0], 0), offsets[:, :, 1]

    def finish(self, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return self._convolve(x, offsets, 1)


class CandidateSelector(torch.nn.Module):
    """The bilinear rescoring of the top ``top_k`` candidates (module docstring)."""

    def __init__(self, vocab: int, hidden: int, rank: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = torch.nn.Parameter(torch.zeros(vocab, rank))
        self.successor_codebook = torch.nn.Parameter(torch.zeros(vocab, rank))
        self.hidden_projection = torch.nn.Linear(hidden, rank, bias=False)

    def forward(self, logits: torch.Tensor, previous: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """``logits [..., V]``, ``previous [...]`` token ids, ``hidden [..., H]`` -> ``[..., V]``: the candidates'
        scores, the lowest value elsewhere."""
        unary, candidates = logits.topk(self.top_k, -1)
        context = self.predecessor_codebook[previous] * self.hidden_projection(hidden)  # [..., r]
        edges = (context[..., None, :] * self.successor_codebook[candidates]).sum(-1)  # [..., K]
        out = torch.full_like(logits, torch.finfo(logits.dtype).min)
        return out.scatter(-1, candidates, unary + edges.to(unary.dtype))


def dflash2_shapes(settings: dict, hidden: int, vocab: int, layers: int) -> dict[str, tuple[int, ...]]:
    """The tensors DFlash2 adds to a DFlash drafter of ``layers`` layers, by name and shape."""
    taps, groups = int(settings["conv_kernel_size"]), hidden // int(settings["conv_group_size"])
    rank = int(settings["selector_rank"])
    shapes = {"candidate_selector.predecessor_codebook": (vocab, rank),
              "candidate_selector.successor_codebook": (vocab, rank),
              "candidate_selector.hidden_projection.weight": (rank, hidden)}
    for i in range(layers):
        for conv in ("attention_conv", "mlp_conv"):
            shapes |= {f"layers.{i}.{conv}.base_kernel": (2, taps, hidden),
                       f"layers.{i}.{conv}.kernel_projection.weight": (2 * taps * groups, hidden)}
    return shapes


def dflash2_refusal(config: dict, layer: dict) -> str | None:
    """Why a speculators DFlash2 config is not read, or None."""
    missing = [k for k in DFLASH2_KEYS if type(config.get(k)) is not int]
    if missing:
        return f"no integer {missing} (speculators 0.9.0 defaults them, vLLM 0.34 reads them without a default)"
    vocab, hidden = layer.get("vocab_size"), layer.get("hidden_size")
    if config.get("draft_vocab_size") not in (None, vocab):
        return f"a draft vocabulary of {config['draft_vocab_size']} tokens (speculators builds DFlash2 on the full one)"
    if hidden % config["conv_group_size"] or not 1 <= config["conv_kernel_size"] <= config.get("block_size", 8):
        return (f"conv_group_size {config['conv_group_size']} / conv_kernel_size {config['conv_kernel_size']} "
                f"(a divisor of hidden size {hidden} / at most the block)")
    if not 1 <= config["selector_top_k"] <= vocab:
        return f"selector_top_k {config['selector_top_k']} (between 1 and the vocabulary's {vocab})"
    return None
