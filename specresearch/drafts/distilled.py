"""Draft models behind the same interface as the target (``models.protocols.LanguageModel``).

* :class:`NGramDraft`: prompt lookup with a proper distribution. The next-token law q is the
  continuation counts of the longest n-gram (n <= ``max_ngram``) that ends the context and occurred
  before in it (falling back to the unigram counts of the context), mixed with a uniform floor:
  ``q = (1 - floor) * counts / sum(counts) + floor / V``. Every token has ``q > 0``, so the draft can
  be verified stochastically (token or block verification), not only greedily.
* Any transformers model with the target's tokenizer, wrapped in ``models.causal_lm.CausalLM``.
* :func:`truncated_draft`: the first few decoder layers of the target plus its embeddings, final norm
  and head -- an untrained stand-in.
* Trained (distilled) drafts shipped under ``data/drafts/<name>/`` (:func:`load_trained_draft`): a few
  decoder layers of the target's architecture, the target's input embedding (frozen, rebuilt from the
  target at load time, never stored) and either the target's head or a trained :class:`SubsetHead`
  over the K tokens that carry most of the target's probability. ``specresearch.training.distill`` trains them.

:func:`check_same_vocab` is the guard the engine applies: target and draft logits must have the same
size (compare logits, not ``len(tokenizer)``: a model's head can be padded beyond the tokenizer).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from specresearch.checks import check_field, named_preset
from specresearch.drafts.store import (
    _STORAGE_DTYPES,
    check_fingerprint,
    drafts_dir,
    embedding_fingerprint,
    manifest_path,
    read_manifest,
    shipped_drafts,
    weights_path,
    write_manifest,
)
from specresearch.models.kernels import SKINNY_ROWS, skinny_linear

__all__ = ["DraftConfig", "DRAFT_PRESETS", "SubsetHead", "build_draft", "trainable_state", "save_draft", "round_to_storage", "load_draft", "load_trained_draft"]


_WEIGHTS_FILE = "draft.safetensors"


_HEAD_IDS = "lm_head.token_ids"


@dataclass(frozen=True)
class DraftConfig:
    """Shape of a distilled draft; everything not listed here is the target's config.

    Attributes:
        name: the preset / directory name under ``data/drafts/``.
        num_layers: decoder layers of the draft (>= 1).
        intermediate_size: MLP width; ``None`` keeps the target's.
        init_layers: target layer indices copied into the draft's layers before training (one per draft
            layer), or ``None`` for a seeded random initialisation.
        storage_dtype: dtype of the shipped tensors, one of ``float32``, ``bfloat16``, ``float16``.
        head_tokens: ``None`` keeps the target's full output head; an int K gives the draft a
            :class:`SubsetHead` over the K tokens with the most teacher probability on the corpus
            (:func:`head_token_ids`), so q(x) = 0 off those K tokens. On CPU the head dominates a
            small draft's cost (SmolLM2: 49152 x 576 = 28 M of a 1-layer draft's 32 M multiply-adds).
        train_head: train (and ship) the output head's rows too; the input embedding stays frozen.
    """

    name: str
    num_layers: int = 1
    intermediate_size: int | None = None
    init_layers: tuple[int, ...] | None = None
    storage_dtype: str = "float32"
    head_tokens: int | None = None
    train_head: bool = False

    def __post_init__(self) -> None:
        check_field(bool(self.name) and "/" not in self.name, "name", f"must be a bare directory name, got {self.name!r}")
        check_field(isinstance(self.num_layers, int) and self.num_layers >= 1, "num_layers", f"must be an int >= 1, got {self.num_layers!r}")
        check_field(self.intermediate_size is None or self.intermediate_size >= 1, "intermediate_size", f"must be None or >= 1, got {self.intermediate_size!r}")
        if self.init_layers is not None:
            object.__setattr__(self, "init_layers", tuple(int(i) for i in self.init_layers))
            check_field(len(self.init_layers) == self.num_layers, "init_layers",
                        f"must list one target layer per draft layer ({self.num_layers}), got {self.init_layers!r}")
            check_field(min(self.init_layers) >= 0, "init_layers", f"must be non-negative layer indices, got {self.init_layers!r}")
        check_field(self.storage_dtype in _STORAGE_DTYPES, "storage_dtype", f"must be one of {sorted(_STORAGE_DTYPES)}, got {self.storage_dtype!r}")
        check_field(self.head_tokens is None or (isinstance(self.head_tokens, int) and self.head_tokens >= 1), "head_tokens",
                    f"must be None or an int >= 1, got {self.head_tokens!r}")
        check_field(isinstance(self.train_head, bool), "train_head", f"must be a bool, got {self.train_head!r}")

    @classmethod
    def from_name(cls, name: str) -> "DraftConfig":
        """A named preset (``DRAFT_PRESETS``), like gpt-fast's ``ModelArgs.from_name``."""
        return named_preset(DRAFT_PRESETS, name)


