"""Writes ``docs/choosing.md`` — which fusion method to use in which situation, and what it gave —
from the studies' committed results (``docs/results/<study>/``), so the page cannot drift from them.

    .venv/bin/python experiments/choosing.py            # rewrite docs/choosing.md
    .venv/bin/python experiments/choosing.py --check    # exit 1 if the committed page differs

Every figure on the page is read from a committed result file named in its row; nothing is typed in.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"
PAGE = ROOT / "docs" / "choosing.md"
ALPHAS = ("0.1", "0.2", "0.4")


@dataclass(frozen=True)
class Cell:
    """One α's figures: accuracy % mean and sample std over ``seeds``, mean NLL and ECE, mean server seconds."""

    accuracy: float
    std: float
    seeds: int
    nll: float
    ece: float
    seconds: float | None = None

    def text(self) -> str:
        return f"{self.accuracy:.2f} ± {self.std:.2f} ({self.seeds}) · {self.nll:.3f} / {self.ece:.3f}"


@dataclass(frozen=True)
class Row:
    situation: str
    command: str
    cells: dict[str, Cell]
    networks: str
    source: str
    key: str = ""  # how the page's text refers to the row

    def seconds(self) -> str:
        known = [c.seconds for c in self.cells.values() if c.seconds is not None]
        return f"{statistics.mean(known):.1f}" if known else "not recorded"


def grid_cells(study: str, method: str, structure: str = "kron") -> tuple[dict[str, Cell], str]:
    """The cells of ``method`` in a grid study's aggregated ``results.csv`` (temperature 0.1, the
    study's M) and its number of networks served."""
    path = RESULTS / study / "results.csv"
    with open(path) as fh:
        rows = [r for r in csv.DictReader(fh) if r["method"] == method and r["structure"] == structure
                and r["temperature"] == "0.1"]
    if not rows:
        raise SystemExit(f"{path.relative_to(ROOT)}: no row for method {method!r}, structure {structure!r}")
    cells = {}
    for r in rows:
        alpha = str(float(r["alpha"]))
        if alpha in ALPHAS:
            cells[alpha] = Cell(float(r["accuracy_mean"]), float(r["accuracy_std"]), int(r["seeds"]),
                                float(r["nll_mean"]), float(r["ece_mean"]))
    return cells, rows[0]["members"]


def seed_files_cells(folders: list[str], label: str) -> dict[str, Cell]:
    """Per α, the rows labelled ``label`` of per-seed JSON files ``a<α>_s<seed>.json`` (one client set
    each), with the server's seconds."""
    by_alpha: dict[str, list[dict]] = {}
    for folder in folders:
        for path in sorted((RESULTS / folder).glob("a*_s*.json")):
            alpha = path.name[1:].split("_s")[0]
            row = next((r for r in json.loads(path.read_text())["rows"] if r["label"] == label), None)
            if row is None:
                raise SystemExit(f"{path.relative_to(ROOT)}: no row labelled {label!r}")
            by_alpha.setdefault(alpha, []).append(row)
    cells = {}
    for alpha, rows in by_alpha.items():
        acc = [100 * r["accuracy"] for r in rows]
        cells[str(float(alpha))] = Cell(statistics.mean(acc), statistics.stdev(acc) if len(acc) > 1 else 0.0,
                                        len(rows), statistics.mean(r["nll"] for r in rows),
                                        statistics.mean(r["ece"] for r in rows),
                                        statistics.mean(r["fuse_seconds"] for r in rows))
    return cells


def distillation_cells(row: str, folder: str = "distillation") -> dict[str, Cell]:
    """Per α, the distillation study's cells of ``row`` (``docs/results/<folder>/<α>_<seed>_<row>.json``)."""
    by_alpha: dict[str, list[dict]] = {}
    for path in sorted((RESULTS / folder).glob(f"*_{row}.json")):
        r = json.loads(path.read_text())
        by_alpha.setdefault(str(float(r["alpha"])), []).append(r)
    cells = {}
    for alpha, rs in by_alpha.items():
        acc = [100 * r["accuracy"] for r in rs]
        cells[alpha] = Cell(statistics.mean(acc), statistics.stdev(acc) if len(acc) > 1 else 0.0, len(rs),
                            statistics.mean(r["nll"] for r in rs), statistics.mean(r["ece"] for r in rs),
                            statistics.mean(r["server_seconds"] for r in rs))
    return cells


