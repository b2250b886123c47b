"""The engines as :func:`specresearch.audit.execute.execute` runs them: one runner per kind of engine, each with the
same four parts (the target's next-token law at given prefixes, the encoded rule's predicted law or None where the
rule is exact, the engine's own generations, and notes), and the helpers they share.

* :class:`TransformersRun`: transformers' assisted generation, prompt lookup, or its ``_speculative_sampling`` called
  on real rows (:func:`captured_rows` records what it verifies with).
* :class:`LlamaCppRun`: llama.cpp's server (:mod:`specresearch.audit.llamacpp`).
* :class:`LlamaSpeculativeRun`: llama.cpp's ``llama-speculative`` example, one process a generation.
* :class:`PythonRun`: any library's sampler against the target's plain law.
"""

from __future__ import annotations

import contextlib
import copy

import torch

from specresearch.audit.engines import engine_rule
from specresearch.audit.real import single_step
from specresearch.audit.vocabularies import CrossVocabularyDraft

__all__ = ["TransformersRun", "LlamaCppRun", "LlamaSpeculativeRun", "PythonRun", "captured_rows", "quiet_transformers", "absorbing", "padded",
           "SAMPLING_OPTIONS", "ENGINE_OPTIONS", "PYTHON_SETTINGS"]

SAMPLING_OPTIONS = ("top_k", "top_p", "repetition_penalty")  # transformers' generate arguments, applied to both laws
# a library's sampling settings for the python engine: recorded, and the law they define given as target_law=
PYTHON_SETTINGS = ("top_k", "top_p", "repetition_penalty", "frequency_penalty", "presence_penalty", "bad_words",
                   "allowed_token_ids", "min_tokens", "stop_token_ids")
ENGINE_OPTIONS = {
    "transformers-assisted": ("num_assistant_tokens", "assistant_confidence_threshold", "assistant_ensemble_weight"),
    "transformers-lookup": ("prompt_lookup_num_tokens", "max_matching_ngram_size"),
    "transformers-sampling": ("assistant_ensemble_weight",),
    "transformers-mtp": (),
    "transformers-gemma4-assistant": ("num_assistant_tokens",),
    "transformers-dflash": (),
    "transformers-usd": ("num_assistant_tokens",),
    "transformers-early-exit": ("assistant_early_exit", "num_assistant_tokens"),
    "llamacpp-server": ("top_k", "top_p", "min_p", "synth_rates", "draft_max", "draft_scale", "seeded"),
    "llamacpp-example": ("top_k", "top_p", "min_p", "n_parallel", "draft_max", "p_split", "draft_scale", "jobs"),
    "llamacpp-simple": ("top_k", "top_p", "min_p", "draft_max", "draft_scale", "jobs"),
    "python": ("sample", "sampler", "name", "version", "target_law", "predicted_law") + PYTHON_SETTINGS,
}
_ROW_BATCH = 32


@contextlib.contextmanager
def captured_rows():
    """Record the rows transformers' assisted decoding verifies with: within the block, every call of
    ``transformers.generation.utils._speculative_sampling`` appends ``(candidate_logits, new_logits)`` (float32, as
    passed: the draft's processed scores of the candidates and the target's processed scores) to the yielded list."""
    from transformers.generation import utils

    original = getattr(utils, "_speculative_sampling", None)
    if original is None:
        raise RuntimeError("this transformers has no generation.utils._speculative_sampling: execute() needs 4.x-5.x")
    calls: list = []

    def recording(candidate_input_ids, candidate_logits, candidate_length, new_logits, *args, **kwargs):
        calls.append((candidate_logits.detach().clone(), new_logits.detach().clone()))
        return original(candidate_input_ids, candidate_logits, candidate_length, new_logits, *args, **kwargs)

    utils._speculative_sampling = recording
    try:
        yield calls
    finally:
        utils._speculative_sampling = original


