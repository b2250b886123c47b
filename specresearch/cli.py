"""Command line: a thin argparse layer that builds configs and calls the package.

Subcommands register themselves in ``_COMMANDS`` through ``_add_*`` functions, one per command; each
shows a worked example in its ``--help``. User errors -- a bad argument value, a missing or malformed
file, an unknown model or draft name, i.e. the ``ValueError`` / ``OSError`` the package raises at its
API boundary -- end in one line ``specresearch <command>: error: ...`` on stderr and exit code 2.
Anything else is a bug and keeps its traceback (``SPECRESEARCH_TRACEBACK=1`` shows one for user errors too).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

# What the package raises for bad input at its boundary (json.JSONDecodeError is a ValueError,
# FileNotFoundError / IsADirectoryError / transformers' "not a model directory" are OSErrors).
_USER_ERRORS = (ValueError, OSError)
# specresearch generate's drafts: the fastest on this CPU at its default gamma (docs/feature_drafts.md), and
# a plain language model for --method contrastive, which scores whole prefixes with it.
from specresearch.checks import OutdatedDependency  # noqa: E402 (what an old environment raises)
from specresearch.cli_audit import add_audit_engine  # noqa: E402 (audit-engine lives beside this file)
from specresearch.cli_checks import (  # noqa: E402 (the flag checks live beside the parser)
    TREE_RULES,
    check_common_flags,
    check_generate_flags,
    check_prompts_file,
    known_names,
    shorten,
)
from specresearch.cli_train import add_distill, add_feature_distill  # noqa: E402 (so do the training commands)
from specresearch.config import COMPILE_CHOICES, GENERATE_DRAFT, GENERATE_GAMMA, GENERATE_MARGIN  # noqa: E402 (shared)

CONTRASTIVE_AMATEUR = "v8k-4l"


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: ``<prog>: error: <message> (see <prog> --help)``, exit code 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _to_stderr(message: str) -> None:
    """What the engine announces (the step-cost timing of the default configuration), on stderr beside the output."""
    print(message, file=sys.stderr)


def _announce_draft_format(name: str | None) -> None:
    """For ``--draft DIR``: which layout the directory was read as, on stderr."""
    from specresearch.drafts.registry import draft_format, without_weight_prefix

    if name == "mtp":
        from specresearch.drafts.registry import MTP_FORMAT

        _to_stderr(f"--draft mtp: {MTP_FORMAT}")
    elif name is not None and Path(without_weight_prefix(name)).is_dir():
        _to_stderr(f"--draft {name}: {draft_format(without_weight_prefix(name))}")


def _command(sub, name: str, help: str, example: str) -> argparse.ArgumentParser:
    """A subcommand parser whose ``--help`` ends with ``example`` (kept verbatim). No abbreviated flags:
    ``bench --gamma 3`` would otherwise silently mean ``--gammas 3`` and start a different sweep."""
    return sub.add_parser(name, help=help, description=help, epilog="example:\n" + example, allow_abbrev=False,
                          formatter_class=argparse.RawDescriptionHelpFormatter)


def _add_report(sub) -> None:
    p = _command(sub, "report", "execute the notebooks headless into reports/ (HTML, PNG figures) and "
                 "refresh the README figures in docs/figures/",
                 "  specresearch report --quick --only 01 03   # two notebooks, small parameters (~30 s)\n"
                 "  specresearch report                        # the main job: every notebook (a few minutes)")
    p.add_argument("--notebooks", default="notebooks", help="directory of numbered notebooks")
    p.add_argument("--out", default="reports", help="output directory")
    p.add_argument("--quick", action="store_true", help="small parameters (what the tests run)")
    p.add_argument("--only", nargs="*", help="run only notebooks whose file name contains one of these")
    p.add_argument("--docs-figures", default="docs/figures",
                   help="where a full run copies the README's figures (default docs/figures; '' = nowhere)")
    p.set_defaults(func=_run_report)


def _run_report(args) -> int:
    from specresearch.experiments.report import run_report

    runs = run_report(args.notebooks, args.out, quick=args.quick, only=args.only,
                      docs_figures=args.docs_figures or None)
    total = sum(r.seconds for r in runs)
    print(f"executed {len(runs)} notebooks in {total:.0f} s; report in {args.out}/")
    return 0


def _add_generate(sub) -> None:
    p = _command(sub, "generate", "speculative generation on a model (default: the embedded SmolLM2-135M)",
                 '  specresearch generate "Tell me a story" --verifier block --gamma 4 --temperature 1.0 '
                 "--max-new-tokens 64\n"
                 '  specresearch generate "Tell me a story" --method beam --num-beams 4')
    p.add_argument("prompt", help="the user message (wrapped in the chat template unless --raw)")
    p.add_argument("--model", default="smollm2-135m-instruct", help="embedded model name or local checkpoint path")
    p.add_argument("--draft", default=None,
                   help=f"{GENERATE_DRAFT} (default: prompt lookup, the shipped feature head with float16 weights elsewhere; the "
                        "fastest draft measured on a 2-core CPU) | ngram+NAME[@OPTION] | a shipped draft (v8k-4l, "
                        "eagle3-v8k; any name under data/drafts/) | fp16:NAME / int8:NAME (its weights in float16 / int8) | "
                        "ngram | truncated:N | mtp (the --model checkpoint's own MTP layer) | checkpoint path. "
                        f"--method contrastive: the amateur (default {CONTRASTIVE_AMATEUR})")
    p.add_argument("--verifier", default=None, choices=["token", "block", "greedy", *TREE_RULES],
                   help="token | block (default; onehot with --draft-law dynamic / static) | greedy for one draft path; "
                        "with --num-drafts K > 1 a multi-draft rule: " + " | ".join(TREE_RULES))
    p.add_argument("--gamma", type=_gamma_arg, default=None,
                   help=f"draft tokens per step. Default ('auto'): for a chain {GENERATE_GAMMA} (measured fastest on the "
                        "reference CPU) unless this machine's step costs (engine.cost, timed once and cached) predict another "
                        f"gamma faster by more than {round(100 * GENERATE_MARGIN)}%%, or with the default --draft and "
                        "--verifier a dynamic tree (where scoring is nearly free, e.g. a GPU at T = 0); with "
                        f"--num-drafts or --stop-below {GENERATE_GAMMA}. With the default --draft a chain's gamma, "
                        "chosen or given, is also its head's length where lookup finds no match")
    p.add_argument("--num-drafts", type=int, default=1,
                   help="draft paths per step, scored as one tree in one target call (default 1: a chain; K > 1 needs a "
                        "multi-draft --verifier; every draft draws trees)")
    p.add_argument("--stop-below", type=float, default=None,
                   help="adaptive chains: draft up to --gamma tokens, stopping once the draft's top probability is below this")
    p.add_argument("--draft-law", default="iid", choices=["iid", "without_replacement", "dynamic", "static"],
                   help="how the K paths are drawn: i.i.d., or their first tokens without replacement; dynamic: EAGLE-2's "
                        "deterministic tree (top-K children per expanded node, --gamma deep, --verifier onehot); static: the same "
                        "without looking at the draft's values (EAGLE-1)")
    p.add_argument("--tree-nodes", type=int, default=None,
                   help="--draft-law dynamic / static: nodes kept in the tree (default K * gamma)")
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto", help="auto (cuda > mps > cpu), cpu, cuda, ...")
    p.add_argument("--device-map", default=None, help='e.g. "auto": shard a large --model across GPUs')
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="the target's weights and arithmetic (a checkpoint draft takes the target's): auto = the "
                        "checkpoint's (the embedded model's float32). In bfloat16 greedy speculative decoding can part "
                        "from greedy autoregressive decoding where logits nearly tie (docs/engine_and_models.md)")
    p.add_argument("--raw", action="store_true", help="use the prompt as is, without the chat template")
    p.add_argument("--autoregressive", action="store_true", help="plain decoding with the target (no draft)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (1 is fastest on a busy machine)")
    p.add_argument("--compile", default="auto", choices=COMPILE_CHOICES,
                   help="captured steps over static caches (engine.static): auto = on CUDA where the run has them "
                        "(a whole-model draft, a feature head: --draft eagle3-v8k, Medusa heads, a DFlash block, a "
                        "Gemma 4 assistant), else the growing loop; on; off")
    _add_decoding_arguments(p)
    p.set_defaults(func=_run_generate)


def _add_decoding_arguments(p) -> None:
    """Classic decoding methods (specresearch.engine.decoding) instead of the speculative loop."""
    # choices spelled out (importing decoding here would load torch for every command); = decoding.METHODS
    methods = ["speculative", "greedy", "sample", "beam", "contrastive"]
    p.add_argument("--method", default="speculative", choices=methods,
                   help="speculative (default) or a plain decoding method of the decoding survey; "
                        "sample uses --temperature/--top-k/--top-p/--epsilon, contrastive uses --draft as amateur")
    p.add_argument("--epsilon", type=float, default=None, help="epsilon sampling: drop tokens with prob < epsilon")
    p.add_argument("--num-beams", type=int, default=4, help="beam width (--method beam)")
    p.add_argument("--length-penalty", type=float, default=0.0, help="beam score log P / length^alpha (alpha)")
    p.add_argument("--no-repeat-ngram", type=int, default=None, help="ban repeating n-grams of this size")
    p.add_argument("--contrastive-alpha", type=float, default=0.1, help="plausibility threshold (--method contrastive)")


def _run_decoding(args, target, tokenizer, prompt: str, sampling) -> int:
    import torch

    from specresearch.engine.decoding import DecodingConfig, decode, lm_logits_fn
    from specresearch.engine.results import eos_ids

    config = DecodingConfig(method=args.method, sampling=sampling, max_new_tokens=args.max_new_tokens,
                            num_beams=args.num_beams, length_penalty=args.length_penalty,
                            no_repeat_ngram_size=args.no_repeat_ngram, contrastive_alpha=args.contrastive_alpha)
    ids = torch.tensor([tokenizer(prompt, add_special_tokens=False)["input_ids"]], device=target.device)
    amateur = None
    if args.method == "contrastive":
        from specresearch.drafts.registry import draft_from_name

        amateur = lm_logits_fn(draft_from_name(args.draft or CONTRASTIVE_AMATEUR, target))
    out = decode(lm_logits_fn(target), ids, config, amateur_fn=amateur,
                 eos_token_id=sorted(eos_ids(None, tokenizer, target)),
                 generator=torch.Generator(device=target.device).manual_seed(args.seed))
    for row, n, score in zip(out.sequences.tolist(), out.num_generated.tolist(), out.scores.tolist()):
        text = tokenizer.decode(row[ids.shape[1] : ids.shape[1] + n], skip_special_tokens=True)
        print(f"{text}\n[{n} tokens, score {score:.3f}]\n")
    return 0


def _run_generate(args) -> int:
    from specresearch.config import SamplingConfig
    from specresearch.drafts.registry import draft_from_name
    from specresearch.engine.generate import autoregressive_generate, speculative_generate
    from specresearch.engine.prompts import encode_prompts
    from specresearch.engine.results import check_context
    from specresearch.models.embedded import load_model

    args.gamma_given, args.verifier_given = args.gamma is not None, args.verifier is not None
    requested = "auto" if args.gamma is None else args.gamma  # resolved once the models are loaded
    args.gamma = GENERATE_GAMMA if requested == "auto" else requested  # (the flag checks need a count)
    check_generate_flags(args)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    sampling = SamplingConfig(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, epsilon=args.epsilon)
    dtype = None if args.dtype == "auto" else getattr(torch, args.dtype)
    target, tokenizer = load_model(args.model, device=args.device, device_map=args.device_map, dtype=dtype)
    prompt = args.prompt
    if not args.raw and getattr(tokenizer, "chat_template", None):
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                               tokenize=False)
    if args.method != "speculative":
        return _run_decoding(args, target, tokenizer, prompt, sampling)
    check_context(target, encode_prompts([prompt], tokenizer)[0], args.max_new_tokens)  # before any draft or timing
    stream = _Stream(tokenizer, args.max_new_tokens)
    common = dict(max_new_tokens=args.max_new_tokens, sampling=sampling, seed=args.seed, tokenizer=tokenizer,
                  on_step=stream, compile=args.compile)
    if args.autoregressive:
        result = autoregressive_generate(target, [prompt], **common)
    else:
        draft = draft_from_name(args.draft or GENERATE_DRAFT, target, tokenizer)
        _announce_draft_format(args.draft)
        from specresearch.engine.cost import fit_default_draft, resolve_config

        default = args.draft in (None, GENERATE_DRAFT)  # named or not, as specresearch.generate and bench take it
        trees = default and not args.verifier_given and args.draft_law == "iid" and args.tree_nodes is None
        chosen = resolve_config(requested, target, draft, temperature=args.temperature, num_drafts=args.num_drafts,
                                stop_below=args.stop_below, trees=trees,
                                announce=_to_stderr)
        if default:  # its head drafts the chain's length off a lookup match too, chosen or asked for
            fit_default_draft(draft, chosen)
        options = {"verifier": args.verifier, "num_drafts": args.num_drafts, "draft_law": args.draft_law,
                   "tree_nodes": args.tree_nodes, **chosen}
        args.gamma = options.pop("gamma")
        result = speculative_generate(target, draft, [prompt], gamma=args.gamma, stop_below=args.stop_below, **options,
                                      **common)
    stream.close()
    compiled = f" (step compiled or captured first: {result.compile_seconds:.1f} s)" if result.compile_seconds else ""
    print(f"\n\n{result.num_tokens} tokens in {result.seconds:.2f} s = {result.tokens_per_second:.1f} tokens/s"
          f"{compiled}; {result.target_calls} target calls", end="")
    if not args.autoregressive:
        nodes = options["tree_nodes"] or options["num_drafts"] * args.gamma
        shape = (f"; {options['verifier']} tree K {options['num_drafts']}, depth {args.gamma}, {nodes} nodes"
                 if options["draft_law"] == "dynamic" else f"; gamma {args.gamma}")
        print(f"{shape}, block efficiency {result.block_efficiency:.2f}, acceptance rate {result.acceptance_rate:.2f}",
              end="")
    print()
    return 0


def _gamma_arg(text: str) -> int | str:
    """``--gamma``: a count, or ``auto`` (this machine's cost curve, ``engine.cost``)."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--gamma must be a count >= 1 or 'auto' (this machine's cost curve), got {text!r}") from None