def rows() -> list[Row]:
    pool, pool_n = grid_cells("label_shift_pool", "ensemble-label-shift")
    pool_d, _ = grid_cells("label_shift_pool", "ensemble-label-shift+distill")
    average, avg_n = grid_cells("label_shift_pool", "ensemble")
    fedbens, fedbens_n = grid_cells("other_systems", "fedbens")
    fedfisher, _ = grid_cells("other_systems", "fedfisher")
    hbfl, _ = grid_cells("other_systems", "hbfl")
    central, _ = grid_cells("other_systems", "centralized", "-")
    lenet = "LeNet, 5 clients, M = 5, 20 epochs"
    demo = "LeNet, 5 clients, M = 3, 5 epochs"
    no_val = ["without_validation/fifteen_seeds"]
    levers = f"{lenet}; `experiments/distillation/`, its levers (the clients fitted again)"
    distilled = distillation_cells("consistent-5000+wide2-long", "distillation_levers")
    data_free = distillation_cells("data-free+all-layers-500", "distillation_levers")
    return [
        Row("**the default** — any server; serves C·M networks; any curvature",
            "`pfuse fuse post_*.h5 --out g.h5` (= `--method ensemble --set pooling=label-shift`)",
            pool, pool_n, f"{lenet}; `experiments/label_shift_pool/config.toml`"),
        Row("unlabeled server inputs; serves one network — what to run when one network must be deployed",
            "`--method ensemble --set pooling=label-shift --distill --distill-student '{\"name\": \"lenet\", "
            "\"kwargs\": {\"width\": 2}}' --distill-steps 12000 --distill-views 8 --unlabeled U.h5` (the consistent "
            "recipe, a student twice as wide on four times the steps)",
            distilled, "1", levers, key="distilled"),
        Row("unlabeled server inputs; serves one network of the clients' architecture",
            "`--method ensemble --set pooling=label-shift --distill --unlabeled U.h5` (the consistent recipe)",
            distillation_cells("consistent-5000"), "1", f"{lenet}; `experiments/distillation/` (the same clients)"),
        Row("no server data at all; serves one network",
            "`--method ensemble --set pooling=label-shift --distill --distill-moment-layers all --distill-views 8 "
            "--distill-synth-size 500` (data-free: 500 inputs synthesised from the teachers and every layer's "
            "recorded input moment)",
            data_free, "1", levers, key="data-free"),
        Row("unlabeled server inputs; serves one network (FedBE's recipe)",
            "`--method ensemble --set pooling=label-shift --distill --distill-recipe swa --unlabeled U.h5`",
            pool_d, "1", f"{lenet}; `experiments/label_shift_pool/config.toml`"),
        Row("validation data; serves M networks; kron",
            "`--method fedbens --val V.h5`", fedbens, fedbens_n, f"{lenet}; `experiments/other_systems/config.toml`"),
        Row("no validation data; serves M networks; kron",
            "`--method fedbens` (EM, prior centre at the clients, server prior from the evidence)",
            seed_files_cells(no_val, "default, no validation, T = clients"), "3",
            f"{demo}; `experiments/without_validation/` (15 client sets)", key="fedbens-default"),
        Row("validation data; serves M networks; kron — the paper's protocol on the same client sets",
            "`--method fedbens --set solver=adam --val V.h5`",
            seed_files_cells(no_val, "adam, best validation iterate, clients' T"), "3",
            f"{demo}; `experiments/without_validation/` (15 client sets)", key="fedbens-paper"),
        Row("validation data; serves one network", "`--method fedfisher --val V.h5`", fedfisher, "1",
            f"{lenet}; `experiments/other_systems/config.toml`"),
        Row("no server data; serves one network", "`--method hbfl`", hbfl, "1",
            f"{lenet}; `experiments/other_systems/config.toml`"),
        Row("*reference:* the client ensemble (plain average of the same networks)",
            "`--method ensemble`", average, avg_n, f"{lenet}; `experiments/label_shift_pool/config.toml`"),
        Row("*reference:* one network trained on all the data (not federated)", "—", central, "1",
            f"{lenet}; `experiments/other_systems/config.toml`"),
    ]


