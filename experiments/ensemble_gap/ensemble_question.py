"""The ensemble question: the C·M-member client ensemble against fusion at equal or
lower serving cost, on the cached α = 0.1 cells of an experiment grid.

    nice -n 10 .venv/bin/python experiments/ensemble_gap/ensemble_question.py --config benchmarks/table1_seeds12.toml \
        --work runs/table1_seeds12 --alpha 0.1 --out docs/results/ensemble_question

For every cached cell (seed): the client ensemble (C·M members), fedbens with the paper's M
median starts, fedbens started from every client component's MAP (C·M modes) and from both
(M + C·M), fedbens' M modes at each of five temperatures pooled (``TUNE_TEMPERATURES``), each
with the plain-average and the Laplace-weighted mode mixture; test accuracy,
NLL, ECE and serving cost (members × parameters). Writes ``results.json`` and ``results.md``.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import replace

from posterior_fusion.data.silo import read_silo
from posterior_fusion.experiment.cells import study_arguments
from posterior_fusion.experiment.grid import Cell, fit_clients, partition_cell
from posterior_fusion.fusion import FusionOptions, fuse_clients
from posterior_fusion.fusion.tuning import TUNE_TEMPERATURES, tune_fusion
from posterior_fusion.metrics import evaluate_members

VARIANTS = [
    ("ensemble", "ensemble", {}),
    ("fedbens (M median starts)", "fedbens", {"steps": 300}),
    ("fedbens (C·M client starts)", "fedbens", {"steps": 300, "starts": "clients"}),
    ("fedbens (M + C·M starts)", "fedbens", {"steps": 300, "starts": "median+clients"}),
    # T and σ0² chosen on the server's validation split (5 x 3 grid, fuse --tune)
    ("fedbens (T, σ0² tuned on validation)", "fedbens-tuned", {"steps": 300}),
    # M modes at each of the tuning grid's five temperatures, pooled into one equal-weight ensemble
    ("fedbens (M modes at each of 5 temperatures)", "fedbens-temperatures", {"steps": 300}),
]


def main() -> None:
    args, cfg, work, out = study_arguments(__doc__)
    path = out / "results.json"
    rows = json.loads(path.read_text()) if path.exists() else []
    done = {(r["seed"], r["variant"]) for r in rows}
    for seed in cfg.seeds:  # the grid's own cache lookup (it also finds folders written under older keys)
        cell = Cell(args.alpha, cfg.clients[0], seed)
        pkey, summary = partition_cell(cfg, cell, work)
        _, clients = fit_clients(cfg, cell, cfg.structures[0], pkey, summary, work, 1, print)
        val, test = read_silo(summary["server_val"]), read_silo(summary["test"])
        d = clients[0].layout.dim
        for name, method, settings in VARIANTS:
            if (seed, name) in done:
                continue
            t0 = time.perf_counter()
            opts = FusionOptions(progress=False, sampling_seed=seed)
            if method == "fedbens-tuned":
                _, res, meta = tune_fusion(clients, "fedbens", opts, val, ("T", "prior"), settings=settings)
            elif method == "fedbens-temperatures":
                runs = [fuse_clients(clients, "fedbens", replace(opts, temperature=t), settings, val)
                        for t in TUNE_TEMPERATURES]
                meta, res = {}, replace(runs[0][1], members=[w for run in runs for w in run[1].members], curvatures=None)
            else:
                _, res, meta = fuse_clients(clients, method, opts, settings, val)
            fuse_s = time.perf_counter() - t0
            m = evaluate_members(clients[0].model_spec, res.members, test)
            chosen = meta.get("tuning", {}).get("chosen") if method == "fedbens-tuned" else None
            rows.append({"seed": seed, "variant": name, "members": len(res.members), "serving_params": len(res.members) * d,
                         "chosen": chosen,
                         "accuracy": m["accuracy"], "nll": m["nll"], "ece": m["ece"], "fuse_seconds": round(fuse_s, 1)})
            print(f"seed {seed} {name}: acc {m['accuracy']:.4f} nll {m['nll']:.3f} ece {m['ece']:.3f} "
                  f"({len(res.members)} members, {fuse_s:.0f}s)", flush=True)
            path.write_text(json.dumps(rows, indent=1))
    lines = ["# The ensemble question: client ensemble vs fusion at equal serving cost", "",
             f"α = {args.alpha}, C = {cfg.clients[0]}, M = {max(cfg.components)}, kron, {cfg.epochs} local epochs; "
             f"seeds {', '.join(str(s) for s in sorted({r['seed'] for r in rows}))} (cached fits in `{args.work}`). Command:", "",
             f"    .venv/bin/python experiments/ensemble_gap/ensemble_question.py --config {args.config} --work {args.work} "
             f"--alpha {args.alpha} --out {args.out}" + (f" --seeds {args.seeds}" if args.seeds else ""), "",
             "| variant | members | accuracy % (mean ± std) | NLL | ECE | per seed |", "|---|---|---|---|---|---|"]
    for name, _, _ in VARIANTS:
        rs = [r for r in rows if r["variant"] == name]
        if not rs:
            continue
        acc = [100 * r["accuracy"] for r in rs]
        sd = statistics.stdev(acc) if len(acc) > 1 else 0.0
        lines.append(f"| {name} | {rs[0]['members']} | {statistics.mean(acc):.2f} ± {sd:.2f} | "
                     f"{statistics.mean(r['nll'] for r in rs):.3f} | {statistics.mean(r['ece'] for r in rs):.3f} | "
                     + ", ".join(f"{a:.2f}" for a in acc) + " |")
    tuned = [r for r in rows if r.get("chosen")]
    if tuned:
        lines += ["", "Tuned choices (validation accuracy): " + "; ".join(
            f"seed {r['seed']}: T = {r['chosen']['temperature']}, σ0² = {r['chosen']['prior_var']}" for r in tuned)]
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
