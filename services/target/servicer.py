"""gRPC servicer of the target: converts protobuf and calls the engine, nothing more."""
from __future__ import annotations

import grpc

from shared.engine.async_engine import AsyncEngine
from shared.engine.sampling_params import InvalidRequest, SamplingParams
from shared.rpc.errors import map_errors
from upesi.v1 import target_pb2, target_pb2_grpc


def params_from_pb(req: target_pb2.TargetGenerateRequest) -> SamplingParams:
    s = req.sampling
    return SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                          seed=s.seed if s.HasField("seed") else None, max_tokens=s.max_tokens,
                          ignore_eos=s.ignore_eos, stop_token_ids=list(s.stop_token_ids), n=req.n or 1,
                          cache_salt=s.cache_salt, beam_width=s.beam_width,
                          num_speculative_tokens=s.num_speculative_tokens if s.HasField("num_speculative_tokens")
                          else None)


class TargetServicer(target_pb2_grpc.TargetServicer):
    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

    @map_errors
    async def Generate(self, request: target_pb2.TargetGenerateRequest, context: grpc.aio.ServicerContext):
        if not request.request_id:
            raise InvalidRequest("request_id is required")
        params = params_from_pb(request)
        first = True
        async for d in self.engine.generate(request.request_id, list(request.prompt_token_ids), params):
            msg = target_pb2.TargetGenerateResponse(deltas=[target_pb2.TokenDelta(
                index=d.index, token_ids=d.token_ids, finish_reason=d.finish_reason or "",
                draft_tokens=d.num_draft_tokens, accepted_tokens=d.num_accepted_tokens)])
            if first:
                msg.prompt_tokens, msg.cached_tokens, first = d.num_prompt_tokens, d.num_cached_tokens, False
            yield msg

    @map_errors
    async def Abort(self, request: target_pb2.AbortRequest, context) -> target_pb2.AbortResponse:
        self.engine.abort(request.request_id, list(request.indices) or None)
        return target_pb2.AbortResponse()

    @map_errors
    async def Info(self, request, context) -> target_pb2.InfoResponse:
        e = self.engine.engine
        return target_pb2.InfoResponse(model=e.model_cfg.name, max_model_len=e.max_model_len,
                                       vocab_size=e.model_cfg.vocab_size, eos_token_ids=sorted(e.eos_token_ids),
                                       block_size=e.cfg.block_size, num_kv_blocks=e.block_manager.num_blocks,
                                       max_num_seqs=e.cfg.max_num_seqs)

    @map_errors
    async def Load(self, request, context) -> target_pb2.LoadResponse:
        e = self.engine.engine
        return target_pb2.LoadResponse(running=len(e.scheduler.running), waiting=len(e.scheduler.waiting),
                                       kv_blocks_used=e.block_manager.num_used_blocks,
                                       kv_blocks_total=e.block_manager.num_blocks)
