"""One full KV block as bytes for a block store, and the checks that make a wrong value a miss.

    value = header (fixed, little-endian) | payload | checksum
    header  = magic "UPKV", format version, flags (bit 0: hidden rows present; bit 1: the checksum is a MAC), the
              block's chain hash,
              the model fingerprint, dtype code, layers, block size, KV heads, head dim, K/V shared, hidden size,
              payload length
    payload = K/V of every layer [L, S, BS, KVH, Dh] (S = 2, or 1 where K and V are one tensor: MLA),
              then, with flag bit 0, the hidden states [BS, D] an EAGLE head reads
    checksum = BLAKE2b-128 of header + payload, keyed with the store key where the store has one (a MAC)

A value is used only if every header field equals the reader's own (same model weights, dtype, cache layout, the
hash it was looked up under) and the checksum holds; anything else (another model, another dtype, a truncated or
corrupted entry) is `InvalidBlock`, which the store counts and treats as a miss. With a store key a plain checksum
is not enough: whoever can write to Redis or the disk tier could recompute one over K/V of their own and steer
other tenants' answers, but cannot compute the MAC without the key (which Redis never holds). Such a value is
`InvalidBlock` with `forged` set.
"""
from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

import torch

from shared.kv.hashing import BlockHash

MAGIC = b"UPKV"
VERSION = 1
_HEADER = struct.Struct("<4sHHQ16sBHHHHBIQ")   # magic ver flags hash fingerprint dtype L BS KVH Dh shared D payload
_CHECKSUM = 16
_DTYPES = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3}
_HIDDEN = 1
_KEYED = 2
_KEY_PERSON = b"upesi-kv-mac"


class InvalidBlock(ValueError):
    """A stored value that must not be used: it names why (the store logs it and counts a miss). `forged`: its
    authentication failed (no MAC, or a wrong one, under the reader's store key)."""

    def __init__(self, why: str, forged: bool = False) -> None:
        super().__init__(why)
        self.forged = forged


def store_mac_key(secret: str) -> bytes:
    """The 32-byte MAC key of a store key given as any string (a passphrase, or random hex)."""
    return hashlib.blake2b(secret.encode(), digest_size=32, person=_KEY_PERSON).digest()


def _digest(key: bytes | None) -> hashlib.blake2b:
    return hashlib.blake2b(digest_size=_CHECKSUM, key=key or b"")


@dataclass(frozen=True, slots=True)
class BlockLayout:
    """What a block's bytes mean; two processes share blocks only when every field is equal."""
    fingerprint: bytes          # 16 bytes: the model's weights and config (model_fingerprint)
    dtype: torch.dtype
    num_layers: int
    block_size: int
    kv_heads: int
    head_dim: int
    kv_shared: bool             # K and V are one tensor (MLA's latent)
    hidden_size: int

    @property
    def kv_shape(self) -> tuple[int, ...]:
        return (self.num_layers, 1 if self.kv_shared else 2, self.block_size, self.kv_heads, self.head_dim)

    @property
    def kv_bytes(self) -> int:
        n = 1
        for d in self.kv_shape:
            n *= d
        return n * self.dtype.itemsize

    @property
    def hidden_bytes(self) -> int:
        return self.block_size * self.hidden_size * self.dtype.itemsize

    def key_tag(self) -> str:
        """Part of a store key: blocks of another model or dtype are never even read."""
        return self.fingerprint[:8].hex()


@dataclass(slots=True)
class BlockData:
    """A block's contents on the host: kv [L, S, BS, KVH, Dh]; hidden [BS, D] or None."""
    kv: torch.Tensor
    hidden: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        return self.kv.nbytes + (self.hidden.nbytes if self.hidden is not None else 0)


