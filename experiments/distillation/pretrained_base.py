"""The distillation study's pretrained-base clients, through the CLI: the pretrained-base study's LeNet base
(``experiments/pretrained_base/run.py --base-only``), five silos that fine-tune it (``pfuse init --base``,
``fit-local --finetune F``, that study's recipe) on a Dirichlet split of the 45,000 images the base never saw,
5,000 of them held out, unlabeled, as the server's inputs. It writes the layout ``run.py`` reads
(``WORK/partitions/*/summary.json``, ``WORK/clients/*/post_<c>.h5``); then run ``run.py WORK``.

    OMP_NUM_THREADS=1 nice -n 19 .venv/bin/python experiments/distillation/pretrained_base.py \\
        runs/distillation_pb_lora4 --finetune lora:4 --alphas 0.1 0.4 --seeds 0
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

PFUSE = str(Path(sys.executable).parent / "pfuse")
HERE = Path(__file__).resolve().parent


def run(*args: object) -> str:
    r = subprocess.run([str(a) for a in args], capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"{' '.join(map(str, args))}: {r.stderr.strip()[-2000:]}")
    return r.stdout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("work", type=Path, help="the folder to write (e.g. runs/distillation_pb_lora4)")
    ap.add_argument("--base-work", type=Path, default=Path("runs/pretrained_base"),
                    help="the pretrained-base study's folder (its base and data files; written when absent)")
    ap.add_argument("--finetune", default="lora:4", help="fit-local --finetune of every silo")
    ap.add_argument("--alphas", type=float, nargs="+", default=[0.1, 0.4])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--clients", type=int, default=5)
    ap.add_argument("--components", type=int, default=3)
    ap.add_argument("--unlabeled", type=int, default=5000, help="images held out, unlabeled, for the server")
    args = ap.parse_args()
    base = args.base_work / "base_lenet.safetensors"
    if not base.exists():
        run(sys.executable, HERE.parent / "pretrained_base" / "run.py", "--base-only", "--work", args.base_work)
    for alpha in args.alphas:
        for seed in args.seeds:
            part = args.work / "partitions" / f"a{alpha}_s{seed}"
            if not (part / "summary.json").exists():
                summary = run(PFUSE, "-q", "partition", "--data", args.base_work / "pool_same-domain.h5",
                    "--test", args.base_work / "test_same-domain.h5", "--clients", args.clients, "--alpha", alpha,
                    "--partition-seed", seed, "--val-size", 0, "--unlabeled-size", args.unlabeled,
                    "--out-dir", part, "--json")
                (part / "summary.json").write_text(summary)
            clients = args.work / "clients" / f"a{alpha}_s{seed}"
            clients.mkdir(parents=True, exist_ok=True)
            init = clients / "init.h5"
            if not init.exists():
                run(PFUSE, "-q", "init", "--base", base, "-M", args.components, "--init-seed", seed, "--out", init)
            for c in range(args.clients):
                out = clients / f"post_{c}.h5"
                if out.exists():
                    continue
                t0 = time.time()
                run(PFUSE, "-q", "fit-local", "--data", part / f"client_{c}.h5", "--init", init,
                    "--finetune", args.finetune, "--structure", "kron", "--kfac", "expand", "--epochs", 5,
                    "--lr", 0.01, "--temperature", 0.1, "--prior-var", 0.1, "--train-seed", 100 * seed + c,
                    "--out", out)
                print(f"alpha {alpha} seed {seed} silo {c}: fitted in {time.time() - t0:.0f}s", flush=True)


if __name__ == "__main__":
    main()
