"""An EAGLE head in a draft service: the draft drives a Verify stream to a real target process, which sends the
hidden states of accepted positions with each verdict (raw float32 bytes over real gRPC); the drafts (chains, or
draft trees with their parent indices), acceptances and tokens are exactly those of the same head inside the
target's engine. A request with a penalty or with logprobs, whose drafts the target verifies only as chains, gets
chains from a head that drafts trees, in the service as in the target."""
from __future__ import annotations

import signal

import grpc
import pytest
import torch

from shared.engine.config import EngineConfig
from shared.sampling_params import SamplingParams
from shared.spec.factory import build_engine
from tests.conftest import free_port
from shared.testing.stack import spawn, wait_healthy
from shared.testing.tiny_llama import PROMPTS
from shared.testing.tiny_llama import save_tiny
from upesi.v1 import draft_pb2, draft_pb2_grpc, target_pb2

pytestmark = pytest.mark.slow
K, TOKENS = 3, 24


@pytest.fixture(scope="module")
def tiny_with_head(tmp_path_factory):
    from shared.model.loader import load_config
    from shared.spec.eagle import EagleHead, head_config_for
    path = tmp_path_factory.mktemp("tiny-eagle")
    save_tiny(path, None)
    torch.manual_seed(1)
    head = EagleHead(head_config_for(load_config(str(path)), 64))
    head.id_map = torch.randperm(96)[:64].sort().values
    head.save(str(path / "eagle"))
    return str(path), str(path / "eagle")


def in_process(tiny: str, head: str | None, tree: int = 0, penalty: float = 0.0, logprobs: int | None = None
               ) -> list[tuple[list[int], int, int]]:
    """Per prompt, one at a time: (tokens, drafted, accepted)."""
    kw = dict(model=tiny, progress=False, num_kv_blocks=128, block_size=4, num_speculative_tokens=K,
              draft_tree_nodes=tree, draft_confidence=0.0, draft_tree_ngram=0)        # as in the service
    eng = build_engine(EngineConfig(speculative=f"eagle:{head}" if head else None, **kw))
    out = []
    for p in PROMPTS:
        d0, a0 = eng.stats_draft, eng.stats_accepted
        params = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True, presence_penalty=penalty,
                                logprobs=logprobs)
        toks = eng.generate([p], params)[0][0]
        out.append((toks, eng.stats_draft - d0, eng.stats_accepted - a0))
    return out


@pytest.mark.parametrize("tree,penalty,logprobs", [(0, 0.0, None), (5, 0.0, None), (5, 0.5, None), (5, 0.0, 0)])
def test_eagle_in_a_draft_service_equals_eagle_in_the_target(tiny_with_head, tmp_path, tree, penalty, logprobs):
    """Chains; trees of 5 nodes; chains from a head that drafts trees (a penalty; logprobs)."""
    tiny, head = tiny_with_head
    plain = [t for t, _, _ in in_process(tiny, None, penalty=penalty, logprobs=logprobs)]
    local = in_process(tiny, head, tree, penalty, logprobs)
    draft, target = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    log = open(tmp_path / "services.log", "w")
    procs = [spawn(["draft", "--address", draft, "--proposer", f"eagle:{head}", "--model", tiny, "--device", "cpu",
                    "--draft-tree-nodes", str(tree), "--draft-confidence", "0", "--draft-tree-ngram", "0"], log),
             spawn(["target", "--address", target, "--model", tiny, "--device", "cpu", "--num-kv-blocks", "128",
                    "--block-size", "4", "--num-speculative-tokens", str(K), "--metrics-port", "0",
                    "--progress", "false"], log)]
    remote = []
    try:
        wait_healthy(draft, 120)
        wait_healthy(target, 120)
        with grpc.insecure_channel(draft) as ch:
            stub = draft_pb2_grpc.DraftStub(ch)
            for i, p in enumerate(PROMPTS):
                req = target_pb2.TargetGenerateRequest(request_id=f"e{i}", prompt_token_ids=p, n=1,
                                                       sampling=target_pb2.SamplingParams(max_tokens=TOKENS, top_p=1,
                                                                                          ignore_eos=True,
                                                                                          presence_penalty=penalty,
                                                                                          logprobs=logprobs))
                toks, drafted, accepted = [], 0, 0
                for msg in stub.Generate(draft_pb2.DraftGenerateRequest(target=target, request=req), timeout=120):
                    for d in msg.deltas:
                        toks += list(d.token_ids)
                        drafted, accepted = d.draft_tokens, d.accepted_tokens
                remote.append((toks, drafted, accepted))
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            proc.wait(30)
    assert [t for t, _, _ in local] == plain and [t for t, _, _ in remote] == plain   # greedy: same tokens
    assert sum(d for _, d, _ in local) >= len(PROMPTS) * TOKENS // 4      # drafts on most steps
    assert remote == local              # same drafts and acceptances per request: the hidden states arrived
