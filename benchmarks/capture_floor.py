"""Where exact K-FAC-expand's capture time goes (issue 28: ≤ 4 epochs asked): one SGD epoch, a forward
pass, the capture's passes alone (one forward + the back-propagated columns to the layer outputs, no
factor formed: the floor any exact-GGN capture pays) and the whole capture, exact and MC, each ÷ the epoch.

    PFUSE_PROGRESS=0 .venv/bin/python benchmarks/capture_floor.py --width 16 --n 512 --threads 1

Process CPU time, the best of ``--rounds``; random images (the costs do not depend on the values).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from posterior_fusion.local import fastcapture as fc
from posterior_fusion.models import ModelSpec


def best(fn, rounds: int) -> float:
    out = []
    for _ in range(rounds):
        t = time.process_time()
        fn()
        out.append(time.process_time() - t)
    return min(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--width", type=int, default=16)
    ap.add_argument("--side", type=int, default=28)
    ap.add_argument("--channels", type=int, default=1)
    ap.add_argument("--n", type=int, default=512)
    ap.add_argument("--batch", type=int, default=256, help="curvature batch (the epoch uses 64)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    spec = ModelSpec("resnet20", {"in_channels": args.channels, "width": args.width, "num_classes": 10})
    model = spec.build()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.n, args.channels, args.side, args.side, generator=g)
    y = torch.randint(0, 10, (args.n,), generator=g)

    def epoch():
        m = spec.build()
        m.load_state_dict(model.state_dict())
        opt = torch.optim.SGD(m.parameters(), lr=0.01)
        for i in range(0, args.n, 64):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(m(x[i : i + 64]), y[i : i + 64]).backward()
            opt.step()

    def forward():
        with torch.no_grad():
            for i in range(0, args.n, args.batch):
                model(x[i : i + args.batch])

    def passes(ggn):
        layers = fc._layers(model)
        gen = torch.Generator().manual_seed(0)
        with fc._no_param_grads(model):
            for i in range(0, args.n, args.batch):
                fc._batch_pass(model, layers, x[i : i + args.batch], ggn, gen, lambda r, inputs, grads: None)

    def capture(ggn):
        fc.fast_kron(model, x, y, args.batch, ggn, torch.Generator().manual_seed(0), kfac="expand")

    epoch()  # warm-up
    e = best(epoch, args.rounds)
    row = {"width": args.width, "n": args.n, "threads": args.threads, "epoch_s": round(e, 3),
           "forward_epochs": round(best(forward, args.rounds) / e, 2)}
    for ggn in ("exact", "mc"):
        row[f"passes_{ggn}_epochs"] = round(best(lambda g=ggn: passes(g), args.rounds) / e, 2)
        row[f"expand_{ggn}_epochs"] = round(best(lambda g=ggn: capture(g), args.rounds) / e, 2)
    print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(row, f, indent=1)


if __name__ == "__main__":
    main()