DRAFT_PRESETS = {
    # ~3.5 M trained parameters per layer for SmolLM2-135M (hidden 576, MLP 1536): 14 MB per float32 layer.
    "tiny-1l": DraftConfig("tiny-1l", num_layers=1, init_layers=(0,)),
    "small-2l": DraftConfig("small-2l", num_layers=2, init_layers=(0, 29)),
    "base-4l": DraftConfig("base-4l", num_layers=4, init_layers=(0, 10, 20, 29), storage_dtype="bfloat16"),
    # Trained 8192-token heads: the head costs 0.9 ms instead of 11 ms per token on this CPU, which pays
    # for the layers. bfloat16: 4.7 M head + 3.5 M per layer parameters at 2 bytes (v8k-4l: 38 MB).
    "v8k-1l": DraftConfig("v8k-1l", num_layers=1, init_layers=(0,), head_tokens=8192, train_head=True, storage_dtype="bfloat16"),
    "v8k-2l": DraftConfig("v8k-2l", num_layers=2, init_layers=(0, 29), head_tokens=8192, train_head=True, storage_dtype="bfloat16"),
    "v8k-4l": DraftConfig("v8k-4l", num_layers=4, init_layers=(0, 10, 20, 29), head_tokens=8192, train_head=True,
                          storage_dtype="bfloat16"),
    # The capacity end of the alpha-vs-c trade-off (measured: c = 0.27, ~1.2 ms per layer on one thread).
    "v8k-8l": DraftConfig("v8k-8l", num_layers=8, init_layers=(0, 4, 8, 12, 17, 21, 25, 29), head_tokens=8192,
                          train_head=True, storage_dtype="bfloat16"),
}


class SubsetHead(torch.nn.Module):
    """An output head over a subset S of the vocabulary: logits over S, the dtype's lowest value elsewhere.

    ``forward`` returns full-vocabulary logits ``[..., V]`` (so softmax gives q(x) = 0 exactly off S, and
    no ``-inf`` reaches downstream arithmetic); :meth:`subset_logits` returns the ``[..., K]`` logits over
    S in ``token_ids`` order, which training uses. ``token_ids`` is a persistent buffer (shipped with
    the draft); ``index_of`` maps a vocabulary id to its position in S, or -1.
    """

    skinny_rows = SKINNY_ROWS  # the row counts skinny_linear computes its own way (models.use_skinny_linears)
    half_limit = None  # with half weights (models.kernels.use_half_weights): the largest |input| their float16 product takes
    kernel_rows = ()  # the row counts the compiled kernel computes (models.kernels.use_kernel_rows)

    def __init__(self, weight: torch.Tensor, token_ids: torch.Tensor, vocab_size: int) -> None:
        super().__init__()
        token_ids = torch.as_tensor(token_ids, dtype=torch.long)
        check_field(token_ids.ndim == 1 and len(token_ids) == len(weight), "token_ids", f"must be [K] with K = {len(weight)} rows, got {tuple(token_ids.shape)}")
        check_field(len(token_ids) == len(token_ids.unique()), "token_ids", "must not repeat a token")
        check_field(0 <= int(token_ids.min()) and int(token_ids.max()) < vocab_size, "token_ids", f"must lie in [0, {vocab_size})")
        self.vocab_size = self.out_features = vocab_size  # out_features: the logits' size, as for nn.Linear
        self.weight = torch.nn.Parameter(weight.detach().clone())
        self.register_buffer("token_ids", token_ids.clone())
        index_of = torch.full((vocab_size,), -1, dtype=torch.long)
        index_of[token_ids] = torch.arange(len(token_ids))
        self.register_buffer("index_of", index_of, persistent=False)

    def subset_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return skinny_linear(hidden, self.weight, skinny_rows=self.skinny_rows, half_limit=self.half_limit,
                             kernel_rows=self.kernel_rows, weight_scale=getattr(self, "weight_scale", None))  # [..., K]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        subset = self.subset_logits(hidden)
        logits = subset.new_full((*subset.shape[:-1], self.vocab_size), torch.finfo(subset.dtype).min)
        return logits.index_copy_(-1, self.token_ids, subset)  # [..., V]


