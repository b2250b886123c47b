#!/usr/bin/env bash
# Set up (or reuse) .venv and run the main job: every notebook executed headless into reports/.
# Extra arguments go to `specresearch report` (e.g. --quick, --only 01 03).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
exec python -m specresearch report "$@"
