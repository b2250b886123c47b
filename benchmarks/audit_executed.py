"""Audit by execution, the committed record: transformers' own speculative code run on the embedded pair
(SmolLM2-135M-Instruct, float32, CPU; the assistant the shipped ``v8k-4l``) and llama.cpp's server and its
``llama-speculative`` example on its GGUF (built by ``scripts/build_llamacpp.sh``; the draft a scaled copy), each
configuration's measured law of the first tokens against the target's and the audit's prediction
(``specresearch.audit.execute``).

    python benchmarks/audit_executed.py [--out benchmarks/records/audit_executed.json] [--scale 1.0]

Resumable: configurations already in the record are kept, the rest run and are written one by one; ``--docs``
rewrites docs/audit.md's table of engines run from this record and the others of ``audit.report.EXECUTED_RECORDS``, and notebook 12's
figure in docs/figures from this record (what the notebook draws, without its live runs). ``--scale``
multiplies every N (0.05 for a smoke run into another file). ``--power`` adds the configurations run at an N that
detects TV 0.03 (``POWER``) as seed blocks of ``--batch-size``, each stored in ``benchmarks/records/blocks/`` as it
lands (a stopped run resumes from its last block); ``--executor ray`` runs the blocks on Ray workers, and ``--only
ENGINE`` keeps one engine's configurations, so that two processes on one machine run two engines.

    python benchmarks/audit_executed.py --power [--executor ray --workers 2]
    python benchmarks/audit_executed.py --power --only transformers-lookup   # beside a run of the others
    python benchmarks/audit_executed.py --status   # each POWER run's blocks so far and the worker-hours it still needs
    python benchmarks/audit_executed.py --pack     # gzip every finished run's blocks (this script's and the libraries')
    python benchmarks/audit_executed.py --supersede llamacpp-simple --why "..."   # draw that engine's power run again

A packed file (``<name>.jsonl.gz``, ``BlockStore.pack``) reads as the plain one did, so a finished run's row is rebuilt
from it the same way; a run that draws more blocks into it unpacks it first. ``--supersede ENGINE --why TEXT`` takes
that engine's power rows out of ``rows`` into the record's ``superseded`` list (each with ``why``) and keeps their
blocks, packed, as ``<name>.superseded.jsonl.gz``: the next ``--power`` run draws them again from nothing.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import sys
from pathlib import Path

import torch

from specresearch.audit.blocks import BlockStore
from specresearch.audit.execute import default_pair, execute
from specresearch.audit.plots import plot_executed
from specresearch.audit.report import EXECUTED_RECORDS, executed_table, largest_runs, row_config_key
from specresearch.audit.report import config_key as key
from specresearch.drafts.registry import load_pair
from specresearch.experiments.executor import LocalExecutor, add_executor_arguments, make_executor
from specresearch.experiments.plotting import save_figure
from specresearch.experiments.records import git_commit, record_header, replace_generated, write_json_record
from specresearch.experiments.report import publish_figures
from specresearch.paths import repo_root

PROMPT = "Name a colour."
LOOKUP_PROMPT = "Repeat after me: the cat sat on the mat, the cat sat on the mat."
# (engine, n_tokens, N, temperature, options, prompt)
CONFIGS = [
    ("transformers-sampling", 1, 40000, 1.0, {}, PROMPT),
    ("transformers-sampling", 1, 40000, 1.0, {"assistant_ensemble_weight": 0.5}, PROMPT),
    ("transformers-sampling", 1, 20000, 0.7, {"top_k": 50}, PROMPT),
    ("transformers-assisted", 2, 8000, 1.0, {}, PROMPT),
    ("transformers-assisted", 2, 2000, 1.0, {"assistant_ensemble_weight": 0.5}, PROMPT),
    ("transformers-assisted", 2, 2000, 0.7, {"top_p": 0.9, "repetition_penalty": 1.2}, PROMPT),
    ("transformers-lookup", 2, 2000, 1.0, {"prompt_lookup_num_tokens": 3}, LOOKUP_PROMPT),
    ("llamacpp-server", 2, 4000, 1.0, {}, PROMPT),
    ("llamacpp-server", 2, 2000, 0.8, {"synth_rates": [0.5, 0.25, 0.125]}, PROMPT),
    # the same without request seeds: the server's synthetic coins then come from a generator of their own
    ("llamacpp-server", 2, 2000, 0.8, {"synth_rates": [0.5, 0.25, 0.125], "seeded": False}, PROMPT),
    # llama-speculative, the example: its own defaults (T 0.8, one branch), then two branches in a random order
    ("llamacpp-example", 2, 1200, 0.8, {}, PROMPT),
    ("llamacpp-example", 2, 600, 0.8, {"n_parallel": 2}, PROMPT),  # its tree batch fails to decode (docs/audit.md)
    # llama-speculative-simple: the server's loop as a command-line example, its first token already drafted for
    ("llamacpp-simple", 2, 400, 0.8, {}, PROMPT),
]


# the same configurations at an N whose test detects TV 0.03 (the bar for a lossless verdict), in seed blocks
# stored as they land (benchmarks/records/blocks/), so a run of hours resumes where it stopped
# transformers at T = 1 leaves the whole vocabulary: cells of expected count >= 50 (not 5), whose fewer cells let
# these N detect TV 0.03 or less (at >= 5, 40,000 runs of the first detect 0.038); rarer sequences pool into their
# prefix's rest. In the order they run, each N the least that detects <= 0.03 (rounded up): a lossless verdict's
# target law and a lossy one's predicted law must both hold at such an N
COARSE = {"min_expected": 50.0}
POWER = [
    ("llamacpp-server", 2, 30000, 1.0, {}, PROMPT),
    ("transformers-assisted", 2, 24000, 1.0, {}, PROMPT, COARSE),  # detects 0.028
    ("transformers-lookup", 2, 16000, 1.0, {"prompt_lookup_num_tokens": 3}, LOOKUP_PROMPT, COARSE),  # 0.030
    ("transformers-assisted", 2, 18000, 0.7, {"top_p": 0.9, "repetition_penalty": 1.2}, PROMPT, COARSE),  # 0.029
    ("transformers-assisted", 2, 22000, 1.0, {"assistant_ensemble_weight": 0.5}, PROMPT, COARSE),  # 0.030
    # llama-speculative-simple, exact: a process a generation (~0.5 s each alone here)
    ("llamacpp-simple", 2, 18000, 0.8, {}, PROMPT, COARSE),  # 0.030
    # then the lossy llama.cpp verdicts at the same N (the same target law, so the same cells): the server's
    # synthetic acceptance without request seeds, and llama-speculative at its defaults (one branch)
    ("llamacpp-server", 2, 18000, 0.8, {"synth_rates": [0.5, 0.25, 0.125], "seeded": False}, PROMPT, COARSE),
    ("llamacpp-example", 2, 18000, 0.8, {}, PROMPT, COARSE),
]
BLOCKS = Path("benchmarks/records/blocks")
FIGURE = "12_engines_executed"  # notebook 12's figure, one panel a configuration at its largest N


def blocks_name(engine, n_tokens, temperature, options, prompt, n, args) -> str:
    """A configuration's block file's name: its key and block size, hashed."""
    text = key(engine, n_tokens, temperature, options, prompt, n) + f"{args.batch_size}:{args.scale}"
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def done_keys(record: dict) -> set[str]:
    """The keys of the configurations the record already holds."""
    return {row_config_key(row) for row in record["rows"]}


def blocks_path(engine, n_tokens, temperature, options, prompt, n, args) -> Path:
    """Where a POWER configuration's seed blocks are stored."""
    return BLOCKS / f"{engine}-{blocks_name(engine, n_tokens, temperature, options, prompt, n, args)}.jsonl"


