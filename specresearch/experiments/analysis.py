"""Tables, bootstrap intervals and figures from the records of ``specresearch.experiments.bench`` (reads CSV rows only).

Metrics of a set of records are ratios of sums over its runs (so long runs weigh more than short ones):

* BE, block efficiency (Sun et al. 2025, arXiv 2403.10444: tokens per target call) = (accepted drafts + target calls) /
  target calls, i.e. the mean number of tokens a verification step emits (num_accepted + 1) before the
  truncation at EOS / max_new_tokens. ``be_emitted`` = emitted tokens / target calls is the truncated
  variant (lower by at most one block per run);
* WS, wall-clock speed-up (Sun et al. 2025, arXiv 2403.10444) = (autoregressive seconds / autoregressive tokens) /
  (speculative seconds / speculative tokens): the throughput ratio against the baseline run of the same
  prompt, temperature and seed. Per token, because a run that meets EOS early produces fewer tokens;
* alpha = accepted drafts / examined drafts (examined = accepted + steps with a rejection): the
  maximum-likelihood acceptance rate when acceptances are i.i.d. Bernoulli(alpha) (Leviathan et al. 2023,
  Leviathan et al. 2023, arXiv 2211.17192), exact for token verification of i.i.d. models, where then BE =
  ``theory.expected_tokens(alpha, gamma)``. Read it from token-verification rows.

Intervals: percentile bootstrap over prompts (Efron & Tibshirani 1993, ch. 13). A resample draws the
prompts of the set with replacement (multinomial counts, ``numpy.random.default_rng(seed)``); each
prompt brings all its runs (every seed), and a metric is recomputed from the reweighted sums. The gain
of block over token verification, block / token - 1, uses a PAIRED bootstrap: one resample of prompts
reweights both verifiers' runs, so the prompt-to-prompt variation common to both cancels.

Expected counts (``expected_gain_table``). Every record also holds, summed over its steps, E[accepted |
the step's drafted block] for BOTH verifiers (``verify.expected_num_accepted``: closed forms given the
rows p_0..p_gamma, q_0..q_{gamma-1} of that block). For a step starting at context c, the expectation over
the drafted block of that number is exactly the verifier's mean accepted count at c, g_m(c) =
``exact.expected_accepted(target, draft, gamma, m, prefix=c)`` (``tests/test_expected.py`` checks this by
enumeration). So on any run, sum_t E_m[accepted | block_t] has the same expectation as sum_t g_m(c_t) over
the contexts c_t where the run's steps start: for the verifier that ran it is an unbiased stand-in for its
realised count with the uniforms' noise removed; for the other verifier it is the counterfactual count at
the same contexts. The expected BE of verifier m on a set of runs is (sum expected_m + steps) / steps and
the expected gain is expected BE(block) / expected BE(token) - 1, both computed on the SAME steps, with a
paired bootstrap over prompts. It estimates the gain at the contexts where steps start on the runs'
trajectories (pooled over the runs included: by default those of every verifier); the paper's BE gain
compares each verifier on its OWN trajectory. The two targets coincide for context-free models and differ
only through where blocks start (the emitted text has the same law under both verifiers, both being
lossless). Like BE, the ratio is consistent rather than unbiased; its numerator and denominator sums are
unbiased.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

import numpy as np
import pandas as pd

from specresearch.experiments.records import AUTOREGRESSIVE, read_records

__all__ = ["METRICS", "PAPER_TABLE", "FEW_PROMPTS", "bootstrap_weights", "pooled_speed", "category_table",
           "expected_gain_table", "format_markdown", "format_paper_table", "gain_table", "paired_difference",
           "paired_gain", "gain_vs_alpha_table", "latest_run", "metric_table", "metric_value", "paper_points",
           "paper_table", "paper_alpha", "plot_gain_vs_alpha", "plot_gain_vs_temperature", "plot_metric_vs_gamma",
           "prompt_sums", "read_records", "read_sweep", "speculative_records", "summary", "t0_agreement",
           "two_symbol_curve", "two_symbol_gain"]

_SUM_COLUMNS = ["accepted_tokens", "examined_drafts", "target_calls", "new_tokens", "seconds", "ar_seconds",
                "ar_tokens"]
METRICS = ("be", "be_emitted", "ws", "alpha")
FEW_PROMPTS = 10  # summary(): fewer prompts than this and the percentile bootstrap's intervals undercover

# Sun et al. 2025 (the table of their OpenReview rebuttal): Vicuna-7B-v1.3 target + Vicuna-68M draft, Spec-Bench, gamma = 8, H100.
PAPER_TABLE = pd.DataFrame({
    "temperature": [0.2, 0.6, 1.0],
    "be_token": [2.75, 2.75, 2.79], "be_block": [2.85, 2.90, 3.04], "be_gain": [0.0372, 0.0532, 0.0870],
    "ws_token": [1.22, 1.23, 1.27], "ws_block": [1.24, 1.29, 1.34], "ws_gain": [0.0166, 0.0424, 0.0607],
})


def paper_points(metric: str = "be") -> pd.DataFrame:
    """Sun et al. 2025's ``metric`` ("be" or "ws") as rows (temperature, gamma = 8, token, block) for plots."""
    if metric not in ("be", "ws"):
        raise ValueError(f"metric must be 'be' or 'ws' (the paper reports no other), got {metric!r}")
    return pd.DataFrame({"temperature": PAPER_TABLE["temperature"], "gamma": 8,
                         "token": PAPER_TABLE[f"{metric}_token"], "block": PAPER_TABLE[f"{metric}_block"]})


