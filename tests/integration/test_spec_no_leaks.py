"""100 speculative requests through a real target and a real draft service (a small draft model with its own paged
KV), a quarter of them cancelled mid-stream: afterwards neither service holds a KV block or any per-sequence state.

Tiny random Llamas (target and a different draft) keep it fast; requests go to the draft's own gRPC API (as the
router sends them), and the draft drives its Verify stream to the target.
"""
from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import grpc
import pytest
import torch

from shared.testing.stack import wait_healthy
from tests.conftest import ROOT, free_port
from upesi.v1 import draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc

pytestmark = pytest.mark.slow

V = 96
REQUESTS, WORKERS = 100, 8


def save_llama(path, seed: int, layers: int) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, eos_token_id=None,
                      tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(4)
    model.save_pretrained(path)


def draft_held(port: int) -> tuple[float, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    get = lambda name: float(re.search(rf"^{name} (\S+)$", text, re.M)[1])  # noqa: E731
    return get("upesi_draft_sequences"), get("upesi_draft_kv_blocks_used")


def test_no_leaks_after_100_speculative_requests_with_cancellations(tmp_path):
    target_dir, draft_dir = tmp_path / "target", tmp_path / "draft"
    save_llama(target_dir, 0, layers=2)
    save_llama(draft_dir, 1, layers=1)
    draft, target, metrics = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}", free_port()
    log = open(tmp_path / "services.log", "w")
    cli = [sys.executable, "-m", "services.cli"]
    procs = [subprocess.Popen([*cli, "draft", "--address", draft, "--proposer", f"draft-model:{draft_dir}",
                               "--metrics-port", str(metrics), "--kv-blocks", "256", "--num-threads", "1"],
                              cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)]
    procs.append(subprocess.Popen([*cli, "target", "--model", str(target_dir), "--address", target,
                                   "--num-speculative-tokens", "3", "--metrics-port", "0", "--num-kv-blocks", "256",
                                   "--num-threads", "1", "--progress", "false"],
                                  cwd=ROOT, stdout=log, stderr=subprocess.STDOUT))
    try:
        wait_healthy(draft, procs=procs)
        wait_healthy(target, procs=procs)
        counts = {"done": 0, "cancelled": 0, "drafted": 0}
        errors: list[str] = []
        lock = threading.Lock()

        def worker(w: int) -> None:
            with grpc.insecure_channel(draft) as ch:
                stub = draft_pb2_grpc.DraftStub(ch)
                for i in range(w, REQUESTS, WORKERS):
                    g = torch.Generator().manual_seed(i)
                    prompt = torch.randint(1, V, (int(torch.randint(3, 40, (1,), generator=g)),), generator=g)
                    sampling = target_pb2.SamplingParams(temperature=0.0 if i % 2 else 1.0, top_p=1.0, seed=i,
                                                         max_tokens=24, ignore_eos=True)
                    stream = stub.Generate(draft_pb2.DraftGenerateRequest(target=target, request=(
                        target_pb2.TargetGenerateRequest(request_id=f"r{i}", prompt_token_ids=prompt.tolist(),
                                                         sampling=sampling, n=1))), timeout=120)
                    try:
                        if i % 4 == 0:                       # a quarter of the clients cancel mid-stream
                            next(stream), next(stream)
                            stream.cancel()
                            key = "cancelled"
                        else:
                            drafted = 0
                            for msg in stream:
                                drafted = max([drafted] + [d.draft_tokens for d in msg.deltas])
                            with lock:
                                counts["drafted"] += drafted
                            key = "done"
                        with lock:
                            counts[key] += 1
                    except grpc.RpcError as e:
                        with lock:
                            errors.append(f"r{i}: {e.code().name} {e.details()}")

        threads = [threading.Thread(target=worker, args=(w,)) for w in range(WORKERS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors[:5]
        assert counts["done"] == 75 and counts["cancelled"] == 25
        assert counts["drafted"] > 0                         # speculation really ran through the draft service
        deadline = time.monotonic() + 10
        with grpc.insecure_channel(target) as ch:
            stub = target_pb2_grpc.TargetStub(ch)
            while True:
                load = stub.Load(target_pb2.LoadRequest(), timeout=10)
                held = draft_held(metrics)
                if (load.kv_blocks_used, load.running, load.waiting, *held) == (0, 0, 0, 0, 0) or \
                        time.monotonic() > deadline:
                    break
                time.sleep(0.2)
        assert (load.kv_blocks_used, load.running, load.waiting) == (0, 0, 0), "target"
        assert held == (0, 0), f"draft holds (sequences, KV blocks) = {held}"
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
