"""One request's trace across all four services, and /metrics on each of them.

`upesi serve --draft ngram --expert-shards 2` runs with OTEL_EXPORTER_OTLP_ENDPOINT pointing at an OTLP trace
collector inside this test (a real gRPC TraceService keeping what it is sent). One Generate call must give one trace
with spans from the router, target, draft and expert services, parented as the request flowed:

  router Generation/Generate -> router client Draft/Generate -> draft server Draft/Generate
      -> target "Verify open" (the request, opened on the draft's Verify stream with its trace context)
          -> prefill, verify (speculation), propose -> draft "draft propose" (the draft's answer to that step)
          -> expert dispatch -> expert server Experts/Dispatch (each shard, each layer)
"""
from __future__ import annotations

import re
import threading
import time
import urllib.request
from collections import Counter
from concurrent import futures

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from tests.conftest import Stack, free_port, free_port_run
from upesi.v1 import generation_pb2 as pb
from upesi.v1 import generation_pb2_grpc

pytestmark = pytest.mark.slow

PROMPT = "one two three four five, one two three four five, one two three four five, one two three"


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace endpoint that keeps every span with its service (resource attribute upesi.service)."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, object]] = []
        self.lock = threading.Lock()

    def Export(self, request, context):
        with self.lock:
            for rs in request.resource_spans:
                attrs = {a.key: a.value.string_value for a in rs.resource.attributes}
                for ss in rs.scope_spans:
                    self.spans.extend((attrs.get("upesi.service", "?"), s) for s in ss.spans)
        return trace_service_pb2.ExportTraceServiceResponse()

    def snapshot(self) -> list[tuple[str, object]]:
        with self.lock:
            return list(self.spans)


def _scrape(port: int) -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()


