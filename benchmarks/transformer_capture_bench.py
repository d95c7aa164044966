"""K-FAC capture ÷ one training epoch for a stock transformer and a BatchNorm ResNet-20, the fast path
against curvlinops' KFAC on the same model and batches, side by side in one run:

    PFUSE_PROGRESS=0 OMP_NUM_THREADS=1 .venv/bin/python benchmarks/transformer_capture_bench.py --n 2048 \\
        --json docs/results/capture/transformer.json
    PFUSE_PROGRESS=0 OMP_NUM_THREADS=1 .venv/bin/python benchmarks/transformer_capture_bench.py --model resnet20-bn \\
        --n 1024 --repeats 2 --json docs/results/capture/resnet20_bn.json

The ResNet-20 (width 16, BatchNorm; 1 x 28 x 28 inputs, Fashion-MNIST's shape) has its statistics set by one
pass in training mode over the inputs, then frozen (``models/finetune.py``, as fine-tuned from a base); its
BatchNorm affine parameters get the exact GGN diagonal in the fast capture, and curvlinops takes its Conv2d
and Linear parameters only (it supports no other layer).

The model: a Linear token embedding (16 → 128), four ``nn.TransformerEncoderLayer`` (width 128, 4 heads,
feed-forward 256, batch first), mean pooling and a 10-way head, built through ``ModelSpec``'s rules
(``nn.MultiheadAttention`` as four Linear maps, ``models/attention.py``); inputs are sequences of 64 random
16-dimensional tokens with random labels (timing only). Each capture (expand and reduce, exact GGN and MC)
is divided by one SGD epoch (batch 64) timed just before it; curvlinops computes the factors of the same
Linear weights and biases (LayerNorm's parameters are left out of its parameter list: it takes Linear and
Conv2d only), with its type-2 (exact) or MC Fisher; for the exact GGN the largest difference of the
weights' Kronecker blocks is reported (each factor normalised, and the product of the factors' norms: a
scalar may move between the two factors; a key projection under reduce has no curvature, its B rounding
noise in both, and is left out), MC draws differ.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from torch import nn

from posterior_fusion.local.capture import capture
from posterior_fusion.local.fit_config import TrainConfig
from posterior_fusion.local.train import train_map
from posterior_fusion.models.attention import linear_attention
from posterior_fusion.models.builtin import resnet20
from posterior_fusion.models.finetune import freeze_statistics


class Transformer(nn.Module):
    def __init__(self, width: int = 128, layers: int = 4) -> None:
        super().__init__()
        self.embed = nn.Linear(16, width)
        self.encoder = nn.ModuleList(nn.TransformerEncoderLayer(width, 4, 2 * width, dropout=0.0, batch_first=True)
                                     for _ in range(layers))
        self.head = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.encoder:
            h = layer(h)
        return self.head(h.mean(1))


def curvlinops_factors(model: nn.Module, x: torch.Tensor, y: torch.Tensor, fisher: str, kfac: str) -> dict:
    """curvlinops' KFAC factors of every Linear / Conv2d weight and bias (``{param name: (A or None, B)}``)."""
    from curvlinops import KFACLinearOperator

    names = {id(p): n for n, p in model.named_parameters()}
    params = [p for m in model.modules() if isinstance(m, (nn.Linear, nn.Conv2d)) for p in m.parameters(recurse=False)]
    op = KFACLinearOperator(model, nn.CrossEntropyLoss(reduction="sum"), params,
                            [(x[i: i + 256], y[i: i + 256]) for i in range(0, len(x), 256)],
                            fisher_type=fisher, kfac_approx=kfac, check_deterministic=False,
                            separate_weight_and_bias=True, num_data=len(x))
    op.compute_kronecker_factors()
    out = {}
    for mod_name, pos in op._mapping.items():
        for key, index in pos.items():
            name = names[id(params[index])]
            out[name] = (op._input_covariances.get(mod_name) if key == "weight" else None,
                         op._gradient_covariances[mod_name])
    return out


