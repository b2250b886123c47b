"""Speed beside the engines, same machine, same model, one run: llama.cpp's and transformers' autoregressive and
speculative decoding of the embedded SmolLM2-135M-Instruct against the toolkit's, each one's speed-up over its own
autoregressive decoding.

Per temperature and MT-Bench first turn (``--prompts`` evenly spaced), every configuration generates
``--max-new-tokens`` tokens of the same chat-templated prompt in turn (so a noisy machine slows them alike), timed
end to end on the host (prompt processing included; llama.cpp's over a local HTTP request, its own report of the
time beside it). One thread everywhere (``torch.set_num_threads``, ``llama-server -t``).

* ``llama.cpp``: ``llama-server`` (``scripts/build_llamacpp.sh``) on the embedded GGUF as shipped (Q4_1 weights,
  4-bit); speculative with the target's first ``--draft-layers`` blocks as a GGUF draft (``write_truncated_draft``),
  its default 3 drafted tokens; its sampling defaults otherwise (top-k 40, top-p 0.95, min-p 0.05; T = 0 greedy).
* ``transformers``: ``generate`` on the float32 model, ``assistant_model`` = the same truncated copy
  (``drafts.registry.truncated_draft``) with transformers' default assistant settings; top-k off.
* ``toolkit``: ``autoregressive_generate``, ``specresearch.generate`` with its default draft and configuration, and
  the same truncated copy at gamma 3 with block verification (the CPU kernels on).

Speed-ups are (tokens / seconds) of the speculative runs over the same engine's autoregressive runs, summed over
prompts, with a 95% bootstrap interval over prompts (1,000 resamples, seed 0). A benchmark: nothing asserted.

    PYTHONPATH=. .venv/bin/python benchmarks/engines_speed.py --out benchmarks/records/engines_speed_<machine>.json
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
import torch

import specresearch
from specresearch.audit.llamacpp import LlamaServer, write_truncated_draft
from specresearch.config import SamplingConfig
from specresearch.drafts.registry import load_pair, truncated_draft
from specresearch.engine.cost import fit_default_draft, resolve_config
from specresearch.engine.generate import autoregressive_generate, speculative_generate
from specresearch.engine.prompts import encode_chat, evenly_spaced, load_prompt_set
from specresearch.experiments.records import record_header, write_json_record
from specresearch.models.embedded import gguf_path, load_embedded
from specresearch.paths import cache_dir

PAIRS = [("llama.cpp", "llama.cpp autoregressive", "llama.cpp speculative"),
         ("transformers", "transformers autoregressive", "transformers assisted"),
         ("toolkit", "toolkit autoregressive", "toolkit default"),
         ("toolkit", "toolkit autoregressive", "toolkit truncated")]


def _interval(spec_tokens, spec_seconds, ar_tokens, ar_seconds, seed: int = 0) -> tuple[float, float, float]:
    """Ratio of summed rates (speculative over autoregressive) and its 95% bootstrap interval over prompts."""
    arrays = [np.asarray(a, dtype=float) for a in (spec_tokens, spec_seconds, ar_tokens, ar_seconds)]
    ratio = lambda i: (arrays[0][i].sum() / arrays[1][i].sum()) / (arrays[2][i].sum() / arrays[3][i].sum())  # noqa: E731
    rng = np.random.default_rng(seed)
    n = len(arrays[0])
    draws = [ratio(rng.integers(0, n, n)) for _ in range(1000)]
    return float(ratio(np.arange(n))), float(np.quantile(draws, 0.025)), float(np.quantile(draws, 0.975))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    parser.add_argument("--draft-layers", type=int, default=6)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    n = args.max_new_tokens

    # the toolkit's target (CPU kernels) and generate's default draft
    target, default_draft, tokenizer = load_pair(draft=specresearch.config.GENERATE_DRAFT)
    plain_lm, _ = load_embedded(device="cpu", skinny_linear=False, fuse_projections=False)  # transformers' model
    plain, hf_draft = plain_lm.model, truncated_draft(plain_lm, args.draft_layers).model
    toolkit_truncated = truncated_draft(target, args.draft_layers)
    draft_gguf = write_truncated_draft(gguf_path(), cache_dir("llamacpp", f"draft-truncated-{args.draft_layers}.gguf"),
                                       args.draft_layers)
    prompts = evenly_spaced(load_prompt_set("mt-bench"), args.prompts)
    ids = encode_chat(prompts, tokenizer)
    eos = int(tokenizer.eos_token_id)

    rows = []
    with LlamaServer(gguf_path()) as ar_server, LlamaServer(gguf_path(), draft_gguf) as spec_server:
        version = spec_server.version()

        def llama(server, prompt, temperature, seed):
            start = time.perf_counter()
            reply = server.complete(prompt.tolist(), n_predict=n, temperature=temperature, seed=seed,
                                    cache_prompt=False, return_tokens=True)
            seconds = time.perf_counter() - start
            timings = reply.get("timings", {})
            return len(reply["tokens"]), seconds, {"server_ms": timings.get("prompt_ms", 0) + timings.get("predicted_ms", 0),
                                                   "draft_n": timings.get("draft_n"), "draft_accepted": timings.get("draft_n_accepted")}

        def hf(prompt, temperature, seed, assistant):
            torch.manual_seed(seed)
            sampling = dict(do_sample=True, temperature=temperature, top_k=0) if temperature > 0 else dict(do_sample=False)
            start = time.perf_counter()
            out = plain.generate(prompt[None], attention_mask=torch.ones_like(prompt[None]), max_new_tokens=n,
                                 assistant_model=assistant, pad_token_id=eos, **sampling)
            return out.shape[1] - prompt.shape[0], time.perf_counter() - start, {}

        chosen = {}

        def default_configs(temperature):
            """What specresearch.generate picks on this machine for its default draft at ``temperature`` (once)."""
            if temperature not in chosen:
                chosen[temperature] = resolve_config("auto", target, default_draft, temperature=temperature, trees=True,
                                                     announce=None)
                fit_default_draft(default_draft, chosen[temperature])
            return chosen[temperature]

        def toolkit(prompt, temperature, seed, draft):
            sampling = SamplingConfig(temperature=temperature)
            start = time.perf_counter()
            if draft is None:
                result = autoregressive_generate(target, [prompt], max_new_tokens=n, sampling=sampling, seed=seed)
            elif draft == "default":  # generate's default: its draft, and the configuration chosen once per temperature
                options = dict(default_configs(temperature))
                gamma, verifier = options.pop("gamma"), options.pop("verifier", "block")
                result = speculative_generate(target, default_draft, [prompt], gamma=gamma, verifier=verifier,
                                              max_new_tokens=n, sampling=sampling, seed=seed, **options)
            else:
                result = specresearch.generate([prompt.tolist()], target=target, draft=draft, tokenizer=tokenizer,
                                               chat=False, gamma=3, max_new_tokens=n, sampling=sampling, seed=seed,
                                               announce=None)
            return result.num_tokens, time.perf_counter() - start, {"block_efficiency": result.block_efficiency}

        runs = {
            "llama.cpp autoregressive": lambda p, t, s: llama(ar_server, p, t, s),
            "llama.cpp speculative": lambda p, t, s: llama(spec_server, p, t, s),
            "transformers autoregressive": lambda p, t, s: hf(p, t, s, None),
            "transformers assisted": lambda p, t, s: hf(p, t, s, hf_draft),
            "toolkit autoregressive": lambda p, t, s: toolkit(p, t, s, None),
            "toolkit default": lambda p, t, s: toolkit(p, t, s, "default"),
            "toolkit truncated": lambda p, t, s: toolkit(p, t, s, toolkit_truncated),
        }
        for temperature in args.temperatures:  # untimed: the toolkit's choice per temperature (its step costs, cached)
            default_configs(temperature)
        for run in runs.values():  # warm-up: caches, llama.cpp's buffers
            run(ids[0][:16], 0.0, 0)
        for temperature in args.temperatures:
            for k, prompt in enumerate(ids):
                names = list(runs) if k % 2 == 0 else list(runs)[::-1]
                for name in names:
                    tokens, seconds, extra = runs[name](prompt, temperature, k)
                    rows.append({"config": name, "temperature": temperature, "prompt": prompts[k]["id"],
                                 "tokens": tokens, "seconds": seconds, **extra})
                    print(f"T={temperature:g} {prompts[k]['id']:>22} {name:>28}: {tokens / seconds:6.1f} tokens/s",
                          flush=True)

    configs = {str(t): dict(c) for t, c in chosen.items()}
    summary = []
    for temperature in args.temperatures:
        at = [r for r in rows if r["temperature"] == temperature]
        rate = {name: sum(r["tokens"] for r in at if r["config"] == name) / sum(r["seconds"] for r in at if r["config"] == name)
                for name in runs}
        for engine, ar, spec in PAIRS:
            pick = lambda name, key: [r[key] for r in at if r["config"] == name]  # noqa: E731
            ratio, low, high = _interval(pick(spec, "tokens"), pick(spec, "seconds"), pick(ar, "tokens"), pick(ar, "seconds"))
            summary.append({"temperature": temperature, "engine": engine, "autoregressive": ar, "speculative": spec,
                            "ar_tokens_per_s": rate[ar], "spec_tokens_per_s": rate[spec], "speedup": ratio,
                            "speedup_interval": [low, high]})
            print(f"T={temperature:g} {spec:>24}: {rate[spec]:6.1f} tokens/s, {ar}: {rate[ar]:6.1f}, "
                  f"speed-up {ratio:.2f}x [{low:.2f}, {high:.2f}]")
    header = record_header("benchmarks/engines_speed.py", sys.argv[1:] if argv is None else list(argv),
                           draft=specresearch.config.GENERATE_DRAFT, engine_versions={"llama.cpp": version,
                           "transformers": __import__("transformers").__version__})
    write_json_record(args.out, header | {"default_configs": configs, "summary": summary, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
