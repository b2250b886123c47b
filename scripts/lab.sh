#!/usr/bin/env bash
# Set up (or reuse) .venv and open the notebooks in JupyterLab, with kernels on the project's .venv.
# Extra arguments go to `jupyter lab` (e.g. --no-browser --port 8899).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
# Kernels start in notebooks/; figures go where the main job puts them.
export SPECRESEARCH_FIGURES="${SPECRESEARCH_FIGURES:-$ROOT/reports/figures}"
exec jupyter lab --ServerApp.root_dir="$ROOT" --FileContentsManager.preferred_dir=notebooks "$@"
