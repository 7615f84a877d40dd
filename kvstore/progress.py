"""Progress of a long start-up step (pre-touching a DRAM arena, scanning the
NVMe segments), told on the ``kvstore.progress`` logger at INFO:
``pre-touching 8.0 GiB of DRAM: 3.1 GiB (39%)`` at most once a second, then
``pre-touched 8.0 GiB of DRAM in 26.1 s``.

A step that ends within its first second says nothing (its final line goes
to DEBUG): the start line of a small daemon stays its first line, and only a
step long enough to look like a hang is narrated. ``kvstore serve`` shows
these lines on stderr whatever the log level (:mod:`kvstore.cli.serve`); a
library user sees them through ordinary logging.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable

from kvstore.units import format_size

log = logging.getLogger("kvstore.progress")
EVERY_S = 1.0


class Progress:
    """``doing`` and ``done`` name the step (``"pre-touching"``, ``"pre-touched"``),
    ``what`` its object (``"of DRAM"``); ``total`` bytes. Call :meth:`advance` as
    bytes are done, :meth:`finish` once."""

    def __init__(self, doing: str, done: str, what: str, total: int, *,
                 clock: Callable[[], float] = time.monotonic, every_s: float | None = None) -> None:
        self.doing, self.done_word, self.what, self.total = doing, done, what, total
        self.clock, self.every_s = clock, EVERY_S if every_s is None else every_s
        self.started = clock()
        self._next = self.started + self.every_s
        self.done = 0
        self.told = 0                  # progress lines said

    def advance(self, nbytes: int) -> None:
        self.done += nbytes
        now = self.clock()
        if now >= self._next:
            self._next = now + self.every_s
            self.told += 1
            share = f" ({100 * self.done // self.total}%)" if self.total else ""
            log.info("%s %s %s: %s%s", self.doing, format_size(self.total), self.what,
                     format_size(self.done), share)

    def finish(self, note: str = "") -> float:
        """Say it is done (at INFO if any progress line was said, else DEBUG); its seconds."""
        took = self.clock() - self.started
        log.log(logging.INFO if self.told else logging.DEBUG, "%s %s %s%s in %.1f s", self.done_word,
                format_size(self.total), self.what, note, took)
        return took