@contextlib.contextmanager
def quiet_transformers():
    """transformers' own warnings off while its code runs N times (its assisted generation warns on every call that
    the candidate generator passes a generation config with arguments); restored after."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


def absorbing(next_rows, eos: int, vocab: int):
    """``next_rows`` with EOS absorbing: after a prefix ending in EOS, EOS again (a generation that stopped)."""
    def rows(prefixes):
        live = [p for p in prefixes if not p or p[-1] != eos]
        computed = iter(next_rows(live)) if live else iter(())
        one_hot = torch.zeros(vocab, dtype=torch.float64)
        one_hot[eos] = 1.0
        return torch.stack([one_hot if p and p[-1] == eos else next(computed) for p in prefixes])
    return rows


def padded(tokens: list[int], n_tokens: int, eos: int) -> list[int]:
    """The first ``n_tokens`` of ``tokens``, EOS absorbing: cut after the first EOS, padded with EOS."""
    tokens = list(tokens)
    if eos in tokens:
        tokens = tokens[: tokens.index(eos) + 1]
    tokens = tokens[:n_tokens]
    return tokens + [eos] * (n_tokens - len(tokens))


class TransformersRun:
    """transformers' generate on the target (and the draft), one prompt, batch 1 as its assisted decoding needs."""

    def __init__(self, engine, target_model, draft_model, prompt: list[int], eos: int, temperature: float, options: dict,
                 n_tokens: int, tokenizers: tuple = ()):
        import transformers

        self.engine, self.target, self.draft, self.prompt, self.eos = engine, target_model, draft_model, list(prompt), eos
        self.vocab = target_model.config.vocab_size
        self.sampling = dict(do_sample=True, temperature=temperature, top_k=options.get("top_k", 0),
                             pad_token_id=eos, **{k: options[k] for k in SAMPLING_OPTIONS[1:] if k in options})
        self.extra = {k: options[k] for k in ENGINE_OPTIONS[engine] if k in options}
        self.weight = options.get("assistant_ensemble_weight")
        self.version = f"transformers {transformers.__version__}"
        self.n_tokens, self.notes, self.draft_tv = n_tokens, [], None
        if engine == "transformers-mtp":  # the target's own MTP layers draft (transformers' MTPCandidateGenerator)
            self.extra["use_mtp"] = True
        if engine == "transformers-dflash":  # a DFlash assistant drafts a block a step (DFlashTokenCandidateGenerator)
            self.extra["speculation_type"] = "dflash"
        if engine == "transformers-gemma4-assistant":  # its candidate generator reads the assistant's config only
            draft_model.generation_config.num_assistant_tokens = self.extra.pop("num_assistant_tokens", n_tokens)
        self.lossy, self.usd = False, None
        if engine == "transformers-usd":  # the draft speaks another vocabulary (UniversalSpeculativeDecodingGenerator)
            self.usd = CrossVocabularyDraft(draft_model, tokenizers, self.vocab, temperature)
            self.extra["tokenizer"], self.extra["assistant_tokenizer"] = tokenizers
            self.lossy = self.usd.lossy
        if engine == "transformers-early-exit":  # the target's first layers draft (EarlyExitCandidateGenerator)
            self.draft = draft_model = None
            self._early_config = target_model.generation_config  # its candidate generator reads the target's
            target_model.generation_config = copy.deepcopy(target_model.generation_config)
        if engine in ("transformers-assisted", "transformers-usd", "transformers-early-exit"):
            config = (draft_model or target_model).generation_config
            config.assistant_confidence_threshold = self.extra.pop("assistant_confidence_threshold", 0.0)
            config.num_assistant_tokens = self.extra.pop("num_assistant_tokens", n_tokens)
            config.num_assistant_tokens_schedule = "constant"

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.engine == "transformers-early-exit":  # the target's own generation config back as it was
            self.target.generation_config = self._early_config
        return None

    def _ids(self, prefixes) -> torch.Tensor:
        return torch.tensor([self.prompt + list(p) for p in prefixes], dtype=torch.long, device=self.target.device)

    @torch.no_grad()
    def rows(self, model, prefixes) -> torch.Tensor:
        """The law ``model`` samples its next token from after each prefix, under the run's settings. -> [n, V]
        (prefixes of one length share a call)."""
        by_length: dict[int, list[int]] = {}
        for i, prefix in enumerate(prefixes):
            by_length.setdefault(len(prefix), []).append(i)
        out = [None] * len(prefixes)
        for indices in by_length.values():
            for start in range(0, len(indices), _ROW_BATCH):
                batch = indices[start:start + _ROW_BATCH]
                ids = self._ids([prefixes[i] for i in batch])
                scores = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, output_scores=True,
                                        return_dict_in_generate=True, **self.sampling).scores[0]
                for i, row in zip(batch, scores.double().softmax(-1).cpu()):
                    out[i] = row
        return torch.stack(out)

    def target_rows(self, prefixes) -> torch.Tensor:
        return self.rows(self.target, prefixes)

    def predicted_rows(self, law) -> dict | None:
        """The encoded rule's next-token law at every prefix ``law`` expanded (None: the rule is exact), from the
        rows transformers verifies with; records how far its q is from the draft's own law."""
        if self.engine == "transformers-lookup":
            return None
        if self.engine in ("transformers-mtp", "transformers-dflash", "transformers-early-exit"):
            self._check_drafted({"transformers-mtp": "MTP", "transformers-dflash": "DFlash"}.get(self.engine, "early-exit"))
            return None
        if self.engine == "transformers-gemma4-assistant":  # the first token is the target's own
            live = [s for s in law.rows if s and s[-1] != self.eos]
            q, p = self._rows_after_forced(live)
            r, _ = single_step("hf-assisted", p, q, num_drafts=1, assistant="greedy")
            return dict(law.rows) | dict(zip(live, r))
        if self.engine == "transformers-usd":
            return self._usd_rows(law)
        live = [s for s in law.rows if not s or s[-1] != self.eos] if self.weight is not None else [()]
        q, p = self.verified_rows(live)
        self.draft_tv = 0.5 * float((q[0] - self.rows(self.draft, [()])[0]).abs().sum())
        if self.draft_tv > 1e-4:
            self.notes.append("transformers verifies with a q other than the draft's own sampling law at these "
                              "settings: lossless still, but the draft it runs is another one (draft_tv_intended)")
        if self.weight is None:
            return None
        r, _ = single_step("hf-assisted", p, q, num_drafts=1, ensemble_weight=self.weight)
        return dict(law.rows) | dict(zip(live, r))  # after an EOS: the law's absorbing row

    def _usd_rows(self, law) -> dict | None:
        """Speculative sampling with drafts from d, verified with q and the target's rows (``usd.rows``), at
        every live prefix; None where nothing is pruned (q is d). ``RuntimeError`` unless the q transformers verifies
        with at the prompt (captured) is the one computed here."""
        captured, _ = self.verified_rows([()])
        live = [s for s in law.rows if not s or s[-1] != self.eos] if self.lossy else [()]
        drafted, q = self.usd.rows(self.prompt, live)
        if float((captured[0] - q[0]).abs().max()) > 1e-4:  # float32 logits of two forwards, not bit-equal
            raise RuntimeError("the q transformers verifies with at the prompt is not the one the run computes: its "
                               "model of the path is wrong")
        self.draft_tv = 0.5 * float((q[0] - drafted[0]).abs().sum())
        if not self.lossy:
            return None
        self.notes.append(f"the draft has {self.usd.own_only} "
                          "tokens the target lacks: transformers prunes its head, and the q it verifies with is the "
                          f"draft's law on other tokens' ids (TV {self.draft_tv:.3f} at the prompt; the order is the one "
                          "its translator drew in this process)")
        r, _ = single_step("hf-assisted", self.target_rows(live), q, num_drafts=1, drafted=drafted)
        return dict(law.rows) | dict(zip(live, r))

    @torch.no_grad()
    def _check_drafted(self, kind: str) -> None:
        """``RuntimeError`` unless one generation of ``n_tokens + 1`` tokens verifies ``kind`` drafts (MTP's, DFlash's)
        with ``_speculative_sampling`` (the path whose law the run measures); the count goes into the notes."""
        ids = self._ids([()])
        with captured_rows() as calls:
            self.target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=self.n_tokens + 1,
                                 assistant_model=self.draft, **self.sampling, **self.extra)
        if not calls:
            raise RuntimeError(f"transformers' {kind} path verified no draft: nothing of it to measure")
        drafted = sum(int(q.shape[1]) for q, _ in calls)
        self.notes.append(f"one generation of {self.n_tokens + 1} tokens: {len(calls)} verification call(s) of "
                          f"_speculative_sampling over {drafted} {kind}-drafted token(s)")

    @torch.no_grad()
    def _rows_after_forced(self, prefixes) -> tuple[torch.Tensor, torch.Tensor]:
        """(q, p) ``[n, V]`` float64 the first verification verifies the draft after each prefix with, for an engine
        whose first token is the target's own (never drafted): the generation starts one token short, and a logits
        processor makes the prefix's last token its first (the rows after it are the engine's own)."""
        from transformers import LogitsProcessor, LogitsProcessorList

        class Force(LogitsProcessor):
            def __init__(self, length: int, token: int):
                self.length, self.token = length, token

            def __call__(self, input_ids, scores):
                if input_ids.shape[1] != self.length:
                    return scores
                forced = torch.full_like(scores, float("-inf"))
                forced[:, self.token] = 0.0
                return forced

        return self._first_verified([(prefix, prefix[:-1], dict(
            max_new_tokens=3,  # room for a draft after the forced token
            logits_processor=LogitsProcessorList([Force(len(self.prompt) + len(prefix) - 1, prefix[-1])])))
            for prefix in prefixes])

    @torch.no_grad()
    def verified_rows(self, prefixes) -> tuple[torch.Tensor, torch.Tensor]:
        """(q, p) ``[n, V]`` float64: the rows transformers' assisted decoding verifies the first draft token after
        each prefix with (:func:`captured_rows`, one assisted step per prefix)."""
        return self._first_verified([(prefix, prefix, dict(max_new_tokens=2)) for prefix in prefixes])

    def _first_verified(self, calls_to_make) -> tuple[torch.Tensor, torch.Tensor]:
        """(q, p) of the first verification of each generation ``(prefix, start, generate's settings)`` started from
        the prompt and ``start`` (:func:`captured_rows`)."""
        qs, ps = [], []
        for prefix, start, settings in calls_to_make:
            ids = self._ids([start])
            with captured_rows() as calls:
                self.target.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=self.draft,
                                     **settings, **self.sampling, **self.extra)
            if not calls:
                raise RuntimeError(f"transformers verified no draft after prefix {prefix}: nothing to capture")
            qs.append(calls[0][0][0, 0].double().softmax(-1).cpu())
            ps.append(calls[0][1][0, 0].double().softmax(-1).cpu())
        return torch.stack(qs), torch.stack(ps)

    @torch.no_grad()
    def draws(self, num_samples: int):
        """The engine's generations, one token list each (``max_new_tokens`` = n_tokens + 1: every one of the first
        n_tokens is a verified position, never a bonus token)."""
        if self.engine == "transformers-sampling":
            yield from self._function_draws(num_samples)
            return
        ids = self._ids([()])
        assistant = self.draft if self.engine in ("transformers-assisted", "transformers-gemma4-assistant",
                                                  "transformers-dflash", "transformers-usd") else None
        for _ in range(num_samples):
            out = self.target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=self.n_tokens + 1,
                                       assistant_model=assistant, **self.sampling, **self.extra)
            yield padded(out[0, ids.shape[1]:].tolist(), self.n_tokens, self.eos)

    def _function_draws(self, num_samples: int):
        from transformers.generation.utils import _speculative_sampling

        ids = self._ids([()])
        with captured_rows() as calls:
            self.target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=2,
                                 assistant_model=self.draft, **self.sampling)
        q_logits, p_logits = calls[0][0][:, :1], calls[0][1][:, :1]
        new_logits = torch.cat([p_logits, p_logits], 1)  # the bonus row is never read for the first token
        drafts = torch.multinomial(q_logits[0, 0].double().softmax(-1), num_samples, replacement=True)
        for x in drafts.tolist():
            candidate = torch.cat([ids.cpu(), torch.tensor([[x]])], 1)
            tokens, _ = _speculative_sampling(candidate, q_logits, 1, new_logits, self.weight)
            yield [int(tokens[0, 0])]


