"""Every error a servicer can meet, mapped to a gRPC status in one place. Never a stack trace to a client."""
from __future__ import annotations

import asyncio
import functools
import inspect
import logging
from collections.abc import Callable

import grpc

from shared.errors import (
    Draining,
    EngineDead,
    Forbidden,
    InvalidRequest,
    NotConfigured,
    NotRunning,
    Overloaded,
    PeerUnavailable,
    Unauthenticated,
)

log = logging.getLogger("upesi.rpc")


class Relayed(RuntimeError):
    """A peer's error passed on as it was (a draft relaying its target's answer); keeps the peer's status code."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


_CODES: list[tuple[type[BaseException], grpc.StatusCode]] = [
    (InvalidRequest, grpc.StatusCode.INVALID_ARGUMENT),
    (Overloaded, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (Unauthenticated, grpc.StatusCode.UNAUTHENTICATED),
    (PeerUnavailable, grpc.StatusCode.UNAVAILABLE),
    (NotRunning, grpc.StatusCode.NOT_FOUND),
    (Forbidden, grpc.StatusCode.PERMISSION_DENIED),
    (NotConfigured, grpc.StatusCode.FAILED_PRECONDITION),
    (Draining, grpc.StatusCode.UNAVAILABLE),
    (EngineDead, grpc.StatusCode.UNAVAILABLE),
]


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status and client-facing message for an exception raised while serving."""
    if isinstance(exc, grpc.aio.AioRpcError):           # a downstream service answered with an error
        code = exc.code()
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                    grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
                    grpc.StatusCode.CANCELLED):
            return code, exc.details() or code.name
        return grpc.StatusCode.UNAVAILABLE, f"a downstream service failed: {exc.details()}"
    if isinstance(exc, Relayed):
        return exc.code, str(exc)
    for kind, code in _CODES:
        if isinstance(exc, kind):
            return code, str(exc)
    return grpc.StatusCode.INTERNAL, "internal error; the server log has the details"


def log_error(exc: BaseException, name: str) -> None:
    """Logs an error on its way to a caller: with its traceback where the caller is told only "internal error"."""
    code, _ = status_for(exc)
    if code is grpc.StatusCode.INTERNAL:
        log.exception("unhandled error in %s", name, exc_info=exc)
    else:
        log.info("%s -> %s: %s", name, code.name, exc)


def map_errors(fn: Callable) -> Callable:
    """Decorates an async servicer method (unary or server-streaming) so exceptions become statuses."""
    name = fn.__qualname__
    if inspect.isasyncgenfunction(fn):
        @functools.wraps(fn)
        async def stream(self, request, context):
            try:
                async for item in fn(self, request, context):
                    yield item
            except (asyncio.CancelledError, GeneratorExit):
                raise
            except Exception as e:
                log_error(e, name)
                await context.abort(*status_for(e))
        return stream

    @functools.wraps(fn)
    async def unary(self, request, context):
        try:
            return await fn(self, request, context)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            log_error(e, name)
            await context.abort(*status_for(e))
    return unary
