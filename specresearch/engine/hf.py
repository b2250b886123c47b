"""Speculative decoding inside transformers' ``generate``: ``custom_generate=speculative(draft)``.

transformers' ``generate`` takes ``custom_generate=<callable>``: it prepares the inputs (left-padded
``input_ids [B, L]``, attention mask, merged ``GenerationConfig``, logits processors, stopping criteria) and
then calls the callable instead of its own decoding loop. :func:`speculative` builds that callable around
the engine ``generate.speculative_generate`` (any verifier of ``verify.VERIFIERS``, B >= 1)::

    out = target.generate(input_ids, attention_mask=mask, do_sample=True, temperature=0.8, max_new_tokens=64,
                          custom_generate=specresearch.engine.hf.speculative(draft, verifier="block", gamma=4))

The same runs from the repository's ``custom_generate/`` directory (:func:`generate` is its entry point)::

    target.generate(input_ids, assistant_model=draft, custom_generate="path/to/custom_generate/..",
                    trust_remote_code=True, verifier="block", gamma=4)

What ``generate`` users rely on, and how it maps:

* ``max_new_tokens`` / ``max_length`` (``MaxLengthCriteria``) and ``eos_token_id`` (``EosTokenCriteria``)
  become the engine's limit and EOS set: a row stops at its first EOS, also inside an accepted block.
* ``do_sample`` / ``temperature`` / ``top_k`` / ``top_p`` / ``epsilon_cutoff``: the warpers transformers
  built (``SAMPLING_WARPERS``) become one ``sampling.SamplingConfig`` applied identically to target and draft,
  so the q handed to the verifier is the law the drafts were sampled from. ``do_sample=False`` is greedy.
  At exact ties on the top-k / top-p boundary ``sampling`` keeps the lower token id (see its docstring).
* Logits processors that are deterministic functions of one row's token prefix and logits row
  (``PREFIX_PROCESSORS``: repetition penalty, no-repeat n-gram, bad words, sequence bias, min length,
  suppress tokens, forced BOS/EOS, prefix-constrained, ...) are applied at EVERY position the engine
  scores, for the target and the draft alike, with that position's own prefix (prompt, accepted tokens and
  the drafts before it), before the sampling warpers, as ``generate`` orders them. The target law p at each
  position is then the law ``generate`` would sample from, so the verifiers stay lossless with respect to
  it. ``LogitNormalization`` (``renormalize_logits``) is dropped: it does not change the law. A draft that
  reads the target's hidden states, or plans its step lengths, keeps doing so (``_Processed``).
* Everything else raises ``ValueError`` naming it: warpers with no ``SamplingConfig`` counterpart (min_p,
  typical_p, eta_cutoff, top_h), processors that keep state across calls or run a model (classifier-free
  guidance, SynthID, watermarking, which transformers also applies after the warpers), beam search
  (``num_beams > 1``), ``output_scores`` / ``output_logits`` / attentions / hidden states. A processor
  class of your own that is a deterministic function of (row prefix, logits row) can be vouched for with
  ``speculative(..., allow=(MyProcessor,))``.
* Stopping criteria: ``MaxLengthCriteria`` and ``EosTokenCriteria`` as above; ``PREFIX_CRITERIA``
  (``StopStringCriteria``, ``max_time``) are asked after every new token with the row's prefix up to it, and
  end the row after that token (inside an accepted block too). Others raise (e.g. criteria reading ``scores``).
  transformers 5.23 drops ``generate``'s ``tokenizer=`` for a ``custom_generate`` callable, so ``stop_strings=``
  raises there: pass ``stopping_criteria=[StopStringCriteria(tokenizer, strings)]``; the ``custom_generate/``
  directory builds that criterion from ``stop_strings=`` and ``tokenizer=`` itself.
* ``streamer``: gets the prompt, then each step's kept tokens (several at once), then ``end()``; one row
  only (transformers' streamers refuse batches too). transformers 5.23 does not forward ``generate``'s
  ``streamer`` argument to a ``custom_generate`` callable, so pass it as ``speculative(draft, streamer=s)``;
  the ``custom_generate/`` directory takes the usual ``streamer=``.
* Left-padded batches with an attention mask (B >= 1; rows accept different numbers of drafts) and
  ``num_return_sequences`` (transformers repeats the rows before calling us).
* Randomness: ``generate(..., seed=7)`` (an int, or one int per row for batch-independent rows) or
  ``generate(..., generator=torch.Generator().manual_seed(7))``; without either, a seed is drawn from
  torch's global RNG, so ``torch.manual_seed`` makes a call reproducible as it does for ``generate``.
* ``return_dict_in_generate=True`` returns :class:`SpeculativeDecoderOnlyOutput`: ``sequences`` plus the
  per-step metrics (accepted drafts per row, block efficiency, acceptance rate, model calls).

The target's own KV cache prepared by ``generate`` is not used (``models.causal_lm.CausalLM`` keeps its own, with
per-row rollback); a ``past_key_values`` that already holds tokens raises.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from transformers.generation import logits_process as _lp
from transformers.generation import stopping_criteria as _sc
from transformers.generation.configuration_utils import GenerationMode
from transformers.generation.utils import GenerateDecoderOnlyOutput

from specresearch.checks import check_int
from specresearch.config import SamplingConfig
from specresearch.core.verify import VERIFIERS
from specresearch.engine.generate import GenerationResult, speculative_generate
from specresearch.engine.tree import TREE_VERIFIERS
from specresearch.models.causal_lm import CausalLM, check_prompt
from specresearch.models.mends import undo_mends
from specresearch.models.protocols import BindsTarget, LanguageModel, TreeScorer
from specresearch.models.slots import rollback_counts

__all__ = [
    "speculative",
    "SpeculativeGenerate",
    "SpeculativeDecoderOnlyOutput",
    "generate",
    "SAMPLING_WARPERS",
    "PREFIX_PROCESSORS",
    "PREFIX_CRITERIA",
]

# transformers warper -> (SamplingConfig field, attribute of the warper holding the value), in generate's order
SAMPLING_WARPERS: dict[type, tuple[str, str]] = {
    _lp.TemperatureLogitsWarper: ("temperature", "temperature"),
    _lp.TopKLogitsWarper: ("top_k", "top_k"),
    _lp.TopPLogitsWarper: ("top_p", "top_p"),
    _lp.EpsilonLogitsWarper: ("epsilon", "epsilon"),
}

# Deterministic functions of (one row's token prefix, its logits row); applied per scored position.
PREFIX_PROCESSORS: tuple[type, ...] = (
    _lp.RepetitionPenaltyLogitsProcessor,
    _lp.NoRepeatNGramLogitsProcessor,
    _lp.NoBadWordsLogitsProcessor,
    _lp.SequenceBiasLogitsProcessor,
    _lp.MinLengthLogitsProcessor,
    _lp.MinNewTokensLengthLogitsProcessor,
    _lp.PrefixConstrainedLogitsProcessor,
    _lp.ForcedBOSTokenLogitsProcessor,
    _lp.ForcedEOSTokenLogitsProcessor,
    _lp.InfNanRemoveLogitsProcessor,
    _lp.ExponentialDecayLengthPenalty,
    _lp.SuppressTokensLogitsProcessor,
    _lp.SuppressTokensAtBeginLogitsProcessor,
)

_LAW_PRESERVING = (_lp.LogitNormalization,)  # log-softmax: same sampling law, dropped

# Deterministic in (row prefix) or in time; asked after every new token.
PREFIX_CRITERIA: tuple[type, ...] = (_sc.StopStringCriteria, _sc.MaxTimeCriteria)

_MODEL_KWARGS = {"attention_mask", "position_ids", "use_cache", "logits_to_keep", "past_key_values", "cache", "cache_position"}


@dataclass
class SpeculativeDecoderOnlyOutput(GenerateDecoderOnlyOutput):
    """``generate``'s output with the engine's per-step metrics (S steps, B rows).

    ``num_accepted [S, B]``: drafts accepted per row and step (0 for rows already finished, see ``active``);
    ``active [S, B]``: row still generating when the step started; ``gamma [S]``: drafts proposed per step;
    ``block_efficiency``: mean tokens per target call per active row; ``acceptance_rate``: accepted drafts /
    drafts examined; ``target_calls`` / ``draft_calls``: forward calls; ``result``: the engine's
    ``GenerationResult`` (tokens, ``StepRecord`` s with timings).
    """

    num_accepted: torch.LongTensor | None = None
    active: torch.BoolTensor | None = None
    gamma: torch.LongTensor | None = None
    block_efficiency: float | None = None
    acceptance_rate: float | None = None
    target_calls: int | None = None
    draft_calls: int | None = None
    result: GenerationResult | None = None


def speculative(draft, *, verifier: str | Callable = "block", gamma: int = 4, streamer=None,
                allow: Sequence[type] = (), num_drafts: int = 1, draft_law: str = "iid",
                tree_nodes: int | None = None) -> "SpeculativeGenerate":
    """The ``custom_generate`` callable running speculative decoding with ``draft`` (module docstring).

    Args:
        draft: a transformers causal LM with the target's tokenizer (its logits must have the target's size),
            or any ``models.protocols.LanguageModel`` (e.g. ``drafts.registry.draft_from_name("v8k-4l", target)``).
        verifier: ``"token"``, ``"block"`` or ``"greedy"`` (``verify.VERIFIERS``), or a verifier callable.
        gamma: draft tokens per step (>= 1).
        streamer: a transformers streamer (``TextStreamer``, ...) for one row; see the module docstring.
        allow: extra logits-processor / stopping-criteria classes you vouch for: deterministic functions of
            one row's token prefix (and, for processors, its logits row), applied like ``PREFIX_PROCESSORS``.
        num_drafts, draft_law, tree_nodes: draft trees, as ``speculative_generate``'s (``verifier`` then a multi-draft
            rule of ``engine.tree.TREE_VERIFIERS``, ``"onehot"`` for ``draft_law="dynamic"``; the draft must copy rows,
            e.g. a transformers causal LM).
    Returns:
        :class:`SpeculativeGenerate`, to pass as ``model.generate(..., custom_generate=...)``.
    """
    check_int("gamma", gamma, meaning="draft tokens per step")
    check_int("num_drafts", num_drafts, meaning="draft paths per step")
    if not callable(verifier) and verifier not in VERIFIERS and verifier not in TREE_VERIFIERS:
        raise ValueError(f"verifier must be one of {sorted(VERIFIERS)} (or, for draft trees, {sorted(TREE_VERIFIERS)}) "
                         f"or a callable, got {verifier!r}")
    if not all(isinstance(c, type) for c in allow):
        raise ValueError(f"allow must be a sequence of classes (logits processors / stopping criteria), got {allow!r}")
    return SpeculativeGenerate(_as_language_model(draft, "draft"), verifier, gamma, streamer, tuple(allow), num_drafts, draft_law,
                               tree_nodes)


@dataclass(frozen=True)
class SpeculativeGenerate:
    """What :func:`speculative` returns; transformers calls it with what ``generate`` prepared."""

    draft: LanguageModel
    verifier: str | Callable
    gamma: int
    streamer: object | None
    allow: tuple[type, ...]
    num_drafts: int = 1
    draft_law: str = "iid"
    tree_nodes: int | None = None

    def __call__(self, model, input_ids: torch.LongTensor, logits_processor, stopping_criteria, generation_config,
                 synced_gpus: bool = False, streamer=None, seed: int | Sequence[int] | None = None,
                 generator: torch.Generator | None = None, **model_kwargs):
        """Decode ``input_ids [B, L]`` (left-padded) -> ``sequences [B, L + T]`` or the output dataclass."""
        own_streamer = streamer is None and self.streamer is not None
        streamer = self.streamer if own_streamer else streamer
        _check_config(generation_config, synced_gpus)
        mask = _attention_mask(input_ids, model_kwargs)
        sampling, processors = _split_processors(logits_processor, generation_config, self.allow)
        max_new_tokens, eos, criteria = _split_criteria(stopping_criteria, input_ids, self.allow)
        if streamer is not None and input_ids.shape[0] != 1:
            raise ValueError(f"streamer takes one row, got a batch of {input_ids.shape[0]}: drop the streamer or "
                             "generate one prompt at a time")
        target, draft = _as_language_model(model, "the target model"), self.draft
        if isinstance(draft, BindsTarget):  # a draft that reads its target's cache (drafts.gemma4): this one's
            draft.bind(target)
        if processors:
            target = _Processed(target, processors, input_ids, mask)
            draft = _Processed(draft, processors, input_ids, mask)
        if own_streamer:
            streamer.put(input_ids.cpu())  # generate puts the prompt only into a streamer it was given itself
        try:
            result = speculative_generate(
                target, draft, [row[m.bool()].tolist() for row, m in zip(input_ids, mask)], verifier=self.verifier,
                gamma=self.gamma, num_drafts=self.num_drafts, draft_law=self.draft_law, tree_nodes=self.tree_nodes,
                max_new_tokens=max_new_tokens,
                sampling=sampling, seed=_seed(seed, generator),
                eos_token_id=eos, on_step=None if streamer is None else _streaming(streamer),
                stop_when=None if not criteria else _stopper(criteria, input_ids))
        finally:  # the caller's target as transformers built it again (models.rotary, models.mends)
            if not isinstance(model, LanguageModel):
                undo_mends(model)
        if streamer is not None:
            streamer.end()
        sequences = _sequences(input_ids, result, generation_config)
        if not generation_config.return_dict_in_generate:
            return sequences
        return _output(sequences, result)


def generate(model, *args, assistant_model=None, verifier: str | Callable = "block", gamma: int = 4, streamer=None,
             allow: Sequence[type] = (), **kwargs):
    """Entry point of the repository's ``custom_generate/generate.py`` (transformers' Hub contract).

    ``model.generate(..., custom_generate="<dir>", trust_remote_code=True, assistant_model=draft)`` calls this
    with every ``generate`` argument; the draft travels as transformers' own ``assistant_model``. It runs
    ``generate`` again with ``custom_generate=speculative(draft, ...)``, so transformers does the preparation.
    """
    if assistant_model is None:
        raise ValueError("assistant_model is required: pass the draft model, e.g. "
                         "target.generate(ids, assistant_model=draft, custom_generate=..., trust_remote_code=True)")
    decode = speculative(assistant_model, verifier=verifier, gamma=gamma, streamer=streamer, allow=allow)
    if kwargs.get("stop_strings") is not None:  # generate would drop tokenizer= on the way to the callable
        if kwargs.get("tokenizer") is None:
            raise ValueError("stop_strings needs tokenizer=: pass the target's tokenizer to generate")
        stop = _sc.StopStringCriteria(kwargs.pop("tokenizer"), kwargs.pop("stop_strings"))
        kwargs["stopping_criteria"] = _sc.StoppingCriteriaList([*(kwargs.get("stopping_criteria") or []), stop])
    return type(model).generate(model, *args, custom_generate=decode, **kwargs)


def _as_language_model(model, name: str) -> LanguageModel:
    """A ``models.protocols.LanguageModel`` as is; a transformers model wrapped in ``CausalLM`` on its own device."""
    if isinstance(model, LanguageModel):
        return model
    if isinstance(model, torch.nn.Module) and hasattr(model, "get_output_embeddings"):
        training = model.training  # a model split by a device_map or tp_plan stays split (CausalLM.placement)
        wrapped = CausalLM(model, device=model.device, skinny_linear=False, switch_attention=False,
                           fuse_projections=False)  # leaves it alone
        model.train(training)  # and its mode: transformers' generate does not switch it either
        return wrapped
    raise ValueError(f"{name} must be a transformers causal LM or a specresearch LanguageModel, "
                     f"got {type(model).__name__}")


def _check_config(config, synced_gpus: bool) -> None:
    """Raise for what speculative decoding here does not do: beams, group beams, scores, multi-GPU sync."""
    mode = config.get_generation_mode()
    if mode not in (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE):
        raise ValueError(f"generation_config asks for {mode.value} (num_beams={config.num_beams}); speculative(...) "
                         "samples (do_sample=True) or decodes greedily, one sequence per row: set num_beams=1 and "
                         "leave out prompt_lookup_num_tokens, penalty_alpha and dola_layers")
    wanted = [f for f in ("output_scores", "output_logits", "output_attentions", "output_hidden_states")
              if getattr(config, f, False)]
    if wanted:
        raise ValueError(f"{', '.join(wanted)} not available with custom_generate=speculative(...): "
                         "return_dict_in_generate=True gives sequences and per-step acceptance metrics instead")
    if synced_gpus:
        raise ValueError("synced_gpus=True is not supported by speculative(...): run one process per model copy")


def _attention_mask(input_ids: torch.Tensor, model_kwargs: dict) -> torch.Tensor:
    """The left-padded mask [B, L] (generate drops an all-ones mask); raise for model kwargs we cannot honour."""
    unknown = sorted(k for k, v in model_kwargs.items() if k not in _MODEL_KWARGS and v is not None)
    if unknown:
        raise ValueError(f"model kwargs {unknown} are not supported by speculative(...): it feeds token ids only")
    for name in ("cache", "past_key_values"):  # the KV cache's keyword: "cache" from transformers 5.24 on
        cache = model_kwargs.get(name)
        if cache is not None and cache.get_seq_length() > 0:
            raise ValueError(f"{name} already holds tokens: speculative(...) prefills its own cache; drop it")
    mask = model_kwargs.get("attention_mask")
    mask = torch.ones_like(input_ids) if mask is None else mask
    try:
        check_prompt(input_ids, mask)
    except ValueError as error:
        raise ValueError(f"{error} (set tokenizer.padding_side = 'left')") from error
    return mask


def _split_processors(processors, config, allow) -> tuple[SamplingConfig, list]:
    """Sampling warpers -> one SamplingConfig; prefix processors kept (in order); anything else raises."""
    fields, kept, last_kind = {}, [], -1
    canonical = list(SAMPLING_WARPERS)
    for processor in processors or ():
        kind = type(processor)
        if kind in SAMPLING_WARPERS:
            if canonical.index(kind) <= last_kind:
                raise ValueError(f"logits_processor has {kind.__name__} out of generate's order (temperature, "
                                 "top_k, top_p, epsilon): set them in the generation config instead")
            last_kind = canonical.index(kind)
            field, attribute = SAMPLING_WARPERS[kind]
            fields[field] = getattr(processor, attribute)
        elif isinstance(processor, _LAW_PRESERVING):
            continue
        elif kind in PREFIX_PROCESSORS or kind in allow:
            if fields:
                raise ValueError(f"logits_processor applies {kind.__name__} after a sampling warper; speculative(...) "
                                 "applies prefix processors before temperature / top-k / top-p")
            kept.append(processor)
        else:
            raise ValueError(
                f"logits_processor {kind.__name__} is not supported by speculative(...): supported are the sampling "
                f"warpers {[c.__name__ for c in SAMPLING_WARPERS]} and the prefix processors "
                f"{[c.__name__ for c in PREFIX_PROCESSORS]}; pass allow=({kind.__name__},) to speculative(...) only if "
                "it is a deterministic function of one row's token prefix and logits")
    if not config.do_sample:
        return SamplingConfig(temperature=0.0), kept
    return SamplingConfig(**fields), kept


def _split_criteria(criteria, input_ids, allow) -> tuple[int, list[int], list]:
    """-> (max_new_tokens, EOS ids, criteria asked per token); anything else raises."""
    max_length, eos, per_token = None, [], []
    for criterion in criteria or ():
        if isinstance(criterion, _sc.MaxLengthCriteria):
            max_length = criterion.max_length if max_length is None else min(max_length, criterion.max_length)
        elif isinstance(criterion, _sc.EosTokenCriteria):
            eos.extend(int(t) for t in criterion.eos_token_id.flatten().tolist())
        elif type(criterion) in PREFIX_CRITERIA or type(criterion) in allow:
            per_token.append(criterion)
        else:
            raise ValueError(f"stopping_criteria {type(criterion).__name__} is not supported by speculative(...): "
                             f"supported are MaxLengthCriteria, EosTokenCriteria and "
                             f"{[c.__name__ for c in PREFIX_CRITERIA]}")
    if max_length is None or max_length <= input_ids.shape[1]:
        raise ValueError(f"max_new_tokens must be >= 1: got max_length={max_length} for prompts of "
                         f"{input_ids.shape[1]} tokens; set max_new_tokens")
    return max_length - input_ids.shape[1], eos, per_token


def _seed(seed, generator) -> int | list[int]:
    """The engine's seed: ``seed``, or drawn from ``generator``, or from torch's global RNG."""
    if seed is not None and generator is not None:
        raise ValueError("pass either seed or generator, not both")
    if seed is not None:
        return seed if isinstance(seed, int) else list(seed)
    return int(torch.randint(0, 2**62, (), generator=generator, device=None if generator is None else generator.device))


def _streaming(streamer) -> Callable[[list[list[int]]], None]:
    def put(kept: list[list[int]]) -> None:
        if kept[0]:
            streamer.put(torch.tensor(kept[0], dtype=torch.long))
    return put


def _stopper(criteria, input_ids) -> Callable[[int, list[int]], bool]:
    """``stop_when`` for the engine: the criteria on row b's full prefix (padded prompt + new tokens)."""
    def stop(b: int, tokens: list[int]) -> bool:
        ids = torch.tensor([input_ids[b].tolist() + tokens], dtype=torch.long, device=input_ids.device)
        return any(bool(c(ids, None).reshape(-1)[0]) for c in criteria)
    return stop


