"""gRPC servicer of the draft service: converts protobuf and hands requests to their target's Verify stream."""
from __future__ import annotations

from services.draft import metrics
from services.draft.target_link import TargetLinks
from shared.errors import Forbidden, InvalidRequest
from shared.rpc.errors import map_errors
from upesi.v1 import draft_pb2, draft_pb2_grpc


class DraftServicer(draft_pb2_grpc.DraftServicer):
    def __init__(self, links: TargetLinks, allowed_targets: frozenset[str] | None = None) -> None:
        self.links, self.allowed = links, allowed_targets

    @map_errors
    async def Generate(self, request: draft_pb2.DraftGenerateRequest, context):
        if not request.target:
            raise InvalidRequest("target (the target replica's host:port) is required")
        if self.allowed is not None and request.target not in self.allowed:
            raise Forbidden(f"this draft does not serve the target {request.target!r} (see its --targets)")
        if not request.request.request_id:
            raise InvalidRequest("request.request_id is required")
        metrics.OPEN_REQUESTS.inc()
        try:
            async for msg in self.links.get(request.target).generate(request.request):
                yield msg
        finally:
            metrics.OPEN_REQUESTS.dec()
