"""Keepalive pings between the services are welcome on every server (shared.rpc.server.server_options): a channel
with the router's keepalive (a ping every 5 s while a call is open) keeps a long silent stream open past the 3
strikes after which a gRPC server that takes the pings for abuse answers GOAWAY ("too_many_pings") and fails the
call. A real aio server and channel in process, with the health service's streaming Watch as the silent stream;
the test waits 22 s (4 pings)."""
from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from shared.rpc.channel import keepalive_options
from shared.rpc.server import create_server


def test_a_silent_stream_outlives_the_keepalive_pings():
    async def main() -> None:
        server = create_server()
        servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
        await servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}",
                                                 options=keepalive_options(5_000, 4_000, idle=False)) as ch:
                call = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(service=""))
                first = await call.read()
                assert first.status == health_pb2.HealthCheckResponse.SERVING
                await asyncio.sleep(22)                      # silent: only the client's pings cross
                await servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
                update = await asyncio.wait_for(call.read(), 5)
                assert update != grpc.aio.EOF and update.status == health_pb2.HealthCheckResponse.NOT_SERVING
                call.cancel()
        finally:
            await server.stop(None)

    asyncio.run(main())
