"""Captured steps against the growing loop and transformers' fastest generate, side by side in one run (issue #67).

On the embedded target (SmolLM2-135M-Instruct) with the shipped feature head (``--draft``, default ``eagle3-v8k``),
over MT-Bench first turns (chat template, ``--prompts`` evenly spaced), for each temperature, prompt and repeat, in
an order shuffled each time: autoregressive decoding and each speculative run (``--runs``: chains, EAGLE-2's dynamic
trees) under each compile mode (``--modes``: ``off`` the growing loop, ``static`` the captured steps eagerly,
``inductor``, ``cudagraph``, ``reduce-overhead``; ``engine.static``), and with ``--peer`` transformers' own
``generate`` on a plain model with the same weights (sdpa, ``cache_implementation="static"``: on CUDA transformers
compiles its forward itself, ``torch.compile(mode="reduce-overhead")``; elsewhere it runs eagerly). Each run is timed
end to end, prompt included, with the same seed for every run of a prompt. Before anything is timed every (run, mode,
temperature) decodes one prompt of each cache size the prompts need, so no compile or capture is timed. A run's
label may name another target in parentheses (``TARGETS``): ``"autoregressive (float32)"`` the target in float32,
``"autoregressive (unfused)"`` the ``--dtype`` target without fused projections (``models.fused``, which
``CausalLM`` applies by default); and another draft in brackets, ``"chain block g1 [ngram+eagle3-v8k]"`` (prompt
lookup with the head: ``specresearch generate``'s default draft).

Writes ``<out>.csv`` (a row a run) and ``<out>.json`` after every prompt (``complete`` says whether all ran; a
cell whose warm-up raises is left out and its error kept under ``failed_cells``, and each cell's warm-up wall time,
its compiles or captures included, under ``warm_up_seconds``): the header (command, commit,
machine, weights' digests) and the summary: per temperature, run and mode, tokens/s and the speed over the fastest autoregressive decoding of that
temperature (over the prompts pooled, 95 % bootstrap intervals), and the keys ``ar_tokens_per_s``,
``peer_tokens_per_s``, ``best_speedup_t0``, ``best_speedup_t1`` with the runs and modes they come from. A benchmark:
nothing is asserted.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_captured.py --device cuda --dtype bfloat16 --prompts 16 \
        --modes off cudagraph reduce-overhead --peer --out benchmarks/records/gpu_speed_h100
    PYTHONPATH=. .venv/bin/python benchmarks/bench_captured.py --draft fp16:eagle3-v8k --prompts 8 \
        --modes off static inductor --runs autoregressive "chain block g1" --out benchmarks/records/captured_cpu_avx2_amd
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

from specresearch.config import COMPILE_CHOICES, SamplingConfig
from specresearch.drafts.registry import draft_from_name, load_pair
from specresearch.engine import static
from specresearch.engine.cost import tree_options
from specresearch.engine.generate import autoregressive_generate, speculative_generate
from specresearch.engine.prompts import encode_chat, evenly_spaced, load_prompts, prompt_set_file
from specresearch.engine.timing import clock
from specresearch.experiments.draft_analysis import pooled_speeds
from specresearch.experiments.records import record_files, record_header

RUNS = {
    "autoregressive": None,
    "chain block g1": dict(verifier="block", gamma=1),
    "chain block g2": dict(verifier="block", gamma=2),
    "chain block g3": dict(verifier="block", gamma=3),
    "dynamic K4 g4 n10": tree_options((4, 4, 10)),
    "dynamic K8 g6 n32": tree_options((8, 6, 32)),
    "dynamic K10 g6 n60": tree_options((10, 6, 60)),
}
PEER = "transformers static"


def decode(target, draft, run: str, mode: str, ids: list[int], sampling, seed: int, max_new_tokens: int, eos):
    """One timed decoding -> (tokens, seconds, tokens per target call)."""
    common = dict(max_new_tokens=max_new_tokens, sampling=sampling, seed=[seed], eos_token_id=eos, compile=mode)
    if RUNS[run] is None:
        out = autoregressive_generate(target, [ids], **common)
    else:
        out = speculative_generate(target, draft, [ids], **RUNS[run], **common)
    return out.num_tokens, out.seconds, out.block_efficiency


def peer_decode(model, ids: list[int], sampling, seed: int, max_new_tokens: int, eos, max_cache_len: int):
    """transformers' ``generate`` with a static cache of ``max_cache_len`` slots whatever the prompt (so its compiled
    forward is compiled once; on CUDA transformers compiles it itself) -> (tokens, seconds, 1)."""
    device = model.device
    torch.manual_seed(seed)
    inputs = torch.tensor([ids], device=device)
    options = dict(do_sample=True, temperature=sampling.temperature, top_k=None, top_p=None) \
        if sampling.temperature > 0 else dict(do_sample=False)
    start = clock(device)
    out = model.generate(inputs, attention_mask=torch.ones_like(inputs), max_new_tokens=max_new_tokens,
                         eos_token_id=eos, pad_token_id=eos, cache_implementation="static",
                         max_cache_len=max_cache_len, **options)
    seconds = clock(device) - start
    return int(out.shape[1] - inputs.shape[1]), seconds, 1.0


def plain_model(target, dtype):
    """The embedded target's weights in a plain transformers model (sdpa; none of the toolkit's kernels)."""
    from transformers import AutoModelForCausalLM

    from specresearch.models.embedded import cache_dir

    model = AutoModelForCausalLM.from_pretrained(cache_dir() / "smollm2-135m-instruct", dtype=dtype,
                                                 attn_implementation="sdpa", local_files_only=True)
    return model.to(target.device).eval()


def warm_up(targets, drafts, peer, prompts, cells, temperatures, max_new_tokens, eos,
            max_cache_len) -> tuple[dict, dict]:
    """Every (run, mode) cell at every temperature once on a prompt of each cache size the prompts need; the peer once
    at each temperature (its cache has one size). A cell that raises is left out of the timed runs. Returns
    ``{"run:mode": "the error"}`` for those (a device run is one call: one broken cell must not cost the others) and
    ``{"run:mode": seconds}``, each other cell's warm-up wall time (what its compiles or captures cost)."""
    failed, seconds = {}, {}
    for run, mode in cells:
        started = time.perf_counter()
        try:
            if run == PEER:
                for temperature in temperatures:
                    peer_decode(peer, prompts[0], SamplingConfig(temperature=temperature), 0, max_new_tokens, eos,
                                max_cache_len)
            else:
                _warm_up_run(targets[_target(run)], drafts[_draft(run)], _base(run), mode, prompts, temperatures,
                             max_new_tokens, eos)
        except Exception as error:  # noqa: BLE001 -- reported in the record, the cell left out
            failed[f"{run}:{mode}"] = f"{type(error).__name__}: {error}"[:2000]
            print(f"cell {run}:{mode} failed in its warm-up and is left out: {failed[f'{run}:{mode}']}", flush=True)
            continue
        seconds[f"{run}:{mode}"] = round(time.perf_counter() - started, 2)
    return failed, seconds