def build_draft(target, config: DraftConfig, seed: int = 0, head_token_ids: torch.Tensor | None = None):
    """A draft with the target's config but ``config.num_layers`` layers, embedding/head copied from the target.

    Args:
        target: a transformers causal LM with ``get_input_embeddings`` / ``get_output_embeddings``.
        config: the draft's shape; ``init_layers`` copies those target layers into the draft's.
        seed: seeds the random init of the layers (a forked RNG: the global RNG is untouched).
        head_token_ids: ``[K]`` token ids of the :class:`SubsetHead`, required iff ``config.head_tokens``
            (K = ``config.head_tokens``); its rows start as the target's head rows.
    Returns:
        a transformers causal LM in the target's dtype whose trainable parameters are its decoder layers,
        final norm and, if ``config.train_head``, its output head (:func:`trainable_state`).
    """
    if (config.head_tokens is None) != (head_token_ids is None):
        raise ValueError(f"head_token_ids must be given iff config.head_tokens is set (head_tokens={config.head_tokens})")
    if head_token_ids is not None and len(head_token_ids) != config.head_tokens:
        raise ValueError(f"head_token_ids must hold head_tokens = {config.head_tokens} ids, got {len(head_token_ids)}")
    from transformers import AutoModelForCausalLM

    hf_config = _draft_hf_config(target, config)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        draft = AutoModelForCausalLM.from_config(hf_config)
    draft.to(dtype=target.dtype)
    if head_token_ids is not None:
        rows = target.get_output_embeddings().weight[torch.as_tensor(head_token_ids, dtype=torch.long)]
        draft.set_output_embeddings(SubsetHead(rows, head_token_ids, hf_config.vocab_size))
    _copy_from_target(draft, target, config)
    draft.get_input_embeddings().weight.requires_grad_(False)
    draft.get_output_embeddings().weight.requires_grad_(config.train_head)
    return draft


def _draft_hf_config(target, config: DraftConfig):
    hf_config = target.config.__class__.from_dict(target.config.to_dict())
    layers = hf_config.num_hidden_layers
    if config.init_layers is not None and max(config.init_layers) >= layers:
        raise ValueError(f"init_layers {config.init_layers} must be < the target's {layers} layers")
    hf_config.num_hidden_layers = config.num_layers
    if getattr(hf_config, "layer_types", None) is not None:
        hf_config.layer_types = hf_config.layer_types[: config.num_layers]
    if config.intermediate_size is not None:
        hf_config.intermediate_size = config.intermediate_size
    if config.train_head or config.head_tokens is not None:
        hf_config.tie_word_embeddings = False  # the head is trained or trimmed: it is not the input embedding
    return hf_config


