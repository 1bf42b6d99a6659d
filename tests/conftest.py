"""Shared fixtures: the default model, the in-process engine, transformers' reference and a running stack."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# Services started by tests compute in fp32, whose outputs are checked against fp32 references; the services'
# own default ("auto") is bf16 on CPUs with native bf16, tested on its own in tests/integration/test_bf16_serving.py.
os.environ.setdefault("UPESI_DTYPE", "float32")

ROOT = Path(__file__).resolve().parents[1]
CHAT_PROMPTS = [
    "Write a short story about a robot learning to paint.",
    "Explain how a hash table works.",
    "List five tips for staying healthy.",
    "What is photosynthesis?",
]
GREEDY_TOKENS = 48


_GIVEN: set[int] = set()


def free_port() -> int:
    """A port nothing listens on now, and never one this process gave out before: servers bind seconds later, and
    gRPC binds with SO_REUSEPORT, so two services handed the same port would share it silently."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _GIVEN:
            _GIVEN.add(port)
            return port


@pytest.fixture(scope="session")
def model_path() -> str:
    from shared.model.loader import default_model_path
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
    """A 2-layer Llama checkpoint (tests/parity/test_tiny_llama.py's), saved once per test run."""
    from tests.parity.test_tiny_llama import save_tiny
    path = tmp_path_factory.mktemp("tiny-llama")
    save_tiny(path, None)
    return str(path)


@pytest.fixture(scope="session")
def engine():
    from shared.engine.config import EngineConfig
    from shared.engine.engine import LLMEngine
    return LLMEngine(EngineConfig(progress=False, kv_cache_gb=0.25))


# The internal token of the stacks tests start (`upesi serve` keeps one it is given), for tests that call internal
# services directly or add a service to a running stack; `INTERNAL` is the metadata such calls carry.
INTERNAL_TOKEN = "upesi-tests-internal-token"
INTERNAL = [("x-upesi-internal-token", INTERNAL_TOKEN)]


class Stack:
    """`upesi serve` on free ports, as a user runs it."""

    def __init__(self, tmp: Path, extra: list[str] | None = None) -> None:
        self.grpc_port, self.http_port, self.metrics_port = free_port(), free_port(), free_port()
        self.address = f"127.0.0.1:{self.grpc_port}"
        self.log = tmp / "serve.log"
        cmd = [sys.executable, "-m", "services.cli", "serve", "--address", self.address,
               "--http-port", str(self.http_port), "--target-address", f"127.0.0.1:{free_port()}",
               "--target-metrics-port", str(self.metrics_port), "--kv-cache-gb", "0.5", *(extra or [])]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=open(self.log, "w"), stderr=subprocess.STDOUT,
                                     env={"UPESI_INTERNAL_TOKEN": INTERNAL_TOKEN, **os.environ})

    def wait_ready(self, timeout_s: float = 300) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"upesi serve exited early:\n{self.log.read_text()[-3000:]}")
            if "upesi: serving on" in self.log.read_text():
                return
            time.sleep(0.5)
        raise TimeoutError(self.log.read_text()[-3000:])

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=60)


@pytest.fixture(scope="session")
def stack(tmp_path_factory):
    s = Stack(tmp_path_factory.mktemp("stack"))
    try:
        s.wait_ready()
        yield s
    finally:
        code = s.stop()
        assert code == 0, f"upesi serve exited with {code}:\n{s.log.read_text()[-3000:]}"
