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

Engines (:data:`ENGINES`), all transformers' (the installed version):

* ``transformers-assisted``: ``generate(assistant_model=draft, do_sample=True)``; rule ``hf-assisted``
  (``assistant_ensemble_weight`` w: its static ensemble verification, predicted lossy). ``max_new_tokens`` is
  ``n_tokens + 1`` and the assistant's confidence threshold 0 unless given, so each of the first ``n_tokens`` tokens
  is a verified draft position (transformers' default 0.4 stops drafting on unconfident tokens; the next token is
  then the target's own, which changes nothing for a lossless rule and moves a lossy one's law towards the target).
* ``transformers-lookup``: ``generate(prompt_lookup_num_tokens=k, do_sample=True)``; rule ``hf-lookup``.
* ``transformers-sampling``: transformers' ``_speculative_sampling`` called directly on the real rows of the prompt
  (a draft token sampled from the captured q, the function decides); ``n_tokens`` = 1; cheap, so N can be large.

A generation that ends early (EOS) is padded with EOS; the laws treat EOS as absorbing alike.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from specresearch.audit.real import single_step
from specresearch.experiments.stats import chi_square, detectable_tv, law_from_rows

__all__ = ["ENGINES", "ExecutionResult", "LawComparison", "execute", "captured_rows", "cell_probs", "tv_interval"]

