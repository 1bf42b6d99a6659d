"""`upesi router`: the public gRPC API and HTTP endpoints; tokenises and forwards to a target."""
from __future__ import annotations

import argparse
import asyncio
from pathlib import Path
import logging

from services.router.config import RouterConfig
from shared.config import add_config_arguments, config_from_args
from shared.rpc.server import Service, run_server

log = logging.getLogger("upesi.router")
PREFILL_JOIN_S = 5.0          # at start, how long to wait for prefill targets that are already up


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, RouterConfig)


async def serve(cfg: RouterConfig) -> None:
    from services.router.auth import KeyTable
    from services.router.draft_client import DraftClient
    from services.router.frontend import Frontend
    from services.router.http import build_app, start_http
    from services.router.servicer import GenerationServicer, add_to_server
    from shared import telemetry
    from shared.model_files import resolve_model_path, served_name
    from shared.registry.factory import open_registry
    from shared.rpc.channel import client_tls_from, server_tls_from, set_client_tls
    from shared.tokenizer import Tokenizer

    telemetry.setup_tracing("upesi-router")
    set_client_tls(client_tls_from(cfg))
    keys = KeyTable.from_config(cfg)                 # a bad keys file fails here, before waiting for targets
    model_path = resolve_model_path(cfg.model)
    tokenizer_task = asyncio.create_task(asyncio.to_thread(Tokenizer, model_path))
    targets, prefill, infos, joins = await _connect_targets(cfg)
    registry = open_registry(cfg.registry) if cfg.registry else None
    drafts = [DraftClient(a) for a in cfg.draft_addresses()]      # connect lazily: a draft may start later
    tokenizer = await tokenizer_task
    if cfg.chat_template:
        tokenizer.use_chat_template(Path(cfg.chat_template).read_text())
    frontend = Frontend(cfg, tokenizer, targets, infos[0], registry, keys, drafts,
                        served_model=cfg.served_model_name or served_name(model_path), prefill=prefill)
    http = None

    async def on_start() -> None:
        nonlocal http
        if cfg.http_port:
            http = await start_http(build_app(frontend), cfg.http_host, cfg.http_port, cfg.http_max_connections,
                                    cfg.http_header_timeout_s)

    async def on_stop() -> None:
        if http:
            http[0].should_exit = True
            await http[1]
        for j in joins:
            j.cancel()
        for t in [*targets, *prefill, *drafts]:
            await t.close()
        frontend.placement.close()
        if registry is not None:
            registry.close()

    service = Service("upesi.v1.Generation", GenerationServicer(frontend), add_to_server)
    def on_drain() -> None:
        frontend.draining = True                     # HTTP keeps serving open streams but refuses new requests

    await run_server(cfg.address, [service], tls=server_tls_from(cfg), on_start=on_start, on_drain=on_drain,
                     on_stop=on_stop, max_receive_bytes=cfg.max_request_bytes,
                     internal=False, limits=cfg.connection_limits())


async def _connect_targets(cfg: RouterConfig) -> tuple[list, list, list, list[asyncio.Task]]:
    """The decode targets (waited for; they must agree on model and block size), the prefill targets, the decode
    targets' infos, and the tasks that let prefill targets join once they are up."""
    from services.router.target_client import TargetClient

    targets = [TargetClient(a.strip()) for a in cfg.target.split(",") if a.strip()]
    if not targets:
        raise ValueError("--target names no address")
    prefill = [TargetClient(a) for a in cfg.prefill_addresses()]
    infos = await asyncio.gather(*(t.wait_info(cfg.target_wait_s) for t in targets))
    if len({i.model for i in infos}) > 1:
        raise ValueError(f"the target replicas serve different models: {sorted({i.model for i in infos})}")
    if len({i.block_size for i in infos}) > 1:
        raise ValueError("the target replicas use different KV block sizes; give them all the same --block-size")
    # prefill targets are optional: each is used from the moment it answers with the same model and block size
    joins = [asyncio.create_task(t.join_when_up(infos[0])) for t in prefill]
    if joins:                                        # those already up (as `upesi serve` starts them) join now
        await asyncio.wait(joins, timeout=PREFILL_JOIN_S)
    return targets, prefill, list(infos), joins


def main(args: argparse.Namespace) -> None:
    asyncio.run(serve(config_from_args(RouterConfig, args)))