def _sequences(input_ids, result: GenerationResult, config) -> torch.LongTensor:
    """Prompt + new tokens, rows that stopped early padded with pad_token_id (as ``generate`` does). -> [B, L+T]."""
    width = max(len(row) for row in result.tokens)
    pad = config.pad_token_id
    if pad is None:
        eos = config.eos_token_id
        pad = (eos if isinstance(eos, int) else eos[0]) if eos is not None else 0
    new = torch.full((input_ids.shape[0], width), int(pad), dtype=torch.long)
    for b, row in enumerate(result.tokens):
        new[b, : len(row)] = torch.tensor(row, dtype=torch.long)
    return torch.cat([input_ids, new.to(input_ids.device)], dim=1)


def _output(sequences, result: GenerationResult) -> SpeculativeDecoderOnlyOutput:
    steps = result.steps
    return SpeculativeDecoderOnlyOutput(
        sequences=sequences,
        num_accepted=torch.tensor([[n if a else 0 for n, a in zip(s.num_accepted, s.active)] for s in steps]),
        active=torch.tensor([s.active for s in steps], dtype=torch.bool),
        gamma=torch.tensor([s.gamma for s in steps]),
        block_efficiency=result.block_efficiency,
        acceptance_rate=result.acceptance_rate,
        target_calls=result.target_calls,
        draft_calls=result.draft_calls,
        result=result,
    )


