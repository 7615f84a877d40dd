"""The Redis tier: the tier itself (tier.py), its config section and
counters (config.py), connections, node routing and dispatch (link.py), the
per-node circuit breaker (breaker.py), the ledger of what it holds
(ledger.py) and the RESP wire (wire.py).

``RedisTier`` is imported on first use, so reading a config (which needs
only ``RedisConfig``) never imports redis-py.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvstore.tiers.redis.config import RedisConfig, RedisCounters

if TYPE_CHECKING:  # pragma: no cover
    from kvstore.tiers.redis.tier import RedisTier

__all__ = ["RedisConfig", "RedisCounters", "RedisTier"]


def __getattr__(name: str) -> Any:
    if name == "RedisTier":
        from kvstore.tiers.redis.tier import RedisTier  # noqa: PLC0415 - pulls in redis-py
        return RedisTier
    raise AttributeError(name)
