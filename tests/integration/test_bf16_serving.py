"""bf16 serving, the services' default on CPUs with native bf16 matmuls: how "auto" resolves, the bf16 engine
against transformers' fp32 reference, and the eagle draft stack running in bf16 end to end."""
from __future__ import annotations

import grpc
import pytest
import torch

from services.draft.config import DraftConfig
from services.launcher import ServeConfig
from services.target.config import TargetConfig
from shared.engine.config import EngineConfig, serving_dtype
from shared.engine.engine import LLMEngine
from shared.ops.cpu_features import cpu_has_native_bf16
from tests.conftest import CHAT_PROMPTS, ROOT, Stack
from upesi.v1 import generation_pb2 as pb
from upesi.v1 import generation_pb2_grpc

HEAD = ROOT / "models" / "eagle-smollm2-135m"


def test_auto_dtype_follows_the_hardware_and_bad_names_are_refused():
    cpu = torch.device("cpu")
    assert serving_dtype("auto", cpu) == ("bfloat16" if cpu_has_native_bf16() else "float32")
    assert serving_dtype("auto", torch.device("cuda")) == "bfloat16"
    assert serving_dtype("float32", cpu) == "float32"
    assert TargetConfig(dtype="auto", device="cpu").engine_config().dtype == serving_dtype("auto", cpu)
    for make in (lambda: serving_dtype("int8", cpu), lambda: TargetConfig(dtype="fp8"),
                 lambda: DraftConfig(dtype="half"), lambda: ServeConfig(dtype="bf16")):
        with pytest.raises(ValueError, match="dtype must be one of"):
            make()


def test_bf16_engine_predicts_what_the_fp32_reference_generates(chat_prompt_ids, hf_greedy):
    """Teacher-forced on transformers' fp32 greedy continuations, the bf16 engine's argmax agrees almost everywhere
    (bf16 rounding flips only near-ties)."""
    eng = LLMEngine(EngineConfig(dtype="bfloat16", progress=False, kv_cache_gb=0.1))
    agree = total = 0
    for prompt, cont in zip(chat_prompt_ids, hf_greedy):
        logits = eng.score(prompt + cont)                                    # [T, V]
        pred = logits[len(prompt) - 1:-1].argmax(-1).tolist()
        agree += sum(p == t for p, t in zip(pred, cont))
        total += len(cont)
    assert agree / total >= 0.9, f"bf16 top-1 agrees on {agree} of {total} reference tokens"


@pytest.mark.slow
def test_eagle_draft_stack_runs_in_bf16(tmp_path):
    """router -> draft (eagle head, bf16) -> Verify stream -> target (bf16): drafts are proposed and accepted."""
    stack = Stack(tmp_path, ["--dtype", "bfloat16", "--draft", f"eagle:{HEAD}", "--num-speculative-tokens", "4",
                             "--draft-metrics-port", "0", "--target-metrics-port", "0"])
    try:
        stack.wait_ready()
        with grpc.insecure_channel(stack.address) as ch:
            stub = generation_pb2_grpc.GenerationStub(ch)
            r = stub.Generate(pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content=CHAT_PROMPTS[3])],
                                                 max_tokens=48, temperature=0, ignore_eos=True), timeout=300)
        assert r.usage.completion_tokens == 48 and len(r.choices[0].text) > 40
        assert r.spec.draft_tokens > 0 and r.spec.accepted_tokens > 0
        assert "(bfloat16)" in stack.log.read_text()
    finally:
        assert stack.stop() == 0
