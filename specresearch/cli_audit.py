"""``specresearch audit-engine``: run an engine's own speculative code and test its law (:mod:`specresearch.audit.execute`).

Kept beside ``cli.py``, which registers it, so that each stays one screenful of commands.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

__all__ = ["add_audit_engine"]


def add_audit_engine(sub, command) -> None:
    from specresearch.audit.execute import ENGINES

    p = command(sub, "audit-engine", "run an engine's own speculative decoding on the embedded pair and test the law "
                "of its first tokens against the target's and against the audit's prediction",
                "  specresearch audit-engine transformers-sampling --samples 20000 --n-tokens 1   # ~1 minute\n"
                "  specresearch audit-engine transformers-assisted --samples 2000 --option assistant_ensemble_weight=0.5\n"
                "  specresearch audit-engine transformers-lookup --samples 1000 --option prompt_lookup_num_tokens=3")
    p.add_argument("engine", choices=sorted(ENGINES), help="whose code runs")
    p.add_argument("--samples", type=int, default=2000, help="generations (N); the output says the TV this N detects")
    p.add_argument("--n-tokens", type=int, default=2, help="leading generated tokens whose law is tested (1-4)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--prompt", default="Name a colour.", help="the user's turn (chat-templated)")
    p.add_argument("--draft", default="v8k-4l", help="the assistant: a shipped distilled draft or truncated:N")
    p.add_argument("--option", action="append", default=[], metavar="NAME=VALUE",
                   help="an engine setting passed to its generate (top_k, top_p, repetition_penalty, "
                        "assistant_ensemble_weight, prompt_lookup_num_tokens, ...); repeatable")
    p.add_argument("--min-expected", type=float, default=5.0, help="a cell's least expected count")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--record", help="append the result as one JSON line (with command, commit, machine) to this file")
    from specresearch.experiments.executor import add_executor_arguments

    add_executor_arguments(p)  # --executor ray: seed blocks of --batch-size as Ray tasks (audit.execute)
    p.add_argument("--batch-size", type=int, default=500,
                   help="generations per seed block (with --executor ray or --blocks-file)")
    p.add_argument("--blocks-file", help="store each finished seed block in this JSON-lines file; rerun the same "
                                         "command to resume a stopped run from its last block")
    p.set_defaults(func=_run)


def _options(pairs: list[str]) -> dict:
    options = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name:
            raise ValueError(f"--option must be NAME=VALUE, got {pair!r}")
        if "," in value:  # a list, e.g. synth_rates=0.5,0.25,0.125
            options[name] = tuple(float(part) for part in value.split(","))
            continue
        number = float(value)
        options[name] = int(number) if number.is_integer() and name not in ("top_p", "min_p", "repetition_penalty",
                                                                           "assistant_ensemble_weight") else number
    return options


def _run(args) -> int:
    import sys

    import torch

    from specresearch.audit.execute import check_arguments, default_pair, execute
    from specresearch.drafts.registry import load_pair
    from specresearch.experiments.executor import make_executor

    options = _options(args.option)
    check_arguments(args.engine, args.n_tokens, args.samples, args.temperature, options)  # before anything loads
    if args.batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {args.batch_size}")
    executor = make_executor(args, local=None)
    if executor is None and args.blocks_file:
        from specresearch.experiments.executor import LocalExecutor

        executor = LocalExecutor()
    torch.set_num_threads(args.threads)
    if args.draft == "v8k-4l":
        target, draft, tokenizer = default_pair()
        models = functools.partial(default_pair)
    else:
        target_lm, draft_lm, tokenizer = load_pair(draft=args.draft, device="cpu", skinny_linear=False,
                                                   fuse_projections=False)
        target, draft = target_lm.model, draft_lm.model
        models = functools.partial(plain_pair, args.draft)
    result = execute(args.engine, prompt=args.prompt, n_tokens=args.n_tokens, num_samples=args.samples,
                     temperature=args.temperature, seed=args.seed, min_expected=args.min_expected,
                     target=target, draft=draft, tokenizer=tokenizer, executor=executor, models=models,
                     batch_size=args.batch_size, blocks_file=args.blocks_file, **options)
    print(result)
    if args.record:
        from specresearch.experiments.records import record_header

        row = record_header("specresearch", ["audit-engine", *sys.argv[2:]], draft=args.draft,
                            prompt=args.prompt) | result.as_record()
        path = Path(args.record)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as handle:
            handle.write(json.dumps(row) + "\n")
        print(f"appended to {path}")
    return 0


def plain_pair(draft: str):
    """The embedded target and ``draft`` as plain transformers models (a Ray worker's recipe)."""
    from specresearch.drafts.registry import load_pair

    target_lm, draft_lm, _ = load_pair(draft=draft, device="cpu", skinny_linear=False, fuse_projections=False)
    return target_lm.model, draft_lm.model