def speculative_records(records: pd.DataFrame) -> pd.DataFrame:
    """The speculative rows (baseline rows dropped)."""
    return records[records["verifier"] != AUTOREGRESSIVE]


def prompt_sums(records: pd.DataFrame) -> pd.DataFrame:
    """Per-prompt sums of the columns the metrics need. -> DataFrame indexed by prompt_id, [P, 7]."""
    return records.groupby("prompt_id")[_SUM_COLUMNS].sum().astype(float)


def metric_value(sums, metric: str) -> np.ndarray:
    """A metric from summed columns: ``sums`` a [..., 7] array or Series/DataFrame with ``_SUM_COLUMNS``."""
    s = dict(zip(_SUM_COLUMNS, np.moveaxis(np.asarray(sums, dtype=float), -1, 0)))
    with np.errstate(divide="ignore", invalid="ignore"):
        values = {
            "be": (s["accepted_tokens"] + s["target_calls"]) / s["target_calls"],
            "be_emitted": s["new_tokens"] / s["target_calls"],
            "ws": (s["ar_seconds"] / s["ar_tokens"]) / (s["seconds"] / s["new_tokens"]),
            "alpha": s["accepted_tokens"] / s["examined_drafts"],
        }
    if metric not in values:
        raise ValueError(f"metric must be one of {METRICS}, got {metric!r}")
    return values[metric]


def bootstrap_weights(num_prompts: int, n_boot: int = 2000, seed: int = 0) -> np.ndarray:
    """How often each prompt is drawn in each resample (multinomial, n = num_prompts). -> [n_boot, P]."""
    if num_prompts < 1 or n_boot < 1:
        raise ValueError(f"num_prompts and n_boot must be >= 1, got {num_prompts} and {n_boot}")
    return np.random.default_rng(seed).multinomial(num_prompts, np.full(num_prompts, 1 / num_prompts), n_boot)


def _interval(samples: np.ndarray, level: float) -> tuple[float, float]:
    """Percentile interval of bootstrap ``samples [n_boot]`` (NaN resamples, e.g. 0/0, ignored)."""
    tail = 100 * (1 - level) / 2
    if np.isnan(samples).all():
        return float("nan"), float("nan")
    low, high = np.nanpercentile(samples, [tail, 100 - tail])
    return float(low), float(high)


def _estimate(sums: pd.DataFrame, metric: str, weights: np.ndarray, level: float) -> tuple[float, float, float]:
    """Point estimate and bootstrap interval of ``metric`` from per-prompt ``sums [P, 7]``."""
    point = float(metric_value(sums.sum().to_numpy(), metric))
    return (point, *_interval(metric_value(weights @ sums.to_numpy(), metric), level))


def metric_table(records: pd.DataFrame, by: Sequence[str] = ("verifier", "temperature", "gamma"),
                 metrics: Sequence[str] = ("be", "ws", "alpha"), *, n_boot: int = 2000, seed: int = 0,
                 level: float = 0.95) -> pd.DataFrame:
    """``metrics`` with bootstrap intervals per group of speculative records.

    Returns one row per group: the ``by`` columns, ``<metric>``, ``<metric>_lo``, ``<metric>_hi`` for each
    metric, ``prompts`` and ``runs``.
    """
    rows = []
    for keys, group in speculative_records(records).groupby(list(by), sort=True):
        sums = prompt_sums(group)
        weights = bootstrap_weights(len(sums), n_boot, seed)
        row = dict(zip(by, keys if isinstance(keys, tuple) else (keys,)), prompts=len(sums), runs=len(group))
        for metric in metrics:
            row[metric], row[f"{metric}_lo"], row[f"{metric}_hi"] = _estimate(sums, metric, weights, level)
        rows.append(row)
    return pd.DataFrame(rows)