class _Stream:
    """Prints the text of row 0 as tokens are accepted (and a tqdm bar on stderr for long runs)."""

    def __init__(self, tokenizer, total: int):
        self.tokenizer, self.tokens, self.printed = tokenizer, [], ""
        self.total, self.bar = total, None  # the bar starts with the first step, after the engine's checks

    def __call__(self, kept: list[list[int]]) -> None:
        if self.bar is None:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=self.total, unit="tok", file=sys.stderr, leave=False, disable=self.total < 256)
        self.tokens.extend(kept[0])
        self.bar.update(len(kept[0]))
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        if text.startswith(self.printed):  # hold back while a multi-byte character is incomplete
            print(text[len(self.printed):], end="", flush=True)
            self.printed = text

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _add_warm_cache(sub) -> None:
    p = _command(sub, "warm-cache", "convert and cache the embedded model now (first use takes ~20-40 s)",
                 "  specresearch warm-cache")
    p.add_argument("--model", default="smollm2-135m-instruct", help="embedded model name")
    p.set_defaults(func=_run_warm_cache)


def _run_warm_cache(args) -> int:
    from specresearch.models.embedded import cache_dir, load_embedded

    load_embedded(args.model, device="cpu")
    print(f"{args.model} is cached in {cache_dir() / args.model}")
    return 0


