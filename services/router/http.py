"""The router's HTTP side: /health and /metrics (the OpenAI-compatible API builds on the same app)."""
from __future__ import annotations

import asyncio
import contextlib
import resource

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol
from fastapi import FastAPI, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from services.router.frontend import Frontend
from services.router.openai_api import add_openai_routes
from services.router.tokenize_api import add_tokenize_routes


def build_app(frontend: Frontend) -> FastAPI:
    app = FastAPI(title="Upesi router", docs_url=None, redoc_url=None)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "model": frontend.served_model, "in_flight": frontend.in_flight}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    add_openai_routes(app, frontend)
    add_tokenize_routes(app, frontend)
    return app


class _Server(uvicorn.Server):
    """uvicorn without its own signal handlers: the gRPC bootstrap owns SIGTERM/SIGINT."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


class _Protocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol with a header deadline: a connection that has not sent a whole request header
    `header_timeout_s` after it opened is closed (a slow or silent client holds no socket for long), and beyond
    `max_open` open connections a new one is closed at once (file descriptors stay for the busy ones)."""
    header_timeout_s = 10.0
    max_open = 4096

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.max_open:
            transport.close()
            return
        self.loop.call_later(self.header_timeout_s, self._close_if_silent)

    def _close_if_silent(self) -> None:
        if self.cycle is None and not self.transport.is_closing():
            self.transport.close()


class _Busy:
    """ASGI middleware: at most `limit` HTTP requests handled at once, 503 beyond (idle connections do not count,
    as they do in uvicorn's own limit)."""

    def __init__(self, app, limit: int) -> None:
        self.app, self.limit, self.active = app, limit, 0

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or self.active < self.limit:
            self.active += scope["type"] == "http"
            try:
                await self.app(scope, receive, send)
            finally:
                self.active -= scope["type"] == "http"
            return
        body = b'{"error": {"message": "the server is busy; retry", "type": "service_unavailable_error", ' \
               b'"param": null, "code": null}}'
        await send({"type": "http.response.start", "status": 503,
                    "headers": [(b"content-type", b"application/json"), (b"retry-after", b"1")]})
        await send({"type": "http.response.body", "body": body})


async def start_http(app: FastAPI, host: str, port: int, max_connections: int | None = None,
                     header_timeout_s: float = 10.0) -> tuple[_Server, asyncio.Task]:
    """Serves `app`; beyond `max_connections` requests handled at once it answers 503 at once. Idle connections
    close after a header deadline or uvicorn's keep-alive timeout, and count toward no limit but the file
    descriptors this process may open."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    protocol = type("Protocol", (_Protocol,), {"header_timeout_s": header_timeout_s,
                                               "max_open": max(64, min(16384, soft - 256))})
    server = _Server(uvicorn.Config(_Busy(app, max_connections) if max_connections else app, host=host, port=port,
                                    log_level="warning", lifespan="off", http=protocol, timeout_keep_alive=5))
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            task.result()                 # raises why it could not start (port taken, ...)
        await asyncio.sleep(0.02)
    return server, task