ENGINES = {
    "transformers-assisted": "hf-assisted",
    "transformers-lookup": "hf-lookup",
    "transformers-sampling": "hf-assisted",
}
SAMPLING_OPTIONS = ("top_k", "top_p", "repetition_penalty")  # transformers' generate arguments, applied to both laws
ENGINE_OPTIONS = {
    "transformers-assisted": ("num_assistant_tokens", "assistant_confidence_threshold", "assistant_ensemble_weight"),
    "transformers-lookup": ("prompt_lookup_num_tokens", "max_matching_ngram_size"),
    "transformers-sampling": ("assistant_ensemble_weight",),
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


class _Transformers:
    """transformers' generate on the target (and the draft), one prompt, batch 1 as its assisted decoding needs."""

    def __init__(self, target_model, draft_model, prompt: list[int], eos: int, temperature: float, options: dict):
        self.target, self.draft, self.prompt, self.eos = target_model, draft_model, list(prompt), eos
        self.sampling = dict(do_sample=True, temperature=temperature, top_k=options.get("top_k", 0),
                             pad_token_id=eos, **{k: options[k] for k in SAMPLING_OPTIONS[1:] if k in options})

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

    def absorbing(self, next_rows):
        """``next_rows`` with EOS absorbing: after a prefix ending in EOS, EOS again."""
        def rows(prefixes):
            live = [p for p in prefixes if not p or p[-1] != self.eos]
            computed = iter(next_rows(live)) if live else iter(())
            vocab = None
            result = []
            for p in prefixes:
                if p and p[-1] == self.eos:
                    result.append(None)
                else:
                    result.append(next(computed))
                    vocab = result[-1].shape[0]
            vocab = vocab or self.target.config.vocab_size
            one_hot = torch.zeros(vocab, dtype=torch.float64)
            one_hot[self.eos] = 1.0
            return torch.stack([one_hot if r is None else r for r in result])
        return rows

    @torch.no_grad()
    def generate(self, n_tokens: int, extra: dict, assistant: bool) -> list[int]:
        ids = self._ids([()])
        out = self.target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n_tokens + 1,
                                   assistant_model=self.draft if assistant else None, **self.sampling, **extra)
        tokens = out[0, ids.shape[1]:].tolist()[:n_tokens]
        return tokens + [self.eos] * (n_tokens - len(tokens))

    @torch.no_grad()
    def verified_rows(self, prefixes, extra: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(q, p) ``[n, V]`` float64: the rows transformers' assisted decoding verifies the first draft token after
        each prefix with (:func:`captured_rows`, one assisted step per prefix)."""
        qs, ps = [], []
        for prefix in prefixes:
            ids = self._ids([prefix])
            with captured_rows() as calls:
                self.target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=2,
                                     assistant_model=self.draft, **self.sampling, **extra)
            if not calls:
                raise RuntimeError(f"transformers verified no draft after prefix {prefix}: nothing to capture")
            qs.append(calls[0][0][0, 0].double().softmax(-1).cpu())
            ps.append(calls[0][1][0, 0].double().softmax(-1).cpu())
        return torch.stack(qs), torch.stack(ps)


def _check(engine: str, n_tokens: int, num_samples: int, temperature: float, options: dict) -> None:
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {sorted(ENGINES)}, got {engine!r}")
    unknown = set(options) - set(SAMPLING_OPTIONS) - set(ENGINE_OPTIONS[engine])
    if unknown:
        raise ValueError(f"{engine} takes options {list(SAMPLING_OPTIONS + ENGINE_OPTIONS[engine])}, got {sorted(unknown)}")
    if not isinstance(n_tokens, int) or not 1 <= n_tokens <= 4:
        raise ValueError(f"n_tokens must be an int in 1..4, got {n_tokens!r}")
    if engine == "transformers-sampling" and n_tokens != 1:
        raise ValueError("transformers-sampling calls the verification function on the prompt's rows: n_tokens=1")
    if not isinstance(num_samples, int) or num_samples < 20:
        raise ValueError(f"num_samples must be an int >= 20, got {num_samples!r}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0 (the engines' sampling mode), got {temperature!r}")
    if engine == "transformers-lookup" and "prompt_lookup_num_tokens" not in options:
        raise ValueError("transformers-lookup needs prompt_lookup_num_tokens (e.g. 3)")


def _prompt_ids(prompt, tokenizer) -> list[int]:
    if isinstance(prompt, str):
        from specresearch.engine.prompts import encode_chat

        return encode_chat([prompt], tokenizer)[0].tolist()
    return [int(t) for t in prompt]


def execute(engine: str, *, prompt, n_tokens: int = 2, num_samples: int, temperature: float = 1.0, seed: int = 0,
            min_expected: float = 5.0, target=None, draft=None, tokenizer=None, progress: bool = True,
            **options) -> ExecutionResult:
    """Run ``engine``'s own implementation ``num_samples`` times on ``prompt`` and test the law of its first
    ``n_tokens`` tokens (module docstring).

    Args:
        engine: a name of :data:`ENGINES`.
        prompt: a string (chat-templated as the user's turn) or token ids.
        target, draft, tokenizer: transformers models (``PreTrainedModel``) and the tokenizer; default the embedded
            SmolLM2-135M-Instruct in float32 on the CPU and the shipped draft ``v8k-4l`` (same tokenizer).
        seed: seeds torch's global generator, which transformers samples from, before the generations.
        min_expected: a cell's least expected count (:func:`law_from_rows`).
        options: the engine's settings (``SAMPLING_OPTIONS`` and ``ENGINE_OPTIONS[engine]``), passed to
            ``generate`` as given; ``top_k`` defaults to 0 (transformers' own default is 50).
    """
    import transformers

    _check(engine, n_tokens, num_samples, temperature, options)
    if target is None:
        from specresearch.drafts.registry import load_pair

        target_lm, draft_lm, tokenizer = load_pair(draft="v8k-4l", device="cpu", skinny_linear=False)
        target, draft = target_lm.model, draft if draft is not None else draft_lm.model
    if draft is None and engine != "transformers-lookup":
        raise ValueError(f"{engine} needs a draft model (the assistant)")
    if tokenizer is None and isinstance(prompt, str):
        raise ValueError("a string prompt needs the tokenizer (or pass token ids)")
    rule = ENGINES[engine]
    weight = options.get("assistant_ensemble_weight")
    verdict = "not exact" if weight is not None else "exact"
    eos = int(target.generation_config.eos_token_id if isinstance(target.generation_config.eos_token_id, int)
              else target.generation_config.eos_token_id[0])
    run = _Transformers(target, draft, _prompt_ids(prompt, tokenizer), eos, temperature, options)
    extra = {k: options[k] for k in ENGINE_OPTIONS[engine] if k in options}
    notes = []
    if engine == "transformers-assisted":
        extra.setdefault("assistant_confidence_threshold", 0.0)
        extra.setdefault("num_assistant_tokens", n_tokens)
        draft.generation_config.assistant_confidence_threshold = extra.pop("assistant_confidence_threshold")
        draft.generation_config.num_assistant_tokens = extra.pop("num_assistant_tokens")
        draft.generation_config.num_assistant_tokens_schedule = "constant"

    law = law_from_rows(run.absorbing(lambda prefixes: run.rows(target, prefixes)), run.prompt, sampling=None,
                        k=n_tokens, num_samples=num_samples, min_expected=min_expected)
    target_probs = list(law.probs) + [0.0]
    draft_tv = None
    predicted_probs = target_probs
    if engine != "transformers-lookup":
        live = [s for s in law.rows if not s or s[-1] != eos] if weight is not None else [()]
        q, p = run.verified_rows(live, extra)
        draft_tv = 0.5 * float((q[0] - run.rows(draft, [()])[0]).abs().sum())
        if draft_tv > 1e-4:
            notes.append("transformers verifies with a q other than the draft's own sampling law at these settings: "
                         "lossless still, but the draft it runs is another one (draft_tv_intended)")
    if weight is not None:
        r, _ = single_step(rule, p, q, num_drafts=1, ensemble_weight=weight)
        rows = dict(law.rows) | dict(zip(live, r))  # after an EOS: the law's absorbing row
        predicted, impossible = cell_probs(law, rows)
        predicted_probs = predicted + [impossible]

    counts = [0] * (len(law.cells) + 1)
    if seed is not None:
        torch.manual_seed(seed)
    start = time.perf_counter()
    for sequence in _draws(engine, run, n_tokens, num_samples, extra, progress):
        cell = law.index(sequence)
        counts[len(law.cells) if cell is None else cell] += 1
    seconds = time.perf_counter() - start
    if not counts[-1] and not predicted_probs[-1]:  # no cell for the impossible then
        counts, target_probs, predicted_probs = counts[:-1], target_probs[:-1], predicted_probs[:-1]
    cells = law.cells + (("outside the target's support",),) * (len(counts) - len(law.cells))
    return ExecutionResult(
        engine, rule, verdict, dict(options), temperature, n_tokens, num_samples, seed, cells, tuple(counts),
        tuple(target_probs), tuple(predicted_probs), _compare(counts, target_probs, target_probs, seed),
        _compare(counts, predicted_probs, target_probs, seed + 1), detectable_tv(num_samples, len(cells)),
        seconds, f"transformers {transformers.__version__}", draft_tv, tuple(notes))


def _draws(engine: str, run: _Transformers, n_tokens: int, num_samples: int, extra: dict, progress: bool):
    """The engine's generations, one token list each."""
    from tqdm.auto import tqdm

    bar = tqdm(total=num_samples, desc=engine, disable=not progress, unit="run")
    if engine == "transformers-sampling":
        from transformers.generation.utils import _speculative_sampling

        with captured_rows() as calls:
            run.generate(1, {}, assistant=True)
        q_logits, p_logits = calls[0][0][:, :1], calls[0][1][:, :1]
        new_logits = torch.cat([p_logits, p_logits], 1)  # the bonus row is never read for the first token
        drafts = torch.multinomial(q_logits[0, 0].double().softmax(-1), num_samples, replacement=True)
        prompt = torch.tensor([run.prompt], dtype=torch.long)
        for x in drafts.tolist():
            candidate = torch.cat([prompt, torch.tensor([[x]])], 1)
            tokens, _ = _speculative_sampling(candidate, q_logits, 1, new_logits, extra.get("assistant_ensemble_weight"))
            bar.update()
            yield [int(tokens[0, 0])]
    else:
        for _ in range(num_samples):
            bar.update()
            yield run.generate(n_tokens, extra, assistant=engine == "transformers-assisted")
    bar.close()
