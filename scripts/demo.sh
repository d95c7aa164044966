#!/usr/bin/env bash
# Set up and run the demo: partition -> fit-local per silo -> fuse -> evaluate table.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/pfuse demo "$@"
