#!/usr/bin/env python
"""Decode throughput through the whole gRPC stack against transformers `generate`, side by side in one run.

Same model (the default SmolLM2-135M-Instruct GGUF, fp32), same 4 chat prompts, greedy, 128 new tokens
(EOS ignored on both sides so every run makes the same number of tokens). Both are warmed up with a
full-length run first. The stack runs as `upesi serve` child processes; transformers runs in this process with
the same thread count. They are measured one after the other, never at the same time.

    .venv/bin/python bench/bench_generate.py [--tokens 128] [--concurrency 4 16 32] [--threads 2]

Prints a table and one JSON line. Figures, not assertions: the machine is shared and noisy.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from bench.workloads import CHAT as PROMPTS  # noqa: E402
from shared.testing.stack import free_port  # noqa: E402


class Stack:
    def __init__(self, threads: int, max_num_seqs: int) -> None:
        self.address = f"127.0.0.1:{free_port()}"
        self.log = open("/tmp/upesi-bench-serve.log", "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "services.cli", "--log-level", "WARNING", "serve", "--address", self.address,
             "--http-port", str(free_port()), "--target-address", f"127.0.0.1:{free_port()}",
             "--target-metrics-port", "0", "--num-threads", str(threads), "--max-num-seqs", str(max_num_seqs)],
            cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT, env=dict(os.environ, UPESI_PROGRESS="false"))
        deadline = time.monotonic() + 600
        while "upesi: serving on" not in Path(self.log.name).read_text():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(Path(self.log.name).read_text()[-2000:])
            time.sleep(0.5)
        import grpc

        from upesi.v1 import generation_pb2_grpc
        self.channel = grpc.insecure_channel(self.address)
        self.stub = generation_pb2_grpc.GenerationStub(self.channel)

    def one(self, prompt: str, tokens: int) -> list[int]:
        from upesi.v1 import generation_pb2 as pb
        req = pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content=prompt)], max_tokens=tokens,
                                 temperature=0, ignore_eos=True)
        ids: list[int] = []
        for msg in self.stub.GenerateStream(req, timeout=600):
            for c in msg.choices:
                ids.extend(c.token_ids)
        return ids

    def run(self, prompts: list[str], tokens: int) -> tuple[int, float]:
        t = time.perf_counter()
        with cf.ThreadPoolExecutor(len(prompts)) as ex:
            outs = list(ex.map(lambda p: self.one(p, tokens), prompts))
        return sum(len(o) for o in outs), time.perf_counter() - t

    def close(self) -> None:
        self.channel.close()
        self.proc.terminate()
        self.proc.wait(60)


class HF:
    def __init__(self, threads: int) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from shared.model_files import default_model_path
        torch.set_num_threads(threads)
        path = default_model_path()
        d, f = os.path.dirname(path), os.path.basename(path)
        self.tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
        self.model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()
        self.pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else 2

    def ids(self, prompt: str) -> list[int]:
        x = self.tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                         tokenize=True)
        return list(x["input_ids"] if hasattr(x, "keys") else x)

    def run(self, prompts: list[str], tokens: int) -> tuple[int, float]:
        import torch
        seqs = [self.ids(p) for p in prompts]
        n = max(len(s) for s in seqs)
        inp = torch.tensor([[self.pad] * (n - len(s)) + s for s in seqs])
        att = torch.tensor([[0] * (n - len(s)) + [1] * len(s) for s in seqs])
        t = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(input_ids=inp, attention_mask=att, max_new_tokens=tokens,
                                      min_new_tokens=tokens, do_sample=False, temperature=None, top_p=None,
                                      top_k=None, pad_token_id=self.pad, eos_token_id=None)
        return (out.shape[1] - n) * len(seqs), time.perf_counter() - t


def measure(fn, prompts: list[str], tokens: int, reps: int) -> float:
    best = 0.0
    for _ in range(reps):
        n, w = fn(prompts, tokens)
        best = max(best, n / w)
    return round(best, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[4, 16, 32])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=2, help="best of this many runs per figure")
    ap.add_argument("--skip-hf", action="store_true")
    a = ap.parse_args()

    results: dict[str, dict[str, float]] = {"upesi_grpc_stack": {}, "transformers_generate": {}}
    stack = Stack(a.threads, max(a.concurrency))
    try:
        stack.run(PROMPTS[:1], a.tokens)                                     # warm-up, full length
        results["upesi_grpc_stack"]["single"] = round(sum(
            measure(stack.run, [p], a.tokens, a.reps) for p in PROMPTS) / len(PROMPTS), 1)
        for c in a.concurrency:
            prompts = (PROMPTS * c)[:c]
            stack.run(prompts, 8)
            results["upesi_grpc_stack"][f"concurrent_{c}"] = measure(stack.run, prompts, a.tokens, a.reps)
    finally:
        stack.close()
    if not a.skip_hf:
        hf = HF(a.threads)
        hf.run(PROMPTS[:1], a.tokens)                                        # warm-up, full length
        results["transformers_generate"]["single"] = round(sum(
            measure(hf.run, [p], a.tokens, a.reps) for p in PROMPTS) / len(PROMPTS), 1)
        for c in a.concurrency:
            prompts = (PROMPTS * c)[:c]
            hf.run(prompts, a.tokens)
            results["transformers_generate"][f"batch_{c}"] = measure(hf.run, prompts, a.tokens, a.reps)

    print(f"\ndecode tokens/s, {a.tokens} greedy tokens, {a.threads} threads (best of {a.reps})")
    print(f"{'':24}{'upesi (gRPC stack)':>20}{'transformers':>16}")
    up, hfr = results["upesi_grpc_stack"], results["transformers_generate"]
    print(f"{'single stream':24}{up['single']:>20}{hfr.get('single', '-'):>16}")
    for c in a.concurrency:
        print(f"{f'{c} concurrent':24}{up[f'concurrent_{c}']:>20}{hfr.get(f'batch_{c}', '-'):>16}")
    print(json.dumps({"tokens": a.tokens, "threads": a.threads, **results}))


if __name__ == "__main__":
    main()
