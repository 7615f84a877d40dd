"""The CLI as a user runs it: a real subprocess, real files."""
import json
import subprocess
import sys

import pytest

from kvstore.identity import CacheIdentity
from kvstore.keys import MediaRef, block_keys

ID = {"model_id": "m/x", "model_revision": "r1", "num_layers": 2, "num_kv_heads": 2,
      "head_dim": 32, "block_size": 16, "dtype": "float16", "cache_salt": "t1"}


def kvstore(*args, check=True):
    return subprocess.run([sys.executable, "-m", "kvstore", *args], capture_output=True, text=True,
                          check=check, timeout=300)


@pytest.fixture
def files(tmp_path):
    ident, toks = tmp_path / "id.json", tmp_path / "tokens.json"
    ident.write_text(json.dumps(ID))
    toks.write_text(json.dumps(list(range(50))))
    return ident, toks


def test_keys_prints_one_hex_key_per_sealed_block(files):
    ident, toks = files
    out = kvstore("keys", "--identity", str(ident), "--tokens", str(toks)).stdout.split()
    expected = [k.hex() for k in block_keys(CacheIdentity.from_dict(ID), range(50))]
    assert out == expected and len(out) == 3


def test_keys_block_size_override_and_extras(files, tmp_path):
    ident, _ = files
    toks = tmp_path / "mm.json"
    toks.write_text(json.dumps({"tokens": list(range(64)),
                                "extras": [[], [{"hash": "img-1", "tokens": 20}]]}))
    out = kvstore("keys", "--identity", str(ident), "--tokens", str(toks), "--block-size", "32").stdout.split()
    identity = CacheIdentity.from_dict({**ID, "block_size": 32})
    assert out == [k.hex() for k in block_keys(identity, range(64), [[], [MediaRef("img-1", 20)]])]


@pytest.mark.parametrize("content,needle", [
    ("{not json", "not valid JSON"),
    ('{"tokens": [1, "a"]}', "list of ints"),
    ('{"tokenz": [1]}', "needs \"tokens\""),
    ('{"tokens": [1], "extras": [[{"hash": "x"}]]}', "extras[0]"),
])
def test_keys_bad_tokens_file_is_a_clear_error(files, tmp_path, content, needle):
    ident, _ = files
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    r = kvstore("keys", "--identity", str(ident), "--tokens", str(bad), check=False)
    assert r.returncode == 2 and needle in r.stdout + r.stderr and "Traceback" not in r.stderr


def test_keys_bad_identity_is_a_clear_error(files, tmp_path):
    _, toks = files
    bad = tmp_path / "id.json"
    bad.write_text(json.dumps({**ID, "tp_rank": 3}))
    r = kvstore("keys", "--identity", str(bad), "--tokens", str(toks), check=False)
    assert r.returncode == 2 and "tp_rank" in r.stderr and "Traceback" not in r.stderr


def test_bench_tiers_writes_rows(tmp_path):
    out = tmp_path / "bench.json"
    r = kvstore("bench", "tiers", "--tiers", "dram,nvme", "--block-size", "64KiB", "--blocks", "8",
                "--repeats", "2", "--nvme-path", str(tmp_path), "--json", str(out))
    rows = json.loads(out.read_text())["rows"]
    assert {(x["tier"], x["op"]) for x in rows} == \
        {(t, o) for t in ("dram", "nvme") for o in ("put", "get")} | {("nvme", "put-nosync")}
    for x in rows:
        assert x["block_bytes"] == 65536 and x["gbps"] > 0 and x["raw_gbps"] > 0
        assert abs(x["ratio"] - x["gbps"] / x["raw_gbps"]) < 1e-9
    assert "ratio" in r.stdout


def test_bench_tiers_rejects_unknown_tier():
    r = kvstore("bench", "tiers", "--tiers", "floppy", check=False)
    assert r.returncode == 2 and "floppy" in r.stderr


def test_import_kvstore_stays_light():
    code = ("import sys, kvstore, kvstore.store.tiered, kvstore.tiers.dram, kvstore.cli.main;"
            "print([m for m in ('torch', 'cupy', 'redis', 'vllm') if m in sys.modules])")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip() == "[]"


