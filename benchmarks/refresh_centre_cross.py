"""Issue 29: the refresh round and fedbens' prior centre crossed. For each LeNet client set, the two
refreshed client sets ``variant_table.py`` wrote — recaptured at the one-shot EM modes with the prior
divided out at zero, and at those with ``prior_centre=clients`` — each refitted by EM with either
centre: which of the two choices (where to refresh, how to refit) the centred round's result comes from.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/refresh_centre_cross.py OUT.json a0.1 a0.1_s1 ...

Client sets are ``/tmp/lenet/<name>`` (test.h5; refreshed at the EM modes in ``refresh/at_em_post_*.h5``,
else ``runs/variants/<name>/at_em_post_*.h5``) and ``runs/variants/<name>/at_centred_em_post_*.h5``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from measured import save_rows

from posterior_fusion.data.silo import read_silo
from posterior_fusion.fusion import FusionOptions, fuse
from posterior_fusion.metrics import evaluate_members


def main() -> None:
    out, names = sys.argv[1], sys.argv[2:]
    rows = []
    for name in names:
        test = read_silo(f"/tmp/lenet/{name}/test.h5")
        at_em = (sorted(Path(f"/tmp/lenet/{name}/refresh").glob("at_em_post_*.h5"))
                 or sorted(Path(f"runs/variants/{name}").glob("at_em_post_*.h5")))
        sets = {"at the EM modes (prior centre zero)": at_em,
                "at the EM modes (prior centre clients)": sorted(Path(f"runs/variants/{name}").glob("at_centred_em_post_*.h5"))}
        for refreshed, paths in sets.items():
            for centre in ("zero", "clients"):
                inputs, res, _ = fuse(paths, "fedbens", FusionOptions(progress=False), {"solver": "em", "prior_centre": centre})
                m = evaluate_members(inputs.spec, res.members, test)
                rows.append({"set": name, "refreshed": refreshed, "refit_prior_centre": centre,
                             "accuracy": m["accuracy"], "nll": m["nll"], "ece": m["ece"]})
                print(json.dumps(rows[-1]), flush=True)
    save_rows(out, {"rows": rows})


if __name__ == "__main__":
    main()
