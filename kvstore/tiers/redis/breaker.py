"""The Redis tier's circuit breaker, one per server node: a node that is
down fails fast and is tried again after a back-off, so a Redis outage costs
a caller one time-out, not one per call."""
from __future__ import annotations

from collections.abc import Callable


class Breaker:
    """Fail fast while the server is down; allow one try after each backoff."""

    def __init__(self, clock: Callable[[], float], base: float, cap: float) -> None:
        self.clock, self.base, self.cap = clock, base, cap
        self.failures = 0
        self.open_until = 0.0

    def allow(self) -> bool:
        return self.clock() >= self.open_until

    @property
    def down(self) -> bool:
        return self.failures > 0

    def failure(self, *, hung: float = 0.0) -> None:
        """A call failed; ``hung``: it timed out after that many seconds (the
        server is there but does not answer), so the breaker opens at once for
        the cap, and at least twice that timeout: a caller making a few calls in
        a row then meets one timeout, not one per call."""
        self.failures += 1
        backoff = max(self.cap, 2 * hung) if hung else min(self.cap, self.base * 2 ** (self.failures - 1))
        self.open_until = self.clock() + backoff

    def success(self) -> bool:
        """Record a success; True if this ends an outage."""
        was_down = self.failures > 0
        self.failures, self.open_until = 0, 0.0
        return was_down