def fill_nvme(path, n: int) -> None:
    """An NVMe tier directory holding ``n`` 8 KiB blocks (block i all bytes i)."""
    import asyncio

    import numpy as np

    from kvstore.record import BlockSpec
    from kvstore.tiers.nvme import NvmeConfig, NvmeTier

    async def fill():
        tier = await NvmeTier.open(NvmeConfig(path=str(path), capacity_bytes=64 << 20))
        await tier.put_many(BlockSpec.raw(8192), [bytes([i + 1]) * 32 for i in range(n)],
                            [np.full(8192, i, np.uint8) for i in range(n)])
        await tier.close()
    asyncio.run(fill())


def test_check_finds_and_fixes_a_corrupt_nvme_record(tmp_path):
    import os

    fill_nvme(tmp_path, 5)
    assert kvstore("check", "--nvme-path", str(tmp_path)).returncode == 0
    seg = next(f for f in os.listdir(tmp_path) if f.endswith(".seg"))
    with open(tmp_path / seg, "r+b") as f:
        f.seek(96 + 100)
        f.write(b"\xff\xfe")
    bad = kvstore("check", "--nvme-path", str(tmp_path), check=False)
    assert bad.returncode == 1 and "checksum" in bad.stdout
    assert kvstore("check", "--nvme-path", str(tmp_path), "--fix").returncode == 0
    after = kvstore("check", "--nvme-path", str(tmp_path))
    assert "live blocks 4" in after.stdout


def test_check_without_fix_only_reads(tmp_path):
    import hashlib
    import os

    fill_nvme(tmp_path, 3)
    seg = next(f for f in os.listdir(tmp_path) if f.endswith(".seg"))
    with open(tmp_path / seg, "ab") as f:
        f.write(b"\x01" * 500)                       # a torn tail: an append a crash cut short
    torn_size = (tmp_path / seg).stat().st_size

    def disk() -> dict:
        return {f: hashlib.sha256((tmp_path / f).read_bytes()).hexdigest() for f in os.listdir(tmp_path)}
    before = disk()
    bad = kvstore("check", "--nvme-path", str(tmp_path), check=False)
    assert bad.returncode == 1 and "torn tail of 500 bytes" in bad.stdout, bad.stdout
    assert disk() == before                           # reported, not truncated
    fixed = kvstore("check", "--nvme-path", str(tmp_path), "--fix")
    assert "torn bytes truncated 500" in fixed.stdout and "live blocks 3" in fixed.stdout
    assert (tmp_path / seg).stat().st_size == torn_size - 500
    assert kvstore("check", "--nvme-path", str(tmp_path)).returncode == 0


def test_check_writes_nothing_not_even_a_lock_file(tmp_path):
    import os

    fill_nvme(tmp_path, 2)
    before = sorted(os.listdir(tmp_path))
    assert "LOCK" not in before
    assert kvstore("check", "--nvme-path", str(tmp_path)).returncode == 0
    assert sorted(os.listdir(tmp_path)) == before


def test_check_leaves_a_fifo_and_a_directory_named_seg_alone_and_says_so(tmp_path):
    """Neither hangs nor crashes check; --fix cannot mend them and says so
    (exit 1); once removed by hand, check passes."""
    import os

    fill_nvme(tmp_path, 2)
    os.mkfifo(tmp_path / "00000000000000aa.seg")
    os.mkdir(tmp_path / "00000000000000ab.seg")
    bad = kvstore("check", "--nvme-path", str(tmp_path), check=False)
    assert bad.returncode == 1 and bad.stdout.count("not a regular file") == 2, bad.stdout + bad.stderr
    assert "live blocks 2" in bad.stdout and "Traceback" not in bad.stderr
    fixed = kvstore("check", "--nvme-path", str(tmp_path), "--fix", check=False)
    assert fixed.returncode == 1 and fixed.stdout.count("not fixed:") == 2, fixed.stdout
    assert "remove it by hand" in fixed.stdout
    os.unlink(tmp_path / "00000000000000aa.seg")
    os.rmdir(tmp_path / "00000000000000ab.seg")
    assert kvstore("check", "--nvme-path", str(tmp_path)).returncode == 0


