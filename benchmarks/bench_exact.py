"""Time the exact machinery: the LP optimality certificate and the exact losslessness check.

Usage (from the repository root):

    .venv/bin/python benchmarks/bench_exact.py                      # default grid, 60 s budget per run
    .venv/bin/python benchmarks/bench_exact.py --budget 30 --vocab 2 3 --gammas 1 2 3 4 5
    .venv/bin/python benchmarks/bench_exact.py --out reports/bench_exact.jsonl

For every (V, gamma) and task, one run on random rational context-dependent models without zeros
(``specresearch.exact.random_rational_model``, seed 0), in a child process that is stopped after
``--budget`` seconds:

* ``lp``: the optimality certificate of proofs/t5 -- ``specresearch.exact.lp.optimal_verifier_lp`` (exact
  rational simplex) plus ``check_verifier(..., "block")`` (block verification's joint is feasible and its
  objective equals the optimum).
* ``lossless``: ``specresearch.exact.is_lossless(..., "block", n_tokens)`` (law of the first n_tokens of
  the whole loop, enumerated in Fractions).

* ``lp_multi``: the multi-draft optimum over K paths of length L = gamma --
  ``specresearch.exact.lp.optimal_verifier_lp(..., num_drafts=K, draft_law="iid")`` (coupling form, drafts
  merged by their set of paths), checked against GBV's exact acceptance (GBV <= optimum). K comes
  from ``--num-drafts`` (default 2 3).

Along gamma a task stops at the first run over budget (larger gammas only grow). Rows (JSON lines with
wall and CPU seconds) go to ``--out``; a Markdown table is printed. Timings are not asserted anywhere.

    .venv/bin/python benchmarks/bench_exact.py --tasks lp_multi --vocab 2 3 --gammas 1 2 3 --num-drafts 2 3

lp_multi on 2026-11-23 (2-core CPU shared with other jobs, no GPU): the largest sizes solved within a
minute are V = 2 with (K = 2, L = 3: 55 s wall, 18 s CPU) and (K = 3, L = 2: 3.3 s); V = 3 only at L = 1
(K = 2 or 3, 0.3 s); V = 3, L = 2 and V = 2, K = 3, L = 3 exceed 60 s. Table in docs/multidraft.md.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import random
import time
from pathlib import Path

from specresearch.exact import expected_accepted, is_lossless, random_rational_model
from specresearch.exact.lp import check_verifier, optimal_verifier_lp


def _models(vocab: int, seed: int = 0):
    rng = random.Random(seed)
    return random_rational_model(vocab, rng, zero_prob=0.0), random_rational_model(vocab, rng, zero_prob=0.0)


def _lp_task(vocab: int, gamma: int, n_tokens: int) -> str:
    target, draft = _models(vocab)
    result = optimal_verifier_lp(target, draft, gamma)
    check = check_verifier(target, draft, gamma, "block")
    assert check.feasible and check.objective == result.optimum, "block verification must attain the LP optimum"
    return f"optimum {result.optimum} ({result.num_variables} vars, {result.num_constraints} constraints)"


def _lossless_task(vocab: int, gamma: int, n_tokens: int) -> str:
    target, draft = _models(vocab)
    assert is_lossless(target, draft, gamma, "block", n_tokens)
    return f"lossless on {n_tokens} tokens"


def _lp_multi_task(vocab: int, gamma: int, n_tokens: int, num_drafts: int) -> str:
    target, draft = _models(vocab)
    result = optimal_verifier_lp(target, draft, gamma, num_drafts=num_drafts, draft_law="iid")
    gbv = expected_accepted(target, draft, gamma, "gbv", num_drafts=num_drafts)
    assert gbv <= result.optimum, "a lossless verifier cannot beat the optimum"
    return f"optimum {result.optimum} (gbv {gbv}; {result.num_variables} vars, {result.num_constraints} constraints)"


TASKS = {"lp": _lp_task, "lossless": _lossless_task, "lp_multi": _lp_multi_task}


def _child(task: str, vocab: int, gamma: int, n_tokens: int, num_drafts, queue) -> None:
    wall, cpu = time.perf_counter(), time.process_time()
    args = (vocab, gamma, n_tokens) + ((num_drafts,) if task == "lp_multi" else ())
    note = TASKS[task](*args)
    queue.put((time.perf_counter() - wall, time.process_time() - cpu, note))


def run_one(task: str, vocab: int, gamma: int, n_tokens: int, budget: float, num_drafts: int | None = None) -> dict:
    """Run one task in a child process; stop it after ``budget`` seconds."""
    queue = mp.get_context("fork").Queue()
    proc = mp.get_context("fork").Process(target=_child, args=(task, vocab, gamma, n_tokens, num_drafts, queue))
    proc.start()
    proc.join(budget)
    row = {"task": task, "V": vocab, "K": num_drafts, "gamma": gamma, "n_tokens": n_tokens if task == "lossless" else None}
    if proc.is_alive():
        proc.terminate()
        proc.join()
        return {**row, "wall_s": None, "cpu_s": None, "note": f"> {budget:g} s (stopped)"}
    wall, cpu, note = queue.get() if proc.exitcode == 0 else (None, None, f"failed (exit {proc.exitcode})")
    return {**row, "wall_s": wall, "cpu_s": cpu, "note": note}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", nargs="*", default=list(TASKS), choices=list(TASKS))
    parser.add_argument("--vocab", nargs="*", type=int, default=[2, 3, 4])
    parser.add_argument("--gammas", nargs="*", type=int, default=[1, 2, 3, 4, 5, 6])
    parser.add_argument("--n-tokens", type=int, default=4, help="tokens compared by the losslessness check")
    parser.add_argument("--budget", type=float, default=60.0, help="seconds per run before it is stopped")
    parser.add_argument("--num-drafts", nargs="*", type=int, default=[2, 3], help="K for lp_multi")
    parser.add_argument("--out", type=Path, default=None, help="JSON-lines file for the rows")
    args = parser.parse_args(argv)
    rows = []
    for task in args.tasks:
        for num_drafts in args.num_drafts if task == "lp_multi" else [None]:
            for vocab in args.vocab:
                for gamma in args.gammas:
                    rows.append(run_one(task, vocab, gamma, args.n_tokens, args.budget, num_drafts))
                    print(json.dumps(rows[-1]), flush=True)
                    if rows[-1]["wall_s"] is None:
                        break
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print("\n| task | V | K | gamma | wall s | CPU s | note |\n| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        wall = "-" if r["wall_s"] is None else f"{r['wall_s']:.2f}"
        cpu = "-" if r["cpu_s"] is None else f"{r['cpu_s']:.2f}"
        k = "-" if r["K"] is None else r["K"]
        print(f"| {r['task']} | {r['V']} | {k} | {r['gamma']} | {wall} | {cpu} | {r['note']} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
