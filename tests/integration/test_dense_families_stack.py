"""Llama 3 (its RoPE scaling), Qwen2, Qwen3, Mistral and Phi-3 (16-token sliding windows, which the prompts and
their answers outgrow), Gemma 2 and Gemma 3 (a multimodal checkpoint, served for its text) through the running
stack (`upesi serve`: router, target, real gRPC): greedy tokens of a tiny checkpoint equal transformers'
`generate` on it, plainly and with n-gram speculation in the target."""
from __future__ import annotations

import pytest

from shared.testing.moe_checkpoints import hf_greedy, save_tokenizer, stack_greedy
from tests.conftest import Stack
from shared.testing.dense_checkpoints import MAKERS, PROMPTS, make_mistral, save_dense

pytestmark = pytest.mark.slow
TOKENS = 24


@pytest.mark.parametrize("family", ["llama3", "qwen2", "qwen3", "mistral", "phi3", "gemma2", "gemma3_multimodal"])
def test_greedy_through_the_stack_equals_transformers(tmp_path, family):
    model = tmp_path / "model"
    ref = save_dense(MAKERS.get(family) or (lambda: make_mistral(16)), model)
    save_tokenizer(model)                                # "t5 t17" is the prompt [5, 17]
    want = hf_greedy(ref, PROMPTS, TOKENS)
    stack = Stack(tmp_path, ["--model", str(model), "--speculative", "ngram", "--num-threads", "1"])
    try:
        stack.wait_ready()
        for k in (0, 3):                                 # plain, then n-gram drafts verified by the target
            assert stack_greedy(stack.address, PROMPTS, TOKENS, k) == want, f"num_speculative_tokens={k}"
    finally:
        assert stack.stop() == 0, stack.log.read_text()[-3000:]
