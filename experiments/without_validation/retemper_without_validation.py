"""Server-side tempering of the client posteriors under fedbens' default without validation data (
"candidates to measure side by side — … server-side tempering of the client posteriors"), on ``pfuse demo`` folders.

    OMP_NUM_THREADS=1 nice -n 19 .venv/bin/python experiments/without_validation/retemper_without_validation.py runs/s25/a0.1_s3 \\
        --json docs/results/without_validation/retemper/a0.1_s3.json
    .venv/bin/python experiments/without_validation/retemper_without_validation.py --report docs/results/without_validation/retemper/*.json

Per folder: the default fusion without validation data (``solver=auto``: EM, prior centre clients, server prior from
the evidence) with every client re-tempered to T (``fuse --temperature T``; ``None``: the clients' own T), beside the
paper's Adam with its best validation iterate at the clients' T (the goal's reference); each evaluated with the
``map`` predictive on the folder's test split (``default_without_validation.run`` / ``report`` with these rows).
One JSON per folder.
"""

from __future__ import annotations

import default_without_validation

TEMPERATURES = (None, 0.03, 0.3, 1.0)  # None: the clients' own T (0.1 in the demo)
REFERENCE = "adam, best validation iterate, clients' T"
ROWS = [(f"default, no validation, T = {'clients' if t is None else t}", {}, False, t) for t in TEMPERATURES] + [
    (REFERENCE, {"solver": "adam"}, True, None)]

if __name__ == "__main__":
    default_without_validation.main(ROWS, REFERENCE, __doc__)
