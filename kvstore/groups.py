"""Models of more than one kind of layer state: which records a prefix needs,
which a store keeps, and the lookup that applies both.

A model's layout is a list of groups (:class:`kvstore.identity.KVGroup`),
each with its own records under its own namespace (``identity.for_group``):
one record per group per block, or, for a recurrent group, one state
checkpoint per block boundary. What a prefix of ``n`` blocks needs of each
group to rebuild the state at block ``n`` (``needed``):

==================  ==========================================================
full, mla, indexer  every block ``0 .. n-1``
sliding_window      the last ``cdiv(window, block_tokens) + 1`` blocks before
                    ``n`` (vLLM's count: the window plus the block the window's
                    first token may sit in), fewer where ``n`` is smaller
recurrent           the state checkpoint at block ``n`` (the record keyed by
                    block ``n - 1``'s key in that group's namespace)
==================  ==========================================================

A lookup hits the longest ``n`` every group can serve; where the
full-attention groups hold more than that, the shorter hit says
``partial_group`` (never a partial load: a prefix is loaded whole or not).

What a store keeps (``kept``): a full-attention group's every block (any
prefix of it may be reused); a sliding-window or recurrent group's records
only where a later request can resume (``resume_points``): the end of the
request's sealed prompt (a conversation's next turn extends it), the point
where its lookup found the stored prefix part from its own (a branch point:
the next request with that shared prefix hits there), and, when configured,
every ``checkpoint_blocks`` blocks. A sliding-window block outside every
one of those windows would serve only a request that parts from this one
at a point no request has parted at yet: that request hits at the resume
point before it (``partial_group``), and stores the window at its own
branch point, so the next request sharing that prefix hits it whole. The
records not stored are counted (``GroupSavings``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable, Protocol, Sequence

import numpy as np

from kvstore.errors import ConfigError
from kvstore.identity import CacheIdentity, KVGroup
from kvstore.keys import BlockKey, KeyChain
from kvstore.outcomes import MissReason

if TYPE_CHECKING:
    from kvstore.store.tiered import LookupResult

WHOLE_PREFIX_KINDS = ("full", "mla", "indexer")


def window_blocks(window: int, block_tokens: int) -> int:
    """Blocks a sliding-window group needs before a resume point."""
    return -(-window // block_tokens) + 1


def needed(group: KVGroup, n: int) -> range:
    """The block indices of ``group`` a prefix of ``n`` blocks needs (see the module docstring)."""
    if n <= 0:
        return range(0)
    kind = group.kind
    if kind in WHOLE_PREFIX_KINDS:
        return range(n)
    if kind == "sliding_window":
        assert group.layout.sliding_window is not None   # KVLayout checks it
        return range(max(0, n - window_blocks(group.layout.sliding_window, group.layout.block_tokens)), n)
    if kind == "recurrent":
        return range(n - 1, n)
    raise ConfigError(f"no hit rule for a group of kind {kind!r}")   # pragma: no cover - GROUP_KINDS


def usable_prefix(groups: Sequence[KVGroup], present: Sequence[Sequence[bool]],
                  limit: int | None = None) -> tuple[int, MissReason | None]:
    """The longest prefix every group can serve, given ``present[g][i]``
    (group g holds block i), and why it is shorter than what the
    full-attention groups hold (``PARTIAL_GROUP``), else ``None``.

    ``limit`` caps the prefix (the request's sealed blocks; default: the
    shortest presence list)."""
    if len(present) != len(groups):
        raise ConfigError(f"{len(present)} presence lists for {len(groups)} groups")
    top = min((len(p) for p in present), default=0) if limit is None else limit
    whole = top
    for g, p in zip(groups, present):
        if g.kind in WHOLE_PREFIX_KINDS:
            whole = min(whole, _run(p, whole))
    # a model of windows and states alone (every layer sliding, say) has
    # no whole prefix to fall short of: its misses are the blocks' own
    partial = MissReason.PARTIAL_GROUP if any(g.kind in WHOLE_PREFIX_KINDS for g in groups) else None
    for n in range(whole, 0, -1):
        if all(all(i < len(p) and p[i] for i in needed(g, n)) for g, p in zip(groups, present)):
            return n, (partial if n < whole else None)
    return 0, (partial if whole else None)


def _run(p: Sequence[bool], limit: int) -> int:
    for i in range(min(limit, len(p))):
        if not p[i]:
            return i
    return min(limit, len(p))


def resume_points(end: int, branch: int = 0, checkpoint_blocks: int = 0) -> list[int]:
    """The block counts a later request may resume from (see the module docstring)."""
    points = {end}
    if 0 < branch < end:
        points.add(branch)
    if checkpoint_blocks > 0:
        points.update(range(checkpoint_blocks, end, checkpoint_blocks))
    return sorted(p for p in points if p > 0)


def kept(group: KVGroup, end: int, points: Iterable[int]) -> list[int]:
    """The block indices of ``group`` a store keeps of a request whose sealed
    blocks end at ``end``, given its resume points."""
    if group.kind in WHOLE_PREFIX_KINDS:
        return list(range(end))
    out: set[int] = set()
    for p in points:
        if 0 < p <= end:
            out.update(needed(group, p))
    return sorted(out)


@dataclass
class GroupSavings:
    """Bytes a group's keep rule left unstored, per kind (for stats)."""

    skipped_bytes: dict[str, int] = field(default_factory=dict)
    stored_bytes: dict[str, int] = field(default_factory=dict)

    def add(self, group: KVGroup, stored: int, skipped: int) -> None:
        b = group.layout.block_bytes
        self.stored_bytes[group.kind] = self.stored_bytes.get(group.kind, 0) + stored * b
        self.skipped_bytes[group.kind] = self.skipped_bytes.get(group.kind, 0) + skipped * b


