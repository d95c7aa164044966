"""Where the layer-by-layer GLM predictive's time and memory go on a convolutional network: one
batch, each stage in a fresh process (warmed on one sample; working set = the peak over the resident memory before
the batch, ``/proc/self/clear_refs``), on a random K-FAC precision (float32, as artifacts store it) over the model:

- ``forward``: the forward pass alone (no gradients);
- ``passes``: the forward pass and the C backward passes to the layer outputs, each class's gradients dropped;
- ``held``: the same, every layer's output gradients for all C classes held and turned into per-layer Jacobian
  factors (``fastcapture.logit_jacobians``) — what the covariance needs before it contracts;
- ``structured``: the whole covariance ``J Λ⁻¹ Jᵀ`` layer by layer (``predictive.structured_moments``, ``glm``);
- ``jacobian``: the same from per-sample full Jacobians (``predictive.jacobian_moments``).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/glm_memory_breakdown.py --batch-sizes 8,32 \\
        --json docs/results/predictive/glm_memory_breakdown_resnet20.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from posterior_fusion.experiment.measure import save_rows

CHILD = """
import json, sys, time, torch
from posterior_fusion.curvature import BlockDiag, Dense, Kron
from posterior_fusion.layout import ParameterLayout
from posterior_fusion.models.jacobians import JACOBIAN, batch_pass, logit_jacobians, no_param_grads
from posterior_fusion.models.layers import captured_layers
from posterior_fusion.models import ModelSpec
from posterior_fusion import predictive as P

stage, b, model_name, width = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
gen = torch.Generator().manual_seed(1)
spec = ModelSpec(model_name, {"width": width, "in_channels": 1} if model_name == "resnet20" else {})
model = spec.build().eval()

def psd(n):
    X = torch.randn(n, n + 2, generator=gen, dtype=torch.float64)
    return (X @ X.T / X.shape[1]).float()

blocks = [Kron(psd(e.matrix_shape[0]), psd(e.matrix_shape[1])) if e.matrix_shape and len(e.shape) >= 2
          else Dense(psd(e.size)) for e in ParameterLayout.from_model(model).entries]
prec = BlockDiag(blocks).precision(0.5, 2.0)
w = 0.05 * torch.randn(sum(p.numel() for p in model.parameters()), generator=gen)
torch.nn.utils.vector_to_parameters(w, model.parameters())
x = torch.randn(b, 1, 28, 28, generator=gen)

def run(xb):
    if stage == "forward":
        with torch.no_grad():
            model(xb)
    elif stage == "passes":
        with no_param_grads(model):
            batch_pass(model, captured_layers(model), xb, JACOBIAN, None, lambda r, inputs, grads: None)
    elif stage == "held":
        for _ in logit_jacobians(model, xb):
            pass
    else:
        moments = P.structured_moments if stage == "structured" else P.jacobian_moments
        moments(spec, w, prec, xb, batch_size=len(xb))

status = lambda key: next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith(key))
run(x[:1])
before = status("VmRSS")
open("/proc/self/clear_refs", "w").write("5")
t0 = time.perf_counter()
run(x)
print(json.dumps({"stage": stage, "batch": b, "seconds": round(time.perf_counter() - t0, 3),
                  "working_set_mib": round((status("VmHWM") - before) / 1024, 1)}))
"""

STAGES = ("forward", "passes", "held", "structured", "jacobian")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-sizes", default="8,32", help="samples per batch, comma-separated [default: %(default)s]")
    ap.add_argument("--model", default="resnet20", choices=("resnet20", "lenet"), help="[default: %(default)s]")
    ap.add_argument("--width", type=int, default=16, help="ResNet-20's width [default: %(default)s]")
    ap.add_argument("--json", default=None, help="write the rows here [default: print only]")
    args = ap.parse_args()
    rows = []
    for b in (int(v) for v in args.batch_sizes.split(",")):
        for stage in STAGES:
            proc = subprocess.run([sys.executable, "-c", CHILD, stage, str(b), args.model, str(args.width)],
                                  capture_output=True, text=True)
            if proc.returncode:
                raise SystemExit(proc.stderr.strip().splitlines()[-1])
            rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
            print(json.dumps(rows[-1]), flush=True)
    save_rows(args.json, {"model": args.model, "width": args.width, "rows": rows})


if __name__ == "__main__":
    main()
