"""Prefix caching, forks and copy-on-write never change outputs, and no block leaks."""
from __future__ import annotations

import pytest
import torch

from shared.engine.config import EngineConfig
from shared.engine.engine import LLMEngine
from shared.sampling_params import SamplingParams
from shared.testing.tiny_llama import save_tiny


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    save_tiny(path, None)
    return str(path)


def engine(path: str, caching: bool = True, blocks: int = 128) -> LLMEngine:
    return LLMEngine(EngineConfig(model=path, progress=False, num_kv_blocks=blocks, block_size=4,
                                  enable_prefix_caching=caching, max_num_batched_tokens=32))


def prompts(n: int, shared: int = 18) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    head = torch.randint(1, 90, (shared,), generator=g).tolist()     # a common "system prompt"
    return [head + torch.randint(1, 90, (3 + i,), generator=g).tolist() for i in range(n)]


def test_cache_hits_do_not_change_greedy_outputs(tiny):
    ps = prompts(6)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    off = engine(tiny, caching=False)
    expect = [off.generate([p], params)[0][0] for p in ps]
    on = engine(tiny)
    got = [on.generate([p], params)[0][0] for p in ps] + [o[0] for o in on.generate(ps, params)]
    assert got == expect + expect
    assert on.block_manager.hit_tokens >= 16 * 11                    # every prompt after the first hit the head
    assert on.block_manager.num_used_blocks == 0


def test_n_choices_equal_single_requests_with_seed_plus_i(tiny):
    p = prompts(1)[0]
    eng = engine(tiny)
    four = eng.generate([p], SamplingParams(temperature=3.0, seed=11, n=4, max_tokens=16, ignore_eos=True))[0]
    stored_after_n = len(eng.block_manager.cached)
    prompt_blocks = len(p) // 4
    # the prompt was prefilled once: each of its full blocks is in the cache once, plus the choices' own blocks
    assert stored_after_n <= prompt_blocks + 4 * ((len(p) + 16) // 4 - prompt_blocks)
    singles = [eng.generate([p], SamplingParams(temperature=3.0, seed=11 + i, max_tokens=16, ignore_eos=True))[0][0]
               for i in range(4)]
    assert four == singles
    assert len({tuple(c) for c in four}) > 1
    assert eng.block_manager.num_used_blocks == 0


def test_prompt_is_computed_once_for_n_choices(tiny):
    p = prompts(1)[0]
    eng = engine(tiny, caching=False)                 # no cache: sharing can only come from forks
    computed = []
    run = eng.runner.run
    eng.runner.run = lambda batch: (computed.append(sum(batch.num_tokens)), run(batch))[1]
    eng.generate([p], SamplingParams(temperature=1.0, seed=1, n=4, max_tokens=4, ignore_eos=True))
    assert computed[0] == len(p)                      # one prefill, not four
    assert computed[1:] == [4, 4, 4]                  # then one token per choice per step
    assert eng.block_manager.num_used_blocks == 0


def test_abort_and_preemption_leak_nothing(tiny):
    eng = engine(tiny, blocks=24)
    ps = prompts(5)
    for i, p in enumerate(ps):
        eng.add_request(f"r{i}", p, SamplingParams(temperature=0.8, seed=i, n=2, max_tokens=30, ignore_eos=True))
    for step in range(12):
        eng.step()
        if step == 3:
            eng.abort("r1")
            eng.abort("r2", [1])
            eng.abort("r3", [0])
    while eng.has_unfinished():
        eng.step()
    assert eng.scheduler.num_preemptions > 0
    assert eng.block_manager.num_used_blocks == 0 and not eng.requests and not eng.pending_forks
    assert min(eng.block_manager.ref_counts) == 0
