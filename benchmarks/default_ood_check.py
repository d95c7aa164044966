"""OOD AUROC of fedbens' default without validation data against the client ensemble (issue 29: "OOD AUROC at least
the client ensemble's"), on a ``pfuse demo`` folder that ``mode_weights_check.sh`` has fused (``g_equal.h5``).

    OMP_NUM_THREADS=1 nice -n 19 .venv/bin/python benchmarks/default_ood_check.py /tmp/s25/a0.1_s3 \\
        >> docs/results/fusion_safety/default_s25/ood.jsonl

The client ensemble (``fuse --method ensemble``) and the default's modes with the ``map`` and ``glm`` predictives
are each evaluated by ``pfuse evaluate --ood`` on the folder's test split, the OOD set being scikit-learn's digits
resized to 28×28 (as ``predictive_fmnist.py``). One JSON line per (fusion, predictive).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from measured import run_measured
from predictive_fmnist import digits_ood


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder", help="a pfuse demo folder with post_*.h5, data/test.h5 and g_equal.h5")
    args = ap.parse_args()
    folder = Path(args.folder)
    ood = folder / "digits_ood.h5"
    if not ood.exists():
        digits_ood(ood)
    ensemble = folder / "g_ensemble.h5"
    if not ensemble.exists():
        r = run_measured("fuse", *sorted(map(str, folder.glob("post_*.h5"))), "--method", "ensemble", "--out", str(ensemble))
        if r["exit"] != 0:
            raise SystemExit(f"fuse --method ensemble failed: {r['error']}")
    for label, path, predictive in (("client ensemble", ensemble, "map"), ("default, no validation", folder / "g_equal.h5", "map"),
                                    ("default, no validation", folder / "g_equal.h5", "glm")):
        r = run_measured("evaluate", str(path), "--data", str(folder / "data" / "test.h5"), "--predictive", predictive,
                         "--ood", str(ood), "--json")
        if r["exit"] != 0:
            raise SystemExit(f"evaluate {path} failed: {r['error']}")
        m = json.loads(r["stdout"])
        print(json.dumps({"set": folder.name, "fusion": label, "predictive": predictive, "eval_seconds": r["seconds"],
                          "eval_peak_mib": r["peak_mib"], **{k: m.get(k) for k in ("accuracy", "nll", "ece", "ood_auroc")}}),
              flush=True)


if __name__ == "__main__":
    main()
