"""The OpenAI-compatible HTTP API: /v1/models, /v1/completions and /v1/chat/completions.

JSON in, `Frontend.stream`, JSON or server-sent events out; no protobuf here. Every error leaves in OpenAI's body,
{"error": {"message", "type", "param", "code"}}, with the HTTP status of the gRPC code that `status_for` gives, so
the two APIs fail alike. Extensions beyond OpenAI's fields: `top_k` (-1 or 0 = no limit), `ignore_eos`, `cache_salt`.
When the router has API keys (auth.py), every route here needs `Authorization: Bearer <key>` (401 otherwise).
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections import defaultdict
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.background import BackgroundTask

from services.router.frontend import Frontend, GenerationInput, StreamChunk
from shared import metrics
from shared.errors import InvalidRequest, PeerUnavailable, Unauthenticated
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
# Fields accepted only at values that ask for nothing: anything else would be silently ignored, so it is refused.
_NO_OP: dict[str, tuple[Any, ...]] = {
    "logprobs": (None, False, 0), "top_logprobs": (None, 0), "echo": (None, False), "suffix": (None, ""),
    "best_of": (None, 1), "frequency_penalty": (None, 0), "presence_penalty": (None, 0), "logit_bias": (None, {}),
    "tools": (None, []), "functions": (None, []), "response_format": (None, {"type": "text"}),
}


class ApiError(Exception):
    """A refusal the Frontend cannot make itself (an unknown model, an unsupported field)."""

    def __init__(self, status: grpc.StatusCode, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code


class _Disconnected(Exception):
    """The client hung up before the answer was ready."""


class _TooLarge(Exception):
    """The request body is larger than the router accepts (HTTP 413)."""


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, refused as soon as it is known to exceed `limit` bytes: by its Content-Length before reading,
    else while it streams in, so a huge body is never held in memory."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _TooLarge(f"the request body has {int(declared)} bytes; this server accepts at most {limit}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _TooLarge(f"the request body is larger than {limit} bytes, the most this server accepts")
        chunks.append(chunk)
    return b"".join(chunks)


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)


class StreamOptions(_Body):
    include_usage: bool | None = None


class _Request(_Body):
    model: str | None = None              # None: the served model
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    n: int | None = None
    stop: Any = None                      # a string or a list of strings
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    ignore_eos: bool = False
    cache_salt: str = ""
    user: str | None = None               # accepted, unused


class CompletionRequest(_Request):
    prompt: Any = None                    # a string, or a list of one string


class ChatMessage(_Body):
    role: str
    content: Any = None                   # a string, or a list of {"type": "text", "text": ...} parts


class ChatRequest(_Request):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None


def _where(loc: tuple[int | str, ...]) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".")


def parse(model: type[_Request], body: bytes) -> _Request:
    """Validates a JSON body; a bad one raises ApiError(INVALID_ARGUMENT) naming the field."""
    try:
        req = model.model_validate_json(body)
    except ValidationError as e:
        err = e.errors()[0]
        where = _where(err["loc"])
        raise ApiError(Code.INVALID_ARGUMENT, f"{where}: {err['msg']}" if where else
                       f"the body must be a JSON object: {err['msg']}", param=where or None) from None
    for name, value in (req.model_extra or {}).items():
        if name in _NO_OP and value not in _NO_OP[name]:
            why = "the engine does not return logprobs yet" if "logprobs" in name else "this server lacks it"
            raise ApiError(Code.INVALID_ARGUMENT, f"{name} is not supported: {why}; leave it unset",
                           param=name, code="unsupported_parameter")
    return req


def _stop(stop: Any) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return stop
    raise InvalidRequest("stop must be a string or a list of strings")


def _prompt(prompt: Any) -> str:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return prompt
    if prompt is None or prompt == "" or prompt == []:
        raise InvalidRequest("prompt is missing or empty")
    if isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
        raise InvalidRequest(f"send one prompt per request; got a list of {len(prompt)}")
    if isinstance(prompt, list):
        raise InvalidRequest("token-id prompts are not supported; send the prompt as a string")
    raise InvalidRequest("prompt must be a string")


def _content(i: int, content: Any) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequest(f"messages[{i}].content must be a string or a list of text parts")
    for j, part in enumerate(content):
        if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
            raise InvalidRequest(f'messages[{i}].content[{j}] is not a {{"type": "text", "text": ...}} part; '
                                 "only text is supported")
    return "\n".join(part["text"] for part in content)


def generation_input(req: _Request, vocab_size: int) -> GenerationInput:
    """The Frontend's input for a parsed request; raises InvalidRequest on what pydantic cannot check."""
    top_k, temperature = req.top_k, req.temperature
    if top_k is not None and (top_k == -1 or top_k >= vocab_size):
        top_k = 0                                                 # no limit, as -1 means in vLLM
    inp = GenerationInput(temperature=temperature, top_p=req.top_p, top_k=top_k, seed=req.seed, n=req.n,
                          stop=_stop(req.stop), ignore_eos=req.ignore_eos, cache_salt=req.cache_salt)
    if isinstance(req, ChatRequest):
        inp.messages = [{"role": m.role, "content": _content(i, m.content)} for i, m in enumerate(req.messages)]
        inp.max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    elif isinstance(req, CompletionRequest):
        inp.prompt = _prompt(req.prompt)
        inp.max_tokens = 16 if req.max_tokens is None else req.max_tokens     # OpenAI's default for completions
    return inp


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
    """The HTTP answer to a refused request; a 401 also names the scheme to use."""
    code, http, body = error_body(exc)
    headers = {"WWW-Authenticate": "Bearer"} if http == 401 else None
    return code, JSONResponse(body, status_code=http, headers=headers)


