"""Fusion from a shared pretrained base (README.md): pretrain a base on data no silo holds, let five silos
fine-tune it (every weight, the prior N(base, σ0² I)), fuse with every method, and set the rows beside the
same silos trained from shared random starting points, each silo alone, the base alone and centralised
fine-tuning on the pooled silos. Starts (``--starts``): ``scratch`` and ``base:<fit-local --finetune>``. One JSON
file of rows per (setting, α, seed, start); ``--report`` prints the table.

    OMP_NUM_THREADS=1 nice -n 19 .venv/bin/python experiments/pretrained_base/run.py --setting same-domain \\
        --alphas 0.1,0.4 --seeds 0,1,2 --work runs/pretrained_base --json-dir docs/results/pretrained_base
    .venv/bin/python experiments/pretrained_base/run.py --report docs/results/pretrained_base

Settings (``--setting``):
- ``same-domain``: the base is trained on half of the Fashion-MNIST training images of classes 0–4
  (T-shirt, trouser, pullover, dress, coat; drawn once with seed 12345); its head never sees classes 5–9.
  The silos split the other 45,000 training images (all ten classes); test: the 10,000 test images.
- ``cross-domain``: the same base; the silos split scikit-learn's digits (1,797 8×8 images, resized to
  28×28 bilinearly, Fashion-MNIST's input transform), 400 of them held out as the test set.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import tempfile
import time
from pathlib import Path

import h5py
import numpy as np
import torch

from posterior_fusion.artifact.reader import load_client
from posterior_fusion.data.idx import load_fmnist
from posterior_fusion.data.prepare import partition_to_files
from posterior_fusion.data.silo import SiloData, read_silo, write_silo
from posterior_fusion.data.transform import InputTransform
from posterior_fusion.errors import IncompatibleArtifactsError
from posterior_fusion.fusion import FusionOptions, fuse, write_fused
from posterior_fusion.local.fit import fit_and_write
from posterior_fusion.local.fit_config import TrainConfig, fit_config_from
from posterior_fusion.local.init import finetune_start, initial_weights, read_base, write_base
from posterior_fusion.local.recapture import recapture_to_file
from posterior_fusion.local.refresh import refresh_to_file
from posterior_fusion.local.refresh_settings import RefreshPrivacy
from posterior_fusion.local.train import train_map
from posterior_fusion.metrics import check_data, ensemble_probabilities, member_metrics
from posterior_fusion.models import ModelSpec, resolve_model
from posterior_fusion.models.members import build_model

PUBLIC_CLASSES = (0, 1, 2, 3, 4)
PUBLIC_SEED = 12345
# CPU threads of the pretraining: a base is bit-identical (its sha256 in the README) only at the same count
PRETRAIN_THREADS = {"lenet": 1, "resnet20": 2}
FMNIST = InputTransform.constants("fmnist")
# (row label, method, settings): every fusion of one cell; kron curvature, so 'product' does not apply
FUSIONS = [
    ("client ensemble", "ensemble", {}),
    ("label-shift pool", "ensemble", {"pooling": "label-shift"}),
    ("fedbens (default)", "fedbens", {}),
    ("fedbens, prior centre at the prior", "fedbens", {"prior_centre": "prior"}),
    ("fedlpa", "fedlpa", {}),
    ("fedfisher", "fedfisher", {}),
    ("fisher-merge", "fisher-merge", {}),
    ("regmean", "regmean", {}),
    ("hbfl", "hbfl", {}),
    ("fedavg", "fedavg", {}),
]


def log(msg: str) -> None:
    print(time.strftime("%H:%M:%S"), msg, flush=True)


def prepare(work: Path, setting: str) -> tuple[Path, Path | None]:
    """Write the public pretraining file (``work/public.h5``) and the silos' pool of ``setting``; returns
    ``(pool file, test file or None: partition holds a test split out of the pool)``."""
    work.mkdir(parents=True, exist_ok=True)
    public, pool, test = work / "public.h5", work / f"pool_{setting}.h5", work / f"test_{setting}.h5"
    if not public.exists():
        x, y = load_fmnist("train")
        rng = np.random.default_rng(PUBLIC_SEED)
        chosen = np.concatenate([rng.permutation(np.flatnonzero(y == k))[: (y == k).sum() // 2] for k in PUBLIC_CLASSES])
        rest = np.setdiff1d(np.arange(len(y)), chosen)
        write_silo(public, SiloData(x[chosen], y[chosen], "fmnist", 10, transform=FMNIST))
        write_silo(work / "pool_same-domain.h5", SiloData(x[rest], y[rest], "fmnist", 10, transform=FMNIST))
        xt, yt = load_fmnist("test")
        write_silo(work / "test_same-domain.h5", SiloData(xt, yt, "fmnist", 10, transform=FMNIST))
    if setting == "cross-domain" and not pool.exists():
        from sklearn.datasets import load_digits

        d = load_digits()
        small = torch.from_numpy(d.images.astype(np.float32) * (255 / 16))[:, None]
        big = torch.nn.functional.interpolate(small, size=(28, 28), mode="bilinear", align_corners=False)
        x = big[:, 0].round().clamp(0, 255).to(torch.uint8).numpy()
        write_silo(pool, SiloData(x, d.target.astype(np.int64), "digits", 10, transform=FMNIST))
        return pool, None
    return pool, (test if setting == "same-domain" else None)


def pretrain(work: Path, spec: ModelSpec, epochs: int) -> Path:
    """The base: SGD on the public file from PyTorch's default initialisation (seed 0), stored as safetensors."""
    path = work / f"base_{spec.name}.safetensors"
    if path.exists():
        return path
    data = read_silo(work / "public.h5")
    x, y = data.tensors()
    threads = torch.get_num_threads()
    torch.set_num_threads(PRETRAIN_THREADS.get(spec.name, 1))  # the base's bits depend on the thread count
    torch.manual_seed(0)
    model = resolve_model(spec.name, spec.provider)[0](**spec.kwargs)  # the architecture itself (BatchNorm trains)
    try:
        res = train_map(model, x, y, TrainConfig(epochs=epochs, weight_decay=5e-4, lr=0.05), seed=0, desc="pretrain")
    finally:
        torch.set_num_threads(threads)
    model.eval()
    log(f"base: {len(y)} public images, {epochs} epochs, train accuracy {res.final_accuracy:.3f}")
    write_base(model, path)
    return path


