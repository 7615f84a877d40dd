"""KV events: what a store holds, published as it changes, in vLLM's format.

:mod:`kvstore.events.format` is the wire format (vLLM's
``vllm.distributed.kv_events`` structs, field for field). See
docs/architecture.md, "KV events".
"""
