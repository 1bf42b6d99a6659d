"""The OpenAI-compatible HTTP API: /v1/models, /v1/completions and /v1/chat/completions.

JSON in (openai_request.py), `Frontend.stream`, JSON or server-sent events out (openai_reply.py); no protobuf
here. Every error leaves in OpenAI's body, {"error": {"message", "type", "param", "code"}}, with the HTTP status of
the gRPC code that `status_for` gives, so the two APIs fail alike. When the router has API keys (auth.py), every
route here needs `Authorization: Bearer <key>` (401 otherwise).
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from collections import defaultdict
from collections.abc import AsyncGenerator, Awaitable
from typing import TypeVar, cast

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from services.router.frontend import Frontend, StreamChunk
from services.router.openai_reply import _collect, _Reply, _sse, _usage, merge_prompts, with_prompt
from services.router.openai_request import (ApiError, ChatRequest, CompletionRequest, GenerationRequest,
                                            generation_inputs, parse)
from shared import metrics
from shared.errors import RateLimited, Unauthenticated
from shared.reasoning import Splitter
from shared.tool_stream import ToolCallStream
from shared.rpc.errors import status_for

log = logging.getLogger("upesi.router.http")
T = TypeVar("T")
Code = grpc.StatusCode

# gRPC code -> (HTTP status, OpenAI error type); any other code (UNAVAILABLE, CANCELLED) -> 503.
_HTTP: dict[grpc.StatusCode, tuple[int, str]] = {
    Code.INVALID_ARGUMENT: (400, "invalid_request_error"),
    Code.NOT_FOUND: (404, "invalid_request_error"),
    Code.UNAUTHENTICATED: (401, "invalid_request_error"),
    Code.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    Code.DEADLINE_EXCEEDED: (504, "timeout_error"),
    Code.INTERNAL: (500, "server_error"),
}
class _Disconnected(Exception):
    """The client hung up before the answer was ready."""


class TooLarge(Exception):
    """The request body is larger than the router accepts (HTTP 413)."""


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused as soon as it is known to exceed `limit` bytes: by its Content-Length before reading,
    else while it streams in, so a huge body is never held in memory."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise TooLarge(f"the request body has {int(declared)} bytes; this server accepts at most {limit}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise TooLarge(f"the request body is larger than {limit} bytes, the most this server accepts")
        chunks.append(chunk)
    return b"".join(chunks)


def error_body(exc: BaseException) -> tuple[grpc.StatusCode, int, dict]:
    """(gRPC code, HTTP status, OpenAI error body) for any exception; never a stack trace to the client."""
    if isinstance(exc, ApiError):
        status, message, param, code = exc.status, str(exc), exc.param, exc.code
    else:
        (status, message), param, code = status_for(exc), None, None
    if isinstance(exc, Unauthenticated) and not exc.missing:
        code = "invalid_api_key"                                  # as OpenAI answers a wrong key
    http, kind = _HTTP.get(status, (503, "service_unavailable_error"))
    if status is Code.INTERNAL:
        log.exception("unhandled error in the HTTP API", exc_info=exc)
    else:
        log.info("HTTP API -> %d: %s", http, message)
    return status, http, {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(exc: BaseException) -> tuple[grpc.StatusCode, JSONResponse]:
    """The HTTP answer to a refused request; a 401 also names the scheme to use, a rate limit when to retry."""
    code, http, body = error_body(exc)
    headers = {"WWW-Authenticate": "Bearer"} if http == 401 else None
    if isinstance(exc, RateLimited):
        headers = {"Retry-After": str(max(1, math.ceil(exc.retry_after_s)))}
    return code, JSONResponse(body, status_code=http, headers=headers)


async def _unless_disconnected(request: Request, aw: Awaitable[T]) -> T:
    """Awaits aw, cancelling it (and so the generation on the target) if the client hangs up first."""
    async def hang_up() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
    work, watch = asyncio.ensure_future(aw), asyncio.ensure_future(hang_up())
    try:
        done, _ = await asyncio.wait((work, watch), return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        work.cancel()
        raise
    finally:
        watch.cancel()
    if work not in done:
        work.cancel()
        await asyncio.wait((work,))
        raise _Disconnected
    return work.result()


async def _events(reply: _Reply, n: int, first: StreamChunk, gen: AsyncGenerator[StreamChunk, None], usage: bool,
                  method: str) -> AsyncGenerator[str, None]:
    """The SSE stream of an answer whose first chunk is in; an error after that goes out as an error event."""
    code = Code.CANCELLED                                   # until the stream ends one way or another
    try:
        if reply.chat:                                      # the first chunk of each choice names the role
            for i in range(n):
                yield _sse(reply.chunk([reply.delta(i, "", None, role=True)], None, usage))
        chunk: StreamChunk | None = first
        offsets: dict[int, int] = defaultdict(int)          # characters of each choice's text so far
        held: dict[int, str] = defaultdict(str)             # a tool-calling choice's text, parsed once it ends
        splitters: dict[int, Splitter] = {}
        calls: dict[int, ToolCallStream] = {}               # tool-calling choices whose calls stream as written
        while chunk is not None:
            for c in chunk.choices:
                if reply.tools is not None:
                    stream = calls.setdefault(c.index, ToolCallStream(reply.tools))
                    if stream.streams:
                        thought, text = "", c.text
                        if reply.reasoning:                    # the thinking apart, then the calls
                            thought, text = splitters.setdefault(c.index, Splitter(reply.thinking_open)).push(
                                text, final=bool(c.finish_reason))
                        d = reply.tool_stream_delta(c.index, stream, text, c.finish_reason)
                        if thought:
                            d["delta"] = {"reasoning_content": thought, **d["delta"]}
                        if d["delta"] or d["finish_reason"]:
                            yield _sse(reply.chunk([d], None, usage))
                        continue
                if reply.tools is not None:
                    held[c.index] += c.text
                    if c.finish_reason:
                        yield _sse(reply.chunk([reply.tool_delta(c.index, held[c.index], c.finish_reason)], None,
                                               usage))
                    continue
                text = c.text
                if reply.echo and c.index not in offsets:         # a choice's first delta: its prompt first
                    text = reply.echo[c.index] + text
                toks = None if c.logprobs is None else (*with_prompt(c, bool(reply.echo)), offsets[c.index])
                offsets[c.index] += len(text)
                if reply.chat and reply.reasoning:             # the thinking apart, a held-back tag aside
                    splitter = splitters.setdefault(c.index, Splitter(reply.thinking_open))
                    r, t = splitter.push(text, final=bool(c.finish_reason))
                    lp = reply.logprobs(*toks) if toks else None
                    yield _sse(reply.chunk([reply.reasoning_delta(c.index, r, t, c.finish_reason, lp)], None, usage))
                    continue
                yield _sse(reply.chunk([reply.delta(c.index, text, c.finish_reason, tokens=toks)], None, usage))
            if chunk.done and usage:
                yield _sse(reply.chunk([], _usage(chunk), True))
            chunk = await anext(gen, None)
        code = Code.OK
    except Exception as e:
        code, _, body = error_body(e)
        yield _sse(body)
    finally:
        metrics.REQUESTS.labels(method, code.name).inc()
        await gen.aclose()
    yield _sse("[DONE]")


def too_large_response(e: TooLarge) -> JSONResponse:
    log.info("HTTP API -> 413: %s", e)
    return JSONResponse({"error": {"message": str(e), "type": "invalid_request_error", "param": None,
                                   "code": "request_too_large"}}, status_code=413, headers={"Connection": "close"})


def unknown_model(frontend: Frontend, model: str) -> ApiError:
    return ApiError(Code.NOT_FOUND, f"the model {model!r} does not exist; this server serves "
                    f"{frontend.served_model!r}", param="model", code="model_not_found")


def add_openai_routes(app: FastAPI, frontend: Frontend) -> None:
    """Mounts /v1/models, /v1/completions and /v1/chat/completions on the router's app."""
    started = int(time.time())

    def card() -> dict:
        return {"id": frontend.served_model, "object": "model", "created": started, "owned_by": "upesi",
                "max_model_len": frontend.info.max_model_len}

    @app.get("/v1/models")
    async def list_models(request: Request) -> JSONResponse:
        try:
            frontend.keys.authenticate(request.headers.get("authorization"))
        except Unauthenticated as e:
            return error_response(e)[1]
        return JSONResponse({"object": "list", "data": [card()]})

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str, request: Request) -> JSONResponse:
        try:
            frontend.keys.authenticate(request.headers.get("authorization"))
        except Unauthenticated as e:
            return error_response(e)[1]
        if model_id == frontend.served_model:
            return JSONResponse(card())
        return error_response(unknown_model(frontend, model_id))[1]

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _serve(frontend, request, CompletionRequest, "Completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _serve(frontend, request, ChatRequest, "ChatCompletions")


async def _serve(frontend: Frontend, request: Request, kind: type[GenerationRequest], method: str) -> Response:
    """One completions or chat completions request: checked, run, answered whole or as server-sent events."""
    try:
        caller = frontend.keys.authenticate(request.headers.get("authorization"))    # no body read before
        req = parse(kind, await read_body(request, frontend.cfg.max_request_bytes))
        if req.model is not None and req.model != frontend.served_model:
            raise unknown_model(frontend, req.model)
        inputs = generation_inputs(req, frontend.info.vocab_size)
        if inputs[0].tool_choice is not None:
            inputs[0].tool_choice.parser = frontend.cfg.tool_call_parser
        reply = _reply_for(frontend, req, inputs, kind is ChatRequest)
        n = (inputs[0].n or 1) * len(inputs)         # prompt p's choice j is choice p * n + j
        # Async generators (closed to cancel); no deadline: HTTP clients time out on their own.
        gens = [cast(AsyncGenerator[StreamChunk, None], frontend.stream(i, None, caller)) for i in inputs]
        gen = gens[0] if len(gens) == 1 else merge_prompts(gens, inputs[0].n or 1)
        if not req.stream:
            answer = reply.whole(*await _unless_disconnected(request, _collect(gen, n, bool(reply.echo))))
            metrics.REQUESTS.labels(method, "OK").inc()
            return JSONResponse(answer)
        first = await _unless_disconnected(request, anext(gen))    # errors up to here get an HTTP status
    except _Disconnected:
        metrics.REQUESTS.labels(method, "CANCELLED").inc()
        return Response(status_code=499)                # nobody reads it; nginx's "client closed request"
    except TooLarge as e:
        metrics.REQUESTS.labels(method, Code.RESOURCE_EXHAUSTED.name).inc()
        return too_large_response(e)
    except Exception as e:
        code, response = error_response(e)
        metrics.REQUESTS.labels(method, code.name).inc()
        return response
    usage = bool(req.stream_options and req.stream_options.include_usage)
    events = _events(reply, n, first, gen, usage, method)
    # Starlette stops iterating when the client hangs up; closing the generator then cancels the generation.
    return StreamingResponse(events, media_type="text/event-stream", background=BackgroundTask(events.aclose),
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _reply_for(frontend: Frontend, req: GenerationRequest, inputs: list, chat: bool) -> _Reply:
    """How the request's answer is written: its id, model, tool and reasoning parsing, echoed prompts."""
    reply = _Reply(chat, frontend.served_model, f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
                   int(time.time()), frontend.tok, inputs[0].tool_choice,
                   reasoning=frontend.cfg.reasoning_parser == "think", chat_input=inputs[0] if chat else None,
                   prompt_logprobs=req.prompt_logprobs is not None)
    if not chat and req.echo:
        reply.echo = [i.prompt or frontend.tok.decode(i.prompt_ids) for i in inputs for _ in range(i.n or 1)]
    return reply
