"""Feature drafts (EAGLE-style): a small head that reads the target's own hidden states.

Notation as in the package docstring: p = target, q = draft. Index conventions: the target at slot j
reads token x_j and emits the feature f_j (``hidden_states`` of the chosen layers), from which its LM
head gives p(x_{j+1} | x_<=j). The head at slot j reads ``g_{j-1}`` and x_j and predicts the target's
final (post-norm) feature h_j at slot j, read out by the target's own LM head (or a vocabulary-subset
head) into q(x_{j+1}). ``g_{j-1}`` is the target's true feature of slot j-1 when it is known (fused to
the hidden size when several layers are read, as EAGLE-3 fuses low, middle and high features) and the
head's own prediction h_{j-1} when it is not (slots drafted since the last verification). Li et al.
2024 (EAGLE, arXiv 2401.15077) and 2025 (EAGLE-3, arXiv 2503.01840).

Architecture of :class:`FeatureHead` (built against any transformers causal LM that returns
``hidden_states``; sizes, attention heads and RoPE base come from its config):

``g = fuse(features)`` (a linear map ``len(feature_layers) * H -> H``; identity for one layer),
``x = fc([g, embed(token)])`` (``2H -> H``), ``num_layers`` pre-norm decoder layers (attention with
RoPE and grouped KV heads, SwiGLU MLP; named as Llama's so they can start as a copy of a target
layer), a final RMSNorm (started as the target's), then the head. Its own KV cache makes drafting one
token one small forward.

:class:`FeatureDraft` puts the head behind the engine's ``LanguageModel`` interface plus
:class:`FeatureReader`: ``feature_layers`` (what the engine must ask the target for) and ``observe``
(the true features of the next slots it will be fed). ``generate.speculative_generate`` prefills the
target asking for those layers, and after each verification rolls the draft back to its last slot with
a true feature and re-feeds the accepted tokens with the target's true features.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from specresearch.checks import check_field, named_preset
from specresearch.drafts.distilled import SubsetHead
from specresearch.drafts.feature_draft import DecoderLayer, FeatureDraft, RMSNorm, rollout, rope_base
from specresearch.drafts.store import (
    _STORAGE_DTYPES,
    check_fingerprint,
    drafts_dir,
    embedding_fingerprint,
    manifest_path,
    read_manifest,
    weights_path,
    write_manifest,
)

__all__ = [
    "FeatureHeadConfig",
    "FEATURE_PRESETS",
    "FeatureHead",
    "head_layer_config",
    "build_feature_head",
    "rollout",
    "FeatureDraft",
    "save_feature_head",
    "load_feature_head",
    "is_feature_draft_dir",
    "feature_head_dir",
    "feature_head_digest",
    "trainable_tensors",
    "round_head_to_storage",
    "load_feature_draft",
]

_WEIGHTS_FILE = "feature_head.safetensors"
_HEAD_IDS = "head.token_ids"


@dataclass(frozen=True)
class FeatureHeadConfig:
    """Shape of a feature head; everything else is the target's config.

    Attributes:
        name: preset / directory name under ``data/drafts/``.
        feature_layers: target ``hidden_states`` indices read (negative from the end; -1 is the final,
            post-norm feature the LM head reads). Several are fused by a trained linear map.
        num_layers: decoder layers of the head.
        init_layer: target decoder layer copied into every head layer before training (Llama-style
            parameter names), or None for a seeded random init.
        head_tokens: None reads q out through the target's full (frozen) LM head; K uses a
            :class:`SubsetHead` over K tokens (q = 0 elsewhere), the target's rows, trained iff ``train_head``.
        feature_loss_weight, rollout, feature_noise: training settings stored with the head
            (``feature_distill`` explains them).
        storage_dtype: dtype of the shipped tensors.
        architecture: ``"specresearch"`` (:class:`FeatureHead`) or ``"eagle3"`` (``drafts.eagle.Eagle3Head``: EAGLE-3's
            own layer, one of them, over a trained ``head_tokens`` vocabulary; what ``drafts.eagle.save_eagle3`` writes
            in the EAGLE repository's layout for other engines).
    """

    name: str
    feature_layers: tuple[int, ...] = (-1,)
    num_layers: int = 1
    init_layer: int | None = -1
    head_tokens: int | None = None
    train_head: bool = False
    storage_dtype: str = "bfloat16"
    architecture: str = "specresearch"

    def __post_init__(self) -> None:
        object.__setattr__(self, "feature_layers", tuple(int(i) for i in self.feature_layers))
        check_field(bool(self.name) and "/" not in self.name, "name", f"must be a bare directory name, got {self.name!r}")
        check_field(len(self.feature_layers) >= 1 and len(set(self.feature_layers)) == len(self.feature_layers), "feature_layers",
                    f"must list distinct hidden_states indices, got {self.feature_layers!r}")
        check_field(isinstance(self.num_layers, int) and self.num_layers >= 1, "num_layers", f"must be an int >= 1, got {self.num_layers!r}")
        check_field(self.head_tokens is None or (isinstance(self.head_tokens, int) and self.head_tokens >= 1), "head_tokens",
                    f"must be None or an int >= 1, got {self.head_tokens!r}")
        check_field(not self.train_head or self.head_tokens is not None, "train_head", "needs head_tokens (the full head stays the target's)")
        check_field(self.storage_dtype in _STORAGE_DTYPES, "storage_dtype", f"must be one of {sorted(_STORAGE_DTYPES)}, got {self.storage_dtype!r}")
        check_field(self.architecture in ("specresearch", "eagle3"), "architecture",
                    f"must be 'specresearch' or 'eagle3', got {self.architecture!r}")
        check_field(self.architecture != "eagle3" or (self.num_layers == 1 and self.train_head), "architecture",
                    "'eagle3' is one layer with a trained head over head_tokens (num_layers=1, train_head=True)")

    @classmethod
    def from_name(cls, name: str) -> "FeatureHeadConfig":
        return named_preset(FEATURE_PRESETS, name)


FEATURE_PRESETS = {
    # EAGLE-1: the final feature only, the target's full head (c is dominated by the 49k-row head).
    "eagle1-full": FeatureHeadConfig("eagle1-full", feature_layers=(-1,)),
    # EAGLE-1 feature with an 8192-token head (the target's rows, trained): the cheap readout.
    "eagle1-v8k": FeatureHeadConfig("eagle1-v8k", feature_layers=(-1,), head_tokens=8192, train_head=True),
    # EAGLE-3-style fused low / middle / high features + the final one, 8192-token trained head.
    "eagle3-v8k": FeatureHeadConfig("eagle3-v8k", feature_layers=(4, 15, 26, -1), head_tokens=8192, train_head=True),
    # EAGLE-3's own architecture over the corpus's low / middle / high features: what save_eagle3 exports.
    "eagle3-native-v8k": FeatureHeadConfig("eagle3-native-v8k", feature_layers=(4, 15, 26), init_layer=None,
                                           head_tokens=8192, train_head=True, architecture="eagle3"),
    # The same with two decoder layers (both copies of the target's last): the capacity lever.
    "eagle3-v8k-2l": FeatureHeadConfig("eagle3-v8k-2l", feature_layers=(4, 15, 26, -1), num_layers=2, head_tokens=8192, train_head=True),
}


# --------------------------------------------------------------------------------------------------
# The head


def head_layer_config(text):
    """The sizes of a head's Llama-style layer (``feature_draft.DecoderLayer``) for a target's text config: the
    target's own attention sizes, or for a target without attention heads (Mamba, Falcon-Mamba: state spaces only)
    heads of 64 wide (one head below 64), an MLP of the config's ``intermediate_size`` (4 H without one) and its norm's
    epsilon (``layer_norm_epsilon`` where it has no ``rms_norm_eps``)."""
    hidden = text.hidden_size
    heads = getattr(text, "num_attention_heads", None) or max(1, hidden // 64)
    return SimpleNamespace(
        hidden_size=hidden, num_attention_heads=heads,
        num_key_value_heads=getattr(text, "num_key_value_heads", None) or heads,
        head_dim=getattr(text, "head_dim", None) or hidden // heads,
        intermediate_size=getattr(text, "intermediate_size", None) or 4 * hidden,
        rms_norm_eps=getattr(text, "rms_norm_eps", None) or getattr(text, "layer_norm_epsilon", None) or 1e-6,
        attention_bias=bool(getattr(text, "attention_bias", False)), mlp_bias=bool(getattr(text, "mlp_bias", False)),
        rope_theta=rope_base(text))


class FeatureHead(torch.nn.Module):
    """The trained part of a feature draft over a frozen transformers target (module docstring).

    Args:
        target: a transformers causal LM (``get_input_embeddings``, ``get_output_embeddings``, a
            ``config`` with hidden size / heads); its embedding (and full head) are read, never trained.
        config: :class:`FeatureHeadConfig`.
        head_token_ids: ``[K]`` token ids of the subset head, required iff ``config.head_tokens``.
        seed: seeds the random initialisation (forked RNG; the global RNG is untouched).
    """

    def __init__(self, target, config: FeatureHeadConfig, head_token_ids: torch.Tensor | None = None, seed: int = 0) -> None:
        super().__init__()
        if (config.head_tokens is None) != (head_token_ids is None):
            raise ValueError(f"head_token_ids must be given iff config.head_tokens is set (head_tokens={config.head_tokens})")
        text = target.config.get_text_config()
        self.config = config
        self.hidden_size = H = text.hidden_size
        self.num_hidden_states = text.num_hidden_layers + 1
        self.vocab_size = int(target.get_output_embeddings().weight.shape[0])
        self.feature_layers = tuple(i % self.num_hidden_states for i in config.feature_layers)
        self.feature_size = len(self.feature_layers) * H
        text = head_layer_config(text)
        head_dim = text.head_dim
        self.register_buffer("inv_freq", 1.0 / rope_base(text) ** (torch.arange(0, head_dim, 2).float() / head_dim), persistent=False)
        self._frozen = {"embedding": target.get_input_embeddings(), "head": target.get_output_embeddings()}
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.fuse = torch.nn.Linear(self.feature_size, H, bias=False) if len(self.feature_layers) > 1 else None
            self.fc = torch.nn.Linear(2 * H, H, bias=True)
            self.layers = torch.nn.ModuleList(DecoderLayer(text) for _ in range(config.num_layers))
            self.norm = RMSNorm(H, text.rms_norm_eps)
        self.subset_head = None
        if head_token_ids is not None:
            rows = self._frozen["head"].weight.detach()[torch.as_tensor(head_token_ids, dtype=torch.long)]
            self.subset_head = SubsetHead(rows.float(), head_token_ids, self.vocab_size)
            self.subset_head.weight.requires_grad_(config.train_head)
        self._init_from_target(target)

    @torch.no_grad()
    def _init_from_target(self, target) -> None:
        """fc starts as ``g + embedding``; layers as a copy of the target's ``init_layer`` (its tensors of the head
        layer's names and shapes: all of a Llama-style layer, the MLP and norms of Qwen3.5's gated attention, none of
        a Mamba mixer's); the norm as the target's."""
        H = self.hidden_size
        self.fc.weight.copy_(torch.cat([torch.eye(H), torch.eye(H)], dim=1))
        self.fc.bias.zero_()
        if self.fuse is not None:  # start by reading the last listed layer only
            self.fuse.weight.zero_()
            self.fuse.weight[:, -H:] = torch.eye(H)
        decoder = target.get_decoder()
        if self.config.init_layer is not None and hasattr(decoder, "layers"):
            source = decoder.layers[self.config.init_layer].state_dict()
            for layer in self.layers:  # every tensor of the same name and shape (all of a Llama-style layer's)
                own = layer.state_dict()
                layer.load_state_dict({k: v.float() for k, v in source.items()
                                       if k in own and own[k].shape == v.shape}, strict=False)
        norm = getattr(decoder, "norm", None)
        if norm is not None and getattr(norm, "weight", None) is not None and norm.weight.shape == self.norm.weight.shape:
            self.norm.weight.copy_(norm.weight.float())

    # -- pieces ----------------------------------------------------------------------------------

    def fuse_features(self, features: torch.Tensor) -> torch.Tensor:
        """Target features ``[..., F]`` (``F = len(feature_layers) * H``) -> head inputs ``[..., H]``."""
        return features if self.fuse is None else self.fuse(features)

    def raw_input_layers(self) -> list[torch.nn.Module]:
        """The layers that read the target's raw hidden states (``fuse``, ``fc``), whose few huge dimensions make them
        the ones sensitive to rounding their weights (``drafts.registry.int8_weight_draft`` keeps them float16)."""
        return [m for m in (self.fuse, self.fc) if m is not None]

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Position ids ``[B, k]`` -> cos, sin ``[B, k, d]``."""
        angles = positions.float()[..., None] * self.inv_freq
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos(), angles.sin()

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Predicted features ``[..., H]`` -> next-token logits ``[..., V]`` (lowest value off a subset head)."""
        if self.subset_head is not None:
            return self.subset_head(hidden)
        head = self._frozen["head"]
        hidden = hidden.to(head.weight.dtype)
        if isinstance(head, torch.nn.Linear):  # the target's weights are read, not trained: no gradient for them
            return F.linear(hidden, head.weight.detach(), None if head.bias is None else head.bias.detach()).float()
        return head(hidden).float()

    def support_logits(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits over the head's support ``[..., K]`` and ``index_of [V]`` (None: the support is all of V)."""
        if self.subset_head is not None:
            return self.subset_head.subset_logits(hidden), self.subset_head.index_of
        return self.logits(hidden), None

    def block(self, inputs: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
              past: list[tuple[torch.Tensor, torch.Tensor] | None], allowed: torch.Tensor):
        """One forward of ``k`` slots: ``inputs [B, k, H]`` (g of the previous slot), ``tokens [B, k]``, ``positions [B, k]``.

        ``past[l]``: layer l's earlier (keys, values) ``[B, kv_heads, S_past, d]`` (None: none); ``allowed [B, k, S]``
        over them and this block. Returns the predicted (post-norm) features ``[B, k, H]`` and each layer's (keys,
        values) with this block's appended (the next block's ``past``).
        """
        with torch.no_grad():  # the target's embedding is read, not trained: no [V, H] gradient in training
            embedding = self._frozen["embedding"](tokens).to(inputs.dtype)
        x = self.fc(torch.cat([inputs, embedding], dim=-1))
        cos, sin = self.rope(positions)
        new = []
        for layer, layer_past in zip(self.layers, past):
            x, kv = layer(x, cos, sin, layer_past, allowed)
            new.append(kv)
        return self.norm(x), new

    def rollout(self, features: torch.Tensor, tokens: torch.Tensor, attention_mask: torch.Tensor, passes: int,
                feature_noise: float = 0.0, generator: torch.Generator | None = None) -> list[torch.Tensor]:
        """:func:`rollout` of this head."""
        return rollout(self, features, tokens, attention_mask, passes, feature_noise, generator)


def build_feature_head(target, config: FeatureHeadConfig, head_token_ids: torch.Tensor | None = None, seed: int = 0):
    """A new head of ``config.architecture``: a :class:`FeatureHead`, or EAGLE-3's (``drafts.eagle.Eagle3Head``)."""
    if config.architecture == "eagle3":
        from specresearch.drafts.eagle import Eagle3Head  # imports this module

        return Eagle3Head.from_feature_config(target, config, head_token_ids, seed)
    return FeatureHead(target, config, head_token_ids=head_token_ids, seed=seed)


# --------------------------------------------------------------------------------------------------
# On disk


def is_feature_draft_dir(directory: str | os.PathLike) -> bool:
    """True if ``directory`` holds a shipped feature head (its manifest has ``feature_head_config``)."""
    return manifest_path(directory).exists() and "feature_head_config" in read_manifest(directory)


def feature_head_digest(directory: str | os.PathLike) -> str:
    """sha256 of a saved head's weights file (what a run continuing it records and is keyed by)."""
    return hashlib.sha256(weights_path(directory, _WEIGHTS_FILE).read_bytes()).hexdigest()


def feature_head_dir(name_or_dir: str | os.PathLike) -> Path:
    """A saved feature head's directory: ``name_or_dir`` itself or the shipped draft of that name under ``data/drafts/``."""
    directory = Path(name_or_dir)
    if not directory.is_dir():
        directory = drafts_dir() / str(name_or_dir)
    if not is_feature_draft_dir(directory):
        raise ValueError(f"name_or_dir {name_or_dir!r}: no feature head in {directory}")
    return directory


def trainable_tensors(head: FeatureHead) -> dict[str, torch.Tensor]:
    return {name: p for name, p in head.named_parameters() if p.requires_grad}


def save_feature_head(head: FeatureHead, target, directory: str | os.PathLike, manifest: dict | None = None) -> Path:
    """Write ``feature_head.safetensors`` (trained tensors in the storage dtype) and ``manifest.json``."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    dtype = _STORAGE_DTYPES[head.config.storage_dtype]
    tensors = {name: p.detach().to(dtype).contiguous() for name, p in trainable_tensors(head).items()}
    if head.subset_head is not None:
        tensors[_HEAD_IDS] = head.subset_head.token_ids.clone()
    save_file(tensors, str(directory / _WEIGHTS_FILE))
    write_manifest(directory, {"feature_head_config": asdict(head.config), "target": embedding_fingerprint(target), **(manifest or {})})
    return directory


@torch.no_grad()
def round_head_to_storage(head: FeatureHead) -> None:
    """Round the trained tensors through the storage dtype in place (a measurement now = the shipped head's)."""
    dtype = _STORAGE_DTYPES[head.config.storage_dtype]
    for p in trainable_tensors(head).values():
        p.copy_(p.to(dtype).to(p.dtype))


def load_feature_head(target, directory: str | os.PathLike) -> FeatureHead:
    """Rebuild a shipped feature head against ``target`` (checked to be the target it was trained on)."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    check_fingerprint(target, manifest["target"], directory)
    config = FeatureHeadConfig(**{**manifest["feature_head_config"], "init_layer": None})
    tensors = load_file(str(weights_path(directory, _WEIGHTS_FILE)))
    head = build_feature_head(target, config, head_token_ids=tensors.pop(_HEAD_IDS, None))
    expected = trainable_tensors(head)
    if tensors.keys() != expected.keys():
        raise ValueError(f"directory {directory}: stored tensors {sorted(tensors)} do not match the head's {sorted(expected)}")
    with torch.no_grad():
        for name, p in expected.items():
            p.copy_(tensors[name].float())
    return head.eval()


def load_feature_draft(target_lm, name_or_dir: str | os.PathLike) -> FeatureDraft:
    """A shipped feature draft (name under ``data/drafts/`` or a directory) beside ``target_lm`` (a ``models.causal_lm.CausalLM``)."""
    head = load_feature_head(target_lm.model, feature_head_dir(name_or_dir))
    draft = FeatureDraft
    if head.config.architecture == "eagle3":  # drafts as the EAGLE repository's heads do (its first slot masked)
        from specresearch.drafts.eagle import EagleDraft  # imports this module

        draft = EagleDraft
    return draft(head, max_context=getattr(target_lm, "max_context", None), device=target_lm.device)
