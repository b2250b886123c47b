"""Medusa heads as FasterDecoding/Medusa saves them, as a draft the engine verifies exactly (Cai et al. 2024, Medusa,
arXiv 2401.10774).

The format, read from FasterDecoding/Medusa at commit e2a5d20 (``medusa/model/medusa_model.py``); our code, their
facts:

* a directory with ``config.json`` (``medusa_num_heads``, ``medusa_num_layers``, ``base_model_name_or_path``:
  ``MedusaConfig``, l. 21-41) and ``medusa_lm_head.pt`` (l. 151-157; ``medusa_lm_head.safetensors`` read too);
* head k (``k = 0 .. medusa_num_heads - 1``) is ``nn.Sequential(*[ResBlock(H)] * medusa_num_layers, Linear(H, V,
  bias=False))`` (l. 111-118): ONE ``ResBlock`` (``x + silu(linear(x))``, l. 43-72) applied ``medusa_num_layers``
  times with the same weights, then the head's own output layer. Tensor names ``{k}.{j}.linear.weight`` /
  ``.bias`` (``j < medusa_num_layers``, equal for every j) and ``{k}.{medusa_num_layers}.weight``;
* the heads read the target's last hidden state after its final norm (``outputs[0]``, l. 212-218): at the slot of
  token ``x_t`` the target's head gives ``x_{t+1}`` and Medusa head k a guess for ``x_{t+2+k}``
  (``medusa/model/utils.py``, ``generate_candidates``, l. 281-293: the base logits' token, then head 0's top-k).

As a draft here: the engine's pending token is ``x_{t+1}`` (sampled from the target at slot t), so the first drafted
token ``x_{t+2}`` comes from head 0 on the feature of slot t, the d-th from head d - 1 on the same feature. The draft
reads ``hidden_states[L]`` through ``FeatureReader`` and plans at most ``medusa_num_heads`` drafted tokens a step
(``PlansLength``). q is each head's softmax: Medusa's own acceptance (typical / nucleus) is audited in
``audit.engines``; here any verifier of the engine keeps the target's law. Its static form
(:class:`StaticMedusaDraft`) runs in the engine's captured steps.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from specresearch.drafts.feature_draft import FeatureQueue
from specresearch.drafts.store import published_weights, read_tensors
from specresearch.models.slots import SlotMask
from specresearch.models.static_cache import StaticRows, keep_path

__all__ = ["MedusaHeads", "MedusaDraft", "StaticMedusaDraft", "is_medusa_dir", "load_medusa"]

_WEIGHTS = ("medusa_lm_head.pt", "medusa_lm_head.safetensors")


class MedusaHeads(torch.nn.Module):
    """``num_heads`` Medusa heads: head k maps ``[..., H]`` to logits ``[..., V]`` (module docstring)."""

    def __init__(self, hidden: int, vocab: int, num_heads: int, num_layers: int) -> None:
        super().__init__()
        self.num_layers = num_layers
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(hidden, hidden) for _ in range(num_heads))
        self.outputs = torch.nn.ModuleList(torch.nn.Linear(hidden, vocab, bias=False) for _ in range(num_heads))

    @property
    def num_heads(self) -> int:
        return len(self.outputs)

    def forward(self, hidden: torch.Tensor, k: int) -> torch.Tensor:
        """Head ``k``'s logits ``[..., V]`` (float32) of ``hidden [..., H]``."""
        x = hidden.float()
        for _ in range(self.num_layers):  # the one ResBlock, applied num_layers times
            x = x + torch.nn.functional.silu(self.blocks[k](x))
        return self.outputs[k](x)

    def load_medusa_state(self, tensors: dict[str, torch.Tensor], where: str) -> None:
        """Copy the repository's tensors (``{k}.{j}.linear.*``, ``{k}.{num_layers}.weight``) in, refusing a missing,
        unknown or misshapen one by name."""
        expected = {}
        for k, (block, out) in enumerate(zip(self.blocks, self.outputs)):
            for j in range(self.num_layers):
                expected[f"{k}.{j}.linear.weight"], expected[f"{k}.{j}.linear.bias"] = block.weight, block.bias
            expected[f"{k}.{self.num_layers}.weight"] = out.weight
        missing, unknown = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
        if missing or unknown:
            raise ValueError(f"{where}: not the Medusa layout for {self.num_heads} heads of {self.num_layers} layers: "
                             f"missing {missing[:6]}, unknown {unknown[:6]}")
        for name, parameter in expected.items():
            if tuple(tensors[name].shape) != tuple(parameter.shape):
                raise ValueError(f"{where}: tensor {name} has shape {tuple(tensors[name].shape)}, expected "
                                 f"{tuple(parameter.shape)}")
            k, j, rest = name.split(".", 2)
            if 0 < int(j) < self.num_layers and not torch.equal(tensors[name], tensors[f"{k}.0.{rest}"]):
                raise ValueError(f"{where}: tensor {name} differs from {k}.0.{rest}: Medusa repeats one ResBlock")
        with torch.no_grad():
            for name, parameter in expected.items():
                parameter.copy_(tensors[name].float())


