"""The router's HTTP side: /health and /metrics (the OpenAI-compatible API builds on the same app)."""
from __future__ import annotations

import asyncio
import contextlib

import uvicorn
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


async def start_http(app: FastAPI, host: str, port: int, max_connections: int | None = None
                     ) -> tuple[_Server, asyncio.Task]:
    """Serves `app`; beyond `max_connections` open connections and tasks, uvicorn answers 503 at once."""
    server = _Server(uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off",
                                    limit_concurrency=max_connections))
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            task.result()                 # raises why it could not start (port taken, ...)
        await asyncio.sleep(0.02)
    return server, task