def _paired_gain(base: pd.DataFrame, treated: pd.DataFrame, metric: str, weights: np.ndarray, level: float):
    """treated / base - 1 of ``metric`` and its paired bootstrap interval (rows: the same prompts)."""
    point = metric_value(treated.sum().to_numpy(), metric) / metric_value(base.sum().to_numpy(), metric) - 1
    samples = metric_value(weights @ treated.to_numpy(), metric) / metric_value(weights @ base.to_numpy(), metric)
    return (float(point), *_interval(samples - 1, level))


def gain_table(records: pd.DataFrame, by: Sequence[str] = ("temperature", "gamma"),
               metrics: Sequence[str] = ("be", "ws"), *, baseline: str = "token", treatment: str = "block", n_boot: int = 2000, seed: int = 0,
               level: float = 0.95) -> pd.DataFrame:
    """Relative gain ``treatment / baseline - 1`` per group, with a paired bootstrap over the shared prompts.

    Returns per group: ``by``, then for each metric ``<metric>_<baseline>``, ``<metric>_<treatment>``,
    ``<metric>_gain``, ``<metric>_gain_lo``, ``<metric>_gain_hi``; and ``prompts`` (those in both).
    """
    rows = []
    for keys, group in speculative_records(records).groupby(list(by), sort=True):
        base = prompt_sums(group[group["verifier"] == baseline])
        treated = prompt_sums(group[group["verifier"] == treatment])
        shared = base.index.intersection(treated.index)
        if shared.empty:
            continue
        base, treated = base.loc[shared], treated.loc[shared]
        weights = bootstrap_weights(len(shared), n_boot, seed)
        row = dict(zip(by, keys if isinstance(keys, tuple) else (keys,)), prompts=len(shared))
        for metric in metrics:
            row[f"{metric}_{baseline}"] = float(metric_value(base.sum().to_numpy(), metric))
            row[f"{metric}_{treatment}"] = float(metric_value(treated.sum().to_numpy(), metric))
            row[f"{metric}_gain"], row[f"{metric}_gain_lo"], row[f"{metric}_gain_hi"] = _paired_gain(
                base, treated, metric, weights, level)
        rows.append(row)
    return pd.DataFrame(rows)


def paired_difference(rows: pd.DataFrame, treated: str, base: str, column: str, *, by: str = "run",
                      key: Sequence[str] = ("prompt_id",), n_boot: int = 4000, seed: int = 0,
                      level: float = 0.95) -> dict:
    """Mean over the shared prompts of ``column`` (treated - base), rows where ``rows[by]`` is ``treated`` / ``base``
    matched on ``key``, with a percentile bootstrap interval over those prompts (``bootstrap_weights``).
    -> {"mean", "low", "high", "prompts"}."""
    a = rows[rows[by] == treated].set_index(list(key))[column]
    b = rows[rows[by] == base].set_index(list(key))[column]
    shared = a.index.intersection(b.index)
    if shared.empty:
        raise ValueError(f"no prompt has both {treated!r} and {base!r}")
    diff = (a.loc[shared] - b.loc[shared]).to_numpy()
    boots = bootstrap_weights(len(diff), n_boot, seed) @ diff / len(diff)
    low, high = _interval(boots, level)
    return {"mean": float(diff.mean()), "low": low, "high": high, "prompts": len(diff)}


def paired_gain(treated, base, *, n_boot: int = 4000, seed: int = 0, level: float = 0.95) -> dict:
    """sum(treated) / sum(base) - 1 over prompts (arrays aligned by prompt), with a percentile bootstrap interval over
    the prompts (``bootstrap_weights``). -> {"gain", "low", "high", "prompts"}."""
    treated, base = np.asarray(treated, dtype=float), np.asarray(base, dtype=float)
    if treated.shape != base.shape or treated.ndim != 1 or not len(base):
        raise ValueError(f"treated and base must be 1-D arrays of one value per prompt, got {treated.shape} and {base.shape}")
    weights = bootstrap_weights(len(base), n_boot, seed)
    low, high = _interval(weights @ treated / (weights @ base) - 1, level)
    return {"gain": float(treated.sum() / base.sum() - 1), "low": low, "high": high, "prompts": len(base)}


