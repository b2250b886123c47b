"""DFlash block drafters (z-lab, DFlash: Block Diffusion for Flash Speculative Decoding, arXiv 2602.06036) as z-lab
publishes them and as transformers saves them, as a draft the engine verifies exactly.

The formats (our code, their facts):

* z-lab/dflash (``dflash/model.py`` at commit 1012959, ``DFlashDraftModel``): ``config.json`` a Qwen3 config with
  ``dflash_config``: ``target_layer_ids`` (the target layers whose outputs are read: transformers'
  ``hidden_states[i + 1]``, ``extract_context_feature``), ``mask_token_id``, ``block_size`` (there or at the top
  level, default 16), optionally ``input_embedding_scale``, ``output_multiplier``, ``final_logit_softcapping``;
  ``model.safetensors`` with ``fc.weight [H, n H]``, ``hidden_norm.weight``, ``layers.{i}.*`` (Qwen3 decoder layers,
  per-head q / k norms) and ``norm.weight``. A full-attention layer is bidirectional; a sliding one is causal with a
  window ``q - k < w`` unless the config's ``is_causal`` says otherwise. DFlash2 in this layout is refused.
* transformers 5.25 (``models/muse_glimmer_assistant``, what its ``speculation_type="dflash"`` runs): model type
  ``muse_glimmer_assistant`` with ``target_layer_ids``, ``block_size`` and ``mask_token_id`` at the top level,
  ``fc`` and ``hidden_norm`` saved as ``encoder.fc`` and ``encoder.output_norm_enc``; every layer bidirectional, a
  sliding one within ``|q - k| <= w`` (its default layer type).
* vllm-project/speculators 0.9.0 (``models/dflash``, what vLLM 0.34 serves): ``speculators_model_type: "dflash"``,
  the Qwen3 layer config under ``transformer_layer_config``, ``block_size``, ``mask_token_id`` and
  ``aux_hidden_state_layer_ids`` (transformers' ``hidden_states`` indices: z-lab's ids + 1, as vLLM converts them);
  z-lab's tensor names, and where ``draft_vocab_size`` is below the vocabulary its own ``lm_head [D, H]`` with ``d2t``
  (draft id i is target id i + d2t[i]) instead of the target's head. Every layer bidirectional; ``sample_from_anchor``
  (below); refused in one line: sliding layers (its window counts from the anchor), a config key this loader does
  not read.
* DSpark in speculators' layout (``speculators_model_type: "dspark"``, ``models/dspark``: the drafter of
  deepseek-ai's DSpark checkpoints as speculators trains them and vLLM 0.34 serves them): the DFlash block plus a
  Markov head: drafted position j's logits gain ``markov_w2(e)``, ``e = markov_w1[x]`` of the token x before the
  predicted one (the anchor, then the drafted tokens; ``markov_head_type: gated`` multiplies e by
  ``sigmoid(gate_proj([h_j; e]))``, h_j the block's normed output there), on the draft vocabulary's columns;
  ``markov_rank`` 0 has none. Its confidence head (``confidence_head.proj``) is read and not used: it predicts
  acceptance for vLLM's adaptive budget and leaves the draft's law alone. Refused in one line: a config without
  ``sample_from_anchor`` (speculators' config reads it as True, vLLM 0.34's reader as False: two different
  drafts), a ``markov_rank`` that is not an integer, the ``rnn`` head (a state carried along the block), DSpark in
  DeepSeek's own layout (a config with ``markov_rank`` outside speculators'). vLLM 0.34's Qwen3 DSpark model builds the vanilla head only.
* DFlash2 in speculators' layout (``speculators_model_type: "dflash2"``, ``models/dflash2``; vLLM 0.34's
  ``DFlash2DraftModel``): the DFlash block with each layer's attention and MLP between two grouped convolutions along
  the block, and a candidate selector that rescores the head's top ``selector_top_k`` tokens given the token before
  the predicted one (:mod:`specresearch.drafts.dflash2`); the draft's law lives on those candidates. Refused in one
  line: a config without ``conv_kernel_size``, ``conv_group_size``, ``selector_rank`` or ``selector_top_k``
  (speculators defaults them, vLLM 0.34 does not), a draft vocabulary (speculators builds it on the full one).
* XPress in speculators' layout (``speculators_model_type: "xpress"``, ``models/xpress``; vLLM 0.34 runs its refiner
  as ``XPressSpeculator``): the DFlash block plus a causal refiner whose bias at block position k reads the block's
  outputs and the tokens before position k's predicted one, so the draft is autoregressive along the block
  (:mod:`specresearch.drafts.xpress`). Refused in one line: ``xpress_rank`` or ``xpress_mlp_ratio`` not a positive
  integer.

One drafting call (the same in every layout): the context is ``hidden_norm(fc(features))`` of every slot before the anchor,
which each layer reads through its own k / v projections (k normed per head, RoPE at the slot's position), without
the layer's input norm; the block is the target's embedding (the raw table, times ``input_embedding_scale``) of
``[anchor, mask x (B - 1)]`` at the anchor's position onwards, through the layers (attention over the context and
the block), then ``norm``; the target's own output head on block position i >= 1 is the law of the token at the
anchor's position + i (times ``output_multiplier``, softcapped where the config says). With ``sample_from_anchor``
(speculators: DSpark's default, DFlash's option) position i >= 0 is the law of the token at the anchor's position +
i + 1: the anchor's own output drafts the first token.

As a draft here: the anchor is the engine's pending token, whose queued feature is the last slot of the context; the
d-th drafted token is drawn from block position d (d - 1 sampling from the anchor). The block does not read the
drafted tokens, so the slot of the d-th drafted token returns the block's next position (a tree's siblings share it;
DSpark adds the Markov bias of the token the slot holds, DFlash2 rescores its candidates given that token,
XPress adds its refiner's bias given the tokens drafted so far) and a
step drafts at most B - 1 tokens (B sampling from the anchor; ``plan_length``). Rows copy and select
(``RowExpander``). q is the softmax of those logits; any verifier of the engine keeps the target's law.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from specresearch.drafts.dflash2 import DFLASH2_KEYS, CandidateSelector, GroupedConv, dflash2_refusal, dflash2_shapes
from specresearch.drafts.dflash_static import StaticDFlashDraft, block_mask
from specresearch.drafts.distilled import SubsetHead
from specresearch.drafts.dspark import MarkovHead
from specresearch.drafts.feature_draft import MLP, FeatureQueue, RMSNorm, rotate_half
from specresearch.drafts.speculators import SPECULATORS_METADATA, refused_layer
from specresearch.drafts.store import check_tensors, published_weights, read_tensors
from specresearch.drafts.xpress import XPRESS_KEYS, XPressRefiner, tokens_before, xpress_refusal, xpress_settings
from specresearch.models.slots import SlotMask

__all__ = ["DFlashBlock", "DFlashDraft", "is_dflash_dir", "load_dflash"]

_WEIGHTS = ("model.safetensors", "pytorch_model.bin")
_TRANSFORMERS_NAMES = {"encoder.fc.weight": "fc.weight", "encoder.output_norm_enc.weight": "hidden_norm.weight"}
_SPECULATORS_KEYS = SPECULATORS_METADATA | {"block_size", "target_hidden_size", "aux_hidden_state_layer_ids",
                                           "mask_token_id", "sliding_window_non_causal", "sample_from_anchor"}
_DSPARK_KEYS = {"markov_rank", "markov_head_type", "enable_confidence_head", "confidence_head_with_markov"}
_SPECULATORS_TYPES = ("dflash", "dspark", "dflash2", "xpress")


class _Layer(torch.nn.Module):
    """A Qwen3 decoder layer whose attention reads the context's keys and values beside the block's own."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, intermediate: int, eps: float,
                 bias: bool, conv: tuple[int, int] | None = None) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.input_layernorm, self.post_attention_layernorm = RMSNorm(hidden, eps), RMSNorm(hidden, eps)
        self.self_attn = torch.nn.Module()
        for name, rows in (("q_proj", heads), ("k_proj", kv_heads), ("v_proj", kv_heads)):
            setattr(self.self_attn, name, torch.nn.Linear(hidden, rows * head_dim, bias=bias))
        self.self_attn.o_proj = torch.nn.Linear(heads * head_dim, hidden, bias=bias)
        self.self_attn.q_norm, self.self_attn.k_norm = RMSNorm(head_dim, eps), RMSNorm(head_dim, eps)
        self.mlp = MLP(hidden, intermediate, bias=False)
        self.attention_conv = self.mlp_conv = None  # DFlash2's convolutions (taps, group size): drafts.dflash2
        if conv is not None:
            self.attention_conv, self.mlp_conv = GroupedConv(hidden, *conv), GroupedConv(hidden, *conv)

    def _keys_values(self, x, cos, sin):
        attn, (n, k, _) = self.self_attn, x.shape
        keys = attn.k_norm(attn.k_proj(x).view(n, k, self.kv_heads, self.head_dim)).transpose(1, 2)
        values = attn.v_proj(x).view(n, k, self.kv_heads, self.head_dim).transpose(1, 2)
        return keys * cos[:, None] + rotate_half(keys) * sin[:, None], values

    def context(self, context, cos, sin):
        """The context's (keys, values) ``[N, kv, k, d]`` for ``context [N, k, H]`` at the rotations ``cos, sin``."""
        return self._keys_values(context, cos, sin)

    def forward(self, h, cos, sin, keys, values, allowed):
        """The block ``h [N, m, H]`` over the context ``keys, values [N, kv, S, d]`` and itself; ``allowed [N, m, S +
        m]``."""
        attn, (n, m, _) = self.self_attn, h.shape
        x = self.input_layernorm(h)
        if self.attention_conv is not None:
            x, offsets = self.attention_conv.prepare(x)
        q = attn.q_norm(attn.q_proj(x).view(n, m, self.heads, self.head_dim)).transpose(1, 2)
        q = q * cos[:, None] + rotate_half(q) * sin[:, None]
        own_keys, own_values = self._keys_values(x, cos, sin)
        out = torch.nn.functional.scaled_dot_product_attention(
            q, torch.cat([keys, own_keys], 2), torch.cat([values, own_values], 2), attn_mask=allowed[:, None],
            enable_gqa=self.heads != self.kv_heads)
        out = attn.o_proj(out.transpose(1, 2).reshape(n, m, -1))
        h = h + (out if self.attention_conv is None else self.attention_conv.finish(out, offsets))
        x = self.post_attention_layernorm(h)
        if self.mlp_conv is None:
            return h + self.mlp(x)
        x, offsets = self.mlp_conv.prepare(x)
        return h + self.mlp_conv.finish(self.mlp(x), offsets)


