#!/bin/bash
# FedLPA's own setting (README.md): ten LeNet clients as FedLPA's scripts/experiments.sh, fused by
# FedLPA's three layer solves (newton, expectation, the authors' gradient descent) and the client
# ensemble; prints one JSON row per fusion and writes them to OUT (default: DIR/solves.json).
#   bash experiments/fedlpa_setting/run.sh DIR [OUT]
set -euo pipefail
if [ "${1:-}" = "" ] || [ "${1:-}" = "--help" ] || [ "${1:-}" = "-h" ]; then
  sed -n 2,5p "$0" | sed 's/^# \{0,1\}//'; exit 0
fi
D=$1; OUT=${2:-$1/solves.json}
PF=${PFUSE:-.venv/bin/pfuse}
mkdir -p "$D"
[ -f "$D/test.h5" ] || $PF partition --clients 10 --alpha 0.1 --scheme per-class --partition-seed 0 --out-dir "$D"
for c in $(seq 0 9); do
  [ -f "$D/post_$c.h5" ] || $PF fit-local --data "$D/client_$c.h5" --model lenet --model-kwargs '{"bias": true}' \
      -M 1 --epochs 10 --train-seed "$c" --out "$D/post_$c.h5"
done
rows=()
for v in "fedlpa estimate=newton" "fedlpa estimate=expectation" "fedlpa estimate=authors-gd" "ensemble pooling=average"; do
  set -- $v
  name="$1-${2#*=}"
  start=$(date +%s.%N)
  rm -f "$D/g_$name.h5"
  $PF fuse "$D"/post_?.h5 --method "$1" --set "$2" --out "$D/g_$name.h5" >/dev/null
  seconds=$(python3 -c "import time; print(round(time.time() - $start, 1))")
  row=$($PF evaluate "$D/g_$name.h5" --data "$D/test.h5" --json | python3 -c \
    "import json,sys; r=json.load(sys.stdin); print(json.dumps({'variant': '$name', 'accuracy': r['accuracy'], 'nll': r['nll'], 'ece': r['ece'], 'server_seconds': $seconds}))")
  echo "$row"; rows+=("$row")
done
printf '%s\n' "${rows[@]}" | python3 -c "import json,sys; json.dump([json.loads(l) for l in sys.stdin], open('$OUT', 'w'), indent=1)"