def _warm_up_run(target, draft, run: str, mode: str, prompts, temperatures, max_new_tokens: int, eos) -> None:
    """``run`` under ``mode`` at each temperature on a prompt of each cache size the prompts need (the growing loop:
    one prompt)."""
    options = RUNS[run]
    plan = static.plan_for("", 0, autoregressive=True) if options is None else static.plan_for(
        options["verifier"], options["gamma"], options.get("num_drafts", 1), options.get("draft_law", "iid"),
        options.get("tree_nodes"))
    sizes = {}
    for ids in prompts:
        sizes.setdefault(static.cache_capacity(len(ids) + max_new_tokens, plan), ids)
    for temperature in temperatures:
        for ids in (sizes.values() if mode != "off" else [prompts[0]]):
            decode(target, draft, run, mode, ids, SamplingConfig(temperature=temperature), 0, max_new_tokens, eos)


def _base(run: str) -> str:
    """``"autoregressive (float32)"`` -> ``"autoregressive"``, ``"chain block g1 [ngram+eagle3-v8k]"`` -> ``"chain
    block g1"``: the run of a label that names another target (``TARGETS``) or another draft."""
    return run.split(" [")[0].split(" (")[0]


def _target(run: str) -> str | None:
    """``"autoregressive (float32)"`` -> ``"float32"``: the other target a label names (``TARGETS``), or None."""
    return run.split(" [")[0].split(" (")[1].rstrip(")") if " (" in run.split(" [")[0] else None


def _draft(run: str) -> str | None:
    """``"chain block g1 [ngram+eagle3-v8k]"`` -> ``"ngram+eagle3-v8k"``: the other draft a label names (any
    ``drafts.registry.draft_from_name`` name, built on the ``--dtype`` target), or None (``--draft``)."""
    return run.split(" [")[1].rstrip("]") if " [" in run else None


def _known_draft(name: str | None) -> bool:
    """Whether a label's draft is one ``drafts.registry.draft_from_name`` builds (checked before any model loads)."""
    from specresearch.cli_checks import check_draft_name

    try:
        check_draft_name(name)
    except ValueError:
        return False
    return True


