"""The router's request logic without protobuf: validate, tokenise, forward to a target, detokenise.

The gRPC servicer and the HTTP API both call `Frontend.stream`.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator

from services.router.auth import KeyTable
from services.router.config import RouterConfig
from services.router.draft_client import DraftClient
from services.router.limits import Caller
from services.router.placement import Placement
from services.router.spec_guard import SpeculationGuard
from services.router.generation_io import ChoiceDelta, GenerationInput, StreamChunk
from services.router.target_client import TargetClient, TargetInfo
from shared import metrics
from shared.errors import Draining, InvalidRequest, Overloaded, PeerUnavailable
from shared.kv.hashing import cache_extra, hash_chain
from shared.reasoning import opens_thinking
from shared.registry.base import PrefixRegistry, ReplicaId, ReplicaLoad
from shared.sampling_params import SamplingParams
from shared.text_output import ChoiceText
from shared.tokenizer import Tokenizer

log = logging.getLogger("upesi.router")


class Frontend:
    def __init__(self, cfg: RouterConfig, tokenizer: Tokenizer, targets: list[TargetClient], info: TargetInfo,
                 registry: PrefixRegistry | None = None, keys: KeyTable | None = None,
                 drafts: list[DraftClient] | None = None, served_model: str | None = None,
                 prefill: list[TargetClient] | None = None) -> None:
        self.cfg, self.tok, self.targets, self.info, self.registry = cfg, tokenizer, targets, info, registry
        self.served_model = served_model or (info.model if info else "")   # the model's name in the OpenAI API
        self.drafts = drafts or []
        self.prefill = prefill or []                         # prefill-only targets (P/D disaggregation)
        self.keys = keys or KeyTable.from_config(cfg)     # who may call, with what limits
        self.in_flight = 0
        self.draining = False                                # set on SIGTERM: new requests are refused
        self.load = {t.address: 0 for t in [*targets, *self.prefill]}   # requests open here on each replica
        # does speculation pay here, for a request alone
        self.guard = SpeculationGuard(lookup_at_targets=cfg.lookup_speculation)
        self.placement = Placement(registry)                 # registry lookups on their own threads

    async def choose_target(self, ids: list[int], salt: str, tried: list[TargetClient] = ()) -> TargetClient:
        """The replica with the longest cached prefix of this prompt, weighed against its load, among those not
        tried yet for this request and not marked down (all of the untried ones when every one is down)."""
        untried = [t for t in self.targets if t not in tried]
        candidates = [t for t in untried if t.up] or untried
        if len(candidates) == 1:
            return candidates[0]
        chain = hash_chain(ids, self.info.block_size, cache_extra(self.info.model, salt))
        loads = {t.address: ReplicaLoad(running=self.load[t.address]) for t in candidates}
        replicas = [ReplicaId(t.address) for t in candidates]
        chosen = await self.placement.choose(chain, replicas, loads, self.info.block_size)
        return next(t for t in self.targets if t.address == chosen)

    def choose_draft(self, params: SamplingParams) -> DraftClient | None:
        """The least busy draft replica for a speculative request; None when it is not one (K = 0, beam search, a
        single token: the prompt's prefill makes it, with nothing to draft, so it goes straight to the target without
        the draft service's relay), no draft is configured, every draft failed in the last few seconds, or more than
        speculative_max_requests are in flight (the target then decodes alone), or, for a request alone, while
        speculation was measured slower than plain decoding here (SpeculationGuard). A request that asks for K > 0
        itself still speculates (unless it asks for one token)."""
        up = [d for d in self.drafts if d.up]
        if not up or params.num_speculative_tokens == 0 or params.beam_width > 1 or params.max_tokens <= 1:
            return None
        busy = 0 < self.cfg.speculative_max_requests < self.in_flight
        if params.num_speculative_tokens is None and (busy or (self.in_flight == 1 and not self.guard.use_drafts())):
            return None
        return min(up, key=lambda d: d.in_flight)

    def _prompt_ids(self, inp: GenerationInput) -> list[int]:
        """The prompt's token ids: given, the chat rendered with the model's template, or the text encoded."""
        given = sum(map(bool, (inp.prompt, inp.messages, inp.prompt_ids)))
        if given != 1:
            raise InvalidRequest("the request has no prompt and no messages" if not given else
                                 "give one of prompt, messages or prompt token ids, not several")
        if inp.prompt_ids:
            vocab = self.info.vocab_size
            if not all(isinstance(t, int) and 0 <= t < vocab for t in inp.prompt_ids):
                raise InvalidRequest(f"prompt token ids must be integers in [0, {vocab})")
            return list(inp.prompt_ids)
        for m in inp.messages:
            if not isinstance(m.get("content"), str) and not (m.get("content") is None and m.get("tool_calls")):
                raise InvalidRequest("every message needs a string content (or tool_calls, for the assistant)")
        chars = len(inp.prompt) + sum(len(m["content"] or "") + len(str(m.get("tool_calls") or ""))
                                      for m in inp.messages) + len(str(inp.tools or ""))
        most = self.cfg.max_prompt_chars or 32 * self.info.max_model_len
        if chars > most:
            raise InvalidRequest(f"the prompt has {chars} characters; this server accepts at most {most} "
                                 f"(its context window is {self.info.max_model_len} tokens)")
        ids = (self.tok.apply_chat_template(inp.messages, inp.tools, inp.template_kwargs) if inp.messages
               else self.tok.encode(inp.prompt))
        if inp.messages and self.cfg.reasoning_parser:
            inp.thinking_open = opens_thinking(self.tok.decode(ids[-8:], skip_special_tokens=False))
        if not ids:
            raise InvalidRequest("the prompt is empty after tokenisation")
        return ids

    def prepare(self, inp: GenerationInput, caller: Caller) -> tuple[list[int], SamplingParams]:
        """Validates and tokenises within the caller's limits; raises InvalidRequest with a message a person can
        act on."""
        if inp.max_tokens is not None and inp.max_tokens < 1:
            raise InvalidRequest(f"max_tokens must be at least 1, got {inp.max_tokens}")
        n = 1 if inp.n is None else inp.n
        if not 1 <= n <= self.cfg.max_n:
            raise InvalidRequest(f"n must be between 1 and {self.cfg.max_n}, got {n}")
        if inp.beam_width is not None and inp.beam_width > self.cfg.max_n:
            raise InvalidRequest(f"beam_width must be at most {self.cfg.max_n}, got {inp.beam_width}")
        if len(inp.cache_salt) > 256:
            raise InvalidRequest("cache_salt is longer than 256 characters")
        if len(inp.stop) > self.cfg.max_stop_strings:
            raise InvalidRequest(f"at most {self.cfg.max_stop_strings} stop strings, got {len(inp.stop)}")
        ids = self._prompt_ids(inp)
        limit = self.info.max_model_len
        if len(ids) >= limit:
            raise InvalidRequest(f"the prompt has {len(ids)} tokens but the model's context window is {limit} "
                                 f"tokens (prompt plus output); shorten it by at least {len(ids) - limit + 1} tokens")
        caller.check(len(ids), inp.max_tokens, max(n, inp.beam_width or 0))   # beams cost as choices do
        room = limit - len(ids)
        if inp.max_tokens is None:                   # the least of the room left, the caller's cap and the default
            max_tokens = min(x for x in (room, caller.limits.max_tokens, self.cfg.default_max_tokens) if x)
        else:
            max_tokens = inp.max_tokens
        if max_tokens > room:
            raise InvalidRequest(f"max_tokens {max_tokens} plus the prompt's {len(ids)} tokens exceed the context "
                                 f"window of {limit}; ask for at most {room}")
        params = SamplingParams(temperature=1.0 if inp.temperature is None else inp.temperature,
                                top_p=1.0 if inp.top_p is None else inp.top_p,
                                top_k=inp.top_k or 0, seed=inp.seed, max_tokens=max_tokens,
                                ignore_eos=inp.ignore_eos, n=n, cache_salt=inp.cache_salt,
                                beam_width=inp.beam_width or 0, num_speculative_tokens=inp.num_speculative_tokens,
                                presence_penalty=inp.presence_penalty or 0.0,
                                frequency_penalty=inp.frequency_penalty or 0.0,
                                repetition_penalty=1.0 if inp.repetition_penalty is None else inp.repetition_penalty,
                                min_p=inp.min_p or 0.0, logit_bias=dict(inp.logit_bias),
                                min_tokens=inp.min_tokens or 0, stop_token_ids=list(inp.stop_token_ids),
                                bad_words=self._bad_words(inp.bad_words),
                                logprobs=inp.logprobs, guide_kind=inp.guide_kind, guide=inp.guide,
                                prompt_logprobs=inp.prompt_logprobs, tenant=caller.name)
        vocab = self.info.vocab_size
        for name, toks in (("logit_bias", params.logit_bias), ("stop_token_ids", params.stop_token_ids)):
            if toks and max(toks) >= vocab:           # below 0: refused by SamplingParams
                raise InvalidRequest(f"{name} names token {max(toks)}, outside the vocabulary [0, {vocab})")
        return ids, params

    def _bad_words(self, words: list[str]) -> list[list[int]]:
        """vLLM's reading of bad_words: each word's tokens as written at the start of a text and, where a leading
        space makes other tokens of the same count (a word of its own mid-sentence), those too."""
        if len(words) > 128 or any(not w.strip() or len(w) > 200 for w in words):
            raise InvalidRequest("bad_words takes at most 128 non-empty words of at most 200 characters")
        out: list[list[int]] = []
        for w in words:
            bare = self.tok.encode(w.lstrip())
            spaced = self.tok.encode(" " + w.lstrip())
            out.append(bare)
            if len(spaced) == len(bare) and spaced[0] != bare[0]:
                out.append(spaced)
        return out

    async def stream(self, inp: GenerationInput, timeout: float | None = None,
                     caller: Caller | None = None) -> AsyncIterator[StreamChunk]:
        """Yields each step's new text per choice; the last chunk has done=True and the usage.
        caller: from `self.keys.authenticate` (None: the anonymous caller, for servers without keys)."""
        if self.draining:
            raise Draining("the router is shutting down; retry on another replica")
        caller = caller or self.keys.authenticate(None)
        budget = self.cfg.request_timeout_s if timeout is None else min(timeout, self.cfg.request_timeout_s)
        deadline = time.monotonic() + budget                 # one deadline for the request, whatever the retries
        if self.in_flight >= self.cfg.max_concurrent_requests:
            raise Overloaded(f"{self.in_flight} requests in flight (limit {self.cfg.max_concurrent_requests}); "
                             "retry later")
        self.in_flight += 1                 # counted before tokenising: a burst cannot all pass the check above
        metrics.IN_FLIGHT.inc()
        try:
            # Tokenising a long prompt takes milliseconds: off the event loop, which serves every other stream.
            ids, params = await asyncio.to_thread(self.prepare, inp, caller)
            params.cache_salt = caller.cache_salt(inp.cache_salt)
            hide_cached = not params.cache_salt and not self.cfg.anonymous_cached_tokens   # the shared partition
            if not params.cache_salt and self.cfg.anonymous_prefix_cache == "private":
                params.cache_salt = "anonymous\x00" + secrets.token_hex(16)      # this request's own partition
            with caller.admitted():
                caller.check_rate(len(ids))                  # after the concurrency slot: a refusal costs no rate
                out = 0
                try:
                    async with contextlib.aclosing(self._stream(ids, params, inp, deadline)) as chunks:  # closing
                        async for chunk in chunks:                                  # it cancels the target's work
                            out = chunk.completion_tokens
                            if hide_cached:
                                chunk.cached_tokens = 0              # it would count others' prefixes
                            yield chunk
                finally:
                    caller.count_tokens(out)
        finally:
            self.in_flight -= 1
            metrics.IN_FLIGHT.dec()

    async def _stream(self, ids: list[int], params: SamplingParams, inp: GenerationInput,
                      deadline: float) -> AsyncIterator[StreamChunk]:
        """Runs the request on a replica; one that is unavailable before anything reached the client (killed,
        restarting, draining) is marked down and the next is tried, so a lost replica costs only the requests
        that were running on it."""
        metrics.PROMPT_TOKENS.inc(len(ids))
        tried: list[TargetClient] = []
        while True:
            target = await self.choose_target(ids, params.cache_salt, tried)
            if not tried:                                 # P/D: the prompt's KV first (for the chosen target)
                await self._prefill(ids, params, deadline, target)
            tried.append(target)
            answered = False
            left = max(0.001, deadline - time.monotonic())
            try:
                async with contextlib.aclosing(self._on_target(target, ids, params, inp, left)) as chunks:
                    async for chunk in chunks:
                        answered = True
                        yield chunk
                return
            except PeerUnavailable as e:
                if answered or len(tried) == len(self.targets):
                    raise
                log.warning("%s; trying another replica", e)

    async def _prefill(self, ids: list[int], params: SamplingParams, deadline: float, decode: TargetClient) -> None:
        """P/D disaggregation: the prompt's KV is computed on the least busy prefill target. With --kv-transfer
        store it writes the full blocks to the shared KV store before it answers, and the decode target reads them
        there on its prefix-cache miss; with direct it sends them to the decode target's host tier (PutBlocks)
        before it answers. Skipped for prompts under one block. A prefill target that fails costs nothing but
        time: the decode target computes what it did not get."""
        up = [t for t in self.prefill if t.up]
        if not up or len(ids) <= self.info.block_size:
            return
        target = min(up, key=lambda t: self.load[t.address])
        self.load[target.address] += 1
        once = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, cache_salt=params.cache_salt,
                              num_speculative_tokens=0)
        destination = decode.address if self.cfg.kv_transfer == "direct" else ""
        try:
            left = max(0.001, deadline - time.monotonic())
            async with contextlib.aclosing(target.generate(uuid.uuid4().hex, ids, once, left,
                                                           kv_destination=destination)) as steps:
                async for _ in steps:
                    pass
        except Exception as e:                 # best effort: whatever failed, the decode target computes the prompt
            log.warning("prefill on %s failed (%s); the decode target computes the prompt", target.address, e)
        finally:
            self.load[target.address] -= 1

    async def _on_target(self, target: TargetClient, ids: list[int], params: SamplingParams,
                         inp: GenerationInput, timeout: float | None) -> AsyncIterator[StreamChunk]:
        self.load[target.address] += 1
        request_id = uuid.uuid4().hex
        choices = [ChoiceText(self.tok, inp.stop, ids, include_stop=inp.include_stop_str_in_output,
                              skip_special=inp.skip_special_tokens) for _ in range(params.n)]
        t0 = last = time.perf_counter()
        first = None                                     # when the first token arrived
        cached = 0
        spec: dict[int, tuple[int, int]] = {}
        alone = self.in_flight == 1 and params.n == 1 and params.beam_width <= 1
        draft = self.choose_draft(params)
        steps = (target.generate(request_id, ids, params, timeout) if draft is None else
                 draft.generate(target, request_id, ids, params, timeout))
        try:
            async with contextlib.aclosing(steps):
                async for step in steps:
                    cached = max(cached, step.cached_tokens)
                    spec.update(step.spec)
                    out, stopped = [], []
                    for index, tokens, reason, lps, prompt in step.deltas:
                        d = choices[index].push(tokens, reason)
                        if d.stop_string_hit:
                            stopped.append(index)
                        if d.text or d.token_ids or d.finish_reason:
                            out.append(ChoiceDelta(index, d.text, d.token_ids, d.finish_reason, lps,
                                                   None if prompt is None else (ids, prompt)))
                    if stopped:
                        await target.abort(request_id, stopped)
                    now = time.perf_counter()
                    ntok = sum(len(c.token_ids) for c in out)
                    if ntok:
                        (metrics.TTFT if last == t0 else metrics.TPOT).observe(now - last)
                        metrics.GENERATED_TOKENS.inc(ntok)
                        last = now
                        first = now if first is None else first
                    done = all(c.finish_reason is not None for c in choices)
                    if done and alone and first is not None and self.in_flight == 1:   # alone throughout: a sample
                        self.guard.record(draft is not None, len(choices[0].token_ids) - 1, last - first,
                                          own_choice=params.num_speculative_tokens is not None,
                                          asked_plain=params.num_speculative_tokens == 0)
                    if out or done:
                        yield StreamChunk(out, len(ids), sum(len(c.token_ids) for c in choices), cached, done,
                                          sum(d for d, _ in spec.values()), sum(a for _, a in spec.values()))
                    if done:
                        return
                raise PeerUnavailable(f"the target {target.address} ended the stream before the answer was done")
        finally:
            self.load[target.address] -= 1