def _usage(c: StreamChunk) -> dict:
    return {"prompt_tokens": c.prompt_tokens, "completion_tokens": c.completion_tokens,
            "total_tokens": c.prompt_tokens + c.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": c.cached_tokens}}


def _sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)}\n\n"


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


@dataclass(slots=True)
class _Reply:
    """One request's answer in OpenAI's shapes, whole or as stream chunks."""
    chat: bool
    model: str
    id: str
    created: int

    def whole(self, texts: list[str], reasons: list[str | None], last: StreamChunk) -> dict:
        choices = [{"index": i, **({"message": {"role": "assistant", "content": t}} if self.chat else {"text": t}),
                    "logprobs": None, "finish_reason": r} for i, (t, r) in enumerate(zip(texts, reasons))]
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": choices, "usage": _usage(last)}

    def chunk(self, choices: list[dict], usage: dict | None = None, with_usage: bool = False) -> dict:
        out: dict[str, Any] = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                               "created": self.created, "model": self.model, "choices": choices}
        if with_usage:
            out["usage"] = usage
        return out

    def delta(self, index: int, text: str, reason: str | None, role: bool = False) -> dict:
        if not self.chat:
            return {"index": index, "text": text, "logprobs": None, "finish_reason": reason}
        delta: dict[str, str] = {"role": "assistant", "content": text} if role else ({"content": text} if text else {})
        return {"index": index, "delta": delta, "logprobs": None, "finish_reason": reason}


async def _collect(gen: AsyncIterator[StreamChunk], n: int) -> tuple[list[str], list[str | None], StreamChunk]:
    # Nothing sized by n before the frontend has validated it (a client may send n = 10**12).
    texts: dict[int, str] = defaultdict(str)
    reasons: dict[int, str | None] = {}
    last = None
    async for chunk in gen:
        for c in chunk.choices:
            texts[c.index] += c.text
            reasons[c.index] = c.finish_reason or reasons.get(c.index)
        last = chunk
    if last is None:
        raise PeerUnavailable("the generation ended without an answer")
    return [texts[i] for i in range(n)], [reasons.get(i) for i in range(n)], last


