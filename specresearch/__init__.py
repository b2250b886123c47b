"""specresearch: a research toolkit for speculative decoding with exact twins and machine-checked proofs.

Notation (fixed once for the whole package, following Leviathan et al. 2023):
p = target model (``target_probs``), q = draft model (``draft_probs``), gamma = draft block length,
alpha = E[sum_x min(p, q)]. Chen et al. 2023 write p for the draft and q for the target; the code never does.

The package is eight rooms whose imports point down (docs/README.md, "Layout"; tests/test_layout.py checks it):
``audit`` (the engines' rules decided exactly) over ``experiments`` and ``training``, over ``engine``, over ``drafts`` and ``models``, over ``core`` (batched torch
verifiers) and ``exact`` (rational twins, no torch); ``checks``, ``config`` and ``paths`` are leaf modules.
"""

from specresearch.config import GENERATE_DRAFT, SamplingConfig

__version__ = "0.1.0"

# The front door: a small API, loaded on first use (importing the package loads no torch, so ``specresearch.exact``
# stays pure Python). ``help(specresearch)`` and ``dir(specresearch)`` list it.
_LAZY = {
    "load_pair": ("specresearch.drafts.registry", "load_pair"),
    "speculative_generate": ("specresearch.engine.generate", "speculative_generate"),
    "autoregressive_generate": ("specresearch.engine.generate", "autoregressive_generate"),
    "token_verify": ("specresearch.core.verify", "token_verify"),
    "block_verify": ("specresearch.core.verify", "block_verify"),
    "greedy_verify": ("specresearch.core.verify", "greedy_verify"),
    "VERIFIERS": ("specresearch.core.verify", "VERIFIERS"),
    "MULTI_VERIFIERS": ("specresearch.core.verify_multi", "MULTI_VERIFIERS"),
    "exact": ("specresearch.exact", None),
    "audit": ("specresearch.audit", None),
    "rule_from_acceptance": ("specresearch.audit", "rule_from_acceptance"),
    "ENGINE_RULES": ("specresearch.audit", "ENGINE_RULES"),
}

__all__ = ["__version__", "SamplingConfig", "generate", *_LAZY]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'specresearch' has no attribute {name!r}")
    import importlib

    module, attribute = _LAZY[name]
    value = importlib.import_module(module)
    return value if attribute is None else getattr(value, attribute)


def __dir__():
    return sorted(set(globals()) | set(__all__))


def _to_stderr(message: str) -> None:
    import sys

    print(message, file=sys.stderr)


