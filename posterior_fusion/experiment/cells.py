"""The shared command line of the studies that read a grid's cached cells
(``diag_full_gap.py``, ``ensemble_question.py``): ``--config --work --alpha --out --threads --seeds``."""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

import torch

from posterior_fusion.experiment import ExperimentConfig


def study_arguments(doc: str | None) -> tuple[argparse.Namespace, ExperimentConfig, Path, Path]:
    """Parse the command line; returns ``(args, grid config, work folder, output folder)`` with the
    output folder created and torch limited to ``--threads``."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="the grid's TOML config")
    ap.add_argument("--work", required=True, help="the grid's work folder (its cache)")
    ap.add_argument("--alpha", type=float, default=0.1, help="Dirichlet α of the cells studied [default: 0.1]")
    ap.add_argument("--out", required=True, help="output folder (results.json, results.md)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads [default: 1]")
    ap.add_argument("--seeds", default=None,
                    help="comma-separated seeds to study, e.g. 0,1 (cells not in the cache are fitted first) "
                         "[default: the config's seeds]")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = ExperimentConfig.from_toml(args.config)
    if args.seeds is not None:
        cfg = replace(cfg, seeds=[int(v) for v in args.seeds.split(",")])
    return args, cfg, Path(args.work), out
