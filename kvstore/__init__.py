"""kvstore: a tiered KV-cache storage engine for LLM inference.

``import kvstore`` stays light: it never imports torch or cupy.
"""
from kvstore.errors import KVStoreError
from kvstore.identity import CacheIdentity, KVLayout
from kvstore.keys import BlockKey, KeyChain, MediaRef, block_keys
from kvstore.outcomes import GetOutcome, MissReason, PutOutcome
from kvstore.record import BlockSpec

__all__ = [
    "BlockKey", "BlockSpec", "CacheIdentity", "GetOutcome", "KVLayout", "KVStoreError",
    "KeyChain", "MediaRef", "MissReason", "PutOutcome", "block_keys",
]
__version__ = "0.1.0"
