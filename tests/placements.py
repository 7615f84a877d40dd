"""A placement test double for checking that request hints reach the policy."""
from __future__ import annotations

from typing import Any


class RecordingPlacement:
    """Wraps a real placement, remembering each ``on_request``'s block count
    and follow-up hint before passing the call on; every other decision is
    the wrapped placement's own."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.requests: list[tuple[int, float | None]] = []

    def on_request(self, keys, now=None, followup=None) -> None:
        self.requests.append((len(keys), followup))
        self.inner.on_request(keys, now, followup=followup)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)
