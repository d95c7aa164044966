"""fedbens' default with and without validation data ("make the default safe whether or not
the server has validation data and whatever ``steps`` is"), on the artifacts of a ``pfuse demo`` folder.

Per folder, ``pfuse fuse`` through the library at the default settings (``solver=auto``) and at the explicit
``solver=adam`` (the former default), each at ``steps`` 300 and 1,000, without and with the
server's validation split; every fused model evaluated on the folder's test split (accuracy, NLL, ECE). One JSON
per folder. The last row runs the kron default's stationary fusion explicitly (for the diag and diag+full
folders, where ``auto`` is Adam).

    for s in "" _s1 _s2; do for a in 0.1 0.4; do
      OMP_NUM_THREADS=1 nice -n 19 .venv/bin/pfuse demo --alpha $a --seed ${s#_s} --out-dir runs/s24/a$a$s --methods fedbens
      OMP_NUM_THREADS=1 nice -n 19 .venv/bin/python experiments/without_validation/default_without_validation.py runs/s24/a$a$s \\
          --json docs/results/without_validation/default_s24/a$a$s.json
    done; done
    .venv/bin/python experiments/without_validation/default_without_validation.py --report docs/results/without_validation/default_s24/*.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

from posterior_fusion.data.silo import read_silo
from posterior_fusion.experiment.measure import paired_difference
from posterior_fusion.fusion import FusionOptions, fuse
from posterior_fusion.metrics import evaluate_members

ROWS = [  # (label, settings, with validation data); run() also takes a server temperature as a fourth entry
    ("default (auto), no validation, 300 steps", {}, False),
    ("default (auto), no validation, 1000 steps", {"steps": 1000}, False),
    ("adam (the default before), no validation, 300 steps", {"solver": "adam"}, False),
    ("adam (the default before), no validation, 1000 steps", {"solver": "adam", "steps": 1000}, False),
    ("default (auto) = adam, validation, 300 steps", {}, True),
    ("default (auto) = adam, validation, 1000 steps", {"steps": 1000}, True),
    ("em, prior centre clients, server prior evidence (explicit), no validation, 300 steps",
     {"solver": "em", "prior_centre": "clients", "server_prior": "evidence"}, False),
]


def run(folder: Path, rows: list[tuple] = ROWS) -> dict:
    """Each of ``rows`` — ``(label, settings, with validation data[, server temperature T])``, T as ``fuse
    --temperature`` (absent or None: the clients' own) — fused and evaluated on the folder's test split."""
    posts = sorted(folder.glob("post_*.h5"))
    val, test = folder / "data" / "server_val.h5", read_silo(folder / "data" / "test.h5")
    out = []
    for label, settings, with_val, *temperature in rows:
        temperature = temperature[0] if temperature else None
        t0 = time.perf_counter()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            inputs, result, meta = fuse(posts, "fedbens", FusionOptions(progress=False, temperature=temperature),
                                        {**settings, "laplace": False}, val_path=val if with_val else None)
        seconds = time.perf_counter() - t0
        metrics = evaluate_members(inputs.spec, result.members, test)
        out.append({"label": label, "settings": settings, "validation": with_val, "temperature": temperature,
                    "resolved": meta["resolved"], "fuse_seconds": round(seconds, 2), "accuracy": metrics["accuracy"],
                    "nll": metrics["nll"], "ece": metrics["ece"],
                    "warnings": sorted({str(w.message)[:160] for w in caught})})
        print(f"{folder.name}: {label}: {100 * metrics['accuracy']:.2f} % NLL {metrics['nll']:.3f} "
              f"ECE {metrics['ece']:.3f} ({seconds:.1f} s)", flush=True)
    return {"folder": str(folder), "torch_threads": torch.get_num_threads(), "rows": out}


def seed(run: dict) -> int:
    """The seed of a run's folder (``…/a0.1_s12`` -> 12; a folder without one, as ``a0.1``, is seed 0)."""
    name = Path(run["folder"]).name
    return int(name.split("_s")[1]) if "_s" in name else 0


def report(paths: list[str], rows: list[tuple] = ROWS, reference: str | None = None) -> None:
    """Markdown: per row, accuracy per set in seed order (the solver that ran in brackets) and the mean ± std over
    seeds per α, with ``reference`` (a row's label) the mean paired difference to that row ± its standard error, and
    NLL / ECE means."""
    runs = [json.loads(Path(p).read_text()) for p in paths]
    alphas = sorted({Path(r["folder"]).name.split("_")[0] for r in runs})
    extra = " | − reference" if reference else ""
    print("| fedbens | " + " | ".join(f"α = {a[1:]} accuracy % (seeds) | mean ± std{extra} | NLL / ECE"
                                       for a in alphas) + " |")
    print("|---|" + ("---|---|---|---|" if reference else "---|---|---|") * len(alphas))
    for label, *_ in rows:
        cells = []
        for a in alphas:
            mine = sorted((r for r in runs if Path(r["folder"]).name.split("_")[0] == a), key=seed)
            got = [row for r in mine for row in r["rows"] if row["label"] == label]  # older runs lack later rows
            if not got:
                cells += ["—"] * (4 if reference else 3)
                continue
            acc = [100 * row["accuracy"] for row in got]
            sd = statistics.stdev(acc) if len(acc) > 1 else 0.0
            cells += [" / ".join(f"{v:.2f}" for v in acc) + " (" + ", ".join(row["resolved"]["solver"] for row in got) + ")",
                      f"{statistics.mean(acc):.2f} ± {sd:.2f}"]
            if reference:
                ref = [row for r in mine for row in r["rows"] if row["label"] == reference]
                cells.append(paired_difference([100 * (g["accuracy"] - f["accuracy"]) for g, f in zip(got, ref)]))
            cells.append(f"{statistics.mean(row['nll'] for row in got):.3f} / {statistics.mean(row['ece'] for row in got):.3f}")
        print(f"| {label} | " + " | ".join(cells) + " |")


def main(rows: list[tuple] = ROWS, reference: str | None = None, description: str | None = __doc__) -> None:
    """The command line of this script and of those that measure other ``rows`` the same way."""
    ap = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folders", nargs="+", help="pfuse demo output folders (post_*.h5, data/server_val.h5, data/test.h5)")
    ap.add_argument("--json", help="write the rows here (one folder)")
    ap.add_argument("--report", action="store_true", help="the arguments are JSON files of this script: print the table")
    args = ap.parse_args()
    if args.report:
        report(args.folders, rows, reference)
        return
    if args.json and len(args.folders) != 1:
        sys.exit("--json takes one folder")
    for folder in args.folders:
        out = run(Path(folder), rows)
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
