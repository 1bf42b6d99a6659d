"""An EAGLE head in a draft service: the target sends the hidden states of accepted positions with each Propose call
(raw float32 bytes over real gRPC), and the proposals are exactly those of the same head in-process."""
from __future__ import annotations

import signal

import pytest
import torch

from shared.engine.config import EngineConfig
from shared.engine.engine import LLMEngine
from shared.engine.sampling_params import SamplingParams
from tests.conftest import free_port
from tests.integration.test_speculative_stack import spawn, wait_healthy
from tests.parity.test_speculative import PROMPTS
from tests.parity.test_tiny_llama import save_tiny


@pytest.fixture(scope="module")
def tiny_with_head(tmp_path_factory):
    from shared.engine.eagle import EagleHead, head_config_for
    from shared.model.loader import load_config
    path = tmp_path_factory.mktemp("tiny-eagle")
    save_tiny(path, None)
    torch.manual_seed(1)
    head = EagleHead(head_config_for(load_config(str(path)), 64))
    head.id_map = torch.randperm(96)[:64].sort().values
    head.save(str(path / "eagle"))
    return str(path), str(path / "eagle")


def run(eng: LLMEngine, prompts, params) -> tuple[list[list[int]], int, int]:
    out = [o[0] for o in eng.generate(prompts, params)]
    return out, eng.stats_draft, eng.stats_accepted


def test_eagle_over_grpc_equals_eagle_in_process(tiny_with_head, tmp_path):
    from services.target.remote_proposer import RemoteProposer
    tiny, head = tiny_with_head
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    kw = dict(model=tiny, progress=False, num_kv_blocks=128, block_size=4, num_speculative_tokens=3)
    plain = [o[0] for o in LLMEngine(EngineConfig(**kw)).generate(PROMPTS, params)]
    local = run(LLMEngine(EngineConfig(speculative=f"eagle:{head}", **kw)), PROMPTS, params)
    address = f"127.0.0.1:{free_port()}"
    log = open(tmp_path / "draft.log", "w")
    proc = spawn(["draft", "--address", address, "--proposer", f"eagle:{head}", "--model", tiny, "--device", "cpu"],
                 log)
    try:
        wait_healthy(address, 120)
        eng = LLMEngine(EngineConfig(**kw))
        eng.proposer = RemoteProposer(address, timeout_s=60)
        remote = run(eng, PROMPTS, params)
        assert eng.proposer.wants_hidden and not eng.proposer.hidden
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    assert local[0] == plain and remote[0] == plain         # greedy: speculation never changes the tokens
    assert local[1] > 0 and remote[1:] == local[1:]          # same drafts and acceptances: the features arrived


def test_a_draft_that_reads_no_hidden_states_is_sent_none(tiny_with_head, tmp_path):
    from services.target.remote_proposer import RemoteProposer
    tiny, _ = tiny_with_head
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    kw = dict(model=tiny, progress=False, num_kv_blocks=128, block_size=4, num_speculative_tokens=3)
    address = f"127.0.0.1:{free_port()}"
    proc = spawn(["draft", "--address", address, "--proposer", "ngram"], open(tmp_path / "draft.log", "w"))
    try:
        wait_healthy(address, 120)
        eng = LLMEngine(EngineConfig(**kw))
        eng.proposer = RemoteProposer(address, timeout_s=60)
        out, drafted, _ = run(eng, PROMPTS, params)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    assert drafted > 0 and not eng.proposer.wants_hidden and not eng.proposer.hidden
    assert out == [o[0] for o in LLMEngine(EngineConfig(**kw)).generate(PROMPTS, params)]
