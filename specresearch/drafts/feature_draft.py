"""What every feature head is built of, and the draft that puts one behind the engine's interface.

* :class:`FeatureDraft`: a head (``drafts.feature.FeatureHead``, ``drafts.eagle.Eagle3Head`` / ``Eagle1Head``) behind
  the ``LanguageModel`` interface plus ``FeatureReader``: its KV cache, slot mask, rollback and rows;
* :func:`rollout`: EAGLE-3's training-time test over any such head (Li et al. 2025, arXiv 2503.01840);
* the Llama-style pieces the heads are made of (:class:`RMSNorm`, :class:`Attention`, :class:`MLP`,
  :class:`DecoderLayer`, :func:`rotate_half`, :func:`rope_base`).

A head has ``fuse_features``, ``block(inputs, tokens, positions, past, allowed)``, ``logits``, ``layers``,
``feature_layers`` and ``feature_size`` (``drafts.feature`` describes the toolkit's own head).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specresearch.models import fused
from specresearch.models.causal_lm import check_prompt
from specresearch.models.kernels import (
    SKINNY_ROWS,
    choose_kernel_rows,
    choose_skinny_rows,
    use_kernel_rows,
    use_skinny_linears,
)
from specresearch.models.slots import SlotMask
from specresearch.models.static_cache import StaticPast, StaticRows, keep_path

__all__ = ["FeatureDraft", "StaticFeatureDraft", "FeatureQueue", "rollout", "RMSNorm", "Attention", "MLP", "DecoderLayer",
           "rotate_half", "rope_base", "extend_past", "windowed", "frozen_logits"]


# The decoder layer's pieces (Llama-style names so a target layer can be copied in)


class RMSNorm(torch.nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


class Attention(torch.nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, bias: bool) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = torch.nn.Linear(hidden, heads * head_dim, bias=bias)
        self.k_proj = torch.nn.Linear(hidden, kv_heads * head_dim, bias=bias)
        self.v_proj = torch.nn.Linear(hidden, kv_heads * head_dim, bias=bias)
        self.o_proj = torch.nn.Linear(heads * head_dim, hidden, bias=bias)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """``x [B, k, H]`` -> queries ``[B, heads, k, d]``, keys and values ``[B, kv_heads, k, d]`` (RoPE applied)."""
        B, k, _ = x.shape
        q = self.q_proj(x).view(B, k, self.heads, self.head_dim).transpose(1, 2)
        key = self.k_proj(x).view(B, k, self.kv_heads, self.head_dim).transpose(1, 2)
        value = self.v_proj(x).view(B, k, self.kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = cos[:, None], sin[:, None]  # [B, 1, k, d]
        return q * cos + rotate_half(q) * sin, key * cos + rotate_half(key) * sin, value

    def attend(self, q, keys, values, allowed: torch.Tensor) -> torch.Tensor:
        """Queries ``[B, h, k, d]`` over ``keys/values [B, kv, S, d]`` where ``allowed [B, k, S]`` -> ``[B, k, H]``."""
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=allowed[:, None], enable_gqa=self.heads != self.kv_heads)
        return self.o_proj(out.transpose(1, 2).reshape(q.shape[0], q.shape[2], -1))


class MLP(torch.nn.Module):
    def __init__(self, hidden: int, intermediate: int, bias: bool) -> None:
        super().__init__()
        self.gate_proj = torch.nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = torch.nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = torch.nn.Linear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(torch.nn.Module):
    def __init__(self, text_config) -> None:
        super().__init__()
        hidden, eps = text_config.hidden_size, text_config.rms_norm_eps
        heads = text_config.num_attention_heads
        head_dim = getattr(text_config, "head_dim", None) or hidden // heads
        kv_heads = getattr(text_config, "num_key_value_heads", None) or heads
        self.input_layernorm = RMSNorm(hidden, eps)
        self.self_attn = Attention(hidden, heads, kv_heads, head_dim, bool(getattr(text_config, "attention_bias", False)))
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.mlp = MLP(hidden, text_config.intermediate_size, bool(getattr(text_config, "mlp_bias", False)))

    def forward(self, x, cos, sin, past: tuple[torch.Tensor, torch.Tensor] | None, allowed):
        """``x [B, k, H]``; ``past``: the earlier (keys, values) attended to, in key order before this block's own
        (None: none); ``allowed [B, k, S_past + k]``. Returns ``(out [B, k, H], (keys, values))`` with this block's
        appended: what the next block's ``past`` is."""
        q, keys, values = self.self_attn.project(self.input_layernorm(x), cos, sin)
        keys, values = extend_past(past, keys, values)
        x = x + self.self_attn.attend(q, keys, values, allowed)
        return x + self.mlp(self.post_attention_layernorm(x)), (keys, values)


