"""vLLM's /tokenize and /detokenize on the router: the served model's tokenizer over HTTP.

    POST /tokenize    {"prompt": str} or {"messages": [...], "chat_template_kwargs": {...}} (rendered with the chat
                      template and a generation prompt) -> {"count", "max_model_len", "tokens"}
    POST /detokenize  {"tokens": [int, ...]} -> {"prompt": str}

Both take an optional "model" (the served one) and the same API keys as the OpenAI routes; errors leave in OpenAI's
error body.
"""
from __future__ import annotations

import asyncio

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from services.router.frontend import Frontend
from services.router.openai_api import TooLarge, error_response, read_body, too_large_response, unknown_model
from services.router.openai_request import ChatMessage, Body, content_text, parse
from shared.errors import InvalidRequest


class TokenizeRequest(Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    chat_template_kwargs: dict | None = None


class DetokenizeRequest(Body):
    model: str | None = None
    tokens: list[int]


def add_tokenize_routes(app: FastAPI, frontend: Frontend) -> None:
    """Mounts /tokenize and /detokenize on the router's app."""

    async def answer(request: Request, kind: type[Body], work) -> JSONResponse:
        try:
            frontend.keys.authenticate(request.headers.get("authorization"))
            req = parse(kind, await read_body(request, frontend.cfg.max_request_bytes))
            if req.model is not None and req.model != frontend.served_model:
                raise unknown_model(frontend, req.model)
            return JSONResponse(await asyncio.to_thread(work, req))     # long texts: off the event loop
        except TooLarge as e:
            return too_large_response(e)
        except Exception as e:
            return error_response(e)[1]

    def tokenize(req: TokenizeRequest) -> dict:
        if (req.prompt is None) == (req.messages is None):
            raise InvalidRequest("give either prompt or messages")
        if req.chat_template_kwargs is not None and req.messages is None:
            raise InvalidRequest("chat_template_kwargs goes with messages")
        if req.messages is not None:
            ids = frontend.tok.apply_chat_template([{"role": m.role, "content": content_text(i, m.content)}
                                                    for i, m in enumerate(req.messages)],
                                                   template_kwargs=req.chat_template_kwargs)
        else:
            ids = frontend.tok.encode(req.prompt)
        return {"count": len(ids), "max_model_len": frontend.info.max_model_len, "tokens": ids}

    def detokenize(req: DetokenizeRequest) -> dict:
        vocab = frontend.info.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise InvalidRequest(f"tokens must be in [0, {vocab}); got {bad[0]}")
        return {"prompt": frontend.tok.decode(req.tokens)}

    @app.post("/tokenize")
    async def tokenize_route(request: Request) -> JSONResponse:
        return await answer(request, TokenizeRequest, tokenize)

    @app.post("/detokenize")
    async def detokenize_route(request: Request) -> JSONResponse:
        return await answer(request, DetokenizeRequest, detokenize)