PROBABILITIES: dict[str, torch.Tensor] = {}  # one network's test probabilities (n, C), by spec, test file, weights


def evaluate(spec: ModelSpec, members: list[torch.Tensor], test: SiloData, **extra) -> dict:
    """``evaluate_members`` with each network's test probabilities computed once per cell: the silos alone, the
    client ensemble and the label-shift pool serve the same networks."""
    check_data(spec, test, len(members))
    keys = [hashlib.sha256(f"{spec!r}|{test.source}|".encode() + w.detach().cpu().numpy().tobytes()).hexdigest()
            for w in members]
    missing = [k for k in range(len(members)) if keys[k] not in PROBABILITIES]
    if missing:
        _, probs = ensemble_probabilities(spec, [members[k] for k in missing], test.inputs())
        PROBABILITIES.update({keys[k]: p for k, p in zip(missing, probs)})
    y = torch.from_numpy(test.labels().astype(np.int64))
    return member_metrics(torch.stack([PROBABILITIES[k] for k in keys]), y, **extra)


def metrics_row(label: str, spec: ModelSpec, members, test: SiloData, served: int, **extra) -> dict:
    m = evaluate(spec, members, test, **extra)
    return {"row": label, "accuracy": 100 * m["accuracy"], "nll": m["nll"], "ece": m["ece"], "served": served,
            **({"non_finite_inputs": m["non_finite_inputs"]} if m["non_finite_inputs"] else {})}


def centralised(spec: ModelSpec, silos: list[SiloData], start: torch.Tensor, epochs: int, lr: float, temperature: float,
                prior_var: float, prior_mean: torch.Tensor | None, seed: int) -> torch.Tensor:
    """One network (``spec``'s trainable parameters) trained on the pooled silos from ``start`` with the
    silos' own recipe (weight decay T·λ0/n toward ``prior_mean``)."""
    x = torch.cat([s.tensors()[0] for s in silos])
    y = torch.cat([s.tensors()[1] for s in silos])
    model = build_model(spec, start)
    model.train()
    cfg = TrainConfig(epochs=epochs, lr=lr, weight_decay=temperature / prior_var / len(y))
    torch.manual_seed(seed)
    train_map(model, x, y, cfg, seed=seed, desc="centralised", prior_mean=prior_mean)
    return torch.nn.utils.parameters_to_vector(model.parameters()).detach()


def silo_file(work: Path, c: int) -> Path:
    return work / "data" / f"client_{c}.h5"


