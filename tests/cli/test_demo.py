"""The main job (`kvstore demo`) end to end, and its wrong-hit detector."""
import asyncio
import json
import subprocess
import sys

from kvstore.bench import demo
from kvstore.bench.workload import AgentWorkloadConfig, generate
from kvstore.store.tiered import TieredStore
from kvstore.tiers.dram import DramConfig, DramTier


def test_demo_command_replays_and_verifies(tmp_path):
    out = tmp_path / "demo.json"
    r = subprocess.run([sys.executable, "-m", "kvstore", "demo", "--max-requests", "200",
                        "--working-set", "200K", "--json", str(out)],
                       capture_output=True, text=True, timeout=300, check=True)
    res = json.loads(out.read_text())
    assert res["requests"] == 200 and res["wrong_bytes"] == 0
    assert 0 < res["hit_tokens"] < res["prompt_tokens"]
    assert res["store"]["tiers"]["dram"]["hits"] > 0
    assert "tokens served from the store" in r.stdout


def test_wrong_bytes_would_be_seen():
    reqs = generate(AgentWorkloadConfig(seed=1, working_set_tokens=50_000, duration_s=30))[:40]
    ident = demo.demo_identity(64)
    tier = DramTier(DramConfig(capacity_bytes=64 << 20, pinned="no"))
    store = TieredStore([tier])
    orig = tier.get_into_many

    async def poisoned(spec, keys, dsts):  # fault injection: a tier that returns wrong bytes
        outs = await orig(spec, keys, dsts)
        for d in dsts:
            memoryview(d)[0] ^= 0xFF
        return outs
    tier.get_into_many = poisoned
    res = asyncio.run(demo.replay_into_store(store, reqs, ident))
    assert res.blocks_loaded > 0 and res.wrong_bytes == res.blocks_loaded
