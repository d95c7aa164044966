#!/usr/bin/env bash
# Set up and run the demo: partition -> fit-local per silo -> fuse -> evaluate table.
set -euo pipefail
cd "$(dirname "$0")/.."
for arg in "$@"; do
  if [ "$arg" = "--help" ] || [ "$arg" = "-h" ]; then
    echo "usage: bash scripts/demo.sh [pfuse demo options]: sets up .venv (scripts/setup.sh) if needed, then runs"
    echo "'pfuse demo' with the options given; 'pfuse demo --help' (after the set-up) lists them."
    exit 0
  fi
done
bash scripts/setup.sh
.venv/bin/pfuse demo "$@"