def cell_data(args, setting: str, alpha: float, seed: int) -> tuple[Path, list[SiloData], SiloData]:
    work = Path(args.work) / setting / f"a{alpha}_s{seed}"
    pool, test_file = prepare(Path(args.work), setting)
    split = work / "data"
    if not (split / "client_0.h5").exists():
        kw = {"test": test_file} if test_file is not None else {"test_size": 400}
        partition_to_files(split, source=pool, clients=args.clients, alpha=alpha, partition_seed=seed,
                           val_size=0, min_size=10 if setting == "same-domain" else 5, **kw)
    silos = [read_silo(split / f"client_{c}.h5") for c in range(args.clients)]
    return work, silos, read_silo(split / "test.h5")


def run_start(args, setting: str, alpha: float, seed: int, spec: ModelSpec, base_path: Path, start: str) -> list[dict]:
    """Every row of one cell for one way of starting: ``scratch`` (shared random starting points) or
    ``base:<finetune>`` (the pretrained base, ``fit-local --finetune``)."""
    work, silos, test = cell_data(args, setting, alpha, seed)
    spec, base, base_sha = read_base(spec, base_path)  # with a BatchNorm model's statistics, frozen at the base's
    rows = [metrics_row("base alone", spec, [base], test, 1)] if start == "base:all" else []
    merge = start.endswith("+merge")  # the artifacts of `fit-local --finetune` merged (`recapture --merge`)
    finetune = start.removesuffix("+merge").split(":", 1)[1] if start != "scratch" else "all"
    if start == "scratch":
        tuned, inits, prior_mean = spec, initial_weights(spec, args.components, seed), None
    else:
        tuned, inits, prior_mean = finetune_start(spec, base, finetune, args.components, seed)
    paths, fit_seconds = [], []
    for c, silo in enumerate(silos):
        out = work / (start.removesuffix("+merge").replace(":", "_") + lr_tag(args.lr)) / f"post_{c}.h5"
        out.parent.mkdir(parents=True, exist_ok=True)
        if not out.exists():
            cfg = fit_config_from({"structure": "kron", "kfac": args.kfac, "epochs": args.epochs, "lr": args.lr,
                                   "temperature": args.temperature, "prior_var": args.prior_var,
                                   "train_seed": 100 * seed + c, "finetune": finetune})
            info = {"init_seed": seed} if start == "scratch" else {"base_sha256": base_sha}
            fit_and_write(tuned, silo, inits, cfg, out, info, log=lambda m: None, prior_mean=prior_mean)
        if merge:
            merged = out.with_name(f"merged_{c}.h5")
            if not merged.exists():
                recapture_to_file(out, silo_file(work, c), merged, None, log=lambda m: None, merge=True)
            out = merged
        paths.append(out)
        for comp in load_client(out).components:
            t = comp.training
            fit_seconds.append((t["curvature_seconds"], t["train_seconds"] / max(1, t["epochs"])))
    with h5py.File(paths[0]) as f:  # the frozen base weights are stored once per artifact, not per component
        frozen = f["frozen"].size * 4 if "frozen" in f else 0
    per_component = statistics.mean(p.stat().st_size - frozen for p in paths) / args.components
    capture = statistics.mean(c for c, _ in fit_seconds) / statistics.mean(e for _, e in fit_seconds)
    tag = ("from random starts" if start == "scratch" else f"base, finetune {finetune}" + (", merged ΔW" if merge else "")
           + ("" if args.lr == 0.01 else f", lr {args.lr:g}"))
    cost = {"artifact_mb_per_component": round(per_component / 2**20, 4),
            "component_pct_of_model": round(100 * per_component / (4 * base.numel()), 2),
            "capture_per_epoch": round(capture, 2)}
    alone = []
    for p in paths:
        art = load_client(p)
        alone.append(evaluate(art.model_spec, [c.map for c in art.components], test)["accuracy"] * 100)
    rows.append({"row": f"each silo alone ({tag})", "accuracy": statistics.mean(alone), "accuracy_min": min(alone),
                 "accuracy_max": max(alone), "served": args.components, **cost})
    served_spec = load_client(paths[0]).model_spec  # the merged artifacts': the whole architecture
    for label, method, settings in FUSIONS:
        t0 = time.time()
        _, res, meta = fuse([str(p) for p in paths], method, FusionOptions(progress=False), settings)
        row = metrics_row(f"{label} ({tag})", served_spec, res.members, test, len(res.members),
                          weights=res.mode_weights, pooling=res.pooling(spec.num_classes))
        row.update(server_seconds=round(time.time() - t0, 1), **cost,
                   **({"far_members_ratio": meta["far_members"]["ratio"]} if "far_members" in meta else {}))
        rows.append(row)
        log(f"{setting} α={alpha} seed {seed} {row['row']}: {row['accuracy']:.2f}")
    if not merge:  # the merged start fuses the same silos' networks: its centralised row is the unmerged one's
        w = centralised(tuned, silos, inits[0], args.epochs, args.lr, args.temperature, args.prior_var, prior_mean, seed)
        rows.append(metrics_row(f"centralised ({tag})", tuned, [w], test, 1))
    for r in rows:
        r.update(setting=setting, alpha=alpha, seed=seed, model=spec.name, epochs=args.epochs,
                 start=start + lr_tag(args.lr), lr=args.lr)
    return rows


