#!/usr/bin/env bash
# The README's test command. Runs every test (unit, slow, e2e). Fast subset only: scripts/test.sh -m "not slow and not e2e"
# Parallel: pytest-xdist workers (FP8GRPO_TEST_WORKERS, default: the CPU count, at least 2; `-n 0` runs in one
# process). The end-to-end tests spend most of their time waiting on process start-ups, servers and actors, so two
# of them share two cores with little slowdown; tests/conftest.py orders them first and keeps the local-stack tests
# on one worker. --durations=30: the slowest tests are listed at the end (tests/README.md keeps the ledger).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || bash scripts/install.sh
WORKERS=${FP8GRPO_TEST_WORKERS:-$(.venv/bin/python -c 'import os; print(max(2, len(os.sched_getaffinity(0))))')}
# --no-loadscope-reorder: keep tests/conftest.py order (groups by ledger time); xdist would otherwise put the groups
# with the most tests first and leave the long single-test end-to-end modules for the end
exec .venv/bin/python -m pytest -q --timeout=1800 --durations=30 -n "$WORKERS" --dist loadgroup --no-loadscope-reorder "$@"
