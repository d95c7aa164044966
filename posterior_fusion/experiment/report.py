"""Tables and plots of an experiment's per-run rows (mean ± std over seeds)."""

from __future__ import annotations

import csv
import io
import math
from pathlib import Path

from posterior_fusion.experiment.grid_config import ExperimentConfig
from posterior_fusion.files import write_atomically, write_text_atomically
from posterior_fusion.fusion.registry import MODES_METHOD


def aggregate(rows: list[dict]) -> list[dict]:
    """Mean ± std over seeds for each (structure, M, method, temperature, α, clients)."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        k = (r["structure"], r["M"], r["method"], r["temperature"], r["alpha"], r["clients"])
        groups.setdefault(k, []).append(r)
    out = []
    for (structure, M, method, temp, alpha, clients), rs in sorted(groups.items(), key=lambda kv: str(kv[0])):
        accs = [100 * r["accuracy"] for r in rs]
        mean = sum(accs) / len(accs)
        std = math.sqrt(sum((a - mean) ** 2 for a in accs) / (len(accs) - 1)) if len(accs) > 1 else 0.0
        out.append({"structure": structure, "M": M, "method": method, "temperature": temp, "alpha": alpha,
                    "clients": clients, "seeds": len(rs), "accuracy_mean": round(mean, 2), "accuracy_std": round(std, 2),
                    "nll_mean": round(sum(r["nll"] for r in rs) / len(rs), 4),
                    "ece_mean": round(sum(r.get("ece", math.nan) for r in rs) / len(rs), 4),
                    # serving cost: networks evaluated per prediction (x the model's parameters)
                    "members": rs[0].get("members", 1)})
    return out


def _savefig(fig, path: Path, **kwargs) -> None:
    write_atomically(path, lambda tmp: fig.savefig(tmp, format="png", **kwargs))


def write_tables(rows: list[dict], work: Path, cfg: ExperimentConfig) -> None:
    agg = aggregate(rows)
    buf = io.StringIO(newline="")
    w = csv.DictWriter(buf, fieldnames=list(agg[0]) if agg else ["empty"])
    w.writeheader()
    w.writerows(agg)
    write_text_atomically(work / "results.csv", buf.getvalue())
    settings = sorted({(a["clients"], a["alpha"]) for a in agg})  # one column per (C, α): a grid may vary both
    several_c = len({c for c, _ in settings}) > 1

    def label(c: int, alpha: float) -> str:
        return f"C={c}, α={alpha}" if several_c else f"α={alpha}"

    lines = [f"# {cfg.name}: test accuracy % (mean ± std over seeds)", "",
             "| structure | M | method | T | " + " | ".join(label(c, al) for c, al in settings) + " |",
             "|---|---|---|---|" + "---|" * len(settings)]
    keyed: dict[tuple, dict] = {}
    for a in agg:
        keyed.setdefault((a["structure"], a["M"], a["method"], a["temperature"]), {})[(a["clients"], a["alpha"])] = a
    for (structure, M, method, temp), by_setting in keyed.items():
        cells = [f"{by_setting[k]['accuracy_mean']:.2f} ± {by_setting[k]['accuracy_std']:.2f} ({by_setting[k]['seeds']})"
                 if k in by_setting else "–" for k in settings]
        lines.append(f"| {structure} | {M} | {method} | {temp} | " + " | ".join(cells) + " |")
    lines += ["", "## Accuracy, NLL, ECE and serving cost (members = networks per prediction)", ""]
    for c, alpha in settings:
        lines += [label(c, alpha).replace("=", " = ") + ":", "",
                  "| structure | M | method | T | accuracy % | NLL | ECE | members |", "|---|---|---|---|---|---|---|---|"]
        rows_here = (a for a in agg if (a["clients"], a["alpha"]) == (c, alpha))
        for a in sorted(rows_here, key=lambda a: -a["accuracy_mean"]):
            lines.append(f"| {a['structure']} | {a['M']} | {a['method']} | {a['temperature']} | "
                         f"{a['accuracy_mean']:.2f} ± {a['accuracy_std']:.2f} | {a['nll_mean']:.3f} | "
                         f"{a['ece_mean']:.3f} | {a['members']} |")
        lines.append("")
    write_text_atomically(work / "results.md", "\n".join(lines) + "\n")
    plot_results(agg, work, max(cfg.components))


STRUCTURE_ORDER = ("kron", "diag+full", "diag")  # line styles solid, dashed, dotted in that order


def plot_results(agg: list[dict], work: Path, m_max: int) -> None:
    """accuracy vs α (or vs C for a one-α grid) per method, structure and client count; fedbens accuracy
    vs M; fedbens accuracy vs server temperature."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    # accuracy against α (one line per method, structure and client count), or against the client
    # count C when the grid has one α and several C (Table 2)
    alphas = sorted({a["alpha"] for a in agg})
    client_counts = sorted({a["clients"] for a in agg})
    structures = sorted({a["structure"] for a in agg if a["structure"] != "-"})
    x_key, others = ("clients", alphas) if len(alphas) == 1 and len(client_counts) > 1 else ("alpha", client_counts)
    # one colour per method, one line style per structure (the same method reads alike across structures)
    colours = {m: f"C{i % 10}" for i, m in enumerate(sorted({a["method"] for a in agg} - {"centralized"}))}
    colours["centralized"] = "black"
    ranked = sorted(structures, key=lambda s: (STRUCTURE_ORDER.index(s) if s in STRUCTURE_ORDER else len(STRUCTURE_ORDER), s))
    styles = {s: ("-", "--", ":", "-.")[i % 4] for i, s in enumerate(ranked)} | {"-": "-"}
    fig, ax = plt.subplots(figsize=(7, 4))
    for structure in sorted({a["structure"] for a in agg}):
        for method in sorted({a["method"] for a in agg if a["structure"] == structure}):
            for j, other in enumerate(others):  # several client counts (or α) on one axis: one marker each
                pts = sorted((a[x_key], a["accuracy_mean"]) for a in agg
                             if (a["structure"], a["method"]) == (structure, method)
                             and a["clients" if x_key == "alpha" else "alpha"] == other
                             and a["M"] in (m_max, 1 if method == "centralized" else m_max))
                label = method if len(structures) <= 1 or structure == "-" else f"{method} ({structure})"
                if len(others) > 1:
                    label += f", C={other}" if x_key == "alpha" else f", α={other}"
                if pts:
                    ax.plot(*zip(*pts), marker="osD^v"[j % 5], label=label, color=colours[method],
                            linestyle=styles[structure])
    ax.set_xscale("log")
    xs = sorted({a[x_key] for a in agg})
    ax.set_xticks(xs, [f"{x:g}" for x in xs])  # the grid's own values, not powers of ten
    ax.minorticks_off()
    ax.set_xlabel("Dirichlet α" if x_key == "alpha" else "clients C")
    ax.set_ylabel("test accuracy %")
    if ax.lines:
        ax.legend(fontsize=6, loc="center left", bbox_to_anchor=(1.01, 0.5))  # beside the axes, not over the lines
    fig.tight_layout()
    _savefig(fig, work / ("accuracy_vs_alpha.png" if x_key == "alpha" else "accuracy_vs_clients.png"), dpi=100,
                bbox_inches="tight")
    plt.close(fig)
    for name, key, sel in (("accuracy_vs_M.png", "M", lambda a: a["method"] == MODES_METHOD),
                           ("accuracy_vs_temperature.png", "temperature",
                            lambda a: a["method"] == MODES_METHOD and a["M"] == m_max)):
        fig, ax = plt.subplots(figsize=(5, 4))
        for structure, c, alpha in sorted({(a["structure"], a["clients"], a["alpha"]) for a in agg if sel(a)}):
            pts = sorted((a[key], a["accuracy_mean"]) for a in agg
                         if sel(a) and (a["structure"], a["clients"], a["alpha"]) == (structure, c, alpha))
            label = f"α={alpha}" if len(client_counts) == 1 else f"C={c}, α={alpha}"
            if len(pts) > 1:
                ax.plot(*zip(*pts), marker="o", label=label if len(structures) <= 1 else f"{structure}, {label}")
        ax.set_xlabel(key)
        ax.set_ylabel("fedbens test accuracy %")
        if key == "temperature":
            ax.set_xscale("log")
        if ax.lines:  # a grid with one M (or one temperature) has nothing to draw here
            ax.legend(fontsize=7)
        fig.tight_layout()
        _savefig(fig, work / name, dpi=100)
        plt.close(fig)