async def _events(reply: _Reply, n: int, first: StreamChunk, gen: AsyncGenerator[StreamChunk, None], usage: bool,
                  method: str) -> AsyncGenerator[str, None]:
    """The SSE stream of an answer whose first chunk is in; an error after that goes out as an error event."""
    code = Code.CANCELLED                                   # until the stream ends one way or another
    try:
        if reply.chat:                                      # the first chunk of each choice names the role
            for i in range(n):
                yield _sse(reply.chunk([reply.delta(i, "", None, role=True)], None, usage))
        chunk: StreamChunk | None = first
        while chunk is not None:
            for c in chunk.choices:
                yield _sse(reply.chunk([reply.delta(c.index, c.text, c.finish_reason)], None, usage))
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


def add_openai_routes(app: FastAPI, frontend: Frontend) -> None:
    """Mounts /v1/models, /v1/completions and /v1/chat/completions on the router's app."""
    started = int(time.time())

    def card() -> dict:
        return {"id": frontend.served_model, "object": "model", "created": started, "owned_by": "upesi"}

    @app.get("/v1/models")
    async def list_models(request: Request) -> JSONResponse:
        try:
            frontend.keys.authenticate(request.headers.get("authorization"))
        except Unauthenticated as e:
            return error_response(e)[1]
        return JSONResponse({"object": "list", "data": [card()]})

    def unknown(model: str) -> ApiError:
        return ApiError(Code.NOT_FOUND, f"the model {model!r} does not exist; this server serves "
                        f"{frontend.served_model!r}", param="model", code="model_not_found")

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str, request: Request) -> JSONResponse:
        try:
            frontend.keys.authenticate(request.headers.get("authorization"))
        except Unauthenticated as e:
            return error_response(e)[1]
        if model_id == frontend.served_model:
            return JSONResponse(card())
        return error_response(unknown(model_id))[1]

    async def serve(request: Request, kind: type[_Request], method: str) -> Response:
        try:
            caller = frontend.keys.authenticate(request.headers.get("authorization"))    # no body read before
            req = parse(kind, await _read_body(request, frontend.cfg.max_request_bytes))
            if req.model is not None and req.model != frontend.served_model:
                raise unknown(req.model)
            inp = generation_input(req, frontend.info.vocab_size)
            chat = kind is ChatRequest
            reply = _Reply(chat, frontend.served_model, f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
                           int(time.time()))
            n = inp.n or 1
            # An async generator (closed to cancel); no deadline: HTTP clients time out on their own.
            gen = cast(AsyncGenerator[StreamChunk, None], frontend.stream(inp, None, caller))
            if not req.stream:
                answer = reply.whole(*await _unless_disconnected(request, _collect(gen, n)))
                metrics.REQUESTS.labels(method, "OK").inc()
                return JSONResponse(answer)
            first = await _unless_disconnected(request, anext(gen))    # errors up to here get an HTTP status
        except _Disconnected:
            metrics.REQUESTS.labels(method, "CANCELLED").inc()
            return Response(status_code=499)                # nobody reads it; nginx's "client closed request"
        except _TooLarge as e:
            metrics.REQUESTS.labels(method, Code.RESOURCE_EXHAUSTED.name).inc()
            log.info("HTTP API -> 413: %s", e)
            return JSONResponse({"error": {"message": str(e), "type": "invalid_request_error", "param": None,
                                           "code": "request_too_large"}}, status_code=413,
                                headers={"Connection": "close"})
        except Exception as e:
            code, response = error_response(e)
            metrics.REQUESTS.labels(method, code.name).inc()
            return response
        usage = bool(req.stream_options and req.stream_options.include_usage)
        events = _events(reply, n, first, gen, usage, method)
        # Starlette stops iterating when the client hangs up; closing the generator then cancels the generation.
        return StreamingResponse(events, media_type="text/event-stream", background=BackgroundTask(events.aclose),
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await serve(request, CompletionRequest, "Completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await serve(request, ChatRequest, "ChatCompletions")
