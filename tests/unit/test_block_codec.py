"""A stored KV block decodes to the same bits, and every kind of wrong value is refused."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from shared.kv.block_codec import (BlockData, BlockLayout, InvalidBlock, decode, encode, model_fingerprint,
                                   store_mac_key)
from shared.kv.hashing import BlockHash
from shared.kv.host_tier import HostTier
from shared.kv.transfer_cost import TransferCost

H = BlockHash(0x1234_5678_9ABC_DEF0 >> 1)


def layout(dtype=torch.float32, shared=False, fingerprint=b"f" * 16) -> BlockLayout:
    return BlockLayout(fingerprint, dtype, num_layers=3, block_size=4, kv_heads=2, head_dim=8, kv_shared=shared,
                       hidden_size=16)


def block(lay: BlockLayout, hidden: bool) -> BlockData:
    g = torch.Generator().manual_seed(0)
    kv = torch.randn(lay.kv_shape, generator=g).to(lay.dtype)
    return BlockData(kv, torch.randn(lay.block_size, lay.hidden_size, generator=g).to(lay.dtype) if hidden else None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hidden", [False, True])
@pytest.mark.parametrize("shared", [False, True])
def test_round_trip_is_bit_exact(dtype, hidden, shared):
    lay = layout(dtype, shared)
    b = block(lay, hidden)
    got = decode(H, lay, encode(H, lay, b))
    assert torch.equal(got.kv.view(torch.uint8), b.kv.view(torch.uint8))
    assert (got.hidden is None) == (not hidden)
    if hidden:
        assert torch.equal(got.hidden, b.hidden)


def test_wrong_values_are_refused():
    lay = layout()
    value = encode(H, lay, block(lay, True))
    cases = {
        "looked up under another hash": (BlockHash(H + 1), lay, value),
        "another model": (H, dataclasses.replace(lay, fingerprint=b"g" * 16), value),
        "another dtype": (H, dataclasses.replace(lay, dtype=torch.bfloat16), value),
        "another layout": (H, dataclasses.replace(lay, block_size=8), value),
        "truncated": (H, lay, value[:-100]),
        "too short for a header": (H, lay, value[:10]),
        "not a block": (H, lay, b"x" * len(value)),
    }
    flipped = bytearray(value)
    flipped[len(value) // 2] ^= 0x40
    cases["one bit flipped"] = (H, lay, bytes(flipped))
    for what, (h, lay_, v) in cases.items():
        with pytest.raises(InvalidBlock):
            decode(h, lay_, v)
            pytest.fail(what)


def test_fingerprint_tells_weights_and_dtype_apart():
    torch.manual_seed(0)
    a = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    b = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    assert model_fingerprint(a, "cfg", torch.float32) == model_fingerprint(a, "cfg", torch.float32)
    assert model_fingerprint(a, "cfg", torch.float32) != model_fingerprint(b, "cfg", torch.float32)
    assert model_fingerprint(a, "cfg", torch.float32) != model_fingerprint(a, "cfg", torch.bfloat16)
    assert model_fingerprint(a, "cfg", torch.float32) != model_fingerprint(a, "other", torch.float32)


def test_host_tier_keeps_the_most_recently_used_within_its_budget():
    lay = layout()
    one = block(lay, False)
    tier = HostTier(3 * one.nbytes)
    for h in range(4):
        tier.put(BlockHash(h), one)
    assert 0 not in tier and len(tier) == 3 and tier.used_bytes == 3 * one.nbytes
    assert tier.get(BlockHash(1)) is one                  # 1 is now the most recent: 2 goes next
    tier.put(BlockHash(9), one)
    assert 2 not in tier and 1 in tier and 9 in tier


def test_transfer_cost_reads_only_while_cheaper_than_computing():
    cost = TransferCost(block_bytes=1000, block_size=16)
    assert cost.worth_reading(10)                          # nothing measured yet: read
    cost.observe_prefill(512, 0.512)                       # 1 ms a token: 16 ms a block
    cost.observe_read(100_000, 0.01)                       # 0.1 us a byte: 0.1 ms a block
    assert cost.worth_reading(10)
    slow = TransferCost(block_bytes=1000, block_size=16)
    slow.observe_prefill(512, 0.000512)                    # 1 us a token (a GPU)
    slow.observe_read(1000, 0.01)                          # 10 ms a block
    assert not slow.worth_reading(10)
    slow.observe_prefill(4, 100.0)                         # a decode step says nothing of a prefill
    assert not slow.worth_reading(10)


def test_a_store_key_authenticates_every_value():
    lay = layout()
    b = block(lay, True)
    key, other = store_mac_key("s3cret"), store_mac_key("another")
    value = encode(H, lay, b, key)
    assert torch.equal(decode(H, lay, value, key).kv, b.kv)
    # whoever writes to the store without the key: a value with a recomputed plain checksum, or a MAC under
    # another key, is refused as forged
    for forged in (encode(H, lay, b), encode(H, lay, b, other)):
        with pytest.raises(InvalidBlock) as e:
            decode(H, lay, forged, key)
        assert e.value.forged
    flipped = bytearray(value)
    flipped[len(value) // 2] ^= 0x01
    with pytest.raises(InvalidBlock) as e:
        decode(H, lay, bytes(flipped), key)
    assert e.value.forged
    with pytest.raises(InvalidBlock) as e:            # a reader without the key cannot check a MAC
        decode(H, lay, value)
    assert not e.value.forged


def test_store_keys_differ_by_secret():
    assert len(store_mac_key("a")) == 32 and store_mac_key("a") != store_mac_key("b")
