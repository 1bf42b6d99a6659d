"""A public gRPC port's connection limits (shared.rpc.server.create_server, as the router serves): calls beyond the
server's cap are refused with RESOURCE_EXHAUSTED while the others go on, and an idle connection is closed. A real
aio server and channel in process, with the health service's streaming Watch as the long call."""
from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from services.router.config import RouterConfig
from shared.rpc.server import ConnectionLimits, create_server


async def _serve(limits: ConnectionLimits) -> tuple[grpc.aio.Server, int]:
    server = create_server(limits=limits)
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    await servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port


def test_calls_past_the_cap_are_refused_and_the_rest_go_on():
    async def main() -> None:
        server, port = await _serve(ConnectionLimits(streams_per_connection=10, max_calls=2, idle_s=60))
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            watches = [stub.Watch(health_pb2.HealthCheckRequest()) for _ in range(2)]
            for w in watches:                                 # both held open: the server's two calls
                assert (await w.read()).status == health_pb2.HealthCheckResponse.SERVING
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            for w in watches:
                w.cancel()
            await asyncio.sleep(0.2)
            assert (await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)).status == \
                health_pb2.HealthCheckResponse.SERVING
        await server.stop(0)
    asyncio.run(main())


def test_an_idle_connection_is_closed():
    async def main() -> None:
        server, port = await _serve(ConnectionLimits(idle_s=0.5))
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert ch.get_state() == grpc.ChannelConnectivity.READY
            for _ in range(50):                               # the server's GOAWAY moves the channel off READY
                await asyncio.sleep(0.1)
                if ch.get_state() != grpc.ChannelConnectivity.READY:
                    break
            assert ch.get_state() != grpc.ChannelConnectivity.READY
        await server.stop(0)
    asyncio.run(main())


def test_the_router_takes_its_limits_from_flags():
    assert RouterConfig(grpc_max_calls=7, grpc_idle_timeout_s=2).connection_limits() == ConnectionLimits(100, 7, 2)
    with pytest.raises(ValueError, match="grpc_max_calls"):
        RouterConfig(grpc_max_calls=0)
