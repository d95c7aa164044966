"""The wheel carries the embedded data: install it into a fresh environment outside the
repository and run `pfuse demo --quick` from another folder."""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_in_a_fresh_environment_runs_the_demo(tmp_path):
    # Build from a copy, so the checkout gets no build/ or egg-info folders.
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".venv", ".git", "runs", "build", "*.egg-info",
                                                             "__pycache__", "demo-run"))
    wheel_dir = tmp_path / "wheel"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(wheel_dir), str(src)], check=True, capture_output=True, timeout=300)
    wheel = glob.glob(str(wheel_dir / "posterior_fusion-*.whl"))[0]
    fresh = tmp_path / "fresh"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(fresh)], check=True, timeout=120)
    # offline (--no-index: the local wheel only); --ignore-installed: never uninstall the project's own
    # (editable) install from this environment
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--ignore-installed", "--prefix",
                    str(fresh), wheel], check=True, capture_output=True, timeout=300)
    # Dependencies (torch, h5py, ...) come from the project environment's site-packages; a path added
    # through a .pth file is not a site dir, so the project's own editable install stays inactive.
    site = next((fresh / "lib").glob("python*/site-packages"))
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    work = tmp_path / "elsewhere"
    work.mkdir()
    # a clean environment: no PYTHONPATH (Ray, used by other tests, exports one pointing at the checkout)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    python = fresh / "bin" / "python"
    where = subprocess.run([str(python), "-c", "import posterior_fusion.data.idx as i; print(i.__file__); "
                            "print(i.EMBEDDED_FMNIST_DIR)"], cwd=work, capture_output=True, text=True, timeout=120, env=env)
    assert where.returncode == 0, where.stderr
    module, data = where.stdout.split()
    assert module.startswith(str(fresh)) and data.startswith(str(fresh)), where.stdout
    demo = subprocess.run([str(python), "-c", "from posterior_fusion.cli.main import main; main()", "demo", "--quick",
                           "--out-dir", "run", "--json"], cwd=work, capture_output=True, text=True, timeout=600, env=env)
    assert demo.returncode == 0, demo.stderr[-2000:]
    assert "fashion-mnist-subset" in demo.stderr and str(fresh) in demo.stderr  # says which data it used
    assert '"method": "fedbens"' in demo.stdout
    rows = json.loads(demo.stdout)
    # the quick demo demonstrates: every row well above chance (10 classes: 10 %)
    assert {r["method"] for r in rows} == {"default", "fedbens", "fedavg"} and min(r["accuracy"] for r in rows) > 0.35, rows
