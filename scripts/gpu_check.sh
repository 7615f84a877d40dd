#!/usr/bin/env bash
# The GPU check, in one run on a CUDA machine with no network (issue 4):
#   1. install wheels carried in ./.whl (xxhash is needed by `import kvstore`;
#      redis + lz4 by the collection of the whole suite; click + rich by the CLI),
#   2. install kvstore without touching dependencies,
#   3. `pytest -m gpu -q` (whole suite, GPU-marked tests only), and the HBM test
#      file in full (CPU twin + GPU), which needs nothing beyond numpy/cupy/xxhash,
#   4. `python3 -m kvstore bench tiers --tiers hbm,dram --json $OUT/bench.json`,
#      plus the HBM bench alone at two block sizes and both host kinds.
# Logs and JSON go to $OUT (default ./gpu_out). Exit status: 0 only if every step passed.
#
#   OUT=/some/dir bash scripts/gpu_check.sh
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT="${OUT:-$PWD/gpu_out}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
status=0

step() { printf '\n== %s\n' "$*" | tee -a "$OUT/summary.log"; }
record() {  # record NAME RC
    printf '%s: rc=%s\n' "$1" "$2" | tee -a "$OUT/summary.log"
    [ "$2" = 0 ] || status=1
}

step "environment"
{
    nvidia-smi || true
    "$PY" -c "import sys, numpy; print(sys.version); print('numpy', numpy.__version__)"
    "$PY" -c "import cupy; r = cupy.cuda.runtime; print('cupy', cupy.__version__, r.runtimeGetVersion(), r.getDeviceCount())"
    "$PY" -c "import torch; print('torch', torch.__version__, torch.cuda.is_available())" || true
} > "$OUT/env.log" 2>&1
tail -n 4 "$OUT/env.log"

step "wheels from ./.whl"
if compgen -G ".whl/*.whl" > /dev/null; then
    "$PY" -m pip install --no-deps --no-index .whl/*.whl > "$OUT/wheels.log" 2>&1
    record wheels $?
else
    echo "no .whl folder: only what the machine has" | tee -a "$OUT/summary.log"
fi

step "install kvstore"
"$PY" -m pip install --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1
rc=$?; record install $rc
[ $rc = 0 ] || { tail -n 20 "$OUT/install.log"; exit 1; }

step "pytest -m gpu -q"
timeout 300 "$PY" -m pytest -m gpu -q -p no:cacheprovider > "$OUT/pytest_gpu.log" 2>&1
record "pytest -m gpu" $?
tail -n 15 "$OUT/pytest_gpu.log"

step "pytest tests/tiers/test_hbm.py (CPU twin + GPU)"
timeout 300 "$PY" -m pytest -q -p no:cacheprovider tests/tiers/test_hbm.py > "$OUT/pytest_hbm.log" 2>&1
record "pytest test_hbm.py" $?
tail -n 5 "$OUT/pytest_hbm.log"

step "kvstore bench tiers --tiers hbm,dram"
timeout 300 "$PY" -m kvstore bench tiers --tiers hbm,dram --json "$OUT/bench.json" > "$OUT/bench.log" 2>&1
record "bench tiers" $?
tail -n 14 "$OUT/bench.log"

step "hbm bench alone: 256KiB and 2MiB, pinned and pageable host buffers"
timeout 240 "$PY" -m kvstore.bench.hbm_raw --device cuda --block-bytes 256KiB,2MiB --blocks 128 \
    --repeats 5 --hosts pinned,pageable --json "$OUT/hbm_raw.json" > "$OUT/hbm_raw.log" 2>&1
record "hbm_raw" $?
cat "$OUT/hbm_raw.log"

step "done: status $status"
exit $status
