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
