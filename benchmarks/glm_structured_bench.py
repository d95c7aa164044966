"""The full-network GLM predictive layer by layer from the precision's blocks (``glm`` today:
``predictive.structured_moments``) against per-sample full Jacobians (``predictive.jacobian_moments``,
the dense ``glm``), side by side on one fedbens artifact: seconds and
peak resident memory of each in a fresh process, and its working set (the peak during the
prediction over the resident memory before it: ``/proc/self/clear_refs`` restarts the peak), beside
the map predictive's; and the largest difference of the two GLM paths' probabilities.

    nice -n 5 .venv/bin/python benchmarks/glm_structured_bench.py --work runs/glmll \
        --json docs/results/predictive/glm_structured.json

``--batch-sizes 1,16,32,64``: instead, the memory one batch of ``b`` samples costs each GLM path at the
same ``b`` (one mode, a fresh process per path and size, both paths warmed on one sample first so the
first backward pass's one-time allocations are left out), and its seconds:

    nice -n 5 .venv/bin/python benchmarks/glm_structured_bench.py --work runs/glmll --batch-sizes 1,16,32,64 \
        --json docs/results/predictive/glm_structured_per_batch.json

The artifact is ``benchmarks/glm_last_layer_bench.py``'s (three LeNet clients, α = 0.5, M = 2, kron,
fedbens with its Laplace posterior; built there if missing); the full 10,000-image test set.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from posterior_fusion.experiment.measure import save_rows

CHILD = """
import json, sys, time, numpy as np
import posterior_fusion as pf
from posterior_fusion import predictive as P
from posterior_fusion.data.silo import read_silo
work, path, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
if path == "jacobian":  # the per-sample full-Jacobian path for every model
    P.LOGIT_MOMENTS["glm"] = P.jacobian_moments
g = pf.load(work + "/g.h5")
data = read_silo(work + "/test.h5")
x, y = data.x[:n], data.labels()[:n]
status = lambda key: next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith(key))
before = status("VmRSS")
open("/proc/self/clear_refs", "w").write("5")  # the peak (VmHWM) restarts from here
t0 = time.time()
p = g.predict(x, predictive="map" if path == "map" else "glm").double().numpy()
seconds = time.time() - t0
np.save(work + f"/probs_{path}.npy", p)
peak = status("VmHWM")
print(json.dumps({"path": path, "predict_seconds": round(seconds, 2), "peak_mib": round(peak / 1024),
                  "working_set_mib": round((peak - before) / 1024), "n": n,
                  "accuracy": float((p.argmax(1) == y).mean()),
                  "nll": float(-np.log(np.maximum(p[np.arange(n), y], 1e-12)).mean())}))
"""

PER_BATCH = """
import json, sys, time
import posterior_fusion as pf
from posterior_fusion import predictive as P
from posterior_fusion.models.members import model_inputs
from posterior_fusion.data.silo import read_silo
work, path, b = sys.argv[1], sys.argv[2], int(sys.argv[3])
status = lambda key: next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith(key))
g = pf.load(work + "/g.h5")
x = model_inputs(g.model_spec, g.metadata.get("input_transform"), read_silo(work + "/test.h5").x[:b], False, "test")
moments = {"structured": P.structured_moments, "jacobian": P.jacobian_moments}[path]
w, prec = g.members[0], g.precision(0)
moments(g.model_spec, w, prec, x[:1], batch_size=1)  # warm: the first backward pass's one-time allocations
before = status("VmRSS")
open("/proc/self/clear_refs", "w").write("5")
t0 = time.time()
moments(g.model_spec, w, prec, x, batch_size=b)
print(json.dumps({"path": path, "batch": b, "seconds": round(time.time() - t0, 3),
                  "working_set_mib": round((status("VmHWM") - before) / 1024, 1)}))
"""


def per_batch(work: Path, sizes: list[int], out: str | None) -> None:
    """Working set and seconds of one batch of each size, structured against full Jacobians."""
    rows = []
    for b in sizes:
        for path in ("structured", "jacobian"):
            proc = subprocess.run([sys.executable, "-c", PER_BATCH, str(work), path, str(b)], capture_output=True,
                                  text=True)
            if proc.returncode:
                raise SystemExit(proc.stderr.strip().splitlines()[-1])
            rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
            print(json.dumps(rows[-1]), flush=True)
    by = {(r["path"], r["batch"]): r for r in rows}
    summary = [{"batch": b, "memory_ratio": round(by["jacobian", b]["working_set_mib"] /
                                                  max(0.1, by["structured", b]["working_set_mib"]), 1),
                "speed_ratio": round(by["jacobian", b]["seconds"] / max(1e-3, by["structured", b]["seconds"]), 1)}
               for b in sizes]
    print(json.dumps(summary))
    save_rows(out, {"rows": rows, "summary": summary})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", default="runs/glmll")
    ap.add_argument("--n", type=int, default=10_000, help="test images (default: all 10,000)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--batch-sizes", default=None,
                    help="comma-separated batch sizes: measure one batch of each per path instead (default: off)")
    args = ap.parse_args()
    work = Path(args.work)
    if not (work / "g.h5").exists():
        subprocess.run([sys.executable, str(Path(__file__).with_name("glm_last_layer_bench.py")), "--work", str(work)],
                       check=True)
    if args.batch_sizes:
        per_batch(work, [int(b) for b in args.batch_sizes.split(",")], args.json)
        return
    rows = []
    for path in ("map", "structured", "jacobian"):  # map: the process's own footprint (model, data, artifact)
        t0 = time.time()
        proc = subprocess.run([sys.executable, "-c", CHILD, str(work), path, str(args.n)], capture_output=True,
                              text=True)
        if proc.returncode:
            raise SystemExit(proc.stderr.strip().splitlines()[-1])
        rows.append({**json.loads(proc.stdout.strip().splitlines()[-1]), "process_seconds": round(time.time() - t0, 1)})
        print(json.dumps(rows[-1]), flush=True)
    a, b = (np.load(work / f"probs_{p}.npy") for p in ("structured", "jacobian"))
    base, fast, full = rows
    summary = {"max_abs_probability_difference": float(np.abs(a - b).max()),
               "speed_ratio": round(full["predict_seconds"] / fast["predict_seconds"], 1),
               "peak_ratio": round(full["peak_mib"] / fast["peak_mib"], 2),
               "working_set_ratio": round(full["working_set_mib"] / max(1, fast["working_set_mib"]), 1),
               # beyond what the map predictive needs too (the inputs' transform, the logits)
               "glm_working_set_ratio": round((full["working_set_mib"] - base["working_set_mib"]) /
                                              max(1, fast["working_set_mib"] - base["working_set_mib"]), 1)}
    print(json.dumps(summary))
    save_rows(args.json, {"rows": rows, "summary": summary})


if __name__ == "__main__":
    main()