def bn_resnet(x: torch.Tensor) -> nn.Module:
    """A BatchNorm ResNet-20 with its statistics from one training-mode pass over ``x``, then frozen."""
    model = resnet20(10, 1, 16, "batch")
    model.train()
    with torch.no_grad():
        for i in range(0, len(x), 256):
            model(x[i: i + 256])
    freeze_statistics(model, None)
    return model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=("transformer", "resnet20-bn"), default="transformer")
    ap.add_argument("--n", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    if args.model == "transformer":
        x, y = torch.randn(args.n, 64, 16, generator=g), torch.randint(0, 10, (args.n,), generator=g)
        model, model_train = linear_attention(Transformer()), linear_attention(Transformer())
        what = "transformer 4 x 128, sequence 64"
    else:
        x, y = torch.randn(args.n, 1, 28, 28, generator=g), torch.randint(0, 10, (args.n,), generator=g)
        model, model_train = bn_resnet(x), bn_resnet(x)
        what = "resnet20 width 16, BatchNorm (statistics frozen), 1 x 28 x 28"
    print(f"{what}: {sum(p.numel() for p in model.parameters()):,} weights, n = {args.n}, threads {args.threads}",
          flush=True)
    train_map(model, x, y, TrainConfig(epochs=1, batch_size=64, weight_decay=0.0), seed=0, desc="epoch")  # warm-up
    model.eval()

    def epoch() -> float:
        model_train.load_state_dict(model.state_dict())
        t0 = time.perf_counter()
        train_map(model_train, x, y, TrainConfig(epochs=1, batch_size=64, weight_decay=0.0), seed=1, desc="epoch")
        return time.perf_counter() - t0

    rows = []
    for kfac in ("expand", "reduce"):
        for ggn, fisher in (("exact", "type-2"), ("mc", "mc")):
            ours, theirs = [], []
            for r in range(args.repeats):
                ep = epoch()
                t0 = time.perf_counter()
                curv, how = capture("kron", model, x, y, 256, ggn, "fast", torch.Generator().manual_seed(r), kfac=kfac)
                ours.append((time.perf_counter() - t0) / ep)
                ep = epoch()
                t0 = time.perf_counter()
                ref = curvlinops_factors(model, x, y, fisher, kfac)
                theirs.append((time.perf_counter() - t0) / ep)
            diff = None
            if ggn == "exact":
                named = dict(zip([n for n, _ in model.named_parameters()], curv.blocks))
                diffs = []
                unit = lambda t: t.double() / t.double().norm()  # noqa: E731 (a scalar may move between the factors)
                largest = max((A.double().norm() * B.double().norm()).item() for A, B in ref.values() if A is not None)
                for name, (A, B) in ref.items():
                    t = named[name].to_tensors()
                    # under reduce a key projection's B is rounding noise in both (Σ over the tokens of a key's
                    # output gradient vanishes: the softmax ignores a shift shared by every key): left out
                    if A is not None and (A.double().norm() * B.double().norm()).item() > 1e-8 * largest:
                        product = (t["kron_A"].double().norm() * t["kron_B"].double().norm()
                                   / (A.double().norm() * B.double().norm())).item()
                        diffs += [(unit(t["kron_A"]) - unit(A)).norm().item(), (unit(t["kron_B"]) - unit(B)).norm().item(),
                                  abs(product - 1)]
                diff = max(diffs)
            row = {"kfac": kfac, "ggn": ggn, "fast_epochs": round(statistics.median(ours), 2),
                   "curvlinops_epochs": round(statistics.median(theirs), 2),
                   "speedup": round(statistics.median(theirs) / statistics.median(ours), 2),
                   "max_rel_diff": None if diff is None else float(f"{diff:.2e}"), "capture": how}
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": what, "n": args.n, "threads": args.threads, "rows": rows},
                      f, indent=1)


if __name__ == "__main__":
    main()
