"""`upesi experts`: one expert shard, the FFN units placed on it (all layers), behind a gRPC server."""
from __future__ import annotations

import argparse
import asyncio
import logging

import torch

from services.experts.config import ExpertsConfig
from shared.config import add_config_arguments, config_from_args
from shared.ops import switches
from shared.rpc.server import Service, run_server

log = logging.getLogger("upesi.experts")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, ExpertsConfig)


async def serve(cfg: ExpertsConfig) -> None:
    from services.experts.servicer import EXPORTED, ExpertsServicer
    from services.experts.shard import ExpertShard
    from shared import telemetry
    from shared.metrics import serve_metrics
    from shared.engine.config import parse_hf_overrides
    from shared.model.loader import load_config
    from shared.model.placement import load_placement, num_routed_experts
    from shared.model_files import resolve_model_path
    from shared.rpc.channel import server_tls_from
    from upesi.v1 import experts_pb2_grpc

    telemetry.setup_tracing("upesi-experts")
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    path, overrides = resolve_model_path(cfg.model), parse_hf_overrides(cfg.hf_overrides)
    placement = load_placement(cfg.expert_placement, cfg.num_shards,
                               num_routed_experts(load_config(path, overrides)))
    shard = ExpertShard(path, placement, cfg.shard_index, cfg.torch_dtype(), cfg.torch_device(), cfg.progress,
                        cfg.nvfp4_act_quant, overrides, cfg.int8_activations)
    if cfg.metrics_port:
        serve_metrics(cfg.metrics_port, cfg.address, EXPORTED)
    service = Service("upesi.v1.Experts", ExpertsServicer(shard), experts_pb2_grpc.add_ExpertsServicer_to_server)
    await run_server(cfg.address, [service], tls=server_tls_from(cfg))


def main(args: argparse.Namespace) -> None:
    cfg = config_from_args(ExpertsConfig, args)
    switches.disable(cfg.disable_kernels)              # before any kernel loads
    asyncio.run(serve(cfg))
