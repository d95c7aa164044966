"""The wheel carries the embedded data and the Flower app: install it into a fresh environment outside
the repository and run `pfuse demo --quick` from another folder."""

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


def _build_wheel(tmp_path: Path, folder: Path) -> str:
    """The project's wheel, built into ``folder`` from a copy (the checkout gets no build/ or egg-info folders)."""
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".venv", ".git", "runs", "logs", "build", "*.egg-info",
                                                             "__pycache__", "demo-run"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(folder), str(src)], check=True, capture_output=True, timeout=300)
    return glob.glob(str(folder / "posterior_fusion-*.whl"))[0]


def test_wheel_in_a_fresh_environment_runs_the_demo(tmp_path):
    wheel = _build_wheel(tmp_path, tmp_path / "wheel")
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
    app = fresh / "share" / "posterior-fusion" / "examples" / "flower" / "pyproject.toml"  # the Flower app ships too
    assert app.read_text() == (ROOT / "examples" / "flower" / "pyproject.toml").read_text()
    demo = subprocess.run([str(python), "-c", "from posterior_fusion.cli.main import main; main()", "demo", "--quick",
                           "--out-dir", "run", "--json"], cwd=work, capture_output=True, text=True, timeout=600, env=env)
    assert demo.returncode == 0, demo.stderr[-2000:]
    assert "fashion-mnist-subset" in demo.stderr and str(fresh) in demo.stderr  # says which data it used
    assert '"method": "fedbens"' in demo.stdout
    rows = json.loads(demo.stdout)
    # the quick demo demonstrates: every row well above chance (10 classes: 10 %)
    assert {r["method"] for r in rows} == {"default", "fedbens", "fedavg"} and min(r["accuracy"] for r in rows) > 0.35, rows


def _dummy_wheel(folder: Path, name: str, version: str, requires: tuple[str, ...] = ()) -> None:
    """A minimal wheel (metadata only) of ``name`` ``version`` requiring ``requires``."""
    import zipfile

    dist = f"{name.replace('-', '_')}-{version}"
    meta = "Metadata-Version: 2.1\n" f"Name: {name}\nVersion: {version}\n" + "".join(f"Requires-Dist: {r}\n" for r in requires)
    files = {f"{dist}.dist-info/METADATA": meta,
             f"{dist}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    files[f"{dist}.dist-info/RECORD"] = "".join(f"{p},,\n" for p in files) + f"{dist}.dist-info/RECORD,,\n"
    with zipfile.ZipFile(folder / f"{dist}-py3-none-any.whl", "w") as z:
        for path, text in files.items():
            z.writestr(path, text)


def test_installing_the_wheel_keeps_the_installed_torch(tmp_path):
    """The resolver's real choice, offline: a local index offers a newer torch and a torchvision that needs
    it (as PyPI does), and a laplace-torch that needs torchvision (as its metadata does); installing the
    wheel with every extra but flower into this environment (torch installed) installs no torch,
    torchvision or CUDA package. (Had the package required laplace-torch, pip would pick torchvision 99 and
    with it torch 99: the dummy index makes that choice possible.)"""
    index = tmp_path / "index"
    wheel = _build_wheel(tmp_path, index)
    _dummy_wheel(index, "torch", "99.0")
    _dummy_wheel(index, "nvidia-cuda-runtime", "99.0")
    _dummy_wheel(index, "torchvision", "99.0", ("torch==99.0", "nvidia-cuda-runtime"))
    _dummy_wheel(index, "laplace-torch", "0.3", ("torch", "torchvision"))
    report = tmp_path / "report.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}  # Ray's PYTHONPATH shows the checkout
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--no-index", "--find-links", str(index),
                        "--report", str(report), "-q", f"{wheel}[data,plot]"], capture_output=True, text=True, timeout=300,
                       env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    names = {i["metadata"]["name"].lower() for i in json.loads(report.read_text())["install"]}
    assert "posterior-fusion" in names and not names & {"torch", "torchvision", "nvidia-cuda-runtime", "laplace-torch"}, names
    # the laplace extra is what would pull them: the dummy index makes the resolver's choice visible
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--no-index", "--find-links", str(index),
                        "--report", str(report), "-q", f"{wheel}[laplace]"], capture_output=True, text=True, timeout=300)
    picked = {i["metadata"]["name"].lower() for i in json.loads(report.read_text())["install"]} if r.returncode == 0 else set()
    assert r.returncode != 0 or "torch" in picked, (r.returncode, picked)
