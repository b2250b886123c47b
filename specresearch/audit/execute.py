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
* ``transformers-mtp``: ``generate(use_mtp=True, do_sample=True)`` on a ``target`` loaded from a checkpoint with MTP
  layers (``drafts.mtp``; no draft model): the layers draft one token a step each, verified by ``_speculative_sampling``
  (rule ``hf-assisted``); its first token is the target's own, so ``n_tokens`` >= 2. The run first checks that one
  generation does verify MTP drafts (its notes say how many).
* ``transformers-sampling``: transformers' ``_speculative_sampling`` called directly on the real rows of the prompt
  (a draft token sampled from the captured q, the function decides); ``n_tokens`` = 1; cheap, so N can be large.
* ``python``: any library's sampler, ``sample=callable(prompt_ids, n_tokens)``, against the target's plain law at
  temperature T (what a library claiming lossless speculative sampling promises); ``benchmarks/audit_libraries.py``
  runs the PyPI libraries through it. With a Ray executor give ``sampler=``, a picklable recipe that builds the
  sampler in each worker, instead; a library run with sampling settings gives the law they define (``target_law=``).
* ``transformers-gemma4-assistant``: ``generate(assistant_model=assistant, do_sample=True)`` with a Gemma 4 assistant
  (``Gemma4AssistantForCausalLM``; the target a Gemma 4 model, whose KV states it shares): transformers 5.25's
  ``SinglePositionMultiTokenCandidateGenerator`` drafts the assistant's argmax and hands its logits to
  ``_speculative_sampling`` as q, the rule ``hf-assisted`` with ``assistant="greedy"`` (predicted lossy). Its first
  token is the target's own (``n_tokens`` >= 2); the prediction reads the rows transformers verifies with after each
  expanded prefix, the generation started one token short with the prefix's last token forced.
* ``transformers-dflash``: ``generate(assistant_model=assistant, speculation_type="dflash", do_sample=True)`` with a
  DFlash block drafter (``MuseGlimmerAssistantModel``, reading the target's hidden states at its
  ``target_layer_ids``): transformers 5.25's ``DFlashTokenCandidateGenerator`` drafts ``block_size - 1`` tokens a
  step from the processed logits it also hands on as q (rule ``hf-assisted``, exact); its first token is the
  target's own (``n_tokens`` >= 2), and the run first checks that a generation verifies DFlash drafts.
* ``transformers-usd``: ``generate(assistant_model=draft, tokenizer=..., assistant_tokenizer=..., do_sample=True)``,
  a draft of another vocabulary (transformers 5.25's ``UniversalSpeculativeDecodingGenerator``: drafts on the shared
  tokens, rule ``hf-assisted``). Where the draft has tokens the target lacks, transformers prunes its head and hands
  on as q the draft's law on other tokens' ids (:mod:`specresearch.audit.vocabularies`): predicted lossy, the draft's
  own law computed from an untouched copy of it. One process only (the permutation is a hash order drawn in it).
* ``transformers-early-exit``: ``generate(assistant_early_exit=k, do_sample=True)``: transformers'
  ``EarlyExitCandidateGenerator`` drafts with the target's first k layers, its final norm and head (LayerSkip's
  self-speculation; no draft model), verified by ``_speculative_sampling`` (rule ``hf-assisted``, exact).
* ``llamacpp-server``: llama.cpp's server (:mod:`specresearch.audit.llamacpp`; built once per machine by
  ``scripts/build_llamacpp.sh``) on the embedded GGUF, the draft a copy with its logits scaled; rule
  ``llamacpp-server`` (``synth_rates``: its synthetic acceptance, predicted lossy). The target's law is the
  server's own sampler chain's final probabilities (``post_sampling_probs``); its first token is never speculated,
  so ``n_tokens`` >= 2 and the second is the one a drafted step decides.
* ``llamacpp-example``: llama.cpp's ``llama-speculative`` example (one process a generation), ``n_parallel``
  branches verified in a random order; rule ``llamacpp-example`` (not exact: its draft is the argmax). ``n_tokens``
  = 2: its first token is the target's own, the second the first drafted position (later ones depend on how the
  step ended). Also held against the rule with the textbook residual p - q (``alternatives``).
