"""On paper with measured costs: a random-weight Llama-3.1-8B (bfloat16, built from its configuration, ~16 GB) on one
GPU, its captured steps timed, and the speed-up a draft accepting as the shipped head does would give there (#67).

Measured on the device, every call a replayed CUDA graph of the static steps (``engine.static``), medians of
``--repeats`` replays with the small state put back between them (so every replay is the same step at the same
context):

* ``r_n``: one target call scoring n tokens, as a chain and as a tree of n nodes, over one scoring 1 token, at a
  ``--context``-token context;
* the draft's calls: a feature head of the toolkit's kind for the 8B's sizes (the ``eagle3-v8k`` preset over its
  hidden size 4096, a 32,000-token head as EAGLE-3's for Llama-3.1-8B; float32, as the engine runs heads), one token
  and K tokens a call;
* whole steps: autoregressive decoding, chains (block verification, gamma 1-3) and EAGLE-2's dynamic trees, at T = 0
  and T = 1 (random weights: the tokens mean nothing, the shapes and so the costs are the real ones); the step's
  parts are the target's call, the draft's calls and the rest (verification and bookkeeping);
* the host: how long issuing one replay takes it, against the device's time for the replay (where they come close,
  the host still bounds a step).

The speed-up of a configuration is tau x t(autoregressive step) / t(its step), tau the shipped head's measured
tokens per step on the embedded pair: ``--tau RECORD`` (a ``bench_captured.py`` record's cells), else
``config.GENERATE_TAU`` / ``GENERATE_TAU_GREEDY`` / ``GENERATE_TREES`` (8 held-out prompts). Writes one JSON record.
A benchmark: nothing is asserted; it needs a CUDA device with ~20 GB free. ``--shape 135m`` does the same on the
embedded target's shape (random weights), whose step's device time, set beside ``bench_captured.py``'s wall time a
token, says how much of a step the host still takes there.

    PYTHONPATH=. python benchmarks/gpu_cost_8b.py --out RESULTS/gpu_cost_8b_gpu.json --tau RESULTS/gpu_speed_gpu.json
    PYTHONPATH=. python benchmarks/gpu_cost_8b.py --shape 135m --out RESULTS/gpu_cost_135m_gpu.json --tau RESULTS/...
    PYTHONPATH=. .venv/bin/python benchmarks/gpu_cost_8b.py --device cpu --tiny --out /tmp/cost.json   # the check
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from specresearch.config import GENERATE_TAU, GENERATE_TAU_GREEDY, GENERATE_TREES, SamplingConfig
from specresearch.engine.captured import SavedState, StepRunner
from specresearch.engine.static import build_run, plan_for
from specresearch.engine.timing import clock
from specresearch.experiments.records import record_header

LLAMA_31_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                   num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0,
                   rms_norm_eps=1e-5, tie_word_embeddings=False)
# --shape 135m: the embedded target's, to split its step into device and host
SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100000.0,
                    rms_norm_eps=1e-5, tie_word_embeddings=True)
TINY = dict(vocab_size=32000, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=False)  # --tiny: the script's smoke
CONFIGS = {"chain block g1": ("block", 1, 1, "iid", None), "chain block g2": ("block", 2, 1, "iid", None),
           "chain block g3": ("block", 3, 1, "iid", None), "dynamic K4 g4 n10": ("onehot", 4, 4, "dynamic", 10),
           "dynamic K8 g6 n32": ("onehot", 6, 8, "dynamic", 32), "dynamic K10 g6 n60": ("onehot", 6, 10, "dynamic", 60)}


def random_llama(device, shape: dict = LLAMA_31_8B, dtype=torch.bfloat16):
    """A Llama of ``shape`` (default Llama-3.1-8B's) with random weights (std 0.02, norms 1), built on the device."""
    from transformers import AutoModelForCausalLM, LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = LlamaConfig(**shape)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    model = model.to_empty(device=device)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            parameter.fill_(1.0) if "norm" in name else parameter.normal_(0.0, 0.02)
    model.model.rotary_emb = LlamaRotaryEmbedding(config).to(device)  # its buffers were on the meta device
    return model.eval()


SHAPES = {"8b": (LLAMA_31_8B, torch.bfloat16, 32000, "Llama-3.1-8B shape, random bf16"),
          "135m": (SMOLLM2_135M, torch.bfloat16, 8192, "SmolLM2-135M shape, random bf16"),
          "tiny": (TINY, torch.float32, 32000, "tiny Llama, random float32")}  # shape, dtype, head tokens, name


def head_for(target, head_tokens: int = 32000):
    """The toolkit's feature head (``eagle3-v8k``'s preset) over the target's sizes, ``head_tokens`` head tokens
    (32,000 as EAGLE-3's for Llama-3.1-8B; the shipped head's 8,192 on SmolLM2's shape), float32."""
    from specresearch.drafts.feature import FEATURE_PRESETS, FeatureDraft, FeatureHead

    config = dataclasses.replace(FEATURE_PRESETS["eagle3-v8k"], head_tokens=head_tokens)
    head = FeatureHead(target.model, config, head_token_ids=torch.arange(head_tokens), seed=0)
    return FeatureDraft(head, device=target.device)


def replay_seconds(runner: StepRunner, state: list[torch.Tensor], repeats: int) -> tuple[float, float]:
    """Median seconds of one call of ``runner`` on its device, and of the host issuing it (a CUDA graph's replay
    returns before the device is done); the state is put back before each call, the capture made before the first."""
    runner.prepare()
    saved = SavedState(state)
    times, issue = [], []
    for _ in range(repeats):
        saved.put_back()
        start = clock(runner.device)
        runner()
        issue.append(time.perf_counter() - start)
        times.append(clock(runner.device) - start)
    saved.put_back()
    return statistics.median(times), statistics.median(issue)


def _mode(device) -> str:
    return "cudagraph" if torch.device(device).type == "cuda" else "eager"


def call_costs(target, draft, context: int, sizes, repeats: int) -> dict:
    """A target call of n tokens as a chain and as a tree, the draft's calls of 1 and K tokens: captured, timed."""
    static_target = target.static_form()
    static_target.allocate(1, 2048)
    ids = torch.randint(0, 32000, (1, context), device=target.device)  # (32,000: inside both vocabularies)
    static_target.prefill(ids, torch.ones_like(ids))
    rows = [static_target.rows.length, static_target.rows.positions]
    out = {"chain": {}, "tree": {}}
    generator = torch.Generator().manual_seed(0)
    for n in sizes:
        tokens = torch.randint(0, 32000, (1, n), device=target.device)
        parents = [-1] + [int(torch.randint(0, i, (1,), generator=generator)) for i in range(1, n)]
        visible = torch.eye(n, dtype=torch.bool)
        depth = torch.zeros(n, dtype=torch.long)
        for i, p in enumerate(parents):
            if p >= 0:
                visible[i] |= visible[p]
                depth[i] = depth[p] + 1
        visible, depth = visible[None].to(target.device), depth[None].to(target.device)
        for kind, call in (("chain", lambda t=tokens: static_target.forward(t)),
                           ("tree", lambda t=tokens, d=depth, v=visible: static_target.forward(t, depth=d, visible=v))):
            out[kind][n] = replay_seconds(StepRunner(call, _mode(target.device), rows, target.device), rows, repeats)[0]
    static_draft = draft.static_form()
    static_draft.allocate(1, 2048)
    inputs = torch.zeros(1, context, static_draft.feature_size, device=target.device)
    static_draft.prefill(ids, torch.ones_like(ids), inputs=static_draft.fuse(inputs))
    drows = [static_draft.rows.length, static_draft.rows.positions]
    hidden = torch.zeros(1, 10, target.model.config.hidden_size, device=target.device)
    for k in (1, 4, 8, 10):
        call = (lambda k=k: static_draft.forward(ids[:, :k], inputs=hidden[:, :k], offset=0))
        out.setdefault("draft", {})[k] = replay_seconds(StepRunner(call, _mode(target.device), drows, target.device),
                                                        drows, repeats)[0]
    out["r_chain"] = {n: out["chain"][n] / out["chain"][sizes[0]] for n in sizes}
    out["r_tree"] = {n: out["tree"][n] / out["chain"][sizes[0]] for n in sizes}
    return out


def step_costs(target, draft, context: int, repeats: int, temperature: float) -> dict:
    """Whole captured steps (module docstring): seconds of the device, and of the host issuing them."""
    sampling = SamplingConfig(temperature=temperature)
    ids = torch.randint(0, 32000, (1, context))
    runs = {"autoregressive": (None, plan_for("", 0, autoregressive=True))}
    runs.update({label: (draft, plan_for(v, g, k, law, nodes)) for label, (v, g, k, law, nodes) in CONFIGS.items()})
    out = {}
    for label, (model, plan) in runs.items():
        run = build_run(target, model, plan=plan, sampling=sampling, batch=1, capacity=(2048, 2048))
        run.start(ids, torch.ones_like(ids), max_new_tokens=1 << 20)
        run.state.uniforms.uniform_()
        runner = StepRunner(run.step, _mode(target.device), run.small_state(), target.device)
        device_s, host_s = replay_seconds(runner, run.small_state(), repeats)
        out[label] = {"device_seconds": device_s, "host_issue_seconds": host_s, "width": plan.width, "kind": plan.kind}
        del run, runner
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return out


def measured_tau(path: str | None) -> dict:
    """tau per (run, temperature key): a bench_captured record's cells (their best mode), else the shipped defaults."""
    tau = {("chain block g%d" % g, "t1"): v for g, v in GENERATE_TAU.items()}
    tau.update({("chain block g%d" % g, "t0"): v for g, v in GENERATE_TAU_GREEDY.items()})
    for (k, g, n), (t0, t1) in GENERATE_TREES.items():
        tau[(f"dynamic K{k} g{g} n{n}", "t0")], tau[(f"dynamic K{k} g{g} n{n}", "t1")] = t0, t1
    if path:
        for cell in json.loads(Path(path).read_text())["summary"]["cells"]:
            run = cell["label"].split(" / ")[0]
            key = "t0" if cell["temperature"] == 0 else "t1" if cell["temperature"] == 1 else None
            if key and run in CONFIGS:
                tau[(run, key)] = cell["tau"]
    return tau


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--tau", help="a bench_captured.py record whose cells give each run's tau")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 3, 4, 8, 11, 16, 33, 61])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shape", choices=list(SHAPES), default="8b",
                        help="the random model's shape: Llama-3.1-8B's, the embedded SmolLM2-135M's (its steps' device "
                             "time against the host's, beside bench_captured's wall time), or a 2-layer one")
    parser.add_argument("--tiny", action="store_true", help="--shape tiny (the script's check on a CPU: eager steps)")
    args = parser.parse_args(argv)
    shape, dtype, head_tokens, name = SHAPES["tiny" if args.tiny else args.shape]
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_cost_8b.py: no CUDA device here (--device cpu --tiny checks the script on a CPU)")
    from specresearch.models.causal_lm import CausalLM

    started = time.time()
    model = random_llama(args.device, shape, dtype)
    target = CausalLM(model, device=args.device, skinny_linear=False)
    draft = head_for(target, head_tokens)
    calls = call_costs(target, draft, args.context, args.sizes, args.repeats)
    tau = measured_tau(args.tau)
    device = torch.cuda.get_device_name(0) if target.device.type == "cuda" else "cpu"
    result = {**record_header("benchmarks/gpu_cost_8b.py", argv, target=None, model=name, device=device,
                              context=args.context), "calls": calls, "steps": {}}
    for temperature, key in ((0.0, "t0"), (1.0, "t1")):
        steps = step_costs(target, draft, args.context, args.repeats, temperature)
        ar = steps["autoregressive"]["device_seconds"]
        for label, cost in steps.items():
            call = calls["tree" if cost["kind"] == "tree" else "chain"].get(cost["width"], float("nan"))
            cost["target_call_seconds"], cost["draft_and_rest_seconds"] = call, cost["device_seconds"] - call
            if (label, key) in tau:
                cost["tau"] = tau[(label, key)]
                cost["projected_speedup"] = tau[(label, key)] * ar / cost["device_seconds"]
        result["steps"][key] = steps
        result[f"ar_tokens_per_s_{key}"] = 1 / ar
        spec = {k: v["projected_speedup"] for k, v in steps.items() if "projected_speedup" in v}
        if spec:
            best = max(spec, key=spec.get)
            result[f"best_speedup_{key}"], result[f"best_config_{key}"] = spec[best], best
    result["seconds"] = time.time() - started
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k not in ("calls", "steps", "machine")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
