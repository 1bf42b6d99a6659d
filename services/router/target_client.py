"""The router's view of a target replica: protobuf stays in here."""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc

from services.router.generation_io import Logprob
from shared.errors import PeerUnavailable
from shared.rpc.channel import ClientTLS, aio_channel, keepalive_options
from shared.sampling_params import SamplingParams
from upesi.v1 import target_pb2, target_pb2_grpc

log = logging.getLogger("upesi.router")


@dataclass(slots=True)
class TargetInfo:
    model: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    block_size: int


@dataclass(slots=True)
class StepOutput:
    # (choice index, new token ids, finish reason, per token (logprob, top ids, top logprobs) or None, the
    # prompt's (tokens 1 .. P-1) with a choice's first tokens or None)
    deltas: list[tuple[int, list[int], str | None, list[Logprob] | None, list[Logprob] | None]]
    spec: dict[int, tuple[int, int]]                   # choice index -> (draft tokens, accepted tokens) so far
    prompt_tokens: int
    cached_tokens: int


class TargetClient:
    def __init__(self, address: str, tls: ClientTLS | None = None, retry_after_s: float = 5.0) -> None:
        self.address, self.retry_after_s = address, retry_after_s
        # tls None: the router's own settings (set_client_tls); keepalive: a frozen target's calls fail (UNAVAILABLE,
        # then another replica) within 10 s instead of hanging to their deadline
        self.channel = aio_channel(address, tls, options=keepalive_options(5_000, 4_000, idle=False))
        self.stub = target_pb2_grpc.TargetStub(self.channel)
        self.down_until = 0.0                 # after UNAVAILABLE, new requests go elsewhere for retry_after_s

    @property
    def up(self) -> bool:
        return time.monotonic() >= self.down_until

    async def wait_info(self, timeout_s: float) -> TargetInfo:
        """Waits for the target to come up (it may still be loading its model) and reads its facts."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                r = await self.stub.Info(target_pb2.InfoRequest(), timeout=10, wait_for_ready=True)
                return TargetInfo(r.model, r.max_model_len, r.vocab_size, list(r.eos_token_ids), r.block_size)
            except grpc.aio.AioRpcError as e:
                if time.monotonic() > deadline:
                    raise PeerUnavailable(f"target {self.address} did not come up: {e.details()}") from None
                await asyncio.sleep(0.5)

    async def join_when_up(self, expect: TargetInfo) -> None:
        """For an optional replica (a prefill target): marked down until it answers, then up if it serves the same
        model with the same block size as `expect` (else it stays down, with an error in the log)."""
        self.down_until = float("inf")
        info = await self.wait_info(timeout_s=float("inf"))
        if (info.model, info.block_size) != (expect.model, expect.block_size):
            log.error("prefill target %s serves %s with %d-token blocks, not %s with %d: not used", self.address,
                      info.model, info.block_size, expect.model, expect.block_size)
            return
        log.info("prefill target %s is up", self.address)
        self.down_until = 0.0

    async def generate(self, request_id: str, prompt: list[int], params: SamplingParams,
                       timeout: float | None, attach: bool = False, kv_destination: str = ""
                       ) -> AsyncIterator[StepOutput]:
        """The request's output step by step. attach: take over the request if a draft's Verify stream opened it
        (its output from the first token on; see services/router/draft_client.py). kv_destination: a prefill
        target sends the prompt's KV blocks to that target before its last answer (P/D, direct transfer)."""
        req = target_request(request_id, prompt, params)
        req.attach = attach
        req.kv_destination = kv_destination
        call = self.stub.Generate(req, timeout=timeout)      # the deadline travels to the target with the call
        try:
            async for out in read_steps(call, params.n):
                yield out
        except grpc.aio.AioRpcError as e:
            if e.code() != grpc.StatusCode.UNAVAILABLE:        # gone, restarting or draining: not this request's
                raise                                          # fault; the router may try another replica
            self.down_until = time.monotonic() + self.retry_after_s
            raise PeerUnavailable(f"target {self.address} is unavailable: {e.details() or 'connection lost'}"
                                  ) from None

    async def abort(self, request_id: str, indices: list[int]) -> None:
        try:
            await self.stub.Abort(target_pb2.AbortRequest(request_id=request_id, indices=indices), timeout=5)
        except grpc.aio.AioRpcError:
            pass                                   # the stream ends anyway; nothing to undo

    async def close(self) -> None:
        await self.channel.close()


def target_request(request_id: str, prompt: list[int], params: SamplingParams) -> target_pb2.TargetGenerateRequest:
    return target_pb2.TargetGenerateRequest(
        request_id=request_id, prompt_token_ids=prompt, n=params.n,
        sampling=target_pb2.SamplingParams(temperature=params.temperature, top_p=params.top_p,
                                           top_k=params.top_k, seed=params.seed, max_tokens=params.max_tokens,
                                           ignore_eos=params.ignore_eos, stop_token_ids=params.stop_token_ids,
                                           cache_salt=params.cache_salt, beam_width=params.beam_width,
                                           num_speculative_tokens=params.num_speculative_tokens,
                                           presence_penalty=params.presence_penalty,
                                           frequency_penalty=params.frequency_penalty,
                                           repetition_penalty=params.repetition_penalty, min_p=params.min_p,
                                           logit_bias=params.logit_bias, min_tokens=params.min_tokens,
                                           logprobs=params.logprobs, guide_kind=params.guide_kind,
                                           guide=params.guide, prompt_logprobs=params.prompt_logprobs,
                                           tenant=params.tenant,
                                           bad_words=[target_pb2.TokenIds(ids=w) for w in params.bad_words]))


def _logprobs(lps) -> list[Logprob]:
    return [Logprob(lp.logprob, list(lp.top_ids), list(lp.top_logprobs), lp.rank) for lp in lps]


async def read_steps(call, n: int) -> AsyncIterator[StepOutput]:
    """TargetGenerateResponse messages of a call (the target's or a draft's) -> StepOutput, until n choices end."""
    unfinished = n
    try:
        async for msg in call:
            out = StepOutput([(d.index, list(d.token_ids), d.finish_reason or None,
                               _logprobs(d.logprobs) if d.logprobs else None,
                               _logprobs(d.prompt_logprobs) if d.has_prompt_logprobs else None) for d in msg.deltas],
                             {d.index: (d.draft_tokens, d.accepted_tokens) for d in msg.deltas},
                             msg.prompt_tokens, msg.cached_tokens)
            unfinished -= sum(1 for d in msg.deltas if d.finish_reason)
            if unfinished <= 0:       # the peer ends the stream after the last finish: read that end now, so
                async for _ in call:  # the call completes (and its trace span ends) though the caller stops
                    pass              # reading at the last answer
            yield out
    finally:
        call.cancel()
