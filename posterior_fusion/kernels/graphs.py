"""Replay a step as a CUDA graph: one launch instead of a few hundred small ones.

On a GPU, a fedbens objective step on LeNet-sized layers is bound by kernel launches, not
arithmetic: ~2 ms eager for a few hundred launches, 0.3–0.6 ms replayed as one captured graph
(an H100, C = 5, M = 1–5; ``docs/benchmarks.md``, "On a GPU"). :class:`GraphedStep` captures
``fn(x)`` once per input shape and dtype, then copies each new ``x`` into the graph's static
input and replays it. ``fn`` must not synchronise with the host (no ``.item()``, no tensors built
from Python lists): the warm-up calls run with torch's sync debug mode set to "error", and a
step that synchronises there is run eagerly from then on, with a warning — a capture that failed
half-way would leave the CUDA random generator unusable, so it is never attempted.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch

Outputs = tuple[torch.Tensor, ...]


class GraphedStep:
    """``fn`` ``(x) -> tuple of tensors``, replayed from a CUDA graph for CUDA inputs (eager otherwise).

    Returned tensors are copies (the graph's own outputs are overwritten by the next replay).
    """

    def __init__(self, fn: Callable[[torch.Tensor], Outputs], warmup: int = 2) -> None:
        self.fn, self.warmup = fn, warmup
        self._graphs: dict[tuple, tuple[torch.Tensor, torch.cuda.CUDAGraph, Outputs] | None] = {}

    def __call__(self, x: torch.Tensor) -> Outputs:
        if not x.is_cuda:
            return self.fn(x)
        key = (tuple(x.shape), x.dtype, x.device)
        if key not in self._graphs:
            self._graphs[key] = self._capture(x)
        entry = self._graphs[key]
        if entry is None:  # capture failed once: eager from then on
            return self.fn(x)
        static, graph, outputs = entry
        static.copy_(x)
        graph.replay()
        return tuple(o.clone() for o in outputs)

    def _capture(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.CUDAGraph, Outputs] | None:
        static = x.detach().clone()
        side = torch.cuda.Stream(device=x.device)
        side.wait_stream(torch.cuda.current_stream(x.device))
        mode = torch.cuda.get_sync_debug_mode()
        try:
            with torch.cuda.stream(side):  # warm-up off the default stream (allocator pools, lazy inits)
                self.fn(static)  # the first call may build caches (host work that may synchronise)
                with warnings.catch_warnings():  # torch calls the mode "a prototype feature" on every switch
                    warnings.simplefilter("ignore", UserWarning)
                    torch.cuda.set_sync_debug_mode("error")
                for _ in range(self.warmup):
                    self.fn(static)
        except RuntimeError as exc:
            warnings.warn(f"the step synchronises with the host, so it cannot be a CUDA graph ({exc}); "
                          "running it eagerly", RuntimeWarning, stacklevel=3)
            return None
        finally:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                torch.cuda.set_sync_debug_mode(mode)
            torch.cuda.current_stream(x.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outputs = self.fn(static)
        return static, graph, tuple(outputs)
