"""gRPC servicer of the target: converts protobuf and calls the engine (Verify streams: services/target/verify.py)."""
from __future__ import annotations

import asyncio
import logging

import grpc

from services.target.block_transfer import BlockSender, decode_blocks
from services.target.relays import Relays, delta_to_pb
from services.target.verify import StreamProposer
from shared.engine.async_engine import AsyncEngine
from shared.errors import InvalidRequest, NotConfigured, NotRunning
from shared.rpc.errors import log_error, map_errors, status_for
from shared.sampling_params import SamplingParams
from shared.spec.proposer_mux import ProposerMux
from upesi.v1 import target_pb2, target_pb2_grpc

log = logging.getLogger("upesi.target")
_END = object()


def params_from_pb(req: target_pb2.TargetGenerateRequest) -> SamplingParams:
    s = req.sampling
    return SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                          seed=s.seed if s.HasField("seed") else None, max_tokens=s.max_tokens,
                          ignore_eos=s.ignore_eos, stop_token_ids=list(s.stop_token_ids), n=req.n or 1,
                          cache_salt=s.cache_salt, beam_width=s.beam_width,
                          num_speculative_tokens=s.num_speculative_tokens if s.HasField("num_speculative_tokens")
                          else None, presence_penalty=s.presence_penalty, frequency_penalty=s.frequency_penalty,
                          repetition_penalty=s.repetition_penalty if s.HasField("repetition_penalty") else 1.0,
                          min_p=s.min_p, logit_bias=dict(s.logit_bias), min_tokens=s.min_tokens,
                          logprobs=s.logprobs if s.HasField("logprobs") else None, guide_kind=s.guide_kind,
                          guide=s.guide, prompt_logprobs=s.prompt_logprobs if s.HasField("prompt_logprobs") else None,
                          tenant=s.tenant, bad_words=[list(w.ids) for w in s.bad_words])