def _llama_sampling(engine: str, options: dict, temperature: float) -> dict:
    """A llama.cpp run's sampler settings (the server's defaults where ``options`` has none); ``ValueError`` for a
    ``top_k`` outside 1..200 (the final probabilities are read back as the ``top_k`` most likely tokens)."""
    from specresearch.audit.llamacpp import SAMPLING

    sampling = {k: options.get(k, SAMPLING[k]) for k in ("top_k", "top_p", "min_p")} | {"temperature": temperature}
    if not isinstance(sampling["top_k"], int) or not 1 <= sampling["top_k"] <= 200:
        raise ValueError(f"{engine} needs top_k in 1..200 (its final probabilities are read back as the top_k most "
                         f"likely tokens), got {sampling['top_k']!r}")
    return sampling


def _scaled_draft(options: dict):
    """``(target GGUF, draft GGUF, scale)``: the draft the target's copy with its logits scaled by ``draft_scale``."""
    from specresearch.audit.llamacpp import write_scaled_draft
    from specresearch.models.embedded import gguf_path
    from specresearch.paths import cache_dir

    scale = float(options.get("draft_scale", 1.5))
    return gguf_path(), write_scaled_draft(gguf_path(), cache_dir("llamacpp", f"draft-scaled-{scale:g}.gguf"), scale), scale


