#!/usr/bin/env bash
# Issue 30, item 5: the refresh round at the client ensemble's serving cost (25 networks) on one
# ensemble_gap cell. DIR holds the cell's files (links into runs/ensemble_gap: partitions/<key>/*.h5 and
# clients/<key>/post_*.h5 — client_C.h5, post_C.h5, server_val.h5, test.h5); OUT receives one
# `pfuse evaluate --json` per global artifact.
#   OMP_NUM_THREADS=1 nice -n 19 bash benchmarks/ensemble_gap_refresh.sh DIR ROUNDS OUT TAG
# anchor: fedbens from the C·M client starts with the prior centre, Adam + best validation iterate (the
# grid's best fusion); each round: every silo recaptures at the current global's 25 modes
# (`recapture --at`, damping auto, the default) and the server refits 25 modes (Adam + validation,
# prior centre clients). Files already there are kept (a stopped run resumes).
set -euo pipefail
D=$1; ROUNDS=$2; OUT=$3; TAG=$4
P=".venv/bin/pfuse"
mkdir -p "$D/refresh" "$OUT"
[ -f "$D/ens.h5" ] || $P fuse "$D"/post_*.h5 --method ensemble --out "$D/ens.h5"
[ -f "$D/anchor.h5" ] || $P fuse "$D"/post_*.h5 --method fedbens --set starts=clients --set prior_centre=clients \
    --val "$D/server_val.h5" --out "$D/anchor.h5"
at=anchor
for r in $(seq 1 "$ROUNDS"); do
  refit=$([ "$r" = 1 ] && echo refit_adam || echo "refit${r}_adam")
  for post in "$D"/post_*.h5; do
    c=$(basename "$post" .h5); c=${c#post_}
    tag=$([ "$r" = 1 ] && echo at_anchor || echo at_refit$([ "$r" -gt 2 ] && echo $((r - 1))))
    [ -f "$D/refresh/${tag}_post_$c.h5" ] || $P recapture --from "$post" --data "$D/client_$c.h5" --at "$D/$at.h5" \
        --out "$D/refresh/${tag}_post_$c.h5"
  done
  [ -f "$D/$refit.h5" ] || $P fuse "$D/refresh/${tag}"_post_*.h5 --method fedbens --set prior_centre=clients \
      --val "$D/server_val.h5" --out "$D/$refit.h5"
  at=$refit
done
for g in "$D"/ens.h5 "$D"/anchor.h5 "$D"/refit*_adam.h5; do
  name=$(basename "$g" .h5)
  [ -s "$OUT/eval_${TAG}_$name.json" ] || $P evaluate "$g" --data "$D/test.h5" --json > "$OUT/eval_${TAG}_$name.json"
done