def run_refresh(args, setting: str, alpha: float, seed: int, spec: ModelSpec, start: str) -> list[dict]:
    """The refresh round as a lever (``<start>+refresh``): fedbens' default on the start's artifacts, then two
    training-free rounds (each silo recaptures its own artifact at the fused modes, `pfuse refresh`, damping
    auto, its default trust radius) each fused again by the default."""
    work, silos, test = cell_data(args, setting, alpha, seed)
    plain = start.removesuffix("+refresh")
    folder = work / (plain.replace(":", "_") + lr_tag(args.lr))
    paths = [folder / f"post_{c}.h5" for c in range(len(silos))]
    tag = "from random starts" if plain == "scratch" else f"base, finetune {plain.split(':', 1)[1]}"
    rows, current = [], None
    for rnd in range(3):
        inputs, refused = (paths if rnd == 0 else []), 0
        for c, p in enumerate(paths):
            if rnd == 0:
                break
            out = folder / f"refresh{rnd}_{c}.h5"
            try:
                if not out.exists():
                    refresh_to_file(p, silo_file(work, c), current, out, log=lambda m: None,
                                      damping="auto", privacy=RefreshPrivacy(refresh_dp_epsilon=None))
                inputs.append(out)
            except IncompatibleArtifactsError:  # the silo's trust radius refuses the global: recorded, no round
                refused += 1
        if refused:
            rows.append({"row": f"fedbens (default), refresh round {rnd} ({tag})", "refused_by_silos": refused,
                         "accuracy": float("nan"), "served": 0})
            log(f"{setting} α={alpha} seed {seed} refresh round {rnd}: refused by {refused} silo(s)")
            break
        t0 = time.time()
        fused_inputs, res, meta = fuse([str(p) for p in inputs], "fedbens", FusionOptions(progress=False), {})
        current = folder / f"refresh_global{rnd}.h5"
        write_fused(current, fused_inputs, res, meta)
        label = ["one-shot", "after one refresh round", "after two refresh rounds"][rnd]
        row = metrics_row(f"fedbens (default), {label} ({tag})", fused_inputs.spec, res.members, test,
                          len(res.members), weights=res.mode_weights, pooling=res.pooling(spec.num_classes))
        row.update(server_seconds=round(time.time() - t0, 1))
        rows.append(row)
        log(f"{setting} α={alpha} seed {seed} {row['row']}: {row['accuracy']:.2f}")
    for r in rows:
        r.update(setting=setting, alpha=alpha, seed=seed, model=spec.name, epochs=args.epochs,
                 start=start + lr_tag(args.lr), lr=args.lr)
    return rows


SINGLE = ("fedbens (default)", "fedbens, prior centre at the prior", "fedlpa", "fedfisher", "fisher-merge", "regmean",
          "hbfl", "fedavg")