def pooled_speed(seconds, tokens, base_seconds, base_tokens, *, n_boot: int = 2000, seed: int = 0,
                 level: float = 0.95) -> dict:
    """Tokens per second over the base's, pooled: (sum base_seconds / sum base_tokens) / (sum seconds / sum tokens),
    from one value per prompt in each array, with a percentile bootstrap interval over the prompts
    (``bootstrap_weights``). -> {"speed", "low", "high", "prompts"}."""
    arrays = [np.asarray(v, dtype=float) for v in (seconds, tokens, base_seconds, base_tokens)]
    if len({a.shape for a in arrays}) != 1 or arrays[0].ndim != 1 or not len(arrays[0]):
        raise ValueError(f"give one value per prompt in each array, got shapes {[a.shape for a in arrays]}")
    values = np.stack(arrays, 1)  # [P, 4]
    pooled = bootstrap_weights(len(values), n_boot, seed) @ values  # [n_boot, 4]
    low, high = _interval((pooled[:, 2] / pooled[:, 3]) / (pooled[:, 0] / pooled[:, 1]), level)
    total = values.sum(0)
    speed = (total[2] / total[3]) / (total[0] / total[1])
    return {"speed": float(speed), "low": low, "high": high, "prompts": len(values)}


def paper_table(records: pd.DataFrame, gamma: int | None = None, **bootstrap) -> pd.DataFrame:
    """Sun et al. 2025's table on our records: one row per temperature at ``gamma`` (default: the largest).

    Columns: temperature, gamma, be_token, be_block, be_gain (+ _lo/_hi), ws_token, ws_block, ws_gain
    (+ _lo/_hi), alpha (token-verification rows, with _lo/_hi), prompts.
    """
    spec = speculative_records(records)
    gamma = int(spec["gamma"].max()) if gamma is None else gamma
    at_gamma = spec[spec["gamma"] == gamma]
    gains = gain_table(at_gamma, by=("temperature",), **bootstrap)
    if gains.empty:
        raise ValueError(f"records: no (temperature, gamma={gamma}) with both token and block rows")
    alpha = metric_table(at_gamma[at_gamma["verifier"] == "token"], by=("temperature",), metrics=("alpha",),
                         **bootstrap)
    table = gains.merge(alpha[["temperature", "alpha", "alpha_lo", "alpha_hi"]], on="temperature", how="left")
    table.insert(1, "gamma", gamma)
    return table


_EXPECTED_COLUMNS = ["expected_token", "expected_block", "target_calls", "overlap_sum"]


def _expected_be(sums: np.ndarray, method: str) -> np.ndarray:
    """Expected BE of ``method`` from summed ``_EXPECTED_COLUMNS`` (``[..., 4]``)."""
    index = _EXPECTED_COLUMNS.index(f"expected_{method}")
    with np.errstate(divide="ignore", invalid="ignore"):
        return (sums[..., index] + sums[..., 2]) / sums[..., 2]


def expected_gain_table(records: pd.DataFrame, by: Sequence[str] = ("temperature", "gamma"),
                        trajectories: Sequence[str] | None = None, *, n_boot: int = 2000, seed: int = 0,
                        level: float = 0.95) -> pd.DataFrame:
    """Expected BE of token and block on the same steps and the paired expected gain (module docstring).

    Args:
        records: bench records with the ``expected_*`` columns (rows without them are dropped).
        by: grouping columns.
        trajectories: the verifiers whose runs supply the steps (default: every verifier in the records).
    Returns one row per group: ``by``, ``be_token_exp``, ``be_block_exp``, ``exp_gain`` (+ ``_lo``/``_hi``:
    paired percentile bootstrap over prompts); ``be_token_own``, ``be_block_own``, ``own_gain`` (+ ``_lo``/
    ``_hi``): each verifier's expected BE on its own runs' steps only, i.e. the paper's comparison with the
    coins' noise removed per step (NaN unless both verifiers ran on every prompt); ``alpha_overlap`` (mean
    over steps of the block's mean sum_x min(p_i, q_i)), ``steps`` and ``prompts``.
    """
    spec = speculative_records(records).dropna(subset=["expected_token", "expected_block"])
    if trajectories is not None:
        spec = spec[spec["verifier"].isin(list(trajectories))]
    rows = []
    for keys, group in spec.groupby(list(by), sort=True):
        sums = group.groupby("prompt_id")[_EXPECTED_COLUMNS].sum().astype(float).to_numpy()  # [P, 4]
        total, weights = sums.sum(0), bootstrap_weights(len(sums), n_boot, seed)
        resampled = weights @ sums  # [n_boot, 4]
        gain = _expected_be(resampled, "block") / _expected_be(resampled, "token") - 1
        row = dict(zip(by, keys if isinstance(keys, tuple) else (keys,)))
        row.update(be_token_exp=float(_expected_be(total, "token")), be_block_exp=float(_expected_be(total, "block")))
        row["exp_gain"] = row["be_block_exp"] / row["be_token_exp"] - 1
        row["exp_gain_lo"], row["exp_gain_hi"] = _interval(gain, level)
        row.update(_own_trajectory_gain(group, weights, level))
        row.update(alpha_overlap=float(total[3] / total[2]), steps=int(total[2]), prompts=len(sums))
        rows.append(row)
    return pd.DataFrame(rows)


