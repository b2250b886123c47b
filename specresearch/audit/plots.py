"""The lossy frontier with each rule's (distortion, acceptance) point beside it; the engines' executed laws beside the
target's and the prediction (plot_executed)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from specresearch.audit.real import StepPoint, topk_tokens

__all__ = ["frontier_curves", "plot_frontier", "plot_executed"]


def frontier_curves(target_probs: torch.Tensor, draft_probs: torch.Tensor, eps: np.ndarray, num_drafts: int = 4) -> dict:
    """Mean over the rows of the frontier min(1, A(0) + eps) for three draft choices: one sampled draft (A(0) =
    alpha), the greedy token (A(0) = p(argmax q)) and the top-``num_drafts`` candidates (A(0) = p(top-K of q))."""
    p, q = target_probs.double(), draft_probs.double()
    starts = {"1 sampled draft": torch.minimum(p, q).sum(-1), "greedy draft (top-1)": p.gather(1, topk_tokens(q, 1)).sum(-1)}
    if num_drafts > 1:
        starts[f"top-{num_drafts} candidates"] = p.gather(1, topk_tokens(q, num_drafts)).sum(-1)
    eps = torch.as_tensor(np.asarray(eps, dtype=np.float64))
    return {label: torch.minimum(torch.ones(1, len(eps), dtype=torch.float64), a0[:, None] + eps[None]).mean(0).numpy()
            for label, a0 in starts.items()}


def plot_frontier(panels: Sequence[tuple[str, dict, Sequence[StepPoint]]], eps: np.ndarray):
    """One panel per (title, frontier curves, rule points): the frontier lines and each rule's (TV, acceptance)
    marker, the same marker and colour for a rule in every panel, one legend below. Axes: the total variation of the
    first emitted token's law from the target's next-token law; the acceptance (the emitted token is an accepted
    draft). Returns the figure."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(6.2 * len(panels), 5.4), squeeze=False)
    names = list(dict.fromkeys(_label(pt) for _, _, points in panels for pt in points))
    style = {name: (m, f"C{i % 10}") for i, (name, m) in enumerate(zip(names, "os^vD<>pP*Xh" * 2))}
    right = max([float(np.max(eps))] + [pt.tv + 0.05 for _, _, points in panels for pt in points])
    for ax, (title, curves, points) in zip(axes[0], panels):
        for (label, curve), line in zip(curves.items(), ("-", "--", ":")):
            ax.plot(eps, curve, line, color="0.35", label=f"frontier: {label}")
        for pt in points:
            marker, colour = style[_label(pt)]
            ax.plot(pt.tv, pt.acceptance, marker, color=colour, markersize=8, linestyle="none", label=_label(pt))
        ax.set(xlabel="total variation from the target's next-token law", ylabel="acceptance (emitted token = an accepted draft)",
               xlim=(-0.02, right), ylim=(0, 1.02), title=title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7.5, loc="lower right")
    fig.tight_layout()
    return fig


def _label(point: StepPoint) -> str:
    return point.rule + ("" if point.settings == "defaults" else f" ({point.settings})")


def plot_executed(rows: Sequence[dict], top: int = 6, columns: int = 5):
    """One panel per row of an ``audit.execute`` record (``ExecutionResult.as_record``): for the ``top`` cells of
    largest target probability and the rest pooled, the measured frequency (95% normal interval of a binomial
    proportion) beside the target's and the predicted probabilities, ``columns`` panels a line. Reads the record only."""
    import matplotlib.pyplot as plt

    columns = min(columns, len(rows))
    lines = -(-len(rows) // columns)
    fig, axes = plt.subplots(lines, columns, figsize=(3.6 * columns, 3.4 * lines), squeeze=False, sharey=True)
    for ax in axes.flat[len(rows):]:
        ax.set_visible(False)
    for ax, row in zip(axes.flat, rows):
        counts, target, predicted = (np.asarray(row[k], dtype=float) for k in ("counts", "target_probs", "predicted_probs"))
        n = counts.sum()
        order = np.argsort(-target)[:top]
        rest = np.setdiff1d(np.arange(len(counts)), order)
        pick = lambda values: np.append(values[order], values[rest].sum())  # noqa: E731
        measured = pick(counts) / n
        error = 1.96 * np.sqrt(measured * (1 - measured) / n)
        x = np.arange(len(order) + 1)
        ax.bar(x - 0.27, measured, 0.27, yerr=error, capsize=2, label="measured (their code)", color="#4c72b0")
        ax.bar(x, pick(target), 0.27, label="target's law", color="#55a868")
        ax.bar(x + 0.27, pick(predicted), 0.27, label="predicted (the audit's rule)", color="#c44e52")
        ax.set_xticks(x, [_cell_label(row["cells"][i]) for i in order] + ["rest"], rotation=60, fontsize=7)
        options = ", ".join(f"{k}={v}" for k, v in row["options"].items()) or "defaults"
        others = "".join(f"\np({name}) {c['p_value']:.2g}" for name, c in row.get("alternatives", {}).items())
        ax.set_title(f"{row['engine']}\n{options}, T={row['temperature']:g}, N={int(n)}\n"
                     f"p(target) {row['target']['p_value']:.2g}, p(predicted) {row['predicted']['p_value']:.2g}{others}",
                     fontsize=8)
    axes[0][0].set_ylabel("probability of the cell")
    axes[0][0].legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    return fig


def _cell_label(cell: str) -> str:
    """A record's cell (its repr) in a few characters: the tokens of a sequence, 'after ...' for a prefix's rest."""
    import ast

    try:
        value = ast.literal_eval(cell)
    except (ValueError, SyntaxError):
        return cell[:12]
    kind = value[0]
    if kind == "seq":
        return "·".join(str(t) for t in value[1])
    if kind == "rest":
        return "rest after " + ("·".join(str(t) for t in value[1]) or "start")
    return str(kind)[:12]