class LlamaCppRun:
    """llama.cpp's server (:mod:`specresearch.audit.llamacpp`) on the embedded GGUF with a scaled copy as the draft."""

    def __init__(self, prompt: list[int], eos: int, vocab: int, temperature: float, options: dict, n_tokens: int,
                 seed: int):
        self.prompt, self.eos, self.vocab, self.n_tokens, self.seed = list(prompt), eos, vocab, n_tokens, seed
        self.seeded = bool(options.get("seeded", True))  # False: requests carry no seed, the server draws its own
        self.sampling = _llama_sampling("llamacpp-server", options, temperature)
        rates = options.get("synth_rates")
        self.rates = None if rates is None else tuple(float(r) for r in (rates.split(",") if isinstance(rates, str) else rates))
        n_max = int(options.get("draft_max", 3))
        args = ["--spec-type", "draft-simple", "--spec-draft-n-max", str(n_max), "--spec-draft-p-min", "0"]
        if self.rates is not None:
            engine_rule("llamacpp-server", gamma=1, synth_rates=self.rates)  # checks them as llama.cpp does
            if len(self.rates) != n_max or n_tokens != 2:
                raise ValueError(f"synth_rates: one rate per drafted position (draft_max = {n_max}), and n_tokens=2 "
                                 "(the token after the first drafted step; later ones depend on earlier acceptances)")
            args += ["--spec-synth-rates", ",".join(repr(r) for r in self.rates)]
        model, draft, scale = _scaled_draft(options)
        self.server_args = (model, draft, args)
        self.notes = [f"the draft is the target's GGUF with its logits scaled by {scale:g} (write_scaled_draft)",
                      "the server's first token is the target's own; its speculative steps start at the second"]
        self.draft_tv = None

    def __enter__(self):
        from specresearch.audit.llamacpp import LlamaServer

        model, draft, args = self.server_args
        self.server = LlamaServer(model, draft, args=args).__enter__()
        self.version = self.server.version()
        return self

    def __exit__(self, *exc):
        self.server.__exit__(*exc)

    def target_rows(self, prefixes) -> torch.Tensor:
        return torch.stack([self.server.row(self.prompt + list(p), self.vocab, self.sampling) for p in prefixes])

    def predicted_rows(self, law) -> dict | None:
        """Synthetic acceptance after the first token: the draft's greedy token (the target's argmax: the draft is
        its scaled copy) kept with the first position's probability, else the target's sample (``llamacpp-server``'s
        float form)."""
        if self.rates is None:
            return None
        rows = dict(law.rows)
        for prefix, p in law.rows.items():
            if len(prefix) == 1 and prefix[0] != self.eos:
                rows[prefix] = single_step("llamacpp-server", p[None], p[None], synth_rates=self.rates)[0][0]
        return rows

    def draws(self, num_samples: int):
        """The server's generations; fails when it drafted nothing (the run would have tested plain sampling)."""
        drafted = accepted = 0
        for i in range(num_samples):
            seed = {"seed": self.seed * 1_000_003 + i} if self.seeded else {}
            reply = self.server.complete(self.prompt, n_predict=self.n_tokens + 1, return_tokens=True, cache_prompt=True,
                                         **seed, **self.sampling)
            drafted += reply.get("timings", {}).get("draft_n", 0) or 0
            accepted += reply.get("timings", {}).get("draft_n_accepted", 0) or 0
            yield padded(reply["tokens"], self.n_tokens, self.eos)
        if not drafted:
            raise RuntimeError("llama-server drafted no token in the run: its speculative decoding was off")
        self.notes.append(f"the server drafted {drafted} tokens in the run and kept {accepted} (its timings)")


