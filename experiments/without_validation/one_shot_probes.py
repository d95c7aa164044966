"""One-shot, validation-free levers for fedbens at stationarity, each against the default (EM,
prior centre at the clients, server prior from the evidence) on a ``pfuse demo`` folder; none of them is a library
setting — this script builds each from the library's parts:

- ``perblock``: the server prior's precision chosen by the evidence for every curvature block on its own (MacKay's
  fixed point per block, λ0_j = γ_j / Σ_k ‖w*_kj − μ_kj‖²: laplace-torch's per-layer prior precision) instead of one
  scale ρ over the blocks' curvature (λ0_j = ρ c_j);
- ``median-centre``: the over-counted prior divided out at the element-wise median of the clients' MAPs (where the
  paper's Adam starts) instead of their λ-weighted mean;
- ``logit-damping``: each client's K-FAC GGN with its logit Hessian damped, ``H + εI`` — ``Kron(B_H + ε B_I, A)``,
  ``B_I`` the output factor of JᵀJ (``fast_kron(ggn="jacobian")`` on the client's own data, at each component's
  MAP; the input factor is the same) — a functional anchor to each client's predictions on its data;
- ``loco``: the scale ρ chosen by leaving one client out (the others' modes scored by the held-out client's own
  Gaussian), from a grid (``--rhos``); each ρ of the grid is also scored on the test set (``rho-grid``: only that);
- ``rho-mixture``: the modes at several multiples of the evidence's ρ (``--factors``) as one ensemble;
- ``agreement``: ρ chosen with unlabelled server inputs (the server split's images without their labels): the
  modes' prediction closest to the client ensemble's (cross-entropy), from the grid ``--rhos``;
- ``adam-oracle``: not a lever but the ceiling of the paper's own protocol — its Adam path with the test set in
  place of the 500 validation images, every 10 steps (the iterate per mode with the best test accuracy).

    OMP_NUM_THREADS=1 nice -n 10 .venv/bin/python experiments/without_validation/one_shot_probes.py runs/s25/a0.1_s1 --probe perblock \\
        >> docs/results/without_validation/probes_s26/probes.jsonl

One JSON line per folder and probe: test accuracy, NLL, ECE (``map`` predictive) of the default and of the probe.

    .venv/bin/python experiments/without_validation/one_shot_probes.py --report docs/results/without_validation/probes_s26/probes.jsonl \\
        [--reference docs/results/without_validation/retemper_s2[56]/*.json]

prints the table (with ``--reference``, ``retemper_without_validation.py``'s JSON per set, also the paper's
best-validation iterate; with ``loco`` / ``rho-grid`` lines, every fixed ρ and the grid's best ρ per set read on the
test set).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

import posterior_fusion
from posterior_fusion.curvature import BlockDiag, Kron
from posterior_fusion.data.silo import read_silo
from posterior_fusion.experiment.measure import paired_difference
from posterior_fusion.fusion import FusionInputs, FusionOptions
from posterior_fusion.fusion.em import MixtureProduct, em_modes
from posterior_fusion.fusion.from_posteriors import fuse_clients
from posterior_fusion.fusion.methods import fedbens as fb
from posterior_fusion.fusion.mode_laplace import evidence_prior_precision, mode_precisions, quadratic_form64
from posterior_fusion.local.capture.fast import fast_kron
from posterior_fusion.metrics import ensemble_probabilities, evaluate_members
from posterior_fusion.models.jacobians import JACOBIAN

STEPS = 300  # EM iterations at most (the default's steps)


def scores(spec, members, test) -> dict:
    m = evaluate_members(spec, list(members), test)
    return {k: m[k] for k in ("accuracy", "nll", "ece")}


def perblock(clients, inputs, record) -> tuple[torch.Tensor, dict]:
    """EM with λ0_j per block by the evidence, from the default's λ0_j, until none moves by 1 %."""
    temps = [inputs.temperature(c) for c in clients]
    lams = [inputs.prior_precision(c) for c in clients]
    W, components = fb.start_rows(inputs, "median", clients[0].num_components)
    centres = fb.client_centres(inputs, components)
    search = record["server_prior_search"]
    lams0 = [search["rounds"][-1]["scale"] * c for c in search["block_scales"]]
    blocks, rounds, moved = len(lams0), 0, math.inf
    while moved >= 0.01 and rounds < 30:
        W, _ = em_modes(MixtureProduct(clients, temps, lams, lams0), W, STEPS, show_progress=False, prior_centres=centres)
        curvatures = mode_precisions(clients, temps, lams, 1.0, W, show_progress=False)[0]
        new = [min(max(evidence_prior_precision(list(W - centres), curvatures,
                                                block_scales=[float(i == j) for i in range(blocks)])[0], 1e-6), 1e8)
               for j in range(blocks)]
        moved = max(abs(math.log(a / b)) for a, b in zip(new, lams0))
        lams0, rounds = new, rounds + 1
    W, _ = em_modes(MixtureProduct(clients, temps, lams, lams0), W, STEPS, show_progress=False, prior_centres=centres)
    return W, {"server_prior_per_block": lams0, "rounds": rounds}


