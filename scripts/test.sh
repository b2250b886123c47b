#!/usr/bin/env bash
# Set up (or reuse) .venv and run the whole test suite. Extra arguments go to pytest.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
# Load (and on first use convert and cache) the embedded model once, before workers start in parallel.
python -m specresearch.cli warm-cache
exec python -m pytest -n 2 --durations=15 "$@"
