"""Drafts by name: the one place that knows every concrete draft kind.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

import torch

from specresearch.drafts.combined import LookupOrDraft
from specresearch.drafts.dial import dial_draft_from_name
from specresearch.drafts.distilled import SubsetHead, load_draft
from specresearch.drafts.ngram import NGramDraft
from specresearch.drafts.store import draft_digest, drafts_dir, manifest_path, shipped_drafts
from specresearch.models.causal_lm import CausalLM
from specresearch.models.embedded import load_embedded, load_tokenizer
from specresearch.models.kernels import choose_kernel_rows, use_half_weights, use_int8_weights, use_kernel_rows
from specresearch.models.protocols import check_same_tokenizer

__all__ = ["truncated_draft", "draft_from_name", "draft_format", "EAGLE3_FORMAT", "EAGLE3_SPECULATORS_FORMAT",
           "EAGLE1_FORMAT", "MEDUSA_FORMAT", "DFLASH_FORMAT", "MTP_FORMAT", "PEAGLE_FORMAT",
           "combined_draft", "half_weight_draft", "int8_weight_draft", "HALF_PREFIX",
           "INT8_PREFIX", "without_weight_prefix", "with_weight_storage", "load_pair", "weights_digests"]


def truncated_draft(target: CausalLM, num_layers: int) -> CausalLM:
    """A draft made of the target's first ``num_layers`` decoder layers + its embeddings, final norm and head.

    A cheap stand-in for a trained draft (same tokenizer, no training). Built generically: a copy of the
    target's config with fewer layers, loaded with the matching subset of the target's weights (any
    weight that does not fit raises). Per-layer config lists (``layer_types``) are truncated too.
    """
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(target.model.config)
    text = config.get_text_config()
    if not 1 <= num_layers <= text.num_hidden_layers:
        raise ValueError(f"num_layers must be in 1..{text.num_hidden_layers}, got {num_layers}")
    text.num_hidden_layers = num_layers
    if isinstance(getattr(text, "layer_types", None), list):
        text.layer_types = text.layer_types[:num_layers]
    draft = AutoModelForCausalLM.from_config(config, dtype=target.model.dtype)
    missing, _unexpected = draft.load_state_dict(target.model.state_dict(), strict=False)
    if missing:
        raise ValueError(f"target weights do not cover the truncated model: missing {missing[:5]}")
    draft.generation_config = copy.deepcopy(target.model.generation_config)
    return CausalLM(draft, device=target.device, fuse_projections=_fuses(target))


HALF_PREFIX = "fp16:"
INT8_PREFIX = "int8:"


def without_weight_prefix(name: str) -> str:
    """``name`` without its ``"fp16:"`` or ``"int8:"`` prefix (the draft whose weights :func:`half_weight_draft` or
    :func:`int8_weight_draft` stores anew)."""
    for prefix in (HALF_PREFIX, INT8_PREFIX):
        if name.startswith(prefix):
            return name[len(prefix) :]
    return name


def draft_from_name(name: str, target: CausalLM, tokenizer=None):
    """A draft from a short description: ``"ngram"``, ``"ngram+<name>"`` (:class:`LookupOrDraft`: prompt lookup
    where the context matches, draft ``<name>`` elsewhere; see :func:`combined_draft` for its ``@`` options),
    ``"truncated:N"`` (first N target layers), ``"mtp"`` (the MTP layer of the target's own checkpoint:
    ``drafts.mtp``), the name of a shipped trained draft (:func:`shipped_drafts`, e.g.
    ``"v8k-4l"``; a shipped feature head gives a ``feature_drafts.FeatureDraft``), the directory of a trained
    draft or feature head (what ``specresearch distill`` / ``feature-distill --out`` write), an EAGLE-1/2 or EAGLE-3
    head, Medusa heads or a DFlash drafter saved as their repositories save them (``drafts.eagle``, ``drafts.medusa``,
    ``drafts.dflash``), a Gemma 4 assistant as transformers saves it (``drafts.gemma4``), or a model path
    (:func:`draft_format` names the layout it finds);
    ``"fp16:<name>"``: draft ``<name>`` with float16 weights (:func:`half_weight_draft`); ``"int8:<name>"``: with
    int8 weights and a scale per output row (:func:`int8_weight_draft`).

    ``tokenizer``: the target's; when given, a checkpoint draft's own tokenizer must equal it
    (``check_same_tokenizer``), and its logits are fitted to the target's width where their numbers of output rows
    differ (``CausalLM(vocab_size=...)``: Qwen2.5-0.5B for Qwen2.5-7B). A checkpoint draft takes the target's dtype.
    """
    if name == "ngram":
        return NGramDraft(target.vocab_size, device=target.device)
    if name.startswith("dial-"):  # the target perturbed (dial_drafts): dial-mix:LAM, dial-uniform:LAM, dial-temp:S
        return dial_draft_from_name(name, target, lambda other: draft_from_name(other, target, tokenizer))
    if name.startswith("ngram+"):
        return combined_draft(name, target, tokenizer)
    if name.startswith((HALF_PREFIX, INT8_PREFIX)):
        return with_weight_storage(draft_from_name(without_weight_prefix(name), target, tokenizer), name, target)
    if name.startswith("truncated:"):
        return truncated_draft(target, int(name.split(":", 1)[1]))
    if name == "mtp":
        from specresearch.drafts.mtp import load_mtp  # imports drafts.eagle, which imports this module

        return load_mtp(target)
    trained = drafts_dir() / name if name in shipped_drafts() else Path(name)
    layout = draft_format(trained) if trained.is_dir() else None
    if layout in (EAGLE3_FORMAT, EAGLE3_SPECULATORS_FORMAT, EAGLE1_FORMAT):
        from specresearch.drafts.eagle import load_eagle  # imports drafts.feature, which imports this module

        return load_eagle(target, trained)
    if layout == PEAGLE_FORMAT:
        from specresearch.drafts.peagle import load_peagle

        return load_peagle(target, trained)
    if layout == MEDUSA_FORMAT:
        from specresearch.drafts.medusa import load_medusa

        return load_medusa(target, trained)
    if layout == DFLASH_FORMAT:
        from specresearch.drafts.dflash import load_dflash

        return load_dflash(target, trained)
    if layout == GEMMA4_ASSISTANT_FORMAT:
        from specresearch.drafts.gemma4 import load_gemma4_assistant

        return load_gemma4_assistant(target, trained)
    if manifest_path(trained).exists():
        from specresearch.drafts.feature import (  # imports this module
            is_feature_draft_dir,
            load_feature_draft,
        )

        if is_feature_draft_dir(trained):
            return load_feature_draft(target, trained)
        return CausalLM(load_draft(target.model, trained), device=target.device, fuse_projections=_fuses(target))
    dtype = getattr(getattr(target, "model", None), "dtype", None)  # a checkpoint draft computes as its target does
    if tokenizer is None:
        return CausalLM(name, device=target.device, dtype=dtype, fuse_projections=_fuses(target))
    check_same_tokenizer(tokenizer, load_tokenizer(name, local_files_only=True))
    # the same tokenizer: rows past its ids are padding, so logits of another width are fitted to the target's
    return CausalLM(name, device=target.device, dtype=dtype, fuse_projections=_fuses(target), vocab_size=target.vocab_size)


def _fuses(target) -> bool | None:
    """``fuse_projections`` for a draft wrapped in ``CausalLM`` for ``target``: ``False`` where a whole target was
    left unfused (``load_pair(fuse_projections=False)``: both models as transformers built them), else ``None``,
    ``CausalLM``'s default (a split target is never fused; its draft is whole)."""
    whole = getattr(target, "placement", None) is None
    return False if whole and getattr(target, "fuses", None) is False else None


