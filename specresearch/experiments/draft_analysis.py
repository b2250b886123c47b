"""Trained drafts compared: acceptance per depth, data scaling, predicted and measured speed-up.

Records in, tables and figures out (the experiments room of docs/README.md, "Layout"). The records are
the manifests the training commands write (``specresearch distill`` / ``feature-distill``, shipped under
``data/drafts/`` or kept by ``benchmarks/run_data_scaling.py``) and the JSON lines of
``benchmarks/bench_wallclock.py``. Notation: alpha_d = acceptance rate of the d-th drafted token after
the last verified one, c = one draft step / one target forward.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd

__all__ = ["expected_tokens", "best_speedup", "speedup_curve", "read_draft_manifest", "corpus_spans", "read_scaling", "read_wallclock",
           "wallclock_table", "pooled_speeds", "speedup_intervals", "free_draft_rows", "best_gammas", "gamma1_costs", "plot_acceptance_by_depth", "plot_data_scaling",
           "plot_speedup_vs_gamma", "plot_speedup_by_category", "plot_alpha_cost_tradeoff", "plot_speedup_intervals",
           "plot_tau_against_speed"]


def expected_tokens(alphas: Sequence[float], gamma: int) -> float:
    """Tokens per target call with gamma drafted tokens: 1 + sum_{k<=gamma} prod_{i<=k} alpha_i (acceptance of
    depth i given depths < i accepted; a distilled LM's one alpha at every depth gives Leviathan et al.'s formula)."""
    if not 0 <= gamma <= len(alphas):
        raise ValueError(f"gamma must be in [0, {len(alphas)}] (the depths measured), got {gamma}")
    total, product = 1.0, 1.0
    for alpha in alphas[:gamma]:
        if not 0 <= alpha <= 1:
            raise ValueError(f"alphas must lie in [0, 1], got {alpha}")
        product *= alpha
        total += product
    return total


def speedup_curve(alphas: Sequence[float], c: float, score_cost: dict[int, float] | None = None,
                  gammas: Sequence[int] | None = None, tokens_per_step: Sequence[float] | None = None) -> list[tuple[int, float, float]]:
    """``(gamma, expected tokens per call E, predicted speed-up E / (r_{gamma+1} + gamma c))`` for each gamma
    of ``gammas`` (default 1..len(alphas); each at most len(alphas)).

    ``score_cost``: r_k = one target call scoring k tokens / one scoring 1 token (``bench.score_seconds``);
    None takes r_k = 1, Leviathan et al.'s model (verification costs one forward whatever gamma).
    ``tokens_per_step``: E at gamma 1..len(alphas) measured otherwise (the loop's expectations along the
    target's sequences, ``feature_distill.loop_expectations``), in place of :func:`expected_tokens`.
    """
    if tokens_per_step is not None and (len(tokens_per_step) != len(alphas) or any(not t >= 1 for t in tokens_per_step)):
        raise ValueError(f"tokens_per_step must hold one value >= 1 per depth ({len(alphas)}), got {list(tokens_per_step)}")
    if not c >= 0:
        raise ValueError(f"c must be >= 0, got {c}")
    gammas = range(1, len(alphas) + 1) if gammas is None else gammas
    if any(not 1 <= g <= len(alphas) for g in gammas):
        raise ValueError(f"gammas must lie in 1..{len(alphas)} (one alpha per depth), got {list(gammas)}")
    if score_cost is not None and any(g + 1 not in score_cost for g in gammas):
        raise ValueError(f"score_cost needs r_k for k = gamma + 1 at every gamma of {list(gammas)}, has {sorted(score_cost)}")
    rows = []
    for g in gammas:
        r = 1.0 if score_cost is None else score_cost[g + 1]
        tokens = expected_tokens(alphas, g) if tokens_per_step is None else tokens_per_step[g - 1]
        rows.append((g, tokens, tokens / (r + g * c)))
    return rows


def best_speedup(alphas: Sequence[float], c: float, score_cost: dict[int, float] | None = None) -> tuple[int, float]:
    """The best gamma <= len(alphas) and its predicted speed-up (:func:`speedup_curve`)."""
    gamma, _, speedup = max(speedup_curve(alphas, c, score_cost), key=lambda row: row[2])
    return gamma, speedup


def read_draft_manifest(path: str | os.PathLike, depths: int = 4) -> dict:
    """One trained draft's manifest (a draft directory or its ``manifest.json``), in one shape for both kinds.

    Returns ``name``, ``kind`` ("feature" or "distilled LM"), ``alpha_by_depth`` (temperature string ->
    alphas at depths 1..; a distilled LM's one alpha repeated ``depths`` times), ``greedy_by_depth``,
    ``c``, ``tokens`` (corpus tokens), ``steps``, ``passes`` (steps x batch size / corpus sequences: how
    often training saw each sequence; None if the manifest does not say) and ``loop_tokens_by_gamma``
    (temperature string, "0.0" greedy -> the token-verification loop's expected tokens per step at gamma
    1..; None if not measured). A head that continued training a saved head (``feature-distill
    --init-from``; ``continued`` True) counts the corpus tokens and steps of every head in its chain
    (their chunks are disjoint, else ``ValueError``); its ``passes`` are None (old and new chunks were
    seen unequally often).
    """
    from specresearch.drafts.store import (
        manifest_path,  # here: this module's plots need no torch until a manifest is read
    )

    path = Path(path)
    file = manifest_path(path) if path.is_dir() else path
    if not file.is_file():
        raise ValueError(f"{str(file)!r} is not a draft manifest")
    manifest = json.loads(file.read_text())
    measurement = manifest.get("measurement")
    if measurement is None:
        raise ValueError(f"{file} has no measurement (training not finished?)")
    if "alpha_by_depth" in measurement:
        kind, by_depth, greedy = "feature", measurement["alpha_by_depth"], measurement["greedy_agreement_by_depth"]
    else:
        kind = "distilled LM"
        by_depth = {t: [a] * depths for t, a in measurement["alpha"].items()}
        greedy = [measurement["greedy_agreement"]] * depths
    name = (manifest.get("feature_head_config") or manifest.get("draft_config") or {}).get("name", file.parent.name)
    steps, batch, sequences = manifest["training"]["steps"], manifest.get("train_config", {}).get("batch_size"), manifest["corpus"].get("sequences")
    passes = steps * batch / sequences if batch and sequences else None
    tokens, chain = manifest["corpus"]["generated_tokens"], _continued_chain(manifest, file)
    for earlier in chain:
        tokens, steps, passes = tokens + earlier["corpus"]["generated_tokens"], steps + earlier["training_steps"], None
    return {"name": name, "kind": kind, "alpha_by_depth": by_depth, "greedy_by_depth": greedy, "c": manifest["cost"]["c"],
            "tokens": tokens, "steps": steps, "passes": passes, "continued": bool(chain), "file": str(file),
            "loop_tokens_by_gamma": measurement.get("loop_tokens_per_step_by_gamma")}


def _init_chain(manifest: dict) -> list[dict]:
    """The ``init_from`` records of the heads ``manifest``'s head continued, latest first."""
    chain, record = [], manifest.get("init_from")
    while record:
        chain.append(record)
        record = record.get("init_from")
    return chain


def corpus_spans(manifest: dict) -> list[dict]:
    """The corpus chunks a trained draft learned from: ``{"prompts_file", "cache_key", "first_chunk", "end_chunk"}``
    for its own run and, for a head that continued saved heads (``feature-distill --init-from``), for each
    head of the chain, own run first. The chunk ranges are as recorded (end exclusive), not checked."""
    return [{"prompts_file": c.get("prompts_file"), "cache_key": c.get("cache_key"), "first_chunk": c.get("first_chunk", 0),
             "end_chunk": c.get("first_chunk", 0) + c["chunks"]}
            for c in [manifest["corpus"], *(r["corpus"] for r in _init_chain(manifest))]]


def _continued_chain(manifest: dict, file: Path) -> list[dict]:
    """The ``init_from`` records of the heads ``manifest``'s head continued, latest first; their corpus chunk
    ranges must be disjoint from each other and from the manifest's own."""
    chain = _init_chain(manifest)
    if not chain:
        return chain
    spans = [(s["cache_key"], s["first_chunk"], s["end_chunk"]) for s in corpus_spans(manifest)]
    for i, (key, start, stop) in enumerate(spans):
        if any(key == k and start < b and a < stop for k, a, b in spans[:i]):
            raise ValueError(f"{file}: the heads it continued trained on overlapping chunks of one corpus; corpus tokens unknown")
    return chain


def read_scaling(*sources: str | os.PathLike) -> pd.DataFrame:
    """The finished points of data-scaling runs: each source a directory (``benchmarks/run_data_scaling.py
    --out``: its ``*.json``; unfinished ones are passed over) or one draft manifest (a file or a draft
    directory). One row per manifest: kind, corpus tokens, steps, passes, continued (a head that continued
    a saved one: tokens and steps of its whole chain), depth-1 alpha at each temperature, greedy agreement and c."""
    if not sources:
        raise ValueError("read_scaling needs at least one directory or manifest")
    from specresearch.drafts.store import manifest_path

    manifests = []
    for source in map(Path, sources):
        if source.is_dir() and not manifest_path(source).is_file():
            for file in sorted(source.glob("*.json")):
                try:
                    manifests.append(read_draft_manifest(file))
                except ValueError:
                    continue
        else:
            manifests.append(read_draft_manifest(source))
    if not manifests:
        raise ValueError(f"no finished scaling manifest in {[str(s) for s in sources]!r}")
    rows = [{"kind": m["kind"], "tokens": m["tokens"], "steps": m["steps"], "passes": m["passes"], "continued": m["continued"],
             **{f"alpha_T{t}": a[0] for t, a in m["alpha_by_depth"].items()}, "greedy": m["greedy_by_depth"][0], "c": m["c"]}
            for m in manifests]
    return pd.DataFrame(rows).sort_values(["kind", "tokens"]).reset_index(drop=True)


def read_wallclock(path: str | os.PathLike) -> tuple[pd.DataFrame, dict[int, float]]:
    """The generation runs of ``benchmarks/bench_wallclock.py`` (JSON lines) and the target's score cost
    r_k (the mean of its before / after timings of k tokens over those of 1 token; empty if not recorded).
    The record's ``machine`` row, if any, is left out."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    runs = [r for r in rows if r.get("method") not in ("target_score", "machine")]
    if not runs:
        raise ValueError(f"{str(path)!r} holds no generation runs")
    ms = {r["k"]: (r["ms_before"] + r["ms_after"]) / 2 for r in rows if r.get("method") == "target_score"}
    return pd.DataFrame(runs), ({k: v / ms[1] for k, v in ms.items()} if 1 in ms else {})


def wallclock_table(rows: pd.DataFrame, by: Sequence[str] = ("temperature",)) -> pd.DataFrame:
    """Speed-up over autoregressive decoding per ``by`` group, method and gamma: (sum tokens / sum seconds) of
    the method over that of the autoregressive runs of the same group, and the mean acceptance rate."""
    by = list(by)
    sums = rows.groupby(by + ["method", "gamma"], as_index=False).agg(tokens=("tokens", "sum"), seconds=("seconds", "sum"),
                                                                     acceptance_rate=("acceptance_rate", "mean"))
    sums["tokens_per_second"] = sums["tokens"] / sums["seconds"]
    base = sums[sums["method"] == "autoregressive"][by + ["tokens_per_second"]].rename(columns={"tokens_per_second": "ar_tokens_per_second"})
    if base.empty:
        raise ValueError("the rows hold no autoregressive baseline")
    out = sums.merge(base, on=by)
    out["vs_autoregressive"] = out["tokens_per_second"] / out["ar_tokens_per_second"]
    return out.drop(columns=["ar_tokens_per_second"])


def pooled_speeds(rows: pd.DataFrame, by: Sequence[str] = ("temperature", "run"), **bootstrap) -> pd.DataFrame:
    """Per ``by`` group: tokens per second over the paired autoregressive runs, pooled over prompts and repeats
    (columns ``prompt_id``, ``seconds``, ``tokens``, ``ar_seconds``, ``ar_tokens``, one row per run as the tree and
    adaptive benchmarks write them), with a 95 % bootstrap interval over the prompts (``analysis.pooled_speed``,
    imported here: it imports torch). -> columns ``by``, ``pooled``, ``low``, ``high``, ``prompts``."""
    from specresearch.experiments.analysis import pooled_speed

    out = []
    for key, cell in rows.groupby(list(by)):
        sums = cell.groupby("prompt_id")[["seconds", "tokens", "ar_seconds", "ar_tokens"]].sum()
        speed = pooled_speed(*sums.to_numpy().T, **bootstrap)
        key = key if isinstance(key, tuple) else (key,)
        out.append({**dict(zip(by, key)), "pooled": speed["speed"], "low": speed["low"], "high": speed["high"],
                    "prompts": speed["prompts"]})
    return pd.DataFrame(out)


def gamma1_costs(rows: pd.DataFrame, temperature: float) -> pd.DataFrame:
    """Each draft's gamma-1 runs at ``temperature`` in the units of one autoregressive token.

    Columns: ``alpha`` (mean acceptance rate), ``c`` (the draft's time per step over the autoregressive
    time per token), ``speedup`` (:func:`wallclock_table`) and ``extra`` = (1 + alpha) / speedup - 1 - c:
    what a step costs beyond one target call and one drafting step (the second scored token, the engine's
    own work, both prefills spread over the steps). A gamma-1 step yields 1 + alpha tokens on average, so
    speedup = (1 + alpha) / (1 + c + extra) holds by construction; ``extra`` is what makes it a model.
    """
    at = rows[rows["temperature"] == temperature]
    base = at[at["method"] == "autoregressive"]
    if base.empty:
        raise ValueError(f"no autoregressive runs at temperature {temperature}")
    ar_per_token = base["seconds"].sum() / base["tokens"].sum()
    runs = at[at["gamma"] == 1]
    if runs.empty:
        raise ValueError(f"no gamma-1 runs at temperature {temperature}")
    speed = wallclock_table(pd.concat([base, runs])).set_index("method")["vs_autoregressive"]
    out = runs.groupby("method", sort=False).agg(alpha=("acceptance_rate", "mean"), draft_seconds=("draft_seconds", "sum"),
                                                 steps=("steps", "sum")).reset_index()
    out["c"] = out["draft_seconds"] / out["steps"] / ar_per_token
    out["speedup"] = out["method"].map(speed)
    out["extra"] = (1 + out["alpha"]) / out["speedup"] - 1 - out["c"]
    return out[["method", "alpha", "c", "speedup", "extra"]]


def _prompt_sums(rows: pd.DataFrame, temperature: float) -> tuple[list[str], dict[tuple[str, int], np.ndarray]]:
    """Per-prompt (tokens, seconds) sums ``[P, 2]`` of each (method, gamma) at one temperature, prompts in one order."""
    part = rows[rows["temperature"] == temperature]
    prompts = sorted(part["prompt"].unique())
    sums = part.groupby(["method", "gamma", "prompt"])[["tokens", "seconds"]].sum()
    out = {}
    for (method, gamma), group in sums.groupby(level=["method", "gamma"]):
        frame = group.droplevel(["method", "gamma"]).reindex(prompts)
        if frame.isna().any().any():
            raise ValueError(f"{method} (gamma {gamma}) at T = {temperature} lacks some prompts; a paired bootstrap needs all")
        out[method, int(gamma)] = frame.to_numpy(dtype=float)
    if ("autoregressive", 0) not in out:
        raise ValueError(f"the rows hold no autoregressive baseline at T = {temperature}")
    return prompts, out


def speedup_intervals(rows: pd.DataFrame, pairs: Sequence[tuple[tuple[str, int], tuple[str, int]]] = (), *, n_boot: int = 1000,
                      seed: int = 0, level: float = 0.95) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Speed-up over autoregressive decoding with bootstrap intervals over the prompts, and paired differences.

    Speed-up = (sum tokens / sum seconds) of a (method, gamma) over that of autoregressive decoding on the same
    prompts, as :func:`wallclock_table`. Each resample draws the prompts with replacement (``analysis.bootstrap_weights``,
    ``n_boot`` resamples, ``seed``) and recomputes every speed-up on the same draw, so ``pairs`` ((method a, gamma
    a), (method b, gamma b)) get a paired interval of speed-up a - speed-up b.

    Returns ``(speedups, differences)``: per temperature, method, gamma: ``speedup``, ``low``, ``high``; per
    temperature and pair: ``a``, ``b``, ``difference``, ``low``, ``high``.
    """
    from specresearch.experiments.analysis import (
        bootstrap_weights,  # imports the bench (torch); only needed here
    )

    if not 0 < level < 1:
        raise ValueError(f"level must lie in (0, 1), got {level}")
    tail = 100 * (1 - level) / 2
    speedups, differences = [], []
    for temperature in sorted(rows["temperature"].unique()):
        prompts, sums = _prompt_sums(rows, temperature)
        weights = bootstrap_weights(len(prompts), n_boot, seed)  # [n_boot, P]

        def speed(key, w=None):
            tokens, seconds = (sums[key].sum(0) if w is None else w @ sums[key]).T
            return tokens / seconds

        base, base_samples = speed(("autoregressive", 0)), speed(("autoregressive", 0), weights)
        ratio = {key: (speed(key) / base, speed(key, weights) / base_samples) for key in sums if key[0] != "autoregressive"}
        for (method, gamma), (point, samples) in sorted(ratio.items()):
            low, high = np.percentile(samples, [tail, 100 - tail])
            speedups.append({"temperature": temperature, "method": method, "gamma": gamma, "speedup": float(point),
                             "low": float(low), "high": float(high), "prompts": len(prompts)})
        for a, b in pairs:
            missing = [key for key in (a, b) if key not in ratio]
            if missing:
                raise ValueError(f"pairs: {missing} not in the rows at T = {temperature}; have {sorted(ratio)}")
            low, high = np.percentile(ratio[a][1] - ratio[b][1], [tail, 100 - tail])
            differences.append({"temperature": temperature, "a": f"{a[0]} g{a[1]}", "b": f"{b[0]} g{b[1]}",
                                "difference": float(ratio[a][0] - ratio[b][0]), "low": float(low), "high": float(high)})
    return pd.DataFrame(speedups), pd.DataFrame(differences)


def free_draft_rows(rows: pd.DataFrame) -> pd.DataFrame:
    """``rows`` (``bench_wallclock``'s schema) as if drafting and the engine's per-step work cost nothing: each
    speculative run's seconds become its prefill and target seconds, the autoregressive runs stay as timed.

    :func:`speedup_intervals` of the result is the ceiling a cheaper draft (or engine) could reach with the same
    acceptance: what is left above it needs a draft the target agrees with more often."""
    missing = {"prefill_seconds", "target_seconds"} - set(rows.columns)
    if missing:
        raise ValueError(f"rows lack {sorted(missing)}: the split of each run's time that bench_wallclock records")
    speculative = rows["method"] != "autoregressive"
    out = rows.copy()
    out.loc[speculative, "seconds"] = rows.loc[speculative, "prefill_seconds"] + rows.loc[speculative, "target_seconds"]
    return out


def best_gammas(overall: pd.DataFrame, temperature: float) -> dict[str, int]:
    """Per method, the gamma with the highest speed-up in ``overall`` (:func:`wallclock_table` over all prompts)
    at ``temperature``: the one setting a user would pick for the whole prompt set."""
    rows = overall[(overall["temperature"] == temperature) & (overall["method"] != "autoregressive")]
    if rows.empty:
        raise ValueError(f"no speculative runs at temperature {temperature} (have {sorted(overall['temperature'].unique())})")
    best = rows.loc[rows.groupby("method", sort=False)["vs_autoregressive"].idxmax()]
    return dict(zip(best["method"], best["gamma"].astype(int)))


def plot_speedup_by_category(rows: pd.DataFrame, temperature: float, methods: Sequence[str] | None = None):
    """Speed-up over autoregressive decoding per prompt category and over all prompts (bars), one bar per method at
    its :func:`best_gammas` gamma on all prompts (default: every method, in the order they ran); ``rows``: the runs of
    :func:`read_wallclock`."""
    import matplotlib.pyplot as plt

    overall = wallclock_table(rows)
    gammas = best_gammas(overall, temperature)
    methods = [m for m in dict.fromkeys(rows["method"]) if m in gammas] if methods is None else list(methods)  # run order
    missing = [m for m in methods if m not in gammas]
    if missing:
        raise ValueError(f"methods {missing} have no runs at temperature {temperature} (have {sorted(gammas)})")
    table = pd.concat([wallclock_table(rows, by=("category", "temperature")),
                       overall.assign(category="all prompts")], ignore_index=True)
    table = table[table["temperature"] == temperature]
    groups = list(dict.fromkeys(table["category"]))
    width = 0.8 / len(methods)
    fig, ax = plt.subplots(figsize=(1.3 * len(groups) + 2, 4))
    for i, method in enumerate(methods):
        at = table[(table["method"] == method) & (table["gamma"] == gammas[method])].set_index("category")["vs_autoregressive"]
        ax.bar([g + (i - (len(methods) - 1) / 2) * width for g in range(len(groups))], [at.get(c, float("nan")) for c in groups],
               width, label=f"{method} (gamma {gammas[method]})")
    ax.axhline(1.0, color="grey", linewidth=1)
    ax.set_xticks(range(len(groups)), [g.replace("_", " ") for g in groups], rotation=25, ha="right", fontsize=8)
    ax.set_ylabel("speed-up over autoregressive decoding")
    ax.set_title(f"T = {temperature:g}, each draft at its best gamma over all prompts")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def plot_acceptance_by_depth(drafts: Sequence[dict], temperatures: Sequence[str] = ("0.2", "0.6", "1.0")):
    """alpha per draft depth, one panel per temperature, one line per draft (:func:`read_draft_manifest` dicts);
    a distilled LM is drawn flat (one alpha: its drafted tokens do not read anything of their own)."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(temperatures), figsize=(4 * len(temperatures), 3.4), sharey=True)
    for ax, t in zip(axes, temperatures):
        for d in drafts:
            alphas = d["alpha_by_depth"][t]
            style = "-o" if d["kind"] == "feature" else "--s"
            ax.plot(range(1, len(alphas) + 1), alphas, style, label=f"{d['name']} ({d['kind']}, c = {d['c']:.2f})")
        ax.set_title(f"T = {t}")
        ax.set_xlabel("draft depth d (tokens after the last verified one)")
        ax.set_xticks(range(1, max(len(d["alpha_by_depth"][t]) for d in drafts) + 1))
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("held-out acceptance alpha_d")
    axes[0].set_ylim(0, max(0.6, max(max(d["alpha_by_depth"][t]) for d in drafts for t in temperatures) + 0.05))
    axes[-1].legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_data_scaling(table: pd.DataFrame, temperature: str = "1.0", target: float | None = 0.5):
    """Depth-1 alpha at ``temperature`` against corpus tokens (log scale, ticks at the corpus sizes), one line
    per kind of draft and number of passes over the data (rounded to a whole pass; a table without
    ``passes``: one per kind); heads that continued a saved head (``continued``) as stars at the tokens of
    their whole chain, joined by a dotted line in token order. The training steps are in the table."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    passes = table["passes"] if "passes" in table else pd.Series([None] * len(table), index=table.index)
    continued = table["continued"].astype(bool) if "continued" in table else pd.Series(False, index=table.index)
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for kind, marker in (("feature", "o"), ("distilled LM", "s")):
        stars = table[(table["kind"] == kind) & continued].sort_values("tokens")
        if len(stars):  # joined in token order: a head continued again sits right of the head it continued
            ax.plot(stars["tokens"], stars[f"alpha_T{temperature}"], marker="*", markersize=12, linestyle=":",
                    label=f"{kind}, continued from a saved head")
        part = table[(table["kind"] == kind) & ~continued]
        groups = passes[part.index].map(lambda v: None if v is None or pd.isna(v) else round(v))
        for whole in sorted(groups.dropna().unique()) + ([None] if groups.isna().any() else []):
            line = part[groups.isna()] if whole is None else part[groups == whole]
            label = kind if whole is None else f"{kind}, {passes[line.index].mean():.1f} passes"
            ax.plot(line["tokens"], line[f"alpha_T{temperature}"], marker=marker, label=label)
    if target is not None:
        ax.axhline(target, color="grey", linestyle=":", linewidth=1, label=f"alpha = {target}")
    ax.set_xscale("log")
    sizes = sorted(table["tokens"].unique())
    ax.set_xticks(sizes, [f"{t / 1e6:.1f}M" if t >= 1e6 else f"{t / 1000:.0f}k" for t in sizes], rotation=45)  # close ticks stay legible
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("corpus tokens (sampled from the target at T = 1; one corpus, its first chunks)")
    ax.set_ylabel(f"held-out alpha, depth 1, T = {temperature}")
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    fig.tight_layout()
    return fig


def plot_speedup_vs_gamma(drafts: Sequence[dict], measured: pd.DataFrame | None = None, temperature: str = "1.0",
                          score_cost: dict[int, float] | None = None):
    """Predicted speed-up against gamma per draft (lines: dotted E / (1 + gamma c), and solid with the
    measured verification cost r_{gamma+1} if ``score_cost``, at each gamma whose r_{gamma+1} it has;
    dashed, the same with the loop's expected tokens per step where the manifest measured them), and
    the measured wall-clock speed-ups of :func:`wallclock_table` (``by=("temperature",)``) at that
    temperature (markers), if given."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(10, 4.6))
    for d in drafts:
        alphas = d["alpha_by_depth"][temperature]
        curve = speedup_curve(alphas, d["c"])
        line, = ax.plot([g for g, _, _ in curve], [s for _, _, s in curve], ":", label=f"{d['name']} predicted, r = 1")
        if score_cost is not None:  # at each gamma whose r_{gamma+1} was timed
            timed = [g for g in range(1, len(alphas) + 1) if g + 1 in score_cost]
            if timed:
                curve = speedup_curve(alphas, d["c"], score_cost, gammas=timed)
                ax.plot(timed, [s for _, _, s in curve], "-s", markersize=4, fillstyle="none", color=line.get_color(),
                        label=f"{d['name']} predicted, measured r")
                loop = (d.get("loop_tokens_by_gamma") or {}).get(temperature)
                if loop is not None:
                    curve = speedup_curve(alphas, d["c"], score_cost, gammas=timed, tokens_per_step=loop[: len(alphas)])
                    ax.plot(timed, [s for _, _, s in curve], "--^", markersize=4, fillstyle="none", color=line.get_color(),
                            label=f"{d['name']} predicted from the loop, measured r")
        if measured is not None:
            rows = measured[(measured["method"] == d["name"]) & (measured["temperature"] == float(temperature))]
            if len(rows):
                ax.plot(rows["gamma"], rows["vs_autoregressive"], "o", color=line.get_color(), label=f"{d['name']} measured")
    if measured is not None:
        others = measured[(measured["temperature"] == float(temperature)) & ~measured["method"].isin([d["name"] for d in drafts] + ["autoregressive"])]
        for method, rows in others.groupby("method"):
            ax.plot(rows["gamma"], rows["vs_autoregressive"], "x--", label=f"{method} measured")
    ax.axhline(1.0, color="grey", linewidth=1)
    ax.set_xlabel("gamma (drafted tokens per step)")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("speed-up over autoregressive decoding")
    ax.set_title(f"T = {temperature}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))  # beside the axes, off the data
    fig.text(0.01, 0.01, "predicted: E / (r + gamma c); r = one target call scoring gamma + 1 tokens over one scoring 1 "
             "(1: flat; measured: this machine),\nc = one draft call over one target call, E = tokens per step",
             fontsize=7, va="bottom")
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    return fig


def plot_alpha_cost_tradeoff(measured: pd.DataFrame, extra: float, held_out: pd.DataFrame | None = None,
                             target: tuple[float, float] | None = (0.5, 0.1), temperature: str = "1.0",
                             levels: Sequence[float] = (0.9, 1.0, 1.1, 1.15, 1.25, 1.4)):
    """alpha against c with the gamma-1 speed-up (1 + alpha) / (1 + c + extra) as contours.

    ``measured``: :func:`gamma1_costs` rows (filled markers, one legend entry each with its measured
    speed-up); ``held_out``: rows with ``label``, ``alpha``, ``c`` measured off the loop (open markers,
    e.g. the data-scaling points), and optionally ``series``: one open marker shape and legend entry per
    series, the labels of every other series written left of their points so that close points stay
    legible; ``target``: (alpha, c) corner of the shaded region alpha >= a, c <= c.
    """
    import matplotlib.pyplot as plt

    if not extra > -1:
        raise ValueError(f"extra must be > -1, got {extra}")
    cs = np.linspace(0.0, 0.25, 101)
    alphas = np.linspace(0.05, 0.7, 131)
    c_grid, a_grid = np.meshgrid(cs, alphas)
    fig, ax = plt.subplots(figsize=(7, 4.8))
    contours = ax.contour(c_grid, a_grid, (1 + a_grid) / (1 + c_grid + extra), levels=list(levels), colors="grey", linewidths=0.8)
    at = 0.12 * cs[-1]  # every label at this c, where its line crosses: left of the drafts, clear of the legend
    spots = [(at, v * (1 + at + extra) - 1) for v in levels if alphas[0] < v * (1 + at + extra) - 1 < alphas[-1]]
    ax.clabel(contours, fmt=lambda v: f"{v:g}x", fontsize=7, manual=spots)
    if target is not None:
        ax.fill_between([0, target[1]], target[0], alphas[-1], color="tab:green", alpha=0.12, label=f"target: alpha >= {target[0]}, c <= {target[1]}")
    if held_out is not None:
        series = held_out["series"] if "series" in held_out else pd.Series("", index=held_out.index)
        for i, name in enumerate(dict.fromkeys(series)):
            marker, right = "os^D"[i % 4], i % 2 == 0
            for r in held_out[series == name].itertuples():
                ax.plot(r.c, r.alpha, marker, fillstyle="none", color="grey")
                ax.annotate(r.label, (r.c, r.alpha), fontsize=6, color="dimgrey", textcoords="offset points",
                            xytext=(4, -8) if right else (-4, 2), ha="left" if right else "right")
            ax.plot([], [], marker, fillstyle="none", color="grey", label="held-out alpha, c timed off the loop" + (f": {name}" if name else ""))
    markers = "osD^v<>p*h"
    for i, r in enumerate(measured.itertuples()):
        ax.plot(r.c, r.alpha, markers[i % len(markers)], color=plt.get_cmap("tab10")(i % 10), label=f"{r.method}: {r.speedup:.2f}x in the loop")
    ax.set_xlim(cs[0], cs[-1])
    ax.set_ylim(alphas[0], alphas[-1])
    ax.set_xlabel("c: one drafting step / one autoregressive token")
    ax.set_ylabel(f"alpha at depth 1, T = {temperature}")
    ax.set_title(f"gamma = 1: speed-up (1 + alpha) / (1 + c + {extra:.2f})", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    return fig


def plot_speedup_intervals(speedups: pd.DataFrame, targets: dict[float, float] | None = None):
    """Speed-ups with their bootstrap intervals (:func:`speedup_intervals`), one panel per temperature, one row per
    (method, gamma), best first; ``targets``: temperature -> a speed-up drawn as a dashed line in its panel."""
    import matplotlib.pyplot as plt

    if speedups.empty:
        raise ValueError("speedups is empty: no speculative runs")
    temperatures = sorted(speedups["temperature"].unique())
    unknown = sorted(set(targets or {}) - set(temperatures))
    if unknown:
        raise ValueError(f"targets at temperatures {unknown} that speedups lacks (have {temperatures})")
    fig, axes = plt.subplots(1, len(temperatures), figsize=(4.6 * len(temperatures), 0.45 * speedups.groupby("temperature").size().max() + 1.6),
                             squeeze=False)
    for ax, temperature in zip(axes[0], temperatures):
        rows = speedups[speedups["temperature"] == temperature].sort_values("speedup")
        y = np.arange(len(rows))
        ax.errorbar(rows["speedup"], y, xerr=[rows["speedup"] - rows["low"], rows["high"] - rows["speedup"]], fmt="o", capsize=3)
        ax.set_yticks(y, [f"{m} (gamma {g})" for m, g in zip(rows["method"], rows["gamma"])], fontsize=8)
        ax.axvline(1.0, color="grey", linewidth=1)
        title = f"T = {temperature:g}, {int(rows['prompts'].iloc[0])} prompts"
        if targets and temperature in targets:  # named in the title: a legend box would cover a marker
            ax.axvline(targets[temperature], color="tab:green", linestyle="--", linewidth=1, label=f"target {targets[temperature]:g}x")
            title += f"; dashed: target {targets[temperature]:g}x"
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("speed-up over autoregressive decoding")
        ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    return fig


TREE_RUN_COLOURS = {"chain": "tab:blue", "dynamic": "tab:green"}  # any other run: a sampled tree (orange)


def plot_tau_against_speed(sources: dict[str, tuple[pd.DataFrame, str]], labelled: Sequence[str] | None = None):
    """Two panels, T = 0 and 1: each run's mean tokens per target call (tau) against its median speed over
    autoregressive decoding, from ``benchmarks/bench_trees.py`` records. ``sources``: label -> (the record's rows, a
    marker); colour: chain, sampled tree, dynamic tree; only the runs that covered every prompt of their source;
    ``labelled``: the sources whose points carry run names (default all). -> (figure, the points drawn: source,
    temperature, run, tau, vs)."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.6), sharey=True)
    drawn = []
    for ax, temperature in zip(axes, (0.0, 1.0)):
        for name, (frame, marker) in sources.items():
            rows = frame[frame.temperature == temperature].groupby("run").agg(
                tau=("tau", "mean"), vs=("vs_autoregressive", "median"), prompts=("prompt_id", "nunique"))
            rows = rows[rows.prompts == rows.prompts.max()]
            ax.scatter(rows.tau, rows.vs, c=[TREE_RUN_COLOURS.get(run.split()[0], "tab:orange") for run in rows.index],
                       marker=marker, s=28, alpha=0.85)
            for run, row in rows.iterrows():
                if labelled is None or name in labelled:
                    ax.annotate(run, (row.tau, row.vs), fontsize=6, xytext=(3, 2), textcoords="offset points")
                drawn.append({"source": name, "temperature": temperature, "run": run, "tau": row.tau, "vs": row.vs})
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set(title=f"T = {temperature:g}", xlabel="tokens per target call (tau, mean over prompts)")
    axes[0].set_ylabel("tokens/s over autoregressive decoding (median)")
    handles = [plt.Line2D([], [], ls="", marker=marker, color="grey", label=name)
               for name, (_, marker) in sources.items()]
    kinds = (("chain", "tab:blue"), ("sampled tree", "tab:orange"), ("dynamic tree", "tab:green"))
    handles += [plt.Line2D([], [], ls="", marker="o", color=colour, label=label) for label, colour in kinds]
    fig.legend(handles=handles, loc="upper center", ncol=len(handles), fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 0.92))
    return fig, pd.DataFrame(drawn)
