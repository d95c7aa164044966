"""``posterior_fusion/fusion/from_files.py``: ``fuse --dry-run`` says, from the headers alone, what the fusion will
hold — the same estimate the fusion itself records — and writes nothing; over the memory limit it is refused in one
line, as the fusion would be."""

from __future__ import annotations

import json

from click.testing import CliRunner
from conftest import fit_split

import posterior_fusion
from posterior_fusion.cli.main import pfuse


def test_a_dry_run_reports_what_the_fusion_holds_and_writes_nothing(tmp_path, small_silo):
    two_clients = fit_split(tmp_path, small_silo, 2, 100, "diag", mixtures=2)
    out = tmp_path / "g.h5"
    args = ["fuse", *map(str, two_clients), "--method", "fedavg", "--out", str(out)]
    r = CliRunner().invoke(pfuse, [*args, "--dry-run", "--json"])
    assert r.exit_code == 0, r.output
    plan = json.loads(r.stdout)
    assert not out.exists()
    assert plan["clients"] == 2 and plan["artifact_bytes"] == sum(p.stat().st_size for p in two_clients)
    text = CliRunner().invoke(pfuse, [*args, "--dry-run"])
    assert text.exit_code == 0 and "2 client headers valid" in text.stdout and "nothing fused" in text.stdout
    assert CliRunner().invoke(pfuse, args).exit_code == 0
    assert posterior_fusion.load(out).metadata["memory_estimate_bytes"] == plan["memory_estimate_bytes"]
    small = CliRunner().invoke(pfuse, [*args, "--dry-run", "--max-memory", str(plan["memory_estimate_bytes"] - 1)])
    assert small.exit_code == 2 and small.stderr.count("\n") == 1 and "over the limit" in small.stderr
