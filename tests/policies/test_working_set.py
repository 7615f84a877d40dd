import pytest

from kvstore.errors import ConfigError
from kvstore.policies.working_set import WorkingSetConfig, WorkingSetEstimator, stable_hash64


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_exact_distinct_tokens_and_expiry():
    clock = Clock()
    ws = WorkingSetEstimator(WorkingSetConfig(window_s=10, buckets=10, tokens_per_key=16), clock)
    ws.observe([1, 2, 3])
    ws.observe([2, 3, 4])                      # repeats count once
    assert ws.tokens() == 4 * 16
    clock.t = 5.0
    ws.observe([4, 5])
    assert ws.tokens() == 5 * 16
    clock.t = 10.5                             # keys seen only at t=0 leave the window
    assert ws.tokens() == 2 * 16
    clock.t = 100.0
    assert ws.tokens() == 0


def test_memory_bounded_estimate():
    ws = WorkingSetEstimator(WorkingSetConfig(window_s=60, max_keys=2000, tokens_per_key=1),
                             clock=lambda: 0.0)
    n = 50_000
    for start in range(0, n, 1000):
        ws.observe(range(start, start + 1000), now=1.0)
    assert ws.level > 0
    assert len(ws._newest) <= 2000
    assert abs(ws.tokens(1.0) - n) / n < 0.15


def test_stable_hash_is_process_independent():
    assert stable_hash64(12345) == stable_hash64(12345) != stable_hash64(12346)
    assert stable_hash64(b"\x01" * 32) == int.from_bytes(b"\x01" * 8, "little")
    assert stable_hash64("x") == stable_hash64("x")


def test_config_validated():
    with pytest.raises(ConfigError):
        WorkingSetConfig(window_s=0)