def extend_past(past, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's ``keys / values [B, kv, k, d]`` with its ``past`` before them: None (nothing earlier), a pair of
    earlier tensors (concatenated: the growing cache), or a static one (``models.static_cache.StaticPast``: written at
    the call's slots, the whole buffers returned)."""
    if past is None:
        return keys, values
    if isinstance(past, StaticPast):
        return past.extend(keys, values)
    return torch.cat([past[0], keys], dim=2), torch.cat([past[1], values], dim=2)


def windowed(allowed: torch.Tensor, window: int | None, positions: torch.Tensor, key_positions: torch.Tensor):
    """``allowed [B, k, S]`` narrowed to the keys less than ``window`` positions before each query (transformers'
    sliding window: ``positions [B, k]``, ``key_positions [B, S]``); as it is where ``window`` is None. A head with a
    windowed layer (``drafts.mtp``: Mellum's) sets ``window``."""
    if not window:
        return allowed
    return allowed & (positions[:, :, None] - key_positions[:, None, :] < window)


def frozen_logits(head: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """A target's own output layer ``head`` (used, not trained: outside the draft's modules) on ``hidden [..., H]``
    -> float32 logits ``[..., V]``, computed in the head's dtype (``drafts.eagle.Eagle1Head``, ``drafts.mtp``)."""
    bias = None if head.bias is None else head.bias.detach()
    return F.linear(hidden.to(head.weight.dtype), head.weight.detach(), bias).float()


def rope_base(text_config) -> float:
    parameters = getattr(text_config, "rope_parameters", None) or {}
    return float(parameters.get("rope_theta", getattr(text_config, "rope_theta", 10000.0)))


def rollout(head, features: torch.Tensor, tokens: torch.Tensor, attention_mask: torch.Tensor, passes: int,
            feature_noise: float = 0.0, generator: torch.Generator | None = None) -> list[torch.Tensor]:
    """Training-time test over right-padded sequences (EAGLE-3): a head's predictions at depths 1..passes (any head
    with ``FeatureHead``'s ``fuse_features``, ``block`` and ``layers``).

    Args:
        features: ``[B, L, F]`` the target's features at every slot; tokens ``[B, L]``; attention_mask ``[B, L]``.
        passes: rollout depth D. Pass k at slot j reads its own pass k-1 prediction of slot j-1 and
            attends to true slots <= j-k plus its own path's slots j-k+1..j (as when drafting).
        feature_noise: half-width of uniform noise added to the true input features (EAGLE-1).
    Returns:
        D tensors ``[B, L, H]``: pass k's predicted feature at slot j, whose logits give q for x_{j+1}
        at draft depth k+1 (meaningful for j >= k).
    """
    B, L, _ = features.shape
    true = F.pad(features[:, :-1], (0, 0, 1, 0))  # [B, L, F]: feature of slot j-1 (zeros before slot 0)
    if feature_noise:
        noise = torch.rand(true.shape, generator=generator, device=generator.device if generator is not None else None)
        true = true + feature_noise * (2 * noise.to(true.device) - 1)
    positions = torch.arange(L, device=features.device).expand(B, L)
    valid = attention_mask.bool()  # [B, L]
    index = torch.arange(L, device=features.device)
    past = [None for _ in head.layers]
    outputs, inputs = [], head.fuse_features(true)
    for k in range(passes):
        old = (index[None, :] <= index[:, None] - k)[None] & valid[:, None, :]  # [B, L, L]: true slots <= j-k
        blocks = [old] + [(index[None, :] == index[:, None] - k + i).expand(B, L, L) for i in range(1, k + 1)]
        allowed = torch.cat(blocks, dim=2)
        if k > 0:  # slots j < k have no path of length k: let them see themselves only (excluded from the loss)
            allowed[:, :k] = False
            diagonal = torch.arange(min(k, L), device=features.device)
            allowed[:, diagonal, k * L + diagonal] = True
        hidden, past = head.block(inputs, tokens, positions, past, allowed)
        outputs.append(hidden)
        inputs = F.pad(hidden[:, :-1], (0, 0, 1, 0))  # the next pass reads slot j-1's prediction
    return outputs


class FeatureQueue:
    """The target's true features a feature-reading draft is handed (``FeatureReader.observe``) before the slots that
    read them: shared by :class:`FeatureDraft` and ``drafts.medusa.MedusaDraft`` (which set ``feature_size``,
    ``feature_layers``, ``device`` and ``reset``)."""

    _queued: torch.Tensor | None = None  # [B, k, F] true features for the next k slots

    def observe(self, features: torch.Tensor) -> None:
        """Queue the target's true features ``[B, k, F]`` of the slots before the next ``k`` slots fed."""
        if features.ndim != 3 or features.shape[-1] != self.feature_size:
            raise ValueError(f"features must be [B, k, {self.feature_size}] (target hidden states {self.feature_layers}), "
                             f"got shape {tuple(features.shape)}")
        self._queued = features.float().to(self.device)

    def _restart(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> None:
        """``prefill``'s start: check the prompt, start a batch of its rows, keep the features observed for it."""
        check_prompt(input_ids, attention_mask)
        queued = self._queued
        self.reset(input_ids.shape[0])
        self._queued = queued

    def _take_queued(self, tokens: torch.Tensor) -> torch.Tensor | None:
        """The queued features for ``tokens [B, k]`` (then none are queued), or None."""
        queued, self._queued = self._queued, None
        if queued is not None and queued.shape[:2] != tokens.shape:
            raise ValueError(f"observed features cover {tuple(queued.shape[:2])} slots but tokens are {tuple(tokens.shape)}")
        return queued


class FeatureDraft(FeatureQueue):
    """A feature head (``drafts.feature.FeatureHead``, an EAGLE head of ``drafts.eagle``) behind the ``LanguageModel``
    interface plus ``FeatureReader``.

    Slots fed with a true feature (queued by :meth:`observe`) and slots fed with the head's own
    prediction of the previous slot (drafting) share one KV cache per layer and one ``SlotMask`` (the
    only record of the cache length), exactly as ``models.causal_lm.CausalLM``: per-row rollback masks slots out.
    On CPU the head's ``nn.Linear`` layers are switched to ``models.kernels.SkinnyLinear`` in place, as ``CausalLM``
    does (same parameters; its 1-8-row calls are the drafting ones), computing the row counts
    ``models.kernels.choose_skinny_rows`` times faster on the head's own weights (``skinny_linear``: ``None``, the
    default, which also gives the compiled kernel the row counts ``models.kernels.choose_kernel_rows`` finds faster
    still), every row count (``True``) or none (``False``). ``chooses_kernel_rows``: whether the kernel's rows were
    timed here (``drafts.registry.half_weight_draft`` times them again for the float16 weights).
    ``fuse_projections``: the head's q / k / v and gate / up projections as one product each (``models.fused``),
    ``None``: on CUDA only (on the CPU, where ``CausalLM`` fuses by default, the drafts ``specresearch generate``
    uses hold float16 weights, which fusing leaves alone; a float32 head's drafting call, ``eagle3-v8k``'s, timed
    the same fused and unfused on a 2-core EPYC with one thread, ``training.feature_measure.measure_feature_cost``).
    """

    skips_first_slot = False  # EagleDraft: each row's first prompt slot is left out of its context

    def __init__(self, head: torch.nn.Module, *, max_context: int | None = None, device="cpu",
                 skinny_linear: bool | None = None, fuse_projections: bool | None = None) -> None:
        self.head = head.eval().to(device)  # beside the target it reads (its embedding is the target's, already there)
        self.fuses = fuse_projections if fuse_projections is not None else torch.device(device).type == "cuda"
        if self.fuses:  # before the calibrations, which then time the fused products
            fused.fuse_projections(self.head)
        if torch.device(device).type == "cpu":
            chosen = choose_skinny_rows(self.head) if skinny_linear is None else SKINNY_ROWS if skinny_linear else ()
            use_skinny_linears(self.head, chosen)
            if skinny_linear is None:
                use_kernel_rows(self.head, choose_kernel_rows(self.head))
        self.chooses_kernel_rows = torch.device(device).type == "cpu" and skinny_linear is None
        self.vocab_size = head.vocab_size
        self.feature_layers = head.feature_layers
        self.feature_size = head.feature_size
        self.max_context = max_context
        self.device = torch.device(device)
        self._slots: SlotMask | None = None
        self._cache: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._queued: torch.Tensor | None = None  # [B, k, F] true features for the next k slots
        self._last: torch.Tensor | None = None  # [B, H] the head's prediction at the last slot

    @property
    def cache_length(self) -> int:
        return 0 if self._slots is None else self._slots.length

    @property
    def valid_lengths(self) -> torch.Tensor:
        return self._slots.counts()

    def reset(self, batch_size: int) -> None:
        if self.fuses:
            fused.keep_fused(self.head)
        self._slots = SlotMask(torch.zeros(batch_size, 0, dtype=torch.bool, device=self.device))
        self._cache, self._last = [], None
        self._queued = None

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Start a batch from a left-padded prompt ``[B, L]``; needs ``observe`` of ``[B, L, F]`` first. -> ``[B, V]``."""
        self._restart(input_ids, attention_mask)
        return self.head.logits(self._append(input_ids, attention_mask.bool())[:, -1])  # the last slot's only

    @torch.no_grad()
    def score(self, tokens: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
        """Append ``tokens [B, k]``; return logits ``[B, k, V]``. Inputs: the queued true features, else (k = 1)
        the head's own prediction at the last slot."""
        return self.head.logits(self._append(tokens, valid))

    def _append(self, tokens: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
        """:meth:`score` up to the predicted features ``[B, k, H]`` (a prompt's logits are read at its last slot only)."""
        if self._slots is None:
            raise ValueError("score called before prefill/reset: start a batch first")
        k, queued = tokens.shape[1], self._take_queued(tokens)
        if queued is not None:
            inputs = self.head.fuse_features(queued)
        elif k == 1 and self._last is not None:
            inputs = self._last[:, None]
        else:
            raise ValueError("a feature draft needs the target's features (observe) before scoring these tokens")
        hidden = self._run(tokens, valid, inputs)
        self._last = hidden[:, -1]
        return hidden

    def _run(self, tokens: torch.Tensor, valid: torch.Tensor | None, inputs: torch.Tensor) -> torch.Tensor:
        """New slots for ``tokens [B, k]`` reading ``inputs [B, k, H]``, causal over the cache -> their outputs."""
        k = tokens.shape[1]
        valid = torch.ones(tokens.shape, dtype=torch.bool, device=self.device) if valid is None else valid.bool()
        old = self._slots.length
        positions = self._slots.append(valid)
        columns = torch.arange(old + k, device=self.device)
        new = torch.arange(k, device=self.device)
        allowed = self._slots.mask[:, None, :] & (columns[None, None, :] <= old + new[None, :, None])
        allowed = windowed(allowed, getattr(self.head, "window", None), positions, self._slots.positions)
        allowed[:, new, old + new] = True  # a masked slot sees itself (no empty softmax)
        past = self._cache or [None for _ in self.head.layers]
        hidden, self._cache = self.head.block(inputs, tokens, positions, past, allowed)
        return hidden

    def static_form(self) -> "StaticFeatureDraft":
        """This head over a static KV cache (:class:`StaticFeatureDraft`), for the engine's captured steps."""
        return StaticFeatureDraft(self)

    def rollback(self, n) -> None:
        """Forget the last ``n`` slots (``int`` or ``[B]``); the next ``score`` needs freshly observed features."""
        common, uneven = self._slots.rollback(n)
        if common:
            self._cache = [(k[:, :, :-common], v[:, :, :-common]) for k, v in self._cache]
        self._last = None
        if uneven:
            self._compact()

    def repeat_rows(self, k: int) -> None:
        """Each row becomes ``k`` consecutive copies: cache, slots, queued features and last prediction."""
        self._rows(lambda t: t.repeat_interleave(k, 0))
        self._slots.repeat_rows(k)

    def select_rows(self, index: torch.Tensor) -> None:
        """Keep rows ``index [B']``, in that order; packs the cache when the rows left behind dead slots."""
        index = index.to(self.device)
        self._rows(lambda t: t[index])
        self._slots.select_rows(index)
        self._compact()

    def _rows(self, change) -> None:
        """Apply ``change`` to every per-row tensor (batch first) but the slot mask."""
        self._cache = [(change(k), change(v)) for k, v in self._cache]
        self._queued = None if self._queued is None else change(self._queued)
        self._last = None if self._last is None else change(self._last)

    def _compact(self) -> None:
        index = self._slots.compaction()
        if index is not None:
            gather = index[:, None, :, None]
            self._cache = [(k.gather(2, gather.expand(-1, k.shape[1], -1, k.shape[-1])),
                            v.gather(2, gather.expand(-1, v.shape[1], -1, v.shape[-1]))) for k, v in self._cache]


class StaticFeatureDraft:
    """A feature draft's head over a static KV cache (``models.static_cache``): the static form of a
    :class:`FeatureDraft` (``models.protocols.StaticFeatureModel``), sharing its head and its layers' kernels.

    Each slot's input is given to :meth:`forward` (``inputs [B, k, H]``): the fused true features of the target
    (:meth:`fuse`), or the head's own predictions, which ``forward`` returns beside the logits (drafting: the
    prediction at a slot is the next slot's input, as :class:`FeatureDraft` drafts). Nothing but ``allocate`` and
    ``prefill`` reads the host."""

    def __init__(self, draft: FeatureDraft):
        self.head, self.fuses = draft.head, draft.fuses
        self.vocab_size, self.device, self.max_context = draft.vocab_size, draft.device, draft.max_context
        self.feature_layers, self.feature_size = draft.feature_layers, draft.feature_size
        self._skip = int(draft.skips_first_slot)
        self.rows: StaticRows | None = None
        self._pasts: list[StaticPast] = []

    def allocate(self, batch: int, capacity: int) -> None:
        self.rows = StaticRows(batch, capacity, self.device)
        self._pasts = [StaticPast(batch, capacity) for _ in self.head.layers]

    @torch.no_grad()
    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """The target's features ``[B, k, F]`` -> the head's inputs ``[B, k, H]``."""
        return self.head.fuse_features(features.float().to(self.device))

    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, leave: int = 0,
                inputs: torch.Tensor | None = None):
        """Start a batch: write and keep the prompt's first ``L - leave`` columns, slot j read with ``inputs[:, j]``
        (``[B, L - leave, H]``). -> (the last written slot's logits ``[B, V]``, the predictions), or (None, None)."""
        if self.fuses:
            fused.keep_fused(self.head)
        self.rows.begin(attention_mask.to(self.device), skip=self._skip)
        fed = input_ids.shape[1] - leave
        if fed <= 0:
            return None, None
        # the head's own call, whatever a subclass's drafting calls do (drafts.peagle's read their re-feed's)
        logits, hidden = StaticFeatureDraft.forward(self, input_ids[:, :fed].to(self.device), inputs=inputs[:, :fed])
        self.rows.advance(fed)
        return logits[:, -1], hidden

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, *, inputs: torch.Tensor, offset: int = 0, depth=None, visible=None):
        """Write ``tokens [B, k]`` read with ``inputs [B, k, H]`` past each row's length (``StaticRows.call``); keeps
        nothing. -> (logits ``[B, k, V]`` float32, the head's predictions ``[B, k, H]``)."""
        call = self.rows.call(tokens.shape[1], offset, depth, visible)
        for past in self._pasts:
            past.slots = call.slots
        allowed = windowed(call.allowed, getattr(self.head, "window", None), call.positions, call.key_positions)
        hidden, _ = self.head.block(inputs, tokens, call.positions, self._pasts, allowed)
        return self.head.logits(hidden), hidden

    def commit(self, n) -> None:
        self.rows.advance(n)

    def keep_path(self, source: torch.Tensor, n: torch.Tensor) -> None:
        keep_path([past.kv for past in self._pasts], self.rows, source, n)
