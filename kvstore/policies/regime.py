"""The regime placement policy (docs/architecture.md, "The regime table").

It measures the sustained working set (distinct tokens touched in a sliding
window, :mod:`.working_set`) and moves between four regimes with hysteresis:

=========  ================  ==================================================
regime     working set       what it decides
=========  ================  ==================================================
HBM_ONLY   < t1 (100K)       new blocks to HBM; HBM evictions dropped (no L2 writes)
WATCH      t1..t2 (250K)     HBM evictions written back to DRAM only with reuse
                             evidence (the frequency filter has seen them twice)
DRAM       t2..t3 (500K)     every HBM eviction written back to DRAM; DRAM hits
                             promoted; DRAM evictions dropped
SPILL      > t3              as DRAM, and DRAM evictions spill to NVMe, then
                             Redis, filtered to spare SSD wear (see below)
=========  ================  ==================================================

Below HBM (the engine's own LRU) the tiers are ordered by the policy's
:class:`ReuseModel` (``make_order``): a request's blocks form a segment,
evicted tail first, and the victim segment is the one least likely to be
extended by a next turn within the tier's residence time (class reuse rate x
the learnt inter-turn gap distribution, :class:`GapModel`); a block an L3
tier still holds is not written back to DRAM again (``exclusive``), and
the NVMe / Redis filter admits a block seen twice, or one worth more than
the block it would displace (TinyLFU's rule over the model's value).

A caller that knows whether a request's context will be sent again (an
agent with a pending tool call) passes ``followup`` to ``on_request``; the
model classes hinted requests apart and learns how far the hint holds. On
the Mooncake conversation trace that signal is what separates online
policies from Belady (README, "Measured").

Thresholds are settable (:class:`RegimeConfig`), or derived from the tiers
(``mode="auto"``): t1 = HBM capacity, t3 = HBM + DRAM capacity, t2 midway.
In either mode a tier whose load is not cheaper than recomputing a block
(``load_beats_recompute``, from the cost model or measured bandwidths) is
never written to: a hit there would cost more time than it saves. Hysteresis: a regime is
entered above ``t * (1 + h)`` and left below ``t * (1 - h)``, so a working
set hovering at a threshold does not flap. Changes are logged (logger
``kvstore.policies.regime``); the last ``timeline_window`` (default
``TIMELINE_WINDOW``) are kept in ``stats()["timeline"]`` and all are counted (``regime_changes``): a client
that flips the regime as fast as it can grows neither memory nor the STATS
reply.

Several owners (the daemon's tenants, :meth:`RegimePlacement.set_owner_shares`):
each owner has a share of the store (by quota; equal shares when there are
none) and a regime of its own, from its own working set (fed by its own
lookups) against thresholds from its own engines (``auto``: t1 = the tokens
its engines reported, t3 = t1 + its share of DRAM) or its share of the fixed
thresholds. A save is decided by its owner's regime, so no owner's reports
or lookups decline another's saves. The store-wide regime (evictions,
spills, promotions ahead of a load, ``stats()``) is derived from bounded
contributions: each owner's engine tokens and working set count up to its
share of the store's capacity in tokens (the budgeted tiers below HBM;
uncapped while no capacity is known). With no shares set (a store of one
process) there is one owner and everything is as it always was.

Rejected: switching on the instantaneous HBM eviction rate (it rises only
after the damage is done, and it is zero in a cold start that will thrash).
"""
from __future__ import annotations

import enum
import logging
import math
import time
from array import array
from collections import OrderedDict, deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Hashable, Mapping, Sequence

from kvstore.errors import ConfigError
from kvstore.policies.base import (
    MAX_OWNERS,
    NO_VIEW,
    PlacementPolicy,
    TierView,
    check_followup,
    first_present,
)
from kvstore.policies.eviction import ClassedLRU, SegmentLRU
from kvstore.policies.working_set import WorkingSetConfig, WorkingSetEstimator, stable_hash64

log = logging.getLogger(__name__)


_NO_PASS = 1 << 30        # a min_count no block reaches: reuse evidence is no pass
TIMELINE_WINDOW = 256     # regime changes kept in stats()["timeline"] (all are counted)
_MIN_OWNER_KEYS = 1024    # an owner's working-set sample, however small its share