EAGLE3_FORMAT = "EAGLE-3 head (the SafeAILab/EAGLE layout: fc, midlayer.*, norm, lm_head, d2t / t2d)"
EAGLE3_SPECULATORS_FORMAT = ("EAGLE-3 head (the vllm-project/speculators layout: speculators_model_type eagle3, "
                             "transformer_layer_config, fc, layers.0.*, norm, lm_head, d2t / t2d)")
PEAGLE_FORMAT = ("P-EAGLE head (the vllm-project/speculators layout: speculators_model_type peagle, mask_token_id, "
                 "an EAGLE-3 head's tensors, mask_hidden, embed_tokens)")
EAGLE1_FORMAT = "EAGLE-1/2 head (the SafeAILab/EAGLE layout: fc, layers.*; the target's head reads it)"
MTP_FORMAT = ("MTP layers in the target's own checkpoint (num_nextn_predict_layers, or Qwen3.5 / Qwen3-Next's "
              "mtp_num_hidden_layers and mtp.*; --draft mtp reads them)")
MEDUSA_FORMAT = "Medusa heads (the FasterDecoding/Medusa layout: config.json with medusa_num_heads, medusa_lm_head.pt)"
DFLASH_FORMAT = ("DFlash block drafter (z-lab's layout: dflash_config, fc, hidden_norm, layers.*; transformers' "
                 "muse_glimmer_assistant; or speculators' dflash / dspark / dflash2 / xpress)")
