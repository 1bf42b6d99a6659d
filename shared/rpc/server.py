"""The one bootstrap every service uses: aio server, health, reflection, signals and graceful stop."""
from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

log = logging.getLogger("upesi.server")

MAX_MESSAGE_BYTES = 256 * 2**20


@dataclass(slots=True)
class Service:
    name: str                                   # full name, e.g. "upesi.v1.Generation"
    servicer: object
    add_to_server: Callable[[object, grpc.aio.Server], None]


def server_options() -> list[tuple[str, int]]:
    return [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]


async def run_server(address: str, services: list[Service], *, grace_s: float = 5.0,
                     on_start: Callable[[], Awaitable[None]] | None = None,
                     on_stop: Callable[[], Awaitable[None]] | None = None) -> None:
    """Serves until SIGTERM or SIGINT, then reports NOT_SERVING, lets in-flight calls finish and stops."""
    server = grpc.aio.server(options=server_options())
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for s in services:
        s.add_to_server(s.servicer, server)
    names = [s.name for s in services] + [health.SERVICE_NAME, reflection.SERVICE_NAME]
    reflection.enable_server_reflection(names, server)
    port = server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"cannot listen on {address}")
    await server.start()
    if on_start:
        await on_start()
    for name in [""] + [s.name for s in services]:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info("serving %s on %s", ", ".join(s.name for s in services), address)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    waiter = asyncio.create_task(server.wait_for_termination())
    stopper = asyncio.create_task(stop.wait())
    await asyncio.wait([waiter, stopper], return_when=asyncio.FIRST_COMPLETED)
    log.info("stopping: draining in-flight calls for up to %.0f s", grace_s)
    await health_servicer.enter_graceful_shutdown()
    await server.stop(grace_s)
    if on_stop:
        await on_stop()
    stopper.cancel()


def setup_logging(level: str = "INFO") -> None:
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
