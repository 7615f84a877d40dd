"""Expected outcomes as values: what a tier or the store reports per block."""
from __future__ import annotations

import enum


class GetOutcome(enum.Enum):
    HIT = "hit"
    MISS = "miss"
    CORRUPT = "corrupt"            # record failed its checksum; the tier dropped it
    UNAVAILABLE = "unavailable"    # backend down (Redis, device)


class PutOutcome(enum.Enum):
    STORED = "stored"
    EXISTS = "exists"              # same key already held: puts are idempotent
    NO_SPACE = "no_space"          # the tier is full of protected blocks
    UNAVAILABLE = "unavailable"
    DECLINED = "declined"          # the placement policy chose not to store it


class MissReason(enum.Enum):
    """Why a block was not found: how a user learns why the hit rate fell."""

    NEVER_STORED = "never_stored"
    EVICTED = "evicted"
    EXPIRED = "expired"
    TTL_EXPIRED = "ttl_expired"           # a paused agent task's block, dropped past its hold
    INVALIDATED = "invalidated"
    CORRUPT = "corrupt"
    TIER_UNAVAILABLE = "tier_unavailable"
    PARTIAL_BLOCK = "partial_block"
    PARTIAL_GROUP = "partial_group"       # a group of a hybrid model lacks what this prefix needs
    # held only in a volatile tier (DRAM, HBM) when the store last stopped without
    # writing it down (a crash, kill -9, flush_on_close off): see kvstore/store/volatile.py
    LOST_IN_RESTART = "lost_in_restart"
