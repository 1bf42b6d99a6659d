"""`upesi router`: the public gRPC API and HTTP endpoints; tokenises and forwards to a target."""
from __future__ import annotations

import argparse
import asyncio
import logging

from services.router.config import RouterConfig
from shared.config import add_config_arguments, config_from_args
from shared.rpc.server import Service, run_server

log = logging.getLogger("upesi.router")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, RouterConfig)


async def serve(cfg: RouterConfig) -> None:
    from services.router.frontend import Frontend
    from services.router.http import build_app, start_http
    from services.router.servicer import GenerationServicer
    from services.router.target_client import TargetClient
    from shared.model.loader import resolve_model_path
    from shared.tokenizer import Tokenizer
    from upesi.v1 import generation_pb2_grpc

    target = TargetClient(cfg.target)
    tokenizer_task = asyncio.create_task(asyncio.to_thread(Tokenizer, resolve_model_path(cfg.model)))
    info = await target.wait_info(cfg.target_wait_s)
    frontend = Frontend(cfg, await tokenizer_task, target, info)
    http = None

    async def on_start() -> None:
        nonlocal http
        if cfg.http_port:
            http = await start_http(build_app(frontend), cfg.http_host, cfg.http_port)

    async def on_stop() -> None:
        if http:
            http[0].should_exit = True
            await http[1]
        await target.close()

    service = Service("upesi.v1.Generation", GenerationServicer(frontend),
                      generation_pb2_grpc.add_GenerationServicer_to_server)
    await run_server(cfg.address, [service], on_start=on_start, on_stop=on_stop)


def main(args: argparse.Namespace) -> None:
    asyncio.run(serve(config_from_args(RouterConfig, args)))
