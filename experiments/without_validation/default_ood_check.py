"""OOD AUROC of fedbens' default without validation data against the client ensemble ("OOD AUROC at least
the client ensemble's"), on a ``pfuse demo`` folder (its ``g_equal.h5``, the default fusion with its Laplace step, is
made here when missing — the same file ``mode_weights_check.sh`` writes).

    OMP_NUM_THREADS=1 nice -n 19 .venv/bin/python experiments/without_validation/default_ood_check.py runs/s25/a0.1_s3 \\
        >> docs/results/without_validation/default/ood.jsonl

The client ensemble (``fuse --method ensemble``) and the default's modes with the ``map`` and ``glm`` predictives
are each evaluated by ``pfuse evaluate --ood`` on the folder's test split, the OOD set being scikit-learn's digits
resized to 28×28 (as ``predictive_fmnist.py``). One JSON line per (fusion, predictive).

    .venv/bin/python experiments/without_validation/default_ood_check.py --report docs/results/without_validation/default_s2[56]/ood.jsonl

prints, per α, the means over the sets and how many sets meet the two predictive goals (``glm`` with a lower
NLL and ECE than the modes' ``map``; an OOD AUROC at least the client ensemble's).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from posterior_fusion.experiment.measure import digits_ood, run_measured


def fused(folder: Path, method: str, name: str) -> Path:
    """``folder/name``: the folder's clients fused by ``method`` at its default settings (once; kept)."""
    out = folder / name
    if not out.exists():
        r = run_measured("fuse", *sorted(map(str, folder.glob("post_*.h5"))), "--method", method, "--out", str(out))
        if r["exit"] != 0:
            raise SystemExit(f"fuse --method {method} failed: {r['error']}")
    return out


ROWS = (("client ensemble", "map"), ("default, no validation", "map"), ("default, no validation", "glm"))


def report(paths: list[str]) -> None:
    """Markdown: per α and row, the means over the sets (accuracy %, NLL, ECE, OOD AUROC) and the sets' count; then
    per α on how many sets ``glm`` beats ``map`` on NLL and ECE together and the AUROC reaches the ensemble's."""
    lines = [json.loads(line) for p in paths for line in Path(p).read_text().splitlines() if line.strip()]
    by = {(r["set"], r["fusion"], r["predictive"]): r for r in lines}  # a set measured twice: the last line
    sets = sorted({r["set"] for r in lines}, key=lambda s: (s.split("_")[0], int(s.split("_s")[1])))
    print("| α | fusion | predictive | sets | accuracy % | NLL | ECE | OOD AUROC |")
    print("|---|---|---|---|---|---|---|---|")
    verdicts = []
    for a in sorted({s.split("_")[0] for s in sets}):
        mine = [s for s in sets if s.split("_")[0] == a and all((s, *row) in by for row in ROWS)]
        for fusion, pred in ROWS:
            got = [by[(s, fusion, pred)] for s in mine]
            acc = [100 * r["accuracy"] for r in got]
            print(f"| {a[1:]} | {fusion} | {pred} | {len(got)} | {statistics.mean(acc):.2f} ± {statistics.stdev(acc):.2f} | "
                  + " | ".join(f"{statistics.mean(r[k] for r in got):.3f}" for k in ("nll", "ece", "ood_auroc")) + " |")
        both = sum(by[(s, *ROWS[2])]["nll"] < by[(s, *ROWS[1])]["nll"] and by[(s, *ROWS[2])]["ece"] < by[(s, *ROWS[1])]["ece"]
                   for s in mine)
        ood = {p: sum(by[(s, "default, no validation", p)]["ood_auroc"] >= by[(s, *ROWS[0])]["ood_auroc"] for s in mine)
               for p in ("map", "glm")}
        verdicts.append(f"α = {a[1:]}: glm better than map on NLL and ECE on {both} of {len(mine)} sets; OOD AUROC ≥ the "
                        f"client ensemble's on {ood['map']} (map) / {ood['glm']} (glm) of {len(mine)}")
    print("\n" + "\n".join(verdicts))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder", nargs="+", help="a pfuse demo folder with post_*.h5 and data/test.h5 (with --report: "
                                             "JSON-lines files of this script)")
    ap.add_argument("--report", action="store_true", help="print the summary table of the given JSON-lines files")
    args = ap.parse_args()
    if args.report:
        report(args.folder)
        return
    if len(args.folder) != 1:
        raise SystemExit("one folder at a time (its lines go to standard output)")
    folder = Path(args.folder[0])
    ood = folder / "digits_ood.h5"
    if not ood.exists():
        digits_ood(ood)
    default, ensemble = fused(folder, "fedbens", "g_equal.h5"), fused(folder, "ensemble", "g_ensemble.h5")
    for label, path, predictive in (("client ensemble", ensemble, "map"), ("default, no validation", default, "map"),
                                    ("default, no validation", default, "glm")):
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
