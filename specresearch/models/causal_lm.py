"""The transformers causal-LM wrapper (:class:`CausalLM`): KV cache with per-row rollback, one mask of valid slots.

It implements :class:`specresearch.models.protocols.LanguageModel`; on CPU it switches the model's linear layers
and attention to :mod:`specresearch.models.kernels`.

Ragged batches (the design choice): rows of a batch accept different numbers of draft tokens, but all
rows share ONE physical cache length. ``rollback(n)`` with per-row ``n`` crops the suffix common to all
rows from the KV cache (``DynamicCache.crop``) and masks out (attention mask 0) the extra slots of rows
that drop more. Position ids are the number of valid slots before each token, so every row sees the
positions of its compacted sequence, and its logits equal those of a plain uncached forward of that
compacted sequence (``tests/test_models.py`` checks it with atol 1e-4 in float32, B = 1 and B > 1 with
left padding). The cost is up to gamma dead slots per step in a batch whose rows disagree (with B = 1
there are never any); once dead slots pass a quarter of the cache (and 4 slots), a rollback, a tree's end or a
row selection packs each row's valid slots to the right (``SlotMask.compaction``): the cache holds at most a
third (or 4) more slots than its longest row. The validity mask lives in one object (``SlotMask``): it is the only record of the
cache length, and the KV cache is asserted to agree with it.
"""

from __future__ import annotations

import inspect
import os
from typing import Sequence

import torch

from specresearch.checks import check_int
from specresearch.models import fused, griffin, rotary
from specresearch.models import recurrent as states
from specresearch.models.attention import (
    attention_layout,
    exact_kernel,
    use_cpu_sdpa,
    use_packed_sdpa,
)
from specresearch.models.kernels import (
    SKINNY_ROWS,
    choose_kernel_rows,
    choose_skinny_rows,
    experts_in_float64,
    use_kernel_rows,
    use_skinny_linears,
)
from specresearch.models.positions import positions_from_masks
from specresearch.models.prefix_sets import PrefixSets, both_sets
from specresearch.models.probe import CHECKED_TYPES, check_cached_tree
from specresearch.models.slots import SlotMask, host_counts, rollback_counts
from specresearch.models.static_lm import StaticCausalLM
from specresearch.models.static_lm import capture_refusal as model_capture_refusal
from specresearch.models.widths import fit_width, output_rows, readable

