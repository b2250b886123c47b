"""Statistical losslessness tests of the whole speculative engine on real models.

The exact twins (``exact.py``) prove the verifiers lossless on small enumerable models. On a real model
(V = 49152) the law of a generation cannot be enumerated, but it can be *tested*: run
``generate.speculative_generate`` on ``num_samples`` copies of one prompt, keep the first ``k`` tokens
of each row, and compare their empirical law with the target law of k-token continuations under the
same sampling transform, p(x_1) p(x_2 | x_1) ... p(x_k | x_<k) with ``sampling.logits_to_probs``
(Leviathan et al. 2023, arXiv 2211.17192, Theorem 1; Sun et al. 2025, arXiv 2403.10444, Theorem 1: the
emitted sequence is distributed exactly as the target's).

Cells (fixed by the target law and ``num_samples`` only, never by the observations). With
``m = min_expected`` and N = ``num_samples``, a prefix s is *expanded* (one target forward gives its
next-token row) when N P(s) >= m. The partition of all k-token sequences is

* every full sequence s with N P(s) >= m (a leaf of the expanded tree);
* for every expanded prefix s, "s then a token whose child is not big": mass P(s) - sum of its big
  children, kept as its own cell if its expected count is >= m;
* one pooled tail with everything else (merged into the smallest cell if its expected count is < m).

This refines "most likely sequences + one tail" (deviations in rare continuations of likely prefixes
stay visible) while keeping every expected count >= m. Observations that the expanded rows show to be
IMPOSSIBLE (a token with target probability 0 after a known prefix, e.g. outside the top-k) make the
p-value exactly 0.

Tests reported:

* Pearson chi-square with ``cells - 1`` degrees of freedom (``p_value``). Under H0 (the engine is
  lossless) the p-value is asymptotically uniform, so rejecting when ``p_value < a`` has false-positive
  rate ``a``; with expected counts >= 5 the approximation is good at the usual levels, and at tiny levels
  (1e-6 and below) the true tail of the statistic is heavier than chi-square, which is why
* an exact conservative test is reported too (``bonferroni_p_value``): the exact two-sided binomial
  p-value of each cell, times the number of cells (union bound). Its false-positive rate is <= a at
  every level and every sample size, with no large-sample approximation.

The expected probabilities come from uncached float32 forwards of the target on ``prompt + prefix``;
the engine uses cached forwards. They agree to ~1e-6 relative, far below what N <= 1e6 samples resolve.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch
from scipy import stats as scipy_stats

from specresearch.checks import check_int
from specresearch.config import SamplingConfig
from specresearch.core.draws import draw_uniforms
from specresearch.core.sampling import logits_to_probs
from specresearch.core.verify import VerifyResult, token_verify
from specresearch.engine.generate import speculative_generate
from specresearch.engine.prompts import encode_prompts

__all__ = [
    "detectable_tv",
    "FPR_NOTE",
    "Cell",
    "SequenceLaw",
    "LosslessTestResult",
    "sequence_law",
    "law_from_rows",
    "chi_square",
    "lossless_test",
    "SampleBlock",
    "sample_block",
    "block_key",
    "block_seeds",
    "seed_blocks",
    "wrong_residual_verify",
    "describe_cell",
    "plot_cells",
]

FPR_NOTE = (
    "Under H0 (lossless engine) p_value is asymptotically uniform: rejecting at p_value < a has false-positive "
    "rate a (chi-square approximation, expected counts >= min_expected). bonferroni_p_value is exact and "
    "conservative: rejecting at bonferroni_p_value < a has false-positive rate <= a at any sample size."
)

# A cell of the partition: ("seq", tokens) one full k-token sequence; ("rest", prefix) the sequences
# continuing an expanded prefix with a token that is not one of its big children; ("tail",) the rest.
Cell = tuple

_TAIL: Cell = ("tail",)
_FORWARD_BATCH = 64  # prefixes per target forward when computing the law


@dataclass(frozen=True)
class SequenceLaw:
    """Exact target probabilities of a partition of the k-token continuations of one prompt.

    ``rows`` holds the next-token law (float64, [V]) after every expanded prefix; ``big`` the probability
    of every prefix / sequence with expected count >= ``min_expected`` (the expanded tree).
    """

    prompt: tuple[int, ...]
    k: int
    sampling: SamplingConfig | None  # None: the rows came from another engine's sampler (law_from_rows)
    num_samples: int
    min_expected: float
    rows: dict[tuple[int, ...], torch.Tensor]  # expanded prefix -> [V] float64 next-token probabilities
    big: dict[tuple[int, ...], float]  # prefix or sequence -> probability, for N P >= min_expected
    cells: tuple[Cell, ...]
    probs: tuple[float, ...]  # [C] probability of each cell, summing to 1
    lookup: dict[Cell, int]  # every atom ("seq"/"rest"/"tail") -> index of the cell it belongs to

    def index(self, sequence: Sequence[int]) -> int | None:
        """Cell index of one observed k-token sequence, or None if the law shows it is impossible."""
        prefix: tuple[int, ...] = ()
        for token in sequence[: self.k]:
            row = self.rows[prefix]
            if not 0 <= token < row.shape[0] or float(row[token]) == 0.0:
                return None
            if prefix + (token,) not in self.big:
                return self.lookup[("rest", prefix)]
            prefix = prefix + (token,)
        return self.lookup[("seq", prefix)]


@dataclass(frozen=True)
class LosslessTestResult:
    """Outcome of :func:`lossless_test`. See ``FPR_NOTE`` for the false-positive rate of each p-value."""

    statistic: float  # Pearson chi-square (inf when an impossible sequence was observed)
    dof: int  # cells - 1
    p_value: float  # chi-square p-value; 0 when an impossible sequence was observed
    bonferroni_p_value: float  # exact binomial per cell x number of cells (conservative)
    counts: tuple[int, ...]  # [C] observed per cell
    expected: tuple[float, ...]  # [C] expected per cell under the target law
    cells: tuple[Cell, ...]
    num_samples: int
    impossible: int  # observed sequences with target probability 0
    seconds: float  # generation time (the law computation excluded)
    note: str = FPR_NOTE

    def rejects(self, level: float) -> bool:
        """True when the chi-square test rejects losslessness at ``level`` (false-positive rate ``level``)."""
        return self.p_value < level

    def detectable_tv(self, level: float = 1e-3, power: float = 0.9) -> float:
        """The smallest total-variation deviation of the cell law this run detects (:func:`detectable_tv`)."""
        return detectable_tv(self.num_samples, len(self.cells), level, power)


def detectable_tv(num_samples: int, cells: int, level: float = 1e-3, power: float = 0.9) -> float:
    """The smallest deviation delta (total variation, between the laws of the test's cells) that the chi-square test
    rejects with probability >= ``power`` at ``level``, whatever its shape.

    A deviation d of the cell probabilities p with sum |d_i| = 2 delta has chi-square divergence sum d_i^2 / p_i >=
    (sum |d_i|)^2 / sum p_i = 4 delta^2 (Cauchy-Schwarz), so the statistic's non-centrality is at least
    lambda = 4 N delta^2 (the asymptotic non-central chi-square law, dof = cells - 1); its power grows with lambda.
    delta = sqrt(lambda* / 4N) with lambda* the non-centrality of power ``power`` at ``level``. A deviation inside a
    cell (two sequences of one cell trading mass) is not seen at all."""
    dof = max(cells - 1, 1)
    critical = scipy_stats.chi2.isf(level, dof)
    low, high = 0.0, 1.0
    while scipy_stats.ncx2.sf(critical, dof, high) < power:
        high *= 2
    for _ in range(60):  # bisection on the non-centrality
        middle = (low + high) / 2
        low, high = (middle, high) if scipy_stats.ncx2.sf(critical, dof, middle) < power else (low, middle)
    return float(np.sqrt(high / (4 * num_samples)))


def _prompt_ids(prompt, tokenizer) -> tuple[int, ...]:
    ids, _ = encode_prompts([prompt] if isinstance(prompt, str) else [list(prompt)], tokenizer)
    return tuple(ids[0].tolist())


def _next_token_rows(target, prompt: tuple[int, ...], prefixes, sampling) -> torch.Tensor:
    """Target law after ``prompt + prefix`` for each prefix (all of one length). -> [len(prefixes), V] float64."""
    out = []
    for start in range(0, len(prefixes), _FORWARD_BATCH):
        ids = torch.tensor([prompt + p for p in prefixes[start : start + _FORWARD_BATCH]], dtype=torch.long)
        logits = target.prefill(ids.to(target.device), torch.ones_like(ids).to(target.device))  # [b, V]
        # float32 transform, as in the engine, so the kept set of top-k / top-p is decided identically
        out.append(logits_to_probs(logits.float(), sampling).double().cpu())
    return torch.cat(out)


def _expand(next_rows: Callable, k, threshold):
    """Breadth-first expansion of every prefix with probability >= threshold (``next_rows(prefixes)``: their
    next-token laws ``[n, V]`` float64). -> (rows, big)."""
    rows, big, frontier = {}, {}, [()]
    prob = {(): 1.0}
    for _ in range(k):
        if not frontier:
            break
        next_frontier = []
        for prefix, row in zip(frontier, next_rows(frontier)):
            rows[prefix] = row
            joint = row * prob[prefix]
            for token in (joint >= threshold).nonzero()[:, 0].tolist():
                child = prefix + (token,)
                prob[child] = big[child] = float(joint[token])
                next_frontier.append(child)
        frontier = next_frontier
    return rows, big


def _partition(rows, big, k, threshold):
    """Cells with probability >= threshold, plus the tail. -> (cells, probs, lookup)."""
    cells = [("seq", s) for s in big if len(s) == k]
    probs = [big[s] for s in big if len(s) == k]
    merged = {}
    for prefix in rows:
        children = sum(p for s, p in big.items() if len(s) == len(prefix) + 1 and s[:-1] == prefix)
        rest = (big[prefix] if prefix else 1.0) - children
        if rest >= threshold:
            cells.append(("rest", prefix))
            probs.append(rest)
        else:
            merged[("rest", prefix)] = -1  # joins the tail
    tail = max(1.0 - sum(probs), 0.0)
    if tail >= threshold or not cells:
        cells.append(_TAIL)
        probs.append(tail)
        tail_index = len(cells) - 1
    else:  # too small to stand alone: pool it with the smallest cell
        tail_index = int(np.argmin(probs))
        probs[tail_index] += tail
    lookup = {atom: tail_index for atom in merged} | {cell: i for i, cell in enumerate(cells)} | {_TAIL: tail_index}
    return tuple(cells), tuple(probs), lookup


def sequence_law(target, prompt, *, sampling: SamplingConfig, k: int, num_samples: int,
                 min_expected: float = 5.0, tokenizer=None) -> SequenceLaw:
    """The target law of the first ``k`` generated tokens on the cells of the module docstring.

    Args:
        target: a ``models.protocols.LanguageModel`` (``prefill`` is used, uncached, once per level of the tree).
        prompt: token ids, or a string with ``tokenizer``.
        sampling: the transform applied to the target logits (as in the engine).
        k: number of generated tokens compared (>= 1).
        num_samples: N, the number of generations the law will be compared with (sets the cells).
        min_expected: minimum expected count of a cell (>= 1; 5 is the textbook rule).
    """
    ids = _prompt_ids(prompt, tokenizer)
    return law_from_rows(lambda prefixes: _next_token_rows(target, ids, prefixes, sampling), ids, sampling=sampling,
                         k=k, num_samples=num_samples, min_expected=min_expected)


def law_from_rows(next_rows: Callable, prompt: Sequence[int], *, sampling: SamplingConfig | None, k: int,
                  num_samples: int, min_expected: float = 5.0) -> SequenceLaw:
    """:func:`sequence_law` from any source of next-token laws: ``next_rows(prefixes)`` -> ``[len(prefixes), V]``
    float64, the law after ``prompt + prefix`` for each (all of one length). It is how another engine's own sampler
    (``audit.execute``: transformers' processed scores, repetition penalty included) defines the cells."""
    _check_test_args(k, num_samples, min_expected)
    threshold = min_expected / num_samples
    rows, big = _expand(next_rows, k, threshold)
    cells, probs, lookup = _partition(rows, big, k, threshold)
    return SequenceLaw(tuple(prompt), k, sampling, num_samples, float(min_expected), rows, big, cells, probs, lookup)


def _check_test_args(k, num_samples, min_expected) -> None:
    check_int("k", k, meaning="number of generated tokens compared")
    check_int("num_samples", num_samples, minimum=2)
    if not 1 <= min_expected <= num_samples:
        raise ValueError(f"min_expected must be in [1, num_samples], got {min_expected!r} (5 is the usual rule)")


def chi_square(counts: Sequence[int], probs: Sequence[float]) -> tuple[float, int, float, float]:
    """Pearson chi-square and exact Bonferroni-binomial tests of ``counts [C]`` against ``probs [C]``.

    Returns ``(statistic, dof, p_value, bonferroni_p_value)``; dof = C - 1 (0 cells of freedom -> p = 1).
    """
    counts_arr, probs_arr = np.asarray(counts, dtype=float), np.asarray(probs, dtype=float)
    n = counts_arr.sum()
    expected = n * probs_arr
    statistic = float(((counts_arr - expected) ** 2 / expected).sum())
    dof = len(counts_arr) - 1
    p_value = float(scipy_stats.chi2.sf(statistic, dof)) if dof > 0 else 1.0
    binomial = [scipy_stats.binomtest(int(c), int(n), float(p)).pvalue for c, p in zip(counts_arr, probs_arr)]
    return statistic, dof, p_value, float(min(1.0, len(binomial) * min(binomial)))


def seed_blocks(num_samples: int, batch_size: int, seed: int) -> list[tuple[int, int]]:
    """``num_samples`` generations cut into blocks of at most ``batch_size``: ``(size, seed)`` per block, each seed its
    own (:func:`block_seeds`), so a block draws the same wherever it runs."""
    sizes = [min(batch_size, num_samples - start) for start in range(0, num_samples, batch_size)]
    return list(zip(sizes, block_seeds(seed, len(sizes))))


def block_seeds(seed: int, batches: int) -> list[int]:
    """Independent, non-overlapping generator seeds for the batches of one test (numpy SeedSequence)."""
    return [int(s.generate_state(1)[0]) for s in np.random.SeedSequence(seed).spawn(batches)]


def _sample_sequences(target, draft, verifier, law: SequenceLaw, *, gamma, num_samples, seed, batch_size,
                      max_new_tokens, tree: dict) -> tuple[list[tuple[int, ...]], float]:
    """``num_samples`` speculative generations of ``law.prompt``, first ``k`` tokens each, and the seconds."""
    sequences, seconds = [], 0.0
    for size, batch_seed in seed_blocks(num_samples, batch_size, seed):
        out = speculative_generate(target, draft, [list(law.prompt)] * size, verifier=verifier, gamma=gamma,
                                   max_new_tokens=max_new_tokens, sampling=law.sampling, seed=batch_seed, **tree)
        seconds += out.seconds
        sequences.extend(tuple(row[: law.k]) for row in out.tokens)
    return sequences, seconds


@dataclass(frozen=True)
class SampleBlock:
    """One seed block of a test, as a worker runs it (``experiments.executor``): ``size`` generations of ``prompt``
    seeded by ``seed``, with the models ``models()`` builds (once per worker: ``executor.loaded``)."""

    models: Callable  # picklable recipe -> (target, draft, ...): drafts.registry.load_pair's triple will do
    verifier: str | Callable
    prompt: tuple[int, ...]
    sampling: SamplingConfig
    k: int
    gamma: int
    size: int
    seed: int
    max_new_tokens: int
    tree: dict = field(default_factory=dict)
    threads: int | None = None  # torch threads (None: as they are; a Ray worker has its task's CPUs)


def sample_block(block: SampleBlock) -> dict:
    """Run one block: ``{"seed", "sequences" (each row's first k tokens), "seconds"}``."""
    from specresearch.experiments.executor import loaded

    if block.threads is not None:
        torch.set_num_threads(block.threads)
    target, draft = loaded(block.models)[:2]
    out = speculative_generate(target, draft, [list(block.prompt)] * block.size, verifier=block.verifier,
                               gamma=block.gamma, max_new_tokens=block.max_new_tokens, sampling=block.sampling,
                               seed=block.seed, **block.tree)
    return {"key": block_key(block), "seed": block.seed, "sequences": [list(row[: block.k]) for row in out.tokens],
            "seconds": out.seconds}


def block_key(block: SampleBlock) -> str:
    """What a block's rows depend on, as text: a blocks file's rows are reused only by a block with the same key."""
    from specresearch.experiments.executor import recipe_key

    verifier = block.verifier if isinstance(block.verifier, str) else getattr(block.verifier, "__qualname__", "?")
    return repr((recipe_key(block.models), verifier, block.prompt, block.sampling, block.k, block.gamma, block.size,
                 block.seed, block.max_new_tokens, sorted(block.tree.items())))


def _sample_blocks(executor, models, verifier, law: SequenceLaw, *, gamma, num_samples, seed, batch_size,
                   max_new_tokens, tree: dict, blocks_file) -> tuple[list[tuple[int, ...]], float]:
    """The seed blocks of ``_sample_sequences`` run by ``executor``; with ``blocks_file`` (JSON lines) each finished
    block is appended as it lands and blocks the file already holds are not run again."""
    if models is None:
        raise ValueError("an executor runs the blocks in its workers: pass models=, a picklable recipe that returns "
                         "(target, draft) (e.g. functools.partial of a top-level loader)")
    blocks = [SampleBlock(models, verifier, law.prompt, law.sampling, law.k, gamma, size, block_seed, max_new_tokens,
                          tree) for size, block_seed in seed_blocks(num_samples, batch_size, seed)]
    keys = [block_key(block) for block in blocks]
    done: dict[str, dict] = {}
    path = None if blocks_file is None else Path(blocks_file)
    if path is not None and path.exists():
        for line in path.read_text().splitlines():
            row = json.loads(line)
            if row.get("key") in keys:
                done[row["key"]] = row

    def landed(_, row):
        done[row["key"]] = row
        if path is not None:
            with path.open("a") as out:
                out.write(json.dumps(row) + "\n")

    executor.run(sample_block, [b for b, key in zip(blocks, keys) if key not in done], on_result=landed)
    sequences = [tuple(s) for key in keys for s in done[key]["sequences"]]
    return sequences, sum(done[key]["seconds"] for key in keys)


def lossless_test(target, draft, verifier: str | Callable, prompt, *, sampling: SamplingConfig, gamma: int,
                  k: int, num_samples: int, seed: int, batch_size: int = 256, min_expected: float = 5.0,
                  max_new_tokens: int | None = None, tokenizer=None, law: SequenceLaw | None = None,
                  num_drafts: int = 1, draft_law: str = "iid", tree_nodes: int | None = None,
                  stop_below: float | None = None, executor=None, models: Callable | None = None,
                  blocks_file=None, compile: str = "off") -> LosslessTestResult:
    """Test that speculative generation of ``prompt`` follows the target law (module docstring).

    Args:
        target, draft: ``models.protocols.LanguageModel`` s (as for ``speculative_generate``).
        verifier: a name in ``verify.VERIFIERS`` or a callable with the verifier signature.
        prompt: token ids, or a string with ``tokenizer``.
        sampling, gamma: passed to the engine; the target law uses the same ``sampling``.
        k: compare the first k generated tokens (the engine shortens gamma to ``max_new_tokens - 1``, so
            block verification differs from token verification only when ``max_new_tokens >= 3``).
        num_samples: generations, run as batches of ``batch_size`` copies of the prompt, each batch with
            its own seed spawned from ``seed`` (numpy ``SeedSequence``).
        max_new_tokens: tokens generated per row (default ``k``; must be >= k).
        law: a precomputed :func:`sequence_law` for the same prompt / sampling / k / num_samples (reuse it
            across verifiers to save the target forwards).
        num_drafts, draft_law, tree_nodes: draft trees (``speculative_generate``'s; ``verifier`` then a multi-draft
            rule).
        stop_below: adaptive draft lengths (``speculative_generate``'s).
        compile: ``speculative_generate``'s (``"static"``: the captured steps, run eagerly).
        executor: an ``experiments.executor`` executor that runs the seed blocks (``--executor ray``: Ray tasks);
            the counts equal one process's with the same ``seed`` (each block draws from its own seed). ``target``
            then only computes the law (None with ``law``), and the workers build their models with ``models``, a
            picklable recipe returning ``(target, draft)``, once per worker.
        blocks_file: with an executor, a JSON-lines file the finished blocks are appended to; a rerun skips them.
    Returns:
        ``LosslessTestResult``; see ``FPR_NOTE`` for the false-positive rates.
    """
    max_new_tokens = k if max_new_tokens is None else max_new_tokens
    if max_new_tokens < k:
        raise ValueError(f"max_new_tokens must be >= k = {k} (the rows must be k tokens long), got {max_new_tokens}")
    if law is None:
        law = sequence_law(target, prompt, sampling=sampling, k=k, num_samples=num_samples,
                           min_expected=min_expected, tokenizer=tokenizer)
    elif (law.k, law.num_samples, law.sampling, law.prompt) != (k, num_samples, sampling,
                                                                _prompt_ids(prompt, tokenizer)):
        raise ValueError("law was computed for another prompt, sampling, k or num_samples; recompute it")
    tree = {"num_drafts": num_drafts, "draft_law": draft_law, "tree_nodes": tree_nodes, "stop_below": stop_below}
    if compile != "off":  # (absent otherwise: the seed blocks' keys stay those of earlier records)
        tree["compile"] = compile
    if executor is not None:
        sequences, seconds = _sample_blocks(executor, models, verifier, law, gamma=gamma, num_samples=num_samples,
                                            seed=seed, batch_size=batch_size, max_new_tokens=max_new_tokens, tree=tree,
                                            blocks_file=blocks_file)
        return _evaluate(law, sequences, seconds)
    sequences, seconds = _sample_sequences(target, draft, verifier, law, gamma=gamma, num_samples=num_samples,
                                           seed=seed, batch_size=batch_size, max_new_tokens=max_new_tokens, tree=tree)
    return _evaluate(law, sequences, seconds)


def _evaluate(law: SequenceLaw, sequences, seconds) -> LosslessTestResult:
    """Count the sequences per cell and run both tests."""
    counts = [0] * len(law.cells)
    impossible = 0
    for sequence in sequences:
        index = law.index(sequence)
        if index is None:
            impossible += 1
        else:
            counts[index] += 1
    n = len(sequences)
    statistic, dof, p_value, bonferroni = chi_square(counts, law.probs) if n > impossible else (0.0, 0, 1.0, 1.0)
    if impossible:
        statistic, p_value, bonferroni = float("inf"), 0.0, 0.0
    expected = tuple(n * p for p in law.probs)
    return LosslessTestResult(statistic, dof, p_value, bonferroni, tuple(counts), expected, law.cells, n,
                              impossible, seconds)


def wrong_residual_verify(target_probs, draft_probs, draft_tokens, generator=None, *, uniforms=None,
                          validate=True) -> VerifyResult:
    """A deliberately WRONG verifier: token verification whose rejection resamples from p instead of
    norm(max(p - q, 0)). Not lossless: the first token's law becomes min(p, q) + (1 - alpha) p.

    Same signature and shapes as ``verify.token_verify``; used to show the tests have power.
    """
    if uniforms is None:
        uniforms = draw_uniforms(*draft_tokens.shape, generator, device=target_probs.device)
    result = token_verify(target_probs, draft_probs, draft_tokens, uniforms=uniforms, validate=validate)
    rows = target_probs[torch.arange(draft_tokens.shape[0]), result.num_accepted]  # [B, V] p after n accepted
    cdf = rows.double().cumsum(-1)  # [B, V]
    u = uniforms[:, -1:].to(cdf) * cdf[:, -1:]
    picked = torch.searchsorted(cdf, u, right=True)  # right=True: never a zero-probability token ...
    last_positive = torch.searchsorted(cdf, cdf[:, -1:].contiguous(), right=False)  # ... even when u * total rounds up
    return VerifyResult(result.num_accepted, torch.minimum(picked, last_positive).squeeze(1))


def describe_cell(cell: Cell, tokenizer=None) -> str:
    """Readable label of a cell: token ids joined by '|' (with ``tokenizer``: the tokens' text, quoted, one string),
    then '*' for "any other token"; 'other' for the tail."""
    if cell == _TAIL:
        return "other"
    kind, tokens = cell
    if tokenizer is not None:
        text = repr(tokenizer.decode(list(tokens))) if tokens else ""
        return f"{text} *".strip() if kind == "rest" else text
    return "|".join([str(t) for t in tokens] + (["*"] if kind == "rest" else []))


def plot_cells(results: dict[str, LosslessTestResult], *, tokenizer=None, top: int = 12):
    """Bar plot per result: exact target vs empirical probability of its ``top`` most likely cells. -> Figure."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(4.5 * len(results), 4.2), sharey=True, squeeze=False)
    for ax, (name, result) in zip(axes[0], results.items()):
        order = np.argsort(result.expected)[::-1][:top]
        x = np.arange(len(order))
        ax.bar(x - 0.2, [result.expected[i] / result.num_samples for i in order], 0.4, label="target (exact)")
        ax.bar(x + 0.2, [result.counts[i] / result.num_samples for i in order], 0.4, label="speculative (empirical)")
        ax.set_xticks(x, [describe_cell(result.cells[i], tokenizer) for i in order], rotation=60, ha="right",
                      fontsize=7)
        ax.set_title(f"{name}\nchi-square p = {result.p_value:.2g}, N = {result.num_samples}", fontsize=9)
        ax.set_xlabel("cell: the first k generated tokens as text\n(* then any other token; other: every rarer cell)")
    axes[0][0].set_ylabel("probability")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    return fig
