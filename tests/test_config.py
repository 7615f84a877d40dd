"""The one configuration tree: the README's example file, TOML and JSON,
environment variables, layering, and errors that name the path."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from kvstore.config import Config
from kvstore.config_load import env_tree, load_config
from kvstore.errors import ConfigError
from kvstore.store.factory import open_store
from kvstore.tiers.nvme.config import NvmeConfig

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "kvstore.toml"


def test_the_example_file_loads_and_says_what_the_readme_says():
    cfg = load_config(EXAMPLE, env={})
    assert cfg.store.tiers() == ["dram", "nvme"]
    assert cfg.store.dram.capacity_bytes == 8 << 30 and cfg.store.nvme.capacity_bytes == 200 << 30
    assert cfg.store.nvme.durability == "fsync" and cfg.policy.name == "default"
    assert cfg.daemon.listen.unix_mode == 0o660 and cfg.daemon.metrics.port == 9477
    assert [t.name for t in cfg.daemon.tenants] == ["teamA", "ops"] and cfg.daemon.tenants[1].admin
    assert cfg.daemon.tenants[0].quota_bytes == 50 << 30 and cfg.daemon.tenants[0].uids == (1001,)
    assert cfg.daemon.limits.max_request_bytes == 256 << 20
    cfg.check_servable()
    assert "token-team-a-1" not in repr(cfg)              # secrets stay out of logs


def _readme_table() -> set[tuple[str, str]]:
    """(section, field) pairs of the configuration table (docs/configuration.md)."""
    text = (EXAMPLE.parents[1] / "docs" / "configuration.md").read_text()
    table = text[text.index("| section | field |"):]
    table = table[:table.index("\n\n")]
    pairs, section = set(), ""
    for row in table.splitlines()[2:]:
        cells = [c.strip() for c in row.strip("|").split("|")]
        section = cells[0].split()[0].strip("`") if cells[0] else section
        pairs |= {(section, name) for name in re.findall(r"`([a-z_]+)`", cells[1])}
    return pairs


def test_every_field_of_the_tree_is_in_the_example_or_the_readme_table():
    documented = _readme_table()
    example = tomllib.loads(EXAMPLE.read_text())
    missing = []

    def given(path: str, name: str) -> bool:
        node = example
        for part in path.split("."):
            node = node.get(part, {}) if isinstance(node, dict) else {}
            node = node[0] if isinstance(node, list) and node else node
        return isinstance(node, dict) and name in node

    def walk(model, path):
        for name, field in model.model_fields.items():
            sub = _section(field.annotation)
            if sub is not None:
                walk(sub, f"{path}.{name}" if path else name)
            elif not ((path, name) in documented or (path.split(".")[0] + ".*", name) in documented
                      or given(path, name)):
                missing.append(f"{path}.{name}")
    walk(Config, "")
    assert missing == []


def _section(annotation):
    from kvstore.schema import section_type
    return section_type(annotation)


def test_json_is_accepted_and_means_the_same_tree(tmp_path):
    toml = load_config(EXAMPLE, env={})
    path = tmp_path / "kvstore.json"
    path.write_text(toml.model_dump_json())
    assert load_config(path, env={}) == toml


def test_layers_defaults_file_environment_then_the_callers_values(tmp_path):
    env = {"KVSTORE_STORE_DRAM_CAPACITY_BYTES": "2GiB", "KVSTORE_POLICY_NAME": "regime",
           "KVSTORE_POLICY_THRESHOLDS": "auto", "KVSTORE_DAEMON_LISTEN_TCP_PORT": "7070",
           "KVSTORE_STORE_NVME_SEGMENT_BYTES": "8MiB", "KVSTORE_LOG_LEVEL": "DEBUG"}
    cfg = load_config(EXAMPLE, data={"policy": {"hysteresis": 0.2}}, env=env)
    assert cfg.store.dram.capacity_bytes == 2 << 30           # the environment over the file
    assert cfg.store.dram.pinned == "auto" and cfg.store.nvme.path == "/var/lib/kvstore"   # tables merge
    assert cfg.store.nvme.segment_bytes == 8 << 20
    assert (cfg.policy.name, cfg.policy.thresholds, cfg.policy.hysteresis) == ("regime", "auto", 0.2)
    assert cfg.daemon.listen.tcp_port == 7070
    over = load_config(EXAMPLE, data={"store": {"dram": {"capacity_bytes": "1GiB"}}}, env=env)
    assert over.store.dram.capacity_bytes == 1 << 30           # the caller over the environment
    assert load_config(env={"KVSTORE_CONFIG": str(EXAMPLE)}).daemon.metrics.port == 9477


def test_environment_variables_name_themselves_when_wrong():
    with pytest.raises(ConfigError, match="KVSTORE_STORE_DRAM_SIZE: no such setting"):
        env_tree({"KVSTORE_STORE_DRAM_SIZE": "1GiB"})
    with pytest.raises(ConfigError, match=r"\$KVSTORE_STORE_DRAM_CAPACITY_BYTES: not a size"):
        load_config(env={"KVSTORE_STORE_DRAM_CAPACITY_BYTES": "lots"})
    with pytest.raises(ConfigError, match="not valid JSON"):
        env_tree({"KVSTORE_POLICY_THRESHOLDS": "[1, 2"})
    assert env_tree({"KVSTORE_REDIS_URL": "redis://x", "KVSTORE_TEST_STRICT": "1"}) == {}


def test_a_section_built_in_python_is_validated_like_a_file():
    with pytest.raises(ConfigError, match=r"store\.nvme\.capacity_bytes: must be >= 4096 \(got 100\)"):
        NvmeConfig(path="/x", capacity_bytes=100)
    cfg = NvmeConfig(path="/x", capacity_bytes="1MiB")
    with pytest.raises(AttributeError):
        cfg.capacity_bytes = 5  # type: ignore[misc]
    assert cfg.replace(durability="fsync").durability == "fsync"
    with pytest.raises(ConfigError, match="durability"):
        cfg.replace(durability="sometimes")


def test_open_store_takes_a_dict_of_the_tree(tmp_path):
    with open_store({"store": {"dram": {"capacity_bytes": "4MiB"},
                               "nvme": {"path": str(tmp_path), "capacity_bytes": "16MiB"}},
                     "policy": {"name": "write-through"}}) as s:
        assert list(s.stats()["tiers"]) == ["dram", "nvme"]


def test_serve_reads_a_toml_config_and_names_the_bad_path(tmp_path):
    bad = tmp_path / "kvstore.toml"
    bad.write_text('[store.nvme]\npath = "/tmp/x"\ncapacity_bytes = -1\n[daemon.listen]\nunix_path = "/tmp/s"\n')
    r = subprocess.run([sys.executable, "-m", "kvstore", "serve", "--config", str(bad)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "store.nvme.capacity_bytes" in r.stderr and "Traceback" not in r.stderr
    nowhere = tmp_path / "nowhere.json"
    nowhere.write_text(json.dumps({"store": {"dram": {"capacity_bytes": "1MiB"}}}))
    r = subprocess.run([sys.executable, "-m", "kvstore", "serve", "--config", str(nowhere)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "daemon.listen" in r.stderr


def test_a_key_given_twice_in_a_config_file_is_an_error_naming_it_and_the_file(tmp_path):
    as_json = tmp_path / "kv.json"
    as_json.write_text('{"store": {"dram": {"capacity_bytes": "1GiB", "capacity_bytes": "2GiB"}}}')
    with pytest.raises(ConfigError, match=rf'config {re.escape(str(as_json))}: the key "capacity_bytes" '
                                          "appears twice"):
        load_config(as_json, env={})
    as_toml = tmp_path / "kv.toml"      # tomllib refuses it itself
    as_toml.write_text('[store.dram]\ncapacity_bytes = "1GiB"\ncapacity_bytes = "2GiB"\n')
    with pytest.raises(ConfigError, match=rf"config {re.escape(str(as_toml))}: not valid TOML"):
        load_config(as_toml, env={})


def test_a_config_file_named_by_the_environment_names_the_variable(tmp_path):
    missing = tmp_path / "nonexistent.toml"
    with pytest.raises(ConfigError) as info:
        load_config(env={"KVSTORE_CONFIG": str(missing)})
    assert str(info.value) == f"$KVSTORE_CONFIG names {missing}: cannot read it: No such file or directory"
    with pytest.raises(ConfigError, match=rf"^--config {re.escape(str(tmp_path))}: cannot read it"):
        load_config(tmp_path, env={}, path_named="--config")        # a directory, not a file


def test_kv_event_endpoints_must_differ_unless_the_system_picks_both_ports():
    pytest.importorskip("zmq")
    events = {"endpoint": "ipc:///tmp/kvs-ev", "replay_endpoint": "ipc:///tmp/kvs-ev"}
    with pytest.raises(ConfigError, match="endpoint and replay_endpoint must differ"):
        load_config(data={"daemon": {"kv_events": events}})
    with pytest.raises(ConfigError, match="must differ"):
        load_config(data={"daemon": {"kv_events": {"endpoint": "tcp://*:5557",
                                                         "replay_endpoint": "tcp://*:5557"}}})
    both = load_config(data={"daemon": {"kv_events": {"endpoint": "tcp://*:0", "replay_endpoint": "tcp://*:0"}}})
    assert both.daemon.kv_events.endpoint == both.daemon.kv_events.replay_endpoint == "tcp://*:0"
