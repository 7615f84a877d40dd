"""Store statistics: per tier, per tenant, and every miss with its reason.

Plain counters updated on the event loop; ``snapshot()`` returns a JSON-ready
dict. Counting misses by reason is how a user finds out why the hit rate fell.
"""
from __future__ import annotations

import hashlib
from collections import Counter, defaultdict
from dataclasses import dataclass, field

from kvstore.outcomes import MissReason

MAX_TENANTS = 1024
# histogram buckets (seconds) of every latency kvstore exports: 100 us to 10 s
LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                   1.0, 2.5, 5.0, 10.0)


@dataclass(slots=True)
class TierCounters:
    hits: int = 0
    puts: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    evictions: int = 0
    demotions_in: int = 0
    promotions_in: int = 0
    corrupt: int = 0
    unavailable: int = 0
    refused: int = 0          # writes the tier refused for want of room the planner thought it had


@dataclass(slots=True)
class StoreStats:
    tiers: dict[str, TierCounters] = field(default_factory=dict)
    misses: Counter = field(default_factory=Counter)          # MissReason -> count (gets)
    lookup_misses: Counter = field(default_factory=Counter)   # why each lookup's prefix ended
    tenant_hits: Counter = field(default_factory=Counter)
    tenant_misses: Counter = field(default_factory=Counter)
    lookups: int = 0
    probes: int = 0            # lookups that were not requests (see TieredStore.alookup)
    lookup_blocks: int = 0
    lookup_hit_blocks: int = 0
    prefetches: int = 0
    prefetched_blocks: int = 0
    prefetch_issued: int = 0       # blocks a lookup asked to promote ahead of their load (the placement's call)
    prefetch_useful: int = 0       # of those, read from the tier they were promoted to
    prefetch_wasted: int = 0       # left that tier (or were read from a slower one) before any read
    invalidated_blocks: int = 0
    writethrough_blocks: int = 0   # copies of put blocks written beyond each block's first

    def tier(self, name: str) -> TierCounters:
        if name not in self.tiers:
            self.tiers[name] = TierCounters()
        return self.tiers[name]

    def tenant_label(self, cache_salt: str) -> str:
        """A short, stable label per tenant salt: salts may be secrets, so they
        never appear in stats; past MAX_TENANTS distinct labels, "other"."""
        if not cache_salt:
            return "-"
        label = "t" + hashlib.sha256(cache_salt.encode()).hexdigest()[:8]
        known = label in self.tenant_hits or label in self.tenant_misses
        return label if known or len(set(self.tenant_hits) | set(self.tenant_misses)) < MAX_TENANTS \
            else "other"

    def miss(self, reason: MissReason, tenant: str) -> None:
        self.misses[reason] += 1
        self.tenant_misses[tenant] += 1

    @property
    def hits(self) -> int:
        return sum(t.hits for t in self.tiers.values())

    def hit_rate(self) -> float:
        total = self.hits + sum(self.misses.values())
        return self.hits / total if total else 0.0

    def snapshot(self) -> dict:
        per_tenant: dict[str, dict] = defaultdict(dict)
        for name in set(self.tenant_hits) | set(self.tenant_misses):
            h, m = self.tenant_hits[name], self.tenant_misses[name]
            per_tenant[name] = {"hits": h, "misses": m, "hit_rate": h / (h + m) if h + m else 0.0}
        return {
            "hit_rate": self.hit_rate(),
            "hits": self.hits,
            "misses": {r.value: self.misses.get(r, 0) for r in MissReason},
            "lookup_misses": {r.value: self.lookup_misses.get(r, 0) for r in MissReason},
            "tiers": {n: {k: getattr(c, k) for k in c.__slots__} for n, c in self.tiers.items()},
            "tenants": dict(per_tenant),
            "lookups": self.lookups, "probes": self.probes, "lookup_blocks": self.lookup_blocks,
            "lookup_hit_blocks": self.lookup_hit_blocks,
            "prefetches": self.prefetches, "prefetched_blocks": self.prefetched_blocks,
            "prefetch_issued": self.prefetch_issued, "prefetch_useful": self.prefetch_useful,
            "prefetch_wasted": self.prefetch_wasted,
            "invalidated_blocks": self.invalidated_blocks,
            "writethrough_blocks": self.writethrough_blocks,
        }
