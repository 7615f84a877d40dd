"""The one place environment variables are read.

KVSTORE_CONFIG     path to a JSON store config (see kvstore.config.StoreConfig)
KVSTORE_REDIS_URL  default Redis URL for the L3 tier and the benchmarks
KVSTORE_DATA_DIR   default directory for the NVMe tier
KVSTORE_LOG_LEVEL  logging level for the CLI (default WARNING)
"""
from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Settings:
    config_path: str | None
    redis_url: str | None
    data_dir: str
    log_level: str


def load() -> Settings:
    env = os.environ
    return Settings(
        config_path=env.get("KVSTORE_CONFIG") or None,
        redis_url=env.get("KVSTORE_REDIS_URL") or None,
        data_dir=env.get("KVSTORE_DATA_DIR") or os.path.join(tempfile.gettempdir(), "kvstore"),
        log_level=env.get("KVSTORE_LOG_LEVEL", "WARNING").upper(),
    )
