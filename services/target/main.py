"""`upesi target`: the model, its paged KV cache and the scheduler behind a gRPC server."""
from __future__ import annotations

import argparse
import asyncio
import logging

from services.target.config import TargetConfig
from shared import metrics
from shared.config import add_config_arguments, config_from_args
from shared.engine.async_engine import AsyncEngine
from shared.engine.engine import LLMEngine
from shared.rpc.server import Service, run_server

log = logging.getLogger("upesi.target")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, TargetConfig)


def _observe(engine: LLMEngine, seen: list[int]) -> None:
    """Called on the engine thread after every step."""
    metrics.KV_BLOCKS_USED.set(engine.block_manager.num_used_blocks)
    metrics.RUNNING.set(len(engine.scheduler.running))
    metrics.WAITING.set(len(engine.scheduler.waiting))
    metrics.STEP_SECONDS.observe(engine.last_step_s)
    new = engine.scheduler.num_preemptions - seen[0]
    if new:
        metrics.PREEMPTIONS.inc(new)
        seen[0] += new


async def serve(cfg: TargetConfig) -> None:
    from prometheus_client import start_http_server

    from upesi.v1 import target_pb2_grpc

    engine = LLMEngine(cfg.engine_config())
    metrics.KV_BLOCKS_TOTAL.set(engine.block_manager.num_blocks)
    seen = [0]
    async_engine = AsyncEngine(engine, on_step=lambda e: _observe(e, seen))
    if cfg.metrics_port:
        start_http_server(cfg.metrics_port, addr="127.0.0.1" if cfg.address.startswith("127.") else "0.0.0.0")
    from services.target.servicer import TargetServicer
    service = Service("upesi.v1.Target", TargetServicer(async_engine), target_pb2_grpc.add_TargetServicer_to_server)

    async def stop() -> None:
        async_engine.stop()

    log.info("model %s: %d KV blocks of %d tokens, context %d", engine.model_path, engine.block_manager.num_blocks,
             cfg.block_size, engine.max_model_len)
    await run_server(cfg.address, [service], on_stop=stop)


def main(args: argparse.Namespace) -> None:
    asyncio.run(serve(config_from_args(TargetConfig, args)))
