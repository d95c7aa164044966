"""Issue 29, item 1 (a first cut): what happens along fedbens' optimisation path. For Adam stopped
after 0 … 1,000 steps (no validation selection), the EM stationary point and damped EM: test
accuracy and NLL, the objective, and per client whether its Laplace approximation still holds at
the fused mode — the per-sample NLL increase on the client's own data that its quadratic predicts,
½ (w − ŵ)ᵀ G (w − ŵ) / n (its GGN at its MAP, untempered, the nearest of its components), against the
increase actually measured on its data — and how far each layer moved from the start. With
``--exact-ggn`` also the same quadratic with the exact GGN at the client's MAP instead of its K-FAC,
½ Σ_i (J_i v)ᵀ (diag p_i − p_i p_iᵀ)(J_i v) / n with v = w − ŵ (Jacobian–vector products over the
client's data, no matrix formed): whether the misprediction is K-FAC's error or the quadratic's.

    nice -n 5 .venv/bin/python benchmarks/fusion_path.py --clients DIR --json OUT.json

DIR holds ``post_*.h5`` fitted on ``client_*.h5`` (same index), and ``test.h5``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from measured import save_rows

from posterior_fusion.artifact import load_client
from posterior_fusion.data.silo import read_silo
from posterior_fusion.fusion import FusionOptions, fuse_clients
from posterior_fusion.fusion.methods.fedbens import GlobalLogPosterior
from posterior_fusion.metrics import evaluate_members

VARIANTS = [(f"adam {s} steps", {"steps": s, "laplace": False, "solver": "adam"}) for s in (0, 30, 100, 300, 1000)]
VARIANTS += [("em (stationary)", {"solver": "em", "laplace": False}),
             ("em, damping 1", {"solver": "em", "damping": 1.0, "laplace": False})]


def exact_ggn_quadratic(spec, w_map: torch.Tensor, v: torch.Tensor, x: torch.Tensor, batch: int = 1024) -> float:
    """``vᵀ G v`` with G the exact GGN of the summed cross-entropy at ``w_map`` on inputs ``x``, from
    Jacobian–vector products (float32 forward, float64 sums)."""
    from torch.func import functional_call, jvp

    model = spec.build().eval()
    names = [n for n, _ in model.named_parameters()]
    shapes = [p.shape for _, p in model.named_parameters()]

    def unflat(flat):
        out, i = {}, 0
        for n, sh in zip(names, shapes):
            out[n] = flat[i : i + sh.numel()].reshape(sh)
            i += sh.numel()
        return out

    total = 0.0
    for i in range(0, x.shape[0], batch):
        xb = x[i : i + batch]
        logits, jv = jvp(lambda f, xb=xb: functional_call(model, unflat(f), (xb,)), (w_map.float(),), (v.float(),))
        p = torch.softmax(logits.double(), -1)
        jv = jv.double()
        total += float((p * jv.square()).sum() - ((p * jv).sum(-1)).square().sum())
    return total


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", required=True)
    ap.add_argument("--json", default=None)
    ap.add_argument("--exact-ggn", action="store_true", help="also the exact-GGN quadratic (module docstring)")
    args = ap.parse_args()
    folder = Path(args.clients)
    paths = sorted(folder.glob("post_*.h5"))
    clients = [load_client(p) for p in paths]
    silos = [read_silo(folder / p.name.replace("post_", "client_")) for p in paths]
    test = read_silo(folder / "test.h5")
    spec = clients[0].model_spec
    layout = clients[0].layout
    objective_of = GlobalLogPosterior(clients, [c.temperature for c in clients], [c.prior_precision for c in clients],
                                      sorted(c.prior_precision for c in clients)[len(clients) // 2], show_progress=False)
    own = [[evaluate_members(spec, [comp.map.float()], s)["nll"] for comp in c.components] for c, s in zip(clients, silos)]
    rows = []
    start = None
    for label, settings in VARIANTS:
        _, res, meta = fuse_clients(clients, "fedbens", FusionOptions(progress=False), settings)
        modes = res.members
        if start is None:
            start = modes
        m = evaluate_members(spec, modes, test)
        per_client = []
        for c, s, nll0 in zip(clients, silos, own):
            predicted, actual, exact = [], [], []
            for w in modes:  # each mode against the client's nearest component (its own quadratic)
                q = [0.5 * float(comp.curvature.quadratic_form((w.double() - comp.map.double()).to(comp.curvature.dtype)))
                     / c.n_data for comp in c.components]
                k = min(range(len(q)), key=q.__getitem__)
                predicted.append(q[k])
                actual.append(evaluate_members(spec, [w], s)["nll"] - nll0[k])
                if args.exact_ggn:
                    comp = c.components[k]
                    exact.append(0.5 * exact_ggn_quadratic(spec, comp.map, w - comp.map, s.tensors()[0]) / c.n_data)
            per_client.append({"n": c.n_data, "predicted_nll_increase": sum(predicted) / len(predicted),
                               "actual_nll_increase": sum(actual) / len(actual)})
            if args.exact_ggn:
                per_client[-1]["exact_ggn_predicted_nll_increase"] = sum(exact) / len(exact)
        moved = {}
        for e in layout.entries:
            sl = slice(e.offset, e.offset + e.size)
            moved[e.name] = sum(float((w[sl] - w0[sl]).norm() / w0[sl].norm().clamp_min(1e-12))
                                for w, w0 in zip(modes, start)) / len(modes)
        objective = objective_of(torch.stack(modes)).tolist()  # the (undamped) fedbens objective, one scale for all
        rows.append({"variant": label, "accuracy": m["accuracy"], "nll": m["nll"], "ece": m["ece"],
                     "objective": objective, "clients": per_client, "relative_move_per_layer": moved})
        print(json.dumps({k: rows[-1][k] for k in ("variant", "accuracy", "nll", "objective")}), flush=True)
    save_rows(args.json, {"clients": [str(p) for p in paths], "rows": rows})


if __name__ == "__main__":
    main()
