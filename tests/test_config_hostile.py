"""Config input a hostile or careless hand gives (issue 25): a config file
that never ends or never opens, an environment that would swap the file's
tenants, a guessable key secret. Each is a ConfigError naming what is at
fault, never a hang, a MemoryError or a silent replacement.
"""
from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from kvstore.config import Config
from kvstore.config_load import MAX_CONFIG_BYTES, load_config
from kvstore.daemon.tenants import load_key_secret, weak_secret
from kvstore.errors import ConfigError

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
TENANTS = [{"name": "teamA", "token": "token-team-a-1"}]


def _address_space_limit() -> None:
    """In a child: 2 GiB of address space, so a read without a bound fails
    fast instead of taking the machine's memory."""
    resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))


def serve(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``kvstore serve ARGS`` (with 2 GiB of address space)."""
    return subprocess.run([sys.executable, "-m", "kvstore", "serve", *args], capture_output=True, text=True,
                          env={**ENV, **(env or {})}, timeout=45, preexec_fn=_address_space_limit)


# -- 1. files that are not config files ---------------------------------------------------------
LOAD = """
import sys
from kvstore.config_load import load_config
from kvstore.errors import ConfigError
try:
    load_config(sys.argv[1] or None, env={"KVSTORE_CONFIG": sys.argv[2]} if sys.argv[2] else {})
except ConfigError as exc:
    print(exc)
"""


def test_dev_zero_as_config_is_a_config_error_not_a_memory_error():
    """In a child with 2 GiB of address space: read whole, /dev/zero would take all there is."""
    for path, variable, said in (("/dev/zero", "", "config /dev/zero: not a regular file (a device)"),
                                 ("", "/dev/zero", "$KVSTORE_CONFIG names /dev/zero: not a regular file")):
        out = subprocess.run([sys.executable, "-c", LOAD, path, variable], capture_output=True, text=True,
                             env=ENV, timeout=45, preexec_fn=_address_space_limit)
        assert out.returncode == 0 and out.stdout.startswith(said), out.stdout + out.stderr


def test_a_fifo_as_config_does_not_hang(tmp_path):
    fifo = tmp_path / "kv.toml"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError, match=r"not a regular file \(a FIFO\)"):
        load_config(fifo, env={})


def test_a_directory_or_an_oversized_file_as_config(tmp_path):
    with pytest.raises(ConfigError, match=r"cannot read it: Is a directory"):
        load_config(tmp_path, env={})
    big = tmp_path / "big.toml"
    big.write_bytes(b"#" * (MAX_CONFIG_BYTES + 1))
    with pytest.raises(ConfigError, match=f"^config {big}: larger than 1,048,576 bytes"):
        load_config(big, env={})
    big.write_bytes(b"#" * MAX_CONFIG_BYTES)           # at the bound: read
    assert load_config(big, env={}) == Config()


def test_serve_with_dev_zero_or_a_fifo_as_config_says_one_error_line(tmp_path):
    """Before: a MemoryError traceback (/dev/zero), and a start that hung (a FIFO)."""
    fifo = tmp_path / "fifo.toml"
    os.mkfifo(fifo)
    for args, env in (((("--config", "/dev/zero")), {}), ((("--unix", str(tmp_path / "kv.sock"))),
                                                          {"KVSTORE_CONFIG": str(fifo)})):
        out = serve(*args, env=env)
        assert out.returncode == 2, out.stderr
        assert out.stderr.count("\n") == 1 and out.stderr.startswith("error: "), out.stderr
        assert "not a regular file" in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "kv.sock").exists()


# -- 2. an environment that would replace the file's tenants ------------------------------------
def test_the_environment_does_not_silently_replace_the_files_tenants(tmp_path):
    cfg = tmp_path / "kv.json"
    cfg.write_text(json.dumps({"daemon": {"tenants": TENANTS}}))
    swapped = json.dumps([{"name": "mallory", "token": "mallory-token-1"}])
    with pytest.raises(ConfigError) as err:
        load_config(cfg, env={"KVSTORE_DAEMON_TENANTS": swapped})
    assert str(cfg) in str(err.value) and "$KVSTORE_DAEMON_TENANTS" in str(err.value)
    assert "mallory-token-1" not in str(err.value)
    # either source alone is fine; so is the environment beside a file that gives no tenants
    assert [t.name for t in load_config(cfg, env={}).daemon.tenants] == ["teamA"]
    assert [t.name for t in load_config(env={"KVSTORE_DAEMON_TENANTS": swapped}).daemon.tenants] == ["mallory"]
    cfg.write_text(json.dumps({"daemon": {"drain_timeout_s": 5}}))
    assert [t.name for t in load_config(cfg, env={"KVSTORE_DAEMON_TENANTS": swapped}).daemon.tenants] == ["mallory"]


def test_serve_names_both_sources_of_tenants(tmp_path):
    cfg = tmp_path / "kv.json"
    cfg.write_text(json.dumps({"daemon": {"listen": {"unix_path": str(tmp_path / "kv.sock")}, "tenants": TENANTS}}))
    out = serve("--config", str(cfg), env={"KVSTORE_DAEMON_TENANTS": json.dumps(TENANTS)})
    assert out.returncode == 2
    assert out.stderr == (f"error: daemon.tenants is given by both --config {cfg} and $KVSTORE_DAEMON_TENANTS; "
                          "a variable does not replace the file's tenants: unset KVSTORE_DAEMON_TENANTS, or "
                          "remove them from the file\n")


# -- 3. a guessable key secret ------------------------------------------------------------------
@pytest.mark.parametrize("secret", ["aaaaaaaaaaaaaaaa", "abababababababab", "abcdefghabcdefgh", "passwordpassword",
                                    "0000000000000000000000000000000000000000"])
def test_a_guessable_key_secret_is_refused_without_echoing_it(secret):
    assert weak_secret(secret) is not None
    cfg = Config.from_dict({"daemon": {"key_secret": secret}})
    with pytest.raises(ConfigError, match="^daemon.key_secret: too guessable") as err:
        load_key_secret(cfg)
    assert secret not in str(err.value)


@pytest.mark.parametrize("secret", ["a-fixed-secret-for-tests", "s3cr3t-token-teamA-0123456789",
                                    "6f1c2b9e0d4a7f3e8b5c1d2a9e7f4b30", "Qm9vbXNoYWthbGFr"])
def test_a_random_looking_key_secret_is_kept(secret):
    assert weak_secret(secret) is None
    assert load_key_secret(Config.from_dict({"daemon": {"key_secret": secret}})) == secret.encode()