class Regime(enum.IntEnum):
    HBM_ONLY = 0
    WATCH = 1
    DRAM = 2
    SPILL = 3


REGIMES = [r.name for r in Regime]      # by number: what /metrics' kvstore_regime gauge means


class FrequencyFilter:
    """Counting Bloom filter with periodic halving (TinyLFU's sketch): an
    estimate, never below the true count since the last halving, of how often
    a key was seen. Fixed memory: ``width`` one-byte counters x ``depth``.

    Aging: after ``sample`` increments all counters halve, so a block popular
    an hour ago does not keep its pass forever.
    """

    def __init__(self, width: int = 1 << 16, depth: int = 4, sample: int | None = None) -> None:
        if width < 64 or depth < 1:
            raise ConfigError("FrequencyFilter needs width >= 64 and depth >= 1")
        self.width, self.depth = width, depth
        self.sample = sample or 10 * width
        self._rows = [array("B", bytes(width)) for _ in range(depth)]
        self._adds = 0

    def _slots(self, key: Hashable) -> list[int]:
        h = stable_hash64(key)
        h1, h2 = h & 0xFFFFFFFF, (h >> 32) | 1
        return [(h1 + i * h2) % self.width for i in range(self.depth)]

    def add(self, key: Hashable) -> None:
        for row, s in zip(self._rows, self._slots(key)):
            if row[s] < 255:
                row[s] += 1
        self._adds += 1
        if self._adds >= self.sample:
            self._adds = 0
            for row in self._rows:
                for i in range(self.width):
                    row[i] >>= 1

    def estimate(self, key: Hashable) -> int:
        return min(row[s] for row, s in zip(self._rows, self._slots(key)))


class GapModel:
    """Online distribution of the gap between a request and the next turn
    that extends it: a histogram over log-spaced bins (1 s .. ~4.6 h, four
    per doubling), with one pseudo-count per bin so it starts flat.

    ``survival(a)`` = P(gap > a), interpolated within a bin on log time.
    """

    PER_OCTAVE, OCTAVES = 4, 14

    def __init__(self) -> None:
        n = self.PER_OCTAVE * self.OCTAVES
        self._counts = [1.0] * n
        self._total = float(n)
        self._tail: list[float] | None = None

    def _bin(self, gap_s: float) -> float:
        return max(0.0, math.log2(max(gap_s, 1.0)) * self.PER_OCTAVE)

    def add(self, gap_s: float) -> None:
        self._counts[min(int(self._bin(gap_s)), len(self._counts) - 1)] += 1.0
        self._total += 1.0
        self._tail = None

    def survival(self, age_s: float) -> float:
        if self._tail is None:      # tail[i] = share of gaps in bins >= i
            tail, acc = [0.0] * (len(self._counts) + 1), 0.0
            for i in range(len(self._counts) - 1, -1, -1):
                acc += self._counts[i]
                tail[i] = acc / self._total
            self._tail = tail
        x = self._bin(age_s)
        if not x < len(self._counts):     # past the last bin (or never seen: infinite age)
            return 0.0
        i = int(x)
        if i >= len(self._counts):
            return 0.0
        frac = x - i
        return self._tail[i] * (1 - frac) + self._tail[i + 1] * frac


