"""The replay's control plane: policies over tier capacities, request by request.

:class:`Simulator` is the one place hit / miss and placement decisions are
made during a replay. It drives the same policy objects the
:class:`~kvstore.store.TieredStore` uses (an :class:`EvictionPolicy` per
tier, one :class:`PlacementPolicy`) and counts capacity in blocks, as a
tier counts bytes. Moving real bytes is the job of an optional
:class:`DataPlane`: the simulator tells it every store / copy / drop it
decided, in order, so a data plane that writes scaled-down payloads into real
tiers holds exactly the blocks the simulator says - the decisions are
identical with or without one, by construction.

Pure Python, single-threaded, no clock: time is the request's timestamp.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, Protocol, Sequence

from kvstore.errors import ConfigError
from kvstore.policies.base import EvictionPolicy, PlacementPolicy


class DataPlane(Protocol):
    """Executes the simulator's decisions on real tiers (see module doc).

    Called synchronously, in decision order; an implementation over the async
    TieredStore queues the operations and flushes them per request.
    """

    def stored(self, key: Hashable, tier: int) -> None: ...
    def copied(self, key: Hashable, src: int, dst: int) -> None: ...
    def dropped(self, key: Hashable, tier: int) -> None: ...
    def loaded(self, keys: Sequence[Hashable], tiers: Sequence[int]) -> None: ...


@dataclass(slots=True)
class SimTier:
    name: str
    capacity_blocks: int
    order: EvictionPolicy
    writes: int = 0          # blocks written into this tier
    reads: int = 0           # blocks loaded from this tier into HBM

    def __post_init__(self) -> None:
        if self.capacity_blocks < 0:
            raise ConfigError(f"tier {self.name}: capacity must be >= 0")


@dataclass(slots=True)
class StepResult:
    hit_tiers: list[int]                 # tier of each prefix-hit block, in order
    writethrough_blocks: int = 0         # blocks written to >1 tier at compute time
    events: list[tuple] = field(default_factory=list)  # (op, key, tier[, tier]) for tests


class Simulator:
    """Hit / miss and placement for one policy over ordered tiers (0 = HBM)."""

    def __init__(self, tiers: Sequence[SimTier], placement: PlacementPolicy, *,
                 data_plane: DataPlane | None = None, record_events: bool = False) -> None:
        if not tiers:
            raise ConfigError("a simulation needs at least one tier")
        self.tiers = list(tiers)
        self.placement = placement
        self.data_plane = data_plane
        self.record = record_events
        self._orders = [t.order for t in self.tiers]
        self._res: StepResult | None = None
        self._protected: set = set()

    def locate(self, key: Hashable) -> int | None:
        for i, o in enumerate(self._orders):
            if key in o:
                return i
        return None

    def step(self, keys: Sequence[Hashable], now: float, storable: int | None = None,
             followup: float | None = None) -> StepResult:
        """Serve one request: find its prefix hits, promote, store what was computed.

        ``storable``: how many leading blocks are sealed and may be stored
        (the trailing partial block is recomputed, never stored);
        ``followup``: the caller's hint, handed to the placement.
        """
        self.placement.on_request(keys, now, followup)
        hits: list[int] = []
        for k in keys:
            t = self.locate(k)
            if t is None:
                break
            hits.append(t)
        res = self._res = StepResult(hits)
        self._protected = set(keys)
        for k, t in zip(keys, hits):
            self._orders[t].touch(k)
            self.tiers[t].reads += t > 0
            dest = self.placement.on_hit(k, t)
            if dest is not None and dest < t:
                self._place(k, dest, src=t)
        if self.data_plane is not None and hits:
            self.data_plane.loaded(keys[: len(hits)], hits)
        limit = len(keys) if storable is None else min(storable, len(keys))
        for k in keys[len(hits):limit]:
            targets = self.placement.put_targets(k)
            stored = sum(self._place(k, t) for t in targets)
            res.writethrough_blocks += max(0, stored - 1)
        self._res = None
        return res

    def _place(self, key: Hashable, tier: int, src: int | None = None) -> bool:
        """Put ``key`` into ``tier`` (evicting as needed); False if it did not fit."""
        order = self._orders[tier]
        if key in order:
            order.touch(key)
            return True
        st = self.tiers[tier]
        if st.capacity_blocks <= 0:
            return False
        if len(order) >= st.capacity_blocks:
            victims = order.evict(len(order) - st.capacity_blocks + 1, self._protected)
            if victims is None:
                return False
            for v in victims:
                self._evicted(v, tier)
        order.insert(key)
        st.writes += 1
        self._emit(("copy", key, src, tier) if src is not None else ("store", key, tier))
        return True

    def _evicted(self, key: Hashable, tier: int) -> None:
        dest = self.placement.on_evict(key, tier)
        if dest is not None and tier < dest < len(self.tiers):
            self._place(key, dest, src=tier)   # copy down before the source copy goes
        self._emit(("drop", key, tier))

    def _emit(self, ev: tuple) -> None:
        if self.record and self._res is not None:
            self._res.events.append(ev)
        dp = self.data_plane
        if dp is not None:
            if ev[0] == "store":
                dp.stored(ev[1], ev[2])
            elif ev[0] == "copy":
                dp.copied(ev[1], ev[2], ev[3])
            else:
                dp.dropped(ev[1], ev[2])
