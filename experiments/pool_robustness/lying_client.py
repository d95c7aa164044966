"""One lying client against the label-shift pool (``ensemble --set pooling=label-shift``), without
validation data: one client's recorded class counts ×1,000 (what the pool weighs by), or one client retrained on
its silo with every label shifted by one (y → y + 1 mod K), beside the honest clients. Each scenario is combined
by the plain average, the pool and the robust pool (``posterior_fusion.pooling.robust_label_shift_pool``):

* count claims are checked against the curvature: each client's count evidence is the number of examples at which
  its curvature per example (mean diagonal / (T · n)) would equal the clients' median; a claim beyond 5 × its
  evidence is scaled down to it (``fuse --robust`` leaves such a client out before fusion instead);
* on the inputs being predicted (no labels), each pair of clients sharing two or more claimed classes is compared
  there (their predictives moved to one label prior); a client whose median disagreement with its partners is
  above 0.1 and 5 median absolute deviations above the median is left out, named.

    .venv/bin/python experiments/robustness/lying_client.py --clients 'runs/label_shift_pool/clients/KEY/post_*.h5' \\
        --partition runs/label_shift_pool/partitions/PKEY --json docs/results/pool_robustness/lying_client.json
"""

from __future__ import annotations

import argparse
import glob
import json
import subprocess
import sys
import warnings
from pathlib import Path

import torch

from posterior_fusion.artifact.reader import load_client
from posterior_fusion.data.silo import SiloData, read_silo, write_silo
from posterior_fusion.experiment.measure import save_rows
from posterior_fusion.pooling import label_shift_pool, robust_label_shift_pool
from posterior_fusion.predictive import predict


def client_probs(path: str | Path, x: torch.Tensor) -> torch.Tensor:
    c = load_client(path)
    return predict(c.model_spec, [m.map for m in c.components], x, "map").double()


def count_evidence(paths: list[str], claimed: torch.Tensor) -> torch.Tensor:
    """``(C,)``: the examples at which each client's curvature per example would equal the median client's, given
    the claimed totals ``claimed`` ``(C,)``."""
    scale = []
    for p in paths:
        c = load_client(p)
        scale.append(sum(float(m.curvature.diagonal().double().mean()) for m in c.components)
                     / (c.num_components * c.temperature))
    scale = torch.tensor(scale, dtype=torch.float64)
    return scale / (scale / claimed).median()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", required=True, help="glob of the honest client artifacts")
    ap.add_argument("--partition", required=True, help="their partition folder (client_<i>.h5, test.h5)")
    ap.add_argument("--liar", type=int, default=0, help="the client that lies [default: 0]")
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
    flipped_paths = [str(flipped_path) if i == args.liar else p for i, p in enumerate(paths)]
    for scenario, probs, cnt, files in (("honest", honest, counts, paths), ("counts x1000", honest, liar_counts, paths),
                                        ("labels shifted", flipped, flipped_counts, flipped_paths)):
        def acc(q):
            return float((q.argmax(1) == y).double().mean()) * 100
        evidence = count_evidence(files, cnt.sum(1))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            robust = acc(robust_label_shift_pool(probs, cnt, count_evidence=evidence))
        named = sorted({int(c) for w in caught if "robust" in str(w.message)
                        for c in str(w.message).split("client(s) ")[1].split(" ")[0].split(",")})
        row = {"scenario": scenario, "average": acc(probs.mean(0)), "pool": acc(label_shift_pool(probs, cnt)),
               "robust": robust, "robust_named": named}
        rows.append(row)
        print(json.dumps(row), flush=True)
    save_rows(args.json, {"clients": paths, "liar": args.liar, "rows": rows})


if __name__ == "__main__":
    main()