class _Processed:
    """A ``LanguageModel`` whose logits pass through transformers logits processors at every position.

    It records the slots fed (prompt, then scored tokens, masked slots included) so the prefix of each
    position is known exactly; rollback forgets them as the model does. Each position's row is processed
    with its prefix broadcast to the whole batch (``generate``'s batch size) and row b read back, so a
    processor holding per-row state (RepetitionPenalty's per-row prompt padding, PrefixConstrained's batch
    index) sees row b where it expects it.

    The optional interfaces pass through: a target's ``hidden_layers`` (features are returned as the model
    computes them, only the logits are processed), a draft's feature channel (``feature_layers``,
    ``feature_size``, ``observe``), its length plan (``plan_length``), a model's context plan (``plan_context``),
    row copies (``repeat_rows`` / ``select_rows``) and a target's tree scoring (``begin_tree`` / ``score_tree`` /
    ``end_tree``: each node processed with its own path as prefix). They are instance attributes, set only when the wrapped model has
    them, so the engine's interface checks see the wrapped model's.
    """

    def __init__(self, model: LanguageModel, processors, input_ids: torch.Tensor, mask: torch.Tensor):
        self.model, self.processors = model, processors
        self.vocab_size = model.vocab_size
        self.returns_hidden_states = getattr(model, "returns_hidden_states", False)
        for name in ("feature_layers", "feature_size", "observe", "plan_length", "plan_context"):
            if hasattr(model, name):
                setattr(self, name, getattr(model, name))
        if hasattr(model, "select_rows") and hasattr(model, "repeat_rows"):  # rows leave the batch / draft trees
            self.select_rows, self.repeat_rows = self._select_rows, self._repeat_rows
        if isinstance(model, TreeScorer):  # a target that scores draft trees
            self.begin_tree, self.score_tree, self.end_tree = self._begin_tree, self._score_tree, self._end_tree
        self._region: list[list[int]] | None = None  # per row, the tokens of the open tree region, in slot order
        self._pads = [row[: int((m == 0).sum())].tolist() for row, m in zip(input_ids, mask)]  # left pads per row
        self._slots: list[list[tuple[int, bool]]] = []
        self._origin: list[int] = []  # the ``generate`` row each current row came from

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def max_context(self) -> int | None:
        return getattr(self.model, "max_context", None)

    def reset(self, batch_size: int) -> None:
        self._slots = [[] for _ in range(batch_size)]
        self._origin = list(range(batch_size))
        self.model.reset(batch_size)

    def _repeat_rows(self, k: int) -> None:
        self._slots = [list(slots) for slots in self._slots for _ in range(k)]
        self._origin = [b for b in self._origin for _ in range(k)]
        self.model.repeat_rows(k)

    def _select_rows(self, index: torch.Tensor) -> None:
        self._slots = [self._slots[i] for i in index.tolist()]
        self._origin = [self._origin[i] for i in index.tolist()]
        self.model.select_rows(index)

    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, hidden_layers=None):
        """As the model's; with ``hidden_layers`` (a target that returns hidden states) ``(logits, features)``."""
        hidden = {} if hidden_layers is None else {"hidden_layers": hidden_layers}
        out = self.model.prefill(input_ids, attention_mask, **hidden)
        self._slots = [list(zip(r.tolist(), m.bool().tolist())) for r, m in zip(input_ids, attention_mask)]
        self._origin = list(range(len(self._slots)))
        return out

    def score(self, tokens: torch.Tensor, valid: torch.Tensor | None = None, hidden_layers=None):
        """Append ``tokens [B, k]``; logits ``[B, k, V]`` after the processors (masked slots left raw);
        with ``hidden_layers`` ``(logits, features)``, the model's features unprocessed."""
        if hidden_layers is None:
            logits, features = self.model.score(tokens, valid), None
        else:
            logits, features = self.model.score(tokens, valid, hidden_layers=hidden_layers)
        logits = logits.clone()
        valid = torch.ones_like(tokens, dtype=torch.bool) if valid is None else valid.bool()
        for b in range(tokens.shape[0]):
            for j in range(tokens.shape[1]):
                self._slots[b].append((int(tokens[b, j]), bool(valid[b, j])))
                if valid[b, j]:
                    logits[b, j] = self._process(b, logits[b, j])
        return logits if features is None else (logits, features)

    def _begin_tree(self) -> None:
        self._region = [[] for _ in self._slots]
        self.model.begin_tree()

    def _score_tree(self, tokens: torch.Tensor, depth: torch.Tensor, visible: torch.Tensor, hidden_layers=None):
        """The model's ``score_tree``; node i's logits go through the processors with the prefix of its own path
        (the valid slots, then the region's slots and new nodes ``visible`` to it: its ancestors and itself)."""
        if hidden_layers is None:
            logits, features = self.model.score_tree(tokens, depth, visible), None
        else:
            logits, features = self.model.score_tree(tokens, depth, visible, hidden_layers=hidden_layers)
        logits = logits.clone()
        for b, (new, seen) in enumerate(zip(tokens.tolist(), visible.tolist())):
            region = self._region[b] + new
            for i, marks in enumerate(seen):
                logits[b, i] = self._process(b, logits[b, i], [t for t, mark in zip(region, marks) if mark])
            self._region[b] = region
        return logits if features is None else (logits, features)

    def _end_tree(self, kept: torch.Tensor) -> None:
        """The accepted path's region slots become valid slots of the prefix; the rest are forgotten."""
        for slots, region, marks in zip(self._slots, self._region, kept.tolist()):
            slots.extend((t, True) for t, mark in zip(region, marks) if mark)
        self._region = None
        self.model.end_tree(kept)

    def rollback(self, n) -> None:
        counts = rollback_counts(n, len(self._slots), "cpu").tolist()
        self._slots = [slots[: len(slots) - c] for slots, c in zip(self._slots, counts)]
        self.model.rollback(n)

    def _process(self, b: int, row: torch.Tensor, path: Sequence[int] = ()) -> torch.Tensor:
        """Processors on row b's prefix (its pads + valid slots + ``path``, a tree node's path) -> processed logits
        ``[V]``, seen by the processors as row ``_origin[b]`` of ``generate``'s batch."""
        origin = self._origin[b]
        prefix = self._pads[origin] + [t for t, ok in self._slots[b] if ok] + list(path)
        batch = len(self._pads)
        ids = torch.tensor([prefix], dtype=torch.long, device=row.device).expand(batch, -1)
        scores = row[None].expand(batch, -1).clone()
        for processor in self.processors:
            scores = processor(ids, scores)
        return scores[origin]