def status(args, record: dict) -> list[str]:
    """One line a POWER configuration: in the record, or how far its stored blocks are (``BlockStore.progress``)."""
    done = done_keys(record)
    lines = []
    for engine, n_tokens, n, temperature, options, prompt, *_ in POWER:
        name = f"{engine} {json.dumps(options)} T {temperature} N {n}"
        if key(engine, n_tokens, temperature, options, prompt, n) in done:
            lines.append(f"{name}: done, in the record")
            continue
        lines.append(f"{name}: {BlockStore.progress(blocks_path(engine, n_tokens, temperature, options, prompt, n, args), n)}")
    return lines


def supersede(record: dict, out: Path, args) -> list[str]:
    """``--supersede``: move ``args.supersede``'s power rows out of ``rows`` (module docstring). -> what was moved."""
    if not args.why:
        raise SystemExit("--supersede needs --why: the reason the rows no longer stand, kept with them")
    lines, kept = [], []
    for row in record["rows"]:
        if row.get("engine") != args.supersede or "power_n" not in row:
            kept.append(row)
            continue
        path = blocks_path(row["engine"], row["n_tokens"], row["temperature"], row["options"], row["prompt"],
                           row["power_n"], args)
        aside = BlockStore.set_aside(path, path.with_name(path.stem + ".superseded.jsonl.gz"))
        record.setdefault("superseded", []).append(row | {"why": args.why, "blocks": aside and str(aside)})
        lines.append(f"{row['engine']} N {row['power_n']}: moved to 'superseded'{f', its blocks to {aside}' if aside else ''}")
    if not lines:
        raise SystemExit(f"no power row of {args.supersede!r} in {out}")
    record["rows"] = kept
    write_json_record(out, record)
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/records/audit_executed.json")
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--power", action="store_true", help="also the POWER configurations")
    parser.add_argument("--docs", action="store_true",
                        help="rewrite docs/audit.md's table of engines run and notebook 12's figure in docs/figures, and stop")
    parser.add_argument("--only", action="append", metavar="ENGINE",
                        help="run only this engine's configurations (repeatable): two processes on two engines share "
                             "the record")
    parser.add_argument("--batch-size", type=int, default=500, help="generations per seed block (--power)")
    parser.add_argument("--status", action="store_true", help="print each POWER run's progress and stop")
    parser.add_argument("--pack", action="store_true", help="gzip the block files of finished runs and stop")
    parser.add_argument("--supersede", metavar="ENGINE", help="move ENGINE's power rows to 'superseded' (with --why), "
                        "keep their blocks aside, and stop")
    parser.add_argument("--why", help="with --supersede: why the rows no longer stand")
    add_executor_arguments(parser)
    args = parser.parse_args(argv)
    if args.docs:
        records = repo_root() / "benchmarks" / "records"
        rows = [row for name in EXECUTED_RECORDS for row in json.loads((records / f"{name}.json").read_text())["rows"]]
        executed = json.loads((records / "audit_executed.json").read_text())["rows"]
        replace_generated(repo_root() / "docs" / "audit.md", "<!-- executed table: generated -->",
                          "<!-- end of executed table -->", executed_table(rows) + "\n")
        figure = publish_figures(save_figure(plot_executed(largest_runs(executed)), FIGURE).parent,
                                 repo_root() / "docs" / "figures", names=(FIGURE,))
        print(f"wrote docs/audit.md's table and {figure[0].relative_to(repo_root())}")
        return 0
    if args.pack:
        for path in sorted(BLOCKS.glob("*.jsonl")):
            if BlockStore.finished(path):
                size = path.stat().st_size
                packed = BlockStore.pack(path)
                print(f"{path} -> {packed.name}: {size:,} -> {packed.stat().st_size:,} bytes")
            else:
                print(f"{path}: still drawing, left as it is")
        return 0
    out = Path(args.out)
    record = json.loads(out.read_text()) if out.exists() else record_header("benchmarks/audit_executed.py", sys.argv[1:] if argv is None else argv, draft="v8k-4l", rows=[])
    if args.status:
        print("\n".join(status(args, record)))
        return 0
    if args.supersede:
        print("\n".join(supersede(record, out, args)))
        return 0
    executor = make_executor(args, local=None)
    torch.set_num_threads(args.threads)
    done = done_keys(record)
    target, draft, tokenizer = load_pair(draft="v8k-4l", device="cpu", skinny_linear=False, fuse_projections=False)
    runs = [(config, None) for config in CONFIGS] + [(config, config[2]) for config in (POWER if args.power else [])]
    for (engine, n_tokens, n, temperature, options, prompt, *test), power_n in runs:
        if key(engine, n_tokens, temperature, options, prompt, power_n) in done or (args.only and engine not in args.only):
            continue
        parallel = {} if power_n is None else dict(
            executor=executor or LocalExecutor(), models=functools.partial(default_pair), batch_size=args.batch_size,
            blocks_file=blocks_path(engine, n_tokens, temperature, options, prompt, n, args))
        result = execute(engine, prompt=prompt, n_tokens=n_tokens, num_samples=max(20, round(n * args.scale)),
                         temperature=temperature, target=target.model, draft=draft.model, tokenizer=tokenizer,
                         **(test[0] if test else {}), **parallel, **options)
        print(result, flush=True)
        row = {"prompt": prompt, "commit": git_commit()} | result.as_record()  # rows may come from resumed runs
        if power_n is not None:
            row |= {"power_n": power_n, "executor": args.executor, "batch_size": args.batch_size} | (test[0] if test else {})
        if out.exists():  # another process (--only) may have added a row since
            record = json.loads(out.read_text())
        record["rows"].append(row)
        write_json_record(out, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
