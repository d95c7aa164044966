"""The refresh round's damping d swept without recapturing (issue 29). A refreshed component holds the
curvature G at the global member w* and the centre ŵ_s = w* − Λ_s⁻¹ r of its recorded damping s (1 where none is recorded), with
r = g/T + λ w* and Λ_d = damped(G, n, d)/T + λ I (``local/recapture.py``). Neither G nor r depends on d,
so r = Λ_s (w* − ŵ_s) and every other centre is ŵ_d = w* − Λ_d⁻¹ r: a damping sweep costs solves, not
captures. w* is recomputed by fusing the one-shot clients as the refresh did (the paper's protocol,
deterministic); the recovered centres are checked against the stored ones.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/refresh_damping_sweep.py --clients DIR \
        --refreshed 'DIR/refresh/at_paper_d1.0_post_*.h5' --dampings 0.3,3,10,30 --json OUT.json

DIR as for ``refresh_round.py``. Each d: fedbens EM at stationarity (no validation) on the re-centred
artifacts; test accuracy, NLL, ECE. ``--set KEY=VALUE`` (repeatable) adds fedbens settings to that
fusion, e.g. ``--set prior_centre=clients``; ``--at-set`` names the fedbens settings the refreshed artifacts were
taken at (then without validation data; default the paper's modes).

``--ratios``: also each d's Levenberg–Marquardt gain ratio per component (``local/recapture.py``
``step_ratio``: the silo's loss at w* and at the centre, one forward pass each, silos DIR/client_K.h5)
and a row ``auto``: each component re-centred as ``recapture --damping auto`` would (``refresh_centre``,
the smallest d of ``AUTO_DAMPINGS`` whose ratio reaches ``RATIO_FLOOR``), then fused like the others.
"""

from __future__ import annotations

import argparse
import glob
import json
import time
from dataclasses import replace
from pathlib import Path

import torch
from measured import save_rows

from posterior_fusion.artifact import write_client_artifact
from posterior_fusion.artifact.reader import load_client, load_global
from posterior_fusion.data.silo import read_silo
from posterior_fusion.fusion import FusionOptions, fuse
from posterior_fusion.local.recapture import refresh_centre, silo_loss, step_ratio
from posterior_fusion.metrics import evaluate_members
from posterior_fusion.posterior import frozen_mapping


def precision(comp, n: int, d: float):
    """Λ_d of a refreshed component, float64."""
    return comp.curvature.astype(torch.float64).damped(n, d).precision(comp.temperature, comp.prior_precision)