GEMMA4_ASSISTANT_FORMAT = ("Gemma 4 assistant (transformers' layout: config.json with model_type gemma4_assistant; it "
                           "drafts from its Gemma 4 target's shared keys)")
_FORMATS = ("a draft this toolkit trained (manifest.json)", EAGLE3_FORMAT, EAGLE3_SPECULATORS_FORMAT, PEAGLE_FORMAT,
            EAGLE1_FORMAT, MEDUSA_FORMAT, DFLASH_FORMAT, GEMMA4_ASSISTANT_FORMAT,
            "a transformers causal LM (config.json with model_type, and its weights)")


def draft_format(directory) -> str:
    """Which published layout the draft ``directory`` holds, in words: a draft the toolkit trained (its manifest), an
    EAGLE-1/2 or EAGLE-3 head or Medusa heads as their repositories save them (``drafts.eagle``, ``drafts.medusa``),
    or a transformers causal LM (an assistant model sharing the target's tokenizer); ``ValueError`` in one line naming
    the layouts expected otherwise."""
    import json

    directory = Path(directory)
    if manifest_path(directory).exists():
        manifest = json.loads(manifest_path(directory).read_text())
        return "feature head this toolkit trained" if "feature_head_config" in manifest else "draft this toolkit trained"
    from specresearch.drafts.dflash import is_dflash_dir  # before EAGLE: z-lab's fc and layers.* look like EAGLE-1's

    if is_dflash_dir(directory):
        return DFLASH_FORMAT
    from specresearch.drafts.gemma4 import is_gemma4_assistant_dir

    if is_gemma4_assistant_dir(directory):  # before a transformers causal LM: it has a model_type and weights too
        return GEMMA4_ASSISTANT_FORMAT
    from specresearch.drafts.eagle import eagle_format
    from specresearch.drafts.speculators import is_speculators_dir

    kind = eagle_format(directory)
    if kind is not None:
        from specresearch.drafts.peagle import is_peagle_dir

        if kind == "EAGLE-3" and is_peagle_dir(directory):
            return PEAGLE_FORMAT
        if kind == "EAGLE-3":
            return EAGLE3_SPECULATORS_FORMAT if is_speculators_dir(directory) else EAGLE3_FORMAT
        return EAGLE1_FORMAT
    from specresearch.drafts.medusa import is_medusa_dir

    if is_medusa_dir(directory):
        return MEDUSA_FORMAT
    config = directory / "config.json"
    weights = any(directory.glob("*.safetensors")) or any(directory.glob("*.bin"))
    if config.is_file() and "model_type" in json.loads(config.read_text()) and weights:
        return "transformers causal LM"
    raise ValueError(f"{directory} holds no draft layout this toolkit reads: expected {'; '.join(_FORMATS)}")


