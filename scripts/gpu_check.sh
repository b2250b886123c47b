#!/usr/bin/env bash
# The prepared GPU check: what only a CUDA machine can check, in <= 8 minutes, results under RESULTS_DIR.
#
#   bash scripts/gpu_check.sh RESULTS_DIR
#
# Needs: a CUDA device, Python with torch, transformers, numpy, scipy and pytest installed; no network, no model hub,
# no shipped weights. Runs from a copy of the repository's code and tests alone (specresearch/, tests/, scripts/,
# data/configs/; the package is put on PYTHONPATH, nothing is installed). PYTHON picks the interpreter (default
# python3). It runs:
#   1. the tests marked `cuda` (tests/test_devices.py: greedy equality and the statistical losslessness test on CUDA
#      for every draft kind built from a config, a CPU generator with GPU probabilities), and the engine's tests on
#      the CPU of that machine (tests/test_rows_end_early.py, tests/test_host_reads.py);
#   2. scripts/gpu_bench.py: verifier timings at B = 32 and the engine's overhead and host reads per step on a
#      random-weight model with SmolLM2-135M's configuration.
# Each part has its own time limit; the script goes on after a failure and exits non-zero if any part failed.
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
    git rev-parse --short HEAD 2>/dev/null || true
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
run cuda_tests 240 "$PY" -m pytest -q -p no:cacheprovider -m cuda tests/test_devices.py --junitxml "$OUT/cuda_tests.xml"
run engine_tests 90 "$PY" -m pytest -q -p no:cacheprovider tests/test_rows_end_early.py tests/test_host_reads.py
run gpu_bench 150 "$PY" scripts/gpu_bench.py --out "$OUT"
exit "$failed"