def median_centre(clients, inputs, record) -> tuple[torch.Tensor, dict]:
    """The default's evidence search with the prior divided out at the median starts."""
    temps = [inputs.temperature(c) for c in clients]
    lams = [inputs.prior_precision(c) for c in clients]
    W0, _ = fb.start_rows(inputs, "median", clients[0].num_components)
    settings = fb.FedBEnsSettings(solver="em", server_prior="evidence", prior_centre="clients", laplace=False)
    lams0, W, _, search, _ = fb.evidence_server_prior(clients, temps, lams, inputs.server_prior_precision(), W0,
                                                      W0.clone(), settings, show_progress=False)
    return W, {"server_prior_scale": search["rounds"][-1]["scale"] if search["rounds"] else None}


def fixed_scale_modes(clients, opts, rho: float) -> tuple[torch.Tensor, list[int]]:
    """EM at stationarity, prior centre at the clients, the server prior ``λ0_j = ρ c_j`` (the default's form
    with its scale fixed at ρ; ``c_j`` from these clients): the modes ``(M, d)`` and their component index."""
    inputs = FusionInputs(clients, opts)
    temps = [inputs.temperature(c) for c in clients]
    lams = [inputs.prior_precision(c) for c in clients]
    lams0 = fb.server_prior_blocks(fb.curvature_scales(clients, temps), rho, inputs.server_prior_precision())
    W0, components = fb.start_rows(inputs, "median", clients[0].num_components)
    W, _ = em_modes(MixtureProduct(clients, temps, lams, lams0), W0, STEPS, show_progress=False,
                    prior_centres=fb.client_centres(inputs, components))
    return W, components


def sweep(clients, opts, test, spec, rhos: list[float], criterion=None) -> tuple[dict[float, torch.Tensor], list[dict]]:
    """The modes at each fixed ρ (``{ρ: (M, d)}``) and a row per ρ: its test scores (the oracle curve) and what
    ``criterion(ρ, W)`` (a dict, optional) says of it."""
    modes, rows = {}, []
    for rho in rhos:
        modes[rho], _ = fixed_scale_modes(clients, opts, rho)
        rows.append({"rho": rho, **(criterion(rho, modes[rho]) if criterion else {}), **scores(spec, modes[rho], test)})
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return modes, rows


def loco(clients, opts, test, spec, rhos: list[float]) -> tuple[torch.Tensor, dict]:
    """The server prior's scale ρ chosen by leaving one client out, from the artifacts alone: for each ρ and
    client c, the modes of the other C − 1 clients, scored by client c's own Gaussian (its posterior precision
    ``Λ_cm`` at its MAP ``ŵ_cm``): ``Σ_c Σ_m ½ (w*_{−c,m} − ŵ_cm)ᵀ Λ_cm (w*_{−c,m} − ŵ_cm)`` per sample of the
    held-out client (the smallest wins)."""
    inputs = FusionInputs(clients, opts)

    def held_out(rho: float, _W) -> dict:
        nats = []
        for c, client in enumerate(clients):
            W, components = fixed_scale_modes([o for i, o in enumerate(clients) if i != c], opts, rho)
            t, lam = inputs.temperature(client), inputs.prior_precision(client)
            q = sum(float(quadratic_form64(client.components[m].curvature.precision(t, lam),
                                           W[k].double() - client.components[m].map.double()))
                    for k, m in enumerate(components))
            nats.append(0.5 * q / client.n_data)
        return {"held_out_nats": nats, "loco": sum(nats)}

    modes, rows = sweep(clients, opts, test, spec, rhos, held_out)
    best = min(rows, key=lambda r: r["loco"])
    return modes[best["rho"]], {"rho_chosen": best["rho"], "per_rho": rows}


def rho_mixture(clients, opts, rho: float, factors: list[float]) -> tuple[torch.Tensor, dict]:
    """The predictive averaged over the server prior's strength instead of one ρ: the M modes at each
    ``ρ · f`` (``f`` in ``factors``, around the evidence's ρ) as one equally weighted ensemble ``(M·F, d)``."""
    return torch.cat([fixed_scale_modes(clients, opts, rho * f)[0] for f in factors]), {"rhos": [rho * f for f in factors]}


