"""Where exact K-FAC-expand's capture time goes (goal: ≤ 4 epochs): one SGD epoch, a forward
pass, the capture's passes alone (one forward + the back-propagated columns to the layer outputs, no
factor formed: the floor any exact-GGN capture pays) and the whole capture, exact and MC, each ÷ the epoch.

    PFUSE_PROGRESS=0 .venv/bin/python benchmarks/capture_floor.py --width 16 --n 512 --threads 1

``--dtypes float32,bfloat16``: the passes and captures (expand and reduce) in both arithmetics
(``capture_dtype``), side by side in one process, beside a bfloat16-autocast SGD epoch for scale;
every ratio is ÷ the float32 epoch.

Process CPU time, the best of ``--rounds``; random images (the costs do not depend on the values).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from posterior_fusion.local.capture.fast import fast_kron
from posterior_fusion.models import ModelSpec
from posterior_fusion.models.jacobians import batch_pass, no_param_grads
from posterior_fusion.models.layers import captured_layers


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
    ap.add_argument("--dtypes", default="float32", help="capture_dtype values to compare (default float32)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dtypes = {"float32": None, "bfloat16": torch.bfloat16}
    chosen = args.dtypes.split(",")
    torch.set_num_threads(args.threads)
    spec = ModelSpec("resnet20", {"in_channels": args.channels, "width": args.width, "num_classes": 10})
    model = spec.build()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.n, args.channels, args.side, args.side, generator=g)
    y = torch.randint(0, 10, (args.n,), generator=g)

    def epoch(low: torch.dtype | None = None):
        m = spec.build()
        m.load_state_dict(model.state_dict())
        opt = torch.optim.SGD(m.parameters(), lr=0.01)
        for i in range(0, args.n, 64):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=low or torch.bfloat16, enabled=low is not None):
                loss = torch.nn.functional.cross_entropy(m(x[i : i + 64]), y[i : i + 64])
            loss.backward()
            opt.step()

    def forward():
        with torch.no_grad():
            for i in range(0, args.n, args.batch):
                model(x[i : i + args.batch])

    def passes(ggn, low=None):
        layers = captured_layers(model)
        gen = torch.Generator().manual_seed(0)
        with no_param_grads(model):
            for i in range(0, args.n, args.batch):
                batch_pass(model, layers, x[i : i + args.batch], ggn, gen, lambda r, inputs, grads: None, low)

    def capture(ggn, low=None, kfac="expand"):
        fast_kron(model, x, y, args.batch, ggn, torch.Generator().manual_seed(0), kfac=kfac, compute_dtype=low)

    epoch()  # warm-up
    e = best(epoch, args.rounds)
    row = {"width": args.width, "n": args.n, "threads": args.threads, "epoch_s": round(e, 3),
           "forward_epochs": round(best(forward, args.rounds) / e, 2)}
    if "bfloat16" in chosen:
        row["bfloat16_epoch_epochs"] = round(best(lambda: epoch(torch.bfloat16), args.rounds) / e, 2)
    for ggn in ("exact", "mc"):
        for name in chosen:
            tag = "" if name == "float32" else f"_{name}"
            low = dtypes[name]
            row[f"passes_{ggn}{tag}_epochs"] = round(best(lambda g=ggn, d=low: passes(g, d), args.rounds) / e, 2)
            row[f"expand_{ggn}{tag}_epochs"] = round(best(lambda g=ggn, d=low: capture(g, d), args.rounds) / e, 2)
            if len(chosen) > 1:
                row[f"reduce_{ggn}{tag}_epochs"] = round(best(lambda g=ggn, d=low: capture(g, d, "reduce"),
                                                              args.rounds) / e, 2)
    print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(row, f, indent=1)


if __name__ == "__main__":
    main()
