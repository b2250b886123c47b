"""Audit by execution: run an engine's own implementation, measure the law of what it generates, and hold it
against the target's law and against the law the toolkit's encoding of its rule predicts.

``audit(rule)`` decides an engine's rule exactly, but the rule is our encoding of the engine's source; this module
runs the engine's code itself. :func:`execute` draws ``num_samples`` generations of one prompt from the engine on the
embedded pair (SmolLM2-135M-Instruct and a draft), keeps the first ``n_tokens`` tokens of each, and tests their
empirical law on the cells of :func:`specresearch.experiments.stats.law_from_rows` (sequences with expected count >=
``min_expected``, the rest of each expanded prefix, a pooled tail) against:

* the **target's law**, computed by the same engine without speculation: transformers' ``generate`` with the same
  sampling settings, one step, its processed ``scores`` softmaxed in float64 (so temperature, top-k / top-p and
  repetition penalty are the engine's own);
* the **predicted law**: the toolkit's float form of the engine's encoded rule (``audit.real.single_step``) applied
  position by position to the rows the engine itself verifies with, captured from its verification function at
  each expanded prefix. For a rule the audit calls exact it is the target's law.

Each comparison gives Pearson's chi-square p-value (false-positive rate = the level, expected counts >= 5), the
total-variation distance between the measured and the compared cell laws with a bootstrap interval and the noise
floor of N samples (:func:`tv_interval`), and the smallest TV the run detects
(:func:`~specresearch.experiments.stats.detectable_tv`, level 1e-3, power 0.9). :attr:`ExecutionResult.finding`
states whether the measurement agrees with the verdict (exact: the target is not rejected at 1e-3; not exact: the
predicted law is not rejected and the target is).

Engines (:data:`ENGINES`): transformers' (the installed version) and llama.cpp's:

* ``transformers-assisted``: ``generate(assistant_model=draft, do_sample=True)``; rule ``hf-assisted``
  (``assistant_ensemble_weight`` w: its static ensemble verification, predicted lossy). ``max_new_tokens`` is
  ``n_tokens + 1`` and the assistant's confidence threshold 0 unless given, so each of the first ``n_tokens`` tokens
  is a verified draft position (transformers' default 0.4 stops drafting on unconfident tokens; the next token is
  then the target's own, which changes nothing for a lossless rule and moves a lossy one's law towards the target).
* ``transformers-lookup``: ``generate(prompt_lookup_num_tokens=k, do_sample=True)``; rule ``hf-lookup``.
* ``transformers-sampling``: transformers' ``_speculative_sampling`` called directly on the real rows of the prompt
  (a draft token sampled from the captured q, the function decides); ``n_tokens`` = 1; cheap, so N can be large.
* ``python``: any library's sampler, ``sample=callable(prompt_ids, n_tokens)``, against the target's plain law at
  temperature T (what a library claiming lossless speculative sampling promises); ``benchmarks/audit_libraries.py``
  runs the PyPI libraries through it.
* ``llamacpp-server``: llama.cpp's server (:mod:`specresearch.audit.llamacpp`; built once per machine by
  ``scripts/build_llamacpp.sh``) on the embedded GGUF, the draft a copy with its logits scaled; rule
  ``llamacpp-server`` (``synth_rates``: its synthetic acceptance, predicted lossy). The target's law is the
  server's own sampler chain's final probabilities (``post_sampling_probs``); its first token is never speculated,
  so ``n_tokens`` >= 2 and the second is the one a drafted step decides.

A generation that ends early (EOS) is padded with EOS; the laws treat EOS as absorbing alike.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from specresearch.audit.engines import engine_rule
from specresearch.audit.real import single_step
from specresearch.experiments.stats import chi_square, detectable_tv, law_from_rows

__all__ = ["ENGINES", "ExecutionResult", "LawComparison", "execute", "check_arguments", "captured_rows", "cell_probs",
           "tv_interval"]

ENGINES = {
    "transformers-assisted": "hf-assisted",
    "transformers-lookup": "hf-lookup",
    "transformers-sampling": "hf-assisted",
    "llamacpp-server": "llamacpp-server",
    "python": "token",  # any library's sampler, given as sample=...: its claim (lossless) is what is tested
}
SAMPLING_OPTIONS = ("top_k", "top_p", "repetition_penalty")  # transformers' generate arguments, applied to both laws
ENGINE_OPTIONS = {
    "transformers-assisted": ("num_assistant_tokens", "assistant_confidence_threshold", "assistant_ensemble_weight"),
    "transformers-lookup": ("prompt_lookup_num_tokens", "max_matching_ngram_size"),
    "transformers-sampling": ("assistant_ensemble_weight",),
    "llamacpp-server": ("top_k", "top_p", "min_p", "synth_rates", "draft_max", "draft_scale"),
    "python": ("sample", "name", "version"),
}
LEVEL = 1e-3  # the level the finding uses (false-positive rate of each chi-square test)
_ROW_BATCH = 32
_BOOTSTRAP = 400


@dataclass(frozen=True)
class LawComparison:
    """The measured cell law against one law: chi-square p-value, TV (measured vs law), its bootstrap 95% interval and
    the noise floor of N samples (:func:`tv_interval`), and the TV between this law and the target's (0 for the
    target itself)."""

    p_value: float
    tv: float
    tv_interval: tuple[float, float]
    tv_floor: float
    tv_from_target: float


@dataclass(frozen=True)
class ExecutionResult:
    """What :func:`execute` measured. ``cells`` are the law's cells (:func:`law_from_rows`), then one for sequences
    the target cannot emit; ``counts`` the generations in each."""

    engine: str
    rule: str
    verdict: str  # the audit's: "exact" or "not exact"
    options: dict
    temperature: float
    n_tokens: int
    num_samples: int
    seed: int
    cells: tuple
    counts: tuple[int, ...]
    target_probs: tuple[float, ...]
    predicted_probs: tuple[float, ...]
    target: LawComparison
    predicted: LawComparison
    detectable_tv: float  # the smallest TV between cell laws this N detects (level 1e-3, power 0.9)
    seconds: float  # the engine's generations
    version: str  # the engine's version
    draft_tv_intended: float | None = None  # TV between the q the engine verifies with and the draft's own law
    notes: tuple[str, ...] = field(default=())

    @property
    def finding(self) -> str:
        """Whether the measured law agrees with the audit's verdict, in one sentence."""
        keeps = self.target.p_value > LEVEL
        if self.verdict == "exact":
            return ("agrees: lossless as the audit says" if keeps else
                    f"FINDING: the audit says exact, the measured law rejects the target's (p = {self.target.p_value:.2g})")
        if self.predicted.p_value > LEVEL and not keeps:
            return "agrees: lossy as the audit predicts (the predicted law holds, the target's is rejected)"
        if self.predicted.p_value <= LEVEL:
            return f"FINDING: the measured law rejects the predicted one (p = {self.predicted.p_value:.2g})"
        return (f"undecided: the run does not tell the predicted law from the target's (their TV "
                f"{self.predicted.tv_from_target:.3f}, detectable {self.detectable_tv:.3f}); raise num_samples")

    def as_record(self) -> dict:
        """A JSON-ready row (cells as strings)."""
        row = {key: getattr(self, key) for key in ("engine", "rule", "verdict", "options", "temperature", "n_tokens",
                                                   "num_samples", "seed", "counts", "target_probs", "predicted_probs",
                                                   "detectable_tv", "seconds", "version", "draft_tv_intended", "notes")}
        row["cells"] = [repr(cell) for cell in self.cells]
        row["target"], row["predicted"] = vars(self.target), vars(self.predicted)
        row["finding"] = self.finding
        return row

    def __str__(self) -> str:
        lines = [f"{self.engine} ({self.rule}, audit: {self.verdict}; {self.version}) options {self.options or 'none'}, "
                 f"T = {self.temperature}, first {self.n_tokens} token(s), N = {self.num_samples}, {len(self.cells)} cells",
                 f"  vs target:    p = {self.target.p_value:.3g}, TV {self.target.tv:.4f} "
                 f"[{self.target.tv_interval[0]:.4f}, {self.target.tv_interval[1]:.4f}] (noise floor {self.target.tv_floor:.4f})",
                 f"  vs predicted: p = {self.predicted.p_value:.3g}, TV {self.predicted.tv:.4f} "
                 f"[{self.predicted.tv_interval[0]:.4f}, {self.predicted.tv_interval[1]:.4f}] "
                 f"(predicted vs target: {self.predicted.tv_from_target:.4f})",
                 f"  detects TV >= {self.detectable_tv:.4f}; {self.finding}"]
        if self.draft_tv_intended is not None:
            lines.append(f"  the q it verifies with is TV {self.draft_tv_intended:.4f} from the draft's own law")
        return "\n".join(lines + [f"  note: {note}" for note in self.notes])


