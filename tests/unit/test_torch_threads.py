"""Every torch operation of a service on one thread: the target's engine is built on its engine thread
(shared/engine/async_engine.py says why); the draft service builds and runs its proposer on its event loop's."""
from __future__ import annotations

import asyncio
import threading

import pytest

from shared.engine.async_engine import AsyncEngine
from shared.engine.config import EngineConfig
from shared.engine.engine import LLMEngine
from shared.sampling_params import SamplingParams


def test_async_engine_builds_its_engine_on_the_thread_that_steps_it(tiny_llama_dir):
    threads: dict[str, int] = {}

    def build() -> LLMEngine:
        threads["built"] = threading.get_ident()
        return LLMEngine(EngineConfig(model=tiny_llama_dir, progress=False, kv_cache_gb=0.01))

    def on_step(engine: LLMEngine) -> None:
        threads["stepped"] = threading.get_ident()

    eng = AsyncEngine(build, on_step=on_step)
    try:
        async def run() -> list[int]:
            out = []
            async for d in eng.generate("r", [1, 2, 3], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)):
                out += d.token_ids
            return out
        tokens = asyncio.run(run())
        assert len(tokens) == 4
        assert threads["built"] == threads["stepped"] != threading.get_ident()
    finally:
        eng.stop()


def test_a_failing_factory_raises_to_the_caller():
    def build() -> LLMEngine:
        raise ValueError("no such model")

    with pytest.raises(ValueError, match="no such model"):
        AsyncEngine(build)
