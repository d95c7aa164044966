"""The fast curvature capture of this checkout against another version of ``fastcapture.py`` (e.g.
an older commit's), alternating in one process: each capture ÷ one training epoch timed in the same
round; process CPU time, median of ``--rounds``; also the largest relative difference of the two
results (the MC captures draw the same labels from the same seed).

    git show c6732eb:posterior_fusion/local/fastcapture.py > /tmp/fastcapture_old.py
    PFUSE_PROGRESS=0 .venv/bin/python benchmarks/capture_ab_bench.py --against /tmp/fastcapture_old.py

``--this PATH`` compares two other versions (e.g. one commit's change alone).

``--model resnet20 --model-kwargs '{"in_channels": 1, "width": 16}'`` times another built-in model on the
same 28x28 Fashion-MNIST images (default LeNet).

Captures (``--captures``, default all): ``kron-exact``, ``kron-mc``, ``diag-exact``, ``last-layer``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import time

import torch
from capture_bench import fmnist_train

from posterior_fusion.local import fastcapture
from posterior_fusion.local.config import TrainConfig
from posterior_fusion.local.train import train_map
from posterior_fusion.models import ModelSpec
from posterior_fusion.runtime import keep_freed_memory


def _factors(curvature) -> torch.Tensor:
    """Every stored tensor of a block-diagonal capture, flattened (never the dense d x d matrix)."""
    return torch.cat([t.flatten().double() for b in curvature.blocks for t in b.to_tensors().values()])


CAPTURES = {
    "kron-exact": lambda m, model, x, y: _factors(m.fast_kron(model, x, y, ggn="exact")),
    "kron-mc": lambda m, model, x, y: _factors(m.fast_kron(model, x, y, ggn="mc",
                                                           generator=torch.Generator().manual_seed(0))),
    "diag-exact": lambda m, model, x, y: m.fast_diag_vector(model, x, y, ggn="exact"),
    "last-layer": lambda m, model, x, y: m.last_layer_ggn(model, x),
}


def load_module(name: str, path: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--against", required=True, help="path of the other fastcapture.py")
    ap.add_argument("--this", default=None, help="path of a fastcapture.py to use instead of this checkout's")
    ap.add_argument("--captures", default=",".join(CAPTURES), help=f"comma-separated (default {','.join(CAPTURES)})")
    ap.add_argument("--n", type=int, default=10000, help="training images (default 10000)")
    ap.add_argument("--rounds", type=int, default=5, help="alternating rounds (default 5)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    ap.add_argument("--model", default="lenet", help="built-in model (default lenet)")
    ap.add_argument("--model-kwargs", default="{}", help="its keyword arguments as JSON (default {})")
    args = ap.parse_args()
    other = load_module("other_fastcapture", args.against)
    this = fastcapture if args.this is None else load_module("this_fastcapture", args.this)
    keep_freed_memory()
    torch.set_num_threads(args.threads)
    x, y = fmnist_train(args.n)
    torch.manual_seed(0)
    spec = ModelSpec(args.model, json.loads(args.model_kwargs))
    model, copy = spec.build(), spec.build()
    cfg = TrainConfig(epochs=1, batch_size=64, weight_decay=0.0)
    train_map(model, x, y, cfg, seed=0, desc="epoch")
    print(f"{args.model} {args.model_kwargs}, n = {args.n}, threads = {args.threads}, rounds = {args.rounds} (process CPU time, median; "
          "each capture ÷ the epoch of its round)")
    for name in args.captures.split(","):
        run = CAPTURES[name]
        ratios: dict[str, list[float]] = {"other": [], "this": []}
        for r in range(args.rounds):
            copy.load_state_dict(model.state_dict())
            t0 = time.process_time()
            train_map(copy, x, y, cfg, seed=r, desc="epoch")
            epoch = time.process_time() - t0
            for which, module in (("other", other), ("this", this)):
                t0 = time.process_time()
                run(module, model, x, y)
                ratios[which].append((time.process_time() - t0) / epoch)
        a, b = run(other, model, x, y), run(this, model, x, y)
        diff = float((a - b).abs().max() / a.abs().max())
        o, t = statistics.median(ratios["other"]), statistics.median(ratios["this"])
        print(f"{name:>11}: other {o:.2f} epochs, this {t:.2f} epochs, {o / t:.2f}x; max relative difference {diff:.1e}",
              flush=True)


if __name__ == "__main__":
    main()