def tv_interval(counts, probs, *, seed: int = 0, repeats: int = _BOOTSTRAP) -> tuple[float, tuple[float, float], float]:
    """TV between the empirical law of ``counts`` and ``probs``; its 95% basic-bootstrap interval (multinomial
    resamples of the counts; the empirical TV is biased upwards, the interval corrects for it and is clipped at 0);
    and the noise floor: the 95th percentile of the TV of N draws from ``probs`` itself, what a run of this N shows
    where there is no deviation at all (about sqrt(cells / N) / 2)."""
    counts, probs = np.asarray(counts, dtype=float), np.asarray(probs, dtype=float)
    n = int(counts.sum())
    tv = 0.5 * float(np.abs(counts / n - probs).sum())
    rng = np.random.default_rng(seed)
    spread = 0.5 * np.abs(rng.multinomial(n, counts / n, size=repeats) / n - probs).sum(1)
    low, high = (max(0.0, 2 * tv - float(np.quantile(spread, q))) for q in (0.975, 0.025))
    floor = 0.5 * np.abs(rng.multinomial(n, probs / probs.sum(), size=repeats) / n - probs).sum(1)
    return tv, (low, high), float(np.quantile(floor, 0.95))


def _compare(counts, probs, target_probs, seed: int) -> LawComparison:
    counts, probs = np.asarray(counts, dtype=float), np.asarray(probs, dtype=float)
    if np.any((probs <= 0) & (counts > 0)):  # a sequence this law cannot give was generated
        p_value = 0.0
    else:
        keep = probs > 0
        p_value = chi_square(counts[keep], probs[keep] / probs[keep].sum())[2]
    tv, interval, floor = tv_interval(counts, probs, seed=seed)
    return LawComparison(p_value, tv, interval, floor, 0.5 * float(np.abs(probs - np.asarray(target_probs)).sum()))


