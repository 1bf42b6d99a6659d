"""The one bootstrap every service uses: aio server, health, reflection, tracing, TLS, signals and graceful stop."""
from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from shared import telemetry
from shared.rpc import internal_token
from shared.rpc.channel import MAX_MESSAGE_BYTES, ServerTLS, message_options
from shared.rpc.ports import ListenError

log = logging.getLogger("upesi.server")

__all__ = ["MAX_MESSAGE_BYTES", "ConnectionLimits", "Service", "create_server", "run_server", "server_options",
           "setup_logging"]


@dataclass(slots=True)
class Service:
    name: str                                   # full name, e.g. "upesi.v1.Generation"
    servicer: object
    add_to_server: Callable[[object, grpc.aio.Server], None]


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    """Bounds on a public port's clients: the streams one connection may have open at once (HTTP/2's
    SETTINGS_MAX_CONCURRENT_STREAMS; more wait), the calls the whole server runs at once (more are refused with
    RESOURCE_EXHAUSTED), and the seconds a connection without calls stays open."""
    streams_per_connection: int = 100
    max_calls: int = 4096
    idle_s: float = 300.0


def server_options(max_receive_bytes: int | None = None,
                   limits: ConnectionLimits | None = None) -> list[tuple[str, int]]:
    """Message sizes (a public port receives at most `max_receive_bytes`: larger messages are refused with
    RESOURCE_EXHAUSTED before they are parsed), clients' keepalive pings every 4 s or more are welcome
    (channel.keepalive_options), a port already taken is refused (no SO_REUSEPORT: two services on one port would
    share its connections silently), and a public port's connection limits."""
    sizes = [(k, max_receive_bytes if max_receive_bytes and k.endswith("receive_message_length") else v)
             for k, v in message_options()]
    out = sizes + [("grpc.so_reuseport", 0), ("grpc.keepalive_permit_without_calls", 1),
                   ("grpc.http2.min_ping_interval_without_data_ms", 4_000)]
    if limits is not None:
        out += [("grpc.max_concurrent_streams", limits.streams_per_connection),
                ("grpc.max_connection_idle_ms", int(limits.idle_s * 1000))]
    return out


def create_server(max_receive_bytes: int | None = None, limits: ConnectionLimits | None = None,
                  interceptors: list | None = None) -> grpc.aio.Server:
    """An aio server with the options above; `limits` also caps the calls it runs at once."""
    return grpc.aio.server(options=server_options(max_receive_bytes, limits), interceptors=interceptors or None,
                           maximum_concurrent_rpcs=limits.max_calls if limits else None)


def _loopback(address: str) -> bool:
    host = address.rsplit(":", 1)[0].strip("[]")
    return host in ("localhost", "::1") or host.startswith("127.")


async def run_server(address: str, services: list[Service], *, grace_s: float = 30.0,
                     tls: ServerTLS | None = None,
                     on_start: Callable[[], Awaitable[None]] | None = None,
                     on_drain: Callable[[], None] | None = None,
                     on_stop: Callable[[], Awaitable[None]] | None = None,
                     max_receive_bytes: int | None = None, internal: bool = True,
                     limits: ConnectionLimits | None = None) -> None:
    """Serves until SIGTERM or SIGINT, then reports NOT_SERVING, lets in-flight calls finish and stops.

    With `tls` the port serves TLS (mTLS when it names a client CA). Each call gets a SERVER span when tracing is
    on (telemetry.setup_tracing, called by the service before this). An `internal` service (every one but the
    router) refuses callers without the deployment's token when it has one (shared.rpc.internal_token); a public
    port takes `limits` on its clients' connections."""
    interceptors = (internal_token.server_interceptors() if internal else []) + telemetry.server_interceptors()
    if internal and not internal_token.token() and not _loopback(address):
        log.warning("%s is reachable beyond this host and no %s is set: any caller that reaches it is served",
                    address, internal_token.ENV)
    server = create_server(max_receive_bytes, limits, interceptors)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for s in services:
        s.add_to_server(s.servicer, server)
    names = [s.name for s in services] + [health.SERVICE_NAME, reflection.SERVICE_NAME]
    reflection.enable_server_reflection(names, server)
    creds = tls.credentials() if tls else None
    try:
        port = server.add_insecure_port(address) if creds is None else server.add_secure_port(address, creds)
    except RuntimeError:                             # grpcio's "Failed to bind"; older releases return 0
        port = 0
    if port == 0:
        if on_stop:                                  # the service's threads stop, so its process can exit
            await on_stop()
        raise ListenError(f"cannot listen on {address}: another process holds the port, or the host is not this "
                          "machine's")
    await server.start()
    if on_start:
        await on_start()
    for name in [""] + [s.name for s in services]:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info("serving %s on %s%s", ", ".join(s.name for s in services), address,
             "" if creds is None else " (mTLS)" if tls.client_ca else " (TLS)")

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    waiter = asyncio.create_task(server.wait_for_termination())
    stopper = asyncio.create_task(stop.wait())
    await asyncio.wait([waiter, stopper], return_when=asyncio.FIRST_COMPLETED)
    log.info("stopping: draining in-flight calls for up to %.0f s", grace_s)
    if on_drain:                                     # e.g. the router's HTTP side refuses new requests from now on
        on_drain()
    await health_servicer.enter_graceful_shutdown()
    await server.stop(grace_s)
    if on_stop:
        await on_stop()
    telemetry.shutdown_tracing()
    stopper.cancel()


def setup_logging(level: str = "INFO") -> None:
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
