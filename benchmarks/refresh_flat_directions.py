"""Why the refit of refreshed ResNet-20 artifacts predicts at chance (issue 29, session 14): fuse the
damping-100 re-centred artifacts of ``refresh_damping_sweep.py`` (every silo's component k centred
within 0.01 of the global member w*_k) with EM, and print how far each fused member lies from the
silos' centres and its norm against theirs.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/refresh_flat_directions.py 'DIR/refresh/sweep_d100.0_at_paper_d1.0_post_*.h5'
"""

from __future__ import annotations

import glob
import sys

import torch

from posterior_fusion.artifact.reader import load_client
from posterior_fusion.fusion import FusionOptions, fuse

torch.set_num_threads(1)
paths = sorted(glob.glob(sys.argv[1]))
arts = [load_client(p) for p in paths]
centres = [[c.map.double() for c in a.components] for a in arts]
_, res, _ = fuse(paths, "fedbens", FusionOptions(progress=False), {"solver": "em"})
for j, w in enumerate(res.members):
    d = [[round(float((w.double() - c).norm()), 2) for c in cs] for cs in centres]
    print("member", j, "norm", round(float(w.norm()), 2), "distance to each silo's 3 centres:", d)
print("centre norms", [round(float(c.norm()), 2) for c in centres[0]])
print("spread of silos' centres for mode 0:", round(max(float((centres[i][0]-centres[0][0]).norm()) for i in range(len(centres))), 3))