def cell_probs(law, rows: dict) -> tuple[list[float], float]:
    """The probabilities of ``law``'s cells under another law given by its next-token ``rows`` (prefix -> [V]
    float64) at every prefix ``law`` expanded, and the mass it puts on tokens the target's rows exclude there.
    -> (per cell, impossible mass)."""
    probs, impossible = [0.0] * len(law.cells), 0.0
    children: dict[tuple, list[int]] = {}
    for sequence in law.big:
        children.setdefault(sequence[:-1], []).append(sequence[-1])
    reach = {(): 1.0}
    for prefix in sorted(law.rows, key=len):
        mass, row, excluded = reach.get(prefix, 0.0), rows[prefix], law.rows[prefix] == 0
        outside = mass * float(row[excluded].sum())
        rest = mass - outside
        for token in children.get(prefix, []):
            child = mass * float(row[token])
            rest -= child
            if len(prefix) + 1 == law.k:
                probs[law.lookup[("seq", prefix + (token,))]] += child
            else:
                reach[prefix + (token,)] = child
        probs[law.lookup[("rest", prefix)]] += max(rest, 0.0)
        impossible += outside
    return probs, impossible


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


def _absorbing(next_rows, eos: int, vocab: int):
    """``next_rows`` with EOS absorbing: after a prefix ending in EOS, EOS again (a generation that stopped)."""
    def rows(prefixes):
        live = [p for p in prefixes if not p or p[-1] != eos]
        computed = iter(next_rows(live)) if live else iter(())
        one_hot = torch.zeros(vocab, dtype=torch.float64)
        one_hot[eos] = 1.0
        return torch.stack([one_hot if p and p[-1] == eos else next(computed) for p in prefixes])
    return rows


def _padded(tokens: list[int], n_tokens: int, eos: int) -> list[int]:
    tokens = list(tokens)[:n_tokens]
    return tokens + [eos] * (n_tokens - len(tokens))


