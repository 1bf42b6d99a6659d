"""Shared fixtures: the default model, the in-process engine, transformers' reference and a running stack."""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# Services started by tests compute in fp32, whose outputs are checked against fp32 references; the services'
# own default ("auto") is bf16 on CPUs with native bf16, tested on its own in tests/integration/test_bf16_serving.py.
os.environ.setdefault("UPESI_DTYPE", "float32")

from shared.testing.stack import INTERNAL, INTERNAL_TOKEN, ROOT, Stack  # noqa: E402,F401 (for tests)
from shared.testing.stack import free_port, free_port_run  # noqa: E402,F401

CHAT_PROMPTS = [
    "Write a short story about a robot learning to paint.",
    "Explain how a hash table works.",
    "List five tips for staying healthy.",
    "What is photosynthesis?",
]
GREEDY_TOKENS = 48


@pytest.fixture(scope="session")
def model_path() -> str:
    from shared.model_files import default_model_path
    return default_model_path()


@pytest.fixture(scope="session")
def hf_tokenizer(model_path):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(os.path.dirname(model_path), gguf_file=os.path.basename(model_path))


@pytest.fixture(scope="session")
def hf_model(model_path):
    import torch
    from transformers import AutoModelForCausalLM
    m = AutoModelForCausalLM.from_pretrained(os.path.dirname(model_path), gguf_file=os.path.basename(model_path),
                                             dtype=torch.float32)
    return m.eval()


@pytest.fixture(scope="session")
def chat_prompt_ids(hf_tokenizer) -> list[list[int]]:
    out = []
    for p in CHAT_PROMPTS:
        x = hf_tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                             tokenize=True)
        out.append(list(x["input_ids"] if hasattr(x, "keys") else x))
    return out


@pytest.fixture(scope="session")
def hf_greedy(hf_model, chat_prompt_ids) -> list[list[int]]:
    """transformers' greedy continuations (48 new tokens, up to and including EOS) of the 4 chat prompts."""
    import torch
    eos = hf_model.generation_config.eos_token_id
    out = []
    for ids in chat_prompt_ids:
        with torch.inference_mode():
            g = hf_model.generate(torch.tensor([ids]), max_new_tokens=GREEDY_TOKENS, do_sample=False,
                                  temperature=None, top_p=None, top_k=None, pad_token_id=eos)
        out.append(g[0, len(ids):].tolist())
    return out


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> str:
    """A 2-layer Llama checkpoint (shared.testing.tiny_llama's), saved once per test run."""
    from shared.testing.tiny_llama import save_tiny
    path = tmp_path_factory.mktemp("tiny-llama")
    save_tiny(path, None)
    return str(path)


@pytest.fixture(scope="session")
def engine():
    from shared.engine.config import EngineConfig
    from shared.engine.engine import LLMEngine
    return LLMEngine(EngineConfig(progress=False, kv_cache_gb=0.25))


@pytest.fixture(scope="session")
def stack(tmp_path_factory):
    s = Stack(tmp_path_factory.mktemp("stack"))
    try:
        s.wait_ready()
        yield s
    finally:
        code = s.stop()
        assert code == 0, f"upesi serve exited with {code}:\n{s.log.read_text()[-3000:]}"


@pytest.fixture(scope="session")
def spec_stack(tmp_path_factory):
    """`upesi serve` in fp32 with a draft service proposing n-gram drafts (K = 4) and the <think> reasoning parser
    on: the OpenAI-surface tests."""
    s = Stack(tmp_path_factory.mktemp("spec-stack"), ["--dtype", "float32", "--draft", "ngram",
                                                      "--num-speculative-tokens", "4", "--draft-metrics-port", "0",
                                                      "--reasoning-parser", "think"])
    try:
        s.wait_ready()
        yield s
    finally:
        assert s.stop() == 0, s.log.read_text()[-3000:]


@pytest.fixture(scope="session")
def oai(spec_stack):
    """The official openai client on spec_stack."""
    openai = pytest.importorskip("openai", reason="the openai client is a test dependency: pip install openai")
    return openai.OpenAI(base_url=f"http://127.0.0.1:{spec_stack.http_port}/v1", api_key="x", max_retries=0,
                         timeout=300)


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir) -> str:
    """The tiny random Llama (tiny_llama_dir), as the speculative tests name it."""
    return tiny_llama_dir


@pytest.fixture(scope="module")
def tiny_eagle(tiny) -> str:
    """A random EAGLE head for the tiny target (reduced vocab of 48 of its 96 tokens)."""
    from shared.testing.tiny_llama import save_tiny_eagle
    return save_tiny_eagle(tiny, f"{tiny}/eagle")
