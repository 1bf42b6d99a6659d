"""The engine's interface to the services that run it: counters after each step and the block events for the
prefix registry, checked against what the requests did."""
from __future__ import annotations

from shared.engine.config import EngineConfig
from shared.engine.engine import LLMEngine
from shared.sampling_params import SamplingParams


def test_counters_and_block_events_follow_the_requests(tiny_llama_dir):
    eng = LLMEngine(EngineConfig(model=tiny_llama_dir, progress=False, num_kv_blocks=64, block_size=16,
                                 max_model_len=256))
    c = eng.counters()
    assert (c.kv_blocks_total, c.kv_blocks_used, c.running, c.waiting, c.prefix_query_tokens) == (64, 0, 0, 0, 0)
    prompt = list(range(1, 41))                                   # 2 full blocks and a partial one
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    eng.add_request("a", prompt, params)
    assert eng.counters().waiting == 1
    eng.step()
    c = eng.counters()
    assert (c.running, c.waiting, c.kv_blocks_used) == (1, 0, 3) and c.last_step_s > 0
    while eng.has_unfinished():
        eng.step()
    stored, removed = eng.drain_block_events()
    assert len(stored) == 2 and removed == []                      # 43 tokens: two full blocks committed
    assert eng.drain_block_events() == ([], [])                    # drained once
    eng.add_request("b", prompt, params)                           # the same prompt: its two blocks are hits
    while eng.has_unfinished():
        eng.step()
    c = eng.counters()
    assert c.prefix_query_tokens >= 80 and c.prefix_hit_tokens == 32 and c.kv_blocks_used == 0
