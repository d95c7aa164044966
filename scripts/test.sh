#!/usr/bin/env bash
# Set up, lint, and run the test suite (this is what CI runs).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check posterior_fusion cli tests benchmarks experiments scripts
.venv/bin/python -m pytest -q -n "${PFUSE_TEST_WORKERS:-2}" --durations=25 tests "$@"
