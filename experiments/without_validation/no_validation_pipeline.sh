#!/usr/bin/env bash
# The pipeline that never sees validation data, on one client set, beside the paper's default and
# the client ensemble. DIR holds client_C.h5, post_C.h5, server_val.h5, test.h5 (links into an experiment's
# cache: partitions/<key>/*.h5, clients/<key>/post_*.h5); OUT receives one `pfuse evaluate --json` per
# global artifact and predictive.
#   OMP_NUM_THREADS=1 nice -n 19 bash experiments/without_validation/no_validation_pipeline.sh DIR OUT TAG
# ens: the client ensemble; paper: fedbens as the paper runs it (Adam, best validation iterate); cem: EM to
# stationarity with the prior centre clients (no validation); each silo recaptures at cem's modes
# (`recapture --at`, damping auto, the default); cem_refresh_em: EM centred again on the refreshed
# artifacts, its Laplace prior from the modes' evidence (laplace_prior=evidence). Files already there are
# kept (a stopped run resumes).
set -euo pipefail
D=$1; OUT=$2; TAG=$3
P=".venv/bin/pfuse"
mkdir -p "$D/refresh" "$OUT"
[ -f "$D/ens.h5" ] || $P fuse "$D"/post_*.h5 --method ensemble --out "$D/ens.h5"
[ -f "$D/paper.h5" ] || $P fuse "$D"/post_*.h5 --method fedbens --val "$D/server_val.h5" --out "$D/paper.h5"
[ -f "$D/cem.h5" ] || $P fuse "$D"/post_*.h5 --method fedbens --set solver=em --set prior_centre=clients \
    --out "$D/cem.h5"
for post in "$D"/post_*.h5; do
  c=$(basename "$post" .h5); c=${c#post_}
  [ -f "$D/refresh/at_cem_post_$c.h5" ] || $P refresh --artifact "$post" --data "$D/client_$c.h5" --at "$D/cem.h5" \
      --out "$D/refresh/at_cem_post_$c.h5"
done
[ -f "$D/cem_refresh_em.h5" ] || $P fuse "$D"/refresh/at_cem_post_*.h5 --method fedbens --set solver=em \
    --set prior_centre=clients --set laplace_prior=evidence --out "$D/cem_refresh_em.h5"
for g in ens paper cem cem_refresh_em; do
  [ -s "$OUT/eval_${TAG}_${g}_map.json" ] || $P evaluate "$D/$g.h5" --data "$D/test.h5" --json \
      > "$OUT/eval_${TAG}_${g}_map.json"
done
[ -s "$OUT/eval_${TAG}_cem_refresh_em_glm.json" ] || $P evaluate "$D/cem_refresh_em.h5" --data "$D/test.h5" \
    --predictive glm --json > "$OUT/eval_${TAG}_cem_refresh_em_glm.json"
