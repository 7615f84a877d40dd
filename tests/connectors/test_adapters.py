"""An adapter's revision is the digest of its files, read once per adapter id.

kvstore.connectors.adapters without an engine: real files in a temp dir. The
end to end (a real vLLM serving random LoRA adapters through the daemon) is
tests/connectors/test_vllm_lora.py.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvstore.connectors.adapters import (
    MAX_ADAPTER_FILES,
    AdapterChanged,
    AdapterRevisions,
    adapter_digest,
    files_signature,
)


def write_adapter(d: Path, weights: bytes, config: str = '{"r": 8}') -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "adapter_config.json").write_text(config)
    (d / "adapter_model.safetensors").write_bytes(weights)
    return d


def test_the_digest_follows_the_bytes_not_the_path(tmp_path):
    a = write_adapter(tmp_path / "a", os.urandom(4096))
    same = write_adapter(tmp_path / "elsewhere", (a / "adapter_model.safetensors").read_bytes())
    assert adapter_digest(str(a)) == adapter_digest(str(same))
    before = adapter_digest(str(a))
    data = bytearray((a / "adapter_model.safetensors").read_bytes())
    data[len(data) // 2] ^= 1                          # one bit of one weight
    (a / "adapter_model.safetensors").write_bytes(bytes(data))
    assert adapter_digest(str(a)) != before
    write_adapter(same, bytes(data), config='{"r": 16}')   # another config, same weights
    assert adapter_digest(str(same)) != adapter_digest(str(a))


def test_a_file_moved_between_names_changes_the_digest(tmp_path):
    one = tmp_path / "one"
    one.mkdir()
    (one / "x").write_bytes(b"ab")
    (one / "y").write_bytes(b"")
    two = tmp_path / "two"
    two.mkdir()
    (two / "x").write_bytes(b"")
    (two / "y").write_bytes(b"ab")
    assert adapter_digest(str(one)) != adapter_digest(str(two))


def test_subdirectories_are_not_read_and_too_many_files_is_refused(tmp_path):
    a = write_adapter(tmp_path / "a", b"w" * 100)
    before = adapter_digest(str(a))
    (a / "checkpoint-1").mkdir()
    (a / "checkpoint-1" / "optimizer.pt").write_bytes(b"junk")
    assert adapter_digest(str(a)) == before
    big = tmp_path / "big"
    big.mkdir()
    for i in range(MAX_ADAPTER_FILES + 1):
        (big / f"f{i}").write_bytes(b"")
    with pytest.raises(ValueError, match="more than an adapter's"):
        adapter_digest(str(big))


def test_revision_is_read_once_per_id_and_again_on_reload(tmp_path):
    a = write_adapter(tmp_path / "a", b"old" * 1000)
    revs = AdapterRevisions()
    first = revs.revision("sql", 1, str(a))
    assert first.startswith("sha256:")
    assert revs.revision("sql", 1, str(a)) == first        # unchanged files: the same, not read again
    write_adapter(a, b"new" * 1000)
    # the engine holds id 1's old weights until it evicts the id, then reads the
    # new files under it: which weights compute id 1 is unknown, so it is refused
    with pytest.raises(AdapterChanged):
        revs.revision("sql", 1, str(a))
    with pytest.raises(AdapterChanged):
        revs.revision("sql", 1, str(a))                     # until it is reloaded
    # a reload under a new id reads the files again
    second = revs.revision("sql", 2, str(a))
    assert second != first
    # vLLM's load_inplace re-reads under the same id, and the id keeps the new digest
    write_adapter(a, b"newer" * 1000)
    third = revs.revision("sql", 1, str(a), reload=True)
    assert third not in (first, second)
    assert revs.revision("sql", 1, str(a)) == third
    # another engine that loaded the same files agrees, whatever its ids
    assert AdapterRevisions().revision("renamed-id", 7, str(a)) == third


def test_an_unreadable_adapter_is_reusable_only_in_this_process_and_id(tmp_path, caplog):
    revs = AdapterRevisions()
    missing = str(tmp_path / "nope")
    r1 = revs.revision("x", 1, missing)
    assert r1.startswith("unread:") and revs.revision("x", 1, missing) == r1
    assert revs.revision("x", 2, missing) != r1               # another id: another revision
    assert AdapterRevisions().revision("x", 1, missing) != r1  # another process: never shared
    assert "could not be read" in caplog.text
    unresolved = AdapterRevisions(resolve=lambda p: None)
    a = write_adapter(tmp_path / "a", b"w")
    assert unresolved.revision("x", 1, str(a)).startswith("unread:")


def test_files_rewritten_while_they_are_digested_are_not_trusted(tmp_path, monkeypatch):
    import kvstore.connectors.adapters as adapters
    a = write_adapter(tmp_path / "a", b"old" * 100)
    real = adapters.adapter_digest

    def digest_then_rewrite(path: str) -> str:
        out = real(path)
        write_adapter(a, b"rewritten" * 100)      # lands between the read and the check
        return out

    monkeypatch.setattr(adapters, "adapter_digest", digest_then_rewrite)
    revs = AdapterRevisions()
    with pytest.raises(AdapterChanged):
        revs.revision("x", 1, str(a))
    monkeypatch.setattr(adapters, "adapter_digest", real)
    assert revs.revision("x", 1, str(a)) == "sha256:" + real(str(a))   # nothing stale was kept


def test_the_signature_sees_a_rewrite_of_the_same_size(tmp_path):
    a = write_adapter(tmp_path / "a", b"x" * 64)
    before = files_signature(str(a))
    os.replace(write_adapter(tmp_path / "b", b"y" * 64) / "adapter_model.safetensors",
               a / "adapter_model.safetensors")      # same size, a new inode
    assert files_signature(str(a)) != before
    assert files_signature(str(tmp_path / "missing")) is None


def test_an_id_named_with_another_path_is_refused_and_a_reload_of_unchanged_files_is_not_read(tmp_path,
                                                                                            monkeypatch):
    import kvstore.connectors.adapters as adapters
    a = write_adapter(tmp_path / "a", b"a" * 100)
    b = write_adapter(tmp_path / "b", b"b" * 100)
    revs = AdapterRevisions()
    ra = revs.revision("x", 1, str(a))
    # vLLM's worker keeps id 1's first weights (a's): b's digest would key a's K/V
    with pytest.raises(AdapterChanged):
        revs.revision("x", 1, str(b))
    reads = []
    real = adapters.adapter_digest
    monkeypatch.setattr(adapters, "adapter_digest", lambda p: reads.append(p) or real(p))
    # vLLM's server sends every request of a reloaded adapter with load_inplace: not read again
    assert revs.revision("x", 1, str(a), reload=True) == ra and reads == []
    # a reload onto the other path reads it, and keys it
    assert revs.revision("x", 1, str(b), reload=True) == "sha256:" + real(str(b)) and reads == [str(b)]


def test_an_unreadable_adapter_gets_a_new_revision_at_every_reload(tmp_path):
    revs = AdapterRevisions()
    missing = str(tmp_path / "nope")
    first = revs.revision("x", 1, missing)
    again = revs.revision("x", 1, missing, reload=True)      # new weights may have come with it
    assert again != first and revs.revision("x", 1, missing) == again


def test_an_adapter_reloaded_with_other_files_is_marked_revised(tmp_path):
    a = write_adapter(tmp_path / "a", b"old" * 100)
    revs = AdapterRevisions()
    revs.revision("x", 1, str(a))
    revs.revision("x", 2, str(a))                              # the same files under a new id
    assert not revs.revised("x", str(a))
    write_adapter(a, b"new" * 100)
    revs.revision("x", 3, str(a))                              # reloaded with other files
    assert revs.revised("x", str(a)) and not revs.revised("y", str(a))


def test_a_fifo_or_an_oversized_adapter_never_hangs_the_reader(tmp_path, monkeypatch):
    import kvstore.connectors.adapters as adapters
    a = write_adapter(tmp_path / "a", b"w" * 100)
    before = adapter_digest(str(a))
    os.mkfifo(a / "zz-fifo")                   # no writer: an open() without O_NONBLOCK would hang
    assert adapter_digest(str(a)) == before
    monkeypatch.setattr(adapters, "MAX_ADAPTER_BYTES", 150)
    write_adapter(a, b"w" * 200)
    with pytest.raises(ValueError, match="more than an adapter's"):
        adapter_digest(str(a))
    assert AdapterRevisions().revision("x", 1, str(a)).startswith("unread:")
