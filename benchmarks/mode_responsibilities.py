"""Each client's responsibilities at the modes of fedbens' default fusion (issue 29, item 1: what the mixture does at
the modes), on ``pfuse demo`` folders. One JSON line per folder: the smallest largest responsibility over clients
and modes, the largest of the others, and which component of each client every mode takes.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/mode_responsibilities.py /tmp/s26/a0.1_s5 … \\
        >> docs/results/fusion_safety/default_s26/responsibilities.jsonl
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from posterior_fusion.fusion import FusionOptions, fuse
from posterior_fusion.fusion.mode_laplace import responsibilities


def main() -> None:
    for f in sys.argv[1:]:
        folder = Path(f)
        inputs, result, _ = fuse(sorted(folder.glob("post_*.h5")), "fedbens", FusionOptions(progress=False),
                                 {"laplace": False})
        W = torch.stack(result.members).double()
        clients = inputs.clients
        r = responsibilities(clients, [inputs.temperature(c) for c in clients],
                             [inputs.prior_precision(c) for c in clients], W)  # per client (modes, components)
        print(json.dumps({"set": str(folder), "min_largest_responsibility": min(float(rc.max(1).values.min()) for rc in r),
                          "largest_other": max(float(rc.sort(1).values[:, :-1].max()) for rc in r),
                          "component_of_mode": [[int(i) for i in rc.argmax(1)] for rc in r]}), flush=True)


if __name__ == "__main__":
    main()
