"""K-FAC-expand's input factor of one convolution, three ways: the unfolded
patches' Gram, the shifted products (``_conv_input_gram_shifted``) and, for scale, the convolution's
forward pass; process CPU time, best of three, one thread; and which one ``_shift_gram_pays`` picks.

    .venv/bin/python benchmarks/input_gram_bench.py
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

from posterior_fusion.local.capture import inputs
from posterior_fusion.local.capture.gram import float64_gram
from posterior_fusion.models.layers import input_columns

SHAPES = [  # (channels, image side, kernel, padding, batch)
    (1, 28, 5, 0, 256), (6, 12, 5, 0, 256), (3, 32, 3, 1, 256), (16, 32, 3, 1, 256), (1, 28, 3, 1, 256),
    (16, 28, 3, 1, 256), (32, 14, 3, 1, 256), (64, 7, 3, 1, 256), (3, 32, 3, 1, 16), (8, 28, 5, 2, 256),
    (8, 28, 3, 0, 256)]


def best(fn) -> float:
    out = float("inf")
    for _ in range(3):
        t0 = time.process_time()
        fn()
        out = min(out, time.process_time() - t0)
    return out


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    torch.set_num_threads(1)
    print("| C | side | kernel | padding | batch | patches s | shifted s | conv forward s | rule picks | right |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for C, H, k, p, M in SHAPES:
        conv = nn.Conv2d(C, C, k, padding=p)
        x = torch.randn(M, C, H, H)
        patches = best(lambda conv=conv, x=x: float64_gram(input_columns(conv, x)))
        shifted = best(lambda conv=conv, x=x: inputs._conv_input_gram_shifted(conv, x))
        forward = best(lambda conv=conv, x=x: conv(x))
        pick = inputs._shift_gram_pays(conv, x)
        print(f"| {C} | {H} | {k} | {p} | {M} | {patches:.4f} | {shifted:.4f} | {forward:.4f} | "
              f"{'shifted' if pick else 'patches'} | {'yes' if pick == (shifted < patches) else 'no'} |", flush=True)


if __name__ == "__main__":
    main()
