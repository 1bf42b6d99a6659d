"""gRPC servicer of an expert shard: converts protobuf and calls the shard, nothing more."""
from __future__ import annotations

import asyncio
import time

import grpc
import torch
from prometheus_client import Counter, Histogram

from services.experts.shard import ExpertShard
from shared import tensor_codec
from shared.errors import InvalidRequest
from shared.rpc.errors import map_errors
from upesi.v1 import experts_pb2, experts_pb2_grpc

COMPUTE_SECONDS = Histogram("upesi_expert_compute_seconds", "Time a shard spends computing one Dispatch",
                            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1, 5))
SLOTS = Counter("upesi_expert_shard_slots_total", "(token, unit) slots computed by this shard")
DISPATCH_TOKENS = Histogram("upesi_expert_dispatch_tokens", "Token rows per Dispatch call (the batch a shard sees)",
                            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096))
EXPORTED = tuple(m.describe()[0].name for m in (COMPUTE_SECONDS, SLOTS, DISPATCH_TOKENS))   # a shard's /metrics


def tensor_from_pb(t: experts_pb2.Tensor, field: str) -> torch.Tensor:
    try:
        return tensor_codec.decode(t.dtype, list(t.shape), t.data)
    except tensor_codec.TensorFormatError as e:
        raise InvalidRequest(f"{field}: {e}") from None


def tensor_to_pb(t: torch.Tensor) -> experts_pb2.Tensor:
    dtype, shape, data = tensor_codec.encode(t)
    return experts_pb2.Tensor(dtype=dtype, shape=shape, data=data)


class ExpertsServicer(experts_pb2_grpc.ExpertsServicer):
    def __init__(self, shard: ExpertShard) -> None:
        self.shard = shard

    @map_errors
    async def Dispatch(self, request: experts_pb2.DispatchRequest, context: grpc.aio.ServicerContext
                       ) -> experts_pb2.DispatchResponse:
        t0 = time.perf_counter()
        hidden = tensor_from_pb(request.hidden, "hidden")
        ids = tensor_from_pb(request.expert_ids, "expert_ids")
        weights = tensor_from_pb(request.weights, "weights") if request.HasField("weights") else None
        rows = tensor_from_pb(request.token_index, "token_index") if request.HasField("token_index") else None
        out = self.shard.forward(request.layer, hidden, ids, weights, rows)
        dt = time.perf_counter() - t0
        COMPUTE_SECONDS.observe(dt)
        SLOTS.inc(ids.numel())
        DISPATCH_TOKENS.observe(hidden.shape[0])
        return experts_pb2.DispatchResponse(output=tensor_to_pb(out), compute_s=dt)

    @map_errors
    async def LoadExperts(self, request: experts_pb2.LoadExpertsRequest, context) -> experts_pb2.LoadExpertsResponse:
        t0 = time.perf_counter()
        loaded = await asyncio.to_thread(self.shard.load, [(e.layer, e.expert) for e in request.experts])
        return experts_pb2.LoadExpertsResponse(loaded=loaded, held=self.shard.num_units,
                                               load_s=time.perf_counter() - t0)

    @map_errors
    async def Info(self, request, context) -> experts_pb2.ShardInfoResponse:
        s, cfg = self.shard, self.shard.cfg
        return experts_pb2.ShardInfoResponse(
            model=cfg.name, shard_index=s.index, num_shards=s.placement.num_shards, num_layers=cfg.num_layers,
            hidden_size=cfg.hidden_size, num_experts=s.placement.num_experts, held=s.num_units,
            weight_bytes=s.weight_bytes, dispatches=s.dispatches, slots=s.slots,
            dtype=str(s.dtype).removeprefix("torch."))
