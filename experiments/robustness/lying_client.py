"""One lying client against the label-shift pool (``ensemble --set pooling=label-shift``), without
validation data: one client's recorded class counts ×1,000 (what the pool weighs by; its curvature,
which the pool never uses, scaled to match would pass ``--robust``), or one client retrained on its
silo with every label shifted by one (y → y + 1 mod K), beside the honest clients. Each scenario is
combined by the plain average, the pool, and two robust levers measured here:

* ``cap``: every client's counts scaled down so its total is at most ``--cap`` × the clients' median
  total before pooling (a count claim far above the others' is not believed);
* ``screen``: on the inputs being predicted (no labels), each client's label-shift-corrected
  predictive is compared with the pool of the others on the classes it claims (mean total-variation
  distance); a client whose score exceeds the median by ``--screen`` × the median absolute deviation
  is left out and named.

    .venv/bin/python experiments/robustness/lying_client.py --clients 'runs/label_shift_pool/clients/KEY/post_*.h5' \\
        --partition runs/label_shift_pool/partitions/PKEY --json docs/results/security/lying_client.json
"""

from __future__ import annotations

import argparse
import glob
import json
import subprocess
import sys
from pathlib import Path

import torch

from posterior_fusion.artifact.reader import load_client
from posterior_fusion.data.silo import SiloData, read_silo, write_silo
from posterior_fusion.experiment.measure import save_rows
from posterior_fusion.pooling import label_shift_pool
from posterior_fusion.predictive import predict


def client_probs(path: str | Path, x: torch.Tensor) -> torch.Tensor:
    c = load_client(path)
    return predict(c.model_spec, [m.map for m in c.components], x, "map").double()


def capped(counts: torch.Tensor, cap: float) -> torch.Tensor:
    totals = counts.sum(1)
    limit = cap * totals.median()
    return counts * torch.clamp(limit / totals, max=1.0)[:, None]


def screen_scores(probs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Per client, the mean total-variation distance between its own label-shift-corrected predictive and
    the pool of the others, over the classes it claims (``(C,)``)."""
    C = probs.shape[0]
    scores = []
    for c in range(C):
        others = [k for k in range(C) if k != c]
        pool = label_shift_pool(probs[others], counts[others])
        prior = counts.sum(0) / counts.sum()
        own_prior = counts[c] / counts[c].sum()
        own = probs[c] * torch.where(own_prior > 0, prior / own_prior.clamp_min(1e-300), torch.zeros_like(prior))
        own = own / own.sum(-1, keepdim=True).clamp_min(1e-300)
        claimed = counts[c] > 0
        scores.append(0.5 * (own[:, claimed] - pool[:, claimed]).abs().sum(-1).mean())
    return torch.stack(scores)


def screened(probs: torch.Tensor, counts: torch.Tensor, k: float) -> list[int]:
    s = screen_scores(probs, counts)
    med = s.median()
    mad = (s - med).abs().median().clamp_min(1e-6)
    return [c for c in range(len(s)) if s[c] > med + k * mad]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", required=True, help="glob of the honest client artifacts")
    ap.add_argument("--partition", required=True, help="their partition folder (client_<i>.h5, test.h5)")
    ap.add_argument("--liar", type=int, default=0, help="the client that lies [default: 0]")
    ap.add_argument("--cap", type=float, default=4.0, help="cap lever: x the median total [default: 4]")
    ap.add_argument("--screen", type=float, default=5.0, help="screen lever: MADs above the median [default: 5]")
    ap.add_argument("--json", default=None, help="write the rows here")
    args = ap.parse_args()
    paths = sorted(glob.glob(args.clients))
    part = Path(args.partition)
    x, y = read_silo(part / "test.h5").tensors()
    honest = torch.stack([client_probs(p, x) for p in paths])
    counts = torch.tensor([list(load_client(p).metadata["class_counts"]) for p in paths], dtype=torch.float64)
    # the label-flipped client: the liar's silo with every label shifted by one, trained as the others were
    src = load_client(paths[args.liar])
    flipped_path = Path(paths[args.liar]).parent / f"flipped_{args.liar}.h5"
    if not flipped_path.exists():
        silo = read_silo(part / f"client_{args.liar}.h5")
        flipped_silo = Path(paths[args.liar]).parent / f"flipped_silo_{args.liar}.h5"
        write_silo(flipped_silo, SiloData(silo.x, (silo.y + 1) % silo.num_classes, silo.dataset, silo.num_classes,
                                          transform=silo.transform))
        training = src.components[0].training
        subprocess.run([str(Path(sys.executable).parent / "pfuse"), "-q", "fit-local", "--data", str(flipped_silo),
                        "--model", src.model_spec.name, "--model-kwargs", json.dumps(dict(src.model_spec.kwargs)),
                        "-M", str(src.num_components), "--epochs", str(int(training.get("epochs", 20))),
                        "--structure", "diag", "--out", str(flipped_path)], check=True)
    flipped = honest.clone()
    flipped[args.liar] = client_probs(flipped_path, x)
    flipped_counts = counts.clone()
    flipped_counts[args.liar] = torch.tensor(list(load_client(flipped_path).metadata["class_counts"]), dtype=torch.float64)
    liar_counts = counts.clone()
    liar_counts[args.liar] *= 1000
    rows = []
    for scenario, probs, cnt in (("honest", honest, counts), ("counts x1000", honest, liar_counts),
                                 ("labels shifted", flipped, flipped_counts)):
        def acc(q):
            return float((q.argmax(1) == y).double().mean()) * 100
        out = screened(probs, cnt, args.screen)
        keep = [c for c in range(len(paths)) if c not in out]
        row = {"scenario": scenario, "average": acc(probs.mean(0)), "pool": acc(label_shift_pool(probs, cnt)),
               "cap": acc(label_shift_pool(probs, capped(cnt, args.cap))),
               "screen": acc(label_shift_pool(probs[keep], cnt[keep])), "screened_out": out,
               "cap+screen": acc(label_shift_pool(probs[keep], capped(cnt[keep], args.cap)))}
        rows.append(row)
        print(json.dumps(row), flush=True)
    save_rows(args.json, {"clients": paths, "liar": args.liar, "cap": args.cap, "screen": args.screen, "rows": rows})


if __name__ == "__main__":
    main()