def _add_bench(sub) -> None:
    p = _command(sub, "bench", "block vs token verification sweep (Sun et al. 2025, arXiv 2403.10444): records to <out>/<run>.csv",
                 "  specresearch bench --quick --draft v8k-4l                  # a few minutes\n"
                 "  specresearch bench --draft v8k-4l --prompts 14 --max-new-tokens 32 --threads 2 "
                 "--prompts-file data/prompts.jsonl")
    p.add_argument("--target", default="smollm2-135m-instruct", help="embedded model name or local checkpoint path")
    p.add_argument("--draft", default=None,
                   help="v8k-4l (default; a shipped distilled draft; eagle3-v8k the feature head) | ngram | ngram+NAME[@OPTION] | "
                        "truncated:N | fp16:NAME | int8:NAME | dial-mix:LAM (BE only) | checkpoint path")
    p.add_argument("--default-config", action="store_true",
                   help=f"time exactly what `specresearch generate` runs by default ({GENERATE_DRAFT}, block, the gamma "
                        "it picks on this machine) against autoregressive decoding; the prompt, temperature and length flags apply")
    p.add_argument("--quick", action="store_true", help="the 'quick' preset (a few minutes); flags below override")
    p.add_argument("--verifiers", nargs="+", help="default: token block; a draft tree as NAME:K[:LAW], e.g. traversal:4 (engine.tree.parse_verifier)")
    p.add_argument("--temperatures", nargs="+", type=float, help="default: 0 0.2 0.6 1.0")
    p.add_argument("--gammas", nargs="+", type=int, help="default: 2 4 6 8")
    p.add_argument("--seeds", nargs="+", type=int, help="default: 0")
    p.add_argument("--max-new-tokens", type=int, help="default: 32")
    p.add_argument("--prompts", type=int, help="number of prompts, evenly spaced (7 = one per category; default all)")
    p.add_argument("--categories", nargs="+", help="keep only these prompt categories")
    p.add_argument("--prompts-file", help="default: the repository's data/prompts.jsonl")
    p.add_argument("--prompt-set", choices=["mt-bench", "humaneval"],
                   help="a paper's prompt set instead of --prompts-file: MT-Bench's 80 questions (first turns) or HumanEval's 164 stubs")
    p.add_argument("--run", help="run id = file name (default: from the settings, so rerunning resumes)")
    p.add_argument("--out", default="results", help="directory of the records")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--device", default="cpu", help="cpu, cuda, auto, ...")
    p.add_argument("--compile", default="off", choices=COMPILE_CHOICES,
                   help="off: the growing loop (its records carry the per-step expectations); on / static / ...: "
                        "captured steps over static caches (engine.static)")
    p.add_argument("--batched", action="store_true",
                   help="all prompts in one call per setting: cheaper, BE only (no wall-clock); for dial-* drafts")
    from specresearch.experiments.executor import add_executor_arguments

    add_executor_arguments(p)  # --executor ray: each prompt a Ray task (experiments.executor)
    p.set_defaults(func=_run_bench)


