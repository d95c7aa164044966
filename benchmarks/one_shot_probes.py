"""Three more one-shot, validation-free levers for fedbens at stationarity (issue 29, item 2), each against the
default (EM, prior centre at the clients, server prior from the evidence) on a ``pfuse demo`` folder; none of them
is a library setting — this script builds each from the library's parts:

- ``perblock``: the server prior's precision chosen by the evidence for every curvature block on its own (MacKay's
  fixed point per block, λ0_j = γ_j / Σ_k ‖w*_kj − μ_kj‖²: laplace-torch's per-layer prior precision) instead of one
  scale ρ over the blocks' curvature (λ0_j = ρ c_j);
- ``median-centre``: the over-counted prior divided out at the element-wise median of the clients' MAPs (where the
  paper's Adam starts) instead of their λ-weighted mean;
- ``logit-damping``: each client's K-FAC GGN with its logit Hessian damped, ``H + εI`` — ``Kron(B_H + ε B_I, A)``,
  ``B_I`` the output factor of JᵀJ (``fast_kron(ggn="jacobian")`` on the client's own data, at each component's
  MAP; the input factor is the same) — a functional anchor to each client's predictions on its data.

    OMP_NUM_THREADS=1 nice -n 10 .venv/bin/python benchmarks/one_shot_probes.py /tmp/s25/a0.1_s1 --probe perblock \\
        >> docs/results/fusion_safety/probes_s26/probes.jsonl

One JSON line per folder and probe: test accuracy, NLL, ECE (``map`` predictive) of the default and of the probe.

    .venv/bin/python benchmarks/one_shot_probes.py --report docs/results/fusion_safety/probes_s26/probes.jsonl
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import time
from pathlib import Path

import torch
from measured import paired_difference

import posterior_fusion
from posterior_fusion.curvature import BlockDiag, Kron
from posterior_fusion.data.silo import read_silo
from posterior_fusion.fusion import FusionInputs, FusionOptions
from posterior_fusion.fusion.em import MixtureProduct, em_modes
from posterior_fusion.fusion.from_posteriors import fuse_clients
from posterior_fusion.fusion.methods import fedbens as fb
from posterior_fusion.fusion.mode_laplace import evidence_prior_precision, mode_precisions
from posterior_fusion.local.fastcapture import JACOBIAN, fast_kron
from posterior_fusion.metrics import evaluate_members

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


def report(path: str) -> None:
    """Markdown: per probe (and ε) and α, the default's and the probe's mean accuracy, the paired difference ± its
    standard error, the sets where the probe is ahead, and the mean NLL / ECE of both."""
    rows: dict[tuple[str, str], list[tuple[dict, dict]]] = {}
    for line in Path(path).read_text().splitlines():
        r = json.loads(line)
        alpha = r["set"].split("_")[0][1:]
        probes = ([(r["probe"], r["probe_scores"])] if "probe_scores" in r
                  else [(f"{r['probe']} ε = {x['eps']:g}", x) for x in r["rows"]])
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
    ap.add_argument("--probe", choices=("perblock", "median-centre", "logit-damping"), help="the lever to measure")
    ap.add_argument("--report", action="store_true", help="print the summary table of the given JSON-lines file")
    ap.add_argument("--eps", default="0.0001,0.001,0.01,0.1,1", help="logit-damping: the ε to try [default: %(default)s]")
    args = ap.parse_args()
    if args.report:
        report(args.folder)
        return
    if args.probe is None:
        ap.error("--probe is required (or --report)")
    folder = Path(args.folder)
    test = read_silo(folder / "data" / "test.h5")
    clients = [posterior_fusion.load(p) for p in sorted(folder.glob("post_*.h5"))]
    opts = FusionOptions(progress=False)
    inputs, result, record = fuse_clients(clients, "fedbens", opts, {"laplace": False})
    row = {"set": folder.name, "probe": args.probe, "default": scores(inputs.spec, result.members, test)}
    t0 = time.perf_counter()
    if args.probe == "logit-damping":
        factors = logit_damped(folder, clients)
        row["rows"] = []
        for eps in (float(e) for e in args.eps.split(",")):
            i, r, _ = fuse_clients(with_logit_damping(clients, factors, eps), "fedbens", opts, {"laplace": False})
            row["rows"].append({"eps": eps, **scores(i.spec, r.members, test)})
    else:
        W, extra = (perblock if args.probe == "perblock" else median_centre)(clients, FusionInputs(clients, opts), record)
        row.update({"probe_scores": scores(inputs.spec, W, test), **extra})
    row["seconds"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
