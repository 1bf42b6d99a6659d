"""`upesi experts`: one expert shard, the FFN units placed on it (all layers), behind a gRPC server."""
from __future__ import annotations

import argparse
import asyncio
import logging

import torch

from services.experts.config import ExpertsConfig
from shared.config import add_config_arguments, config_from_args
from shared.rpc.server import Service, run_server

log = logging.getLogger("upesi.experts")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, ExpertsConfig)


async def serve(cfg: ExpertsConfig) -> None:
    from prometheus_client import start_http_server

    from services.experts.servicer import ExpertsServicer
    from services.experts.shard import ExpertShard
    from shared.model.loader import load_config, resolve_model_path
    from shared.model.placement import load_placement, num_routed_experts
    from upesi.v1 import experts_pb2_grpc

    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    path = resolve_model_path(cfg.model)
    placement = load_placement(cfg.expert_placement, cfg.num_shards, num_routed_experts(load_config(path)))
    shard = ExpertShard(path, placement, cfg.shard_index, cfg.torch_dtype(), cfg.torch_device(), cfg.progress)
    if cfg.metrics_port:
        start_http_server(cfg.metrics_port, addr="127.0.0.1" if cfg.address.startswith("127.") else "0.0.0.0")
    service = Service("upesi.v1.Experts", ExpertsServicer(shard), experts_pb2_grpc.add_ExpertsServicer_to_server)
    await run_server(cfg.address, [service])


def main(args: argparse.Namespace) -> None:
    asyncio.run(serve(config_from_args(ExpertsConfig, args)))
