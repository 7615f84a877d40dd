"""Environment variables that are not part of the config tree (those,
``KVSTORE_<SECTION>_<FIELD>`` and ``KVSTORE_CONFIG``, are read by
:mod:`kvstore.config_load`):

KVSTORE_REDIS_URL  default Redis URL for the benchmarks (kvstore bench tiers --tiers redis)
KVSTORE_LOG_LEVEL  logging level for the CLI (default WARNING); inside an
                   engine, set, it gives kvstore's loggers a stderr handler
                   at that level (e.g. DEBUG: the connector's load timings)
KVSTORE_CACHE_DIR  where benchmarks keep what they build once, e.g. models
                   (default $XDG_CACHE_HOME/kvstore, else ~/.cache/kvstore)
"""
from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Settings:
    redis_url: str | None
    log_level: str
    log_level_set: bool
    cache_dir: str


def load() -> Settings:
    env = os.environ
    return Settings(
        redis_url=env.get("KVSTORE_REDIS_URL") or None,
        log_level=env.get("KVSTORE_LOG_LEVEL", "WARNING").upper(),
        log_level_set=bool(env.get("KVSTORE_LOG_LEVEL")),
        cache_dir=env.get("KVSTORE_CACHE_DIR") or os.path.join(
            env.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kvstore"),
    )
