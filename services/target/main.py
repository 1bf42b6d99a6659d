"""`upesi target`: the model, its paged KV cache and the scheduler behind a gRPC server."""
from __future__ import annotations

import argparse
import asyncio
import logging

from services.target.config import TargetConfig
from shared import metrics, telemetry
from shared.config import add_config_arguments, config_from_args
from shared.ops import switches
from shared.engine.async_engine import AsyncEngine
from shared.engine.engine import LLMEngine
from shared.registry.factory import redacted
from shared.rpc.server import Service, run_server
from shared.spec.factory import build_engine

log = logging.getLogger("upesi.target")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, TargetConfig)


class StepObserver:
    """Runs on the engine thread after every step: metrics, and block events to the registry (batched there)."""

    def __init__(self, publisher=None) -> None:
        self.publisher = publisher
        self.seen = {"preempt": 0, "query": 0, "hit": 0, "draft": 0, "accepted": 0}

    def _inc(self, counter, key: str, value: int) -> None:
        if value > self.seen[key]:
            counter.inc(value - self.seen[key])
            self.seen[key] = value

    def __call__(self, engine: LLMEngine) -> None:
        c = engine.counters()
        metrics.KV_BLOCKS_USED.set(c.kv_blocks_used)
        metrics.RUNNING.set(c.running)
        metrics.WAITING.set(c.waiting)
        metrics.STEP_SECONDS.observe(c.last_step_s)
        self._inc(metrics.PREEMPTIONS, "preempt", c.preemptions)
        self._inc(metrics.PREFIX_QUERIES, "query", c.prefix_query_tokens)
        self._inc(metrics.PREFIX_HITS, "hit", c.prefix_hit_tokens)
        self._inc(metrics.SPEC_DRAFT, "draft", c.draft_tokens)
        self._inc(metrics.SPEC_ACCEPTED, "accepted", c.accepted_tokens)
        stored, removed = engine.drain_block_events()
        if self.publisher is not None:
            if stored:
                self.publisher.stored(stored)
            if removed:
                self.publisher.removed(removed)
            self.publisher.set_load(c.waiting, c.running)


class TracedAsyncEngine(AsyncEngine):
    """Hands each request's trace context (the gRPC handler's) to the engine thread, which keeps it on the request's
    sequences for the spans it records (prefill, verify, propose, expert dispatch). Only used when tracing is on."""

    def generate(self, request_id: str, prompt: list[int], params, relayed: bool = False):
        ctx = telemetry.current_context()
        if ctx is not None:
            self.engine.trace_parents[request_id] = ctx
        return super().generate(request_id, prompt, params, relayed=relayed)


def _publisher(cfg: TargetConfig):
    if not cfg.registry:
        return None
    from shared.registry.factory import open_registry
    from shared.registry.publisher import BlockPublisher
    publisher = BlockPublisher(open_registry(cfg.registry), cfg.replica_id or cfg.address)
    publisher.start()
    return publisher


def _attach_expert_shards(cfg: TargetConfig, engine: LLMEngine):
    """Moves every layer's FFN to the expert shards (waiting for them to come up) and frees the local weights."""
    if not cfg.expert_addresses():
        return None
    from shared.model.placement import load_placement, num_routed_experts
    from shared.shards.client import ExpertsClient
    from shared.shards.remote_ffn import attach_expert_shards, ffn_kinds

    addresses, model = cfg.expert_addresses(), engine.runner.model
    placement = load_placement(cfg.expert_placement, len(addresses), num_routed_experts(engine.model_cfg))
    client = ExpertsClient(addresses, placement, ffn_kinds(model), cfg.expert_timeout_s)
    log.info("waiting for %d expert shards: %s", len(addresses), ", ".join(addresses))
    client.wait_ready(engine.model_cfg, timeout_s=600)
    freed = attach_expert_shards(model, client)
    log.info("FFNs of %d layers run on %d expert shards; freed %.1f MiB of local FFN weights",
             len(client.dense_layers), len(addresses), freed / 2**20)
    return client


def _start_rebalancer(cfg: TargetConfig, client):
    """Replicates hot experts while serving (--rebalance-interval-s), on its own thread; None when off."""
    if client is None or not cfg.rebalance_interval_s:
        return None
    from shared.shards.rebalance import Rebalancer
    return Rebalancer(client, cfg.rebalance_interval_s, cfg.rebalance_threshold, cfg.rebalance_extra).start()


async def serve(cfg: TargetConfig) -> None:
    from services.target.servicer import TargetServicer
    from shared.rpc.channel import client_tls_from, server_tls_from, set_client_tls
    from upesi.v1 import target_pb2_grpc

    telemetry.setup_tracing("upesi-target")
    set_client_tls(client_tls_from(cfg))             # the expert shards' channels
    publisher = _publisher(cfg)
    attached: list = []

    def build() -> LLMEngine:                        # on the engine thread, which runs every step after
        engine = build_engine(cfg.engine_config())
        if cfg.capture_hidden:
            engine.runner.capture_hidden()
        attached.append(_attach_expert_shards(cfg, engine))
        return engine
    engine_cls = TracedAsyncEngine if telemetry.ENABLED else AsyncEngine
    async_engine = engine_cls(build, on_step=StepObserver(publisher), stream_interval=cfg.stream_interval)
    engine, experts = async_engine.engine, attached[0]
    rebalancer = _start_rebalancer(cfg, experts)
    metrics.KV_BLOCKS_TOTAL.set(engine.counters().kv_blocks_total)
    if cfg.metrics_port:
        metrics.serve_metrics(cfg.metrics_port, cfg.address)
    service = Service("upesi.v1.Target", TargetServicer(async_engine, cfg.draft_timeout_s, cfg.lookup_speculation),
                      target_pb2_grpc.add_TargetServicer_to_server)

    async def stop() -> None:
        async_engine.stop()
        engine.close()
        if publisher is not None:
            publisher.stop()
        if rebalancer is not None:
            rebalancer.stop()
        if experts is not None:
            experts.close()

    log.info("model %s (%s): %d KV blocks of %d tokens, context %d, registry %s, KV store %s, host tier %s GiB",
             engine.model_path, engine.cfg.dtype, engine.counters().kv_blocks_total, cfg.block_size,
             engine.max_model_len, redacted(cfg.registry), redacted(cfg.kv_store), cfg.kv_host_gb)
    await run_server(cfg.address, [service], tls=server_tls_from(cfg), on_stop=stop)


def main(args: argparse.Namespace) -> None:
    cfg = config_from_args(TargetConfig, args)
    switches.disable(cfg.disable_kernels)              # before any kernel loads
    asyncio.run(serve(cfg))