class ReuseModel:
    """Online estimate of how likely a block is to be reused, by request class.

    A prefix hit reuses a whole earlier request (the next turn of a
    conversation re-sends it), so reuse is learnt per *request*: each request
    gets a class from what is known when it arrives - its depth (how many
    earlier requests its longest previously seen prefix ran through, capped)
    and its size (short or long) - and a class's rate is the share of its
    requests that a later request extended, counted online from the stream
    (``(extended + 1) / (requests + 2)``; requests still waiting for a next
    turn count as not extended, which biases every class alike). Each block
    remembers the class and time of the last request that carried it
    (``stamp``); ``ClassedLRU`` orders a tier by them.

    A caller's follow-up hint (``observe(..., followup=p)``) replaces depth
    and size: hinted requests get one of two classes of their own, "likely"
    (p >= 0.5) and "unlikely", whose rates are learnt like any other - so a
    hint is trusted exactly as far as it has come true so far, and a source
    of wrong hints costs no more than having none.

    Memory: at most ``max_keys`` block records and ``max_pending`` requests
    waiting to be extended (oldest forgotten first). Single-threaded.

    Rejected: per-block frequency alone (TinyLFU's signal): a block's first
    reuse is its conversation's next turn, so counting blocks learns only
    after the decision that mattered; and position in the prefix (block 0
    is shared by everyone, but every later position of a chain is reused
    together or not at all).
    """

    DEPTHS = 3
    LONG_BLOCKS = 8

    def __init__(self, max_keys: int = 1 << 21, max_pending: int = 1 << 17,
                 power: float = 1.0) -> None:
        self.max_keys, self.max_pending, self.power = max_keys, max_pending, power
        self._meta: OrderedDict[Hashable, list] = OrderedDict()   # key -> [cls, t, count, req, pos]
        self._pending: OrderedDict[int, int] = OrderedDict()      # request seq -> cls
        n = 2 * self.DEPTHS + 2                  # + the two hinted classes
        self._requests, self._extended = [0] * n, [0] * n
        self._seq = 0
        self.now = 0.0
        self.gaps = GapModel()

    def observe(self, keys: Sequence[Hashable], now: float, followup: float | None = None) -> int:
        """Classify and record one request; returns its class."""
        self.now = now
        self._seq += 1
        meta = self._meta
        hm = first_present(keys, meta)
        parent = meta[keys[hm - 1]] if hm >= 2 else None
        if followup is not None:
            cls = 2 * self.DEPTHS + (followup >= 0.5)
        else:
            depth = 0 if parent is None else min(parent[2], self.DEPTHS - 1)
            cls = 2 * depth + (len(keys) >= self.LONG_BLOCKS)
        if parent is not None:
            pc = self._pending.pop(parent[3], None)
            if pc is not None:
                self._extended[pc] += 1
                self.gaps.add(now - parent[1])
        self._requests[cls] += 1
        self._pending[self._seq] = cls
        if len(self._pending) > self.max_pending:
            self._pending.popitem(last=False)
        for pos, k in enumerate(keys):
            m = meta.get(k)
            if m is None:
                meta[k] = [cls, now, 1, self._seq, pos]
            else:
                m[0], m[1], m[2], m[3], m[4] = cls, now, m[2] + 1, self._seq, pos
                meta.move_to_end(k)
        while len(meta) > self.max_keys:
            meta.popitem(last=False)
        return cls

    def expect(self, keys: Sequence[Hashable], now: float) -> None:
        """Known blocks that are about to be read (a session's hint): last
        used now, in the class of requests hinted to continue. Counts and
        the reuse model are untouched: nothing was requested yet."""
        cls = 2 * self.DEPTHS + 1
        for k in keys:
            m = self._meta.get(k)
            if m is not None:
                m[0], m[1] = cls, max(m[1], now)

    def rate(self, cls: int) -> float:
        return (self._extended[cls] + 1) / (self._requests[cls] + 2)

    def weight(self, cls: int) -> float:
        """Relative retention of a class (> 0): its reuse rate ** ``power``."""
        return self.rate(cls) ** self.power

    def reuse_soon(self, cls: int, age_s: float, horizon_s: float) -> float:
        """P(a block of class ``cls`` last used ``age_s`` ago is reused within
        the next ``horizon_s``), given it has not been reused yet: the class
        rate p and the gap survival S give p (S(a) - S(a + h)) / (1 - p + p S(a)).
        Evicting the lowest first is Belady's rule in expectation, with
        the horizon the time a kept block would stay anyway."""
        p, g = self.rate(cls), self.gaps
        sa = g.survival(age_s)
        return p * (sa - g.survival(age_s + horizon_s)) / (1.0 - p + p * sa)

    def stamp(self, key: Hashable) -> tuple[int, float]:
        """(class, last use time) of a block; unknown blocks look oldest."""
        m = self._meta.get(key)
        return (0, float("-inf")) if m is None else (m[0], m[1])

    def segment_stamp(self, key: Hashable) -> tuple[int, float, int, int]:
        """(class, last use time, request seq, position in it) - the segment
        a :class:`~.eviction.SegmentLRU` files a block under."""
        m = self._meta.get(key)
        return (0, float("-inf"), 0, 0) if m is None else (m[0], m[1], m[3], m[4])

    def value(self, key: Hashable) -> float:
        """Higher = more worth keeping now: weight / age (age floored at 1 ms)."""
        cls, t = self.stamp(key)
        return self.weight(cls) / max(self.now - t, 1e-3)

    def stats(self) -> dict:
        return {"class_rates": [round(self.rate(c), 3) for c in range(len(self._requests))],
                "class_requests": list(self._requests)}