class GroupChains:
    """One key chain per group of a model (one for a plain model): group
    g's block i is keyed in group g's namespace, so each group's records are
    stored, found and loaded on their own."""

    __slots__ = ("identities", "chains")

    def __init__(self, identity: CacheIdentity) -> None:
        self.identities = identity.group_identities
        self.chains = [KeyChain(i) for i in self.identities]

    @property
    def groups(self) -> tuple[KVGroup, ...]:
        first = self.identities[0]
        return first.groups or (KVGroup(tuple(range(first.layout.num_layers)), first.layout),)

    def extend(self, tokens: Iterable[int] | np.ndarray, extras: Sequence | None = None) -> None:
        for chain in self.chains:
            chain.extend(tokens, extras)

    def keys(self, group: int, upto: int) -> list[BlockKey]:
        return self.chains[group].keys[:upto]

    def __len__(self) -> int:
        return len(self.chains[0].keys)


@dataclass(frozen=True, slots=True)
class GroupHit:
    """A grouped lookup's answer: the prefix to load (``blocks``), what the
    full-attention groups alone hold (``whole``: the branch point a later
    save keeps a window at), and why ``blocks`` is shorter."""

    blocks: int
    whole: int
    reason: MissReason | None


def lookup_groups(store: _Looks, chains: GroupChains, upto: int, *,
                  followup: float | None = None, probe: bool = False) -> GroupHit:
    """Look up blocks [0, upto) of every group in ``store`` and apply the hit
    rule. The first group's lookup is the request's (counted unless
    ``probe``); the other groups' keys go in one probe of the same request
    (a lookup takes keys of any namespace: one round trip to a daemon, not
    one per group)."""
    groups = chains.groups
    keys = [chains.keys(gi, upto) for gi in range(len(groups))]
    present: list[list[bool]] = [[] for _ in groups]
    if keys[0]:
        first = store.lookup(keys[0], followup=followup, probe=probe)
        present[0] = [t is not None for t in first.tiers]
    rest = [k for ks in keys[1:] for k in ks]
    if rest:
        tiers = store.lookup(rest, probe=True).tiers
        at = 0
        for gi in range(1, len(groups)):
            present[gi] = [t is not None for t in tiers[at:at + len(keys[gi])]]
            at += len(keys[gi])
    whole = upto
    for group, p in zip(groups, present):
        if group.kind in WHOLE_PREFIX_KINDS:
            whole = min(whole, _run(p, whole))
    blocks, reason = usable_prefix(groups, present, upto)
    if not any(g.kind in WHOLE_PREFIX_KINDS for g in groups):
        whole = blocks          # no stored prefix to part from but the hit itself
    return GroupHit(blocks, whole, reason)


class _Looks(Protocol):   # the one call lookup_groups makes (Store and the daemon client answer it)
    def lookup(self, keys: Sequence[BlockKey], *, followup: float | None = None,
               probe: bool = False) -> LookupResult: ...