def _own_trajectory_gain(group: pd.DataFrame, weights: np.ndarray, level: float) -> dict:
    """Each verifier's expected BE on its OWN runs' steps (the paper's comparison, coins' noise removed per
    step) and their ratio - 1 with the paired bootstrap ``weights``; NaN unless both verifiers ran on
    every prompt of ``group``."""
    prompts = sorted(group["prompt_id"].unique())
    sums = {}
    for method in ("token", "block"):
        own = group[group["verifier"] == method].groupby("prompt_id")[[f"expected_{method}", "target_calls"]].sum()
        if set(own.index) != set(prompts):
            return {"be_token_own": float("nan"), "be_block_own": float("nan"), "own_gain": float("nan"),
                    "own_gain_lo": float("nan"), "own_gain_hi": float("nan")}
        sums[method] = own.loc[prompts].astype(float).to_numpy()  # [P, 2]
    be = {m: (v.sum(0)[0] + v.sum(0)[1]) / v.sum(0)[1] for m, v in sums.items()}
    resampled = {m: weights @ v for m, v in sums.items()}  # [n_boot, 2]
    samples = {m: (r[:, 0] + r[:, 1]) / r[:, 1] for m, r in resampled.items()}
    low, high = _interval(samples["block"] / samples["token"] - 1, level)
    return {"be_token_own": float(be["token"]), "be_block_own": float(be["block"]),
            "own_gain": float(be["block"] / be["token"] - 1), "own_gain_lo": low, "own_gain_hi": high}


def summary(records: pd.DataFrame, **bootstrap) -> str:
    """The Markdown tables that make sense for the verifiers present in ``records`` (what ``bench`` prints).

    Token and block both present: ``paper_table`` at the largest gamma where both ran, then the realised
    and expected gains per (temperature, gamma). Otherwise: BE and alpha per (verifier, temperature,
    gamma) (WS too when timed), and the expected BE of token and block on those runs' steps. Under
    ``FEW_PROMPTS`` prompts a line says that the intervals undercover."""
    spec = speculative_records(records)
    if spec.empty:
        return "no speculative records"
    parts = []
    timed = bool(spec["seconds"].notna().any())
    both = spec.groupby("gamma")["verifier"].agg(lambda v: {"token", "block"} <= set(v))
    if both.any():
        parts.append(format_paper_table(paper_table(records, gamma=int(both[both].index.max()), **bootstrap)))
    else:
        metrics = ("be", "ws", "alpha") if timed else ("be", "alpha")
        parts.append(format_markdown(metric_table(records, metrics=metrics, **bootstrap)))
    if "expected_token" in spec and spec["expected_token"].notna().any():
        table = expected_gain_table(records, **bootstrap)
        parts.append("Expected BE given each drafted block (both verifiers on the same steps):\n"
                     + format_markdown(table, percent=("exp_gain", "exp_gain_lo", "exp_gain_hi")))
    if (prompts := spec["prompt_id"].nunique()) < FEW_PROMPTS:  # the bootstrap's spread shrinks by sqrt((P - 1) / P)
        parts.append(f"({prompts} prompts: intervals from resampling so few cover well below 95 %)")
    return "\n\n".join(parts)