TARGETS = ("float32", "bfloat16", "float16", "unfused")  # a label's other target: a dtype, or the --dtype target with
# its projections unfused (models.fused; CausalLM fuses them by default): their cost side by side in one run


def summary(rows: list[dict]) -> dict:
    """Speeds over the fastest autoregressive decoding of each temperature, pooled over prompts (module docstring)."""
    import pandas as pd

    frame = pd.DataFrame(rows)
    frame["label"] = frame["run"] + " / " + frame["mode"]
    out = {"cells": []}
    for temperature, at in frame.groupby("temperature"):
        ar = at[at["run"].str.startswith("autoregressive")]
        if ar.empty:  # no baseline (its cells failed): speeds only
            for label, mine in at.groupby("label"):
                out["cells"].append({"temperature": float(temperature), "label": label,
                                     "tokens_per_s": float(mine["tokens"].sum() / mine["seconds"].sum()),
                                     "tau": float(mine["tau"].mean()), "prompts": int(mine["prompt_id"].nunique())})
            continue
        speeds = ar.groupby("label").apply(lambda c: c["tokens"].sum() / c["seconds"].sum())
        base_label = speeds.idxmax()
        base = ar[ar["label"] == base_label].set_index(["prompt_id", "repeat"])[["tokens", "seconds"]]
        paired = at.join(base.rename(columns={"tokens": "ar_tokens", "seconds": "ar_seconds"}), on=["prompt_id", "repeat"])
        pooled = pooled_speeds(paired, by=("label",))
        for _, cell in pooled.iterrows():
            mine = paired[paired["label"] == cell["label"]]
            out["cells"].append({"temperature": float(temperature), "label": cell["label"],
                                 "tokens_per_s": float(mine["tokens"].sum() / mine["seconds"].sum()),
                                 "tau": float(mine["tau"].mean()), "speedup": cell["pooled"], "low": cell["low"],
                                 "high": cell["high"], "prompts": int(cell["prompts"]), "baseline": base_label})
        key = "t0" if temperature == 0 else "t1" if temperature == 1 else f"t{temperature:g}"
        spec = [c for c in out["cells"] if c["temperature"] == temperature and not c["label"].startswith(("autoregressive", PEER))]
        if spec:
            best = max(spec, key=lambda c: c["speedup"])
            out[f"best_speedup_{key}"], out[f"best_config_{key}"] = best["speedup"], best["label"]
        out[f"ar_tokens_per_s_{key}"] = {label: float(v) for label, v in speeds.items()}
        peer = at[at["run"] == PEER]
        if len(peer):
            out[f"peer_tokens_per_s_{key}"] = float(peer["tokens"].sum() / peer["seconds"].sum())
    out["ar_tokens_per_s"] = max((v for k, d in list(out.items()) if k.startswith("ar_tokens_per_s_")
                                  for v in d.values()), default=None)
    peers = [v for k, v in out.items() if k.startswith("peer_tokens_per_s_")]
    out["peer_tokens_per_s"] = max(peers) if peers else None
    return out


