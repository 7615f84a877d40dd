# Sourced by scripts/test.sh and scripts/setup_vllm_env.sh: timestamped
# progress lines, and pip runs that show they are alive and keep the
# resolver's expected complaints to one line.

# pip's own advice to use a venv when run as root: test.sh prints its own,
# once (CI runs it as root on purpose).
export PIP_ROOT_USER_ACTION=ignore
PIP_LOG_DIR="${PIP_LOG_DIR:-${TMPDIR:-/tmp}/kvstore-pip-logs}"
HEARTBEAT_S="${HEARTBEAT_S:-30}"

say() { printf '%s  %s\n' "$(date +%H:%M:%S)" "$*"; }

# pip_run [--conflicts-expected-of 'PKG|PKG'] LABEL COMMAND...
#
# Runs COMMAND (a pip command) with its output in a log, saying every
# HEARTBEAT_S seconds that it is still running. Afterwards the log is shown,
# except: resolver conflict lines of the named packages (installed without
# their pins on purpose; pip reports them again after every later install
# that touches them) become one counted line pointing at the log, and pip's
# notes that a configured local index folder is missing on this machine
# ("WARNING: Location 'file:///...' is ignored") are dropped. Returns
# COMMAND's status, so under `set -e` a failed install fails the script.
pip_run() {
    local expected=""
    if [ "$1" = "--conflicts-expected-of" ]; then expected="$2"; shift 2; fi
    local label="$1"; shift
    mkdir -p "$PIP_LOG_DIR"
    local log="$PIP_LOG_DIR/$(printf '%s' "$label" | tr -c 'A-Za-z0-9._-' '_').log"
    local start=$SECONDS status=0
    say "pip: $label"
    "$@" >"$log" 2>&1 &
    local pid=$! beat=$((start + HEARTBEAT_S))
    while kill -0 "$pid" 2>/dev/null; do
        sleep 1
        if [ "$SECONDS" -ge "$beat" ] && kill -0 "$pid" 2>/dev/null; then
            say "  ... $label: still running ($((SECONDS - start)) s; log: $log)"
            beat=$((beat + HEARTBEAT_S))
        fi
    done
    wait "$pid" || status=$?
    local conflict="^(${expected:-\$^}) [^ ]+ (requires|has requirement) "
    local header="^ERROR: pip's dependency resolver does not currently take into account"
    local location="^WARNING: Location '[^']*' is ignored"
    local conflicts
    conflicts=$(grep -cE "$conflict" "$log" || true)
    if [ "$conflicts" -gt 0 ]; then
        grep -vE "$conflict|$header|$location" "$log" || true
        say "pip: $conflicts dependency conflicts of ${expected//|//} are expected (installed without their pins); log: $log"
    else
        grep -vE "$location" "$log" || true
    fi
    if [ "$status" -ne 0 ]; then
        say "pip: $label FAILED (exit $status); full log: $log"
    else
        say "  done: $label ($((SECONDS - start)) s)"
    fi
    return "$status"
}