def agreement(clients, opts, test, spec, x: torch.Tensor, rhos: list[float]) -> tuple[torch.Tensor, dict]:
    """ρ chosen with unlabelled server inputs ``x`` ``(n, ...)`` (no labels: FedBE's assumption, weaker than
    validation data): the ρ whose modes' mean prediction has the smallest cross-entropy against the client
    ensemble's (every client component's MAP, softmax-averaged) — the distillation loss. The ρ with the highest
    top-1 agreement is recorded beside it."""
    ens, _ = ensemble_probabilities(spec, [comp.map for c in clients for comp in c.components], x)

    def against_ensemble(_rho: float, W) -> dict:
        p, _ = ensemble_probabilities(spec, W, x)
        return {"soft_ce": float(-(ens * p.clamp_min(1e-12).log()).sum(1).mean()),
                "agreement": float((p.argmax(1) == ens.argmax(1)).float().mean())}

    modes, rows = sweep(clients, opts, test, spec, rhos, against_ensemble)
    best = min(rows, key=lambda r: r["soft_ce"])
    top1 = max(rows, key=lambda r: (r["agreement"], -r["soft_ce"]))
    return modes[best["rho"]], {"rho_chosen": best["rho"], "rho_by_agreement": top1["rho"],
                                "by_agreement": {k: top1[k] for k in ("accuracy", "nll", "ece")}, "per_rho": rows}


def logit_damped(folder: Path, clients) -> list[torch.Tensor]:
    """Per client and component, the K-FAC output factors B_I of JᵀJ on the client's data at the component's MAP."""
    out = []
    for c, client in enumerate(clients):
        x, y = read_silo(folder / "data" / f"client_{c}.h5").tensors()
        per = []
        for comp in client.components:
            model = client.model_spec.build()
            torch.nn.utils.vector_to_parameters(comp.map.float(), model.parameters())
            model.eval()
            per.append([b.B for b in fast_kron(model, x, y, batch_size=256, ggn=JACOBIAN).blocks])
        out.append(per)
    return out


def with_logit_damping(clients, factors, eps: float):
    return [dataclasses.replace(client, components=tuple(
        dataclasses.replace(comp, curvature=BlockDiag([Kron(b.B + eps * bi.to(b.B.dtype), b.A, b.scale, b.shift)
                                                       for b, bi in zip(comp.curvature.blocks, per)]))
        for comp, per in zip(client.components, parts))) for client, parts in zip(clients, factors)]


PAPER = "adam, best validation iterate, clients' T"  # the reference row of retemper_without_validation.py's JSON


