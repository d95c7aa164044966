#!/usr/bin/env bash
# Issue 29, one-shot goal: fedbens EM at stationarity with the prior centre and client-curvature damping d
# (no validation data), per client set; one `pfuse evaluate --json` per (set, d) in OUT.
#   OMP_NUM_THREADS=1 nice -n 19 bash benchmarks/centre_damping_sweep.sh OUT /tmp/lenet/a0.1 /tmp/lenet/a0.1_s1 …
# Each set directory holds post_*.h5 (the clients) and test.h5; files already in OUT are kept (resumes).
set -euo pipefail
OUT=$1; shift
P=.venv/bin/pfuse
mkdir -p "$OUT"
for D in "$@"; do
  set_name=$(basename "$D")
  for d in 0 0.1 0.3 1 3; do
    out="$OUT/${set_name}_d$d"
    [ -s "$out.json" ] && continue
    $P --quiet fuse "$D"/post_*.h5 --method fedbens --set solver=em --set prior_centre=clients --set damping="$d" \
        --out "$out.h5" > /dev/null
    $P --quiet evaluate "$out.h5" --data "$D/test.h5" --json > "$out.json"
    rm -f "$out.h5"
  done
done