class _Transformers:
    """transformers' generate on the target (and the draft), one prompt, batch 1 as its assisted decoding needs."""

    def __init__(self, engine, target_model, draft_model, prompt: list[int], eos: int, temperature: float, options: dict,
                 n_tokens: int):
        import transformers

        self.engine, self.target, self.draft, self.prompt, self.eos = engine, target_model, draft_model, list(prompt), eos
        self.vocab = target_model.config.vocab_size
        self.sampling = dict(do_sample=True, temperature=temperature, top_k=options.get("top_k", 0),
                             pad_token_id=eos, **{k: options[k] for k in SAMPLING_OPTIONS[1:] if k in options})
        self.extra = {k: options[k] for k in ENGINE_OPTIONS[engine] if k in options}
        self.weight = options.get("assistant_ensemble_weight")
        self.version = f"transformers {transformers.__version__}"
        self.n_tokens, self.notes, self.draft_tv = n_tokens, [], None
        if engine == "transformers-assisted":
            draft_model.generation_config.assistant_confidence_threshold = self.extra.pop("assistant_confidence_threshold", 0.0)
            draft_model.generation_config.num_assistant_tokens = self.extra.pop("num_assistant_tokens", n_tokens)
            draft_model.generation_config.num_assistant_tokens_schedule = "constant"

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None

    def _ids(self, prefixes) -> torch.Tensor:
        return torch.tensor([self.prompt + list(p) for p in prefixes], dtype=torch.long, device=self.target.device)

    @torch.no_grad()
    def rows(self, model, prefixes) -> torch.Tensor:
        """The law ``model`` samples its next token from after each prefix, under the run's settings. -> [n, V]."""
        out = []
        for start in range(0, len(prefixes), _ROW_BATCH):
            ids = self._ids(prefixes[start:start + _ROW_BATCH])
            scores = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, output_scores=True,
                                    return_dict_in_generate=True, **self.sampling).scores[0]
            out.append(scores.double().softmax(-1).cpu())
        return torch.cat(out)

    def target_rows(self, prefixes) -> torch.Tensor:
        return self.rows(self.target, prefixes)

    def predicted_rows(self, law) -> dict | None:
        """The encoded rule's next-token law at every prefix ``law`` expanded (None: the rule is exact), from the
        rows transformers verifies with; records how far its q is from the draft's own law."""
        if self.engine == "transformers-lookup":
            return None
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

    @torch.no_grad()
    def verified_rows(self, prefixes) -> tuple[torch.Tensor, torch.Tensor]:
        """(q, p) ``[n, V]`` float64: the rows transformers' assisted decoding verifies the first draft token after
        each prefix with (:func:`captured_rows`, one assisted step per prefix)."""
        qs, ps = [], []
        for prefix in prefixes:
            ids = self._ids([prefix])
            with captured_rows() as calls:
                self.target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=2,
                                     assistant_model=self.draft, **self.sampling, **self.extra)
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
        assistant = self.draft if self.engine == "transformers-assisted" else None
        for _ in range(num_samples):
            out = self.target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=self.n_tokens + 1,
                                       assistant_model=assistant, **self.sampling, **self.extra)
            yield _padded(out[0, ids.shape[1]:].tolist(), self.n_tokens, self.eos)

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


