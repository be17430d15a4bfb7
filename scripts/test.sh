#!/usr/bin/env bash
# The README's test command. Runs every test (unit, slow, e2e). Fast subset only: scripts/test.sh -m "not slow and not e2e"
# --durations=30: the slowest tests are listed at the end, so a run shows where the ~40-minute CI budget goes.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || bash scripts/install.sh
exec .venv/bin/python -m pytest -q --timeout=1800 --durations=30 "$@"
