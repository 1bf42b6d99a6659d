"""KV blocks from one target to another over gRPC (prefill/decode disaggregation with direct transfer).

    prefill target                                               decode target
    Generate(kv_destination=D) ... prompt computed
    engine thread: export_blocks -> copies of the prompt's blocks
    encode (block_codec) --- PutBlocks stream, one KVBlock each --> decode + check (block_codec)
                                                                    engine thread: receive_blocks -> host tier
    last answer to the router <- PutBlocksResponse(stored)
                                                                  router: Generate on D -> prefix-cache miss -> host
                                                                  tier hit -> imported, no prefill

The values are the block store's (shared/kv/block_codec.py), so a block from another model, dtype or layout, or a
damaged one, is refused by the same checks. Protobuf stays here and in the servicer; the engine sees BlockData.
"""
from __future__ import annotations

import asyncio
import logging
import time

from shared import metrics
from shared.engine.async_engine import AsyncEngine
from shared.kv.block_codec import BlockData, BlockLayout, InvalidBlock, decode, encode
from shared.kv.hashing import BlockHash
from shared.rpc.channel import aio_channel
from upesi.v1 import target_pb2, target_pb2_grpc

log = logging.getLogger("upesi.target.blocks")
SEND_TIMEOUT_S = 60.0


class BlockSender:
    """Sends a prompt's cached blocks to other targets; one channel per destination, opened on first use."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        self.stubs: dict[str, target_pb2_grpc.TargetStub] = {}

    async def send(self, destination: str, prompt: list[int], cache_salt: str) -> int:
        """The prompt's leading cached blocks to `destination` -> how many it stored. Raises on failure."""
        t0 = time.perf_counter()
        items = await self.engine.call(lambda e: e.export_blocks(prompt, cache_salt))
        if not items:
            return 0
        layout = self.engine.block_layout
        loop = asyncio.get_running_loop()
        values = await loop.run_in_executor(None, encode_blocks, layout, items)
        stub = self.stubs.get(destination)
        if stub is None:
            stub = self.stubs[destination] = target_pb2_grpc.TargetStub(aio_channel(destination))
        reply = await stub.PutBlocks(iter(target_pb2.KVBlock(hash=h, value=v) for h, v in values),
                                     timeout=SEND_TIMEOUT_S)
        metrics.KV_STORE_BYTES.labels("sent").inc(sum(len(v) for _, v in values))
        log.debug("sent %d blocks to %s in %.1f ms (%d stored, %d refused)", len(values), destination,
                  1e3 * (time.perf_counter() - t0), reply.stored, reply.invalid)
        return reply.stored


def encode_blocks(layout: BlockLayout, items: list[tuple[BlockHash, BlockData]]) -> list[tuple[BlockHash, bytes]]:
    """Blocks -> (hash, value) pairs in the block store's format."""
    return [(h, encode(h, layout, b)) for h, b in items]


def decode_blocks(layout: BlockLayout, blocks: list[tuple[int, bytes]]
                  ) -> tuple[list[tuple[BlockHash, BlockData]], int]:
    """Received (hash, value) pairs -> the blocks that pass every check, and how many did not."""
    good, bad = [], 0
    for h, value in blocks:
        try:
            good.append((BlockHash(h), decode(BlockHash(h), layout, value)))
        except InvalidBlock as e:
            bad += 1
            metrics.KV_STORE_INVALID.inc()
            log.warning("KV block %016x from another target not used: %s", h, e)
    return good, bad