HEAD = """# Which method to use, and what to expect

<!-- Generated by `python experiments/choosing.py` from the committed study results; do not edit. -->

Full Fashion-MNIST, 5 silos with Dirichlet(α) label skew (smaller α: more skew), K-FAC curvature.
Each cell: test accuracy % mean ± sample std (seeds) · NLL / ECE (means); "server s": the server's
seconds per fusion where the study recorded them (2 CPU cores). The last column names the setting
and the configuration that produced the row (its study README has the command).

"""

TAIL = """
How the default was chosen: it is the row that needs nothing from the server (no validation data,
no unlabeled inputs, any curvature structure) and is best at every α measured — the client
ensemble's own networks, each client's members averaged and the clients pooled class by class
under label shift from the class counts every artifact records (`docs/methods.md`). It serves C·M
networks, as the client ensemble does. Where one network must be served, distil it on unlabeled
server inputs into a student wider than the clients' network (row {distilled}), or with no server data at all
from inputs synthesised from the artifacts (row {data_free}); where only the clients' M modes may be served, `fedbens` with
validation data is the strongest fusion measured; without it, its default solver stands at {gap}
against the paper's validation-selected protocol on the same client sets (rows {default} and {paper}).

What the table does not cover: silos that fine-tune a shared pretrained network
(`experiments/pretrained_base/`: there one fused network beats the client ensemble when the silos fine-tune
the head — fedbens with `prior_centre = "prior"` on ResNet-20, three seeds, within 1.2 points of centralised head
fine-tuning at α = 0.4; when they fine-tune every weight, one fused LeNet comes within 0.6 points of the ensemble
after two refresh rounds at α = 0.4, but one fused ResNet-20 stays 15–20 points under it, so serve the default
there), models
other than LeNet at these sizes (ResNet-20: `experiments/resnet20_fmnist/`; a stock transformer:
`experiments/own_data/`), differentially private artifacts (`experiments/dp/`), and clients that lie about
their class counts (`fuse --robust` caps count claims and leaves out a client unlike the others:
`experiments/pool_robustness/`).
"""


def render() -> str:
    lines = [HEAD, "| situation | method | α = 0.1 | α = 0.2 | α = 0.4 | networks served | server s | setting and source |",
             "|---|---|---|---|---|---|---|---|"]
    table = rows()
    for r in table:
        cells = [r.cells[a].text() if a in r.cells else "—" for a in ALPHAS]
        lines.append(f"| {r.situation} | {r.command} | {' | '.join(cells)} | {r.networks} | {r.seconds()} | {r.source} |")
    number = {r.key: i + 1 for i, r in enumerate(table) if r.key}
    keyed = {r.key: r.cells for r in table if r.key}
    default, paper = keyed["fedbens-default"], keyed["fedbens-paper"]
    gap = ", ".join(f"{default[a].accuracy - paper[a].accuracy:+.2f} points at α = {a}".replace("-", "−")
                    for a in ALPHAS if a in default and a in paper)
    return "\n".join(lines) + "\n" + TAIL.format(gap=gap, default=number["fedbens-default"],
                                                     paper=number["fedbens-paper"], distilled=number["distilled"],
                                                     data_free=number["data-free"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="exit 1 if docs/choosing.md differs from what is generated")
    args = ap.parse_args()
    text = render()
    if args.check:
        same = PAGE.exists() and PAGE.read_text() == text
        print("docs/choosing.md is up to date" if same else "docs/choosing.md differs: run experiments/choosing.py")
        sys.exit(0 if same else 1)
    PAGE.write_text(text)
    print(f"wrote {PAGE.relative_to(ROOT)}")

if __name__ == "__main__":
    main()