def silo_losses(art, silo_path: Path):
    """``w ↦`` the silo's summed cross-entropy (cached per point: the auto row revisits the swept centres)."""
    data = read_silo(silo_path, num_classes=art.model_spec.num_classes)
    if data.sha256() != art.metadata.get("data_sha256"):
        raise SystemExit(f"{silo_path}: is not the silo {art.path} was captured on")
    x, y = data.tensors()
    uncached = silo_loss(art, x, y, int(art.metadata.get("curvature_batch_size", 256)), torch.float32)
    cache: dict[bytes, float] = {}

    def loss(w: torch.Tensor) -> float:
        key = w.float().numpy().tobytes()  # the model is built in float32: equal keys, equal losses
        if key not in cache:
            cache[key] = uncached(w)
        return cache[key]
    return loss


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", required=True)
    ap.add_argument("--refreshed", required=True, help="glob of the d = 1 refreshed artifacts")
    ap.add_argument("--dampings", default="0.3,3,10,30")
    ap.add_argument("--json", default=None)
    ap.add_argument("--set", action="append", default=[], help="KEY=VALUE: a fedbens setting of the swept fusion")
    ap.add_argument("--at-set", action="append", default=[],
                    help="KEY=VALUE: the refreshed artifacts were taken at fedbens with these settings and no "
                         "validation data (default: the paper's modes, Adam with validation)")
    ap.add_argument("--ratios", action="store_true", help="gain ratios per d and the auto row (module docstring)")
    ap.add_argument("--at-global", default=None,
                    help="the global artifact the refreshed artifacts were taken at (its SHA-256 is checked against "
                         "theirs), instead of recomputing it")
    args = ap.parse_args()
    extra = dict(kv.split("=", 1) for kv in args.set)
    at = dict(kv.split("=", 1) for kv in args.at_set)
    folder = Path(args.clients)
    posts = sorted(folder.glob("post_*.h5"))
    refreshed = sorted(glob.glob(args.refreshed))
    test, val = read_silo(folder / "test.h5"), folder / "server_val.h5"
    arts = [load_client(p) for p in refreshed]
    if args.at_global:
        glob_art = load_global(args.at_global)
        if any(a.metadata["refreshed_at"]["file_sha256"] != glob_art.sha256 for a in arts):
            raise SystemExit(f"{args.at_global}: is not the global artifact the refreshed artifacts were taken at")
        members = [w.double() for w in glob_art.members]
    else:
        t0 = time.time()
        _, paper, _ = fuse(posts, "fedbens", FusionOptions(progress=False), at, val_path=None if at else val)
        print(f"the global modes recomputed in {time.time() - t0:.0f}s", flush=True)
        members = [w.double() for w in paper.members]
    residuals, worst = [], 0.0
    for art in arts:
        n = int(art.metadata["n_data"])
        rs = []
        for comp in art.components:
            w = members[int(comp.training["refreshed_at_member"])]
            stored = float(comp.training.get("damping", 1.0))  # recaptures before `auto` recorded none: d = 1
            rs.append(precision(comp, n, stored).matvec(w - comp.map.double()))
            again = w - precision(comp, n, stored).solve(rs[-1])
            worst = max(worst, float((again - comp.map.double()).norm() / comp.map.double().norm()))
        residuals.append(rs)
    print(f"stored centres recovered to {worst:.1e} (relative)", flush=True)
    losses = [silo_losses(art, folder / f"client_{Path(src).stem.split('_')[-1]}.h5") if args.ratios else None
              for art, src in zip(arts, refreshed)]
    rows, work = [], Path(refreshed[0]).parent
    for d in [1.0] + [float(t) for t in args.dampings.split(",")] + (["auto"] if args.ratios else []):
        paths, steps, ratios, chosen = [], [], [], []
        for art, rs, src, loss in zip(arts, residuals, refreshed, losses):
            n = int(art.metadata["n_data"])
            comps = []
            for comp, r in zip(art.components, rs):
                w = members[int(comp.training["refreshed_at_member"])]
                T, lam = comp.temperature, comp.prior_precision
                g = T * (r - lam * w)  # r = g/T + λ w*
                if d == "auto":
                    centre, used, rho = refresh_centre(w, comp.curvature, g, T, lam, n, "auto", loss)
                    chosen.append(used)
                else:
                    centre = w - precision(comp, n, d).solve(r)
                    rho = step_ratio(w, centre, comp.curvature, g, T, lam, loss(w), loss(centre)) if loss else None
                ratios.append(rho)
                steps.append(float((centre - w).norm()))
                record = {k: v for k, v in comp.training.items() if k != "step_ratio"}
                record["damping"] = used if d == "auto" else d  # the record says how this centre was taken
                if rho is not None:
                    record["step_ratio"] = rho
                comps.append(replace(comp, map=centre.to(comp.map.dtype), training=frozen_mapping(record)))
            meta = dict(art.metadata, refreshed_at=dict(art.metadata["refreshed_at"], damping=d))
            paths.append(work / f"sweep_d{d}_{Path(src).name}")
            write_client_artifact(paths[-1], art.model_spec, art.layout, meta, comps)
        t0 = time.time()
        inputs, result, _ = fuse(paths, "fedbens", FusionOptions(progress=False), {"solver": "em", **extra})
        m = evaluate_members(inputs.spec, result.members, test)
        rows.append({"damping": d, "fusion": "em (stationary), no validation", "settings": extra, "accuracy": m["accuracy"],
                     "nll": m["nll"], "ece": m["ece"], "server_seconds": round(time.time() - t0, 1),
                     "centre_step_norm": max(steps)})
        if args.ratios:
            rows[-1].update(step_ratios=[round(x, 4) for x in ratios], min_step_ratio=min(ratios))
        if chosen:
            rows[-1]["chosen_dampings"] = chosen
        print(json.dumps(rows[-1]), flush=True)
    save_rows(args.json, {"clients": str(folder), "refreshed": refreshed, "at_settings": at or "the paper's", "d1_recovery": worst, "rows": rows})


if __name__ == "__main__":
    main()
