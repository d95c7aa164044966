"""Issue 30, item 5 with the refresh round: fedbens started from every client component (C·M modes, the
client ensemble's serving cost), one-shot and after one refresh round at its modes, beside the client
ensemble.

    nice -n 5 .venv/bin/python benchmarks/refresh_clients.py DIR OUT.json

DIR as for refresh_round.py (client_*.h5, post_*.h5, server_val.h5, test.h5).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from measured import save_rows

from posterior_fusion.artifact import write_client_artifact
from posterior_fusion.artifact.reader import load_client
from posterior_fusion.data.silo import read_silo
from posterior_fusion.fusion import FusionOptions, fuse
from posterior_fusion.local.recapture import recapture
from posterior_fusion.metrics import evaluate_members
from posterior_fusion.posterior import GlobalEnsemble


def main() -> None:
    folder, out = Path(sys.argv[1]), sys.argv[2]
    paths = sorted(folder.glob("post_*.h5"))
    silos = [folder / p.name.replace("post_", "client_") for p in paths]
    test, val = read_silo(folder / "test.h5"), folder / "server_val.h5"
    (folder / "refresh").mkdir(exist_ok=True)
    rows = []

    def run(label: str, client_paths, method: str, settings: dict, use_val: bool) -> GlobalEnsemble:
        t0 = time.time()
        inputs, res, _ = fuse(client_paths, method, FusionOptions(progress=False), settings,
                              val_path=val if use_val else None)
        m = evaluate_members(inputs.spec, res.members, test)
        rows.append({"variant": label, "members": len(res.members), "accuracy": m["accuracy"], "nll": m["nll"],
                     "ece": m["ece"], "server_seconds": round(time.time() - t0, 1)})
        print(json.dumps(rows[-1]), flush=True)
        c = inputs.clients[0]
        return GlobalEnsemble(label, f"{len(rows):064d}", c.model_spec, c.layout, {"method": method}, tuple(res.members))

    run("client ensemble", paths, "ensemble", {}, False)
    g = run("fedbens starts=clients (paper's Adam, best validation)", paths, "fedbens", {"starts": "clients"}, True)
    run("fedbens starts=clients, EM stationary, no validation", paths, "fedbens", {"starts": "clients", "solver": "em"},
        False)
    refreshed = []
    for p, s in zip(paths, silos):
        src = load_client(p)
        meta, comps = recapture(src, read_silo(s, num_classes=src.model_spec.num_classes), src.structure, at=g,
                                log=lambda *_: None)
        refreshed.append(folder / "refresh" / f"clients_{p.name}")
        write_client_artifact(refreshed[-1], src.model_spec, src.layout, meta, comps)
    run("refreshed at those modes, EM stationary, no validation", refreshed, "fedbens", {"solver": "em"}, False)
    run("refreshed at those modes, Adam best objective, no validation", refreshed, "fedbens", {}, False)
    save_rows(out, {"clients": [str(p) for p in paths], "rows": rows})


if __name__ == "__main__":
    main()
