"""This machine's cost curve and the default gamma it makes best (``engine.cost``), beside the measured speeds.

Times r_n (one target call scoring n tokens over one scoring 1), c (one call of the draft over one target call), o (a
step's own work) and s_gamma (a chain step drafting gamma tokens over an autoregressive step; ``ngram+NAME`` is timed
on NAME, whose chains gamma sets) on the embedded pair, fresh (not the cache), and prints the predicted speed-ups
E(gamma) / s_gamma (what the default uses) and E(gamma) / (r_{gamma+1} + gamma c + o) for ``config.GENERATE_TAU``
beside the speed-ups measured at gamma 1-3 in ``benchmarks/records/adaptive_amd.csv`` (the head alone, T = 1, the same
machine), and the gamma ``specresearch generate`` takes here (the measured default unless another is predicted
faster by more than ``config.GENERATE_MARGIN``). Writes ``benchmarks/records/cost_curve_<cpu>.json`` (command,
commit, machine, the draft's sha256). A benchmark: nothing is asserted.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_cost_curve.py --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import sys

import pandas as pd
import torch

from specresearch.config import (
    GENERATE_DRAFT,
    GENERATE_GAMMA,
    GENERATE_MARGIN,
    GENERATE_TAU,
)
from specresearch.drafts.registry import load_pair
from specresearch.engine.cost import best_gamma, measure_cost_curve, predicted_speedup
from specresearch.experiments.records import record_header, write_json_record
from specresearch.paths import repo_root


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--draft", default=GENERATE_DRAFT)
    parser.add_argument("--rounds", type=int, default=3, help="independent measurements (the median is kept)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target, draft, _ = load_pair(draft=args.draft)
    curves = [measure_cost_curve(target, draft, max_tokens=max(GENERATE_TAU) + 1, rounds=1) for _ in range(args.rounds)]
    ratios = [statistics.median(c.ratios[i] for c in curves) for i in range(len(curves[0].ratios))]
    draft_ratio = statistics.median(c.draft_ratio for c in curves)
    overhead = statistics.median(c.overhead_ratio for c in curves)
    steps = [statistics.median(c.step_ratios[i] for c in curves) for i in range(len(curves[0].step_ratios))]
    curve = type(curves[0])(tuple(ratios), draft_ratio, statistics.median(c.target_seconds for c in curves), overhead,
                            tuple(steps), step_rounds=tuple(c.step_ratios for c in curves), load=curves[0].load)
    predicted = predicted_speedup(curve, GENERATE_TAU)
    from_calls = predicted_speedup(curve, GENERATE_TAU, model="calls")
    measured = pd.read_csv(repo_root() / "benchmarks" / "records" / "adaptive_amd.csv")
    measured = measured[measured.temperature == 1.0].groupby("run").vs_autoregressive.median()
    record = record_header("benchmarks/bench_cost_curve.py", sys.argv[1:], draft=args.draft, r=ratios, c=draft_ratio,
                           o=overhead, s=steps, predicted_from_calls=from_calls, target_seconds=curve.target_seconds,
                           rounds=[c.__dict__ for c in curves], predicted=predicted,
                           best_gamma=best_gamma(curve, GENERATE_TAU),
                           default_gamma=best_gamma(curve, GENERATE_TAU, incumbent=GENERATE_GAMMA, margin=GENERATE_MARGIN),
                           measured_head_t1={g: float(measured.get(f"gamma {g}", float("nan"))) for g in GENERATE_TAU})
    machine = record["machine"]
    out = repo_root() / "benchmarks" / "records" / f"cost_curve_{machine.get('cpu', 'cpu').split()[0].lower()}.json"
    write_json_record(out, record, indent=2)
    print(f"r_n = {[round(r, 3) for r in ratios]}, c = {draft_ratio:.3f}, o = {overhead:.3f}, s_gamma = {[round(x, 3) for x in steps]}")
    for g in GENERATE_TAU:
        print(f"gamma {g}: predicted from steps {predicted[g]:.3f}x, from calls {from_calls[g]:.3f}x, "
              f"measured (head, T = 1) {record['measured_head_t1'][g]:.3f}x")
    print(f"fastest predicted: gamma {record['best_gamma']}; generate's default here: gamma {record['default_gamma']} "
          f"(gamma {GENERATE_GAMMA} unless another is predicted > {GENERATE_MARGIN:.0%} faster) ({out})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
