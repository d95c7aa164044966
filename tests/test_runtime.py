"""``keep_freed_memory``: a training loop stops faulting its buffers in again every step; the
opt-out leaves glibc alone. Each case runs in a fresh interpreter (the setting is process-wide)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

SCRIPT = """
import resource, sys
import torch
from posterior_fusion.runtime import keep_freed_memory
from posterior_fusion.local.config import TrainConfig
from posterior_fusion.local.train import train_map
from posterior_fusion.models import ModelSpec
took = keep_freed_memory()
torch.set_num_threads(1)
x, y = torch.rand(4096, 1, 28, 28), torch.randint(0, 10, (4096,))
torch.manual_seed(0)
model = ModelSpec("lenet", {}).build()
cfg = TrainConfig(epochs=1, batch_size=64, weight_decay=0.0)
train_map(model, x, y, cfg, seed=0, desc="warm-up")
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
train_map(model, x, y, cfg, seed=1, desc="epoch")  # 64 steps
print(took, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _run(extra_env: dict) -> tuple[bool, int]:
    env = {k: v for k, v in os.environ.items() if k != "PFUSE_MALLOC"} | {"PFUSE_PROGRESS": "0"} | extra_env
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, check=True)
    took, faults = out.stdout.split()
    return took == "True", int(faults)


def _glibc() -> bool:
    return sys.platform.startswith("linux") and os.confstr("CS_GNU_LIBC_VERSION") is not None


@pytest.mark.skipif(not _glibc(), reason="keep_freed_memory acts on glibc's allocator only")
def test_training_steps_do_not_fault_buffers_in_again():
    took, faults = _run({})
    assert took
    # A step's activations and gradients span ~250 pages (the first convolution's output alone is 216), so
    # faulting them in again every step costs > 10,000 faults over these 64 steps; reused buffers cost a one-time
    # handful (1-44 measured). glibc's own defaults are no baseline: its dynamic mmap threshold makes them vary
    # from 1 to 63,673 faults between runs of this script.
    assert faults < 1024, faults


def test_opt_out_leaves_the_allocator_alone():
    took, _ = _run({"PFUSE_MALLOC": "default"})
    assert not took