def _value(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    collector = Collector()
    server = grpc.server(futures.ThreadPoolExecutor(4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, server)
    otlp_port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    mp = pytest.MonkeyPatch()
    mp.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{otlp_port}")
    mp.setenv("OTEL_BSP_SCHEDULE_DELAY", "200")
    mp.delenv("OTEL_TRACES_EXPORTER", raising=False)
    mp.delenv("OTEL_SERVICE_NAME", raising=False)
    ports = {"draft": free_port(), "experts": free_port_run(2)}
    target = free_port_run(3)                      # the target, then its two shards on the next ports
    stack = Stack(tmp_path_factory.mktemp("tracing"),
                  ["--draft", "ngram", "--draft-address", f"127.0.0.1:{free_port()}", "--num-speculative-tokens", "3",
                   "--draft-metrics-port", str(ports["draft"]), "--expert-shards", "2",
                   "--expert-metrics-port", str(ports["experts"]), "--target-address", f"127.0.0.1:{target}"])
    mp.undo()                                  # the children have their environment; this process needs none
    try:
        stack.wait_ready()
        yield stack, collector, ports
    finally:
        assert stack.stop() == 0, stack.log.read_text()[-3000:]
        server.stop(0)


def _generate(stack, max_tokens: int):
    with grpc.insecure_channel(stack.address) as ch:
        return generation_pb2_grpc.GenerationStub(ch).Generate(
            pb.GenerateRequest(prompt=PROMPT, max_tokens=max_tokens, temperature=0), timeout=120)


def test_one_trace_spans_all_four_services(traced):
    stack, collector, ports = traced
    for _ in range(5):            # warm up until the target reaches the draft (it skips a draft that timed out)
        if _generate(stack, 4).spec.draft_tokens:
            break
        time.sleep(5)
    t0 = time.time_ns()
    r = _generate(stack, 12)
    assert r.choices[0].token_ids
    assert r.spec.draft_tokens > 0, "the n-gram draft proposed nothing: no verification step to trace"

    def router_roots(spans):
        return [s for svc, s in spans if svc == "router" and s.name == "/upesi.v1.Generation/Generate"
                and s.start_time_unix_nano >= t0]

    deadline, last = time.monotonic() + 60, -1
    while True:                                # spans arrive in batches from four processes: wait until none come
        spans = collector.snapshot()
        if len(spans) == last and len(router_roots(spans)) == 1:
            break
        assert time.monotonic() < deadline, f"spans still coming: {sorted({(svc, s.name) for svc, s in spans})}"
        last = len(spans)
        time.sleep(2.0)
    roots = router_roots(spans)
    trace = [(svc, s) for svc, s in spans if s.trace_id == roots[0].trace_id]
    root = roots[0]
    assert root.parent_span_id == b"", "the router's server span is the root"
    by_id = {s.span_id: (svc, s) for svc, s in trace}
    assert len(by_id) == len(trace)

    def parent(span):
        assert span.parent_span_id in by_id, f"{span.name}: parent not in {Counter((v, s.name) for v, s in trace)}"
        return by_id[span.parent_span_id]

    for svc, s in trace:                       # one tree: every span but the root has its parent in the trace
        if s is not root:
            parent(s)
    assert {svc for svc, _ in trace} == {"router", "target", "draft", "experts"}

    def one(svc_name, name):
        found = [s for svc, s in trace if svc == svc_name and s.name == name]
        assert found, f"no {name} span from the {svc_name}"
        return found

    (draft_server,) = one("draft", "/upesi.v1.Draft/Generate")
    router_client = parent(draft_server)
    assert router_client[0] == "router" and parent(router_client[1])[1] is root
    (target_server,) = one("target", "/upesi.v1.Target/Verify open")
    assert parent(target_server)[1] is draft_server
    (prefill,) = one("target", "prefill")
    assert parent(prefill)[1] is target_server
    assert dict((a.key, a.value.int_value) for a in prefill.attributes)["upesi.prompt_tokens"] > 0
    for v in one("target", "verify"):
        assert parent(v)[1] is target_server
    for d in one("draft", "draft propose"):                     # the draft's answer <- the target's propose step
        step = parent(d)
        assert step[0] == "target" and step[1].name == "propose" and parent(step[1])[1] is target_server
    dispatch = one("target", "expert dispatch")
    for d in dispatch:
        assert parent(d)[1] is target_server
        assert len([e for e in d.events if e.name == "layer"]) == 30       # one event per layer per step
    shard_spans = one("experts", "/upesi.v1.Experts/Dispatch")
    assert all(parent(s)[1].name == "expert dispatch" for s in shard_spans)
    assert len(shard_spans) == 2 * 30 * len(dispatch)                       # 2 shards x 30 layers per step
    for svc, s in trace:                                                    # spans close after they open
        assert s.end_time_unix_nano >= s.start_time_unix_nano, (svc, s.name)


def test_metrics_on_every_service(traced):
    stack, _, ports = traced
    with grpc.insecure_channel(stack.address) as ch:
        generation_pb2_grpc.GenerationStub(ch).Generate(
            pb.GenerateRequest(prompt=PROMPT, max_tokens=4, temperature=0), timeout=120)
    router = _scrape(stack.http_port)
    assert _value(router, "upesi_time_to_first_token_seconds_count") >= 1
    assert _value(router, "upesi_time_per_output_token_seconds_count") >= 1
    target = _scrape(stack.metrics_port)
    assert _value(target, "upesi_kv_blocks_total") > 0
    assert _value(target, "upesi_spec_draft_tokens_total") > 0
    assert "upesi_expert_tokens_total{" in target
    draft = _scrape(ports["draft"])
    assert _value(draft, "upesi_draft_propose_seconds_count") >= 1
    assert _value(draft, "upesi_draft_batch_sequences_count") >= 1
    assert _value(draft, "upesi_draft_proposed_tokens_total") > 0
    for i in range(2):
        shard = _scrape(ports["experts"] + i)
        assert _value(shard, "upesi_expert_dispatch_tokens_count") >= 30     # one Dispatch per layer, at least
        assert _value(shard, "upesi_expert_compute_seconds_count") >= 30


def test_deadline_reaches_the_target(traced):
    """A request whose deadline passes gets DEADLINE_EXCEEDED, and the target drops its work: the deadline (or the
    cancellation it causes) crosses router -> target, so no sequence keeps running and no KV block stays used."""
    stack, _, _ = traced
    with grpc.insecure_channel(stack.address) as ch, pytest.raises(grpc.RpcError) as e:
        generation_pb2_grpc.GenerationStub(ch).Generate(
            pb.GenerateRequest(prompt=PROMPT, max_tokens=2000, temperature=0, ignore_eos=True), timeout=3)
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    deadline = time.monotonic() + 60
    while True:
        target = _scrape(stack.metrics_port)
        if _value(target, "upesi_running_sequences") == 0 and _value(target, "upesi_kv_blocks_used") == 0:
            break
        assert time.monotonic() < deadline, "the target still works on a request whose deadline passed"
        time.sleep(0.5)
