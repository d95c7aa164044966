#!/usr/bin/env bash
# The GPU figures of models at real size in one run on a lent GPU machine (docs/benchmarks.md, "On a GPU: models at real
# size"). Run from the repository root on the device machine, with the pure-Python dependencies that its
# image lacks carried as wheels in .whl/ (laplace-torch 0.3, backpack-for-pytorch 1.7.1,
# curvlinops-for-pytorch 3.0.1, unfoldNd, einconv, asdfghjkl):
#
#     bash benchmarks/gpu_real_size.sh            # writes its logs and JSON under $OUT
#
# Parts, each under its own time limit so that one failure leaves the others' figures (at most 560 s; the device tool allows 600 s a call):
#   1. the capture table on the GPU: ResNet-20 widths 16 / 32 / 64 (benchmarks/real_size_bench.py --device cuda);
#   2. whole fedbens CPU vs GPU on width-64 compressed artifacts, C = 5, M = 5 (server_size_bench.py
#      --devices cuda,cpu): set-up, seconds per step, Laplace step, peak RSS, GPU peak against fuse's estimate;
#   3. whole fedbens on the GPU on width-64 plain artifacts, C = 5, M = 5, the paper's 300 Adam steps with the
#      Laplace step (the CPU needs ≈ 62 min for this on 2 cores, docs/benchmarks.md);
#   4. the CUDA tests (tests/test_kernels.py on the GPU, test_fit_on_cuda_equals_cpu).
# At most eight files under $OUT (what the device tool brings back). DRY=1 runs every part small on the CPU (a check of this script where there is no GPU).
set -u
OUT=${OUT:-runs/gpu_real_size}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target runs/site .whl/*.whl || exit 1
fi
# the package maps posterior_fusion.cli to cli/ (pyproject.toml); importing from the tree needs the same
if [ ! -e posterior_fusion/cli ]; then ln -s ../cli posterior_fusion/cli; trap 'rm -f posterior_fusion/cli' EXIT; fi
export PYTHONPATH=$PWD:runs/site
PY=${PY:-python3}
if [ "${DRY:-0}" = 1 ]; then
    DEV=cpu; WIDTHS=4; N=128; SW=4; SN=64; TESTS="tests/test_kernels.py -k cuda_graph"; PLAIN_STEPS=3; XDIST=""
else
    DEV=cuda; WIDTHS=16,32,64; N=1024; SW=64; SN=256; TESTS="tests/test_kernels.py tests/test_real_models.py::test_fit_on_cuda_equals_cpu"; PLAIN_STEPS=300; XDIST="-n 8"
fi
THREADS=$(nproc)
{ date -u; nproc; free -g | head -2; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1
  $PY -c "import torch, laplace, curvlinops, posterior_fusion.cli.main as m; print('torch', torch.__version__, 'cuda', torch.cuda.is_available() and torch.cuda.get_device_name())"
} > "$OUT/summary.txt" 2>&1
cat "$OUT/summary.txt"

part() {  # part NAME SECONDS COMMAND...: one part under its own limit, its exit status and seconds logged
    local name=$1 limit=$2; shift 2
    local t0=$SECONDS
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    echo "part $name: exit $rc, $((SECONDS - t0)) s" | tee -a "$OUT/summary.txt"
    tail -n 4 "$OUT/$name.log"
}

# capture first (launch-bound at small batches), then the
# servers, then the tests (their slowest are CPU tests: two threads per worker keeps 8 workers off each other;
# -v names each result as it comes, so a run stopped at its limit still says which test failed)
part capture 100 $PY benchmarks/real_size_bench.py --device "$DEV" --widths "$WIDTHS" --n "$N" --threads "$THREADS" \
    --json "$OUT/capture_gpu.json"
part server_compressed 180 $PY benchmarks/server_size_bench.py --width "$SW" --clients 5 --components 5 --n "$SN" \
    --steps 3,9 --compress 0.05 --devices "$DEV,cpu" --max-memory 64G --json "$OUT/server_w64_c5_m5_compress0.05.json"
part server_plain 130 $PY benchmarks/server_size_bench.py --width "$SW" --clients 5 --components 5 --n "$SN" \
    --whole "steps=$PLAIN_STEPS,solver=adam" --devices "$DEV" --max-memory 64G --json "$OUT/server_w64_c5_m5_plain_whole.json"
# shellcheck disable=SC2086
OMP_NUM_THREADS=2 part tests 150 $PY -m pytest -v --tb=short -p no:cacheprovider $XDIST --durations=5 $TESTS
grep "^part " "$OUT/summary.txt"