class TargetServicer(target_pb2_grpc.TargetServicer):
    def __init__(self, engine: AsyncEngine, verify_timeout_s: float = 5.0, lookup_speculation: bool = False) -> None:
        self.engine = engine
        # drafts from Verify streams go through a mux (and prompt lookup, for requests without a draft service)
        mux = engine.wrap_proposer(lambda p: p if isinstance(p, ProposerMux)
                                   else ProposerMux(p, lookup_unbound=lookup_speculation))
        self.relays = Relays(engine, mux)
        self.verify_timeout_s = verify_timeout_s
        self.blocks = BlockSender(engine)

    @map_errors
    async def Generate(self, request: target_pb2.TargetGenerateRequest, context: grpc.aio.ServicerContext):
        if not request.request_id:
            raise InvalidRequest("request_id is required")
        if request.attach:
            got = self.relays.attach(request.request_id)
            if got is None:
                raise NotRunning(f"request {request.request_id!r} is not running on this target")
            async for msg in self._attached(request.request_id, *got):
                yield msg
            return
        params = params_from_pb(request)
        prompt = list(request.prompt_token_ids)
        first, held = True, None
        async for d in self.engine.generate(request.request_id, prompt, params):
            msg = delta_to_pb(d, first)
            first = False
            if not request.kv_destination:
                yield msg
                continue
            if held is not None:                    # a prefill target holds each answer until the next: the
                yield held                          # blocks go before the last one
            held = msg
        if request.kv_destination:
            await self._send_blocks(request.kv_destination, prompt, params.cache_salt)
        if held is not None:
            yield held

    async def _send_blocks(self, destination: str, prompt: list[int], cache_salt: str) -> None:
        """Best effort: whatever fails, the decode target computes the blocks it did not get."""
        try:
            await self.blocks.send(destination, prompt, cache_salt)
        except Exception as e:
            log.warning("KV blocks for %s not sent: %s", destination, getattr(e, "details", lambda: e)())

    @map_errors
    async def PutBlocks(self, request_iterator, context) -> target_pb2.PutBlocksResponse:
        if not self.engine.keeps_received_blocks:
            raise NotConfigured("this target keeps no host tier for KV blocks from other targets: start it with "
                                "--kv-host-gb")
        got = [(b.hash, b.value) async for b in request_iterator]
        layout = self.engine.block_layout
        good, bad = await asyncio.get_running_loop().run_in_executor(None, decode_blocks, layout, got)
        if good:
            await self.engine.call(lambda e: e.receive_blocks(good))
        return target_pb2.PutBlocksResponse(stored=len(good), invalid=bad)

    async def _attached(self, request_id: str, queue: asyncio.Queue, history: list):
        """A request a Verify stream opened, taken over by this caller: its output so far, then the rest."""
        done = False
        try:
            for msg in history:
                yield msg
            while True:
                _, item = await queue.get()
                if item is None:
                    done = True
                    return
                if isinstance(item, BaseException):
                    done = True
                    raise item
                yield item
        finally:
            if not done:
                self.relays.abort(request_id)                 # the caller went away: stop the request

    async def Verify(self, request_iterator, context: grpc.aio.ServicerContext):
        """One draft's stream (see services/target/verify.py): requests it opens, verdicts down, proposals up."""
        loop = asyncio.get_running_loop()
        outbox: asyncio.Queue = asyncio.Queue()   # VerifyDown, or (request id, output | error | None) from relays
        proposer = StreamProposer(loop, outbox, self.verify_timeout_s,
                                  vocab_size=self.engine.info().vocab_size)
        self.relays.mux.add(proposer)
        mine: dict[str, object] = {}
        reader = asyncio.create_task(self._read_verify(request_iterator, proposer, outbox, mine))
        try:
            while True:
                item = await outbox.get()
                if item is _END:
                    return
                if isinstance(item, target_pb2.VerifyDown):
                    yield item
                    continue
                rid, msg = item
                if msg is None:
                    mine.pop(rid, None)
                elif isinstance(msg, BaseException):
                    mine.pop(rid, None)
                    log_error(msg, f"a request on the Verify stream ({rid})")
                    code, text = status_for(msg)
                    yield target_pb2.VerifyDown(request_id=rid, error=text, error_code=code.value[0])
                else:
                    yield target_pb2.VerifyDown(request_id=rid, output=msg)
        finally:
            proposer.close()
            self.relays.mux.remove(proposer)
            reader.cancel()
            self.relays.orphan([r for r in mine.values() if r.sink is outbox])

    async def _read_verify(self, request_iterator, proposer: StreamProposer, outbox: asyncio.Queue,
                           mine: dict) -> None:
        try:
            async for up in request_iterator:
                kind = up.WhichOneof("kind")
                if kind == "proposals":
                    proposer.answer(up.step, up.proposals)
                elif kind == "open":
                    req = up.open
                    try:
                        if not req.request_id:
                            raise InvalidRequest("request_id is required")
                        if req.request_id in self.relays.by_id:
                            raise InvalidRequest(f"request id {req.request_id!r} is already running")
                        params = params_from_pb(req)
                    except InvalidRequest as e:
                        outbox.put_nowait((req.request_id, e))
                        continue
                    mine[req.request_id] = self.relays.start(req.request_id, list(req.prompt_token_ids), params,
                                                             proposer, outbox, up.traceparent)
                elif kind == "abort":
                    mine.pop(up.abort.request_id, None)
                    self.relays.abort(up.abort.request_id, owner=outbox)
                elif kind == "hello":
                    proposer.wants_hidden = up.hello.wants_hidden
        except Exception as e:                        # the draft went away mid-message; the finally below copes
            log.info("verify stream ended: %s", e)
        finally:
            outbox.put_nowait(_END)

    @map_errors
    async def Abort(self, request: target_pb2.AbortRequest, context) -> target_pb2.AbortResponse:
        self.engine.abort(request.request_id, list(request.indices) or None)
        return target_pb2.AbortResponse()

    @map_errors
    async def Info(self, request, context) -> target_pb2.InfoResponse:
        i = self.engine.info()
        return target_pb2.InfoResponse(model=i.model, max_model_len=i.max_model_len, vocab_size=i.vocab_size,
                                       eos_token_ids=i.eos_token_ids, block_size=i.block_size,
                                       num_kv_blocks=i.num_kv_blocks, max_num_seqs=i.max_num_seqs)

    @map_errors
    async def Load(self, request, context) -> target_pb2.LoadResponse:
        load = self.engine.load()
        return target_pb2.LoadResponse(running=load.running, waiting=load.waiting,
                                       kv_blocks_used=load.kv_blocks_used, kv_blocks_total=load.kv_blocks_total)
