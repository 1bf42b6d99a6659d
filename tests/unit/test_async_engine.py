"""AsyncEngine: a caller that goes away before the engine admits its request leaves nothing running."""
from __future__ import annotations

import asyncio
import time

import pytest

from shared.engine.async_engine import AsyncEngine
from shared.engine.config import EngineConfig
from shared.engine.engine import LLMEngine
from shared.errors import InvalidRequest
from shared.sampling_params import SamplingParams


def test_cancelled_before_admission_is_aborted(tiny_llama_dir):
    eng = AsyncEngine(lambda: LLMEngine(EngineConfig(model=tiny_llama_dir, progress=False, kv_cache_gb=0.01,
                                                     max_model_len=256)))
    try:
        async def leave_early() -> None:
            stream = eng.generate("r", [1, 2, 3], SamplingParams(temperature=0, max_tokens=250, ignore_eos=True))
            task = asyncio.ensure_future(stream.__anext__())
            await asyncio.sleep(0)                     # the request is queued for the engine thread, not admitted
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        asyncio.run(leave_early())
        deadline = time.monotonic() + 60               # the engine thread handles the add, then the abort
        while eng.engine.requests or eng.engine.has_unfinished():
            assert time.monotonic() < deadline, "the abandoned request is still running"
            time.sleep(0.01)
        assert eng.engine.block_manager.num_used_blocks == 0
    finally:
        eng.stop()


def test_a_refused_request_raises_and_aborts_nothing(tiny_llama_dir):
    eng = AsyncEngine(lambda: LLMEngine(EngineConfig(model=tiny_llama_dir, progress=False, kv_cache_gb=0.01,
                                                     max_model_len=256)))
    try:
        async def refused() -> None:
            with pytest.raises(InvalidRequest, match="prompt token ids"):
                async for _ in eng.generate("r", [10**6], SamplingParams(max_tokens=2)):
                    pass
        asyncio.run(refused())
        assert eng._inbox.empty()
    finally:
        eng.stop()


def test_a_full_waiting_queue_refuses_new_requests_until_it_drains(tiny_llama_dir):
    """Serving applies backpressure (Overloaded: RESOURCE_EXHAUSTED at the edge) once max_waiting_seqs sequences
    wait for a batch slot; the refused request leaves nothing behind and later ones are admitted again."""
    from shared.errors import Overloaded
    eng = AsyncEngine(lambda: LLMEngine(EngineConfig(model=tiny_llama_dir, progress=False, kv_cache_gb=0.01,
                                                     max_model_len=256, max_num_seqs=1, max_waiting_seqs=2)))
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

    async def run() -> list:
        streams = [eng.generate(r, [1, 2, 3], params) for r in ("a", "b", "c", "d")]
        firsts = await asyncio.gather(*(s.__anext__() for s in streams), return_exceptions=True)
        for s in streams:
            await s.aclose()
        return firsts
    try:
        firsts = asyncio.run(run())
        refused = [f for f in firsts if isinstance(f, Overloaded)]
        assert refused and all("max_waiting_seqs" in str(f) for f in refused)
        assert len(refused) < len(firsts)                       # the first requests were served
        deadline = time.monotonic() + 60
        while eng.engine.requests or eng.engine.has_unfinished():
            assert time.monotonic() < deadline, "closed streams left requests running"
            time.sleep(0.01)
        assert eng.engine.block_manager.num_used_blocks == 0
    finally:
        eng.stop()


def test_stream_interval_merges_a_requests_tokens_and_keeps_them(tiny_llama_dir):
    """stream_interval=3: the first token at once, then a message per 3 steps, the end at once; the same tokens
    as every step's delivery. Auto: every step while few sequences run, one per running // 8 steps beyond."""
    from shared.engine.async_engine import auto_interval
    params = SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)
    two = SamplingParams(temperature=0.8, seed=3, max_tokens=9, ignore_eos=True, n=2)

    def deliveries(interval: int, p: SamplingParams) -> list:
        eng = AsyncEngine(lambda: LLMEngine(EngineConfig(model=tiny_llama_dir, progress=False, kv_cache_gb=0.01,
                                                         max_model_len=256)), stream_interval=interval)

        async def run() -> list:
            return [(d.index, d.token_ids, d.finish_reason) async for d in eng.generate("r", [1, 2, 3], p)]
        try:
            return asyncio.run(run())
        finally:
            eng.stop()
    every, merged, auto = deliveries(1, params), deliveries(3, params), deliveries(0, params)
    assert [len(t) for _, t, _ in every] == [1] * 9 and auto == every
    assert [len(t) for _, t, _ in merged] == [1, 3, 3, 2]
    assert sum((t for _, t, _ in merged), []) == sum((t for _, t, _ in every), [])
    assert [r for _, _, r in merged] == [None, None, None, "length"]
    for interval in (1, 3):                                   # two choices: each merged on its own
        got = deliveries(interval, two)
        for i in (0, 1):
            mine = [(t, r) for j, t, r in got if j == i]
            assert sum(len(t) for t, _ in mine) == 9 and mine[-1][1] == "length"
            if interval == 3:
                assert [len(t) for t, _ in mine] == [1, 3, 3, 2]
    assert [auto_interval(n) for n in (1, 7, 8, 15, 16, 32, 64)] == [1, 1, 1, 1, 2, 4, 8]
    with pytest.raises(ValueError, match="stream_interval"):
        AsyncEngine(lambda: None, stream_interval=-1)


def test_a_relayed_request_in_a_batch_too_big_to_speculate_is_delivered_every_few_steps(tiny_llama_dir):
    """A request a draft service relays, joining others above speculative_max_seqs: its first token at once, then a
    message per RELAY_INTERVAL steps, the same tokens; the other requests and a relayed request alone every step."""
    from shared.engine.async_engine import RELAY_INTERVAL
    params = SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)      # outlive the relayed request

    def lengths(others: int) -> tuple[list[int], list[int], list[list[int]]]:
        eng = AsyncEngine(lambda: LLMEngine(EngineConfig(model=tiny_llama_dir, progress=False, kv_cache_gb=0.01,
                                                         max_model_len=256, speculative_max_seqs=1)))

        async def run() -> list:
            started = [asyncio.Event() for _ in range(others)]

            async def other(i: int) -> list[int]:
                out = []
                async for d in eng.generate(f"o{i}", [1, 2, 3], long):
                    out.append(len(d.token_ids))
                    started[i].set()
                return out

            async def relayed() -> list[list[int]]:
                for e in started:                                # the others are running first
                    await e.wait()
                return [d.token_ids async for d in eng.generate("relayed", [1, 2, 3], params, relayed=True)]
            return await asyncio.gather(relayed(), *(other(i) for i in range(others)))
        try:
            got, *rest = asyncio.run(run())
        finally:
            eng.stop()
        return [len(t) for t in got], sum(got, []), rest
    alone, alone_tokens, _ = lengths(0)
    busy, busy_tokens, rest = lengths(3)
    assert alone == [1] * 9
    assert RELAY_INTERVAL == 4 and busy == [1, 4, 4]
    assert busy_tokens == alone_tokens                           # the same tokens, merged
    assert rest == [[1] * 200] * 3