def half_weight_draft(draft, target: CausalLM):
    """``draft`` (a trained ``FeatureDraft`` or a ``CausalLM`` that owns its weights) with its linear layers'
    and output head's weights stored in float16, in place (``models.kernels.use_half_weights``); returns it.

    On this CPU a drafting step of the shipped feature head (sampling included) takes 3.5 ms against 4.9
    with float32 weights, at the same held-out alpha to three decimals (``docs/feature_drafts.md``). Where the draft
    timed the compiled kernel's rows when it loaded (``chooses_kernel_rows``), they are timed again on the float16
    weights (``models.kernels.choose_kernel_rows``), which the kernel widens as it reads them. The
    target is never changed (a layer the draft shares with it is refused); drafts without weights
    (``ngram``, ``dial-...``) are refused.
    """
    module = _weights_module(draft, HALF_PREFIX)
    use_half_weights(module, (SubsetHead,), shared_with=target.model)
    if draft.chooses_kernel_rows:
        use_kernel_rows(module, choose_kernel_rows(module))
    return draft


def int8_weight_draft(draft, target: CausalLM):
    """``draft`` (as :func:`half_weight_draft` takes) with its linear layers' and output head's weights stored in int8
    with a float32 scale per output row (``models.kernels.use_int8_weights``), in place; returns it. A feature head's
    input layers (``fuse``, ``fc``) get float16 weights instead (:func:`half_weight_draft`'s): they read the target's
    raw hidden states, whose few huge dimensions make a row's int8 rounding cost most of the head's agreement (on the
    shipped head, int8 there took 0.03 of held-out alpha; ``docs/feature_drafts.md``). Every other layer reads a
    normalised input or its own activations.

    Where the compiled kernel runs (``models.native``), every int8 call of 1-8 rows goes to it (nothing to time: any
    other path converts the whole weight per call), and the float16 layers are timed for it as
    :func:`half_weight_draft` times them. The target is never changed; drafts without weights are refused.
    """
    from specresearch.drafts.feature import FeatureDraft  # imports this module

    module = _weights_module(draft, INT8_PREFIX)
    if isinstance(draft, FeatureDraft):
        inputs = module.raw_input_layers()
        rest = [m for m in module.modules() if isinstance(m, (torch.nn.Linear, SubsetHead)) and all(m is not i for i in inputs)]
        use_half_weights(torch.nn.ModuleList(inputs), shared_with=target.model)
        use_int8_weights(torch.nn.ModuleList(rest), (SubsetHead,), shared_with=target.model)
    else:
        use_int8_weights(module, (SubsetHead,), shared_with=target.model)
    if draft.chooses_kernel_rows:
        use_kernel_rows(module, choose_kernel_rows(module))
    return draft


def with_weight_storage(draft, name: str, target: CausalLM):
    """``draft`` with the weights ``name``'s prefix names: :func:`half_weight_draft` for ``fp16:``,
    :func:`int8_weight_draft` for ``int8:``, unchanged without one."""
    if name.startswith(HALF_PREFIX):
        return half_weight_draft(draft, target)
    if name.startswith(INT8_PREFIX):
        return int8_weight_draft(draft, target)
    return draft


def _weights_module(draft, prefix: str) -> torch.nn.Module:
    """The module whose weights a trained ``draft`` computes with (a feature head's, a ``CausalLM``'s model)."""
    from specresearch.drafts.feature import FeatureDraft  # imports this module

    if isinstance(draft, FeatureDraft):
        return draft.head
    if isinstance(draft, CausalLM):
        return draft.model
    raise ValueError(f"{prefix} needs a trained draft (a feature head or a distilled / checkpoint LM), got {type(draft).__name__}")


