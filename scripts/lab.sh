#!/usr/bin/env bash
# Set up (or reuse) .venv and open the notebooks in JupyterLab, with kernels on the project's .venv.
# Extra arguments go to `jupyter lab` (e.g. --no-browser --port 8899). As root (a container), --allow-root is added:
# jupyter refuses to start as root without it. SPECRESEARCH_LAB_ECHO=1 prints the command instead of running it.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
# Kernels start in notebooks/; figures go where the main job puts them.
export SPECRESEARCH_FIGURES="${SPECRESEARCH_FIGURES:-$ROOT/reports/figures}"
args=("$@")
if [ "$(id -u)" = 0 ] && [[ " ${args[*]-} " != *" --allow-root "* ]]; then
    echo "lab.sh: running as root, so passing --allow-root to jupyter lab (it refuses root otherwise)" >&2
    args+=(--allow-root)
fi
command=(jupyter lab --ServerApp.root_dir="$ROOT" --FileContentsManager.preferred_dir=notebooks ${args[@]+"${args[@]}"})
if [ "${SPECRESEARCH_LAB_ECHO:-}" = 1 ]; then
    echo "${command[*]}"
    exit 0
fi
exec "${command[@]}"
