"""Command line: a thin argparse layer that builds configs and calls the package.

Subcommands register themselves in ``_COMMANDS`` through ``_add_*`` functions, one per command.
"""

from __future__ import annotations

import argparse
import sys


def _add_report(sub) -> None:
    p = sub.add_parser("report", help="execute the notebooks headless into reports/ (HTML, PNG figures)")
    p.add_argument("--notebooks", default="notebooks", help="directory of numbered notebooks")
    p.add_argument("--out", default="reports", help="output directory")
    p.add_argument("--quick", action="store_true", help="small parameters (what the tests run)")
    p.add_argument("--only", nargs="*", help="run only notebooks whose file name contains one of these")
    p.set_defaults(func=_run_report)


def _run_report(args) -> int:
    from specresearch.report import run_report

    runs = run_report(args.notebooks, args.out, quick=args.quick, only=args.only)
    total = sum(r.seconds for r in runs)
    print(f"executed {len(runs)} notebooks in {total:.0f} s; report in {args.out}/")
    return 0


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="speculative generation on a model (default: the embedded SmolLM2-135M)")
    p.add_argument("prompt", help="the user message (wrapped in the chat template unless --raw)")
    p.add_argument("--model", default="smollm2-135m-instruct", help="embedded model name or local checkpoint path")
    p.add_argument("--draft", default="v8k-4l",
                   help="v8k-4l (the shipped distilled draft; any name under data/drafts/) | ngram | truncated:N | checkpoint path")
    p.add_argument("--verifier", default="block", choices=["token", "block", "greedy"])
    p.add_argument("--gamma", type=int, default=4, help="draft tokens per step")
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto", help="auto (cuda > mps > cpu), cpu, cuda, ...")
    p.add_argument("--device-map", default=None, help='e.g. "auto": shard a large --model across GPUs')
    p.add_argument("--raw", action="store_true", help="use the prompt as is, without the chat template")
    p.add_argument("--autoregressive", action="store_true", help="plain decoding with the target (no draft)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (1 is fastest on a busy machine)")
    _add_decoding_arguments(p)
    p.set_defaults(func=_run_generate)


def _add_decoding_arguments(p) -> None:
    """Classic decoding methods (specresearch.decoding) instead of the speculative loop."""
    # choices spelled out (importing decoding here would load torch for every command); = decoding.METHODS
    methods = ["speculative", "greedy", "sample", "beam", "contrastive"]
    p.add_argument("--method", default="speculative", choices=methods,
                   help="speculative (default) or a plain decoding method of reference 001; "
                        "sample uses --temperature/--top-k/--top-p/--epsilon, contrastive uses --draft as amateur")
    p.add_argument("--epsilon", type=float, default=None, help="epsilon sampling: drop tokens with prob < epsilon")
    p.add_argument("--num-beams", type=int, default=4, help="beam width (--method beam)")
    p.add_argument("--length-penalty", type=float, default=0.0, help="beam score log P / length^alpha (alpha)")
    p.add_argument("--no-repeat-ngram", type=int, default=None, help="ban repeating n-grams of this size")
    p.add_argument("--contrastive-alpha", type=float, default=0.1, help="plausibility threshold (--method contrastive)")


def _run_decoding(args, target, tokenizer, prompt: str, sampling) -> int:
    import torch

    from specresearch.decoding import DecodingConfig, decode, lm_logits_fn

    config = DecodingConfig(method=args.method, sampling=sampling, max_new_tokens=args.max_new_tokens,
                            num_beams=args.num_beams, length_penalty=args.length_penalty,
                            no_repeat_ngram_size=args.no_repeat_ngram, contrastive_alpha=args.contrastive_alpha)
    ids = torch.tensor([tokenizer(prompt, add_special_tokens=False)["input_ids"]], device=target.device)
    amateur = None
    if args.method == "contrastive":
        from specresearch.drafts import draft_from_name

        amateur = lm_logits_fn(draft_from_name(args.draft, target))
    out = decode(lm_logits_fn(target), ids, config, amateur_fn=amateur, eos_token_id=tokenizer.eos_token_id,
                 generator=torch.Generator(device=target.device).manual_seed(args.seed))
    for row, n, score in zip(out.sequences.tolist(), out.num_generated.tolist(), out.scores.tolist()):
        text = tokenizer.decode(row[ids.shape[1] : ids.shape[1] + n], skip_special_tokens=True)
        print(f"{text}\n[{n} tokens, score {score:.3f}]\n")
    return 0