def two_symbol_gain(alpha: float, gamma: int) -> tuple[float, float]:
    """(token BE, block BE) of the i.i.d. two-symbol family p = (1 - alpha/2, alpha/2), q = (alpha/2,
    1 - alpha/2), whose acceptance rate is alpha (the two-symbol post's example is alpha = 2/3).

    Exact up to float64: the mean over all 2^gamma draft blocks, weighted by q(block), of
    ``verify.expected_num_accepted`` (the identity ``tests/test_expected.py`` proves by enumeration).
    """
    import itertools

    import torch

    from specresearch.core.verify import expected_num_accepted

    if not 0 < alpha <= 1:
        raise ValueError(f"alpha must be in (0, 1], got {alpha!r}")
    target = torch.tensor([1 - alpha / 2, alpha / 2], dtype=torch.float64)
    draft = torch.tensor([alpha / 2, 1 - alpha / 2], dtype=torch.float64)
    tokens = torch.tensor(list(itertools.product((0, 1), repeat=gamma)))  # [2^gamma, gamma]
    weight = draft[tokens].prod(-1)  # [2^gamma]
    rows = (len(tokens), gamma)
    result = []
    for method in ("token", "block"):
        expected = expected_num_accepted(target.expand(rows[0], gamma + 1, 2), draft.expand(*rows, 2), tokens, method)
        result.append(1 + float((weight * expected).sum()))
    return result[0], result[1]


def two_symbol_curve(gammas: Sequence[int] = (4, 8), alphas: Sequence[float] | None = None) -> pd.DataFrame:
    """``two_symbol_gain`` on a grid: rows (gamma, alpha, be_token, be_block, gain = block / token - 1)."""
    alphas = np.linspace(0.05, 1.0, 39) if alphas is None else alphas
    rows = []
    for gamma in gammas:
        for alpha in alphas:
            token, block = two_symbol_gain(float(alpha), gamma)
            rows.append({"gamma": gamma, "alpha": float(alpha), "be_token": token, "be_block": block,
                         "gain": block / token - 1})
    return pd.DataFrame(rows)


def read_sweep(directory: str | os.PathLike) -> pd.DataFrame:
    """Every ``*.csv`` of record files in ``directory`` (e.g. one per draft, ``run_id`` = the draft), concatenated."""
    frames = [read_records(path) for path in sorted(Path(directory).glob("*.csv"))]
    if not frames:
        raise ValueError(f"directory {directory} holds no *.csv record files")
    return pd.concat(frames, ignore_index=True)


def gain_vs_alpha_table(records: pd.DataFrame, by: Sequence[str] = ("run_id", "temperature", "gamma"),
                        **bootstrap) -> pd.DataFrame:
    """Per group: the realised BE gain (``gain_table``, BE only) beside the expected gain on the same steps
    (``expected_gain_table``) and the measured alpha (``alpha_overlap``): what ``plot_gain_vs_alpha`` draws."""
    realised = gain_table(records, by=by, metrics=("be",), **bootstrap)
    expected = expected_gain_table(records, by=by, **bootstrap).drop(columns="prompts")
    return realised.merge(expected, on=list(by), how="inner")


def paper_alpha(gamma: int = 8) -> pd.Series:
    """The alpha implied by the token BE of Sun et al. 2025 (arXiv 2403.10444) at ``gamma`` under i.i.d. acceptances: the root of
    (1 - alpha^(gamma+1)) / (1 - alpha) = BE (the paper reports no alpha). One value per temperature."""
    from scipy.optimize import brentq

    def implied(be):
        return brentq(lambda a: sum(a**k for k in range(gamma + 1)) - be, 1e-9, 1 - 1e-9)

    return PAPER_TABLE["be_token"].map(implied).rename("alpha")


def category_table(records: pd.DataFrame, gamma: int | None = None, temperature: float | None = None,
                   **bootstrap) -> pd.DataFrame:
    """Block-vs-token gain per category (rows category x temperature) at ``gamma`` (default: the largest);
    optionally one ``temperature``. Intervals resample the category's own prompts (few: wide)."""
    spec = speculative_records(records)
    gamma = int(spec["gamma"].max()) if gamma is None else gamma
    chosen = spec[spec["gamma"] == gamma]
    if temperature is not None:
        chosen = chosen[chosen["temperature"] == temperature]
    return gain_table(chosen, by=("category", "temperature"), **bootstrap)


def t0_agreement(records: pd.DataFrame) -> tuple[int, int]:
    """At T = 0: (units whose verifiers produced identical tokens, units). Should be equal (greedy)."""
    spec = speculative_records(records)
    zero = spec[spec["temperature"] == 0]
    hashes = zero.groupby(["prompt_id", "gamma", "seed"])["output_hash"].nunique()
    return int((hashes == 1).sum()), int(len(hashes))


def _format_cell(value, kind: str) -> str:
    if isinstance(value, str):
        return value
    if value is None or (isinstance(value, float) and np.isnan(value)):
        return "-"
    return f"{100 * value:+.1f}%" if kind == "percent" else f"{value:.3f}" if kind == "float" else str(value)


