"""Two commits' wall clock side by side, in one run: does a code change make speculative decoding faster here?

Changes worth a few percent drown in the drift of this kind of machine between runs (whole runs of
``bench_wallclock.py`` a day apart differ by more), so the two versions are timed in turns, prompt by prompt. Each
side (``--base`` and ``--head``: a git revision, checked out for the run with ``git worktree``, or ``.``, this
working tree as it is) runs in its own worker process that imports that side's ``specresearch`` and loads the same
target and ``--draft`` (default ``specresearch generate``'s, with its gamma on the reference CPU, block verification).
Without ``--draft`` (or with ``--fit-draft``) a combined draft drafts ``--gamma`` tokens where lookup finds no match
too, as ``specresearch generate``'s default draft does (``engine.cost.fit_default_draft``; records made before this
option drafted one there). For every prompt (``--prompt-set``'s first turns, or ``--prompts-file``; ``--prompts``
evenly spaced; token ids encoded once, here) and temperature, each side times autoregressive decoding and then
speculative decoding (``--gamma``, ``--verifier``) of the same prompt with the same seed; the sides take turns,
alternating which goes first. A side's speed-up is (tokens / seconds) of its speculative runs over that of its own
autoregressive runs, summed over the prompts; head - base gets a paired 95% bootstrap interval over the prompts (1,000
resamples, seed 0; each resample redraws the prompts for both sides). The tokens per second of both methods are
shown too: a change that speeds up the target speeds up both, and can lower the ratio while every run gets faster.

Rows go to ``--out`` (JSON lines: a ``method = machine`` row with the command, this checkout's commit, the machine,
the weights' digests and each side's revision and commit, then every run as soon as it is timed); ``--table RECORD``
prints a finished record's table again. A benchmark: nothing asserted on time.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_commits.py --base feb87bc --head . --prompts 32 \\
        --out benchmarks/records/commits_feb87bc_probs_32.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

WORKER_FLAG = "--worker"


def worker(args) -> None:
    """Serve timing requests on stdin, one JSON line each (``ids``, ``temperature``, ``seed``), with this process's
    ``specresearch`` (the side's checkout, first on ``PYTHONPATH``): autoregressive then speculative decoding."""
    import torch

    import specresearch

    torch.set_num_threads(args.threads)
    from specresearch.config import SamplingConfig
    from specresearch.drafts.registry import load_pair
    from specresearch.engine.generate import autoregressive_generate, speculative_generate

    root = Path(os.environ["BENCH_COMMITS_ROOT"]).resolve()
    if root not in Path(specresearch.__file__).resolve().parents:
        raise RuntimeError(f"worker for {root} imported specresearch from {specresearch.__file__}")
    target, draft, tokenizer = load_pair(draft=args.draft)
    if args.fit_draft and getattr(draft, "draft_gamma", None) is not None:  # as specresearch generate's default draft
        draft.draft_gamma = args.gamma  # drafts gamma tokens off a lookup match too (engine.cost.fit_default_draft)
    options = dict(gamma=args.gamma, verifier=args.verifier)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        common = dict(max_new_tokens=args.max_new_tokens, sampling=SamplingConfig(temperature=request["temperature"]),
                      seed=[request["seed"]], eos_token_id=tokenizer.eos_token_id)
        runs = {"autoregressive": autoregressive_generate(target, [request["ids"]], **common),
                "speculative": speculative_generate(target, draft, [request["ids"]], **options, **common)}
        print(json.dumps({method: {"tokens": out.num_tokens, "seconds": out.seconds, "prefill_seconds": out.prefill_seconds,
                                   "steps": len(out.steps),
                                   "target_seconds": sum(s.target_seconds for s in out.steps),
                                   "draft_seconds": sum(s.draft_seconds for s in out.steps)}
                          for method, out in runs.items()}), flush=True)


class Side:
    """One side's checkout (a worktree made for the run, or this one) and its worker process."""

    def __init__(self, name: str, revision: str, args, repo: Path, scratch: Path) -> None:
        self.name, self.revision, self.repo = name, revision, repo
        self.worktree = None
        if revision == ".":
            self.root = repo
        else:
            self.root = self.worktree = scratch / name
            subprocess.run(["git", "-C", str(repo), "worktree", "add", "--detach", "--quiet", str(self.root), revision], check=True)
        self.commit = subprocess.run(["git", "-C", str(self.root), "rev-parse", "--short", "HEAD"], check=True,
                                     capture_output=True, text=True).stdout.strip()
        if revision == "." and subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
                                              capture_output=True, text=True).stdout.strip():
            self.commit += "+changes"
        env = {**os.environ, "PYTHONPATH": str(self.root), "BENCH_COMMITS_ROOT": str(self.root)}
        command = [sys.executable, str(Path(__file__).resolve()), WORKER_FLAG, "--draft", args.draft, "--gamma", str(args.gamma),
                   "--verifier", args.verifier, "--max-new-tokens", str(args.max_new_tokens),
                   "--threads", str(args.threads), *(["--fit-draft"] if args.fit_draft else [])]
        self.process = subprocess.Popen(command, cwd=self.root, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            self._read()  # loaded
        except RuntimeError:
            self.close()  # no worktree left registered
            raise

    def run(self, request: dict) -> dict:
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        return self._read()

    def _read(self) -> dict:
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the {self.name} worker ({self.revision}) exited with {self.process.wait()}")
        return json.loads(line)

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()
            self.process.wait(timeout=60)
        if self.worktree is not None:
            subprocess.run(["git", "-C", str(self.repo), "worktree", "remove", "--force", str(self.worktree)], check=False)


def load_rows(path) -> tuple[dict, list[dict]]:
    lines = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    header = next((r for r in lines if r.get("method") == "machine"), None)
    if header is None:
        raise ValueError(f"{path}: no 'method = machine' row: not a bench_commits record")
    return header, [r for r in lines if r.get("method") in ("autoregressive", "speculative")]


def summary(rows: list[dict], n_boot: int = 1000, seed: int = 0) -> list[dict]:
    """Per temperature: each side's tokens per second for both methods, its speed-up with a bootstrap interval, the
    paired interval of head - base (the same prompts redrawn for both sides), and for each method head's tokens per
    second over base's with its paired interval (``ar_faster``, ``spec_faster``: a change that speeds up the target
    speeds up both methods, and may lower the speed-up while both run faster)."""
    from specresearch.experiments.analysis import bootstrap_weights

    out = []
    for temperature in sorted({r["temperature"] for r in rows}):
        at = [r for r in rows if r["temperature"] == temperature]
        prompts = sorted({r["prompt"] for r in at})
        sums = {}  # (side, method) -> [P, 2] tokens, seconds
        for r in at:
            table = sums.setdefault((r["side"], r["method"]), np.zeros((len(prompts), 2)))
            table[prompts.index(r["prompt"])] += (r["tokens"], r["seconds"])
        draws = bootstrap_weights(len(prompts), n_boot, seed)  # [n_boot, P]

        def speed(side, method, weights=None):
            tokens, seconds = (sums[side, method].sum(0) if weights is None else weights @ sums[side, method]).T
            return tokens / seconds

        row = {"temperature": temperature, "prompts": len(prompts)}
        ratio = {}
        for side in ("base", "head"):
            ratio[side] = (speed(side, "speculative") / speed(side, "autoregressive"),
                           speed(side, "speculative", draws) / speed(side, "autoregressive", draws))
            low, high = np.percentile(ratio[side][1], [2.5, 97.5])
            row.update({f"{side}_ar_tok_s": speed(side, "autoregressive"), f"{side}_spec_tok_s": speed(side, "speculative"),
                        f"{side}_speedup": ratio[side][0], f"{side}_low": low, f"{side}_high": high})
        low, high = np.percentile(ratio["head"][1] - ratio["base"][1], [2.5, 97.5])
        row.update(difference=ratio["head"][0] - ratio["base"][0], difference_low=low, difference_high=high)
        for method, key in (("autoregressive", "ar"), ("speculative", "spec")):  # head's speed over base's, paired
            faster = speed("head", method, draws) / speed("base", method, draws)
            low, high = np.percentile(faster, [2.5, 97.5])
            row.update({f"{key}_faster": speed("head", method) / speed("base", method), f"{key}_faster_low": low,
                        f"{key}_faster_high": high})
        out.append(row)
    return out


def table(header: dict, rows: list[dict]) -> str:
    sides = header["sides"]
    lines = [f"base {sides['base']['revision']} ({sides['base']['commit']}), head {sides['head']['revision']} "
             f"({sides['head']['commit']}); draft {header['draft']}, gamma {header['gamma']}, {header['verifier']} verification",
             "", "| T | prompts | AR tok/s base / head | spec tok/s base / head | speed-up base [95%] | speed-up head [95%] "
             "| head - base [paired 95%] | AR head / base [paired 95%] | spec head / base [paired 95%] |",
             "|---|---|---|---|---|---|---|---|---|"]
    for s in summary(rows):
        lines.append(f"| {s['temperature']:g} | {s['prompts']} | {s['base_ar_tok_s']:.2f} / {s['head_ar_tok_s']:.2f} "
                     f"| {s['base_spec_tok_s']:.2f} / {s['head_spec_tok_s']:.2f} "
                     f"| {s['base_speedup']:.3f} [{s['base_low']:.3f}, {s['base_high']:.3f}] "
                     f"| {s['head_speedup']:.3f} [{s['head_low']:.3f}, {s['head_high']:.3f}] "
                     f"| {s['difference']:+.3f} [{s['difference_low']:+.3f}, {s['difference_high']:+.3f}] "
                     f"| {s['ar_faster']:.3f} [{s['ar_faster_low']:.3f}, {s['ar_faster_high']:.3f}] "
                     f"| {s['spec_faster']:.3f} [{s['spec_faster_low']:.3f}, {s['spec_faster_high']:.3f}] |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--base", help="git revision of the base side, or '.' for this working tree")
    parser.add_argument("--head", default=".", help="git revision of the head side (default '.': this working tree)")
    parser.add_argument("--draft", default=None, help="draft name (default: config.GENERATE_DRAFT)")
    parser.add_argument("--gamma", type=int, default=None, help="default: config.GENERATE_GAMMA")
    parser.add_argument("--verifier", default="block")
    parser.add_argument("--fit-draft", action="store_true",
                        help="a combined draft drafts --gamma tokens where lookup finds no match, as specresearch "
                             "generate's default draft does (implied without --draft; a named draft keeps its "
                             "own length)")
    parser.add_argument("--prompt-set", default="mt-bench", help="engine.prompts.load_prompt_set name (first turns)")
    parser.add_argument("--prompts-file", help="a prompts file (data/prompts.jsonl's schema) instead of --prompt-set")
    parser.add_argument("--prompts", type=int, default=16, help="prompts, evenly spaced")
    parser.add_argument("--temperatures", nargs="+", type=float, default=[0.0, 1.0])
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="reports/bench_commits.jsonl")
    parser.add_argument("--table", metavar="RECORD", help="only print the table of a finished run's record")
    parser.add_argument(WORKER_FLAG, action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    if args.table:
        if not Path(args.table).is_file():
            parser.error(f"--table {args.table!r}: no such file (a record bench_commits wrote with --out)")
        try:
            header, rows = load_rows(args.table)
        except ValueError as error:  # not JSON lines, or not bench_commits' rows
            parser.error(f"--table: {error}")
        print(table(header, rows))
        return
    if args.base is None:
        parser.error("--base is required (a git revision, or '.')")
    if args.base == args.head:
        parser.error(f"--base and --head name the same side ({args.base!r})")
    if args.prompts < 2 or args.max_new_tokens < 1 or args.threads < 1:
        parser.error("--prompts must be >= 2, --max-new-tokens and --threads >= 1")
    for flag in ("base", "head"):
        revision = getattr(args, flag)
        if revision != "." and subprocess.run(["git", "-C", str(Path(__file__).resolve().parents[1]), "rev-parse", "--verify", "--quiet", f"{revision}^{{commit}}"],
                                              capture_output=True).returncode:
            parser.error(f"--{flag} {revision!r} is not a commit of this repository: give a git revision, or '.'")

    from specresearch.config import GENERATE_DRAFT, GENERATE_GAMMA
    from specresearch.engine.prompts import encode_chat, evenly_spaced, load_prompt_set, load_prompts
    from specresearch.experiments.bench import run_seed
    from specresearch.experiments.records import record_header
    from specresearch.models.embedded import load_embedded
    from specresearch.paths import repo_root

    args.fit_draft = args.fit_draft or args.draft is None  # gamma tokens off a match too, as generate's default draft
    args.draft = args.draft or GENERATE_DRAFT
    args.gamma = GENERATE_GAMMA if args.gamma is None else args.gamma
    prompts = evenly_spaced(load_prompts(args.prompts_file) if args.prompts_file else load_prompt_set(args.prompt_set), args.prompts)
    ids = [t.tolist() for t in encode_chat(prompts, load_embedded()[1])]  # the model is dropped: the workers load theirs
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    repo = repo_root()
    with tempfile.TemporaryDirectory(prefix="bench_commits_") as scratch:
        sides = {}
        try:
            for name in ("base", "head"):
                sides[name] = Side(name, getattr(args, name), args, repo, Path(scratch))
            header = record_header("benchmarks/bench_commits.py", sys.argv[1:], args.draft, method="machine",
                                   gamma=args.gamma, verifier=args.verifier, fit_draft=args.fit_draft,
                                   sides={n: {"revision": s.revision, "commit": s.commit} for n, s in sides.items()})
            rows = []
            started = time.perf_counter()
            with out.open("w") as sink:
                sink.write(json.dumps(header) + "\n")
                for i, (prompt, prompt_ids) in enumerate(zip(prompts, ids)):
                    for j, temperature in enumerate(args.temperatures):
                        order = ("base", "head") if (i + j) % 2 == 0 else ("head", "base")
                        request = {"ids": prompt_ids, "temperature": temperature, "seed": run_seed(prompt["id"], args.seed)}
                        for name in order:
                            for method, timed in sides[name].run(request).items():
                                rows.append({"prompt": prompt["id"], "category": prompt["category"], "temperature": temperature,
                                             "side": name, "method": method, **timed})
                                sink.write(json.dumps(rows[-1]) + "\n")
                        sink.flush()
                    print(f"[{i + 1}/{len(prompts)}] {prompt['id']} ({time.perf_counter() - started:.0f} s)", flush=True)
        finally:
            for side in sides.values():
                side.close()
    print(table(header, rows))


if __name__ == "__main__":
    main()