@torch.no_grad()
def _copy_from_target(draft, target, config: DraftConfig) -> None:
    draft.get_input_embeddings().weight.copy_(target.get_input_embeddings().weight)
    if config.head_tokens is None:
        draft.get_output_embeddings().weight.copy_(target.get_output_embeddings().weight)
    draft_decoder, target_decoder = draft.get_decoder(), target.get_decoder()
    draft_decoder.norm.load_state_dict(target_decoder.norm.state_dict())
    for mine, theirs in zip(draft_decoder.layers, config.init_layers or ()):
        mine.load_state_dict(target_decoder.layers[theirs].state_dict())


def trainable_state(draft) -> dict[str, torch.Tensor]:
    """The parameters that are trained and shipped (decoder layers, final norm, a trained head), by name."""
    return {name: p for name, p in draft.named_parameters() if p.requires_grad}


def save_draft(draft, target, config: DraftConfig, directory: str | os.PathLike, manifest: dict | None = None) -> Path:
    """Write ``draft.safetensors`` (trained tensors only, in ``config.storage_dtype``) and ``manifest.json``.

    The manifest records ``draft_config``, the target's embedding fingerprint and whatever ``manifest``
    adds (command, seed, corpus size, training time, measurements).
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    dtype = _STORAGE_DTYPES[config.storage_dtype]
    tensors = {name: p.detach().to(dtype).contiguous() for name, p in trainable_state(draft).items()}
    head = draft.get_output_embeddings()
    if isinstance(head, SubsetHead):
        tensors[_HEAD_IDS] = head.token_ids.detach().clone()
    save_file(tensors, str(directory / _WEIGHTS_FILE))
    write_manifest(directory, {"draft_config": asdict(config), "target": embedding_fingerprint(target), **(manifest or {})})
    return directory


@torch.no_grad()
def round_to_storage(draft, config: DraftConfig) -> None:
    """Round the trained tensors through ``config.storage_dtype`` in place, so a measurement taken now is
    the measurement of the shipped draft (which :func:`load_draft` rebuilds from the rounded tensors)."""
    dtype = _STORAGE_DTYPES[config.storage_dtype]
    for p in trainable_state(draft).values():
        p.copy_(p.to(dtype).to(p.dtype))


def load_draft(target, directory: str | os.PathLike):
    """Rebuild a shipped draft: target's embedding/head (frozen) + the stored layers and norm.

    Raises ``ValueError`` if ``target`` is not the model the draft was trained against.
    Returns the draft in ``eval`` mode, in the target's dtype.
    """
    directory = Path(directory)
    manifest = read_manifest(directory)
    check_fingerprint(target, manifest["target"], directory)
    config = DraftConfig(**{**manifest["draft_config"], "init_layers": None})
    tensors = load_file(str(weights_path(directory, _WEIGHTS_FILE)))
    head_ids = tensors.pop(_HEAD_IDS, None)
    if (head_ids is None) != (config.head_tokens is None):
        raise ValueError(f"directory {directory}: head_tokens {config.head_tokens} but {_HEAD_IDS} is {'missing' if head_ids is None else 'stored'}")
    draft = build_draft(target, config, head_token_ids=head_ids)
    expected = trainable_state(draft)
    if tensors.keys() != expected.keys():
        raise ValueError(f"directory {directory}: stored tensors {sorted(tensors)} do not match the draft's {sorted(expected)}")
    with torch.no_grad():
        for name, p in expected.items():
            p.copy_(tensors[name].to(p.dtype))
    return draft.eval()


def load_trained_draft(target, name: str, root: str | os.PathLike | None = None):
    """The shipped draft ``<root>/<name>`` (default root :func:`drafts_dir`) rebuilt against ``target``."""
    directory = Path(root) if root is not None else drafts_dir()
    if not manifest_path(directory / name).exists():
        available = shipped_drafts(directory)
        raise ValueError(f"name {name!r}: no trained draft in {directory}; available: {available}")
    return load_draft(target, directory / name)
