#!/usr/bin/env bash
# Set up .venv with every dependency (torch pinned to the 2.13.0 CPU wheel) and the real
# Fashion-MNIST where apt is usable. Idempotent: re-running it is quick.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
pip_install() { .venv/bin/python -m pip install -q --disable-pip-version-check -c constraints.txt "$@" 2>&1 | grep -v "^WARNING: Location" || true; }
pip_install torch==2.13.0 numpy scipy click h5py tqdm safetensors pytest pytest-xdist ruff matplotlib triton
# laplace-torch and backpack declare torchvision; install them without it and list their real needs.
pip_install --no-deps laplace-torch backpack-for-pytorch curvlinops-for-pytorch asdfghjkl
pip_install einops unfoldNd einconv linear_operator opt_einsum torchmetrics scikit-learn opacus
pip_install "flwr[simulation]"
pip_install --no-deps -e .
if .venv/bin/python -c "import torchvision" >/dev/null 2>&1; then .venv/bin/python -m pip uninstall -y -q torchvision; fi
.venv/bin/python -c "import torch, laplace, h5py, posterior_fusion.cli.main" \
  || { echo "setup: the environment does not import; see the messages above" >&2; exit 1; }

FMNIST=/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz
if [ ! -f "$FMNIST" ]; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    { apt-get install -y -qq dataset-fashion-mnist >/dev/null 2>&1 \
      || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq dataset-fashion-mnist >/dev/null 2>&1; }; } \
      || echo "setup: could not install dataset-fashion-mnist; using the embedded subset in data/" >&2
  else
    echo "setup: apt-get not usable here; the embedded Fashion-MNIST subset in data/ will be used" >&2
  fi
fi
echo "setup: ok ($(.venv/bin/python -c 'import torch; print("torch", torch.__version__)'))" >&2