class _LlamaCpp:
    """llama.cpp's server (:mod:`specresearch.audit.llamacpp`) on the embedded GGUF with a scaled copy as the draft."""

    def __init__(self, prompt: list[int], eos: int, vocab: int, temperature: float, options: dict, n_tokens: int,
                 seed: int):
        from specresearch.audit.llamacpp import SAMPLING, write_scaled_draft
        from specresearch.models.embedded import gguf_path
        from specresearch.paths import cache_dir

        self.prompt, self.eos, self.vocab, self.n_tokens, self.seed = list(prompt), eos, vocab, n_tokens, seed
        self.sampling = {k: options.get(k, SAMPLING[k]) for k in ("top_k", "top_p", "min_p")} | {"temperature": temperature}
        if not isinstance(self.sampling["top_k"], int) or not 1 <= self.sampling["top_k"] <= 200:
            raise ValueError("llamacpp-server needs top_k in 1..200 (its final probabilities are read back as the "
                             f"top_k most likely tokens), got {self.sampling['top_k']!r}")
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
        scale = float(options.get("draft_scale", 1.5))
        draft = write_scaled_draft(gguf_path(), cache_dir("llamacpp", f"draft-scaled-{scale:g}.gguf"), scale)
        self.server_args = (gguf_path(), draft, args)
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
            reply = self.server.complete(self.prompt, n_predict=self.n_tokens + 1, seed=self.seed * 1_000_003 + i,
                                         return_tokens=True, cache_prompt=True, **self.sampling)
            drafted += reply.get("timings", {}).get("draft_n", 0) or 0
            accepted += reply.get("timings", {}).get("draft_n_accepted", 0) or 0
            yield _padded(reply["tokens"], self.n_tokens, self.eos)
        if not drafted:
            raise RuntimeError("llama-server drafted no token in the run: its speculative decoding was off")
        self.notes.append(f"the server drafted {drafted} tokens in the run and kept {accepted} (its timings)")


