"""The optional lz4 / byte-shuffle codec of the Redis tier."""
from __future__ import annotations

import numpy as np
import pytest

from kvstore.errors import ConfigError, CorruptRecord
from kvstore.record import FLAG_LZ4, FLAG_SHUFFLE
from kvstore.tiers import compress


def _kv_like(n: int, seed: int = 0) -> np.ndarray:
    """bf16-like values: small gaussian numbers, so the high bytes repeat."""
    f32 = np.random.default_rng(seed).standard_normal(n // 2).astype(np.float32) * 0.02
    return (f32.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)


def test_shuffle_is_its_own_inverse():
    data = np.arange(1000, dtype=np.uint16).view(np.uint8)
    planes = compress.shuffle16(memoryview(data)).ravel()
    assert np.array_equal(planes[:1000], data[0::2]) and np.array_equal(planes[1000:], data[1::2])
    out = np.empty_like(data)
    compress.unshuffle16_into(planes, memoryview(out))
    assert np.array_equal(out, data)


@pytest.mark.parametrize("codec", compress.CODECS)
def test_round_trip_is_byte_exact(codec):
    for data in (np.zeros(1 << 16, np.uint8), _kv_like(1 << 16), np.tile(np.arange(256, dtype=np.uint8), 64)):
        stored, flags = compress.encode(memoryview(data), codec)
        if codec == "none":
            assert flags == 0
        out = np.empty_like(data)
        compress.decode_into(stored, flags, memoryview(out))
        assert np.array_equal(out, data)


@pytest.mark.parametrize("codec", compress.CODECS)
def test_odd_lengths_round_trip(codec):
    """A block of any size is stored: an odd one has no 16-bit lanes, so
    lz4-shuffle compresses it unshuffled instead of failing the put."""
    for data in (np.zeros(4097, np.uint8), np.arange(1, dtype=np.uint8)):
        stored, flags = compress.encode(memoryview(data), codec)
        assert not flags & FLAG_SHUFFLE
        out = np.empty_like(data)
        compress.decode_into(stored, flags, memoryview(out))
        assert np.array_equal(out, data)
    assert compress.encode(memoryview(np.zeros(4097, np.uint8)), "lz4-shuffle")[1] == FLAG_LZ4


def test_shuffle_flags_and_gain_on_16_bit_data():
    data = _kv_like(1 << 16)
    stored, flags = compress.encode(memoryview(data), "lz4-shuffle")
    assert flags == FLAG_LZ4 | FLAG_SHUFFLE and len(stored) < 0.95 * data.nbytes


def test_incompressible_data_is_stored_raw_without_a_copy():
    data = np.random.default_rng(1).integers(0, 256, 1 << 16, dtype=np.uint8)
    view = memoryview(data)
    for codec in ("lz4", "lz4-shuffle"):
        stored, flags = compress.encode(view, codec)
        assert flags == 0 and stored is view


def test_bad_streams_and_codecs_are_typed_errors():
    data = np.zeros(4096, np.uint8)
    stored, flags = compress.encode(memoryview(data), "lz4")
    with pytest.raises(CorruptRecord):
        compress.decode_into(stored[: len(stored) // 2], flags, memoryview(np.empty(4096, np.uint8)))
    with pytest.raises(CorruptRecord):
        compress.decode_into(stored, flags, memoryview(np.empty(8192, np.uint8)))
    with pytest.raises(ConfigError):
        compress.check_codec("zstd")
    with pytest.raises(ConfigError):
        compress.shuffle16(memoryview(np.zeros(3, np.uint8)))


@pytest.mark.hf
def test_real_kv_from_a_random_weight_llama():
    """Real K/V: plain lz4 never pays (stored raw); shuffle round-trips byte-exact."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from kvstore.bench.redis_raw import measure_codec

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=512,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=512)
    model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    with torch.no_grad():
        cache = model(torch.randint(0, 1000, (1, 256)), use_cache=True).past_key_values
    kv = torch.stack([torch.stack([layer.keys[0], layer.values[0]]) for layer in cache.layers])
    blocks = [kv[:, :, :, t:t + 16, :].contiguous().view(torch.uint8).numpy().ravel().copy()
              for t in range(0, kv.shape[3], 16)]
    plain = measure_codec(blocks, "lz4")
    shuffled = measure_codec(blocks, "lz4-shuffle")  # asserts a byte-exact round trip
    assert plain["ratio"] == pytest.approx(1.0)
    assert 1.0 <= shuffled["ratio"] < 1.5