def format_markdown(table: pd.DataFrame, percent: Sequence[str] = (), floatfmt: str = "float") -> str:
    """A DataFrame as a Markdown table (floats to 3 decimals; ``percent`` columns as +x.x%)."""
    header = "| " + " | ".join(map(str, table.columns)) + " |"
    lines = [header, "|" + "---|" * len(table.columns)]
    for row in table.itertuples(index=False):
        cells = [_format_cell(v, "percent" if c in percent else (floatfmt if isinstance(v, float) else "other"))
                 for c, v in zip(table.columns, row)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _with_interval(value, low, high, percent: bool) -> str:
    if percent:
        return f"{100 * value:+.1f}% [{100 * low:+.1f}, {100 * high:+.1f}]"
    return f"{value:.3f} [{low:.3f}, {high:.3f}]"


def format_paper_table(table: pd.DataFrame) -> str:
    """``paper_table`` output as Markdown in the layout of Sun et al. 2025 (arXiv 2403.10444; gains with 95% intervals); the WS
    columns are left out when no run was timed (batched sweeps)."""
    rows = []
    timed = bool(table["ws_token"].notna().any())
    for r in table.to_dict("records"):
        rows.append({
            "T": f"{r['temperature']:g}", "gamma": str(r["gamma"]),
            "BE token": f"{r['be_token']:.3f}", "BE block": f"{r['be_block']:.3f}",
            "BE gain [95% CI]": _with_interval(r["be_gain"], r["be_gain_lo"], r["be_gain_hi"], True),
            "WS token": f"{r['ws_token']:.3f}", "WS block": f"{r['ws_block']:.3f}",
            "WS gain [95% CI]": _with_interval(r["ws_gain"], r["ws_gain_lo"], r["ws_gain_hi"], True),
            "alpha (token)": _with_interval(r["alpha"], r["alpha_lo"], r["alpha_hi"], False),
            "prompts": str(r["prompts"]),
        })
    frame = pd.DataFrame(rows)
    return format_markdown(frame if timed else frame.drop(columns=["WS token", "WS block", "WS gain [95% CI]"]))


def latest_run(results_dir: str | os.PathLike = "results", exclude_prefix: str = "quick-") -> Path | None:
    """The most recently modified ``<results_dir>/*.csv`` whose name does not start with ``exclude_prefix``."""
    runs = [p for p in Path(results_dir).glob("*.csv") if not p.name.startswith(exclude_prefix)]
    return max(runs, key=lambda p: p.stat().st_mtime) if runs else None


_STYLES = {"token": ("s", "--", -0.08), "block": ("D", "-", 0.08)}  # marker, line style, x offset


def plot_metric_vs_gamma(table: pd.DataFrame, metric: str, label: str, paper: pd.DataFrame | None = None):
    """One panel per temperature: ``metric`` vs gamma, one line per verifier with its bootstrap interval (the table's
    level, 95% by default), integer gamma ticks, the legend above the panels.

    ``table``: ``metric_table(records)`` output. ``paper``: optional rows (temperature, gamma, token,
    block) drawn as open markers. Returns the matplotlib figure.
    """
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    temperatures = sorted(table["temperature"].unique())
    fig, axes = plt.subplots(1, len(temperatures), figsize=(3.2 * len(temperatures), 3.6), sharey=True, squeeze=False)
    for ax, temperature in zip(axes[0], temperatures):
        for verifier, rows in table[table["temperature"] == temperature].groupby("verifier"):
            rows = rows.sort_values("gamma")
            err = [rows[metric] - rows[f"{metric}_lo"], rows[f"{metric}_hi"] - rows[metric]]
            style = _STYLES.get(verifier, ("o", "-", 0.0))  # token dashed and shifted: visible under block
            ax.errorbar(rows["gamma"] + style[2], rows[metric], yerr=err, marker=style[0], ls=style[1], capsize=3,
                        label=f"{verifier} (ours)")
        if paper is not None:
            for verifier, marker in (("token", "s"), ("block", "D")):
                hit = paper[paper["temperature"] == temperature]
                ax.plot(hit["gamma"], hit[verifier], marker, mfc="none", label=f"{verifier} (paper, Vicuna)")
        ax.set_title(f"T = {temperature:g}")
        ax.set_xlabel("gamma (draft tokens per step)")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # gamma is an integer
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel(f"{label}\nbars: 95% bootstrap interval over prompts")
    handles, labels = axes[0][-1].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=8, loc="upper center", ncol=min(4, len(labels)), bbox_to_anchor=(0.5, 1.0))
    fig.tight_layout(rect=(0, 0, 1, 0.88))  # the legend sits above the panels, off the data
    return fig