def write_record(out: Path, header: dict, rows: list[dict], failed: dict, *, complete: bool) -> dict:
    """``<out>.csv`` and ``<out>.json`` of the rows so far; ``complete`` False while prompts are still to come."""
    import pandas as pd

    csv_path, json_path = record_files(out)
    csv_path.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows).to_csv(csv_path, index=False)
    result = {**header, "complete": complete, "failed_cells": failed, "summary": summary(rows)}
    json_path.write_text(json.dumps(result, indent=1) + "\n")
    return result


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="the target's weights")
    parser.add_argument("--draft", default="eagle3-v8k")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-set", default="mt-bench", choices=["mt-bench", "humaneval"])
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    parser.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS))
    parser.add_argument("--modes", nargs="+", default=["off", "static"], choices=COMPILE_CHOICES)
    parser.add_argument("--cells", nargs="+", metavar="RUN:MODE",
                        help="exactly these (run, mode) pairs instead of --runs x --modes, e.g. 'chain block g1:cudagraph'")
    parser.add_argument("--ar-dtypes", nargs="+", default=[], choices=["float32", "bfloat16"],
                        help="autoregressive decoding of a target in these dtypes too, under every mode of --modes")
    parser.add_argument("--peer", action="store_true", help="time transformers' generate with a static cache too")
    parser.add_argument("--capacity-step", type=int, default=static.CAPACITY_STEP,
                        help="the fewest slots of a static cache (engine.static.CAPACITY_STEP; 512: one cache size, one "
                             "capture a run, for prompts up to ~400 tokens), and the peer's max_cache_len")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", required=True, help="record stem: <out>.csv and <out>.json")
    parser.add_argument("--validate-only", action="store_true", help="check the cells and stop (scripts/gpu_check.sh's test)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    static.CAPACITY_STEP = args.capacity_step
    cells = ([tuple(cell.rsplit(":", 1)) for cell in args.cells] if args.cells else
             [(run, mode) for run in args.runs for mode in args.modes])
    cells += [(f"autoregressive ({dtype})", mode) for dtype in args.ar_dtypes if dtype != args.dtype for mode in args.modes]
    unknown = [f"{r}:{m}" for r, m in cells if _base(r) not in RUNS or m not in COMPILE_CHOICES
               or _target(r) not in (None, *TARGETS) or not _known_draft(_draft(r))]
    if unknown:
        parser.error(f"unknown cells {unknown}: RUN is one of {list(RUNS)}, optionally followed by ' (TARGET)' with "
                     f"TARGET one of {list(TARGETS)} and ' [DRAFT]' with any draft name; MODE one of {COMPILE_CHOICES}")
    if args.validate_only:
        return 0
    static.SESSIONS_KEPT = max(static.SESSIONS_KEPT, 4 * len(cells) * len(args.temperatures))
    header = record_header("benchmarks/bench_captured.py", argv, draft=args.draft, dtype=args.dtype)  # the code run
    target, draft, tokenizer = load_pair(draft=args.draft, device=args.device, dtype=getattr(torch, args.dtype))
    targets = {None: target}
    for other in {_target(r) for r, _ in cells} - {None}:
        from specresearch.models.embedded import load_embedded

        targets[other] = (load_embedded(device=args.device, dtype=getattr(torch, args.dtype), fuse_projections=False)
                          if other == "unfused" else load_embedded(device=args.device, dtype=getattr(torch, other)))[0]
    eos = tokenizer.eos_token_id
    rows_in = evenly_spaced(load_prompts(prompt_set_file(args.prompt_set)), args.prompts)
    prompts = [ids.tolist() for ids in encode_chat(rows_in, tokenizer)]
    peer = plain_model(target, getattr(torch, args.dtype)) if args.peer else None
    cells += [(PEER, "transformers")] if peer else []
    started = time.time()
    drafts = {None: draft}
    for name in {_draft(r) for r, _ in cells} - {None}:
        drafts[name] = draft_from_name(name, target, tokenizer)
    failed, header["warm_up_seconds"] = warm_up(targets, drafts, peer, prompts, cells, args.temperatures,
                                                args.max_new_tokens, eos, args.capacity_step)
    cells = [cell for cell in cells if f"{cell[0]}:{cell[1]}" not in failed]
    print(f"warmed up in {time.time() - started:.0f} s", flush=True)
    rows = []
    for i, (row, ids) in enumerate(zip(rows_in, prompts)):  # prompts outermost: a run cut short has every temperature
        for temperature in args.temperatures:
            sampling = SamplingConfig(temperature=temperature)
            for repeat in range(args.repeats):
                order = random.Random(f"{temperature} {i} {repeat}").sample(cells, len(cells))
                for run, mode in order:
                    if run == PEER:
                        tokens, seconds, tau = peer_decode(peer, ids, sampling, 1000 + i, args.max_new_tokens, eos,
                                                           args.capacity_step)
                    else:
                        tokens, seconds, tau = decode(targets[_target(run)], drafts[_draft(run)], _base(run), mode,
                                                      ids, sampling, 1000 + i, args.max_new_tokens, eos)
                    rows.append({"prompt_id": row["id"], "temperature": temperature, "repeat": repeat, "run": run,
                                 "mode": mode, "tokens": tokens, "seconds": seconds, "tau": tau})
        # the record so far after every prompt: a run stopped at its time limit still leaves what it measured
        write_record(Path(args.out), header, rows, failed, complete=False)
        print(f"prompt {i + 1}/{len(prompts)} at {time.time() - started:.0f} s", flush=True)
    result = write_record(Path(args.out), header, rows, failed, complete=True)
    for cell in result["summary"]["cells"]:
        speed = f"{cell['speedup']:.2f}x [{cell['low']:.2f}, {cell['high']:.2f}]" if "speedup" in cell else ""
        print(f"T {cell['temperature']:g}  {cell['label']:<42} {cell['tokens_per_s']:8.1f} tok/s  tau {cell['tau']:.2f}  "
              f"{speed}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