def summary(folder: Path) -> None:
    """One line per (setting, start, α): the client ensemble, the label-shift pool, fedbens' default, the best
    single-network fusion (by mean accuracy over the seeds), centralised fine-tuning of the same parameters,
    each silo alone (mean ± std over seeds; n seeds), and the costs per component (capture ÷ epoch: mean over
    seeds); the JSON files of ``folder`` and its subfolders, one block per model."""
    rows = [r for p in sorted(folder.glob("**/*.json")) for r in json.loads(p.read_text())]

    def cell(vals: list[float]) -> str:
        return f"{statistics.mean(vals):.2f}" + (f" ± {statistics.stdev(vals):.2f}" if len(vals) > 1 else "")

    print("| model | setting | start | α | seeds | silo alone | client ensemble | label-shift pool | fedbens | best "
          "single network | centralised | MB / component (% of the model) | capture ÷ epoch |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for model, setting in sorted({(r["model"], r["setting"]) for r in rows}, key=lambda k: (k[0] != "lenet", k)):
        mine = [r for r in rows if (r["model"], r["setting"]) == (model, setting)]
        for start in sorted(dict.fromkeys(r["start"] for r in mine if "refresh" not in r["start"])):
            for alpha in sorted({r["alpha"] for r in mine}):
                rs = [r for r in mine if (r["start"], r["alpha"]) == (start, alpha)]
                if not rs:
                    continue
                by = {}
                for r in rs:
                    by.setdefault(r["row"].rsplit(" (", 1)[0], []).append(r)
                acc = {k: [r["accuracy"] for r in v] for k, v in by.items()}
                fused = {k: v for k, v in acc.items() if k in SINGLE}
                best = max(fused, key=lambda k: statistics.mean(fused[k]))
                cost = next(r for r in rs if "artifact_mb_per_component" in r)
                capture = statistics.mean(r["capture_per_epoch"] for r in rs if "capture_per_epoch" in r)
                central = cell(acc["centralised"]) if "centralised" in acc else "(unmerged)"
                print(f"| {model} | {setting} | {start} | {alpha} | {len(acc['client ensemble'])} | {cell(acc['each silo alone'])} | "
                      f"{cell(acc['client ensemble'])} | {cell(acc['label-shift pool'])} | "
                      f"{cell(acc['fedbens (default)'])} | {best}: {cell(fused[best])} | {central} | "
                      f"{cost['artifact_mb_per_component']:.3f} ({cost['component_pct_of_model']:.0f} %) | "
                      f"{capture:.2f} |")


def report(folder: Path) -> None:
    rows = [r for p in sorted(folder.glob("*.json")) for r in json.loads(p.read_text())]
    for setting in sorted({r["setting"] for r in rows}):
        alphas = sorted({r["alpha"] for r in rows if r["setting"] == setting})
        print(f"\n{setting}: test accuracy % (mean ± std over seeds) · NLL / ECE\n")
        print("| row | served | " + " | ".join(f"α = {a}" for a in alphas) + " |")
        print("|---|---|" + "---|" * len(alphas))
        labels = list(dict.fromkeys(r["row"] for r in rows if r["setting"] == setting))
        for label in labels:
            cells, served = [], ""
            for a in alphas:
                rs = [r for r in rows if r["setting"] == setting and r["alpha"] == a and r["row"] == label]
                if not rs:
                    cells.append("—")
                    continue
                served = rs[0]["served"]
                if any("refused_by_silos" in r for r in rs):
                    cells.append("refused by the silos' trust radius (" + " / ".join(
                        str(r.get("refused_by_silos", 0)) for r in rs) + f" of {len(rs[0].get('clients', [])) or 5})")
                    continue
                acc = [r["accuracy"] for r in rs]
                sd = f" ± {statistics.stdev(acc):.2f}" if len(acc) > 1 else ""
                nll = f" · {statistics.mean(r['nll'] for r in rs):.3f} / {statistics.mean(r['ece'] for r in rs):.3f}" \
                    if "nll" in rs[0] else ""
                cells.append(f"{statistics.mean(acc):.2f}{sd}{nll} ({len(acc)})")
            print(f"| {label} | {served} | " + " | ".join(cells) + " |")


def sizes(args, spec: ModelSpec, base_path: Path, finetunes: list[str]) -> None:
    """Bytes of one component (the artifact of M = 1 without the frozen base, stored once per artifact) per
    ``--finetune``, structure and compression, against the model's float32 weights: what a silo sends per component.
    The size does not depend on the data or the training length: one epoch on the first 512 images of silo 0."""
    _, silos, _ = cell_data(args, args.setting, 0.4, 0)
    silo = SiloData(silos[0].x[:512], silos[0].y[:512], silos[0].dataset, silos[0].num_classes,
                    transform=silos[0].transform)
    spec, base, base_sha = read_base(spec, base_path)
    print("| --finetune | trained weights (% of the model) | structure | --compress | bytes / component | % of the model |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for finetune in finetunes:
            tuned, inits, prior_mean = finetune_start(spec, base, finetune, 1, 0)
            for structure in ("kron", "diag"):
                for compress in (0.0, 0.05) if structure == "kron" else (0.0,):
                    out = Path(tmp) / f"{finetune.replace(':', '_')}_{structure}_{compress}.h5"
                    cfg = fit_config_from({"structure": structure, "kfac": args.kfac, "epochs": 1, "compress": compress,
                                           "temperature": args.temperature, "prior_var": args.prior_var,
                                           "finetune": finetune})
                    fit_and_write(tuned, silo, inits, cfg, out, {"base_sha256": base_sha}, log=lambda m: None,
                                  prior_mean=prior_mean)
                    with h5py.File(out) as f:
                        frozen = f["frozen"].size * 4 if "frozen" in f else 0
                    size = out.stat().st_size - frozen
                    trained = load_client(out).components[0].map.numel()
                    print(f"| {finetune} | {trained:,} ({100 * trained / base.numel():.1f} %) | {structure} | "
                          f"{compress:g} | {size:,} | {100 * size / (4 * base.numel()):.1f} % |", flush=True)


def lr_tag(lr: float) -> str:
    """The file-name tag of a learning rate other than fit-local's default (none for 0.01, whose files came first)."""
    return "" if lr == 0.01 else f"_lr{lr:g}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--setting", choices=["same-domain", "cross-domain"], default="same-domain")
    ap.add_argument("--alphas", default="0.1,0.4")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--model", default="lenet")
    ap.add_argument("--model-kwargs", default="{}")
    ap.add_argument("--clients", type=int, default=5)
    ap.add_argument("--components", type=int, default=3)
    ap.add_argument("--epochs", type=int, default=5, help="local (and centralised) fine-tuning epochs")
    ap.add_argument("--lr", type=float, default=0.01, help="local (and centralised) SGD learning rate (fit-local's)")
    ap.add_argument("--pretrain-epochs", type=int, default=10)
    ap.add_argument("--starts", default="base:all,scratch,base:head,base:last:2,base:lora:4,base:lora:4+merge",
                    help="comma-separated: scratch (shared random starting points) or base:<fit-local --finetune>, "
                         "with +merge the same artifacts merged into the whole architecture (recapture --merge), "
                         "with +refresh fedbens before and after two refresh rounds on that start's artifacts")
    ap.add_argument("--kfac", default="expand")
    ap.add_argument("--temperature", type=float, default=0.1)
    ap.add_argument("--prior-var", type=float, default=0.1)
    ap.add_argument("--work", default="runs/pretrained_base")
    ap.add_argument("--json-dir", default="docs/results/pretrained_base")
    ap.add_argument("--report", default=None, help="print the table of the JSON files in this folder and exit")
    ap.add_argument("--summary", default=None, help="print the one-line-per-start summary of this folder and exit")
    ap.add_argument("--base-only", action="store_true",
                    help="write the public pretraining file, the silos' pool, the test file and the base under --work, "
                         "then exit (the distillation study's pretrained-base setting starts from them)")
    ap.add_argument("--sizes", default=None, metavar="FINETUNES",
                    help="comma-separated fit-local --finetune values: print the bytes of one component's artifact for "
                         "each, K-FAC and diag, plain and with --compress 0.05 (one epoch on 512 images) and exit")
    args = ap.parse_args()
    if args.report:
        report(Path(args.report))
        return
    if args.summary:
        summary(Path(args.summary))
        return
    spec = ModelSpec(args.model, json.loads(args.model_kwargs))
    prepare(Path(args.work), args.setting)
    base_path = pretrain(Path(args.work), spec, args.pretrain_epochs)
    if args.base_only:
        log(f"base: {base_path}")
        return
    if args.sizes:
        sizes(args, spec, base_path, args.sizes.split(","))
        return
    Path(args.json_dir).mkdir(parents=True, exist_ok=True)
    for seed in [int(s) for s in args.seeds.split(",")]:
        for alpha in [float(a) for a in args.alphas.split(",")]:
            for start in args.starts.split(","):
                out = Path(args.json_dir) / (f"{spec.name}_{args.setting}_a{alpha}_s{seed}_{start.replace(':', '')}"
                                             f"{lr_tag(args.lr)}.json")
                if out.exists():
                    continue
                rows = (run_refresh(args, args.setting, alpha, seed, spec, start) if start.endswith("+refresh")
                        else run_start(args, args.setting, alpha, seed, spec, base_path, start))
                out.write_text(json.dumps(rows, indent=1))
                log(f"wrote {out}")


if __name__ == "__main__":
    main()
