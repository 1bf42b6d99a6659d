"""A shared secret between the services of one deployment, so that internal ports serve only the deployment.

The router's public port is for clients (API keys, services/router/auth.py). The target, draft and expert-shard
ports are internal: with `UPESI_INTERNAL_TOKEN` set in their environment they refuse, with UNAUTHENTICATED, every
call that does not carry the same token in its `x-upesi-internal-token` metadata, except health checks, reflection
and the read-only status calls in OPEN_METHODS. Every channel a service makes (shared.rpc.channel) sends the token
of its own environment. `upesi serve` generates a token at start for the services it launches; deployments that
start the services one by one give them all the same value. mTLS (shared.rpc.channel) is the stronger alternative across
hosts; the token also holds where TLS is off.
"""
from __future__ import annotations

import hmac
import os
from collections.abc import Callable
from typing import Any

import grpc

ENV = "UPESI_INTERNAL_TOKEN"
METADATA_KEY = "x-upesi-internal-token"
# open like health checks: health and reflection (by prefix), and the read-only status calls (by exact name) the
# router and monitoring probe with
OPEN_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")
OPEN_METHODS = frozenset({"/upesi.v1.Target/Info", "/upesi.v1.Target/Load"})


def token() -> str | None:
    """This process's token (None: the deployment does not use one)."""
    return os.environ.get(ENV) or None


def _with_token(metadata: Any, value: str) -> list[tuple[str, str]]:
    return [*(metadata or ()), (METADATA_KEY, value)]


class _AioToken:
    def __init__(self, value: str) -> None:
        self.value = value

    def _details(self, d: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        return grpc.aio.ClientCallDetails(d.method, d.timeout, _with_token(d.metadata, self.value), d.credentials,
                                          d.wait_for_ready)


# grpc.aio files an interceptor under the first of the four kinds it is an instance of: one class per kind
class _AioUnaryUnary(_AioToken, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(self._details(details), request)


class _AioUnaryStream(_AioToken, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(self._details(details), request)


class _AioStreamUnary(_AioToken, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, details, request_iterator):
        return await continuation(self._details(details), request_iterator)


class _AioStreamStream(_AioToken, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, details, request_iterator):
        return await continuation(self._details(details), request_iterator)


class _SyncDetails(grpc.ClientCallDetails):
    def __init__(self, d: grpc.ClientCallDetails, metadata: list[tuple[str, str]]) -> None:
        self.method, self.timeout, self.metadata = d.method, d.timeout, metadata
        self.credentials, self.wait_for_ready = d.credentials, d.wait_for_ready
        self.compression = getattr(d, "compression", None)


class _SyncClient(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                  grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    def __init__(self, value: str) -> None:
        self.value = value

    def _d(self, d: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        return _SyncDetails(d, _with_token(d.metadata, self.value))

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._d(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._d(details), request)

    def intercept_stream_unary(self, continuation, details, request_iterator):
        return continuation(self._d(details), request_iterator)

    def intercept_stream_stream(self, continuation, details, request_iterator):
        return continuation(self._d(details), request_iterator)


def aio_client_interceptors() -> list:
    """For the channels this process makes: the token on every call (none without one)."""
    value = token()
    if not value:
        return []
    return [kind(value) for kind in (_AioUnaryUnary, _AioUnaryStream, _AioStreamUnary, _AioStreamStream)]


def sync_channel(channel: grpc.Channel) -> grpc.Channel:
    """A blocking channel whose calls carry the token (unchanged without one)."""
    value = token()
    return grpc.intercept_channel(channel, _SyncClient(value)) if value else channel


def _refusal(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same kind that answers UNAUTHENTICATED without running the method."""
    message = "this is an internal service of an Upesi deployment; the call lacks the deployment's token"

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def streaming(request: Any, context: grpc.aio.ServicerContext):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover - abort raises

    make: Callable
    if handler.request_streaming and handler.response_streaming:
        make, fn = grpc.stream_stream_rpc_method_handler, streaming
    elif handler.request_streaming:
        make, fn = grpc.stream_unary_rpc_method_handler, unary
    elif handler.response_streaming:
        make, fn = grpc.unary_stream_rpc_method_handler, streaming
    else:
        make, fn = grpc.unary_unary_rpc_method_handler, unary
    return make(fn, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)


class TokenCheck(grpc.aio.ServerInterceptor):
    """Refuses calls without the deployment's token (compared in constant time) on an internal server."""

    def __init__(self, value: str) -> None:
        self.expected = value.encode()

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or details.method in OPEN_METHODS or details.method.startswith(OPEN_PREFIXES):
            return handler
        given = dict(details.invocation_metadata or ()).get(METADATA_KEY, "")
        if hmac.compare_digest(given.encode() if isinstance(given, str) else given, self.expected):
            return handler
        return _refusal(handler)


def server_interceptors() -> list:
    """For an internal service's server: the check, when this process has a token."""
    value = token()
    return [TokenCheck(value)] if value else []
