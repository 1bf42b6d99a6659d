"""gRPC servicer of the public Generation API: converts protobuf and calls the Frontend."""
from __future__ import annotations

import grpc

from services.router.frontend import Frontend, GenerationInput, StreamChunk
from shared import metrics
from shared.rpc.errors import map_errors, status_for
from upesi.v1 import generation_pb2, generation_pb2_grpc


def input_from_pb(req: generation_pb2.GenerateRequest) -> GenerationInput:
    opt = lambda name: getattr(req, name) if req.HasField(name) else None   # noqa: E731
    return GenerationInput(prompt=req.prompt, messages=[{"role": m.role, "content": m.content} for m in req.messages],
                           max_tokens=opt("max_tokens"), temperature=opt("temperature"), top_p=opt("top_p"),
                           top_k=opt("top_k"), seed=opt("seed"), n=opt("n"), stop=list(req.stop),
                           ignore_eos=req.ignore_eos, cache_salt=req.cache_salt,
                           beam_width=opt("beam_width"), num_speculative_tokens=opt("num_speculative_tokens"))


def _spec(chunk: StreamChunk) -> generation_pb2.SpecStats:
    return generation_pb2.SpecStats(draft_tokens=chunk.draft_tokens, accepted_tokens=chunk.accepted_tokens)


def _usage(chunk: StreamChunk) -> generation_pb2.Usage:
    return generation_pb2.Usage(prompt_tokens=chunk.prompt_tokens, completion_tokens=chunk.completion_tokens,
                                cached_tokens=chunk.cached_tokens)


class _Counted:
    """Counts a request's outcome in upesi_requests_total."""

    def __init__(self, method: str) -> None:
        self.method = method

    def __enter__(self) -> "_Counted":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        code = "OK" if exc is None else (status_for(exc)[0].name if isinstance(exc, Exception) else "CANCELLED")
        metrics.REQUESTS.labels(self.method, code).inc()


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(self, frontend: Frontend) -> None:
        self.frontend = frontend

    @map_errors
    async def Generate(self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        with _Counted("Generate"):
            inp = input_from_pb(request)
            n = inp.n or 1
            texts, ids, reasons = [""] * n, [[] for _ in range(n)], [""] * n
            last = None
            async for chunk in self.frontend.stream(inp, context.time_remaining()):
                for c in chunk.choices:
                    texts[c.index] += c.text
                    ids[c.index].extend(c.token_ids)
                    reasons[c.index] = c.finish_reason or reasons[c.index]
                last = chunk
            return generation_pb2.GenerateResponse(
                request_id=request.request_id, usage=_usage(last), spec=_spec(last),
                choices=[generation_pb2.Choice(index=i, text=texts[i], token_ids=ids[i], finish_reason=reasons[i])
                         for i in range(n)])

    @map_errors
    async def GenerateStream(self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        with _Counted("GenerateStream"):
            async for chunk in self.frontend.stream(input_from_pb(request), context.time_remaining()):
                msg = generation_pb2.GenerateResponse(request_id=request.request_id, choices=[
                    generation_pb2.Choice(index=c.index, text=c.text, token_ids=c.token_ids,
                                          finish_reason=c.finish_reason or "") for c in chunk.choices])
                if chunk.done:
                    msg.usage.CopyFrom(_usage(chunk))
                    msg.spec.CopyFrom(_spec(chunk))
                yield msg
