"""scripts/progress.sh, which the test command (scripts/test.sh) and the vLLM
venv's set-up use for every pip run: progress while it runs, the expected
resolver complaints of packages installed without their pins folded into one
line, and a failure that still fails the script. Real bash, real processes;
the "pip" is a stand-in command printing what pip prints."""
from __future__ import annotations

import subprocess
from pathlib import Path

PROGRESS = Path(__file__).resolve().parents[1] / "scripts" / "progress.sh"

PIP_OUTPUT = r"""
printf '%s\n' "WARNING: Location 'file:///opt/pypi/simple/x/' is ignored: it is neither a file nor a directory." \
  "ERROR: pip's dependency resolver does not currently take into account all the packages that are installed." \
  "sglang 0.5.23 requires torchao==0.9.0, which is not installed." \
  "sglang 0.5.23 requires xgrammar==0.1.19, which is not installed." \
  "sglang 0.5.23 has requirement torch==2.8.0, but you have torch 2.13.0+cpu." \
  "other 1.0 requires zzz, which is not installed." \
  "Successfully installed psutil-7.0"
"""


def run(script: str, tmp_path: Path, heartbeat_s: int = 30) -> subprocess.CompletedProcess:
    body = f"set -euo pipefail\nsource {PROGRESS}\n{script}\n"
    return subprocess.run(["bash", "-c", body], capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin", "PIP_LOG_DIR": str(tmp_path / "logs"),
                               "HEARTBEAT_S": str(heartbeat_s)})


def test_expected_conflicts_become_one_counted_line_and_the_rest_is_shown(tmp_path):
    fake = tmp_path / "fake_pip.sh"
    fake.write_text(PIP_OUTPUT)
    r = run(f'pip_run --conflicts-expected-of sglang "sglang, no deps" bash {fake}\necho after', tmp_path)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert out.count("3 dependency conflicts of sglang are expected") == 1
    assert "torchao" not in out and "has requirement torch" not in out      # folded
    assert "resolver does not currently take into account" not in out
    assert "is ignored" not in out                                            # the missing local index folders
    assert "other 1.0 requires zzz" in out                                    # not expected: shown
    assert "Successfully installed psutil-7.0" in out and out.rstrip().endswith("after")
    log = next((tmp_path / "logs").iterdir()).read_text()
    assert "torchao" in log                                                   # the whole output stays in the log


def test_without_expected_packages_every_conflict_is_shown(tmp_path):
    fake = tmp_path / "fake_pip.sh"
    fake.write_text(PIP_OUTPUT)
    r = run(f'pip_run "plain" bash {fake}', tmp_path)
    assert r.returncode == 0
    assert "sglang 0.5.23 requires torchao" in r.stdout and "expected" not in r.stdout


def test_a_failed_install_fails_the_script_and_says_where_its_log_is(tmp_path):
    r = run('pip_run "a package that is not there" bash -c "echo ERROR: No matching distribution; exit 1"\n'
            'echo after', tmp_path)
    assert r.returncode == 1
    assert "No matching distribution" in r.stdout and "FAILED (exit 1)" in r.stdout
    assert "after" not in r.stdout


def test_a_long_install_says_it_is_still_running(tmp_path):
    r = run('pip_run "slow" sleep 2.5', tmp_path, heartbeat_s=1)
    assert r.returncode == 0
    assert r.stdout.count("slow: still running") >= 1 and "done: slow" in r.stdout