def combined_draft(name: str, target: CausalLM, tokenizer=None) -> LookupOrDraft:
    """``"ngram+<name>[@option]..."`` -> ``LookupOrDraft(draft_from_name(<name>), ...)``.

    By default a step that starts without a lookup match drafts one token (``draft_gamma=1``: the trained
    drafts' best length on this CPU, ``docs/feature_drafts.md``) and the wrapped draft is fed lazily.
    Options: ``@draft-gamma=N`` (at most N tokens in such a step), ``@draft-gamma=none`` (always the
    engine's gamma), ``@every-slot`` (feed the wrapped draft every slot, ``lazy=False``), ``@min-match=N``
    (lookup proposes a token after a match of N or more tokens; default 2) and ``@plan-match=N`` (such a
    match plans a full step; default: min-match). Values out of range raise from :class:`LookupOrDraft`.
    """
    base, *options = name.split("@")
    settings = {"draft_gamma": 1, "lazy": True}
    counts = {"min-match": "min_match", "plan-match": "plan_match"}
    for option in options:
        key, _, value = option.partition("=")
        if option == "every-slot":
            settings["lazy"] = False
        elif key == "draft-gamma" and (value == "none" or value.isdigit() and int(value) >= 1):
            settings["draft_gamma"] = None if value == "none" else int(value)
        elif key in counts and value.isdigit():
            settings[counts[key]] = int(value)
        else:
            raise ValueError(f"draft {name!r}: unknown option @{option} "
                             "(@draft-gamma=N, @draft-gamma=none, @every-slot, @min-match=N, @plan-match=N)")
    return LookupOrDraft(draft_from_name(base[len("ngram+") :], target, tokenizer), **settings)


def load_pair(name: str = "smollm2-135m-instruct", draft: str = "v8k-4l", *, device: str | torch.device = "auto",
                       dtype: torch.dtype | None = torch.float32, skinny_linear: bool | None = None,
                       fuse_projections: bool | None = None):
    """The embedded target (:func:`specresearch.models.embedded.load_embedded`), a draft for it and the tokenizer: ``(target, draft, tokenizer)``.

    ``draft``: a shipped draft (``drafts.store.shipped_drafts()``, default the distilled ``v8k-4l``), the
    directory a training command wrote, or any other ``drafts.registry.draft_from_name`` description (``ngram``,
    ``ngram+NAME``, ``truncated:N``, ``dial-...``, ``fp16:NAME``, ``int8:NAME``). A trained draft is rebuilt against this target (its
    embedding is the target's) and checked to belong to it. An unknown name fails before the target loads.
    ``skinny_linear``: the target's, as :func:`load_embedded`'s. ``fuse_projections``: the target's, as
    :func:`load_embedded`'s, and a draft's wrapped in ``CausalLM`` (``False``: both models as transformers built them,
    for code other than the toolkit's to run).
    """
    base = without_weight_prefix(draft)
    described = base == "ngram" or base.startswith(("ngram+", "truncated:", "dial-"))
    if not (base in shipped_drafts() or Path(base).is_dir() or described):
        raise ValueError(f"draft must be a shipped draft {shipped_drafts()}, a trained draft's directory or a "
                         f"drafts.registry.draft_from_name description (ngram, ngram+NAME, truncated:N, dial-..., fp16:NAME, int8:NAME), got {draft!r}")
    target, tokenizer = load_embedded(name, device=device, dtype=dtype, skinny_linear=skinny_linear,
                                      fuse_projections=fuse_projections)
    return target, draft_from_name(draft, target), tokenizer


def weights_digests(name: str) -> dict[str, str]:
    """The sha256 (``store.draft_digest``) of every shipped draft a draft name uses, what a benchmark record carries:
    ``ngram+fp16:eagle3-v8k`` -> the head's; ``dial-mix:0.5`` -> ``v8k-4l``'s, its default other draft; {} for drafts
    without weights (``ngram``, ``truncated:N``)."""
    shipped = shipped_drafts()
    used = [part for part in re.split(r"[+:@]", name) if part in shipped]
    if name.startswith("dial-mix:") and name.count(":") == 1:
        used.append("v8k-4l")
    return {part: draft_digest(drafts_dir() / part) for part in used}
