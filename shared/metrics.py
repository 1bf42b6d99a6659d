"""Prometheus metrics, all prefixed upesi_. Each process exposes the ones it updates."""
from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)

REQUESTS = Counter("upesi_requests_total", "Generation requests by outcome", ["method", "code"])
TTFT = Histogram("upesi_time_to_first_token_seconds", "Time from request to first token", buckets=_LATENCY)
TPOT = Histogram("upesi_time_per_output_token_seconds", "Time between output tokens", buckets=_LATENCY)
PROMPT_TOKENS = Counter("upesi_prompt_tokens_total", "Prompt tokens received")
GENERATED_TOKENS = Counter("upesi_generation_tokens_total", "Tokens generated")
IN_FLIGHT = Gauge("upesi_requests_in_flight", "Requests being served")

KV_BLOCKS_TOTAL = Gauge("upesi_kv_blocks_total", "KV cache blocks in the pool")
KV_BLOCKS_USED = Gauge("upesi_kv_blocks_used", "KV cache blocks in use")
RUNNING = Gauge("upesi_running_sequences", "Sequences in the running batch")
WAITING = Gauge("upesi_waiting_sequences", "Sequences waiting for admission")
PREEMPTIONS = Counter("upesi_preemptions_total", "Sequences preempted for lack of KV blocks")
STEP_SECONDS = Histogram("upesi_engine_step_seconds", "Forward step time", buckets=_LATENCY)
SPEC_DRAFT = Counter("upesi_spec_draft_tokens", "Speculative tokens proposed by the draft")
SPEC_ACCEPTED = Counter("upesi_spec_accepted_tokens", "Speculative tokens accepted by verification")
PREFIX_QUERIES = Counter("upesi_prefix_cache_queries", "Prompt tokens looked up in the prefix cache")
PREFIX_HITS = Counter("upesi_prefix_cache_hits", "Prompt tokens served from the prefix cache")

_TRANSFER = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
KV_STORE_HITS = Counter("upesi_kv_store_hits_total", "KV blocks read from the block store", ["tier"])
KV_STORE_WRITE_FAILURES = Counter("upesi_kv_store_write_failures_total",
                                  "KV blocks a tier failed to store (tried again when next committed)", ["tier"])
KV_STORE_MISSES = Counter("upesi_kv_store_misses_total", "KV blocks looked up in the block store and not found")
KV_STORE_SKIPPED = Counter("upesi_kv_store_skipped_total",
                           "KV blocks computed instead of read because reading was measured to cost more")
KV_STORE_INVALID = Counter("upesi_kv_store_invalid_total",
                           "Block store values refused (another model, dtype or layout, truncated, corrupted)")
KV_STORE_FORGED = Counter("upesi_kv_store_forged_total",
                          "Block store values refused because their MAC under the store key failed (also counted "
                          "in upesi_kv_store_invalid_total)")
KV_STORE_DROPPED = Counter("upesi_kv_store_dropped_total", "KV block writes dropped because the writer fell behind")
KV_STORE_BYTES = Counter("upesi_kv_store_bytes_total", "KV block bytes: read from and written to the block store "
                         "(read, write), sent to and received from other targets (sent, received)", ["direction"])
KV_STORE_READ_SECONDS = Histogram("upesi_kv_store_read_seconds", "Time of one block store read (a prefix's blocks)",
                                  buckets=_TRANSFER)
KV_STORE_WRITE_SECONDS = Histogram("upesi_kv_store_write_seconds", "Time of one block store write (a batch)",
                                   buckets=_TRANSFER)


class _Only:
    """A collector that yields the default registry's families whose names start with one of `prefixes`."""

    def __init__(self, prefixes: tuple[str, ...]) -> None:
        self.prefixes = prefixes

    def collect(self):
        from prometheus_client import REGISTRY
        for family in REGISTRY.collect():
            if family.name.startswith(self.prefixes):
                yield family


def serve_metrics(port: int, grpc_address: str, prefixes: tuple[str, ...] | None = None) -> None:
    """/metrics on its own HTTP port (shared.metrics_server: a bounded daemon server), on loopback when the service's
    gRPC address is loopback.
    `prefixes`: export only the families whose names start with one of them, plus the process_ / python_ ones
    (a process imports modules that define other services' families, which it never updates).
    A port already taken is logged as an error and serving goes on without /metrics."""
    import logging

    from prometheus_client import REGISTRY, CollectorRegistry

    from shared import metrics_server
    addr = "127.0.0.1" if grpc_address.startswith(("127.", "localhost")) else "0.0.0.0"
    registry = REGISTRY
    if prefixes is not None:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Only(tuple(prefixes) + ("process_", "python_")))
    try:
        metrics_server.start(port, addr, registry)
    except OSError as e:
        logging.getLogger("upesi.metrics").error("cannot serve /metrics on %s:%d (%s); going on without it",
                                                 addr, port, e.strerror)
