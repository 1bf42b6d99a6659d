"""`upesi draft`: proposes speculative tokens for target replicas (n-gram lookup or a small draft model)."""
from __future__ import annotations

import argparse
import asyncio
import logging

from services.draft.config import DraftConfig
from shared.config import add_config_arguments, config_from_args
from shared.ops import switches
from shared.rpc.server import Service, run_server

log = logging.getLogger("upesi.draft")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, DraftConfig)


async def serve(cfg: DraftConfig) -> None:
    import torch

    from services.draft.proposer_service import DraftState
    from services.draft.servicer import DraftServicer
    from services.draft.target_link import TargetLinks
    from shared import telemetry
    from shared.engine.config import resolve_device, resolve_dtype, serving_dtype
    from shared.metrics import serve_metrics
    from shared.rpc.channel import client_tls_from, server_tls_from, set_client_tls
    from shared.spec.factory import make_proposer
    from upesi.v1 import draft_pb2_grpc

    telemetry.setup_tracing("upesi-draft")
    set_client_tls(client_tls_from(cfg))             # the Verify streams to targets
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(serving_dtype(cfg.dtype, device), device)

    # Built, like every proposal after, on this event loop's thread: the one torch thread of the process (a second
    # one would get its own OpenMP team: shared/engine/async_engine.py). A proposal runs inline between the stream's
    # messages; handing it to a worker thread and back cost 3-5% of single-stream tokens/s (docs/performance.md).
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    proposer = make_proposer(cfg.proposer, cfg.kv_blocks, cfg.block_size, dtype, device, cfg.max_model_len,
                             target_path=cfg.model, draft_confidence=cfg.draft_confidence,
                             draft_tree_nodes=cfg.draft_tree_nodes, draft_tree_ngram=cfg.draft_tree_ngram)
    links = TargetLinks(DraftState(proposer))
    service = Service("upesi.v1.Draft", DraftServicer(links, cfg.allowed_targets()),
                      draft_pb2_grpc.add_DraftServicer_to_server)
    if cfg.metrics_port:
        serve_metrics(cfg.metrics_port, cfg.address, ("upesi_draft_",))
    log.info("draft proposer %s", cfg.proposer)
    await run_server(cfg.address, [service], tls=server_tls_from(cfg), on_stop=links.close)


def main(args: argparse.Namespace) -> None:
    cfg = config_from_args(DraftConfig, args)
    switches.disable(cfg.disable_kernels)              # before any kernel loads
    asyncio.run(serve(cfg))