* ``llamacpp-simple``: llama.cpp's ``llama-speculative-simple`` example, the server's loop (sample the target,
  compare with the draft's token); rule ``llamacpp-server`` (exact); its first token is already drafted for.

A generation that ends early (EOS) is padded with EOS; the laws treat EOS as absorbing alike.

With ``executor=`` (``experiments.executor``: ``--executor ray`` on the command line) the N generations run as seed
blocks of ``batch_size`` (each block seeds its own draws, ``stats.block_seeds``), each in a worker that builds the
models once from ``models`` (default: :func:`default_pair`); the counts then depend on the seed and the block size,
not on the number of workers. ``blocks_file=`` keeps each finished block in a JSON-lines file (:class:`BlockStore`): a
run of hours stopped anywhere resumes from its last block and counts what one uninterrupted run would.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from specresearch.audit.blocks import BlockStore, block_machine, block_notes
from specresearch.audit.runners import (
    ENGINE_OPTIONS,
    PYTHON_SETTINGS,
    SAMPLING_OPTIONS,
    LlamaCppRun,
    LlamaSpeculativeRun,
    PythonRun,
    TransformersRun,
    absorbing,
    captured_rows,
    quiet_transformers,
)
from specresearch.experiments.records import git_commit
from specresearch.experiments.stats import chi_square, detectable_tv, law_from_rows

__all__ = ["ENGINES", "ExecutionResult", "LawComparison", "execute", "check_arguments", "default_pair", "captured_rows", "cell_probs",
           "tv_interval", "compare_counts", "DrawBlock", "draw_block", "timed_block", "TinyRun", "record_tiny_runs",
           "tiny_runs_main"]

ENGINES = {
    "transformers-assisted": "hf-assisted",
    "transformers-lookup": "hf-lookup",
    "transformers-sampling": "hf-assisted",
    "transformers-mtp": "hf-assisted",  # the MTP layers' draft, verified by the same _speculative_sampling
    "transformers-gemma4-assistant": "hf-assisted",  # assistant="greedy": argmax drafts, their softmax passed as q
    "transformers-dflash": "hf-assisted",  # a block drafted from the processed logits it hands on as q
    "transformers-usd": "hf-assisted",  # across vocabularies: drafts on the shared tokens; q permuted where it prunes
    "transformers-early-exit": "hf-assisted",  # the target's first layers and its head draft (LayerSkip's self-drafting)
    "llamacpp-server": "llamacpp-server",
    "llamacpp-example": "llamacpp-example",
    "llamacpp-simple": "llamacpp-server",  # the same loop as the server's (common_sampler_sample_and_accept_n)
    "python": "token",  # any library's sampler, given as sample=...: its claim (lossless) is what is tested
}
LEVEL = 1e-3  # the level the finding uses (false-positive rate of each chi-square test)
_BOOTSTRAP = 400
_CALLABLES = ("sample", "sampler", "target_law", "predicted_law")  # the python engine's callables: not settings
OUTSIDE = ("outside the target's support",)  # the cell of the sequences the target cannot emit


@dataclass(frozen=True)
class LawComparison:
    """The measured cell law against one law: chi-square p-value, TV (measured vs law), the bias-corrected bootstrap
    95% interval of the true TV (it can lie below the measured TV, which noise biases upwards) and the noise floor of N
    samples (:func:`tv_interval`), and the TV between this law and the target's (0 for the
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
    alternatives: dict = field(default_factory=dict)  # name -> LawComparison: the run against other candidate laws
    machines: tuple[dict, ...] = ()  # the machines that drew the generations (block_machine), one where they all agree
    commits: tuple[str, ...] = ()  # the commits of the code that drew them (records.git_commit), in block order

    @property
    def finding(self) -> str:
        """Whether the measured law agrees with the audit's verdict, in one sentence."""
        keeps = self.target.p_value > LEVEL
        if self.verdict == "exact":
            return ("agrees: lossless as the audit says" if keeps else
                    f"FINDING: the audit says exact, the measured law rejects the target's (p = {self.target.p_value:.2g})"
                    + self._outside())
        if self.predicted.p_value > LEVEL and not keeps:
            return "agrees: lossy as the audit predicts (the predicted law holds, the target's is rejected)"
        if self.predicted.p_value <= LEVEL:
            return f"FINDING: the measured law rejects the predicted one (p = {self.predicted.p_value:.2g})"
        return (f"undecided: the run does not tell the predicted law from the target's (their TV "
                f"{self.predicted.tv_from_target:.3f}, detectable {self.detectable_tv:.3f}); raise num_samples")

    def _outside(self) -> str:
        """How many generations the target cannot emit, where any were drawn: one such cell of expected count 0
        alone rejects the target's law, whatever the rest of the cells say."""
        outside = self.counts[-1] if self.cells and self.cells[-1] == OUTSIDE else 0
        return f"; {outside} of {self.num_samples} generations outside the target's support" if outside else ""

    def as_record(self) -> dict:
        """A JSON-ready row (cells as strings)."""
        row = {key: getattr(self, key) for key in ("engine", "rule", "verdict", "options", "temperature", "n_tokens",
                                                   "num_samples", "seed", "counts", "target_probs", "predicted_probs",
                                                   "detectable_tv", "seconds", "version", "draft_tv_intended", "notes")}
        row["machines"], row["commits"] = list(self.machines), list(self.commits)
        row["cells"] = [repr(cell) for cell in self.cells]
        row["target"], row["predicted"] = vars(self.target), vars(self.predicted)
        if self.alternatives:
            row["alternatives"] = {name: vars(comparison) for name, comparison in self.alternatives.items()}
        row["finding"] = self.finding
        return row

    def __str__(self) -> str:
        lines = [f"{self.engine} ({self.rule}, audit: {self.verdict}; {self.version}) options {self.options or 'none'}, "
                 f"T = {self.temperature}, first {self.n_tokens} token(s), N = {self.num_samples}, {len(self.cells)} cells",
                 f"  vs target:    p = {self.target.p_value:.3g}, TV {self.target.tv:.4f}, bias-corrected 95% "
                 f"[{self.target.tv_interval[0]:.4f}, {self.target.tv_interval[1]:.4f}] (noise floor {self.target.tv_floor:.4f})",
                 f"  vs predicted: p = {self.predicted.p_value:.3g}, TV {self.predicted.tv:.4f}, bias-corrected 95% "
                 f"[{self.predicted.tv_interval[0]:.4f}, {self.predicted.tv_interval[1]:.4f}] "
                 f"(predicted vs target: {self.predicted.tv_from_target:.4f})",
                 f"  detects TV >= {self.detectable_tv:.4f}; {self.finding}",
                 "  (a measured TV is biased upwards by sampling noise; its interval is of the true TV and can lie "
                 "below it)"]
        for name, other in self.alternatives.items():
            lines.append(f"  vs {name}: p = {other.p_value:.3g}, TV {other.tv:.4f}, bias-corrected 95% "
                         f"[{other.tv_interval[0]:.4f}, {other.tv_interval[1]:.4f}]")
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


def compare_counts(counts, probs, target_probs, seed: int = 0) -> LawComparison:
    """Cell ``counts`` of N generations held against a cell law ``probs``: chi-square p-value (0 where a cell the law
    cannot give was drawn), TV with its bootstrap interval (``seed``) and noise floor, and ``probs``' TV to
    ``target_probs``."""
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


def _block_draws(executor, models, engine, ids, eos, vocab, temperature, options, n_tokens, num_samples, batch_size,
                 seed, progress, store=None
                 ) -> tuple[list[tuple[int, ...]], float, tuple[dict, ...], tuple[str, ...]]:
    """Every block's generations, in block order, the blocks run by ``executor`` (those ``store`` already holds read
    back from it, each new one appended as it lands), the seconds the blocks took, summed, and the distinct machines
    and commits that drew them (blocks stored before blocks named their machine or commit add none)."""
    from tqdm.auto import tqdm

    from specresearch.experiments.stats import seed_blocks

    blocks = [DrawBlock(engine, models, tuple(ids), eos, vocab, temperature, tuple(sorted(options.items())),
                        n_tokens, size, block_seed) for size, block_seed in seed_blocks(num_samples, batch_size, seed)]
    kept = {} if store is None else store.read()
    todo = [block for block in blocks if (block.size, block.seed) not in kept]
    if todo and store is not None and getattr(executor, "name", "") == "local":
        store.check_machine(block_machine(), "this machine")  # before drawing here, not after the first block
    bar = tqdm(total=num_samples, initial=num_samples - sum(block.size for block in todo), unit="run",
               desc=f"{engine} ({getattr(executor, 'name', 'executor')})", disable=not progress)

    def landed(index, result):
        block = todo[index]
        kept[(block.size, block.seed)] = result
        if store is not None:
            store.append(block.size, block.seed, *result)
        bar.update(block.size)

    executor.run(timed_block, todo, on_result=landed)
    bar.close()
    draws = [kept[(block.size, block.seed)] for block in blocks]
    machines, commits = [], []
    for _, _, machine, commit in draws:
        if machine is not None and machine not in machines:
            machines.append(machine)
        if commit and commit not in commits:
            commits.append(commit)
    return ([tuple(sequence) for sequences, *_ in draws for sequence in sequences],
            sum(seconds for _, seconds, *_ in draws), tuple(machines), tuple(commits))


def default_pair():
    """The embedded SmolLM2-135M-Instruct (float32, CPU) and the shipped draft ``v8k-4l`` as plain transformers models
    (none of the toolkit's CPU kernels, so nothing is timed on a first use), and the tokenizer:
    ``(target, draft, tokenizer)``."""
    from specresearch.drafts.distilled import load_trained_draft
    from specresearch.models.embedded import load_embedded

    target_lm, tokenizer = load_embedded(device="cpu", skinny_linear=False, fuse_projections=False)
    return target_lm.model, load_trained_draft(target_lm.model, "v8k-4l"), tokenizer


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
    if engine in ("llamacpp-server", "llamacpp-example", "transformers-mtp", "transformers-gemma4-assistant",
                  "transformers-dflash") and n_tokens < 2:
        raise ValueError(f"{engine} samples its first token from the target alone: n_tokens >= 2")
    if engine == "llamacpp-example" and n_tokens != 2:
        raise ValueError("llamacpp-example: n_tokens=2 (the token after its first drafted step; later ones depend on "
                         "how that step ended)")
    if not isinstance(num_samples, int) or num_samples < 20:
        raise ValueError(f"num_samples must be an int >= 20, got {num_samples!r}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0 (the engines' sampling mode), got {temperature!r}")
    if engine == "python" and ("sample" in options) == ("sampler" in options):
        raise ValueError("engine 'python' needs sample=callable(prompt_ids, n_tokens) -> token ids, or sampler=, a "
                         "picklable recipe returning one (one of the two)")
    if engine == "python" and not callable(options.get("sample", options.get("sampler"))):
        raise ValueError("engine 'python': sample= (or sampler=) must be callable")
    if engine == "python" and not callable(options.get("predicted_law", callable)):
        raise ValueError("engine 'python': predicted_law= must be callable(law) -> the next-token rows it predicts")
    if engine == "python" and set(options) & set(PYTHON_SETTINGS) and not callable(options.get("target_law")):
        raise ValueError("engine 'python': sampling settings need target_law=callable(ids, logits), the law they define")
    lossy = options.get("assistant_ensemble_weight") is not None or engine in ("transformers-gemma4-assistant",
                                                                              "transformers-usd")
    if lossy and options.get("num_assistant_tokens", n_tokens) < n_tokens:
        raise ValueError(f"{engine}: num_assistant_tokens must be >= n_tokens where the prediction is not the target's "
                         "law (it takes each measured token for a verified draft; a bonus token follows the target)")
    if engine == "transformers-usd" and set(options) & set(SAMPLING_OPTIONS):
        raise ValueError("transformers-usd: the draft's own law is computed under the temperature alone (no top_k, "
                         "top_p or repetition_penalty)")
    if engine == "transformers-early-exit" and not isinstance(options.get("assistant_early_exit"), int):
        raise ValueError("transformers-early-exit needs assistant_early_exit=k, the layers that draft (an int)")
    if engine == "transformers-lookup" and "prompt_lookup_num_tokens" not in options:
        raise ValueError("transformers-lookup needs prompt_lookup_num_tokens (e.g. 3)")


def _prompt_ids(prompt, tokenizer) -> list[int]:
    if isinstance(prompt, str):
        from specresearch.engine.prompts import encode_chat

        return encode_chat([prompt], tokenizer)[0].tolist()
    return [int(t) for t in prompt]


def _verdict(engine: str, options: dict, run=None) -> str:
    lossy = options.get("assistant_ensemble_weight") is not None or options.get("synth_rates") is not None
    lossy = lossy or getattr(run, "lossy", False)  # transformers-usd with a pruned head
    return "not exact" if lossy or engine in ("llamacpp-example", "transformers-gemma4-assistant") else "exact"


@dataclass(frozen=True)
class DrawBlock:
    """One seed block of :func:`execute`'s generations, as a worker runs it (:func:`draw_block`)."""

    engine: str
    models: object  # picklable recipe -> (target, draft, ...)
    ids: tuple
    eos: int
    vocab: int
    temperature: float
    options: tuple  # the engine's options as (name, value) pairs
    n_tokens: int
    size: int
    seed: int


def timed_block(block: DrawBlock) -> tuple[list[tuple[int, ...]], float, dict, str | None]:
    """:func:`draw_block`, the seconds it took in its worker, the worker's machine (:func:`block_machine`) and the
    commit of its checkout (``records.git_commit``; None where none is known)."""
    start = time.perf_counter()
    draws = draw_block(block)
    return draws, time.perf_counter() - start, block_machine(), git_commit() or None


def draw_block(block: DrawBlock) -> list[tuple[int, ...]]:
    """The block's generations (first ``n_tokens`` tokens each), drawn with its own seed in this worker."""
    from specresearch.experiments.executor import loaded

    target, draft = loaded(block.models)[:2]
    run = _make_run(block.engine, target, draft, list(block.ids), block.eos, block.vocab, block.temperature,
                    dict(block.options), block.n_tokens, block.seed)
    with run, quiet_transformers():
        torch.manual_seed(block.seed)
        return [tuple(sequence) for sequence in run.draws(block.size)]


def _make_run(engine, target, draft, ids, eos, vocab, temperature, options, n_tokens, seed, tokenizers=()):
    if engine in ("llamacpp-example", "llamacpp-simple"):
        return LlamaSpeculativeRun(ids, eos, vocab, temperature, options, n_tokens, seed, simple=engine == "llamacpp-simple")
    if engine.startswith("llamacpp"):
        return LlamaCppRun(ids, eos, vocab, temperature, options, n_tokens, seed)
    if engine == "python":
        return PythonRun(target, ids, eos, temperature, options, n_tokens)
    return TransformersRun(engine, target, draft, ids, eos, temperature, options, n_tokens, tokenizers)


def execute(engine: str, *, prompt, n_tokens: int = 2, num_samples: int, temperature: float = 1.0, seed: int = 0,
            min_expected: float = 5.0, target=None, draft=None, tokenizer=None, progress: bool = True,
            executor=None, models=None, batch_size: int = 500, blocks_file=None, assistant_tokenizer=None,
            **options) -> ExecutionResult:
    """Run ``engine``'s own implementation ``num_samples`` times on ``prompt`` and test the law of its first
    ``n_tokens`` tokens (module docstring).

    Args:
        engine: a name of :data:`ENGINES`.
        prompt: a string (chat-templated as the user's turn) or token ids.
        assistant_tokenizer: ``transformers-usd``'s draft's own tokenizer (``tokenizer`` then the target's).
        target, draft, tokenizer: transformers models (``PreTrainedModel``) and the tokenizer; default the embedded
            SmolLM2-135M-Instruct in float32 on the CPU and the shipped draft ``v8k-4l`` (same tokenizer). The
            llama.cpp engines load the embedded GGUF themselves and use ``target`` for its EOS and vocabulary only.
        seed: seeds torch's global generator, which transformers samples from, before the generations (llama.cpp:
            request i carries seed ``seed * 1000003 + i``).
        min_expected: a cell's least expected count (:func:`law_from_rows`).
        options: the engine's settings (``SAMPLING_OPTIONS`` and ``ENGINE_OPTIONS[engine]``), passed to
            ``generate`` as given; ``top_k`` defaults to 0 there (transformers' own default is 50). For llama.cpp
            its request's ``top_k`` / ``top_p`` / ``min_p`` (default the server's 40 / 0.95 / 0.05), ``synth_rates``,
            ``draft_max`` (3), ``draft_scale`` (1.5) and ``seeded`` (True: request i carries a seed; False: none, the
            server draws one from ``std::random_device`` and the run does not repeat).
        executor, models, batch_size: run the generations as seed blocks of ``batch_size`` on ``executor`` (module
            docstring), the workers building ``models()`` (a picklable recipe returning ``(target, draft, ...)``;
            default :func:`default_pair`, required when ``target`` is given).
        blocks_file: with an executor, a JSON-lines path (:class:`BlockStore`) each finished seed block is appended
            to; a rerun with the same arguments reads those blocks back and draws only the rest (``seconds`` is then
            the blocks' own seconds, summed).
    """
    check_arguments(engine, n_tokens, num_samples, temperature, options)
    if blocks_file is not None and executor is None:
        raise ValueError("blocks_file= stores seed blocks: pass an executor too (experiments.executor.LocalExecutor() "
                         "runs them in this process)")
    if executor is not None and models is None and target is not None:
        raise ValueError("an executor runs the generations in its workers: pass models=, a picklable recipe that "
                         "returns (target, draft, ...), with target=")
    if engine == "transformers-usd" and (executor is not None or tokenizer is None or assistant_tokenizer is None):
        raise ValueError("transformers-usd needs tokenizer= and assistant_tokenizer=, in this process (no executor: the "
                         "q transformers verifies with follows the tokenizer's hash order, which each process draws anew)")
    if target is None and engine == "transformers-mtp":
        raise ValueError("transformers-mtp needs target=, a transformers model loaded from a checkpoint with MTP layers "
                         "(the embedded SmolLM2 has none)")
    if target is None:
        target, loaded, tokenizer = default_pair()
        draft = draft if draft is not None else loaded
    if draft is None and engine in ("transformers-assisted", "transformers-sampling", "transformers-gemma4-assistant",
                                    "transformers-dflash", "transformers-usd"):
        raise ValueError(f"{engine} needs a draft model (the assistant)")
    if tokenizer is None and isinstance(prompt, str):
        raise ValueError("a string prompt needs the tokenizer (or pass token ids)")
    eos = target.generation_config.eos_token_id
    eos = int(eos if isinstance(eos, int) else eos[0])
    ids, vocab = _prompt_ids(prompt, tokenizer), target.config.vocab_size
    run = _make_run(engine, target, draft, ids, eos, vocab, temperature, options, n_tokens, seed,
                    (tokenizer, assistant_tokenizer) if engine == "transformers-usd" else ())
    from tqdm.auto import tqdm

    with run, quiet_transformers():
        law = law_from_rows(absorbing(run.target_rows, eos, vocab), ids, sampling=None, k=n_tokens,
                            num_samples=num_samples, min_expected=min_expected)
        target_probs = list(law.probs) + [0.0]
        rows = run.predicted_rows(law)
        if rows is None:
            predicted_probs = target_probs
        else:
            predicted, impossible = cell_probs(law, rows)
            predicted_probs = predicted + [impossible]
        others = {}
        for name, other_rows in (run.alternative_rows(law) if hasattr(run, "alternative_rows") else {}).items():
            probs, impossible = cell_probs(law, other_rows)
            others[name] = probs + [impossible]
        counts = [0] * (len(law.cells) + 1)
        if seed is not None:
            torch.manual_seed(seed)
        start, store = time.perf_counter(), None
        if executor is None:
            machines, commits = (block_machine(),), tuple(filter(None, [git_commit()]))
            draws = tqdm(run.draws(num_samples), total=num_samples, desc=engine, disable=not progress, unit="run")
        else:
            store = None if blocks_file is None else BlockStore(blocks_file, dict(
                engine=engine, ids=list(ids), temperature=temperature, n_tokens=n_tokens, num_samples=num_samples,
                batch_size=batch_size, seed=seed, options={k: v for k, v in sorted(options.items()) if k not in _CALLABLES}))
            draws, block_seconds, machines, commits = _block_draws(
                executor, models or functools.partial(default_pair), engine, ids, eos, vocab, temperature, options,
                n_tokens, num_samples, batch_size, seed, progress, store)
        for sequence in draws:
            cell = law.index(sequence)
            counts[len(law.cells) if cell is None else cell] += 1
        seconds = time.perf_counter() - start if executor is None or blocks_file is None else block_seconds
    if not counts[-1] and not predicted_probs[-1] and not any(probs[-1] for probs in others.values()):
        counts, target_probs, predicted_probs = counts[:-1], target_probs[:-1], predicted_probs[:-1]  # no such cell
        others = {name: probs[:-1] for name, probs in others.items()}
    cells = law.cells + (OUTSIDE,) * (len(counts) - len(law.cells))
    return ExecutionResult(
        engine, ENGINES[engine], _verdict(engine, options, run), {k: v for k, v in options.items() if k not in _CALLABLES},
        temperature, n_tokens, num_samples, seed,
        cells, tuple(counts), tuple(target_probs), tuple(predicted_probs),
        compare_counts(counts, target_probs, target_probs, seed), compare_counts(counts, predicted_probs, target_probs, seed + 1),
        detectable_tv(num_samples, len(cells)), seconds, run.version, run.draft_tv, tuple(run.notes) + block_notes(store),
        {name: compare_counts(counts, probs, target_probs, seed + 2 + i) for i, (name, probs) in enumerate(others.items())},
        machines, commits)


@dataclass(frozen=True)
class TinyRun:
    """One configuration of :func:`record_tiny_runs`: ``engine`` on the models ``build()`` returns (``(target, draft,
    row fields)``: a draft of None for the engines without one, fields such as a checkpoint's digest; then, optionally,
    :func:`execute`'s further keyword arguments, such as tokenizers), named ``model`` in the record."""

    model: str
    build: object  # () -> (target, draft, dict)
    engine: str
    n_tokens: int
    num_samples: int
    temperature: float = 1.0
    options: dict = field(default_factory=dict)
    prompt: tuple = (5, 9, 3)


def record_tiny_runs(out, command: str, argv, runs, *, scale: float = 1.0, min_expected: float = 20.0) -> dict:
    """The resumable record of execution runs on models built for them (``benchmarks/audit_mtp.py``,
    ``audit_gemma4.py``, ``audit_dflash.py``, ``audit_usd.py``, ``audit_early_exit.py``: transformers' paths the
    embedded pair cannot run, mostly on tiny random-weight models): ``runs`` (:class:`TinyRun`) already in the JSON
    record ``out`` (by model, engine, settings and prompt) are kept, the others run at ``num_samples * scale`` (at
    least 20) and are written one by one, each row naming its model and commit."""
    import json
    from pathlib import Path

    from specresearch.audit.report import config_key
    from specresearch.experiments.records import record_header, write_json_record

    out = Path(out)
    record = json.loads(out.read_text()) if out.exists() else record_header(
        command, argv, target=None, models="tiny random-weight models, named in each row", rows=[])
    done = {config_key(r["engine"], r["n_tokens"], r["temperature"], r["options"], [r["model"], r["prompt"]])
            for r in record["rows"]}
    for run in runs:
        if config_key(run.engine, run.n_tokens, run.temperature, run.options, [run.model, list(run.prompt)]) in done:
            continue
        target, draft, fields, *keywords = run.build()  # keywords: execute's further arguments (tokenizers)
        result = execute(run.engine, prompt=list(run.prompt), n_tokens=run.n_tokens, temperature=run.temperature,
                         num_samples=max(20, round(run.num_samples * scale)), target=target, draft=draft,
                         min_expected=min_expected, **(keywords[0] if keywords else {}), **run.options)
        print(result, flush=True)
        record["rows"].append({"model": run.model, **fields, "prompt": list(run.prompt), "commit": git_commit()}
                              | result.as_record())
        write_json_record(out, record)
    return record


def tiny_runs_main(doc: str, name: str, runs, argv=None) -> int:
    """The command line of a tiny-model record's script (``benchmarks/<name>.py``, its docstring ``doc``): ``--out``
    (default ``benchmarks/records/<name>.json``), ``--scale`` (every N), ``--threads``; runs
    :func:`record_tiny_runs`."""
    import argparse
    import sys

    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--out", default=f"benchmarks/records/{name}.json")
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    record_tiny_runs(args.out, f"benchmarks/{name}.py", sys.argv[1:] if argv is None else argv, runs, scale=args.scale)
    return 0