@dataclass(frozen=True, slots=True)
class RegimeConfig:
    """``thresholds`` (t1, t2, t3) in tokens, or ``mode="auto"`` to derive them."""

    thresholds: tuple[int, int, int] = (100_000, 250_000, 500_000)
    mode: str = "fixed"                       # "fixed" | "auto"
    hysteresis: float = 0.1
    window_s: float = 60.0
    tokens_per_key: int = 16
    reuse_min_count: int = 2                  # WATCH: write back only blocks seen this often
    nvme_min_count: int = 2                   # SPILL: frequency filter on NVMe / Redis writes
    filter_width: int = 1 << 16
    class_weight_power: float = 2.0           # ClassedLRU retention ~ class reuse rate ** this
    initial: Regime = Regime.HBM_ONLY
    order: str = "hazard"                     # lower-tier order: "segment" | "hazard" | "classed" (see make_order)
    exclusive: bool = True                    # no DRAM write-back of a block L3 still holds
    horizon_scale: float = 0.4                # hazard order: horizon = this x measured residence
    timeline_window: int = TIMELINE_WINDOW    # regime changes kept in stats()["timeline"]
    tier_roles: Mapping[str, str] = field(default_factory=lambda: {
        "hbm": "hbm", "dram": "dram", "nvme": "l3", "redis": "l3"})

    def __post_init__(self) -> None:
        if self.order not in ("segment", "hazard", "classed"):
            raise ConfigError(f"regime order must be 'hazard', 'segment' or 'classed', got {self.order!r}")
        if self.mode not in ("fixed", "auto"):
            raise ConfigError(f"regime mode must be 'fixed' or 'auto', got {self.mode!r}")
        t = self.thresholds
        if len(t) != 3 or not (0 < t[0] <= t[1] <= t[2]):
            raise ConfigError(f"thresholds must be 0 < t1 <= t2 <= t3, got {t}")
        if not 0.0 <= self.hysteresis < 1.0:
            raise ConfigError(f"hysteresis must be in [0, 1), got {self.hysteresis}")
        if self.window_s <= 0 or self.tokens_per_key < 1:
            raise ConfigError("window_s > 0 and tokens_per_key >= 1 required")
        if isinstance(self.timeline_window, bool) or not isinstance(self.timeline_window, int) \
                or self.timeline_window < 1:
            raise ConfigError(f"timeline_window must be a count >= 1, got {self.timeline_window!r}"[:200])


def auto_thresholds(capacities: Mapping[str, int]) -> tuple[int, int, int]:
    """t1 = HBM tokens (the working set fits the engine's cache), t3 = HBM +
    DRAM tokens (beyond it DRAM alone is too small), t2 midway."""
    hbm = max(1, int(capacities.get("hbm", 0)))
    t3 = max(hbm, hbm + int(capacities.get("dram", 0)))
    return hbm, (hbm + t3) // 2, t3


@dataclass(slots=True)
class _OwnerRegime:
    """One owner's side of a :class:`RegimePlacement` with several owners."""

    share: float
    ws: WorkingSetEstimator
    regime: Regime
    engine_tokens: int = 0
    last_ws: int = 0


def step_regime(regime: Regime, ws: int, thresholds: Sequence[int], hysteresis: float) -> Regime:
    """The regime after ``regime`` for working set ``ws`` (tokens): up past
    ``t * (1 + h)``, down below ``t * (1 - h)``, as many steps as it takes."""
    r = int(regime)
    while r < 3 and ws > thresholds[r] * (1 + hysteresis):
        r += 1
    while r > 0 and ws < thresholds[r - 1] * (1 - hysteresis):
        r -= 1
    return Regime(r)


