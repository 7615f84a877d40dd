"""`kvstore bench tiers --peer lmcache`: LMCache's own storage on the same blocks.

lmcache is installed only in the vLLM venv (.venv-vllm), so the end-to-end test
is marked ``vllm`` and skips where no interpreter can import lmcache; the error
paths run everywhere.
"""
import json
import subprocess
import sys

import pytest

from kvstore.bench import lmcache_tiers
from kvstore.bench.tiers import TierBenchConfig
from kvstore.errors import ConfigError, MissingDependency

BLOCK = 256 << 10
BLOCKS, REPEATS = 8, 2


def peer_python_or_skip() -> str:
    try:
        return lmcache_tiers.find_peer_python()
    except MissingDependency as exc:
        pytest.skip(str(exc))


@pytest.mark.slow
@pytest.mark.vllm
def test_peer_rows_beside_ours(tmp_path):
    peer_python_or_skip()
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, "-m", "kvstore", "bench", "tiers", "--tiers", "dram,nvme",
                        "--peer", "lmcache", "--blocks", str(BLOCKS), "--repeats", str(REPEATS),
                        "--block-size", "256KiB", "--nvme-path", str(tmp_path), "--json", str(out)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(out.read_text())
    rows = {(x["tier"], x["op"]): x for x in doc["rows"]}
    peer = {("lmcache-cpu", "put"), ("lmcache-cpu", "get"), ("lmcache-disk", "put"),
            ("lmcache-disk", "put-nosync"), ("lmcache-disk", "get")}
    ours = {(t, o) for t in ("dram", "nvme") for o in ("put", "get")} | {("nvme", "put-nosync")}
    assert peer | ours == set(rows)
    for key in peer:
        x = rows[key]
        assert x["peer"] == "lmcache" and x["block_bytes"] == BLOCK and x["repeats"] == REPEATS
        assert x["gbps"] > 0 and x["raw_gbps"] > 0 and x["timed"]
    for tier in ("lmcache-cpu", "lmcache-disk"):   # every get was compared byte for byte
        assert rows[(tier, "get")]["bytes_verified"] == BLOCKS * BLOCK * REPEATS
    summary = doc["peer"]
    assert summary["name"] == "lmcache" and summary["version"]
    assert {(x["ours"], x["peer"]) for x in summary["ratios"]} == {
        (" ".join(a), " ".join(b)) for a, b, _ in lmcache_tiers.PAIRS}
    assert all(x["ratio"] > 0 for x in summary["ratios"])
    assert set(summary["goals"]) == {"dram_at_or_above_lmcache_cpu",
                                     "nvme_put_at_least_2x_lmcache_disk_durable",
                                     "nvme_put_at_least_2x_lmcache_disk_page_cache"}
    assert "lmcache-disk" in r.stdout and "ours / lmcache" in r.stdout


def test_missing_peer_interpreter_says_how_to_install(tmp_path):
    with pytest.raises(MissingDependency, match="pip install --no-deps lmcache==0.5.6"):
        lmcache_tiers.find_peer_python(str(tmp_path / "no-python"))


def test_peer_needs_a_tier_it_mirrors():
    with pytest.raises(ConfigError, match="dram and nvme"):
        lmcache_tiers.peer_tiers(TierBenchConfig(tiers=("redis",), redis_url="redis://x"))
    with pytest.raises(ConfigError, match="even block size"):
        lmcache_tiers.peer_tiers(TierBenchConfig(tiers=("dram",), block_bytes=4097))