def report(path: str, references: list[str]) -> None:
    """Markdown: per probe (and ε) and α, the default's and the probe's mean accuracy, the paired difference ± its
    standard error, the sets where the probe is ahead, and the mean NLL / ECE of both; once per set, every fixed ρ
    of its ``loco`` / ``rho-grid`` / ``agreement`` lines together and their best ρ read on the test set (an oracle); ``references``
    (``retemper_without_validation.py`` JSON files, named by set) add the paper's best-validation iterate."""
    paper = {Path(f).stem: next(x for x in json.loads(Path(f).read_text())["rows"] if x["label"] == PAPER)
             for f in references}
    lines = [json.loads(line) for line in Path(path).read_text().splitlines()]
    grid: dict[str, dict[float, dict]] = {}  # per set, every fixed ρ of its loco / rho-grid lines
    for r in lines:
        grid.setdefault(r["set"], {}).update({x["rho"]: x for x in r.get("per_rho", [])})
    rows: dict[tuple[str, str], list[tuple[dict, dict]]] = {}
    done: set[str] = set()  # sets whose ρ grid and reference rows are in
    for r in lines:
        alpha = r["set"].split("_")[0][1:]
        probes = ([] if r["probe"] == "rho-grid" else [(r["probe"], r["probe_scores"])] if "probe_scores" in r
                  else [(f"{r['probe']} ε = {x['eps']:g}", x) for x in r["rows"]])
        if "by_agreement" in r:
            probes.append(("agreement by top-1 instead of cross-entropy", r["by_agreement"]))
        if r["set"] not in done:
            done.add(r["set"])
            rhos = grid[r["set"]]
            probes += [(f"fixed ρ = {rho:g}", rhos[rho]) for rho in sorted(rhos)]
            if rhos:
                probes.append(("best ρ of the grid per set, read on the test set (oracle)",
                               max(rhos.values(), key=lambda x: x["accuracy"])))
            if r["set"] in paper:
                probes.append(("the paper: Adam, best validation iterate (validation data)", paper[r["set"]]))
        for name, got in probes:
            rows.setdefault((name, alpha), []).append((r["default"], got))
    print("| probe | α | sets | default accuracy % | probe accuracy % | difference ± s.e. | probe ahead | NLL / ECE default | NLL / ECE probe |")
    print("|---|---|---|---|---|---|---|---|---|")
    for (name, alpha), pairs in rows.items():
        diff = [100 * (g["accuracy"] - d["accuracy"]) for d, g in pairs]
        mean = {(k, i): statistics.mean(pair[i][k] for pair in pairs) for k in ("accuracy", "nll", "ece") for i in (0, 1)}
        print(f"| {name} | {alpha} | {len(pairs)} | {100 * mean['accuracy', 0]:.2f} | {100 * mean['accuracy', 1]:.2f} | "
              f"{paired_difference(diff)} | {sum(x > 0 for x in diff)} | {mean['nll', 0]:.3f} / "
              f"{mean['ece', 0]:.3f} | {mean['nll', 1]:.3f} / {mean['ece', 1]:.3f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder", help="a pfuse demo folder (post_*.h5, data/client_*.h5, data/test.h5); with --report, "
                                   "a JSON-lines file of this script")
    ap.add_argument("--probe", choices=("perblock", "median-centre", "logit-damping", "loco", "rho-grid", "rho-mixture",
                                        "adam-oracle", "agreement"), help="the lever to measure")
    ap.add_argument("--report", action="store_true", help="print the summary table of the given JSON-lines file")
    ap.add_argument("--reference", nargs="*", default=[],
                    help="with --report: retemper_without_validation.py JSON files (SET.json) whose best-validation "
                         "row joins the table [default: none]")
    ap.add_argument("--rhos", default="0.03,0.1,0.2,0.3,0.5,1,2",
                    help="loco, rho-grid, agreement: the server prior scales ρ (λ0_j = ρ c_j) [default: %(default)s]")
    ap.add_argument("--factors", default="0.333,1,3",
                    help="rho-mixture: multiples of the evidence's ρ whose modes join the ensemble [default: %(default)s]")
    ap.add_argument("--eps", default="0.0001,0.001,0.01,0.1,1", help="logit-damping: the ε to try [default: %(default)s]")
    args = ap.parse_args()
    if args.report:
        report(args.folder, args.reference)
        return
    if args.probe is None:
        ap.error("--probe is required (or --report)")
    folder = Path(args.folder)
    test = read_silo(folder / "data" / "test.h5")
    clients = [posterior_fusion.load(p) for p in sorted(folder.glob("post_*.h5"))]
    opts = FusionOptions(progress=False)
    inputs, result, record = fuse_clients(clients, "fedbens", opts, {"laplace": False})
    row = {"set": folder.name, "probe": args.probe, "default": scores(inputs.spec, result.members, test)}
    rho_default = record["server_prior_search"]["rounds"][-1]["scale"]  # the evidence's ρ
    rhos = [float(r) for r in args.rhos.split(",")]
    t0 = time.perf_counter()
    W, extra = None, {}
    if args.probe == "logit-damping":
        factors = logit_damped(folder, clients)
        row["rows"] = []
        for eps in (float(e) for e in args.eps.split(",")):
            i, r, _ = fuse_clients(with_logit_damping(clients, factors, eps), "fedbens", opts, {"laplace": False})
            row["rows"].append({"eps": eps, **scores(i.spec, r.members, test)})
    elif args.probe == "rho-grid":
        extra = {"per_rho": sweep(clients, opts, test, inputs.spec, rhos)[1], "rho_default": rho_default}
    elif args.probe == "loco":
        W, extra = loco(clients, opts, test, inputs.spec, rhos)
        extra["rho_default"] = rho_default
    elif args.probe == "agreement":
        x = read_silo(folder / "data" / "server_val.h5").tensors()[0]  # inputs only: the labels are not read
        W, extra = agreement(clients, opts, test, inputs.spec, x, rhos)
        extra["rho_default"] = rho_default
    elif args.probe == "adam-oracle":
        _, r, _ = fuse_clients(clients, "fedbens", opts, {"solver": "adam", "val_every": 10, "laplace": False},
                               val=test)
        W = torch.stack(list(r.members))
    elif args.probe == "rho-mixture":
        W, extra = rho_mixture(clients, opts, rho_default, [float(f) for f in args.factors.split(",")])
    else:
        W, extra = (perblock if args.probe == "perblock" else median_centre)(clients, FusionInputs(clients, opts), record)
    if W is not None:
        row["probe_scores"] = scores(inputs.spec, W, test)
    row.update(extra)
    row["seconds"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
