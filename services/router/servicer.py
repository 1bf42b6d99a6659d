"""gRPC servicer of the public Generation API: converts protobuf and calls the Frontend."""
from __future__ import annotations

from collections import defaultdict

import grpc

from services.router.frontend import Frontend, GenerationInput, StreamChunk
from services.router.limits import Caller
from shared import metrics
from shared.errors import InvalidRequest
from shared.rpc.errors import map_errors, status_for
from upesi.v1 import generation_pb2, generation_pb2_grpc


def input_from_pb(req: generation_pb2.GenerateRequest) -> GenerationInput:
    opt = lambda name: getattr(req, name) if req.HasField(name) else None   # noqa: E731
    return GenerationInput(prompt=req.prompt, messages=[{"role": m.role, "content": m.content} for m in req.messages],
                           max_tokens=opt("max_tokens"), temperature=opt("temperature"), top_p=opt("top_p"),
                           top_k=opt("top_k"), seed=opt("seed"), n=opt("n"), stop=list(req.stop),
                           include_stop_str_in_output=req.include_stop_str_in_output,
                           skip_special_tokens=True if opt("skip_special_tokens") is None else req.skip_special_tokens,
                           ignore_eos=req.ignore_eos, cache_salt=req.cache_salt,
                           beam_width=opt("beam_width"), num_speculative_tokens=opt("num_speculative_tokens"),
                           presence_penalty=opt("presence_penalty"), frequency_penalty=opt("frequency_penalty"),
                           repetition_penalty=opt("repetition_penalty"), min_p=opt("min_p"),
                           logit_bias=dict(req.logit_bias), min_tokens=opt("min_tokens"),
                           stop_token_ids=list(req.stop_token_ids), bad_words=list(req.bad_words),
                           logprobs=opt("logprobs"),
                           guide_kind=req.guide_kind, guide=req.guide, prompt_logprobs=opt("prompt_logprobs"))


def _logprobs(lps) -> list[generation_pb2.TokenLogprobs]:
    return [generation_pb2.TokenLogprobs(logprob=lp.logprob, top_ids=lp.top_ids, top_logprobs=lp.top_logprobs,
                                         rank=lp.rank) for lp in lps or ()]


def parse_request(data: bytes) -> generation_pb2.GenerateRequest | None:
    """Bytes that are no GenerateRequest become None, which the servicer refuses with INVALID_ARGUMENT (grpc's
    own handling of a parse error answers UNKNOWN with the exception's text)."""
    try:
        return generation_pb2.GenerateRequest.FromString(data)
    except Exception:                                 # DecodeError, or anything else the parser may raise
        return None


def add_to_server(servicer: GenerationServicer, server: grpc.aio.Server) -> None:
    """The generated add_GenerationServicer_to_server, with parse_request as the request parser."""
    out = generation_pb2.GenerateResponse.SerializeToString
    handlers = {
        "Generate": grpc.unary_unary_rpc_method_handler(servicer.Generate, parse_request, out),
        "GenerateStream": grpc.unary_stream_rpc_method_handler(servicer.GenerateStream, parse_request, out),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("upesi.v1.Generation", handlers),))


def _authorization(context: grpc.aio.ServicerContext) -> str | None:
    """The request's `authorization` metadata (gRPC keys are lower-case)."""
    for key, value in context.invocation_metadata() or ():
        if key == "authorization" and isinstance(value, str):
            return value
    return None


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

    def _caller(self, request: generation_pb2.GenerateRequest | None, context: grpc.aio.ServicerContext) -> Caller:
        caller = self.frontend.keys.authenticate(_authorization(context))        # before looking at the body
        if request is None:                      # parse_request could not parse the bytes
            raise InvalidRequest("the request body is not a valid upesi.v1.GenerateRequest message")
        return caller

    @map_errors
    async def Generate(self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        with _Counted("Generate"):
            caller = self._caller(request, context)
            inp = input_from_pb(request)
            # Nothing sized by n before the frontend has validated it (n may be 2^32 - 1 here).
            texts: dict[int, str] = defaultdict(str)
            ids: dict[int, list[int]] = defaultdict(list)
            reasons: dict[int, str] = defaultdict(str)
            lps: dict[int, list] = defaultdict(list)
            prompts: dict[int, tuple] = {}
            last = None
            async for chunk in self.frontend.stream(inp, context.time_remaining(), caller):
                for c in chunk.choices:
                    texts[c.index] += c.text
                    ids[c.index].extend(c.token_ids)
                    reasons[c.index] = c.finish_reason or reasons[c.index]
                    lps[c.index] += c.logprobs or []
                    if c.prompt_logprobs is not None:
                        prompts.setdefault(c.index, c.prompt_logprobs)
                last = chunk
            choices = [generation_pb2.Choice(index=i, text=texts[i], token_ids=ids[i], finish_reason=reasons[i],
                                             logprobs=_logprobs(lps[i])) for i in range(inp.n or 1)]
            for i, (prompt, plps) in prompts.items():
                choices[i].prompt_token_ids.extend(prompt)
                choices[i].prompt_logprobs.extend(_logprobs(plps))
            return generation_pb2.GenerateResponse(request_id=request.request_id, usage=_usage(last),
                                                   spec=_spec(last), choices=choices)

    @map_errors
    async def GenerateStream(self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        with _Counted("GenerateStream"):
            caller = self._caller(request, context)
            async for chunk in self.frontend.stream(input_from_pb(request), context.time_remaining(), caller):
                msg = generation_pb2.GenerateResponse(request_id=request.request_id, choices=[
                    generation_pb2.Choice(index=c.index, text=c.text, token_ids=c.token_ids,
                                          finish_reason=c.finish_reason or "", logprobs=_logprobs(c.logprobs),
                                          prompt_token_ids=c.prompt_logprobs[0] if c.prompt_logprobs else (),
                                          prompt_logprobs=_logprobs(c.prompt_logprobs[1] if c.prompt_logprobs else ()))
                    for c in chunk.choices])
                if chunk.done:
                    msg.usage.CopyFrom(_usage(chunk))
                    msg.spec.CopyFrom(_spec(chunk))
                yield msg