def _run_generate(args) -> int:
    from specresearch.drafts import draft_from_name
    from specresearch.embedded import load_model
    from specresearch.generate import autoregressive_generate, speculative_generate
    from specresearch.sampling import SamplingConfig

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    sampling = SamplingConfig(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, epsilon=args.epsilon)
    target, tokenizer = load_model(args.model, device=args.device, device_map=args.device_map)
    prompt = args.prompt
    if not args.raw and getattr(tokenizer, "chat_template", None):
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                               tokenize=False)
    if args.method != "speculative":
        return _run_decoding(args, target, tokenizer, prompt, sampling)
    stream = _Stream(tokenizer, args.max_new_tokens)
    common = dict(max_new_tokens=args.max_new_tokens, sampling=sampling, seed=args.seed, tokenizer=tokenizer,
                  on_step=stream)
    if args.autoregressive:
        result = autoregressive_generate(target, [prompt], **common)
    else:
        draft = draft_from_name(args.draft, target, tokenizer)
        result = speculative_generate(target, draft, [prompt], verifier=args.verifier, gamma=args.gamma, **common)
    stream.close()
    print(f"\n\n{result.num_tokens} tokens in {result.seconds:.2f} s = {result.tokens_per_second:.1f} tokens/s; "
          f"{result.target_calls} target calls", end="")
    if not args.autoregressive:
        print(f"; block efficiency {result.block_efficiency:.2f}, acceptance rate {result.acceptance_rate:.2f}", end="")
    print()
    return 0


class _Stream:
    """Prints the text of row 0 as tokens are accepted (and a tqdm bar on stderr for long runs)."""

    def __init__(self, tokenizer, total: int):
        from tqdm.auto import tqdm

        self.tokenizer, self.tokens, self.printed = tokenizer, [], ""
        self.bar = tqdm(total=total, unit="tok", file=sys.stderr, leave=False, disable=total < 256)

    def __call__(self, kept: list[list[int]]) -> None:
        self.tokens.extend(kept[0])
        self.bar.update(len(kept[0]))
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        if text.startswith(self.printed):  # hold back while a multi-byte character is incomplete
            print(text[len(self.printed):], end="", flush=True)
            self.printed = text

    def close(self) -> None:
        self.bar.close()


def _add_distill(sub) -> None:
    p = sub.add_parser("distill", help="train a KL-distilled draft for the embedded target (resumable; ships to data/drafts/)")
    p.add_argument("--preset", default="v8k-4l", help="draft preset (specresearch.drafts.DRAFT_PRESETS)")
    p.add_argument("--target", default="smollm2-135m-instruct", help="embedded target model")
    for flag, kind in [("--seed", int), ("--steps", int), ("--batch-size", int), ("--seq-len", int), ("--lr", float),
                       ("--warmup-steps", int), ("--corpus-temperature", float), ("--corpus-max-new-tokens", int),
                       ("--corpus-samples-per-prompt", int), ("--corpus-batch-size", int), ("--checkpoint-every", int),
                       ("--teacher-top-k", int), ("--weight-decay", float)]:
        p.add_argument(flag, type=kind, help="TrainConfig field (default: the dataclass default)")
    p.add_argument("--prompts", default="data/distill_prompts.jsonl", help="distillation prompts")
    p.add_argument("--heldout", default="data/prompts.jsonl", help="held-out prompts for the measurement")
    p.add_argument("--heldout-prompts", type=int, default=14, help="how many held-out prompts (evenly spaced)")
    p.add_argument("--measure-tokens", type=int, default=64, help="continuation length in the measurement")
    p.add_argument("--out", help="output directory (default data/drafts/<preset>)")
    p.add_argument("--max-minutes", type=float, help="stop and checkpoint after this long; rerun the command to resume")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.set_defaults(func=_run_distill)