def model_fingerprint(model: torch.nn.Module, config_text: str, dtype: torch.dtype) -> bytes:
    """16 bytes naming the weights a KV block was computed with: the config, the dtype, and the name, shape, dtype
    and first 256 values of the first and last four parameters (cheap, yet another checkpoint, a quantised copy or
    another dtype gives another fingerprint)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(config_text.encode())
    h.update(str(dtype).encode())
    params = list(model.named_parameters())
    for name, p in params[:4] + params[-4:]:
        h.update(f"{name}{tuple(p.shape)}{p.dtype}".encode())
        head = p.detach().reshape(-1)[:256].contiguous().cpu()
        h.update(_raw(head))
    return h.digest()


def _raw(t: torch.Tensor) -> bytes:
    t = t.contiguous()
    return t.view(torch.uint8).numpy().tobytes() if t.numel() else b""


def encode(h: BlockHash, layout: BlockLayout, block: BlockData, key: bytes | None = None) -> bytes:
    """The stored value of a block; `key` (store_mac_key): its checksum is a MAC under that key."""
    if tuple(block.kv.shape) != layout.kv_shape or block.kv.dtype != layout.dtype:
        raise ValueError(f"block kv {tuple(block.kv.shape)} {block.kv.dtype} does not match the layout "
                         f"{layout.kv_shape} {layout.dtype}")
    payload = [_raw(block.kv.cpu())]
    flags = _KEYED if key else 0
    if block.hidden is not None:
        flags |= _HIDDEN
        payload.append(_raw(block.hidden.to(layout.dtype).cpu()))
    size = sum(len(p) for p in payload)
    header = _HEADER.pack(MAGIC, VERSION, flags, h, layout.fingerprint, _DTYPES[layout.dtype], layout.num_layers,
                          layout.block_size, layout.kv_heads, layout.head_dim, int(layout.kv_shared),
                          layout.hidden_size, size)
    digest = _digest(key)
    digest.update(header)
    for p in payload:
        digest.update(p)
    return b"".join([header, *payload, digest.digest()])


def decode(h: BlockHash, layout: BlockLayout, value: bytes, key: bytes | None = None) -> BlockData:
    """The block stored under `h`, or InvalidBlock. With a `key` only a value with a MAC under it is used."""
    if len(value) < _HEADER.size + _CHECKSUM:
        raise InvalidBlock(f"truncated: {len(value)} bytes")
    (magic, version, flags, stored_hash, fingerprint, dtype_code, layers, bs, kvh, dh, shared, hidden_size,
     size) = _HEADER.unpack_from(value)
    if magic != MAGIC or version != VERSION:
        raise InvalidBlock(f"not a block of this format (magic {magic!r}, version {version})")
    if stored_hash != h:
        raise InvalidBlock(f"stored for block {stored_hash:016x}, looked up as {h:016x}")
    if fingerprint != layout.fingerprint:
        raise InvalidBlock("computed by another model (fingerprint differs)")
    if dtype_code != _DTYPES[layout.dtype]:
        raise InvalidBlock(f"dtype code {dtype_code}, this model runs {layout.dtype}")
    if (layers, bs, kvh, dh, bool(shared), hidden_size) != (layout.num_layers, layout.block_size, layout.kv_heads,
                                                            layout.head_dim, layout.kv_shared, layout.hidden_size):
        raise InvalidBlock("another cache layout")
    want = layout.kv_bytes + (layout.hidden_bytes if flags & _HIDDEN else 0)
    if size != want or len(value) != _HEADER.size + size + _CHECKSUM:
        raise InvalidBlock(f"payload of {len(value) - _HEADER.size - _CHECKSUM} bytes, expected {want}")
    if key and not flags & _KEYED:
        raise InvalidBlock("not authenticated: no MAC under this store's key", forged=True)
    if not key and flags & _KEYED:
        raise InvalidBlock("authenticated under a store key this reader does not have")
    body = memoryview(value)[:_HEADER.size + size]
    digest = _digest(key)
    digest.update(body)
    if digest.digest() != value[-_CHECKSUM:]:
        raise InvalidBlock("MAC mismatch: forged, or written under another key" if key else "checksum mismatch",
                           forged=bool(key))
    start = _HEADER.size
    raw = torch.frombuffer(bytearray(body[start:]), dtype=torch.uint8)
    kv = raw[:layout.kv_bytes].view(layout.dtype).view(layout.kv_shape)
    hidden = None
    if flags & _HIDDEN:
        hidden = raw[layout.kv_bytes:].view(layout.dtype).view(layout.block_size, layout.hidden_size)
    return BlockData(kv, hidden)