class MedusaDraft(FeatureQueue):
    """Medusa heads behind the engine's ``LanguageModel`` interface, with ``FeatureReader``, ``PlansLength`` and
    ``RowExpander`` (module docstring). Each slot keeps its anchor (the last true feature, ``[H]``) and its depth
    (drafted slots since it); a slot's logits are head ``depth``'s on its anchor."""

    format = "Medusa"

    def __init__(self, heads: MedusaHeads, feature_layer: int, *, device="cpu") -> None:
        self.heads = heads.eval().to(device)
        self.vocab_size = heads.outputs[0].out_features
        self.feature_layers = (feature_layer,)
        self.feature_size = heads.blocks[0].in_features
        self.device = torch.device(device)
        self._slots: SlotMask | None = None
        self._anchor = self._depth = None  # [B, S, H], [B, S]
        self._queued: torch.Tensor | None = None

    @property
    def cache_length(self) -> int:
        return 0 if self._slots is None else self._slots.length

    def reset(self, batch_size: int) -> None:
        self._slots = SlotMask(torch.zeros(batch_size, 0, dtype=torch.bool, device=self.device))
        self._anchor = torch.zeros(batch_size, 0, self.feature_size, device=self.device)
        self._depth = torch.zeros(batch_size, 0, dtype=torch.long, device=self.device)
        self._queued = None

    def plan_length(self, gamma: int) -> int:
        """At most one drafted token per head."""
        return min(gamma, self.heads.num_heads)

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        self._restart(input_ids, attention_mask)
        return self.score(input_ids, attention_mask.bool())[:, -1]

    @torch.no_grad()
    def score(self, tokens: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
        """Append ``tokens [B, k]``; logits ``[B, k, V]``: head 0 on the queued true features, or (k = 1, none
        queued) head ``depth`` on the last slot's anchor."""
        if self._slots is None:
            raise ValueError("score called before prefill/reset: start a batch first")
        (batch, k), queued = tokens.shape, self._take_queued(tokens)
        if queued is not None:
            anchor, depth = queued, torch.zeros(batch, k, dtype=torch.long, device=self.device)
        elif k == 1 and self._slots.length:
            last = self._slots.length - 1 - self._slots.mask.flip(-1).long().argmax(-1)  # [B] each row's last slot
            rows = torch.arange(batch, device=self.device)
            anchor, depth = self._anchor[rows, last][:, None], self._depth[rows, last][:, None] + 1
        else:
            raise ValueError("a Medusa draft needs the target's features (observe) before scoring these tokens")
        if int(depth.max()) >= self.heads.num_heads:
            raise ValueError(f"Medusa has {self.heads.num_heads} heads: it drafts at most {self.heads.num_heads} tokens "
                             "a step (gamma, or a tree's depth)")
        self._slots.append(torch.ones_like(tokens, dtype=torch.bool) if valid is None else valid.bool().to(self.device))
        self._anchor, self._depth = torch.cat([self._anchor, anchor], 1), torch.cat([self._depth, depth], 1)
        logits = torch.empty(batch, k, self.vocab_size, device=self.device)
        for d in depth.unique().tolist():
            at = depth == d
            logits[at] = self.heads(anchor[at], d)
        return logits

    def static_form(self) -> "StaticMedusaDraft":
        """These heads in the engine's captured steps (:class:`StaticMedusaDraft`)."""
        return StaticMedusaDraft(self)

    def rollback(self, n) -> None:
        common, uneven = self._slots.rollback(n)
        end = self._slots.length
        self._anchor, self._depth = self._anchor[:, :end], self._depth[:, :end]
        if uneven:
            self._compact()

    def repeat_rows(self, k: int) -> None:
        self._slots.repeat_rows(k)
        self._anchor, self._depth = self._anchor.repeat_interleave(k, 0), self._depth.repeat_interleave(k, 0)
        self._queued = None if self._queued is None else self._queued.repeat_interleave(k, 0)

    def select_rows(self, index: torch.Tensor) -> None:
        index = index.to(self.device)
        self._slots.select_rows(index)
        self._anchor, self._depth = self._anchor[index], self._depth[index]
        self._queued = None if self._queued is None else self._queued[index]
        self._compact()

    def _compact(self) -> None:
        index = self._slots.compaction()
        if index is not None:
            self._anchor = self._anchor.gather(1, index[:, :, None].expand(-1, -1, self._anchor.shape[-1]))
            self._depth = self._depth.gather(1, index)


class StaticMedusaDraft:
    """Medusa heads in the engine's captured steps (``models.protocols.StaticFeatureModel``). They keep no cache, only
    each row's extent. The step's re-feed (:meth:`refeed`: the accepted tokens and the next token, each with the
    target's feature of the slot before it) gives head 0 on each slot's feature, and that feature as the slot's
    prediction, which the engine gathers at the next token's slot and hands to the drafting calls; a drafting call at
    depth d of the step (a chain's ``offset = d - 1``, a tree's ``(d - 1) K``: d = ``offset // k + 1``) gives head d on
    it (a tree's siblings share it). Nothing reads the host but ``allocate`` and ``prefill``."""

    def __init__(self, draft: MedusaDraft) -> None:
        self.heads, self.vocab_size, self.device = draft.heads, draft.vocab_size, draft.device
        self.feature_layers, self.feature_size = draft.feature_layers, draft.feature_size
        self.rows: StaticRows | None = None

    def allocate(self, batch: int, capacity: int) -> None:
        self.rows = StaticRows(batch, capacity, self.device)

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """The target's features ``[B, k, H]`` are the heads' inputs as they are."""
        return features.float().to(self.device)

    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, leave: int = 0, inputs=None):
        """Start a batch (nothing to write). -> (None, None): the first drafted token comes from the first re-feed."""
        self.rows.begin(attention_mask.to(self.device))
        self.rows.advance(input_ids.shape[1] - leave)
        return None, None

    @torch.no_grad()
    def refeed(self, tokens: torch.Tensor, *, inputs: torch.Tensor):
        """-> (head 0 on each slot's feature ``[B, k, V]``, the features ``[B, k, H]``)."""
        return self.heads(inputs, 0), inputs

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, *, inputs: torch.Tensor, offset: int = 0, depth=None, visible=None):
        """A drafting call: head ``offset // k + 1`` on ``inputs [B, k, H]`` (the anchor's feature). -> (logits, it)."""
        head = offset // tokens.shape[1] + 1
        if head >= self.heads.num_heads:
            raise ValueError(f"Medusa has {self.heads.num_heads} heads: it drafts at most {self.heads.num_heads} tokens "
                             "a step (gamma, or a tree's depth)")
        return self.heads(inputs, head), inputs

    def commit(self, n) -> None:
        self.rows.advance(n)

    def keep_path(self, source: torch.Tensor, n: torch.Tensor) -> None:
        keep_path([], self.rows, source, n)