__all__ = ["CausalLM", "cache_argument", "output_cache", "check_prompt", "resolve_device", "placement"]


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """``"auto"`` -> cuda if available, else mps, else cpu; anything else is passed to ``torch.device``. A device this
    machine lacks is a ``ValueError`` saying so (torch's own errors, an ``AssertionError`` "Torch not compiled with
    CUDA enabled" at the first tensor, name neither the argument nor what to pass)."""
    if str(device) == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        return torch.device("mps") if _mps_available() else torch.device("cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(f"device {device!r} is not a device: use 'auto', 'cpu', 'cuda', 'cuda:N' or 'mps'") from None
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r}: torch sees no CUDA device on this machine (a CPU build of torch, or no "
                         "GPU); use 'cpu' or 'auto'")
    if resolved.type == "cuda" and resolved.index is not None and resolved.index >= torch.cuda.device_count():
        raise ValueError(f"device {device!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    if resolved.type == "mps" and not _mps_available():
        raise ValueError(f"device {device!r}: torch sees no Apple GPU (MPS) on this machine; use 'cpu' or 'auto'")
    return resolved


def _mps_available() -> bool:
    return getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available()


def check_prompt(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> None:
    """Raise ``ValueError`` unless ``input_ids [B, L]`` (L >= 1) has a left-padded ``attention_mask`` of its shape."""
    if input_ids.ndim != 2 or input_ids.shape[1] < 1:
        raise ValueError(f"input_ids must be [B, L] with L >= 1, got shape {tuple(input_ids.shape)}")
    if attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"attention_mask must have the shape of input_ids {tuple(input_ids.shape)}, "
            f"got {tuple(attention_mask.shape)}"
        )
    if bool((attention_mask.long().diff(dim=1) < 0).any()):
        raise ValueError("attention_mask must be left-padded: in each row, zeros (padding) and then ones")


def cache_argument(model) -> str:
    """The keyword a transformers model's forward takes its KV cache under: ``"cache"`` (transformers >= 5.24,
    where ``past_key_values`` is deprecated) or ``"past_key_values"``; ``ValueError`` for a model that takes neither
    (GPT-1 keeps no cache: it cannot score drafts after a cached context)."""
    parameters = inspect.signature(model.forward).parameters
    if "cache" not in parameters and "past_key_values" not in parameters:
        raise ValueError(f"{type(model).__name__} takes no KV cache, so it cannot score drafts after a cached context: "
                         "use a model of another family")
    return "cache" if "cache" in parameters else "past_key_values"


def output_cache(output):
    """The KV cache of a transformers model output, under either name (``cache_argument``)."""
    cache = output.get("cache")
    return cache if cache is not None else output.get("past_key_values")


class CausalLM:
    """A transformers ``AutoModelForCausalLM`` behind the narrow prefill / score / rollback interface.

    Uses transformers' own ``DynamicCache`` (``crop`` for rollback); keeps no state on the HF model object
    and never branches on the model class (on CPU it switches the model's ``nn.Linear`` layers to
    :class:`SkinnyLinear`, see ``skinny_linear``, and its ``"sdpa"`` attention to :func:`cpu_sdpa_attention`; on CUDA
    to :func:`packed_sdpa_attention`).
    Logits are returned in float32.

    Args:
        model: a model name or local path (loaded with ``AutoModelForCausalLM.from_pretrained``), or an instance.
        device: ``"auto"`` (cuda > mps > cpu) or a torch device; ignored when ``device_map`` is given.
        dtype: e.g. ``torch.float32`` / ``torch.bfloat16``; ``None`` keeps the checkpoint's (or instance's) dtype. A
            float64 mixture-of-experts model runs transformers' eager experts (:func:`experts_in_float64`).
        device_map: passed to ``from_pretrained`` (e.g. ``"auto"``: accelerate shards a large target across
            the available GPUs, then CPU). Only with a name or path.
        skinny_linear: switch the model's ``nn.Linear`` layers to :class:`SkinnyLinear` and its ``"sdpa"``
            attention to :func:`cpu_sdpa_attention` (module docstring: cheaper verification calls on CPU).
            ``None``: when the model is on the CPU, the layers for the row counts :func:`choose_skinny_rows`
            finds faster on this machine (none: plain ``nn.Linear``), and the compiled kernel
            (:mod:`specresearch.models.native`) for those :func:`choose_kernel_rows` finds faster still;
            ``True``: every row count 1-8, no kernel. On CUDA, ``None`` switches the attention to
            :func:`packed_sdpa_attention` and ``False`` leaves it alone.
        switch_attention: a model whose attention kernel takes no 4-D mask (``flash_attention_2/3``) is switched to
            ``sdpa`` with a warning (:func:`~specresearch.models.attention.exact_kernel`); ``False``: refused instead
            (the caller's model stays as it is), as a float64 model's grouped experts are (:func:`experts_in_float64`).
            A model with layers it cannot mask (chunked attention, KV sharing) is refused either way; one with
            recurrent layers (:mod:`specresearch.models.recurrent`: linear attention, state spaces) rolls them back
            per row and scores a draft tree path by path.
        fuse_projections: compute each layer's query / key / value projections, and its MLP's gate / up pair, as one
            matrix product (:mod:`specresearch.models.fused`: fewer kernels a step on a GPU, fewer products and Python
            calls on the CPU, the same weights). ``None``: fused wherever the model is whole (not split). Fusing
            works on ``model`` in place: each member's parameter becomes a new one, a view of its group's tensor (an
            optimizer built on the old ones no longer reaches them); ``False`` leaves them as they are.
        vocab_size: the logits' width, when it is not the model's own: a draft that shares its target's tokenizer
            but not its number of output rows (Qwen2.5-0.5B's 151,936 against Qwen2.5-7B's 152,064: rows past the
            tokenizer's ids are padding) gets logits over the target's ids, its own cut or padded with -inf (a
            token it cannot propose has probability 0, which every verifier takes; the output law stays the
            target's). A narrower model reads an id past its rows (one the shared tokenizer never produces; a random
            target may) as its last row: that changes what it proposes, never the output law.
            ``drafts.registry`` passes it for a checkpoint draft whose tokenizer is the target's.
        probe: score a 3-node draft tree and a token after a dead slot, each against an uncached forward, and refuse
            the model in one line where they differ (:mod:`specresearch.models.probe`: a family whose attention places
            keys otherwise than by the positions and masks passed here). ``None``: for a family the matrices of
            ``tests/test_families.py`` do not check; ``False``: never.

    Every family and kernel gets the masks it applies (:mod:`specresearch.models.attention`): tree calls and, for a
    model with sliding-window layers, every call carry an additive mask built from the slots' positions; windows are
    applied here and the cache keeps the whole context (docs/engine_and_models.md, "Families and kernels").
    """

    returns_hidden_states = True  # prefill / score take hidden_layers= (module docstring)

    def __init__(self, model, *, device: str | torch.device = "auto", dtype: torch.dtype | None = None,
                 device_map: str | dict | None = None, skinny_linear: bool | None = None, switch_attention: bool = True,
                 fuse_projections: bool | None = None, vocab_size: int | None = None, probe: bool | None = None):
        if vocab_size is not None:
            check_int("vocab_size", vocab_size, meaning="the logits' width")
        if isinstance(model, (str, os.PathLike)):
            model = _from_pretrained(model, dtype, device_map)
        elif device_map is not None:
            raise ValueError("device_map needs a model name or path (from_pretrained applies it); got an instance")
        self.placement = placement(model)  # None, "device_map" or "tensor_parallel": the model is split, left in place
        if self.placement is None:
            model = model.to(device=resolve_device(device), dtype=dtype)
        elif dtype is not None and dtype != model.dtype:
            raise ValueError(f"{type(model).__name__} is split ({self.placement}); it keeps its dtype {model.dtype}: "
                             "load it with the dtype you want (dtype=... in from_pretrained)")
        if self.placement is not None and skinny_linear:
            raise ValueError(f"skinny_linear=True replaces linear layers, which a split model ({self.placement}) "
                             "keeps as transformers placed them: leave skinny_linear unset")
        self.model = model.eval()
        self.switched_from = exact_kernel(self.model, may_switch=switch_attention)  # the kernel replaced, or None
        experts_in_float64(self.model, may_switch=switch_attention)
        self._cache_argument = cache_argument(self.model)  # refuses a model that keeps no cache
        positions_from_masks(self.model)  # Bloom's ALiBi, GPT-Neo's local windows: from the masks, not the slots
        states.clamp_time_steps(self.model)  # Mamba-2 mixers' time step bounded in their cached steps as in their scans
        griffin.keep_states_in_cache(self.model)  # RecurrentGemma's recurrent blocks: their states in the cache
        rotary.fix_rotaries(self.model)  # longrope's / dynamic NTK's frequencies: one set a run, not one a call
        self._attention = attention_layout(self.model)
        self.recurrent = self._attention.recurrent  # recurrent layers (models.recurrent): trees path by path
        whole = self.placement is None
        if fuse_projections and not whole:
            raise ValueError(f"fuse_projections=True lays weights end to end, which a split model ({self.placement}) "
                             "keeps as transformers placed them: leave fuse_projections unset")
        self.fuses = whole and fuse_projections is not False
        if self.fuses:  # before the calibrations below, which then time the fused products
            fused.fuse_projections(self.model)
        self.chooses_kernel_rows = whole and skinny_linear is None and self.device.type == "cpu"  # (half_weight_draft)
        if whole and (skinny_linear if skinny_linear is not None else self.device.type == "cpu"):
            use_skinny_linears(self.model, choose_skinny_rows(self.model) if skinny_linear is None else SKINNY_ROWS)
            if skinny_linear is None:
                use_kernel_rows(self.model, choose_kernel_rows(self.model))
            use_cpu_sdpa(self.model)
        elif whole and skinny_linear is None and self.device.type == "cuda":
            use_packed_sdpa(self.model)  # a masked call of a grouped-query layer without transformers' K / V copies
        self._cache = None
        self._slots: SlotMask | None = None
        self._sets: PrefixSets | None = None  # a second cache where the run changes its rotary set (plan_context)
        self.logits_width = vocab_size if vocab_size != self.own_vocab_size else None  # the logits' width, when not own
        if probe if probe is not None else self.model.config.model_type not in CHECKED_TYPES:
            try:
                check_cached_tree(self)
            finally:
                self._cache, self._slots = None, None

    @property
    def device(self) -> torch.device:
        """Where inputs go: the device of the input embeddings (the first shard under a device_map)."""
        return self.model.get_input_embeddings().weight.device

    @property
    def vocab_size(self) -> int:
        """Size of the logits' last dimension (may exceed ``len(tokenizer)``; ``vocab_size=`` where given)."""
        return self.logits_width if self.logits_width is not None else self.own_vocab_size

    @property
    def own_vocab_size(self) -> int:
        """The model's own number of output rows."""
        return output_rows(self.model)

    @property
    def max_context(self) -> int | None:
        """Positions the model supports (config ``max_position_embeddings``); None if the config does not say."""
        return getattr(self.model.config.get_text_config(), "max_position_embeddings", None)

    def plan_context(self, positions: int, shortest: int | None = None) -> bool:
        """Rotate every call by the frequencies of a sequence of ``positions`` where they follow its length (longrope,
        dynamic NTK: ``models.rotary``); the engine gives the longest prompt plus ``max_new_tokens`` before a run.
        Where a longrope set changes within the run and the ``shortest`` prompt (None: any) is within the change,
        each token comes from its prefix's set (:mod:`~specresearch.models.prefix_sets`: two caches from the next
        run's start until every row is past it). Returns whether a rotation changed (the cache then holds keys of
        the former)."""
        changed = rotary.plan_rotaries(self.model, positions)
        limit = rotary.set_change(self.model, positions)
        crosses = limit is not None and (shortest is None or shortest <= limit)
        if crosses and self._sets is not None and self._sets.limit == limit:  # a plan within a run: its caches kept
            self._sets.context = positions
        else:
            self._sets = PrefixSets(self, limit, positions) if crosses else None
        return changed

    @property
    def cache_length(self) -> int:
        return 0 if self._slots is None else self._slots.length

    def cache_layers(self) -> list:
        """The growing cache's layers (transformers'), in order: what a prefill left there, for a static form that
        starts from it (``models.static_lm``: models with recurrent layers)."""
        return list(self._cache.layers)

    def cached_layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The keys and values ``[B, H, S, D]`` attention layer ``layer`` holds, with each slot's validity and position
        ``[B, S]`` (for a draft that attends to the target's keys: ``drafts.gemma4``)."""
        held = self._cache.layers[layer]
        return held.keys, held.values, self._slots.mask, self._slots.positions

    @property
    def valid_lengths(self) -> torch.Tensor:
        """Number of valid (unmasked) tokens in the context of each row. -> [B]."""
        return self._slots.counts()

    @both_sets()
    def reset(self, batch_size: int) -> None:
        if self.fuses:
            fused.keep_fused(self.model)
        self._cache = states.recurrent_cache(self.model) if self.recurrent else _new_cache(self.model, self._attention)
        self._slots = SlotMask(torch.zeros(batch_size, 0, dtype=torch.bool, device=self.device))

    @both_sets("prompt")
    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, hidden_layers: Sequence[int] | None = None):
        """Run the left-padded prompt ``[B, L]`` through the model; return the last next-token logits ``[B, V]``
        (and, with ``hidden_layers``, the hidden states ``[B, L, n * H]``)."""
        check_prompt(input_ids, attention_mask)
        self.reset(input_ids.shape[0])
        self._slots.append(attention_mask.to(self.device).bool())
        positions = self._slots.prompt_positions()
        logits, hidden = self._forward(input_ids, positions, logits_to_keep=1, hidden_layers=hidden_layers)
        return logits[:, -1] if hidden_layers is None else (logits[:, -1], hidden)

    @both_sets("chain")
    def score(self, tokens: torch.Tensor, valid: torch.Tensor | None = None, hidden_layers: Sequence[int] | None = None):
        """Append ``tokens [B, k]`` (slots with ``valid = False`` masked out); return logits ``[B, k, V]``
        (and, with ``hidden_layers``, the hidden states ``[B, k, n * H]``)."""
        if self._slots is None:
            raise ValueError("score called before prefill/reset: start a batch first")
        if valid is None:
            valid = torch.ones(tokens.shape, dtype=torch.bool, device=self.device)
        piece = states.piece_size(self.model) if self.recurrent else None
        if piece and self._slots.length and tokens.shape[1] > piece:
            return states.score_in_pieces(self, tokens, valid, hidden_layers, piece)
        if self.recurrent:
            states.trim(self._cache)
        positions = self._slots.append(valid.to(self.device))
        logits, hidden = self._forward(tokens, positions, logits_to_keep=0, hidden_layers=hidden_layers)
        return logits if hidden_layers is None else (logits, hidden)

    @both_sets()
    def begin_tree(self) -> None:
        """Start scoring a tree: the slots of the following :meth:`score_tree` calls form one region."""
        if self.recurrent:  # each path scored as a chain (models.recurrent.score_tree_as_paths)
            self.tree_paths = None
            return
        self._slots.begin_tree()

    @both_sets("tree")
    def score_tree(self, tokens: torch.Tensor, depth: torch.Tensor, visible: torch.Tensor, hidden_layers: Sequence[int] | None = None):
        """Score ``tokens [B, k]`` as tree nodes in one call: node i sits at position (valid slots before the tree)
        + ``depth[b, i]`` and attends to every valid slot before the tree and to the region slots and new nodes
        marked in ``visible [B, k, r + k]`` (its ancestors and itself). Returns logits ``[B, k, V]`` (and hidden
        states with ``hidden_layers``), each equal to an uncached forward of the node's path (tests/test_tree.py)."""
        if self.recurrent:
            return states.score_tree_as_paths(self, tokens, depth, visible, hidden_layers)
        positions, mask = self._slots.append_tree(visible.to(self.device), depth.to(self.device))
        logits, hidden = self._forward(tokens, positions, logits_to_keep=0, hidden_layers=hidden_layers, visible=mask)
        return logits if hidden_layers is None else (logits, hidden)

    @both_sets()
    def end_tree(self, kept: torch.Tensor) -> None:
        """Keep the tree slots where ``kept [B, r]`` (the accepted path); crop the slots no row keeps, and pack the
        cache when dead slots make up a quarter of it (``SlotMask.compaction``)."""
        if self.recurrent:
            states.end_tree_as_paths(self, kept)
            return
        dropped = self._slots.end_tree(kept.to(self.device))
        if dropped:
            self._cache.crop(-dropped)
        self._compact()

    def _compact(self) -> None:
        """Pack each row's valid slots to the right when dead slots make up a quarter of the cache."""
        index = self._slots.compaction()
        if index is not None:
            for layer in self._cache.layers:  # each on its layer's device under a device_map
                if getattr(layer, "keys", None) is None:  # a recurrent layer: no slots
                    continue
                slots = index.to(layer.keys.device)
                # keys and values may differ in heads and width (DeepSeek-V2/V3's latent attention: 16 and 4 wide here)
                layer.keys, layer.values = _gather_slots(layer.keys, slots), _gather_slots(layer.values, slots)
                if getattr(layer, "indexer_keys", None) is not None:  # DeepSeek Sparse Attention's [B, L, D]
                    layer.indexer_keys = _gather_slots(layer.indexer_keys[:, None], slots)[:, 0]
            if self.recurrent:
                states.set_length(self._cache, self._slots.length)
        self._check_length()

    @both_sets()
    def repeat_rows(self, k: int) -> None:
        """Each row becomes ``k`` consecutive rows with the same cache (drafting k paths per row)."""
        for layer in self._cache.layers:
            if getattr(layer, "keys", None) is not None:
                layer.batch_repeat_interleave(k)
        if self.recurrent:
            states.repeat_rows(self._cache, k)
        self._slots.repeat_rows(k)

    @both_sets()
    def select_rows(self, index: torch.Tensor) -> None:
        """Keep rows ``index [B']`` of the cache, in that order (the paths the verifier accepted, or the rows still
        generating); packs the cache when the rows left behind dead slots."""
        for layer in self._cache.layers:  # each on its layer's device under a device_map
            if getattr(layer, "keys", None) is not None:
                layer.batch_select_indices(index.to(layer.keys.device))
        if self.recurrent:
            states.select_rows(self._cache, index)
        self._slots.select_rows(index.to(self.device))
        self._compact()

    @property
    def static_refusal(self) -> str | None:
        """Why this model has no static form (a sentence naming it), or None."""
        name = type(self.model).__name__
        if self._sets is not None:
            return (f"{name} changes its rotary set past position {self._sets.limit} within the planned run, each token"
                    " drawn from its prefix's set (models.prefix_sets: two caches), which a static KV cache does not hold")
        return None

    def capture_refusal(self, mode: str) -> str | None:
        """Why this model's static steps cannot run as ``mode`` (``models.static_lm.capture_refusal``), or None."""
        return model_capture_refusal(self.model, mode)

    def static_form(self) -> StaticCausalLM:
        """This model over a static KV cache (:class:`~specresearch.models.static_lm.StaticCausalLM`): the same
        weights, kernels and masks, for the engine's captured steps."""
        if self.static_refusal:
            raise ValueError(f"{self.static_refusal}: run the growing loop (compile='off')")
        return StaticCausalLM(self)

    @both_sets()
    def rollback(self, n) -> None:
        """Forget the last ``n`` slots (``int`` or per-row ``[B]``): crop what all rows drop, mask the rest; recurrent
        layers restore each row's state (:func:`~specresearch.models.recurrent.rollback_rows`)."""
        if self.recurrent:
            counts = rollback_counts(n, self._slots.mask.shape[0], self.device)
            most = max(host_counts(n, len(counts)) or counts.tolist(), default=0)
        common, uneven = self._slots.rollback(n)
        if self.recurrent:
            from transformers.cache_utils import DynamicLayer

            for layer in self._cache.layers:  # the attention part of each layer, if any
                if getattr(layer, "keys", None) is not None and common:
                    DynamicLayer.crop(layer, -common)
            states.rollback_rows(self._cache, counts, most)
            states.set_length(self._cache, self._slots.length)
        elif common:
            self._cache.crop(-common)
        if uneven:  # rows dropped different counts: dead slots may have piled up
            self._compact()

    def _forward(self, tokens: torch.Tensor, positions: torch.Tensor, logits_to_keep: int, hidden_layers=None, visible=None):
        """-> (logits float32, the requested hidden states concatenated float32 or None). ``visible [B, k, L]``: the
        slots each new one sees, for tree calls; by default a chain's (``SlotMask.visible_to_last``)."""
        kept = states.before_call(self._cache) if self.recurrent else None
        with torch.no_grad():
            out = self.model(
                input_ids=readable(tokens.to(self.device), self),
                attention_mask=self._mask(positions, visible),
                position_ids=positions,
                use_cache=True,
                **{self._cache_argument: self._cache},
                logits_to_keep=logits_to_keep,
                output_hidden_states=hidden_layers is not None,
            )
        if kept is not None:
            states.after_call(kept, tokens.shape[1])
        self._check_length()
        logits = fit_width(out.logits.float(), self.logits_width)
        if hidden_layers is None:
            return logits, None
        hidden = torch.cat([out.hidden_states[i].to(self.device) for i in hidden_layers], dim=-1)  # layers' devices
        return logits, hidden.float()

    def _check_length(self) -> None:
        held = self._cache.get_seq_length()
        if held != self._slots.length:  # a model whose layers keep no slot per token (RecurrentGemma, CPM-Ant)
            raise RuntimeError(f"{type(self.model).__name__}'s cache holds {held} tokens where CausalLM placed "
                               f"{self._slots.length}: its layers do not keep one cache slot per token")

    def _mask(self, positions: torch.Tensor, visible: torch.Tensor | None):
        """The attention mask of a call appending slots at ``positions [B, k]``: the 2-D slot mask where transformers
        makes the right 4-D one of it (a chain call, no sliding window, weights no wider than float32, a model that
        reads a 2-D mask as it is: not GIT), else the
        layout's additive masks (float64: transformers fills its mask with float64's lowest value, which ``eager``'s
        float32 softmax reads as -inf, so a left-padded row's pad slots turned the row into NaN;
        ``models.attention.additive_mask``)."""
        layout = self._attention
        if visible is None and not (layout.windowed or layout.four_d) and (self.model.dtype != torch.float64
                                                                            or self.recurrent):
            if not self._attention.attends:  # no attention layer: the call's own columns (Mamba v1 multiplies the
                return self._slots.mask[:, -positions.shape[1]:].long()  # mask it is given into the call's tokens)
            return self._slots.mask.long()  # recurrent layers read a call's padding from it (models.recurrent)
        if visible is None:
            visible = self._slots.visible_to_last(positions.shape[1])
        masks = self._attention.masks(visible, positions, self._slots.positions, self.model.dtype)
        if not self.recurrent:
            return masks
        # windows beside recurrent layers (Lara, Inkling): the mapping, the recurrent layers' 2-D mask of the call
        masks = masks if isinstance(masks, dict) else {self._attention.windows[0][0]: masks}
        return {**masks, "linear_attention": self._slots.mask[:, -positions.shape[1]:].long()}


def placement(model) -> str | None:
    """How a transformers model is split: ``"tensor_parallel"`` (loaded with ``tp_plan``: each process holds a shard
    of every layer), ``"device_map"`` (accelerate's hooks over several devices, or with layers offloaded to the CPU or
    disk), or None (one device, where ``CausalLM`` may move it)."""
    if getattr(model, "tp_size", None) not in (None, 1) or getattr(model, "_tp_size", None) not in (None, 1):
        return "tensor_parallel"
    places = set(getattr(model, "hf_device_map", {}).values())
    if len(places) > 1 or places & {"disk", "meta"}:
        return "device_map"
    return None


def _new_cache(model, layout):
    """Full layers for every layer, sliding-window ones included (windows are masked: models.attention); DeepSeek
    Sparse Attention's layers keep their indexer's keys too (transformers' ``DynamicIndexedLayer``)."""
    from transformers import DynamicCache

    return DynamicCache(config=model.config) if layout.indexed else DynamicCache()


def _from_pretrained(name_or_path, dtype, device_map):
    from transformers import AutoModelForCausalLM

    local = os.path.isdir(name_or_path)
    return AutoModelForCausalLM.from_pretrained(
        name_or_path, dtype=dtype if dtype is not None else "auto", device_map=device_map, local_files_only=local
    )


def _gather_slots(cache: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``cache [B, heads, L, width]`` with each row's slots ``index [B, L']`` in that order."""
    return cache.gather(2, index[:, None, :, None].expand(-1, cache.shape[1], -1, cache.shape[-1]))