class LlamaSpeculativeRun:
    """llama.cpp's ``llama-speculative`` example (:func:`specresearch.audit.llamacpp.run_speculative`: SpecInfer-style
    verification of ``n_parallel`` draft branches in a random order) on the embedded GGUF with a scaled copy as the
    draft, one process a generation (``jobs`` at once). Its first token is the target's own sample; the second is the
    first a drafted step decides, so ``n_tokens`` = 2. The target's and the draft's lists (their sampler chains' final
    probabilities) come from two ``llama-server`` processes on the same files; the prediction is the encoded rule
    ``llamacpp-example`` on them (its lists the rows' supports), and the run is also held against the same rule with
    the residual taken token by token (p - q, every token on both lists), the encoding before this runner ran.

    ``simple=True``: ``llama-speculative-simple`` (the loop the server runs, sample-and-compare: exact), whose first
    token is already drafted for; the prediction is the target's law."""

    def __init__(self, prompt: list[int], eos: int, vocab: int, temperature: float, options: dict, n_tokens: int,
                 seed: int, simple: bool = False):
        import os

        self.prompt, self.eos, self.vocab, self.n_tokens, self.seed = list(prompt), eos, vocab, n_tokens, seed
        engine = "llamacpp-simple" if simple else "llamacpp-example"
        self.sampling = _llama_sampling(engine, options, temperature)
        self.n_parallel, self.draft_max = int(options.get("n_parallel", 1)), int(options.get("draft_max", 3))
        self.p_split = float(options.get("p_split", 0.1))
        if not 1 <= self.n_parallel <= 4 or self.draft_max < 1:
            raise ValueError(f"{engine}: n_parallel in 1..4 and draft_max >= 1, got {self.n_parallel}, {self.draft_max}")
        self.jobs = int(options.get("jobs", min(2, os.cpu_count() or 1)))
        self.model, self.draft, scale = _scaled_draft(options)
        self.simple, self._draft_rows = simple, {}
        self.notes = [f"the draft is the target's GGUF with its logits scaled by {scale:g} (write_scaled_draft)",
                      "llama-speculative-simple drafts for its first token already (--spec-draft-p-min 0)" if simple else
                      "llama-speculative's first token is the target's own; the second is the first it drafts for"]
        self.draft_tv = None

    def __enter__(self):
        from specresearch.audit.llamacpp import LlamaServer

        self.servers = [LlamaServer(self.model).__enter__()]
        if not self.simple:  # the draft's lists, for the prediction
            try:
                self.servers.append(LlamaServer(self.draft).__enter__())
            except BaseException:
                self.servers[0].__exit__(None, None, None)
                raise
        target_server = self.servers[0]
        self.text = target_server.detokenize(self.prompt)
        tokens = target_server.tokenize(self.text)
        if tokens != self.prompt:
            self.notes.append(f"llama.cpp tokenizes the prompt's text as {len(tokens)} tokens (the toolkit's: "
                              f"{len(self.prompt)}); the laws use llama.cpp's")
            self.prompt = tokens
        self.version = target_server.version() + (", llama-speculative-simple" if self.simple else ", llama-speculative")
        return self

    def __exit__(self, *exc):
        for server in self.servers:
            server.__exit__(*exc)

    def _rows(self, server, prefixes) -> torch.Tensor:
        return torch.stack([server.row(self.prompt + list(p), self.vocab, self.sampling) for p in prefixes])

    def target_rows(self, prefixes) -> torch.Tensor:
        return self._rows(self.servers[0], prefixes)

    def _step_rows(self, law, lists: str) -> dict:
        rows = dict(law.rows)
        drafted = [prefix for prefix in law.rows if len(prefix) == 1 and prefix[0] != self.eos]
        if drafted:
            missing = [prefix for prefix in drafted if prefix not in self._draft_rows]
            if missing:  # the prediction and the alternative share the draft's lists
                self._draft_rows.update(zip(missing, self._rows(self.servers[1], missing)))
            q = torch.stack([self._draft_rows[prefix] for prefix in drafted])
            p = torch.stack([law.rows[prefix] for prefix in drafted])
            r = single_step("llamacpp-example", p, q, num_drafts=self.n_parallel, p_split=self.p_split,
                            lists=lists)[0]
            rows.update(zip(drafted, r))
        return rows

    def predicted_rows(self, law) -> dict | None:
        """The first token: the target's; the second: ``llamacpp-example``'s float form on the target's and the
        draft's lists after the first (its residual on the lists as the example pairs them). None (the target's
        law) for the simple loop."""
        return None if self.simple else self._step_rows(law, "support")

    def alternative_rows(self, law) -> dict:
        return {} if self.simple else {"residual p - q token by token": self._step_rows(law, "full")}

    def draws(self, num_samples: int):
        """The example's generations, ``jobs`` processes at a time, in order. Each run's seed is drawn uniformly from
        [1, 2^31 - 2] by a generator seeded with the run's ``seed``: the example's verifier generator
        (``minstd_rand0``) gives consecutive seeds nearly equal first draws, which would make the runs dependent."""
        from concurrent.futures import ThreadPoolExecutor

        import numpy as np

        from specresearch.audit.llamacpp import run_speculative

        seeds = np.random.default_rng(self.seed).integers(1, 2**31 - 1, size=num_samples).tolist()

        def one(seed: int):
            return run_speculative(self.model, self.draft, self.text, seed=seed,
                                   n_predict=self.n_tokens if self.simple else self.n_tokens - 1,
                                   sampling=self.sampling, n_parallel=self.n_parallel, draft_max=self.draft_max,
                                   p_split=self.p_split, simple=self.simple, with_log=True)

        failed = 0
        with ThreadPoolExecutor(self.jobs) as pool:
            for seed, (tokens, log) in zip(seeds, pool.map(one, seeds)):
                failed += "failed to find a memory slot" in log
                if len(tokens) < self.n_tokens and self.eos not in tokens:
                    raise RuntimeError(f"{'llama-speculative-simple' if self.simple else 'llama-speculative'} (seed "
                                       f"{seed}) logged {len(tokens)} tokens of {self.n_tokens} and no end of "
                                       "generation: its log does not show what it generated")
                yield padded(tokens, self.n_tokens, self.eos)
        if failed:
            self.notes.append(f"in {failed} of {num_samples} runs the target's batch failed to decode ('failed to find a "
                              "memory slot': several branches need a unified KV cache, which the example cannot be "
                              "given) and the example went on with the previous step's list")