def plot_gain_vs_alpha(table: pd.DataFrame, theory: pd.DataFrame | None = None, paper: bool = True,
                       column: str = "exp_gain"):
    """BE gain of block over token (``column``: ``exp_gain`` or ``be_gain``, with ``_lo``/``_hi``) against the
    measured alpha, one panel per gamma, one colour per temperature.

    ``table``: rows with ``gamma``, ``temperature``, ``alpha_overlap`` and the gain columns (e.g.
    ``expected_gain_table`` merged with ``gain_table``). ``theory``: rows (gamma, alpha, gain) drawn as a
    line (e.g. ``two_symbol_gain``). ``paper``: the three gains of Sun et al. 2025 (arXiv 2403.10444) (gamma = 8) at the alpha their
    token BE implies (``paper_alpha``). Returns the matplotlib figure.
    """
    import matplotlib.pyplot as plt

    gammas = sorted(table["gamma"].unique())
    drafts = sorted(table["run_id"].unique()) if "run_id" in table else [None]
    markers = dict(zip(drafts, "osD^v<>pP*"))
    colours = {t: f"C{i}" for i, t in enumerate(sorted(table["temperature"].unique()))}
    fig, axes = plt.subplots(1, len(gammas), figsize=(5.5 * len(gammas), 4.2), sharey=True, squeeze=False)
    for ax, gamma in zip(axes[0], gammas):
        rows = table[table["gamma"] == gamma]
        for (draft, temperature), group in rows.groupby([rows.get("run_id", pd.Series(None, index=rows.index)),
                                                         "temperature"], dropna=False):
            value, low, high = (100 * group[f"{column}{s}"] for s in ("", "_lo", "_hi"))
            ax.errorbar(group["alpha_overlap"], value, yerr=[value - low, high - value], marker=markers.get(draft, "o"),
                        color=colours[temperature], ls="none", capsize=3)
        for temperature, colour in colours.items():
            ax.plot([], [], "o", color=colour, label=f"SmolLM2, T = {temperature:g}")
        for draft, marker in markers.items():
            if draft is not None:
                label = f"draft {draft}" + (" (runs the target: BE only)" if str(draft).startswith("dial-") else "")
                ax.plot([], [], marker, color="grey", mfc="none", label=label)
        if theory is not None:
            curve = theory[theory["gamma"] == gamma].sort_values("alpha")
            ax.plot(curve["alpha"], 100 * curve["gain"], "k-", lw=1, label="i.i.d. two-symbol family (exact)")
        if paper and gamma == 8:
            ax.plot(paper_alpha(8), 100 * PAPER_TABLE["be_gain"], "k*", ms=11,
                    label="paper, T = 0.2/0.6/1.0 (alpha implied by BE)")
        ax.axhline(0, color="grey", lw=0.8)
        ax.set_title(f"gamma = {gamma}")
        ax.set_xlabel("alpha (measured mean sum_x min(p, q))")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("BE gain of block over token (%)")
    fig.tight_layout()
    return fig


def plot_gain_vs_temperature(gains: pd.DataFrame, metric: str = "be", paper: bool = True):
    """Relative gain of block over token verification vs temperature, one line per gamma, with intervals.

    ``gains``: ``gain_table(records)`` output (by temperature and gamma). ``paper``: add the three gains of Sun et al. 2025
    (arXiv 2403.10444; gamma = 8). Returns the matplotlib figure.
    """
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    gammas = sorted(gains["gamma"].unique())
    for offset, gamma in zip(np.linspace(-0.02, 0.02, len(gammas)), gammas):
        rows = gains[gains["gamma"] == gamma].sort_values("temperature")
        value, low, high = (100 * rows[f"{metric}_gain{s}"] for s in ("", "_lo", "_hi"))
        ax.errorbar(rows["temperature"] + offset, value, yerr=[value - low, high - value], marker="o", capsize=3,
                    label=f"gamma = {gamma} (ours)")
    if paper:
        ax.plot(PAPER_TABLE["temperature"], 100 * PAPER_TABLE[f"{metric}_gain"], "k*", ms=10,
                label="paper (Vicuna-7B/68M, gamma = 8)")
    ax.axhline(0, color="grey", lw=0.8)
    ax.set_xlabel("temperature T")
    ax.set_ylabel(f"{metric.upper()} gain of block over token (%)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig
