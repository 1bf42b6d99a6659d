"""OpenTelemetry tracing: one trace per request across router, target, draft and expert shards.

`setup_tracing` runs once per process at service start (never at import) and reads only the standard OTEL_* variables:
- OTEL_TRACES_EXPORTER: `otlp` (the default), `console` or `none`;
- otlp exports only when OTEL_EXPORTER_OTLP_ENDPOINT or OTEL_EXPORTER_OTLP_TRACES_ENDPOINT is set (protocol from
  OTEL_EXPORTER_OTLP[_TRACES]_PROTOCOL, grpc by default); with neither, nothing is exported;
- OTEL_SERVICE_NAME / OTEL_RESOURCE_ATTRIBUTES, OTEL_TRACES_SAMPLER, OTEL_BSP_* (batching) as the SDK reads them.

When nothing is exported tracing is off: no provider, no interceptors on servers or channels, and `ENABLED` is False,
which is all the engine checks per step, so tracing costs nothing then.

Context crosses processes in gRPC metadata (W3C traceparent) through opentelemetry's gRPC interceptors. Inside the
target the engine thread batches many requests in one step: each Sequence keeps its request's context (`trace_ctx`),
and per-step work (proposals, expert dispatch) is parented to the first traced request of the batch, with links to
the others (`StepScope`).
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace

log = logging.getLogger("upesi.telemetry")

ENABLED = False                    # set once by setup_tracing; read on hot paths
_provider = None
_tracer: trace.Tracer = trace.NoOpTracer()
_local = threading.local()         # the engine thread's current step (StepScope)

Context = otel_context.Context


def _env(*names: str) -> str:
    for n in names:
        v = os.environ.get(n, "").strip()
        if v:
            return v
    return ""


def _exporter():
    """The span exporter the OTEL_* variables ask for, or None (nothing to export)."""
    if _env("OTEL_SDK_DISABLED").lower() == "true":
        return None
    names = [n.strip().lower() for n in (_env("OTEL_TRACES_EXPORTER") or "otlp").split(",") if n.strip()]
    if not names or names == ["none"]:
        return None
    if len(names) > 1:
        raise ValueError(f"OTEL_TRACES_EXPORTER: one exporter please, got {names}")
    if names[0] == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter
        return ConsoleSpanExporter()
    if names[0] != "otlp":
        raise ValueError(f"OTEL_TRACES_EXPORTER={names[0]!r} is not supported here: use otlp, console or none")
    if not _env("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT"):
        return None
    protocol = _env("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc"
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    elif protocol == "http/protobuf":
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError as e:
            raise RuntimeError("OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf needs "
                               "opentelemetry-exporter-otlp-proto-http installed") from e
    else:
        raise ValueError(f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol!r}: use grpc or http/protobuf")
    return OTLPSpanExporter()       # endpoint, headers, TLS and timeout from the OTEL_EXPORTER_OTLP_* variables


def setup_tracing(service: str) -> bool:
    """Installs the tracer provider for this process (once). `service` is the default service.name
    ("upesi-router", ...), overridden by OTEL_SERVICE_NAME. Returns whether spans are exported."""
    global ENABLED, _provider, _tracer
    if _provider is not None:
        return ENABLED
    exporter = _exporter()
    if exporter is None:
        log.debug("tracing off (no OTLP endpoint, or OTEL_TRACES_EXPORTER=none)")
        return False
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    named = _env("OTEL_SERVICE_NAME") or "service.name=" in _env("OTEL_RESOURCE_ATTRIBUTES")
    attrs = {"upesi.service": service.removeprefix("upesi-")}
    if not named:
        attrs["service.name"] = service
    _provider = TracerProvider(resource=Resource.create(attrs))          # sampler from OTEL_TRACES_SAMPLER
    _provider.add_span_processor(BatchSpanProcessor(exporter))          # OTEL_BSP_* batching
    trace.set_tracer_provider(_provider)
    _tracer = _provider.get_tracer("upesi")
    ENABLED = True
    log.info("tracing: exporting spans of %s (%s)", service, type(exporter).__name__)
    return True


def shutdown_tracing() -> None:
    """Flushes and stops the exporter (at graceful stop)."""
    if _provider is not None:
        _provider.shutdown()


def tracer() -> trace.Tracer:
    return _tracer


def current_context() -> Context | None:
    """The caller's context to carry into the engine thread; None when tracing is off or the caller's trace is not
    sampled (then the engine records nothing for the request, and a step's parent is always a sampled request)."""
    if not ENABLED:
        return None
    ctx = otel_context.get_current()
    return ctx if trace.get_current_span(ctx).get_span_context().trace_flags.sampled else None


def span_between(name: str, parent: Context, start_ns: int, attributes: dict | None = None,
                 links: list[trace.Link] | None = None) -> None:
    """Records a finished span [start_ns, now] under `parent` (the engine's per-request spans)."""
    _tracer.start_span(name, context=parent, start_time=start_ns, attributes=attributes, links=links).end()


def links_to(contexts: list[Context]) -> list[trace.Link]:
    return [trace.Link(trace.get_current_span(c).get_span_context()) for c in contexts]


# ---------------------------------------------------------------- grpc interceptors (only when ENABLED)
def _not_health_or_reflection():
    """Also not the long-lived Verify streams: each request on one has its own span (`request_span`)."""
    from opentelemetry.instrumentation.grpc import filters
    return filters.negate(filters.any_of(filters.health_check(), filters.service_prefix("grpc.reflection"),
                                         filters.full_method_name("/upesi.v1.Target/Verify")))


def server_interceptors() -> list:
    """For grpc.aio servers: a SERVER span per call, its parent taken from the caller's metadata."""
    if not ENABLED:
        return []
    from opentelemetry.instrumentation.grpc import aio_server_interceptor
    return [aio_server_interceptor(tracer_provider=_provider, filter_=_not_health_or_reflection())]


def aio_client_interceptors() -> list:
    if not ENABLED:
        return []
    from opentelemetry.instrumentation.grpc import aio_client_interceptors as make
    return make(tracer_provider=_provider, filter_=_not_health_or_reflection())


def traced_sync_channel(channel):
    """A blocking channel whose calls get CLIENT spans and carry the trace context (unchanged when tracing is off)."""
    if not ENABLED:
        return channel
    from opentelemetry.instrumentation.grpc import client_interceptor, intercept_channel
    return intercept_channel(channel, client_interceptor(tracer_provider=_provider,
                                                         filter_=_not_health_or_reflection()))


def inject_metadata(ctx: Context | None = None) -> tuple[tuple[str, str], ...]:
    """W3C trace context of `ctx` (default: the current one) as gRPC metadata."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=ctx)
    return tuple(carrier.items())


def request_span(name: str, traceparent: str):
    """A span for work that arrives on a long-lived stream with its own trace context (a Verify stream's `open`):
    (span, its context) to end when the work is done, or (None, None) when tracing is off or nothing is carried."""
    if not ENABLED or not traceparent:
        return None, None
    parent = propagate.extract({"traceparent": traceparent})
    span = _tracer.start_span(name, context=parent)
    return span, trace.set_span_in_context(span)


def attach(ctx: Context) -> None:
    """Makes `ctx` current for the rest of this task (an asyncio task has its own copy of the context)."""
    otel_context.attach(ctx)


def traceparent(ctx: Context | None = None) -> str:
    """The W3C traceparent of `ctx` (default: the current context); "" when tracing is off."""
    if not ENABLED:
        return ""
    return dict(inject_metadata(ctx)).get("traceparent", "")


@contextmanager
def span_from(name: str, traceparent_value: str, attributes: dict | None = None) -> Iterator[None]:
    """A span current for the block, child of a carried traceparent (nothing when off or not carried)."""
    if not ENABLED or not traceparent_value:
        yield
        return
    with _tracer.start_as_current_span(name, context=propagate.extract({"traceparent": traceparent_value}),
                                       attributes=attributes):
        yield


# ---------------------------------------------------------------- the engine thread's step
class StepScope:
    """One engine step's tracing: parent = the first traced request of the batch, links = the others.

    `expert_dispatch_metadata` (called by the expert client once per layer) opens one "expert dispatch" span per
    step on first use, adds an event per layer, and returns the metadata that makes the shards' spans its children;
    the scope ends that span when the step's forward pass is done."""

    __slots__ = ("parent", "links", "dispatch", "metadata", "layers")

    def __init__(self, contexts: list[Context]) -> None:
        self.parent = contexts[0]
        self.links = links_to(contexts[1:])
        self.dispatch = None
        self.metadata: tuple = ()
        self.layers = 0

    def expert_dispatch_metadata(self, layer: int, tokens: int, shards: int) -> tuple:
        if self.dispatch is None:
            self.dispatch = _tracer.start_span("expert dispatch", context=self.parent, links=self.links)
            self.metadata = inject_metadata(trace.set_span_in_context(self.dispatch))
        self.dispatch.add_event("layer", {"layer": layer, "tokens": tokens, "shards": shards})
        self.layers += 1
        return self.metadata

    def close(self) -> None:
        if self.dispatch is not None:
            self.dispatch.set_attribute("upesi.layers", self.layers)
            self.dispatch.end()


@contextmanager
def step_scope(contexts: list[Context]) -> Iterator[StepScope | None]:
    """Makes the step's scope current on this thread (None when no request of the batch is traced)."""
    if not contexts:
        yield None
        return
    scope = StepScope(contexts)
    _local.scope = scope
    try:
        yield scope
    finally:
        _local.scope = None
        scope.close()


def current_step() -> StepScope | None:
    return getattr(_local, "scope", None) if ENABLED else None


@contextmanager
def span_in(name: str, contexts: list[Context], attributes: dict | None = None) -> Iterator[None]:
    """A span current on this thread for the block, parented to contexts[0] with links to the rest."""
    if not contexts:
        yield
        return
    with _tracer.start_as_current_span(name, context=contexts[0], links=links_to(contexts[1:]),
                                       attributes=attributes):
        yield


def now_ns() -> int:
    return time.time_ns()


# ---------------------------------------------------------------- per-request spans of the engine
def traced_contexts(seqs) -> list[Context]:
    """The distinct trace contexts of these sequences (choices of one request share one), in batch order."""
    if not ENABLED:
        return []
    out: dict[int, Context] = {}
    for s in seqs:
        if s.trace_ctx is not None:
            out.setdefault(id(s.trace_ctx), s.trace_ctx)
    return list(out.values())


def prefill_starting(seqs) -> None:
    """Marks when each traced sequence's prompt starts computing (its first prefill chunk)."""
    now = time.time_ns()
    for s in seqs:
        if s.trace_ctx is not None and s.prefill_start_ns == 0 and s.in_prompt:
            s.prefill_start_ns = now


def prefill_done(seqs) -> None:
    """Records a "prefill" span for each traced sequence whose prompt is now computed (all chunks, one span)."""
    for s in seqs:
        if s.trace_ctx is not None and s.prefill_start_ns > 0 and not s.in_prompt:
            span_between("prefill", s.trace_ctx, s.prefill_start_ns,
                         {"upesi.prompt_tokens": s.num_prompt_tokens, "upesi.cached_tokens": s.num_cached_tokens,
                          "upesi.choice": s.index})
            s.prefill_start_ns = -1                  # once per sequence, even if it is recomputed after preemption