class RegimePlacement(PlacementPolicy):
    """Placement by regime over the store's ordered tiers (names: ``hbm``,
    ``dram``, ``nvme``, ``redis``; absent tiers are skipped).

    Without an ``hbm`` tier of its own (the store under vLLM or SGLang,
    and the daemon's: the engine's prefix cache is HBM) every put is an
    engine's save of a block its own cache holds, so the regime decides
    whether to keep it (``put_targets``): HBM_ONLY declines it (the engine
    serves what fits its cache itself), WATCH keeps it only with reuse
    evidence, DRAM and SPILL keep it in DRAM. ``capacities["hbm"]`` is then
    the engines' caches in tokens, as their connectors report them.

    Capacities (``mode="auto"``'s thresholds, the free-room rules) and the
    tiers' counts and next victims are the planner's: it attaches itself
    as this policy's :class:`~.base.TierView`; the engines' caches are its
    ``engine_tokens``. ``load_beats_recompute(tier_name) -> bool`` comes from the cost model
    (or measured bandwidths) and rules out slow tiers.
    Single-threaded; ``clock`` is used when ``on_request`` gets no ``now``.
    """

    def __init__(self, tiers: Sequence[str], config: RegimeConfig = RegimeConfig(), *,
                 load_beats_recompute: Callable[[str], bool] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.tiers = list(tiers)
        self.config = config
        self._clock = clock
        roles = [config.tier_roles.get(t, "l3") for t in self.tiers]
        usable = load_beats_recompute   # a tier slower than recompute is never written, in any mode
        self._hbm: int | None = roles.index("hbm") if "hbm" in roles else None   # None: the engine's
        self._dram = next((i for i, r in enumerate(roles) if r == "dram"
                           and (usable is None or usable(self.tiers[i]))), None)
        self._l3 = [i for i, r in enumerate(roles) if r == "l3"
                    and (usable is None or usable(self.tiers[i]))]
        if self._hbm is None and self._dram is None and not self._l3:
            raise ConfigError("RegimePlacement needs a tier to place blocks in")
        self._view: TierView = NO_VIEW
        self._fixed = tuple(config.thresholds)
        self._engine_tokens: dict[int, int] = {}   # owner -> its engines' tokens (on_engines)
        self._ws = WorkingSetEstimator(WorkingSetConfig(window_s=config.window_s,
                                                        tokens_per_key=config.tokens_per_key),
                                       clock=clock)
        self._freq = FrequencyFilter(width=config.filter_width)
        self._model = ReuseModel(power=config.class_weight_power)
        self._own: set[int] = set()       # the tiers ordered by this policy's make_order
        self.regime = config.initial
        self._timeline: deque[dict] = deque(maxlen=config.timeline_window)   # the newest changes
        self._changes = 0                 # every change, the window's and the older ones
        self._owners: dict[int, _OwnerRegime] = {}   # empty: one owner (a store of one process)
        self._anonymous: _OwnerRegime | None = None  # calls naming no owner in shares (see owner_scope)
        self._acting = 0                  # the owner of the request or save being decided (owner_scope)
        self._owner_changes = 0           # changes of the owners' own regimes
        self._counts = {"writebacks": 0, "saves_declined": 0, "dropped": 0, "spills": 0,
                        "spill_filtered": 0, "promotions": 0}
        self._last_ws = 0
        self._last_now = 0.0

    # -- observation ---------------------------------------------------
    def on_return(self, keys: Sequence[Hashable], now: float) -> None:
        """A paused agent task is due back: its blocks rank as just used."""
        self._model.expect(keys, now)

    def on_request(self, keys: Sequence[Hashable], now: float | None = None,
                   followup: float | None = None) -> None:
        now = self._clock() if now is None else now
        followup = check_followup(followup)
        if self._owners:      # the request's owner moves its own working set and regime only
            own = self._owner(self._acting)
            own.ws.observe(keys, now)
            own.last_ws = own.ws.tokens(now)
            new_own = step_regime(own.regime, own.last_ws, self._owner_thresholds(own), self.config.hysteresis)
            self._owner_changes += new_own != own.regime
            own.regime = new_own
            ws = self._bounded_working_set(now)
        else:
            self._ws.observe(keys, now)
            ws = self._ws.tokens(now)
        self._model.observe(keys, now, followup)
        for k in keys:
            self._freq.add(k)
        self._last_ws = ws
        self._last_now = now
        new = self._next_regime(ws)
        if new != self.regime or not self._changes:
            if self._changes:
                log.info("regime %s -> %s at t=%.1fs (working set %d tokens)",
                         self.regime.name, new.name, now, ws)
            self.regime = new
            self._changes += 1
            self._timeline.append({"t_s": now, "regime": new.name, "working_set_tokens": ws})

    def _next_regime(self, ws: int) -> Regime:
        return step_regime(self.regime, ws, self.thresholds, self.config.hysteresis)

    # -- owners (a daemon's tenants) -------------------------------------------
    def set_owner_shares(self, shares: Mapping[int, float]) -> None:
        """The owners whose requests and saves are told apart (``owner_scope``)
        and each one's share of the store (see :func:`owner_shares`). Each gets
        a regime and a working-set sample of its own (the sample sized by its
        share: memory stays about one store's worth). An owner already known
        keeps its regime and its working set; one not named is forgotten."""
        if len(shares) > MAX_OWNERS:
            raise ConfigError(f"at most {MAX_OWNERS} owners have a regime of their own, got {len(shares)}")
        for o, share in shares.items():
            if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0.0 < share <= 1.0:
                raise ConfigError(f"an owner's share is in (0, 1], got {share!r} for owner {o}"[:200])
        owners = {}
        for o, share in shares.items():
            old = self._owners.get(o)
            if old is not None:
                old.share = float(share)
                owners[o] = old
            else:
                owners[o] = self._new_owner(float(share), self._engine_tokens.get(o, 0))
        self._owners = owners
        if not owners:
            self._anonymous = None
        elif self._anonymous is None:
            self._anonymous = self._new_owner(min(shares.values()), 0)
        else:
            self._anonymous.share = min(shares.values())

    def _new_owner(self, share: float, engine_tokens: int) -> _OwnerRegime:
        config = WorkingSetConfig(window_s=self.config.window_s, tokens_per_key=self.config.tokens_per_key,
                                  max_keys=max(_MIN_OWNER_KEYS, int(WorkingSetConfig().max_keys * share)))
        return _OwnerRegime(share, WorkingSetEstimator(config, clock=self._clock), self.config.initial,
                            engine_tokens)

    @contextmanager
    def owner_scope(self, owner: int) -> Iterator[None]:
        """The calls made inside (``on_request``, ``put_targets``) are for
        ``owner``'s request or save. The calls of an owner not named in the
        shares (0: a caller that names none) share one state of their own,
        entitled to the smallest share: they move no named owner's regime."""
        outer, self._acting = self._acting, owner
        try:
            yield
        finally:
            self._acting = outer

    def on_engines(self, tokens_by_owner: Mapping[int, int]) -> None:
        """The tokens each owner's engines reported (their own prefix caches)."""
        self._engine_tokens = dict(tokens_by_owner)
        for o, own in self._owners.items():
            own.engine_tokens = self._engine_tokens.get(o, 0)

    def _owner(self, owner: int) -> _OwnerRegime:
        own = self._owners.get(owner)
        if own is None:      # not a tenant: the one anonymous state, never a tenant's or one of its own
            assert self._anonymous is not None    # set with the owners
            own = self._anonymous
        return own

    def _contributors(self) -> list[_OwnerRegime]:
        """Every state that moves the store-wide regime: the owners' and the anonymous one."""
        return [*self._owners.values(), *([self._anonymous] if self._anonymous is not None else [])]

    def _tier_tokens(self) -> dict[str, int]:
        """Each budgeted tier's capacity in tokens, as the planner knows it."""
        tpk, view = self.config.tokens_per_key, self._view
        caps = {}
        for i, name in enumerate(self.tiers):
            blocks = view.capacity_blocks(i)
            if blocks is not None:
                caps[name] = blocks * tpk
        return caps

    def _store_tokens(self) -> int | None:
        """What the store holds at most below HBM, in tokens (None: not known yet)."""
        hbm = self.tiers[self._hbm] if self._hbm is not None else None
        below = [v for name, v in self._tier_tokens().items() if name != hbm]
        return sum(below) if below else None

    def _owner_thresholds(self, own: _OwnerRegime) -> tuple[int, int, int]:
        """An owner's thresholds: its share of the fixed ones, or under
        ``auto`` its own engines (HBM: its share of the store's HBM tier,
        where the store has one) and its share of DRAM."""
        if self.config.mode != "auto":
            t1, t2, t3 = (max(1, int(t * own.share)) for t in self._fixed)
            return t1, t2, t3
        caps = self._tier_tokens()
        hbm = own.engine_tokens if self._hbm is None else int(caps.get(self.tiers[self._hbm], 0) * own.share)
        return auto_thresholds({"hbm": hbm, "dram": int(caps.get("dram", 0) * own.share)})

    def _bounded(self, values: Sequence[tuple[float, int]]) -> int:
        """The sum of (share, value) pairs, each value capped at its share of
        the store's capacity in tokens (uncapped while none is known)."""
        store = self._store_tokens()
        if store is None:
            return sum(v for _, v in values)
        return sum(min(v, int(share * store)) for share, v in values)

    def _bounded_working_set(self, now: float) -> int:
        states = self._contributors()
        for own in states:
            own.last_ws = own.ws.tokens(now)    # expires what left the window
        return self._bounded([(own.share, own.last_ws) for own in states])

    # -- decisions -----------------------------------------------------
    def prefetch_to(self, hit_tier: int) -> int | None:
        """A lookup found blocks in ``hit_tier``: promote them to DRAM ahead of
        the load where this regime keeps blocks in DRAM (DRAM, SPILL) and the
        hit is below it (NVMe, Redis: a load from there is the slow one).
        Only for a store under an engine (no HBM tier here): the engine then
        loads from DRAM. With an HBM tier of its own the hit is promoted to
        HBM as it is read (``on_hit``); a DRAM copy first would only cost room."""
        if self._hbm is not None or self.regime < Regime.DRAM or self._dram is None or hit_tier <= self._dram:
            return None
        return self._dram

    def attach(self, view: TierView) -> None:
        self._view = view

    @property
    def thresholds(self) -> tuple[int, ...]:
        """The working-set thresholds (tokens) between the regimes: the
        configured ones, or under ``auto`` the planner's capacities now."""
        return auto_thresholds(self.capacities()) if self.config.mode == "auto" else self._fixed

    def capacities(self) -> dict[str, int]:
        """Each tier's capacity in tokens, as the planner knows it, and
        ``hbm``: the engines' caches when the store has no HBM tier of its own."""
        caps = self._tier_tokens()
        if self._hbm is None:   # several owners: each one's engines count up to its share of the store
            caps["hbm"] = self._bounded([(own.share, own.engine_tokens) for own in self._owners.values()]) \
                if self._owners else self._view.engine_tokens
        return caps

    def put_targets(self, key: Hashable) -> list[int]:
        if self._hbm is not None:
            return [self._hbm]
        # an engine's save: its own cache holds the block; keep a copy only
        # where this regime would have written the HBM eviction back
        first = self._dram if self._dram is not None else (self._l3[0] if self._l3 else None)
        r = self._owner(self._acting).regime if self._owners else self.regime   # the saver's own
        if first is None or r == Regime.HBM_ONLY:
            self._counts["saves_declined"] += 1
            return []
        if r == Regime.WATCH and not self._admits(key, first, self.config.reuse_min_count):
            self._counts["saves_declined"] += 1
            return []
        if first != self._dram and r != Regime.SPILL:
            self._counts["saves_declined"] += 1
            return []     # no DRAM: only the highest regime writes to a slow tier
        self._counts["writebacks"] += 1
        return [first]

    def on_evict(self, key: Hashable, from_tier: int) -> int | None:
        r = self.regime
        if from_tier == self._hbm:
            if self._dram is None or r == Regime.HBM_ONLY:
                return self._drop()
            if r == Regime.WATCH and not self._admits(key, self._dram, self.config.reuse_min_count):
                return self._drop()
            if self.config.exclusive and any(self._view.planned(key, i) for i in self._own
                                             if i != self._dram):
                return self._drop()     # a lower tier still holds it: no second copy
            self._counts["writebacks"] += 1
            return self._dram
        lower = [i for i in self._l3 if i > from_tier]
        if r == Regime.HBM_ONLY or not lower:
            return self._drop()
        # below SPILL a block's count is no pass: the slow tier takes only what
        # displaces nothing or is worth more than what it displaces
        evidence = self.config.nvme_min_count if r == Regime.SPILL else _NO_PASS
        if not self._admits(key, lower[0], evidence):
            self._counts["spill_filtered"] += 1
            return self._drop()
        self._counts["spills"] += 1
        return lower[0]

    def _has_room(self, tier: int) -> bool:
        """The tier holds less than its capacity (known from ``capacities``):
        a write there costs its bandwidth and displaces nothing, so WATCH's
        reuse evidence is not needed for it. Measured (kvstore bench sweep):
        without this rule regime trailed lru by 3-4% in the 100-250K and
        250-500K bands, where DRAM is large and WATCH left it half empty."""
        cap = self._view.capacity_blocks(tier)
        return tier in self._own and cap is not None and self._view.blocks_in(tier) < cap

    def _admits(self, key: Hashable, tier: int, min_count: int) -> bool:
        """The write filter where a regime asks for evidence (WATCH's DRAM
        write-backs, SPILL's NVMe / Redis writes): a write pays when what it
        saves beats what it costs.

        A block seen ``min_count`` times passes (its reuse is likely). Otherwise, when the
        target tier is ordered by this policy (``make_order``), TinyLFU's
        rule with the reuse model as the frequency: it passes if the tier has
        room (the write displaces nothing) or the block is worth more than the one it would displace. With
        a foreign order there is no victim to compare with and it is dropped.
        Rejected: the count filter alone - on conversation traffic a block's
        first reuse is the one that matters (the next turn), so it dropped
        the blocks worth keeping and lost to plain LRU.
        """
        if self._freq.estimate(key) >= min_count:
            return True
        if tier not in self._own:
            return False
        if self._has_room(tier):
            return True
        victim = self._view.next_victim(tier)
        return victim is None or self._model.value(key) > self._model.value(victim)

    def make_order(self, tier: str) -> SegmentLRU | ClassedLRU:
        """The eviction order for one of this policy's tiers below HBM (HBM
        is the engine's own LRU), over the policy's reuse model. ``order``:
        ``hazard`` (default) - :class:`SegmentLRU` evicting the segment least
        likely to be reused within ``horizon_scale`` x the tier's measured
        residence (``ReuseModel.reuse_soon``, online Belady); ``segment`` -
        SegmentLRU by class-weighted age; ``classed`` - :class:`ClassedLRU`.
        On the Mooncake conversation trace (gap closed to Belady at
        2M / 5M / 10M tokens): classed 0.035 / 0.015 / 0.018, hazard with
        ``exclusive`` 0.16 / 0.054 / 0.100. The store / simulator builds each lower tier's
        order with this, so the tier keeps what the model values."""
        if tier not in self.tiers:
            raise ConfigError(f"tier {tier!r} is not one of {self.tiers}")
        m = self._model
        order: SegmentLRU | ClassedLRU
        if self.config.order == "hazard":
            h = self.config.horizon_scale
            # least likely reused within the horizon first; age breaks ties
            order = SegmentLRU(m.segment_stamp, m.weight, lambda: m.now,
                               priority=lambda c, age, res: 1e-9 * age - m.reuse_soon(c, age, h * res))
        elif self.config.order == "segment":
            order = SegmentLRU(m.segment_stamp, m.weight, lambda: m.now)
        else:
            order = ClassedLRU(m.stamp, m.weight, lambda: m.now)
        self._own.add(self.tiers.index(tier))
        return order

    def _drop(self) -> int | None:
        """No tier: the evicted block is dropped (counted)."""
        self._counts["dropped"] += 1
        return None

    def on_hit(self, key: Hashable, tier: int) -> int | None:
        if self._hbm is None or tier == self._hbm:
            return None     # an engine's load lands in its own cache, not in a tier here
        self._counts["promotions"] += 1
        return self._hbm

    def stats(self) -> dict:
        owners: dict[str, int] = {}
        for own in self._owners.values():   # how many owners are in each regime (no owner named)
            owners[own.regime.name] = owners.get(own.regime.name, 0) + 1
        return {"regime": self.regime.name, "working_set_tokens": self._last_ws,
                "thresholds": list(self.thresholds), "mode": self.config.mode,
                "timeline": list(self._timeline), "regime_changes": self._changes,
                "owner_regimes": owners, "owner_regime_changes": self._owner_changes,
                **self._counts, **self._model.stats()}