def generate(prompts, *, target=None, draft=None, tokenizer=None, chat: bool = True, verifier: str = "block",
             gamma: int | str = "auto", max_new_tokens: int = 64, sampling: SamplingConfig = SamplingConfig(),
             seed=0, announce=_to_stderr, **options):
    """Speculative generation as ``specresearch generate`` does it: the chat template, the CLI's default draft.

    Args:
        prompts: a string or a list of strings (user messages; with ``chat=False`` used as they are), or token ids.
        target, draft, tokenizer: a pair (``load_pair``) or None: the embedded SmolLM2-135M-Instruct and the CLI's
            default draft ``GENERATE_DRAFT`` (``ngram+fp16:eagle3-v8k``), loaded once per call. ``target`` may also be
            a name or checkpoint directory (``models.embedded.load_model``, its tokenizer taken unless one is given)
            or a transformers causal LM (wrapped in ``CausalLM``, which works on it in place); ``draft`` a name
            (``drafts.registry.draft_from_name``) for the given or the embedded target, or a transformers causal LM
            sharing the target's tokenizer (its logits cut or padded to the target's width where both models' rows
            hold every id of the tokenizer: Qwen2.5-0.5B for Qwen2.5-7B).
        chat: wrap each string in the tokenizer's chat template (as the CLI does unless ``--raw``).
        verifier, gamma, max_new_tokens, sampling, seed, options: as :func:`speculative_generate` (``num_drafts=``,
            ``stop_below=``, ...). ``gamma="auto"`` (default), as the CLI: for a chain ``engine.cost.default_config``
            (``GENERATE_GAMMA`` unless this machine's step costs, timed once and cached, predict another gamma, or
            with the default draft and verifier one of ``GENERATE_TREES``' dynamic trees, faster by more than
            ``GENERATE_MARGIN``); with ``num_drafts > 1`` or ``stop_below``, ``GENERATE_GAMMA``. With the default
            draft a chain's gamma, chosen or given, is its head's length off a lookup match too
            (``engine.cost.fit_default_draft``).
            Every configuration is lossless, but a seeded sample depends on the configuration as well as the seed: under
            ``"auto"`` the same seed gives the same text on later calls once this machine's costs are cached, and may
            give another on another machine or under another load; give ``gamma`` a count to fix the configuration.
        announce: told, as the CLI prints, when this machine's step costs are timed (the first call, ~25 s here) and
            when a measurement is not kept; default: a line on stderr; None: silent.
    Returns:
        ``engine.generate.GenerationResult`` with ``.text`` decoded.
    """
    from specresearch.engine.generate import speculative_generate
    from specresearch.engine.prompts import encode_chat, encode_prompts

    if announce is not None and not callable(announce):
        raise TypeError(f"announce must be a callable taking one message (e.g. print), or None; got {announce!r}")
    default_draft = draft is None or draft == GENERATE_DRAFT
    if target is None and (draft is None or isinstance(draft, str)):
        from specresearch.drafts.registry import load_pair

        target, draft, tokenizer = load_pair(draft=draft or GENERATE_DRAFT)
    else:
        if target is None:  # the embedded target, for the draft given
            from specresearch.models.embedded import load_embedded

            target, tokenizer = load_embedded()
        else:
            target, tokenizer = _as_target(target, tokenizer)
        if draft is None or isinstance(draft, str):
            from specresearch.drafts.registry import draft_from_name

            draft = draft_from_name(draft or GENERATE_DRAFT, target, tokenizer)
        else:
            draft = _as_model(draft, "draft", target.device, vocab_size=_fitted_width(draft, target, tokenizer))
    from specresearch.engine.cost import fit_default_draft, resolve_config
    from specresearch.engine.results import check_context

    rows = [prompts] if isinstance(prompts, str) else list(prompts)
    if chat and tokenizer is not None and getattr(tokenizer, "chat_template", None):
        rows = [encode_chat([row], tokenizer)[0].tolist() if isinstance(row, str) else row for row in rows]
    check_context(target, encode_prompts(rows, tokenizer)[0], max_new_tokens)  # bad prompts fail before any timing
    trees = default_draft and verifier == "block" and not {"draft_law", "tree_nodes"} & set(options)
    chosen = resolve_config(gamma, target, draft, temperature=sampling.temperature,
                            num_drafts=options.get("num_drafts", 1), stop_below=options.get("stop_below"), trees=trees,
                            announce=announce)
    if default_draft:  # its head drafts the chain's length off a lookup match too, chosen or asked for
        fit_default_draft(draft, chosen)
    gamma, verifier = chosen.pop("gamma"), chosen.pop("verifier", verifier)
    options = {**options, **chosen}
    return speculative_generate(target, draft, rows, tokenizer=tokenizer, verifier=verifier, gamma=gamma,
                                max_new_tokens=max_new_tokens, sampling=sampling, seed=seed, **options)


def _is_transformers_model(model) -> bool:
    import torch

    return isinstance(model, torch.nn.Module) and hasattr(model, "config") and not hasattr(model, "prefill")


def _fitted_width(draft, target, tokenizer) -> int | None:
    """The target's number of output rows for a transformers draft whose own rows, and the target's, hold every id of
    the tokenizer (the rows past them are padding: Qwen2.5-0.5B's 151,936 against Qwen2.5-7B's 152,064), else None
    (the engine then refuses a draft of another width, naming the fix)."""
    if tokenizer is None or not _is_transformers_model(draft):
        return None
    from specresearch.models.widths import output_rows

    return target.vocab_size if len(tokenizer) <= min(output_rows(draft), target.vocab_size) else None


def _as_target(target, tokenizer):
    """``generate``'s target as a model the engine drives, and the tokenizer (a checkpoint's own unless given)."""
    import os

    if isinstance(target, (str, os.PathLike)):
        from specresearch.models.embedded import load_model

        target, own = load_model(str(target))
        return target, tokenizer if tokenizer is not None else own
    return _as_model(target, "target", "auto"), tokenizer


def _as_model(model, role: str, device, vocab_size: int | None = None):
    """A transformers causal LM wrapped in ``CausalLM`` (its logits ``vocab_size`` wide where given); anything else as
    given, a target checked to be one the engine drives (``models.protocols.check_language_model``, the engine's own
    check, before the front door uses it)."""
    if _is_transformers_model(model):
        from specresearch.models.causal_lm import CausalLM

        return CausalLM(model, device=device, vocab_size=vocab_size)
    if role == "target":
        from specresearch.models.protocols import check_language_model

        check_language_model(model, "target", takes="a name, a checkpoint directory, a transformers causal LM or one "
                                                    "of the toolkit's models (load_pair, models.CausalLM)")
    return model