def _run_distill(args) -> int:
    import json

    import torch

    from specresearch.distill import DraftConfig, TrainConfig, run_distillation
    from specresearch.embedded import load_embedded

    torch.set_num_threads(args.threads)
    fields = {f: getattr(args, f) for f in TrainConfig.__dataclass_fields__ if getattr(args, f, None) is not None}
    lm, tokenizer = load_embedded(args.target, device="cpu")
    manifest = run_distillation(
        lm.model, tokenizer, DraftConfig.from_name(args.preset), TrainConfig(**fields), prompts_path=args.prompts,
        heldout_path=args.heldout, out_dir=args.out, heldout_prompts=args.heldout_prompts,
        measure_tokens=args.measure_tokens, max_seconds=None if args.max_minutes is None else 60 * args.max_minutes,
        command="specresearch " + " ".join(sys.argv[1:]),
    )
    if not manifest["finished"]:
        print(f"stopped at step {manifest['training']['steps']}; rerun the same command to resume")
        return 0
    print(json.dumps({k: manifest[k] for k in ("measurement", "cost", "training")}, indent=2))
    return 0


def _add_warm_cache(sub) -> None:
    p = sub.add_parser("warm-cache", help="convert and cache the embedded model now (first use takes ~20-40 s)")
    p.add_argument("--model", default="smollm2-135m-instruct", help="embedded model name")
    p.set_defaults(func=_run_warm_cache)


def _run_warm_cache(args) -> int:
    from specresearch.embedded import cache_dir, load_embedded

    load_embedded(args.model, device="cpu")
    print(f"{args.model} is cached in {cache_dir() / args.model}")
    return 0


def _add_bench(sub) -> None:
    p = sub.add_parser("bench", help="block vs token verification sweep (reference 003): records to <out>/<run>.csv")
    p.add_argument("--target", default="smollm2-135m-instruct", help="embedded model name or local checkpoint path")
    p.add_argument("--draft", default="v8k-4l",
                   help="v8k-4l (a shipped distilled draft) | ngram | truncated:N | dial-mix:LAM (BE only) | checkpoint path")
    p.add_argument("--quick", action="store_true", help="the 'quick' preset (a few minutes); flags below override")
    p.add_argument("--verifiers", nargs="+", help="default: token block")
    p.add_argument("--temperatures", nargs="+", type=float, help="default: 0 0.2 0.6 1.0")
    p.add_argument("--gammas", nargs="+", type=int, help="default: 2 4 6 8")
    p.add_argument("--seeds", nargs="+", type=int, help="default: 0")
    p.add_argument("--max-new-tokens", type=int, help="default: 32")
    p.add_argument("--prompts", type=int, help="number of prompts, evenly spaced (7 = one per category; default all)")
    p.add_argument("--categories", nargs="+", help="keep only these prompt categories")
    p.add_argument("--prompts-file", help="default: the repository's data/prompts.jsonl")
    p.add_argument("--run", help="run id = file name (default: from the settings, so rerunning resumes)")
    p.add_argument("--out", default="results", help="directory of the records")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--device", default="cpu", help="cpu, cuda, auto, ...")
    p.add_argument("--batched", action="store_true",
                   help="all prompts in one call per setting: cheaper, BE only (no wall-clock); for dial-* drafts")
    p.set_defaults(func=_run_bench)


def _run_bench(args) -> int:
    import dataclasses
    from pathlib import Path

    import torch

    from specresearch import analysis, bench

    torch.set_num_threads(args.threads)
    fields = {"verifiers": args.verifiers, "temperatures": args.temperatures, "gammas": args.gammas,
              "seeds": args.seeds, "max_new_tokens": args.max_new_tokens, "num_prompts": args.prompts,
              "categories": args.categories}
    preset = bench.BenchConfig.from_name("quick" if args.quick else "full")
    config = dataclasses.replace(preset, **{k: tuple(v) if isinstance(v, list) else v
                                            for k, v in fields.items() if v is not None})
    run = args.run or bench.default_run_id(args.target, args.draft, config, "quick-" if args.quick else "")
    path = Path(args.out) / f"{run}.csv"
    records = bench.run_named(args.target, args.draft, config, path, prompts_path=args.prompts_file, run_id=run,
                              device=args.device, command="specresearch " + " ".join(sys.argv[1:]),
                              batched=args.batched)
    print(analysis.summary(records))
    same, units = analysis.t0_agreement(records)
    if units and len(config.verifiers) > 1:
        print(f"\nT = 0: the verifiers' outputs identical in {same}/{units} units")
    print(f"records in {path}")
    return 0


_COMMANDS = [_add_report, _add_generate, _add_distill, _add_warm_cache, _add_bench]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specresearch", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for add in _COMMANDS:
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
