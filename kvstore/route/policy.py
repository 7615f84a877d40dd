"""Picking a replica for a request: by expected time to first token.

A replica's expected TTFT for a request of ``n_tokens`` whose blocks are
``keys`` (:class:`Router.estimate`):

* its held prefix, from the :class:`~kvstore.route.index.PrefixIndex`, in
  tokens per medium, each block under the fastest medium holding it;
* each medium's hit tokens cost their load time (:class:`Costs`: a
  per-token time and a per-request latency; an HBM hit costs nothing) -
  but never more than recomputing them, since a connector that loads
  slower than the GPU prefills would not load;
* the uncached tokens cost their recompute;
* a queue: the replica's requests in flight (the caller's ``load``) times
  the mean service time of the requests routed so far (an estimate the
  router keeps; a replica serves prefills one at a time).

Routes (:data:`ROUTES`):

``prefix``
    the lowest expected TTFT; near-ties (within a tenth of a mean service
    time) go to the replica a task's (or first block's) earlier call went
    to, then the less loaded, then the one given fewer requests so far.
``affinity``
    a task's calls (``task``; without one, the calls sharing a first block)
    stay on the replica the first one went to, unless it is clearly worse
    (its expected TTFT is more than a mean service time plus twice the
    best's) or overloaded (more than twice the mean load plus one in
    flight); then the best by expected TTFT, which the task follows from then on.
``least-loaded``
    the fewest requests in flight; ties to the one given fewer so far.
``round-robin``
    each candidate in turn.

Candidates are the index's replicas plus any the caller reports a load for.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field

from kvstore.bench.costmodel import CostModel
from kvstore.errors import ConfigError, KVStoreError
from kvstore.events.format import MEDIA, MEDIUM_GPU
from kvstore.route.index import SPEED_ORDER, PrefixIndex

ROUTES = ("prefix", "affinity", "least-loaded", "round-robin")
_STICKY_MEMORY = 1 << 16      # task / first-block bindings remembered, least recent forgotten first
_EWMA = 0.05                  # weight of each new request in the mean service time


class NoReplicas(KVStoreError):
    """Nothing to route to: the index knows no replica and the caller reported none."""


@dataclass(frozen=True)
class Costs:
    """What a token costs: recomputed, or loaded from a medium into HBM.

    ``load_s_per_token`` and ``load_latency_s`` per medium (a medium absent
    from ``load_s_per_token`` cannot be loaded from: its hits are
    recomputed; ``GPU`` costs nothing); ``overhead_s``: paid once by a
    request that loads from any medium but ``GPU`` (the connector's)."""

    recompute_s_per_token: float
    load_s_per_token: dict[str, float]
    load_latency_s: dict[str, float] = field(default_factory=dict)
    overhead_s: float = 0.0

    def __post_init__(self) -> None:
        figures = [self.recompute_s_per_token, self.overhead_s, *self.load_s_per_token.values(),
                   *self.load_latency_s.values()]
        if not all(isinstance(v, (int, float)) and v >= 0 and v != float("inf") for v in figures):
            raise ConfigError("costs must be finite numbers >= 0")

    def load_s(self, medium: str, tokens: int) -> float:
        """Time to get ``tokens`` of a prefix held in ``medium`` into HBM:
        its load, or its recompute when that is faster (or it cannot load)."""
        if tokens <= 0 or medium == MEDIUM_GPU:
            return 0.0
        recompute = tokens * self.recompute_s_per_token
        per = self.load_s_per_token.get(medium)
        if per is None:
            return recompute
        return min(recompute, self.load_latency_s.get(medium, 0.0) + tokens * per)

    def ttft_s(self, n_tokens: int, hit_tokens: Mapping[str, int]) -> float:
        """Expected prefill time of ``n_tokens`` with ``hit_tokens`` per medium held."""
        hit = sum(hit_tokens.values())
        t = max(0, n_tokens - hit) * self.recompute_s_per_token
        loaded = False
        for m, n in hit_tokens.items():
            if m != MEDIUM_GPU and n > 0:
                s = self.load_s(m, n)
                loaded |= s < n * self.recompute_s_per_token
                t += s
        # the connector's overhead only when it loads something (a medium slower than recompute is recomputed)
        return t + (self.overhead_s if loaded else 0.0)

    @classmethod
    def from_cost_model(cls, cost: CostModel) -> Costs:
        """The replay's stated cost model (:mod:`kvstore.bench.costmodel`),
        its tiers under their media (``dram`` -> ``CPU``, ...)."""
        kvb = cost.model.kv_bytes_per_token
        per, lat = {}, {}
        for tier, tc in cost.tiers.items():
            medium = MEDIA.get(tier, tier)
            per[medium] = kvb / tc.bandwidth_Bps
            lat[medium] = tc.latency_s
        return cls(recompute_s_per_token=cost.prefill_s(1), load_s_per_token=per, load_latency_s=lat,
                   overhead_s=cost.connector_overhead_s)

    @classmethod
    def measured(cls, model: str = "llama3-8b", *, gpu_tflops: float | None = None,
                 bandwidth_Bps: Mapping[str, float] | None = None, latency_s: Mapping[str, float] | None = None,
                 overhead_s: float | None = None) -> Costs:
        """From measured figures: a model preset (:mod:`kvstore.bench.models`:
        K/V bytes and FLOPs per token), the GPU's effective TFLOP/s, and each
        tier's measured load bandwidth and latency (by tier name - ``dram``,
        ``nvme``, ``redis`` - or medium; e.g. ``kvstore bench tiers``' get
        GB/s), the cost model's defaults for the rest."""
        from kvstore.bench.costmodel import DEFAULT_TIERS, TierCost  # noqa: PLC0415
        from kvstore.bench.models import make_cost_model  # noqa: PLC0415

        by_medium = {MEDIA.get(t, t): t for t in DEFAULT_TIERS}
        tiers = dict(DEFAULT_TIERS)
        for name in {*(bandwidth_Bps or {}), *(latency_s or {})}:
            tier = by_medium.get(name, name)
            base = tiers.get(tier, TierCost(float("inf"), 0.0))
            tiers[tier] = TierCost((bandwidth_Bps or {}).get(name, base.bandwidth_Bps),
                                   (latency_s or {}).get(name, base.latency_s))
        overrides: dict = {"tiers": tiers}
        if gpu_tflops is not None:
            overrides["gpu_flops"] = gpu_tflops * 1e12
        if overhead_s is not None:
            overrides["connector_overhead_s"] = overhead_s
        return cls.from_cost_model(make_cost_model(model, **overrides))

    def describe(self) -> dict:
        return {"recompute_s_per_token": self.recompute_s_per_token,
                "load_s_per_token": dict(self.load_s_per_token),
                "load_latency_s": dict(self.load_latency_s), "overhead_s": self.overhead_s}


@dataclass(frozen=True)
class Choice:
    """A replica and why: its expected TTFT (queue included) and hit tokens per medium."""

    replica: str
    expected_ttft_s: float
    hit_tokens: dict[str, int]
    reason: str


class Router:
    """Routes requests over the replicas of ``index`` by ``route`` (:data:`ROUTES`).

    Not thread-safe: one caller at a time (the service holds a lock)."""

    def __init__(self, index: PrefixIndex, costs: Costs, route: str = "prefix", *, block_tokens: int) -> None:
        if route not in ROUTES:
            raise ConfigError(f"unknown route {route!r}; choose from {list(ROUTES)}")
        if not isinstance(block_tokens, int) or block_tokens < 1:
            raise ConfigError(f"block_tokens must be an int >= 1, got {block_tokens!r}")
        self.index, self.costs, self.route, self.block_tokens = index, costs, route, block_tokens
        self.assigned: dict[str, int] = {}                    # requests routed to each replica
        self._sticky: OrderedDict[Hashable, str] = OrderedDict()
        self._turn = 0
        self._service_s: float | None = None                  # running mean of a request's service time

    # -- figures ---------------------------------------------------------------------
    def mean_service_s(self, n_tokens: int = 0) -> float:
        """The mean service time of the requests routed so far (before any:
        recomputing ``n_tokens``): what one request in flight adds to a wait."""
        if self._service_s is None:
            return n_tokens * self.costs.recompute_s_per_token
        return self._service_s

    def hit_tokens(self, replica: str, keys: Sequence[Hashable], n_tokens: int) -> dict[str, int]:
        """``replica``'s held prefix of ``keys`` in tokens per medium, at most
        ``n_tokens`` in all (the slowest media give up the excess)."""
        return block_tokens_held(self.index.prefix(replica, keys), self.block_tokens, n_tokens)

    def candidates(self, load: Mapping[str, float] | None = None) -> list[str]:
        return sorted(set(self.index.replicas()) | {r for r in (load or {}) if r not in self.index.shared})

    def estimate(self, keys: Sequence[Hashable], n_tokens: int, *,
                 load: Mapping[str, float] | None = None) -> dict[str, Choice]:
        """Every candidate's expected TTFT (queue included) and hit tokens."""
        if not isinstance(n_tokens, int) or n_tokens < 0:
            raise ConfigError(f"n_tokens must be an int >= 0, got {n_tokens!r}")
        wait = self.mean_service_s(n_tokens)
        out = {}
        for r in self.candidates(load):
            hits = self.hit_tokens(r, keys, n_tokens)
            q = _load_of(load, r)
            out[r] = Choice(r, self.costs.ttft_s(n_tokens, hits) + q * wait, hits,
                            f"{sum(hits.values())} of {n_tokens} tokens held, {q:g} in flight")
        return out

    # -- the choice ------------------------------------------------------------------
    def choose(self, keys: Sequence[Hashable], n_tokens: int, *, task: str | None = None,
               load: Mapping[str, float] | None = None) -> Choice:
        """The replica for one request by this router's route; counts it as routed."""
        est = self.estimate(keys, n_tokens, load=load)
        if not est:
            raise NoReplicas("no replicas: the index knows none and the caller reported no load")
        names = list(est)
        sticky_key: Hashable | None = ("task", task) if task is not None else \
            (("block", keys[0]) if len(keys) else None)
        bound = self._sticky.get(sticky_key) if sticky_key is not None else None
        bound = bound if bound in est else None
        wait = self.mean_service_s(n_tokens)
        if self.route == "round-robin":
            pick, why = names[self._turn % len(names)], "round-robin"
            self._turn += 1
        elif self.route == "least-loaded":
            pick = min(names, key=lambda r: (_load_of(load, r), self.assigned.get(r, 0), r))
            why = "least loaded"
        else:
            best = self._fastest(est, load, bound, wait)
            pick, why = best, "lowest expected TTFT"
            if self.route == "affinity" and bound is not None:
                mean_load = sum(_load_of(load, r) for r in names) / len(names)
                worse = est[bound].expected_ttft_s > 2 * est[best].expected_ttft_s + wait
                overloaded = _load_of(load, bound) > 2 * mean_load + 1
                if not (worse or overloaded):
                    pick, why = bound, "affinity"
                else:
                    why = "affinity moved: " + ("overloaded" if overloaded else "clearly slower")
            elif bound == best and best is not None:
                why = "lowest expected TTFT (affinity among near-ties)"
        if sticky_key is not None:
            self._sticky[sticky_key] = pick
            self._sticky.move_to_end(sticky_key)
            if len(self._sticky) > _STICKY_MEMORY:
                self._sticky.popitem(last=False)
        self.assigned[pick] = self.assigned.get(pick, 0) + 1
        c = est[pick]
        service = c.expected_ttft_s - _load_of(load, pick) * wait
        self._service_s = service if self._service_s is None else (1 - _EWMA) * self._service_s + _EWMA * service
        return Choice(pick, c.expected_ttft_s, c.hit_tokens, f"{why}: {c.reason}")

    def _fastest(self, est: Mapping[str, Choice], load: Mapping[str, float] | None, bound: str | None,
                 wait: float) -> str:
        """The lowest expected TTFT; near-ties (a tenth of a mean service time)
        to the bound replica, then the least loaded, then the least assigned."""
        low = min(c.expected_ttft_s for c in est.values())
        near = [r for r, c in est.items() if c.expected_ttft_s <= low + 0.1 * wait]
        if bound in near:
            return bound
        return min(near, key=lambda r: (est[r].expected_ttft_s > low, _load_of(load, r),
                                        self.assigned.get(r, 0), r))


def block_tokens_held(blocks: Mapping[str, int], block_tokens: int, n_tokens: int) -> dict[str, int]:
    """A held prefix in blocks per medium as tokens per medium, at most
    ``n_tokens`` in all: the last block may be partial, and the slowest
    media give up the excess."""
    tokens = {m: b * block_tokens for m, b in blocks.items()}
    excess = sum(tokens.values()) - max(0, n_tokens)
    for m in sorted(tokens, key=_speed_rank, reverse=True):
        if excess <= 0:
            break
        cut = min(excess, tokens[m])
        tokens[m] -= cut
        excess -= cut
    return {m: n for m, n in tokens.items() if n > 0}


def _load_of(load: Mapping[str, float] | None, replica: str) -> float:
    return float(load.get(replica, 0.0)) if load else 0.0


def _speed_rank(medium: str) -> int:
    return SPEED_ORDER.index(medium) if medium in SPEED_ORDER else len(SPEED_ORDER)
