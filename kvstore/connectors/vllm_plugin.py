"""vLLM plugin: makes ``"kv_connector": "KVStoreConnector"`` work without
``kv_connector_module_path``.

kvstore declares this module's :func:`register` under vLLM's
``vllm.general_plugins`` entry point group (pyproject.toml). vLLM calls every
plugin of that group in each of its processes (API server, engine core,
workers), so after ``pip install kvstore-tiered[vllm]``::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KVStoreConnector",
        "kv_role": "kv_both", "kv_connector_extra_config": {...}}'

finds the connector by name. A config that still names
``kv_connector_module_path`` keeps working: vLLM imports that path first.

vLLM calls the plugin outside any try block (``vllm.plugins.load_general_plugins``),
so :func:`register` never raises: a process without vLLM, or a vLLM whose
factory moved, gets one log line and an engine that runs without the short
name. The registration is lazy (vLLM's factory stores the module path and
imports it only when an engine asks for the connector), so a vLLM process
that does not use kvstore never imports torch-side kvstore code through this
plugin; this module imports nothing at import time beyond ``logging``.
"""
from __future__ import annotations

import logging

CONNECTOR_NAME = "KVStoreConnector"
CONNECTOR_MODULE = "kvstore.connectors.vllm"
CONNECTOR_CLASS = "KVStoreConnector"

log = logging.getLogger(__name__)


def register() -> bool:
    """Register ``KVStoreConnector`` with vLLM's KV connector factory.

    Idempotent: vLLM loads plugins once per process, but a process that
    calls this again, or a vLLM that already knows the name (a future vLLM
    shipping it, another plugin), is left as it is. Returns whether the name
    is registered when it returns; never raises.
    """
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    except Exception as e:   # not only ImportError: a broken vLLM install raises anything at import
        log.warning("kvstore: vLLM's KV connector factory cannot be imported (%s: %s), so %s is not "
                    "registered; give \"kv_connector_module_path\": \"%s\" in the kv-transfer-config instead",
                    type(e).__name__, e, CONNECTOR_NAME, CONNECTOR_MODULE)
        return False
    # the factory raises ValueError on a second registration of a name; its
    # registry is private, so it is only read (where present) to stay quiet
    if CONNECTOR_NAME in getattr(KVConnectorFactory, "_registry", {}):
        return True
    try:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, CONNECTOR_MODULE, CONNECTOR_CLASS)
    except ValueError:
        return True   # registered in the meantime (the registry was not readable): the name resolves
    except Exception as e:
        log.warning("kvstore: registering %s with vLLM failed (%s: %s); give \"kv_connector_module_path\": "
                    "\"%s\" in the kv-transfer-config instead", CONNECTOR_NAME, type(e).__name__, e, CONNECTOR_MODULE)
        return False
    log.debug("kvstore: registered %s -> %s.%s with vLLM", CONNECTOR_NAME, CONNECTOR_MODULE, CONNECTOR_CLASS)
    return True