def _run_bench(args) -> int:
    import dataclasses

    import torch

    from specresearch.experiments import analysis, bench

    check_prompts_file("--prompts-file", args.prompts_file)
    if args.default_config:
        given = [flag for flag, value in (("--draft", args.draft), ("--verifiers", args.verifiers), ("--gammas", args.gammas)) if value]
        if given:
            raise ValueError(f"--default-config fixes the draft, verifier and gamma to generate's defaults: drop {', '.join(given)}")
        args.draft, args.verifiers, args.gammas = GENERATE_DRAFT, ["block"], [GENERATE_GAMMA]  # gamma: the machine's, below
    args.draft = args.draft or "v8k-4l"
    if args.prompt_set:
        from specresearch.engine.prompts import prompt_set_file

        if args.prompts_file:
            raise ValueError("--prompt-set and --prompts-file name two prompt sources: give one")
        args.prompts_file = str(prompt_set_file(args.prompt_set))
    torch.set_num_threads(args.threads)
    fields = {"verifiers": args.verifiers, "temperatures": args.temperatures, "gammas": args.gammas,
              "seeds": args.seeds, "max_new_tokens": args.max_new_tokens, "num_prompts": args.prompts,
              "categories": args.categories, "compile": None if args.compile == "off" else args.compile}
    preset = bench.BenchConfig.from_name("quick" if args.quick else "full")
    config = dataclasses.replace(preset, **{k: tuple(v) if isinstance(v, list) else v
                                            for k, v in fields.items() if v is not None})
    prefix = ("quick-" if args.quick else "") + ("default-" if args.default_config else "")
    run = args.run or bench.default_run_id(args.target, args.draft, config, prefix)
    path = Path(args.out) / f"{run}.csv"
    from specresearch.experiments.executor import make_executor

    records = bench.run_named(args.target, args.draft, config, path, prompts_path=args.prompts_file, run_id=run,
                              device=args.device, command="specresearch " + " ".join(sys.argv[1:]),
                              batched=args.batched, default_gamma=args.default_config,
                              announce=_to_stderr, executor=make_executor(args, local=None))
    print(analysis.summary(records))
    same, units = analysis.t0_agreement(records)
    if units and len(config.verifiers) > 1:
        print(f"\nT = 0: the verifiers' outputs identical in {same}/{units} units")
    print(f"records in {path}")
    return 0


