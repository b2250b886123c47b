"""The tree papers' claims on the embedded pair: each rule against the baseline its paper compares with, paired.

Every claim is a gain in tokens per target call (block efficiency, tau: machine-independent), treated / baseline - 1,
on the same prompts and per-prompt seeds, with a 95% paired bootstrap interval over the prompts
(``experiments.analysis.gain_table``). SmolLM2-135M-Instruct, the shipped feature head drafting
(``fp16:eagle3-v8k``; ``--draft``), MT-Bench first turns (``--prompt-set``), T = 1, ``--max-new-tokens`` 64.

* ``traversal``: Traversal Verification (Weng et al., arXiv 2505.12398) against token-level tree verification
  (SpecInfer's RRS) on the same i.i.d. trees, K = 2 and 4 paths of 3 tokens. The paper reports +2.2-5.7% accepted
  length.
* ``gbv``: multi-draft block verification with K = 3 paths of L = 8 against single-draft block verification at
  L = 8 (the paper: +30% block efficiency).
* ``spectr``: SpecTr's K-SEQ (Sun et al., arXiv 2310.15141) with K = 2 and 4 drafts of one token against one draft
  (L = 1). The paper's 1.37x is wall clock over single-draft speculative decoding on larger models and longer drafts.
* ``eagle2``: EAGLE-2's dynamic tree (Li et al., arXiv 2406.16858) against the static tree of the same K, depth and
  node count (``draft_law="static"``), one-hot rule both.

Writes ``benchmarks/records/claims_<claim>_t<T>_<cpu>.csv`` (bench records, resumable; header ``.json`` with command,
commit, machine and the draft's sha256) and ``claims_t<T>_<cpu>.md``, the table. A benchmark: nothing is asserted.

Realised runs diverge after their first difference, so their intervals are wide. ``--same-trees RECORD`` reads a
``bench_trees.py`` record of sampled trees instead, whose every step carries each rule's exact E[accepted | that tree]
(``core.tree_expectations``), and prints each rule's gain over RRS on the very same trees, without sampling noise
(and the verifying rule's realised tokens per call against RRS's expectation); ``--base block`` compares with block
verification of each tree's first path alone, the single-draft baseline on the same draws.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_tree_claims.py --prompts 16
    PYTHONPATH=. .venv/bin/python benchmarks/bench_tree_claims.py --prompts 160 --executor ray --address <head>:6379
    PYTHONPATH=. .venv/bin/python benchmarks/bench_tree_claims.py --same-trees benchmarks/records/trees_traversal_mt-bench_amd.csv
    PYTHONPATH=. .venv/bin/python benchmarks/bench_tree_claims.py --same-trees benchmarks/records/trees_traversal_v8k-4l_mt-bench_amd.csv
    PYTHONPATH=. .venv/bin/python benchmarks/bench_tree_claims.py --same-trees benchmarks/records/trees_gbv_mt-bench_amd.csv --base block
    PYTHONPATH=. .venv/bin/python benchmarks/bench_tree_claims.py --same-trees benchmarks/records/trees_gbv_dial-mix0.5_mt-bench_amd.csv --base block
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch

from specresearch.drafts.registry import load_pair
from specresearch.engine.prompts import prompt_set_file
from specresearch.experiments.analysis import gain_table, paired_gain
from specresearch.experiments.bench import BenchConfig, load_bench_prompts, run_bench
from specresearch.experiments.executor import add_executor_arguments, make_executor
from specresearch.experiments.records import record_header, write_run_info
from specresearch.paths import repo_root

CLAIMS = {  # claim -> (gamma, [(baseline, treatment), ...], the paper's figure)
    "traversal": (3, [("rrs:2", "traversal:2"), ("rrs:4", "traversal:4")], "+2.2% to +5.7% accepted length"),
    "gbv": (8, [("block", "gbv:3")], "+30% block efficiency"),
    "spectr": (1, [("block", "kseq:2"), ("block", "kseq:4")], "1.37x wall clock over single-draft decoding"),
    "eagle2": (4, [("onehot:2:static:6", "onehot:2:dynamic:6"), ("onehot:4:static:10", "onehot:4:dynamic:10")],
               "dynamic trees accept more than static ones"),
}


def same_trees(path: str | Path, base: str = "rrs", *, n_boot: int = 4000, seed: int = 0, level: float = 0.95) -> str:
    """Each rule's tokens per call over ``base``'s on the same trees (module docstring; ``"block"``: block verification
    of the first path alone, the single-draft baseline), per run of a ``bench_trees.py`` record: ratio of the sums
    over prompts - 1, with a percentile bootstrap interval over the prompts."""
    import pandas as pd

    if not Path(path).is_file():
        raise ValueError(f"--same-trees: no record at {path} (a bench_trees.py .csv)")
    rows = pd.read_csv(path)
    have = sorted(c.removeprefix("tau_") for c in rows.columns if c.startswith("tau_"))
    if f"tau_{base}" not in rows.columns or rows[f"tau_{base}"].isna().all():
        raise ValueError(f"--base {base!r}: {Path(path).name} holds no expectation of that rule; it has {have} "
                         "(expectations are recorded for sampled-tree runs)")
    rules = [c.removeprefix("tau_") for c in rows.columns if c.startswith("tau_") and c != f"tau_{base}" and rows[c].notna().any()]
    lines = [f"Gains over {base} on the same trees, `{Path(path).name}` (paired over prompts, {level:.0%} bootstrap):", "",
             f"| run | T | prompts | E {base} | " + " | ".join(f"E {r}" for r in rules) + " | realised |",
             "|---|---|---|---|" + "---|" * (len(rules) + 1)]
    for (run, temperature), group in rows.dropna(subset=[f"tau_{base}"]).groupby(["run", "temperature"]):
        reference = group[f"tau_{base}"].to_numpy()

        def gain(column: str) -> str:
            if group[column].isna().any():  # a rule without an expectation on these trees (K-SEQ beyond one token)
                return "-"
            g = paired_gain(group[column].to_numpy(), reference, n_boot=n_boot, seed=seed, level=level)
            return f"{g['gain']:+.1%} [{g['low']:+.1%}, {g['high']:+.1%}]"

        lines.append(f"| {run} | {temperature:g} | {len(group)} | {reference.mean():.3f} | "
                     + " | ".join(gain(f"tau_{r}") for r in rules) + f" | {gain('tau')} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--claims", nargs="+", default=list(CLAIMS), choices=list(CLAIMS))
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-set", default="mt-bench", choices=["mt-bench", "humaneval"])
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--draft", default="fp16:eagle3-v8k")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out-dir", default=str(repo_root() / "benchmarks" / "records"))
    parser.add_argument("--same-trees", metavar="RECORD", help="print the gains on a bench_trees.py record's trees and exit")
    parser.add_argument("--base", default="rrs", help="with --same-trees: the rule the gains are over (block: the first path alone)")
    add_executor_arguments(parser)
    args = parser.parse_args()
    if args.same_trees:
        try:
            print(same_trees(args.same_trees, args.base))
        except ValueError as error:
            parser.error(str(error))
        return 0
    torch.set_num_threads(args.threads)
    target, draft, tokenizer = load_pair(draft=args.draft)
    executor = make_executor(args, local=None)  # --executor ray: each prompt a Ray task, its worker loading the pair once
    parallel = {} if executor is None else dict(executor=executor,
                                                models=functools.partial(load_pair, draft=args.draft, device="cpu"))
    header = record_header("benchmarks/bench_tree_claims.py", sys.argv[1:], draft=args.draft, prompt_set=args.prompt_set)
    cpu = header["machine"].get("cpu", "cpu").split()[0].lower()
    lines = [f"Claims on {args.prompt_set} ({args.prompts} prompts), T = {args.temperature}, {args.max_new_tokens} new tokens, "
             f"draft {args.draft}; command `{header['command']}`, commit {header['commit']}.",
             "", "| claim | baseline | treatment | tau baseline | tau treatment | gain (95% CI) | the paper |",
             "|---|---|---|---|---|---|---|"]
    for claim in args.claims:
        gamma, pairs, paper = CLAIMS[claim]
        verifiers = tuple(dict.fromkeys(v for pair in pairs for v in pair))
        config = BenchConfig(verifiers=verifiers, temperatures=(args.temperature,), gammas=(gamma,),
                             max_new_tokens=args.max_new_tokens, num_prompts=args.prompts)
        prompts = load_bench_prompts(tokenizer, config, prompt_set_file(args.prompt_set))
        path = Path(args.out_dir) / f"claims_{claim}_t{args.temperature:g}_{cpu}.csv"
        write_run_info(path, **{k: v for k, v in header.items() if k != "machine"}, claim=claim)
        records = run_bench(target, draft, prompts, config, path, eos_token_id=tokenizer.eos_token_id, **parallel)
        for baseline, treatment in pairs:
            table = gain_table(records, metrics=("be",), baseline=baseline, treatment=treatment)
            lines += [_row(claim, baseline, treatment, row, paper) for row in table.to_dict("records")]
    out = Path(args.out_dir) / f"claims_t{args.temperature:g}_{cpu}.md"
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


def _row(claim: str, baseline: str, treatment: str, row: dict, paper: str) -> str:
    base, treated = row[f"be_{baseline}"], row[f"be_{treatment}"]
    gain, low, high = row["be_gain"], row["be_gain_lo"], row["be_gain_hi"]
    return (f"| {claim} | {baseline} | {treatment} | {base:.3f} | {treated:.3f} | {100 * gain:+.1f}% "
            f"({100 * low:+.1f}, {100 * high:+.1f}) | {paper} |")


if __name__ == "__main__":
    sys.exit(main())