class DFlashBlock(torch.nn.Module):
    """A DFlash drafter's weights and settings (module docstring): ``fc``, ``hidden_norm``, ``layers``, ``norm``; each
    layer's attention pattern ``kinds[i] = (causal, window, inclusive)``."""

    def __init__(self, config: dict, kinds: list[tuple[bool, int | None, bool]]) -> None:
        super().__init__()
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        H, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
        d, kv = int(config.get("head_dim") or H // heads), int(config.get("num_key_value_heads") or heads)
        eps, n = float(config.get("rms_norm_eps", 1e-6)), len(config["target_layer_ids"])
        self.fc, self.hidden_norm = torch.nn.Linear(n * H, H, bias=False), RMSNorm(H, eps)
        dflash2 = config.get("dflash2")  # DFlash2's settings (speculators' layout), else None
        conv = (int(dflash2["conv_kernel_size"]), int(dflash2["conv_group_size"])) if dflash2 else None
        self.layers = torch.nn.ModuleList(_Layer(H, heads, kv, d, int(config["intermediate_size"]), eps,
                                                 bool(config.get("attention_bias")), conv) for _ in kinds)
        self.candidate_selector = CandidateSelector(int(config["vocab_size"]), H, int(dflash2["selector_rank"]), int(
            dflash2["selector_top_k"])) if dflash2 else None
        self.norm = RMSNorm(H, eps)
        self.kinds = list(kinds)
        self.block_size, self.mask_token_id = int(config["block_size"]), int(config["mask_token_id"])
        self.embedding_scale = float(config.get("input_embedding_scale") or 1.0)
        self.output_multiplier = float(config.get("output_multiplier") or 1.0)
        self.softcap = float(config.get("final_logit_softcapping") or 0.0)
        self.head = None  # speculators' own head over a draft vocabulary (SubsetHead), else the target's
        if config.get("draft_token_ids") is not None:
            ids = torch.as_tensor(config["draft_token_ids"])
            self.head = SubsetHead(torch.zeros(len(ids), H), ids, int(config["vocab_size"]))
        self.from_anchor = bool(config.get("sample_from_anchor"))  # the anchor's own output drafts the first token
        self.predictions = self.block_size - (0 if self.from_anchor else 1)  # drafted tokens a block gives
        rank = int(config.get("markov_rank") or 0)
        draft_vocab = int(config.get("draft_vocab_size") or config["vocab_size"])
        self.markov_head = MarkovHead(int(config["vocab_size"]), draft_vocab, rank, H,
                                      config.get("markov_head_type") == "gated") if rank else None
        xpress = config.get("xpress")  # XPress's refiner (speculators' layout), else None
        self.refiner_head = XPressRefiner(int(config["vocab_size"]), draft_vocab, H, self.block_size, xpress[
            "xpress_rank"], xpress["xpress_mlp_ratio"]) if xpress else None
        keys = set(LlamaConfig().to_dict()) | {"rope_theta", "rope_scaling"}
        rope = {k: v for k, v in config.items() if k in keys and k not in ("layer_types", "sliding_window")}
        self.rotary = LlamaRotaryEmbedding(LlamaConfig(**rope))

    def rope(self, positions: torch.Tensor):
        """(cos, sin) ``[N, k, d]`` at ``positions [N, k]``."""
        return self.rotary(self.norm.weight, positions)

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        return self.hidden_norm(self.fc(features))

    def run(self, embeds, positions, keys, values, masks) -> torch.Tensor:
        """The block ``embeds [N, m, H]`` at ``positions [N, m]`` over the context ``keys[i], values[i]`` -> normed
        outputs ``[N, m, H]``; ``masks[kind] [N, m, S + m]`` per layer kind."""
        cos, sin = self.rope(positions)
        h = embeds
        for layer, kind, k, v in zip(self.layers, self.kinds, keys, values):
            h = layer(h, cos, sin, k, v, masks[kind])
        return self.norm(h)


class DFlashDraft(FeatureQueue):
    """A DFlash drafter behind the engine's ``LanguageModel`` interface, with ``FeatureReader``, ``PlansLength`` and
    ``RowExpander`` (module docstring). Every slot fed has a column in each layer's context cache: the fused feature of
    the slot before it (none for a row's first slot and for drafted slots); ``_depth`` counts the drafted slots since
    the anchor; ``_block [B, B_size - 1, V]`` is the last anchor's block of logits."""

    format = "DFlash"

    def __init__(self, block: DFlashBlock, target_lm, feature_layers: tuple[int, ...], *, device=None) -> None:
        self.device = torch.device(device or target_lm.device)
        self.block = block.eval().to(self.device)
        target = target_lm.model
        self._frozen = {"embedding": target.get_input_embeddings(), "head": target.get_output_embeddings()}
        self.vocab_size = int(target_lm.vocab_size)
        self.feature_layers = tuple(feature_layers)
        self.feature_size = block.fc.in_features
        self._slots: SlotMask | None = None
        self._queued: torch.Tensor | None = None
        self._hidden: torch.Tensor | None = None  # DSpark's gated head, DFlash2's selector: the last block's outputs
        self._reads_hidden = block.markov_head is not None or block.candidate_selector is not None

    @property
    def cache_length(self) -> int:
        return 0 if self._slots is None else self._slots.length

    def reset(self, batch_size: int) -> None:
        empty = lambda *size, dtype=torch.float32: torch.zeros(batch_size, *size, dtype=dtype, device=self.device)  # noqa: E731
        self._slots = SlotMask(empty(0, dtype=torch.bool))
        layer = self.block.layers[0]
        self._keys = [empty(layer.kv_heads, 0, layer.head_dim) for _ in self.block.layers]
        self._values = [empty(layer.kv_heads, 0, layer.head_dim) for _ in self.block.layers]
        self._context, self._depth = empty(0, dtype=torch.bool), empty(0, dtype=torch.long)
        self._tokens = empty(0, dtype=torch.long)  # each slot's token (XPress reads the one before the anchor)
        self._block, self._hidden, self._queued, self._line, self._full = None, None, None, None, None

    def plan_length(self, gamma: int) -> int:
        """At most ``block_size - 1`` drafted tokens (``block_size`` sampling from the anchor)."""
        return min(gamma, self.block.predictions)

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        self._restart(input_ids, attention_mask)
        return self._feed(input_ids.to(self.device), attention_mask.bool().to(self.device), self._take_queued(input_ids),
                          every_column=False)[:, -1]

    @torch.no_grad()
    def score(self, tokens: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
        """Append ``tokens [B, k]``; logits ``[B, k, V]``: with queued features, block position 1 of each token as the
        anchor; else (k = 1) the next position of the last anchor's block."""
        if self._slots is None:
            raise ValueError("score called before prefill/reset: start a batch first")
        tokens = tokens.to(self.device)
        valid = torch.ones_like(tokens, dtype=torch.bool) if valid is None else valid.bool().to(self.device)
        queued = self._take_queued(tokens)
        if queued is not None:
            return self._feed(tokens, valid, queued, every_column=True)
        if tokens.shape[1] != 1 or self._block is None:
            raise ValueError("a DFlash draft needs the target's features (observe) before scoring these tokens")
        last = self._slots.length - 1 - self._slots.mask.flip(-1).long().argmax(-1)  # [B] each row's last slot
        rows = torch.arange(len(tokens), device=self.device)
        depth = self._depth[rows, last] + 1
        if int(depth.max()) >= self.block.predictions:
            raise ValueError(f"a DFlash block of {self.block.block_size} drafts at most {self.block.predictions} "
                             "tokens a step (gamma, or a tree's depth)")
        self._slots.append(valid)
        self._extend(torch.zeros_like(valid), depth[:, None], tokens)
        hidden = None if self._hidden is None else self._hidden[rows, depth]
        bias = None
        if self.block.refiner_head is not None:  # the drafted token is the one before block position `at`'s
            at = depth + self.block.block_size - self.block.predictions
            self._line[rows, at] = tokens[:, 0]
            bias = self.block.refiner_head(self._full, self._line, at)
        return self.position_logits(self._block[rows, depth], tokens[:, 0], hidden, bias)[:, None]

    def _extend(self, context, depth, tokens, keys=None, values=None) -> None:
        """The new slots' context flags, depths, tokens and (none: empty) context keys and values."""
        self._context, self._depth = torch.cat([self._context, context], 1), torch.cat([self._depth, depth], 1)
        self._tokens = torch.cat([self._tokens, tokens], 1)
        for i, cached in enumerate(self._keys):
            k = keys[i] if keys is not None else cached.new_zeros(*cached.shape[:2], context.shape[1], cached.shape[-1])
            self._keys[i] = torch.cat([cached, k], 2)
            self._values[i] = torch.cat([self._values[i], values[i] if values is not None else torch.zeros_like(k)], 2)

    def _feed(self, tokens, valid, features, *, every_column: bool) -> torch.Tensor:
        """Slots for ``tokens [B, k]`` reading the features of the slots before them; the blocks of every column (or of
        the last) as anchor. -> logits ``[B, k, V]`` (block position 1 where computed)."""
        if features is None:
            raise ValueError("a DFlash draft needs the target's features (observe) before scoring these tokens")
        (batch, k), start = tokens.shape, self._slots.length
        positions = self._slots.append(valid)
        context = valid & (positions > 0)  # a row's first slot has no slot before it
        fused = self.block.fuse(features.to(self.device).float())
        cos, sin = self.block.rope((positions - 1).clamp(min=0))
        pairs = [layer.context(fused, cos, sin) for layer in self.block.layers]
        self._extend(context, torch.zeros_like(tokens), tokens, [p[0] for p in pairs], [p[1] for p in pairs])
        columns = torch.arange(k if every_column else 1, device=self.device) + (0 if every_column else k - 1)
        c, size = len(columns), self.block.block_size
        anchors = positions[:, columns].reshape(-1)  # [B c]
        embeds = self.embed_block(tokens[:, columns].reshape(-1))
        query_positions = anchors[:, None] + torch.arange(size, device=self.device)
        slots = torch.arange(self._slots.length, device=self.device)
        seen = (self._context[:, None, :] & (slots[None, None, :] <= (start + columns)[None, :, None]))  # [B, c, S]
        seen = seen.reshape(batch * c, 1, -1).expand(-1, size, -1)
        key_positions = torch.cat([(self._slots.positions - 1).repeat_interleave(c, 0), query_positions], 1)
        key_valid = torch.cat([seen, seen.new_ones(batch * c, size, size)], -1)
        masks = {kind: block_mask(kind, query_positions, key_positions, key_valid) for kind in set(self.block.kinds)}
        keys = [x.repeat_interleave(c, 0) for x in self._keys]
        values = [x.repeat_interleave(c, 0) for x in self._values]
        out = self.block.run(embeds, query_positions, keys, values, masks)  # [B c, size, H]
        hidden = out[:, size - self.block.predictions:].reshape(batch, c, self.block.predictions, -1)
        base = self.base_logits(hidden)  # [B, c, P, V]
        self._block = base[:, -1]
        self._hidden = hidden[:, -1] if self._reads_hidden else None
        result = torch.zeros(batch, k, self.vocab_size, device=self.device)
        bias = self._refine(out.view(batch, c, size, -1), tokens[:, columns], start + columns)
        result[:, columns] = self.position_logits(base[:, :, 0], tokens[:, columns], hidden[:, :, 0], bias)
        return result

    def embed_block(self, anchors: torch.Tensor) -> torch.Tensor:
        """The blocks ``[anchor, mask x (B - 1)]`` of ``anchors [N]`` as the layers read them ``[N, B, H]``: the
        target's raw embedding table, times ``input_embedding_scale``."""
        ids = anchors.new_full((len(anchors), self.block.block_size), self.block.mask_token_id)
        ids[:, 0] = anchors
        return torch.nn.functional.embedding(ids, self._frozen["embedding"].weight).float() * self.block.embedding_scale

    def static_form(self) -> StaticDFlashDraft:
        """This drafter in the engine's captured steps (``drafts.dflash_static.StaticDFlashDraft``)."""
        return StaticDFlashDraft(self)

    def _refine(self, out: torch.Tensor, anchors: torch.Tensor, slots: torch.Tensor) -> torch.Tensor | None:
        """XPress's bias of each column's first drafted position (``out [B, c, size, H]``, the anchors' tokens and
        slots ``[B, c]``); keeps the last column's block and tokens before its positions for the drafted slots."""
        if self.block.refiner_head is None:
            return None
        (batch, c), size = anchors.shape, self.block.block_size
        line = anchors.new_zeros(batch, c, size)
        first = size - self.block.predictions  # 1 in the fill-in layout: the token before the anchor comes first
        if first:
            before = tokens_before(self._slots.mask, self._tokens, slots.expand(batch, -1))
            line[..., 0] = torch.where(before >= 0, before, anchors)  # the anchor where the row has none
        line[..., first] = anchors
        self._full, self._line = out[:, -1], line[:, -1]
        at = torch.full((batch * c,), first, device=self.device)
        return self.block.refiner_head(out.reshape(batch * c, size, -1), line.view(batch * c, size), at).view(
            batch, c, -1)

    def base_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The output head's logits over the target's vocabulary (the draft vocabulary's others the lowest float)."""
        head = self.block.head if self.block.head is not None else self._frozen["head"]
        return head(hidden.to(head.weight.dtype))[..., : self.vocab_size].float()

    def position_logits(self, base: torch.Tensor, previous: torch.Tensor, hidden: torch.Tensor | None,
                bias: torch.Tensor | None = None) -> torch.Tensor:
        """A drafted position's logits: ``base`` plus XPress's ``bias`` and DSpark's Markov bias of the ``previous``
        token (on the draft vocabulary's columns), times ``output_multiplier``, softcapped where the config says;
        DFlash2's candidates rescored given the ``previous`` token."""
        if self.block.markov_head is not None:
            markov = self.block.markov_head(previous, hidden).float()
            bias = markov if bias is None else bias + markov
        if bias is not None:
            bias = bias.float()
            ids = self.block.head.token_ids if self.block.head is not None else torch.arange(
                bias.shape[-1], device=bias.device)
            base = base.index_add(-1, ids, bias)
        logits = base * self.block.output_multiplier
        if self.block.softcap > 0:
            logits = torch.tanh(logits / self.block.softcap) * self.block.softcap
        if self.block.candidate_selector is not None:
            logits = self.block.candidate_selector(logits, previous, hidden)
        return logits

    def rollback(self, n) -> None:
        _, uneven = self._slots.rollback(n)
        self._trim()
        if uneven:
            self._compact()

    def _trim(self) -> None:
        end = self._slots.length
        self._context, self._depth, self._tokens = self._context[:, :end], self._depth[:, :end], self._tokens[:, :end]
        self._keys = [x[:, :, :end] for x in self._keys]
        self._values = [x[:, :, :end] for x in self._values]

    def repeat_rows(self, k: int) -> None:
        self._slots.repeat_rows(k)
        self._context, self._depth = self._context.repeat_interleave(k, 0), self._depth.repeat_interleave(k, 0)
        self._tokens = self._tokens.repeat_interleave(k, 0)
        self._line = None if self._line is None else self._line.repeat_interleave(k, 0)
        self._full = None if self._full is None else self._full.repeat_interleave(k, 0)
        self._keys = [x.repeat_interleave(k, 0) for x in self._keys]
        self._values = [x.repeat_interleave(k, 0) for x in self._values]
        self._block = None if self._block is None else self._block.repeat_interleave(k, 0)
        self._hidden = None if self._hidden is None else self._hidden.repeat_interleave(k, 0)
        self._queued = None if self._queued is None else self._queued.repeat_interleave(k, 0)

    def select_rows(self, index: torch.Tensor) -> None:
        index = index.to(self.device)
        self._slots.select_rows(index)
        self._context, self._depth, self._tokens = self._context[index], self._depth[index], self._tokens[index]
        self._line = None if self._line is None else self._line[index]
        self._full = None if self._full is None else self._full[index]
        self._keys, self._values = [x[index] for x in self._keys], [x[index] for x in self._values]
        self._block = None if self._block is None else self._block[index]
        self._hidden = None if self._hidden is None else self._hidden[index]
        self._queued = None if self._queued is None else self._queued[index]
        self._compact()

    def _compact(self) -> None:
        index = self._slots.compaction()
        if index is not None:
            self._context, self._depth = self._context.gather(1, index), self._depth.gather(1, index)
            self._tokens = self._tokens.gather(1, index)
            at = index[:, None, :, None]
            self._keys = [x.gather(2, at.expand(-1, x.shape[1], -1, x.shape[-1])) for x in self._keys]
            self._values = [x.gather(2, at.expand(-1, x.shape[1], -1, x.shape[-1])) for x in self._values]


def _config(directory: Path) -> dict:
    """The drafter's ``config.json`` with ``dflash_config``'s keys lifted to the top level (they win, as z-lab reads
    them); a speculators config flattened (its layer's keys, ``target_layer_ids`` from ``aux_hidden_state_layer_ids``)
    after the refusals of the module docstring."""
    config = json.loads((directory / "config.json").read_text())
    kind = config.get("speculators_model_type")
    if kind not in _SPECULATORS_TYPES:
        if "markov_rank" in config or "markov_rank" in (config.get("dflash_config") or {}):
            raise ValueError(f"{directory}: a DSpark drafter outside speculators' layout (DeepSeek's): not read; "
                             "speculators' layout (speculators_model_type dspark) is")
        return {**config, **(config.get("dflash_config") or {})}
    known = _SPECULATORS_KEYS | {"dspark": _DSPARK_KEYS, "dflash2": set(DFLASH2_KEYS), "xpress": set(XPRESS_KEYS)}.get(
        kind, set())
    layer, unknown = dict(config.get("transformer_layer_config") or {}), sorted(set(config) - known)
    why = f"config keys {unknown} this loader does not read" if unknown else refused_layer(layer)
    if why is None and not config.get("aux_hidden_state_layer_ids"):
        why = "no aux_hidden_state_layer_ids"
    if why is None and layer.get("model_type", "qwen3") != "qwen3":
        why = f"a layer of type {layer.get('model_type')!r}"
    if why is None and kind == "dspark" and "sample_from_anchor" not in config:
        why = "no sample_from_anchor (speculators 0.9.0 reads it as True, vLLM 0.34 as False: two drafts)"
    if why is None and kind == "dspark" and type(config.get("markov_rank", 256)) is not int:
        why = f"markov_rank {config['markov_rank']!r} (an integer; speculators' default 256)"
    if why is None and kind == "dspark" and config.get("markov_head_type", "vanilla") not in ("vanilla", "gated"):
        why = f"a Markov head of type {config['markov_head_type']!r} (this loader builds vanilla and gated)"
    if why is None and kind == "dflash2":
        why = dflash2_refusal(config, layer)
    if why is None and kind == "xpress":
        why = xpress_refusal(config)
    if why:
        raise ValueError(f"{directory}: a speculators {kind} drafter with {why}: refused (module docstring)")
    flat = {**layer, "architectures": ["DFlashDraftModel"], "block_size": config.get("block_size", 8),
            "mask_token_id": config.get("mask_token_id"), "draft_vocab_size": config.get("draft_vocab_size"),
            "target_layer_ids": [int(i) - 1 for i in config["aux_hidden_state_layer_ids"]],
            "sample_from_anchor": bool(config.get("sample_from_anchor"))}
    if kind == "dspark":
        flat |= {k: config.get(k) for k in _DSPARK_KEYS}
        flat["markov_rank"] = int(config.get("markov_rank", 256))  # speculators' default
    if kind == "dflash2":
        flat["dflash2"] = {k: int(config[k]) for k in DFLASH2_KEYS}
    if kind == "xpress":
        flat["xpress"] = xpress_settings(config)
    if config.get("target_hidden_size") not in (None, layer.get("hidden_size")):
        flat["hidden_size_target"] = config["target_hidden_size"]
    return flat


def is_dflash_dir(directory: str | os.PathLike) -> bool:
    """Whether ``directory`` holds a DFlash drafter in z-lab's layout (``dflash_config``), transformers'
    (``muse_glimmer_assistant``) or speculators' (also DSpark, DFlash2 and XPress), with its weights."""
    directory = Path(directory)
    if not (directory / "config.json").is_file() or published_weights(directory, _WEIGHTS) is None:
        return False
    config = json.loads((directory / "config.json").read_text())
    return ("dflash_config" in config or config.get("model_type") == "muse_glimmer_assistant"
            or config.get("speculators_model_type") in _SPECULATORS_TYPES)


def _kinds(config: dict, transformers_layout: bool) -> list[tuple[bool, int | None, bool]]:
    count = int(config["num_hidden_layers"])
    types = config.get("layer_types") or ["full_attention"] * count
    if len(types) != count or set(types) - {"full_attention", "sliding_attention"}:
        raise ValueError(f"DFlash layer types {types} for {count} layers: this loader builds full and sliding attention")
    kinds = []
    for kind in types:
        sliding = kind == "sliding_attention"
        window = int(config["sliding_window"]) if sliding else None
        if transformers_layout:
            kinds.append((False, window, True))
        else:
            causal = sliding if config.get("is_causal") is None else bool(config["is_causal"])
            kinds.append((causal, window, False))
    return kinds


def _expected(config: dict) -> dict[str, tuple[int, ...]]:
    H, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    d, kv, inter = int(config.get("head_dim") or H // heads), int(config.get("num_key_value_heads") or heads), int(
        config["intermediate_size"])
    shapes = {"fc.weight": (H, len(config["target_layer_ids"]) * H), "hidden_norm.weight": (H,), "norm.weight": (H,)}
    for i in range(int(config["num_hidden_layers"])):
        at = f"layers.{i}."
        shapes |= {at + "input_layernorm.weight": (H,), at + "post_attention_layernorm.weight": (H,),
                   at + "self_attn.q_proj.weight": (heads * d, H), at + "self_attn.k_proj.weight": (kv * d, H),
                   at + "self_attn.v_proj.weight": (kv * d, H), at + "self_attn.o_proj.weight": (H, heads * d),
                   at + "self_attn.q_norm.weight": (d,), at + "self_attn.k_norm.weight": (d,),
                   at + "mlp.gate_proj.weight": (inter, H), at + "mlp.up_proj.weight": (inter, H),
                   at + "mlp.down_proj.weight": (H, inter)}
        if config.get("attention_bias"):
            shapes |= {at + f"self_attn.{n}_proj.bias": (r,) for n, r in (("q", heads * d), ("k", kv * d),
                                                                           ("v", kv * d), ("o", H))}
    draft = int(config.get("draft_vocab_size") or config["vocab_size"])
    if draft != int(config["vocab_size"]):  # speculators' own head over a draft vocabulary
        shapes |= {"lm_head.weight": (draft, H), "d2t": (draft,), "t2d": (int(config["vocab_size"]),)}
    rank = int(config.get("markov_rank") or 0)
    if rank:  # DSpark's Markov head
        shapes |= {"markov_head.markov_w1.weight": (int(config["vocab_size"]), rank),
                   "markov_head.markov_w2.weight": (draft, rank)}
        if config.get("markov_head_type") == "gated":
            shapes |= {"markov_head.gate_proj.weight": (rank, H + rank), "markov_head.gate_proj.bias": (rank,)}
    if config.get("dflash2"):
        shapes |= dflash2_shapes(config["dflash2"], H, int(config["vocab_size"]), int(config["num_hidden_layers"]))
    if config.get("xpress"):
        shapes |= XPressRefiner.shapes(config["xpress"], H, int(config["vocab_size"]), draft, int(config["block_size"]))
    if config.get("enable_confidence_head"):  # read, not used: it predicts acceptance, the draft's law is without it
        shapes |= {"confidence_head.proj.weight": (1, H + (rank if config.get("confidence_head_with_markov") else 0)),
                   "confidence_head.proj.bias": (1,)}
    return shapes


def load_dflash(target_lm, directory: str | os.PathLike, *, device=None) -> DFlashDraft:
    """A DFlash drafter saved in z-lab's, transformers' or speculators' layout, or a DSpark, DFlash2 or XPress drafter
    in speculators' (module docstring), as a draft for ``target_lm`` (a ``CausalLM``); a layout, setting or tensor
    this loader does not read is refused in one line, by name."""
    directory = Path(directory)
    if not is_dflash_dir(directory):
        raise ValueError(f"{directory} holds no DFlash drafter: expected config.json with dflash_config (z-lab's "
                         "layout) or model_type muse_glimmer_assistant (transformers'), and model.safetensors")
    config = _config(directory)
    transformers_layout = config.get("model_type") == "muse_glimmer_assistant"
    refused = [k for k in DFLASH2_KEYS if config.get(k) is not None] + [  # DFlash2 outside speculators' layout
        a for a in config.get("architectures") or () if a not in ("DFlashDraftModel", "MuseGlimmerAssistantModel")]
    if refused:
        raise ValueError(f"{directory}: {refused}: this loader reads DFlash drafters (DFlashDraftModel) and DFlash2 in "
                         "speculators' layout, not DFlash2 in this layout or other architectures")
    config.setdefault("block_size", 16)
    missing = [k for k in ("target_layer_ids", "mask_token_id") if config.get(k) is None]
    if missing or config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{directory}: DFlash config without {missing} or with activation {config.get('hidden_act')!r}")
    text = target_lm.model.config.get_text_config()
    if int(config["hidden_size"]) != text.hidden_size or config.get("hidden_size_target"):
        raise ValueError(f"{directory}: a DFlash drafter of hidden size {config['hidden_size']} reads a target of the "
                         f"same size, not {text.hidden_size}")
    rows = int(target_lm.model.get_input_embeddings().weight.shape[0])
    if not 0 <= int(config["mask_token_id"]) < rows:
        raise ValueError(f"{directory}: mask_token_id {config['mask_token_id']} is not a token of the target's "
                         f"embedding ({rows} rows)")
    layers = tuple(int(i) + 1 for i in config["target_layer_ids"])
    if not all(1 <= i <= text.num_hidden_layers for i in layers):
        raise ValueError(f"{directory}: target_layer_ids {config['target_layer_ids']} outside the target's "
                         f"{text.num_hidden_layers} layers")
    tensors = {_TRANSFORMERS_NAMES.get(k, k): v for k, v in read_tensors(published_weights(directory, _WEIGHTS)).items()}
    check_tensors(directory, tensors, _expected(config), set(), "DFlash")
    if "d2t" in tensors and int(config["vocab_size"]) != target_lm.vocab_size:
        raise ValueError(f"{directory}: a draft vocabulary over {config['vocab_size']} tokens, the target has "
                         f"{target_lm.vocab_size}")
    if "d2t" in tensors:
        config["draft_token_ids"] = torch.arange(len(tensors["d2t"])) + tensors.pop("d2t").long()
        tensors.pop("t2d")
        tensors["head.weight"] = tensors.pop("lm_head.weight")
        tensors["head.token_ids"] = config["draft_token_ids"]
    for name in [k for k in tensors if k.startswith("confidence_head.")]:
        del tensors[name]
    block = DFlashBlock(config, _kinds(config, transformers_layout))
    block.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in tensors.items()}, strict=True)
    return DFlashDraft(block, target_lm, layers, device=device)
