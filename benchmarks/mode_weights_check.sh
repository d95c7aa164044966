#!/usr/bin/env bash
# fedbens' default without validation data (solver=auto -> EM, prior centre clients, server prior from the evidence)
# with the modes weighted equally (default) or by their Laplace mass (mode_weights=laplace: π_k ∝ p(w*_k|D) |Λ*_k|^-1/2),
# each evaluated with the map and glm predictives on the folder's test split. One JSON line per (weights, predictive).
#   OMP_NUM_THREADS=1 nice -n 19 bash benchmarks/mode_weights_check.sh /tmp/s24/a0.1 >> docs/results/fusion_safety/default_s24/mode_weights.jsonl
set -euo pipefail
DIR=$1
P=.venv/bin/pfuse
for W in equal laplace; do
  $P fuse "$DIR"/post_*.h5 --method fedbens --set mode_weights=$W --out "$DIR/g_$W.h5" --json > "$DIR/g_$W.fuse.json" 2> /dev/null
  for PRED in map glm; do
    $P evaluate "$DIR/g_$W.h5" --data "$DIR/data/test.h5" --predictive $PRED --json 2> /dev/null > "$DIR/e_${W}_$PRED.json"
    .venv/bin/python - "$DIR" "$W" "$PRED" <<'PY'
import json, sys
import posterior_fusion
folder, weights, pred = sys.argv[1:]
m = json.load(open(f"{folder}/e_{weights}_{pred}.json"))
g = posterior_fusion.load(f"{folder}/g_{weights}.h5").metadata
print(json.dumps({"set": folder.rstrip("/").split("/")[-1], "mode_weights": weights, "predictive": pred,
                  "weights": g["mode_weights"], "objective_at_modes": g["laplace"]["objective_at_modes"],
                  **{k: m[k] for k in ("accuracy", "nll", "ece")}}))
PY
  done
done