_COMMANDS = [_add_report, _add_generate, lambda sub: add_distill(sub, _command), lambda sub: add_feature_distill(sub, _command),
             _add_warm_cache, _add_bench, lambda sub: add_audit_engine(sub, _command)]


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="specresearch", description=__doc__.splitlines()[0],
                     epilog="`specresearch <command> --help` shows each command's options and an example.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="command")
    for add in _COMMANDS:
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command; user errors become one line on stderr and exit code 2 (module docstring)."""
    try:
        import specresearch.models  # noqa: F401 (checks transformers' version; the parser imports the engines)
    except OutdatedDependency as exc:
        print(f"specresearch: error: {exc}", file=sys.stderr)
        return 2
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # reported by the subcommand's parser, so the line names the command
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        sub.choices[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
    _quiet_and_offline()
    try:
        check_common_flags(args)
        return args.func(args)
    except _USER_ERRORS as exc:
        if os.environ.get("SPECRESEARCH_TRACEBACK") == "1":
            raise
        print(f"specresearch {args.command}: error: {_user_message(exc, args)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"specresearch {args.command}: interrupted", file=sys.stderr)
        return 130


def _quiet_and_offline() -> None:
    """No hub: a name that is neither embedded, shipped nor a directory fails at once instead of retrying
    a download for a minute. No "Loading weights" bar per model load: the commands draw their own bars."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if "transformers" in sys.modules:  # imported before main() (tests, an interactive session): tell it too
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()


def _user_message(exc: BaseException, args) -> str:
    """One line for a user error; a model or draft that failed to load is named with the flag that gave it."""
    message = shorten(str(exc) or type(exc).__name__, 400)
    if isinstance(exc, FileNotFoundError) and exc.filename:
        message = f"{exc.filename}: {exc.strerror or 'no such file'}"
    if isinstance(exc, OSError) and not isinstance(exc, FileNotFoundError) and os.environ.get("HF_HUB_OFFLINE") != "0":
        from specresearch.drafts.registry import without_weight_prefix

        # transformers' message for a name it cannot resolve offline does not say which name it was
        for flag in ("model", "target", "draft"):
            name, known = getattr(args, flag, None), known_names(flag)
            base = without_weight_prefix(name) if name else name
            if name and not Path(base).exists() and base not in known and not base.startswith("truncated:"):
                return (f"--{flag} {name!r} is neither a known name ({', '.join(known)}) "
                        f"nor an existing checkpoint directory")
    return message


if __name__ == "__main__":
    sys.exit(main())
