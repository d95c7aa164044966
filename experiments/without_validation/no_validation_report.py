"""Markdown table of ``no_validation_pipeline.sh`` evaluations: per client set (TAG), test accuracy / NLL /
ECE of the client ensemble, the paper's fedbens (best validation iterate), EM centred (no validation) and
the whole no-validation pipeline with `map` and `glm` (Laplace prior from the evidence).

    .venv/bin/python experiments/without_validation/no_validation_report.py docs/results/without_validation/no_validation
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

COLUMNS = (("ens_map", "client ensemble (15)"), ("paper_map", "paper: Adam, best validation iterate"),
           ("cem_map", "EM centred (one-shot, no validation)"),
           ("cem_refresh_em_map", "EM → refresh (auto) → EM, map"),
           ("cem_refresh_em_glm", "the same, glm (evidence δ)"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder", type=Path, help="the folder of eval_<TAG>_<column>.json files")
    folder = ap.parse_args().folder
    suffixes = [f"_{c}.json" for c, _ in COLUMNS]
    tags = sorted({f.name[len("eval_"):-len(end)] for f in folder.glob("eval_*.json") for end in suffixes
                   if f.name.endswith(end)})
    print("| client set | " + " | ".join(label for _, label in COLUMNS) + " |")
    print("|---|" + "---|" * len(COLUMNS))
    for tag in tags:
        cells = []
        for c, _ in COLUMNS:
            f = folder / f"eval_{tag}_{c}.json"
            if not f.exists() or not f.stat().st_size:
                cells.append("–")
                continue
            m = json.loads(f.read_text())
            cells.append(f"{100 * m['accuracy']:.2f} / {m['nll']:.3f} / {m['ece']:.3f}")
        print(f"| {tag} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
