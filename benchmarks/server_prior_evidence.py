"""Issue 29, item 2: the strength of fedbens' pull to the clients' average, chosen without data.

With ``prior_centre=clients`` the over-counted prior is divided out at each mode's client average μ_m,
and what is left of the prior is the server's ``N(μ_m, λ_s⁻¹ I)``: λ_s is how hard the stationary
point is pulled to the clients' average (the clients' own λ_c stay as captured). This script solves
fedbens' EM to stationarity at each λ_s of a grid and reports test and validation accuracy beside the
Laplace evidence of the server's model at that λ_s,

    log Z(λ_s) ≈ log Σ_k exp(−U_λs(w*_k) + d/2 log 2π − ½ log|H_k + λ_s I|) − log K,

(U the objective with its normalising constants, H_k the raw curvature at mode k): the clients'
likelihoods q_c / p0_c are held fixed, so Z is a marginal likelihood in λ_s and its maximiser is
MacKay's empirical-Bayes choice, made from the artifacts alone.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/server_prior_evidence.py --clients DIR --json OUT.json

Rows: the paper's fedbens (Adam, best validation iterate), fedbens ``server_prior=evidence`` (one λ0 per
block, ``ρ c_j``, ρ from the evidence), then EM at each one-λ0 of ``--lams``. ``--evidence-only``: the first
two; ``--rhos``: EM at fixed ρ instead (what validation data could choose from); ``--per-block``: also one
independent MacKay λ0 per block (tried, not kept). Results: ``docs/results/fusion_safety/`` ("The server prior
from the evidence").
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
from measured import save_rows

from posterior_fusion.artifact import load_client
from posterior_fusion.curvature import BlockDiag
from posterior_fusion.data.silo import read_silo
from posterior_fusion.fusion import FusionOptions, fuse
from posterior_fusion.fusion import types as fusion_types
from posterior_fusion.fusion.em import MixtureProduct, em_modes
from posterior_fusion.fusion.methods.fedbens import client_centres, curvature_scales, start_rows
from posterior_fusion.fusion.mode_laplace import evidence_prior_precision, mode_precisions
from posterior_fusion.fusion.types import FusionInputs
from posterior_fusion.metrics import evaluate_members
from posterior_fusion.mixture import LOG_2PI


def log_evidence(result) -> float:
    """The Laplace evidence of the fused modes (log-mean-exp over modes)."""
    lam = result.info["laplace"]["server_prior_precision"]
    values = torch.tensor(result.info["laplace"]["objective_at_modes"], dtype=torch.float64)
    terms = []
    for v, curv in zip(values, result.curvatures):
        prec = curv.precision(1.0, lam)
        d = prec.dim
        terms.append(-v + 0.5 * d * LOG_2PI - 0.5 * prec.logdet().double())
    t = torch.stack(terms)
    return float(torch.logsumexp(t, 0) - math.log(len(terms)))


def per_block_search(paths, folder, test, val, rounds: int = 30) -> dict:
    """EM (prior centre clients) with one server λ per block, each the per-block MacKay fixed point."""
    inputs = FusionInputs([load_client(p) for p in paths], FusionOptions(progress=False))
    clients = inputs.clients
    temps = [inputs.temperature(c) for c in clients]
    lams = [inputs.prior_precision(c) for c in clients]
    modes = clients[0].num_components
    W, comps = start_rows(inputs, "median", modes)
    centres = client_centres(inputs, comps)
    nblocks = len(clients[0].components[0].curvature.blocks)
    lam_blocks = [inputs.server_prior_precision()] * nblocks
    t0 = time.time()
    for r in range(rounds):
        W, _ = em_modes(MixtureProduct(clients, temps, lams, lam_blocks), W, 300, show_progress=False,
                        prior_centres=centres)
        curv, _ = mode_precisions(clients, temps, lams, 1.0, W, show_progress=False)
        offsets = W - centres
        nxt = []
        for j, (off, blk) in enumerate(zip(curv[0].offsets, curv[0].blocks)):
            sub = [BlockDiag([c.blocks[j]]) for c in curv]
            nxt.append(evidence_prior_precision([o[off: off + blk.dim] for o in offsets], sub)[0])
        change = max(abs(math.log(a / b)) for a, b in zip(nxt, lam_blocks))
        print(f"round {r}: λ_b {[round(x, 1) for x in nxt]} change {change:.3f}", flush=True)
        lam_blocks = nxt
        if change < 0.01:
            break
    seconds = time.time() - t0
    m = evaluate_members(inputs.spec, list(W), test)
    mv = evaluate_members(inputs.spec, list(W), val)
    return {"variant": "em, prior centre clients, server λ per block (evidence)", "server_prior_precision": lam_blocks,
            "accuracy": m["accuracy"], "nll": m["nll"], "ece": m["ece"], "val_accuracy": mv["accuracy"],
            "val_nll": mv["nll"], "rounds": r + 1, "server_seconds": round(seconds, 1)}


def rho_sweep(paths, test, val, rhos: list[float]) -> list[dict]:
    """EM (prior centre clients) at fixed ρ, λ0_j = ρ c_j (the library's block scales): what a server with
    validation data could choose ρ from (test and validation accuracy side by side)."""
    inputs = FusionInputs([load_client(p) for p in paths], FusionOptions(progress=False))
    clients = inputs.clients
    temps = [inputs.temperature(c) for c in clients]
    lams = [inputs.prior_precision(c) for c in clients]
    W0, comps = start_rows(inputs, "median", clients[0].num_components)
    centres = client_centres(inputs, comps)
    scales = curvature_scales(clients, temps)
    out = []
    for rho in rhos:
        t0 = time.time()
        W, _ = em_modes(MixtureProduct(clients, temps, lams, [rho * c for c in scales]), W0, 300, show_progress=False,
                        prior_centres=centres)
        seconds = time.time() - t0
        m, mv = evaluate_members(inputs.spec, list(W), test), evaluate_members(inputs.spec, list(W), val)
        out.append({"variant": f"em, prior centre clients, server λ0 per block, fixed ρ {rho:g}", "rho": rho,
                    "accuracy": m["accuracy"], "nll": m["nll"], "ece": m["ece"], "val_accuracy": mv["accuracy"],
                    "val_nll": mv["nll"], "server_seconds": round(seconds, 1)})
        print(json.dumps(out[-1]), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", required=True)
    ap.add_argument("--lams", default="10,30,100,300,1000,3000,10000")
    ap.add_argument("--json", default=None)
    ap.add_argument("--per-block", action="store_true", help="also one server λ per block (MacKay per block)")
    ap.add_argument("--evidence-only", action="store_true", help="only the paper's row and server_prior=evidence")
    ap.add_argument("--no-paper", action="store_true", help="leave the paper's row out")
    ap.add_argument("--no-evidence", action="store_true", help="leave the server_prior=evidence row out")
    ap.add_argument("--rhos", default="", help="only EM at these fixed ρ (λ0 per block = ρ × block scale)")
    args = ap.parse_args()
    folder = Path(args.clients)
    paths = sorted(folder.glob("post_*.h5"))
    test, val = read_silo(folder / "test.h5"), read_silo(folder / "server_val.h5")
    rows = []
    if args.rhos:
        rows = rho_sweep(paths, test, val, [float(x) for x in args.rhos.split(",")])
        save_rows(args.json, {"clients": [str(p) for p in paths], "rows": rows})
        return
    original = fusion_types.FusionInputs.server_prior_precision

    def run(label, settings, lam=None, use_val=False):
        if lam is not None:  # the server's λ0 alone (--prior-var would change the clients' λ_c as well)
            fusion_types.FusionInputs.server_prior_precision = lambda self: lam
        try:
            t0 = time.time()
            inputs, result, _ = fuse(paths, "fedbens", FusionOptions(progress=False), settings,
                                     val_path=folder / "server_val.h5" if use_val else None)
            seconds = time.time() - t0
        finally:
            fusion_types.FusionInputs.server_prior_precision = original
        m = evaluate_members(inputs.spec, result.members, test)
        mv = evaluate_members(inputs.spec, result.members, val)
        row = {"variant": label, "server_prior_precision": result.info["laplace"]["server_prior_precision"],
               "server_prior_search": result.info.get("server_prior_search"),
               "settings": settings, "validation": use_val, "accuracy": m["accuracy"], "nll": m["nll"],
               "ece": m["ece"], "val_accuracy": mv["accuracy"], "val_nll": mv["nll"],
               "log_evidence": log_evidence(result), "server_seconds": round(seconds, 1)}
        rows.append(row)
        print(json.dumps(row), flush=True)

    if not args.no_paper:
        run("paper: adam, best validation iterate", {}, use_val=True)
    em = {"solver": "em", "prior_centre": "clients"}
    if not args.no_evidence:
        run("em, prior centre clients, server prior evidence, λ0 per block", {**em, "server_prior": "evidence"})
    if args.per_block:
        rows.append(per_block_search(paths, folder, test, val))
        print(json.dumps(rows[-1]), flush=True)
    if args.evidence_only:
        save_rows(args.json, {"clients": [str(p) for p in paths], "rows": rows})
        return
    for lam in [float(x) for x in args.lams.split(",")]:
        run(f"em, prior centre clients, server λ {lam:g}", em, lam)
    save_rows(args.json, {"clients": [str(p) for p in paths], "rows": rows})


if __name__ == "__main__":
    main()