class _Python:
    """A library's own sampler, ``sample(prompt_ids, n_tokens) -> tokens`` (at least ``n_tokens`` new ones), against
    the target's plain law softmax(logits / T) from one uncached forward of the same model: what a library that
    claims lossless speculative sampling at temperature T promises."""

    def __init__(self, target_model, prompt: list[int], eos: int, temperature: float, options: dict, n_tokens: int):
        self.target, self.prompt, self.eos, self.temperature, self.n_tokens = target_model, list(prompt), eos, temperature, n_tokens
        self.sample = options["sample"]
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
            logits = self.target(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[:, -1]
            out.append((logits.double() / self.temperature).softmax(-1).cpu())
        return torch.cat(out)

    def predicted_rows(self, law) -> dict | None:
        return None

    def draws(self, num_samples: int):
        for _ in range(num_samples):
            yield _padded(self.sample(list(self.prompt), self.n_tokens), self.n_tokens, self.eos)


def check_arguments(engine: str, n_tokens: int, num_samples: int, temperature: float, options: dict) -> None:
    """``ValueError`` for arguments :func:`execute` refuses, before anything loads."""
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {sorted(ENGINES)}, got {engine!r}")
    own = engine.startswith("llamacpp") or engine == "python"
    allowed = ENGINE_OPTIONS[engine] if own else SAMPLING_OPTIONS + ENGINE_OPTIONS[engine]
    unknown = set(options) - set(allowed)
    if unknown:
        raise ValueError(f"{engine} takes options {list(allowed)}, got {sorted(unknown)}")
    if not isinstance(n_tokens, int) or not 1 <= n_tokens <= 4:
        raise ValueError(f"n_tokens must be an int in 1..4, got {n_tokens!r}")
    if engine == "transformers-sampling" and n_tokens != 1:
        raise ValueError("transformers-sampling calls the verification function on the prompt's rows: n_tokens=1")
    if engine.startswith("llamacpp") and n_tokens < 2:
        raise ValueError(f"{engine} samples its first token from the target alone: n_tokens >= 2")
    if not isinstance(num_samples, int) or num_samples < 20:
        raise ValueError(f"num_samples must be an int >= 20, got {num_samples!r}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0 (the engines' sampling mode), got {temperature!r}")
    if engine == "python" and not callable(options.get("sample")):
        raise ValueError("engine 'python' needs sample=callable(prompt_ids, n_tokens) -> token ids")
    if engine == "transformers-lookup" and "prompt_lookup_num_tokens" not in options:
        raise ValueError("transformers-lookup needs prompt_lookup_num_tokens (e.g. 3)")


def _prompt_ids(prompt, tokenizer) -> list[int]:
    if isinstance(prompt, str):
        from specresearch.engine.prompts import encode_chat

        return encode_chat([prompt], tokenizer)[0].tolist()
    return [int(t) for t in prompt]


def _verdict(engine: str, options: dict) -> str:
    lossy = options.get("assistant_ensemble_weight") is not None or options.get("synth_rates") is not None
    return "not exact" if lossy else "exact"


def execute(engine: str, *, prompt, n_tokens: int = 2, num_samples: int, temperature: float = 1.0, seed: int = 0,
            min_expected: float = 5.0, target=None, draft=None, tokenizer=None, progress: bool = True,
            **options) -> ExecutionResult:
    """Run ``engine``'s own implementation ``num_samples`` times on ``prompt`` and test the law of its first
    ``n_tokens`` tokens (module docstring).

    Args:
        engine: a name of :data:`ENGINES`.
        prompt: a string (chat-templated as the user's turn) or token ids.
        target, draft, tokenizer: transformers models (``PreTrainedModel``) and the tokenizer; default the embedded
            SmolLM2-135M-Instruct in float32 on the CPU and the shipped draft ``v8k-4l`` (same tokenizer). The
            llama.cpp engines load the embedded GGUF themselves and use ``target`` for its EOS and vocabulary only.
        seed: seeds torch's global generator, which transformers samples from, before the generations (llama.cpp:
            request i carries seed ``seed * 1000003 + i``).
        min_expected: a cell's least expected count (:func:`law_from_rows`).
        options: the engine's settings (``SAMPLING_OPTIONS`` and ``ENGINE_OPTIONS[engine]``), passed to
            ``generate`` as given; ``top_k`` defaults to 0 there (transformers' own default is 50). For llama.cpp
            its request's ``top_k`` / ``top_p`` / ``min_p`` (default the server's 40 / 0.95 / 0.05), ``synth_rates``,
            ``draft_max`` (3) and ``draft_scale`` (1.5).
    """
    check_arguments(engine, n_tokens, num_samples, temperature, options)
    if target is None:
        from specresearch.drafts.registry import load_pair

        target_lm, draft_lm, tokenizer = load_pair(draft="v8k-4l", device="cpu", skinny_linear=False)
        target, draft = target_lm.model, draft if draft is not None else draft_lm.model
    if draft is None and engine in ("transformers-assisted", "transformers-sampling"):
        raise ValueError(f"{engine} needs a draft model (the assistant)")
    if tokenizer is None and isinstance(prompt, str):
        raise ValueError("a string prompt needs the tokenizer (or pass token ids)")
    eos = target.generation_config.eos_token_id
    eos = int(eos if isinstance(eos, int) else eos[0])
    ids, vocab = _prompt_ids(prompt, tokenizer), target.config.vocab_size
    if engine.startswith("llamacpp"):
        run = _LlamaCpp(ids, eos, vocab, temperature, options, n_tokens, seed)
    elif engine == "python":
        run = _Python(target, ids, eos, temperature, options, n_tokens)
    else:
        run = _Transformers(engine, target, draft, ids, eos, temperature, options, n_tokens)
    from tqdm.auto import tqdm

    with run:
        law = law_from_rows(_absorbing(run.target_rows, eos, vocab), ids, sampling=None, k=n_tokens,
                            num_samples=num_samples, min_expected=min_expected)
        target_probs = list(law.probs) + [0.0]
        rows = run.predicted_rows(law)
        if rows is None:
            predicted_probs = target_probs
        else:
            predicted, impossible = cell_probs(law, rows)
            predicted_probs = predicted + [impossible]
        counts = [0] * (len(law.cells) + 1)
        if seed is not None:
            torch.manual_seed(seed)
        start = time.perf_counter()
        for sequence in tqdm(run.draws(num_samples), total=num_samples, desc=engine, disable=not progress, unit="run"):
            cell = law.index(sequence)
            counts[len(law.cells) if cell is None else cell] += 1
        seconds = time.perf_counter() - start
    if not counts[-1] and not predicted_probs[-1]:  # no cell for the impossible then
        counts, target_probs, predicted_probs = counts[:-1], target_probs[:-1], predicted_probs[:-1]
    cells = law.cells + (("outside the target's support",),) * (len(counts) - len(law.cells))
    return ExecutionResult(
        engine, ENGINES[engine], _verdict(engine, options), {k: v for k, v in options.items() if k != "sample"},
        temperature, n_tokens, num_samples, seed,
        cells, tuple(counts), tuple(target_probs), tuple(predicted_probs),
        _compare(counts, target_probs, target_probs, seed), _compare(counts, predicted_probs, target_probs, seed + 1),
        detectable_tv(num_samples, len(cells)), seconds, run.version, run.draft_tv, tuple(run.notes))