def is_medusa_dir(directory: str | os.PathLike) -> bool:
    """Whether ``directory`` holds Medusa heads in the repository's layout (``config.json`` with
    ``medusa_num_heads`` and ``medusa_lm_head.pt`` or ``.safetensors``)."""
    directory = Path(directory)
    config = directory / "config.json"
    return (config.is_file() and any((directory / w).is_file() for w in _WEIGHTS)
            and "medusa_num_heads" in json.loads(config.read_text()))


def load_medusa(target_lm, directory: str | os.PathLike, *, device=None) -> MedusaDraft:
    """Medusa heads saved in the repository's layout as a draft for ``target_lm`` (a ``CausalLM``)."""
    directory = Path(directory)
    if not is_medusa_dir(directory):
        raise ValueError(f"{directory} holds no Medusa heads: expected config.json with medusa_num_heads and "
                         "medusa_lm_head.pt (the FasterDecoding/Medusa layout)")
    config = json.loads((directory / "config.json").read_text())
    text = target_lm.model.config.get_text_config()
    heads = MedusaHeads(text.hidden_size, target_lm.vocab_size, int(config["medusa_num_heads"]),
                        int(config.get("medusa_num_layers", 1)))
    heads.load_medusa_state(read_tensors(published_weights(directory, _WEIGHTS)), str(directory))
    return MedusaDraft(heads, text.num_hidden_layers, device=device or target_lm.device)
