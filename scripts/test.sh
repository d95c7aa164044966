#!/usr/bin/env bash
# Set up, lint, and run the test suite (this is what CI runs).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check posterior_fusion cli tests benchmarks experiments scripts
# One worker per core and one more: the Flower tests spend most of their time waiting on the processes they start,
# and the extra worker uses the core they leave idle (each worker runs torch on one thread).
.venv/bin/python -m pytest -q -n "${PFUSE_TEST_WORKERS:-$(( $(nproc) + 1 ))}" --durations=25 tests "$@"