class PythonRun:
    """A library's own sampler, ``sample(prompt_ids, n_tokens) -> tokens`` (at least ``n_tokens`` new ones), against
    the target's plain law softmax(logits / T) from one uncached forward of the same model: what a library that
    claims lossless speculative sampling at temperature T promises.

    ``options["sampler"]`` instead of ``options["sample"]``: a recipe (``experiments.executor.loaded``) that builds the
    sampler, once a process, so that seed blocks can run in workers that did not build it (a library's sampler holds
    its models and does not travel). Built here, before a block seeds its draws, as a given sampler was.
    ``options["target_law"]``: ``callable(ids, logits) -> probabilities``, the law the library's sampling settings
    (:data:`PYTHON_SETTINGS`, recorded) define after ``ids`` (the prompt and a prefix) from the model's float64
    ``logits`` [V] at temperature 1, in place of softmax(logits / T). ``options["predicted_law"]``: ``callable(law) ->
    rows``, an encoding of a composition the library does not claim lossless: its next-token law at every prefix the
    target's ``law`` expanded (prefix -> [V] float64), held to the measured law as the audit's prediction (the
    verdict is then "not exact")."""

    def __init__(self, target_model, prompt: list[int], eos: int, temperature: float, options: dict, n_tokens: int):
        from specresearch.experiments.executor import loaded

        self.target, self.prompt, self.eos, self.temperature, self.n_tokens = target_model, list(prompt), eos, temperature, n_tokens
        self.sample = options["sample"] if "sample" in options else loaded(options["sampler"])
        self.law, self.predict = options.get("target_law"), options.get("predicted_law")
        self.lossy = self.predict is not None
        self.version = options.get("version", getattr(self.sample, "__module__", "?"))
        self.notes, self.draft_tv = [f"library: {options.get('name', self.version)}"], None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None

    @torch.no_grad()
    def target_rows(self, prefixes) -> torch.Tensor:
        out = []
        for start in range(0, len(prefixes), _ROW_BATCH):
            ids = torch.tensor([self.prompt + list(p) for p in prefixes[start:start + _ROW_BATCH]], dtype=torch.long,
                               device=self.target.device)
            logits = self.target(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[:, -1].double().cpu()
            out.append((logits / self.temperature).softmax(-1) if self.law is None else
                       torch.stack([self.law(row.tolist(), x) for row, x in zip(ids.cpu(), logits)]))
        return torch.cat(out)

    def predicted_rows(self, law) -> dict | None:
        return None if self.predict is None else self.predict(law)

    def draws(self, num_samples: int):
        for _ in range(num_samples):
            yield padded(self.sample(list(self.prompt), self.n_tokens), self.n_tokens, self.eos)