def test_check_fix_mends_an_unreadable_region_for_good(tmp_path):
    """A damaged header mid-segment: check reports the unreadable bytes; --fix
    rewrites the segment (its good records copied forward) and exits 0; every
    later check passes (before, the region stayed and every check failed)."""
    import os

    fill_nvme(tmp_path, 5)
    seg = next(f for f in os.listdir(tmp_path) if f.endswith(".seg"))
    frame = 8 + 96 + 8192
    with open(tmp_path / seg, "r+b") as f:
        f.seek(64 + 2 * frame)                       # the third record's frame head
        f.write(bytes(40))
    bad = kvstore("check", "--nvme-path", str(tmp_path), check=False)
    assert bad.returncode == 1 and "unreadable bytes" in bad.stdout and "live blocks 4" in bad.stdout
    fixed = kvstore("check", "--nvme-path", str(tmp_path), "--fix")
    assert "segments rewritten 1" in fixed.stdout and "not fixed" not in fixed.stdout, fixed.stdout
    after = kvstore("check", "--nvme-path", str(tmp_path))
    assert "live blocks 4" in after.stdout and "problem" not in after.stdout


@pytest.mark.slow
def test_bench_replay_with_data_plane_writes_json_and_plots(tmp_path):
    out, plots = tmp_path / "replay.json", tmp_path / "plots"
    r = kvstore("bench", "replay", "--workload", "agent", "--duration", "40", "--json", str(out),
                "--plots", str(plots), "--nvme-path", str(tmp_path))
    res = json.loads(out.read_text())
    assert set(res["policies"]) == {"hbm-only", "always-offload", "lru", "regime", "belady"}
    for name, p in res["policies"].items():
        for k in ("hit_rate", "ttft_p50_s", "ttft_p99_s", "recomputed_token_share"):
            assert k in p, (name, k)
        if name != "belady":
            assert p["data_plane"]["ok"] and p["data_plane"]["verified_blocks"] > 0
    assert res["cost_model"]["model"]["kv_bytes_per_token"] > 0
    assert sorted(f.name for f in plots.iterdir() if f.suffix == ".png")
    assert "regime" in r.stdout


def test_bench_replay_runs_sessions_side_by_side_every_row_through_the_data_plane(tmp_path):
    out = tmp_path / "replay.json"
    r = kvstore("bench", "replay", "--workload", "agent", "--duration", "30", "--working-set", "60K",
                "--policy", "lru,regime,belady", "--sessions", "both", "--admission", "on",
                "--json", str(out), "--nvme-path", str(tmp_path), "--wide")
    res = json.loads(out.read_text())
    assert set(res["policies"]) == {"lru", "lru+sessions+admission", "regime", "regime+sessions+admission",
                                    "belady"}
    for name, p in res["policies"].items():
        assert p["ttft_after_tool_p99_s"] > 0 and 0 < p["cache_creation_share"] <= 1, name
        if "+sessions" in name:
            assert p["sessions"]["admission"]["limit"] >= 1
        if name != "belady":            # session rows too: the real store, checked against the planner
            assert p["data_plane"]["ok"] and p["data_plane"]["verified_blocks"] > 0, name
    assert "after tool p99" in r.stdout
    bad = kvstore("bench", "replay", "--workload", "agent", "--admission", "on", check=False)
    assert bad.returncode != 0 and "sessions" in bad.stderr and "Traceback" not in bad.stderr


def test_bench_replay_bad_trace_line_names_the_line(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}\n'
                     '{"timestamp": 5, "input_length": "x"}\n')
    r = kvstore("bench", "replay", "--trace", str(trace), check=False)
    assert r.returncode == 2 and ":2" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.slow
def test_bench_sweep_reports_every_band(tmp_path):
    out = tmp_path / "sweep.json"
    kvstore("bench", "sweep", "--duration", "30", "--json", str(out))
    bands = json.loads(out.read_text())["bands"]
    assert [b["band"] for b in bands] == ["<100K", "100K-250K", "250K-500K", ">500K"]
    for b in bands:
        assert b["working_set_tokens"] > 0
        for p in ("hbm-only", "always-offload", "lru", "regime"):
            assert b["policies"][p]["completed"] >= 0 and b["policies"][p]["ttft_mean_s"] >= 0


def test_check_of_a_folder_without_segments_says_so(tmp_path):
    """A typo'd --nvme-path must not read as a healthy tier."""
    empty = kvstore("check", "--nvme-path", str(tmp_path))
    assert "no segment files" in empty.stderr and str(tmp_path) in empty.stderr
    fill_nvme(tmp_path, 2)
    assert "no segment files" not in kvstore("check", "--nvme-path", str(tmp_path)).stderr
