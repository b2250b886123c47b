"""XPress's causal refiner on the DFlash block (vllm-project/speculators 0.9.0, ``models/xpress``; vLLM 0.34 runs the
same refiner as ``XPressSpeculator``, ``qwen3_xpress.py``), read by :mod:`specresearch.drafts.dflash`. Our code,
their facts:

* **the refiner** (``refiner_head``, rank r = ``xpress_rank``): block position k's logits gain a bias built from the
  block's normed outputs h_0 .. h_{B-1} (all B positions, the anchor's included) and the token x_k before the token
  position k predicts::

      a_k = in_proj([down_h(h_k); down_g(mean_j h_j); token_embed(x_k)])
      c_k = a_k + sum_{j <= k} mix_l[:, k, j] * a_j          (per channel: a causal mix along the block)
      bias_k = readout(c_k + mlp_down(silu(mlp_gate(c_k)) * mlp_up(c_k)))   (MLP width r * xpress_mlp_ratio)

  on the draft vocabulary's columns. x_k in the fill-in layout (XPress's default: position 0 the anchor, position k
  predicts the k-th drafted token): the token before the anchor (the anchor itself where the row has none, as
  speculators at a sequence's start), the anchor, then the drafted tokens; sampling from the anchor (position k
  predicts drafted token k + 1): the anchor, then the drafted tokens. Position k's law depends on every token drafted
  before it, so the draft is autoregressive along the block: the engine samples it token by token, the law
  speculators' teacher-forced pass trains (its ``block_bias`` of the true previous tokens).
* **vLLM 0.34 drafts it otherwise**: greedily, ``xpress_num_passes`` (default 6) parallel Jacobi passes over the
  block from the head's own argmax (position k settles by pass k, so with B - 1 passes its draft is the serial greedy
  one), scoring by default only the head's top ``xpress_topc`` = 512 tokens, and with the anchor's id standing in for
  the token before the anchor. ``num_jacobi_passes`` is read and not used here (its draft is a function of this law
  once the passes settle). It reads weights named ``xpress_head.w1`` / ``mix.L`` / ``mlp.*`` / ``w2`` and configs
  with ``xpress_mlp_hidden``, not speculators' names, and its reader of speculators' configs refuses
  ``speculators_model_type: xpress``; it refuses ``sample_from_anchor`` and a draft vocabulary.
"""

from __future__ import annotations

import torch

__all__ = ["XPRESS_KEYS", "XPressRefiner", "tokens_before", "xpress_refusal", "xpress_settings"]

XPRESS_KEYS = ("xpress_rank", "xpress_mlp_ratio", "num_jacobi_passes")
_DEFAULTS = {"xpress_rank": 256, "xpress_mlp_ratio": 2, "num_jacobi_passes": 6}  # speculators 0.9.0's


class XPressRefiner(torch.nn.Module):
    """speculators' ``XPressRefinerHead`` (module docstring), its tensor names."""

    def __init__(self, vocab: int, draft_vocab: int, hidden: int, block: int, rank: int, mlp_ratio: int) -> None:
        super().__init__()
        self.token_embed = torch.nn.Embedding(vocab, rank)
        self.down_h = torch.nn.Linear(hidden, rank, bias=False)
        self.down_g = torch.nn.Linear(hidden, rank, bias=False)
        self.in_proj = torch.nn.Linear(3 * rank, rank, bias=False)
        self.mix_l = torch.nn.Parameter(torch.zeros(rank, block, block))
        self.mlp_gate = torch.nn.Linear(rank, rank * mlp_ratio, bias=False)
        self.mlp_up = torch.nn.Linear(rank, rank * mlp_ratio, bias=False)
        self.mlp_down = torch.nn.Linear(rank * mlp_ratio, rank, bias=False)
        self.readout = torch.nn.Linear(rank, draft_vocab, bias=False)

    def forward(self, hidden: torch.Tensor, previous: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """The bias of block position ``position [N]`` given the block's outputs ``hidden [N, B, H]`` and the tokens
        before each position's predicted one ``previous [N, B]`` (read up to ``position``) -> ``[N, draft vocab]``."""
        mean = hidden.mean(1, keepdim=True).expand_as(hidden)
        a = self.in_proj(torch.cat([self.down_h(hidden), self.down_g(mean), self.token_embed(previous)], -1))
        block = hidden.shape[1]
        weights = self.mix_l[:, position].permute(1, 2, 0)  # [N, B, r]: position k's row of the mixer
        weights = weights * (torch.arange(block, device=a.device)[None, :] <= position[:, None])[..., None]
        rows = torch.arange(len(a), device=a.device)
        c = a[rows, position] + (weights * a).sum(1)
        return self.readout(c + self.mlp_down(torch.nn.functional.silu(self.mlp_gate(c)) * self.mlp_up(c)))

    @staticmethod
    def shapes(settings: dict, hidden: int, vocab: int, draft_vocab: int, block: int) -> dict[str, tuple[int, ...]]:
        """The refiner's tensors and shapes in speculators' layout (``settings``: :func:`xpress_settings`)."""
        r, wide = settings["xpress_rank"], settings["xpress_rank"] * settings["xpress_mlp_ratio"]
        at = "refiner_head."
        return {at + "token_embed.weight": (vocab, r), at + "down_h.weight": (r, hidden),
                at + "down_g.weight": (r, hidden), at + "in_proj.weight": (r, 3 * r), at + "mix_l": (r, block, block),
                at + "mlp_gate.weight": (wide, r), at + "mlp_up.weight": (wide, r), at + "mlp_down.weight": (r, wide),
                at + "readout.weight": (draft_vocab, r)}


def xpress_settings(config: dict) -> dict[str, int]:
    """The refiner's settings from a speculators XPress config, speculators' defaults where missing."""
    return {k: config.get(k, _DEFAULTS[k]) for k in XPRESS_KEYS}


def xpress_refusal(config: dict) -> str | None:
    """Why a speculators XPress config is not read, or None."""
    bad = {k: v for k, v in xpress_settings(config).items() if type(v) is not int or v < 1}
    return f"{bad} (positive integers; speculators' defaults {_DEFAULTS})" if bad else None


def tokens_before(mask: torch.Tensor, tokens: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
    """The token of each row's last valid slot before slot ``at [N, c]`` (slots ``mask [N, S]`` holding ``tokens
    [N, S]``), -1 where the row has none."""
    index = torch.where(mask, torch.arange(mask.shape[1], device=mask.device), -1)
    last = torch.cat([index.new_full((len(index), 1), -1), index[:, :-1]], 1).cummax(1).values.gather(1, at)
    return torch.where(last >= 0, tokens.gather(1, last.clamp(min=0)), -1)
