#!/usr/bin/env python
"""Upesi as `make run` starts it, side by side with vLLM's CPU build and transformers, in one run.

The stack is `upesi serve` with the Makefile's SERVE_ARGS (the default deployment) on free ports. The same chat
prompts, greedy, `--tokens` new tokens with EOS ignored (every side does the same work), both sides warm:
  single   each prompt alone; tokens/s averaged over prompts, TTFT the median
  c4, c32  4 and 32 requests at once (the prompts repeated); tokens/s of the whole batch
for Upesi's requests with `num_speculative_tokens: 0` (plain) and with the deployment's default (speculative),
the two alternating request by request (single) or batch by batch in one stack.
Beside tokens/s: time to first token, and CPU seconds per generated token (every process of the stack, or of
the peer, divided by the tokens). The physical bound of single-stream plain decoding, (memory read bandwidth) /
(weight bytes read per step), is measured on this machine and each single-stream figure given as a fraction of it.
Single stream, from the target's and the draft's /metrics between each request's first token and its end (the
prompt's prefill apart): tokens per target step, and where a step's wall time goes (the target's step, the draft's
proposal, and the rest: Verify round trip and delivery).

4-bit weights: the default model is a Q4_1 GGUF whose layers the stack serves as they are stored (packed codes,
shared/ops/qgemm.c, qgemm_avx2.c). `--weights` adds stacks beside it, their requests alternating with the default
stack's: `dequantised` (or `bf16`; the same flags plus --dequantise-gguf: the file dequantised at load to the
stack's dtype; plain and default requests) and `nvfp4:DIR` (an NVFP4 checkpoint made by `upesi quantize`, served
plainly). `--compare-args "FLAGS"` adds a stack of other `upesi serve` flags whose default requests alternate
with the others (a deployment choice, side by side). The target's resident memory is reported for each stack.
With `--llamacpp-python PATH` (the interpreter of a llama-cpp-python install) llama.cpp decodes the same prompt
tokens from `--llamacpp-model` (default: the default model's Q4_1 file) one at a time (bench/peer_llamacpp.py).

With `--vllm-python PATH` (the interpreter of a vLLM CPU install) and `--vllm-model DIR` (a Hugging Face folder
of the same weights), vLLM runs in its own processes (bench/peer_vllm.py: in-process engine, every core,
plain and n-gram speculation K = 4) in the same dtype as the stack; transformers `generate` runs unless
--skip-hf. The peers and the stack are measured one after the other, never at the same time.

    .venv/bin/python bench/bench_peers.py [--vllm-python ~/vllm/bin/python --vllm-model ~/smollm2-hf]
        [--serve-args "..."] [--loads 1 4 32] [--tokens 128] [--dtype auto] [--skip-hf]
        [--weights dequantised nvfp4:/tmp/smollm2-nvfp4]
        [--llamacpp-python ~/.cache/upesi-llamacpp-peer/venv/bin/python]

Prints a table and one JSON line. Figures, not assertions: the machine is shared and noisy.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from bench.workloads import WORKLOADS  # noqa: E402
from shared.testing.stack import free_port  # noqa: E402

PROMPTS = list(WORKLOADS["chat"])          # the workload's prompts (--workload)
PRESENCE_PENALTY = 0.0                     # the stack's requests' (--presence-penalty)


def make_run_args() -> list[str]:
    """The flags `make run` gives `upesi serve` (the Makefile's SERVE_ARGS)."""
    out = subprocess.run(["make", "-s", "--no-print-directory", "serve-args"], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout
    return shlex.split(out)


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return f"{line.split(':', 1)[1].strip()}, {os.cpu_count()} cores"
    return platform.processor() or "unknown CPU"


def read_bandwidth_gbs(threads: int) -> float:
    """Memory read bandwidth: the best of several sums over a 1 GiB fp32 tensor (far beyond the caches)."""
    import torch
    torch.set_num_threads(threads)
    x = torch.ones(2**28)
    best = 0.0
    for _ in range(6):
        t = time.perf_counter()
        x.sum()
        best = max(best, x.nbytes / (time.perf_counter() - t) / 1e9)
    return best


class ServeStack:
    """`upesi serve` with the given flags on free ports; CPU time summed over it and its children. Requests go out
    from one asyncio event loop on one gRPC channel (as vLLM's serving benchmark drives its server), which costs
    the shared cores less than a thread per stream: 0.35 against 0.59 CPU-s of client for 4,096 tokens at 32
    streams (2-core EPYC, 2026-12-05)."""

    def __init__(self, args: list[str]) -> None:
        self.address, self.http_port = f"127.0.0.1:{free_port()}", free_port()
        self.metrics_ports = (free_port(), free_port())        # the target's and the draft's /metrics
        # a log per stack (a run's stacks must not truncate each other's), named by its port
        self.log = open(Path(tempfile.gettempdir()) / f"upesi-bench-peers-serve-{self.http_port}.log", "w")
        cmd = [sys.executable, "-m", "services.cli", "--log-level", "WARNING", "serve", *args,
               "--address", self.address, "--http-port", str(self.http_port),
               "--target-address", f"127.0.0.1:{free_port()}",
               "--target-metrics-port", str(self.metrics_ports[0]), "--draft-address", f"127.0.0.1:{free_port()}",
               "--draft-metrics-port", str(self.metrics_ports[1]), "--expert-metrics-port", "0"]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT,
                                     env=dict(os.environ, UPESI_PROGRESS="false"))
        deadline = time.monotonic() + 900
        while "upesi: serving on" not in Path(self.log.name).read_text():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(Path(self.log.name).read_text()[-3000:])
            time.sleep(0.5)
        self.loop = asyncio.new_event_loop()
        self.channel = self.loop.run_until_complete(self._open())
        from upesi.v1 import generation_pb2_grpc
        self.stub = generation_pb2_grpc.GenerationStub(self.channel)

    async def _open(self):
        import grpc
        return grpc.aio.insecure_channel(self.address)        # made inside the loop that will use it

    def cpu_s(self) -> float:
        import psutil
        total = 0.0
        root = psutil.Process(self.proc.pid)
        for p in [root, *root.children(recursive=True)]:
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.Error:
                pass
        return total

    def target_rss_mb(self) -> float:
        """Resident memory of the stack's target process(es), MB."""
        import psutil
        total = 0.0
        for p in psutil.Process(self.proc.pid).children(recursive=True):
            try:
                if " target " in " ".join(p.cmdline()) + " ":
                    total += p.memory_info().rss / 1e6
            except psutil.Error:
                pass
        return total

    async def one(self, prompt: str, tokens: int, k: int | None, at_first: list | None = None) -> tuple[int, float]:
        """One streamed request -> (completion tokens, seconds to the first token); at_first: gets (the step
        counters, the clock, the tokens so far) when the first token arrives."""
        from upesi.v1 import generation_pb2 as pb
        # each side its own cache partition: alternating sides must not find each other's prompts cached
        req = pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content=prompt)], max_tokens=tokens,
                                 temperature=0, ignore_eos=True, cache_salt=f"bench-k{k}")
        if PRESENCE_PENALTY:
            req.presence_penalty = PRESENCE_PENALTY
        if k is not None:
            req.num_speculative_tokens = k
        t0, ttft, n = time.perf_counter(), None, 0
        async for msg in self.stub.GenerateStream(req, timeout=900):
            got = sum(len(c.token_ids) for c in msg.choices)
            n += got
            if got and ttft is None:
                ttft = time.perf_counter() - t0
                if at_first is not None:
                    at_first.append((self.counters(), time.perf_counter(), n))
        return n, ttft or 0.0

    def counters(self) -> dict[str, float]:
        """The step counters of the target's and the draft's /metrics (a family's series summed)."""
        import urllib.request
        out = dict.fromkeys(STEP_COUNTERS, 0.0)
        for port in self.metrics_ports:
            try:
                text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
            except OSError:
                continue                                     # no draft service in this stack
            for line in text.splitlines():
                name = line.split("{")[0].split(" ")[0]
                if name in out:
                    out[name] += float(line.rsplit(" ", 1)[1])
        return out

    def run(self, prompts: list[str], tokens: int, k: int | None) -> dict[str, float]:
        first: list = []                                     # a request alone: the counters at its first token

        async def every() -> list[tuple[int, float]]:
            return await asyncio.gather(*(self.one(p, tokens, k, first if len(prompts) == 1 else None)
                                          for p in prompts))

        c, t = self.cpu_s(), time.perf_counter()
        outs = self.loop.run_until_complete(every())
        end = time.perf_counter()
        wall, cpu = end - t, self.cpu_s() - c
        n = sum(o[0] for o in outs)
        out = {"tok_s": n / wall, "ttft_s": statistics.median(o[1] for o in outs), "cpu_s_per_tok": cpu / n}
        if first:
            before, start, made = first[0]
            out |= step_breakdown(before, self.counters(), n - made, end - start)
        return out

    def close(self) -> None:
        if getattr(self, "channel", None) is not None:
            self.loop.run_until_complete(self.channel.close())
            self.loop.close()
        self.proc.terminate()
        try:
            self.proc.wait(90)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


STEP_COUNTERS = ("upesi_engine_step_seconds_count", "upesi_engine_step_seconds_sum", "upesi_draft_propose_seconds_sum")


def step_breakdown(before: dict[str, float], after: dict[str, float], tokens: int, wall: float) -> dict[str, float]:
    """One request alone, after its first token (its prompt's prefill apart): the target's engine steps it took and
    where a step's wall time went: the target's step (forward pass, verification, sampling:
    upesi_engine_step_seconds), the draft's proposal (upesi_draft_propose_seconds) and the rest (the Verify round
    trip, delivering tokens, the services' loops)."""
    d = {key: after[key] - before[key] for key in STEP_COUNTERS}
    steps = max(1.0, d["upesi_engine_step_seconds_count"])
    target, draft = d["upesi_engine_step_seconds_sum"] / steps, d["upesi_draft_propose_seconds_sum"] / steps
    return {"tokens_per_step": tokens / steps, "step_ms": 1e3 * wall / steps, "target_step_ms": 1e3 * target,
            "draft_ms": 1e3 * draft, "other_ms": 1e3 * (wall / steps - target - draft)}


def measure_stack(sides: dict[str, tuple[ServeStack, int | None]], loads: list[int], tokens: int, reps: int
                  ) -> dict[str, dict]:
    """Each side (name -> a stack and its requests' num_speculative_tokens: 0 plain, None the deployment's
    default) at each load, the sides alternating request by request (single) or batch by batch, so that the
    machine's drift between minutes falls on all alike."""
    for stack, k in sides.values():
        stack.run(PROMPTS[:1], tokens, k)                                # warm-up, full length
    out: dict[str, dict[str, dict[str, float]]] = {name: {} for name in sides}
    for load in loads:
        if load == 1:
            runs: dict[str, list[dict[str, float]]] = {name: [] for name in sides}
            for p in PROMPTS:
                for _ in range(reps):
                    for name, (stack, k) in sides.items():
                        runs[name].append(stack.run([p], tokens, k))
            for name, r in runs.items():
                out[name]["single"] = {key: statistics.mean(x[key] for x in r) for key in r[0]}
                out[name]["single"]["ttft_s"] = statistics.median(x["ttft_s"] for x in r)
            continue
        prompts = (PROMPTS * load)[:load]
        best: dict[str, list[dict[str, float]]] = {name: [] for name in sides}
        for stack, k in sides.values():
            stack.run(prompts, 8, k)
        for _ in range(reps):
            for name, (stack, k) in sides.items():
                best[name].append(stack.run(prompts, tokens, k))
        for name, r in best.items():
            out[name][f"c{load}"] = max(r, key=lambda x: x["tok_s"])
    for name, (stack, _) in sides.items():
        out[name]["target_rss_mb"] = stack.target_rss_mb()
    return out


def measure_llamacpp(a: argparse.Namespace) -> dict:
    """llama.cpp on the same prompt tokens (the chat template applied by Upesi's tokenizer), one at a time."""
    from shared.model.loader import load_config
    from shared.model_files import default_model_path
    from shared.tokenizer import Tokenizer
    model = a.llamacpp_model or default_model_path()
    tok = Tokenizer(default_model_path())
    spec = {"ids": [tok.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS],
            "eos": load_config(default_model_path()).eos_token_ids}
    path = Path(tempfile.gettempdir()) / "upesi-bench-peers-llamacpp.json"
    path.write_text(json.dumps(spec))
    cmd = [a.llamacpp_python, str(ROOT / "bench" / "peer_llamacpp.py"), "--model", model, "--prompts-json",
           str(path), "--threads", str(a.threads), "--tokens", str(a.tokens), "--reps", str(a.reps)]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=tempfile.gettempdir())
    lines = [x for x in r.stdout.splitlines() if x.startswith("{")]
    if r.returncode or not lines:
        raise RuntimeError(f"llama.cpp run failed ({r.returncode}):\n{r.stderr[-3000:]}")
    return json.loads(lines[-1])


def measure_vllm(a: argparse.Namespace, dtype: str, ngram: int) -> dict:
    prompts = Path(tempfile.gettempdir()) / "upesi-bench-peers-prompts.json"
    prompts.write_text(json.dumps(PROMPTS))
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads), VLLM_CPU_KVCACHE_SPACE="2", TOKENIZERS_PARALLELISM="false",
               VLLM_NO_USAGE_STATS="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    iomp = Path(a.vllm_python).resolve().parents[1] / "lib" / "libiomp5.so"     # vLLM's recommended preloads
    preload = [p for p in [*a.vllm_preload, str(iomp) if iomp.exists() else None] if p]
    if preload:
        env["LD_PRELOAD"] = ":".join(preload)
    cmd = [a.vllm_python, str(ROOT / "bench" / "peer_vllm.py"), "--model", a.vllm_model, "--prompts-json",
           str(prompts), "--dtype", dtype, "--tokens", str(a.tokens), "--reps", str(a.reps),
           "--loads", *map(str, a.loads), "--ngram", str(ngram)]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=tempfile.gettempdir())
    lines = [x for x in r.stdout.splitlines() if x.startswith("{")]
    if r.returncode or not lines:
        raise RuntimeError(f"vLLM run failed ({r.returncode}):\n{r.stderr[-3000:]}")
    return json.loads(lines[-1])


def measure_hf(a: argparse.Namespace, dtype: str) -> dict:
    """transformers `generate` on the default model's GGUF (dequantised), single stream and 4 at once."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from shared.model_files import default_model_path
    torch.set_num_threads(a.threads)
    path = default_model_path()
    d, f = os.path.dirname(path), os.path.basename(path)
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=getattr(torch, dtype)).eval()
    pad = tok.pad_token_id if tok.pad_token_id is not None else 2

    def ids(p: str) -> list[int]:
        x = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True)
        return list(x["input_ids"] if hasattr(x, "keys") else x)

    def run(prompts: list[str], tokens: int) -> dict[str, float]:
        seqs = [ids(p) for p in prompts]
        n = max(len(s) for s in seqs)
        inp = torch.tensor([[pad] * (n - len(s)) + s for s in seqs])
        att = torch.tensor([[0] * (n - len(s)) + [1] * len(s) for s in seqs])
        c, t = time.process_time(), time.perf_counter()
        with torch.inference_mode():
            out = model.generate(input_ids=inp, attention_mask=att, max_new_tokens=tokens, min_new_tokens=tokens,
                                 do_sample=False, temperature=None, top_p=None, top_k=None, pad_token_id=pad,
                                 eos_token_id=None)
        wall, cpu = time.perf_counter() - t, time.process_time() - c
        made = (out.shape[1] - n) * len(seqs)
        return {"tok_s": made / wall, "cpu_s_per_tok": cpu / made}

    run(PROMPTS[:1], a.tokens)                                           # warm-up, full length
    out = {}
    for load in [x for x in a.loads if x <= 4]:
        prompts = (PROMPTS * load)[:load]
        runs = [run([p], a.tokens) for p in PROMPTS] if load == 1 else [run(prompts, a.tokens)]
        r = {key: statistics.mean(x[key] for x in runs) for key in runs[0]}
        r["ttft_s"] = statistics.median(run([p], 1)["tok_s"] ** -1 for p in prompts)
        out["single" if load == 1 else f"c{load}"] = r
    return out


# bytes per weight of each GGUF type as shared/ops/qgemm.py packs it (codes, then scales and mins in fp16 where
# they are exactly fp16 values, else fp32)
PACKED_BYTES = {"Q4_0": 0.5 + 2 / 32, "Q4_1": 0.5 + 4 / 32, "Q8_0": 1 + 2 / 32, "Q4_K": 0.5 + 8 / 32,
                "Q5_K": 1 + 8 / 32, "Q6_K": 1 + 4 / 16}


def weight_bytes(dtype: str, packed: bool = False) -> int:
    """Bytes of weights a plain decode step reads (every linear layer, the LM head, norms) in `dtype`, or with the
    default GGUF's quantised layers (and the head tied to its quantised embedding) read packed."""
    from shared.model.gguf_loader import gguf_quant_types
    from shared.model.loader import load_config
    from shared.model_files import default_model_path
    c = load_config(default_model_path())
    per_layer = (c.hidden_size * (c.num_heads + 2 * c.num_kv_heads) * c.head_dim + c.num_heads * c.head_dim
                 * c.hidden_size + 3 * c.hidden_size * c.intermediate_size + 2 * c.hidden_size)
    params = c.num_layers * per_layer + c.vocab_size * c.hidden_size + c.hidden_size
    size = 4 if dtype == "float32" else 2
    if not packed:
        return params * size
    total = params * size
    shapes = {"q_proj": (c.num_heads * c.head_dim, c.hidden_size), "k_proj": (c.num_kv_heads * c.head_dim,
              c.hidden_size), "v_proj": (c.num_kv_heads * c.head_dim, c.hidden_size),
              "o_proj": (c.hidden_size, c.num_heads * c.head_dim), "gate_proj": (c.intermediate_size, c.hidden_size),
              "up_proj": (c.intermediate_size, c.hidden_size), "down_proj": (c.hidden_size, c.intermediate_size),
              "embed_tokens": (c.vocab_size, c.hidden_size)}
    for name, kind in gguf_quant_types(default_model_path(), c).items():
        short = name.split(".")[-2]
        if kind.name in PACKED_BYTES and short in shapes and (short != "embed_tokens" or c.tie_word_embeddings):
            n = shapes[short][0] * shapes[short][1]
            total += int(n * (PACKED_BYTES[kind.name] - size))
    return total


def served_dtype(dtype: str) -> str:
    import torch

    from shared.engine.config import serving_dtype
    return serving_dtype(dtype, torch.device("cpu"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--serve-args", default=None, help="flags of `upesi serve` (default: the Makefile's SERVE_ARGS, "
                                                      "as `make run` starts it)")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--loads", type=int, nargs="+", default=[1, 4, 32], help="concurrent requests (1 = single)")
    ap.add_argument("--reps", type=int, default=2, help="runs per prompt (single) or per figure (best of)")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="threads of the peers (default: every core)")
    ap.add_argument("--dtype", default="auto", help="the stack's --dtype; the peers run the dtype it resolves to")
    ap.add_argument("--vllm-python", default=None, help="python of a vLLM CPU install (measures vLLM beside)")
    ap.add_argument("--vllm-model", default=None, help="Hugging Face folder of the default model, for vLLM")
    ap.add_argument("--vllm-preload", nargs="*", default=[], help="libraries to LD_PRELOAD into vLLM (tcmalloc)")
    ap.add_argument("--skip-hf", action="store_true", help="do not measure transformers")
    ap.add_argument("--skip-spec", action="store_true", help="only plain requests through the stack")
    ap.add_argument("--workload", choices=sorted(WORKLOADS), default="chat",
                    help="chat: four short questions; grounded: four edits of a given ~300-token text, whose "
                         "answers copy the prompt; mixed: the two interleaved (bench/workloads.py)")
    ap.add_argument("--presence-penalty", type=float, default=0.0,
                    help="the stack's requests (plain and default) carry this presence penalty, so speculation is "
                         "verified under logits processing; peers are run without it (use without them)")
    ap.add_argument("--weights", nargs="*", default=[], help="stacks beside the default one: dequantised (or "
                    "bf16: the GGUF dequantised to the stack's dtype at load; plain and default requests), int8 "
                    "(the default stack with --int8-activations), nvfp4:DIR (an NVFP4 checkpoint) and "
                    "nvfp4-int8:DIR (the same with --int8-activations); plain requests")
    ap.add_argument("--compare-args", default=None, help="flags of a second `upesi serve` stack beside the first, "
                                                        "whose default requests are measured in the same rounds "
                                                        "(a deployment choice side by side)")
    ap.add_argument("--llamacpp-python", default=None, help="python of a llama-cpp-python install (measures "
                                                            "llama.cpp beside, single stream)")
    ap.add_argument("--llamacpp-model", default=None, help="GGUF file for llama.cpp (default: the default model)")
    a = ap.parse_args()
    PROMPTS[:] = WORKLOADS[a.workload]
    global PRESENCE_PENALTY
    PRESENCE_PENALTY = a.presence_penalty
    if a.vllm_python and not a.vllm_model:
        ap.error("--vllm-python needs --vllm-model (a Hugging Face folder of the same weights)")

    dtype = served_dtype(a.dtype)
    serve = shlex.split(a.serve_args) if a.serve_args is not None else make_run_args()
    results: dict[str, dict] = {}
    stacks = [ServeStack([*serve, "--dtype", a.dtype])]
    try:
        sides = {"upesi plain": (stacks[0], 0)} | ({} if a.skip_spec else {"upesi default": (stacks[0], None)})
        for w in a.weights:
            if w in ("dequantised", "bf16"):
                stacks.append(ServeStack([*serve, "--dtype", a.dtype, "--dequantise-gguf"]))
                sides[f"upesi {dtype} weights plain"] = (stacks[-1], 0)
                if not a.skip_spec:
                    sides[f"upesi {dtype} weights default"] = (stacks[-1], None)
            elif w == "int8":
                stacks.append(ServeStack([*serve, "--dtype", a.dtype, "--int8-activations"]))
                sides["upesi int8-activations plain"] = (stacks[-1], 0)
            elif w.split(":", 1)[0] in ("nvfp4", "nvfp4-int8"):
                kind, path = w.split(":", 1)
                stacks.append(ServeStack(["--model", path, "--dtype", a.dtype]
                                         + (["--int8-activations"] if kind == "nvfp4-int8" else [])))
                sides[f"upesi {kind} {Path(path).name} plain"] = (stacks[-1], 0)
            else:
                ap.error(f"--weights takes dequantised, int8, nvfp4:DIR and nvfp4-int8:DIR, not {w!r}")
        if a.compare_args is not None:
            stacks.append(ServeStack([*shlex.split(a.compare_args), "--dtype", a.dtype]))
            sides["upesi default, --compare-args"] = (stacks[-1], None)
        results.update(measure_stack(sides, a.loads, a.tokens, a.reps))
    finally:
        for stack in stacks:
            stack.close()
    if a.llamacpp_python:
        results["llama.cpp"] = measure_llamacpp(a)
    if a.vllm_python:
        results["vllm plain"] = measure_vllm(a, dtype, 0)
        results["vllm ngram K=4"] = measure_vllm(a, dtype, 4)
    if not a.skip_hf:
        results["transformers"] = measure_hf(a, dtype)
    bw = read_bandwidth_gbs(a.threads)
    bound = bw * 1e9 / weight_bytes(dtype, packed=True)

    print(f"\n{cpu_name()}; dtype {dtype}; {a.workload} prompts; {a.tokens} greedy tokens (EOS ignored); "
          f"`upesi serve {' '.join(serve)}`")
    print(f"read bandwidth {bw:.1f} GB/s -> single-stream plain bound {bound:.1f} tok/s "
          f"({weight_bytes(dtype, packed=True) / 1e6:.0f} MB of weights per step, packed; "
          f"{weight_bytes(dtype) / 1e6:.0f} MB in {dtype})")
    base = results.get("vllm plain", {})
    cols = ["single" if x == 1 else f"c{x}" for x in a.loads]
    print(f"{'tokens/s (TTFT s, CPU ms/token)':34}" + "".join(f"{c:>30}" for c in cols))
    for name, r in results.items():
        cells = []
        for c in cols:
            if c not in r:
                cells.append(f"{'-':>30}")
                continue
            x = r[c]
            ratio = f" {x['tok_s'] / base[c]['tok_s']:.2f}x" if c in base and name != "vllm plain" else ""
            cells.append(f"{x['tok_s']:.1f}{ratio} ({x.get('ttft_s', float('nan')):.2f}, "
                         f"{1e3 * x['cpu_s_per_tok']:.0f})".rjust(30))
        print(f"{name:34}" + "".join(cells))
    for name, r in results.items():
        if "single" in r and name in ("upesi plain", "upesi default"):
            print(f"{name}: single stream at {r['single']['tok_s'] / bound:.0%} of the bandwidth bound")
    for name, r in results.items():
        if "tokens_per_step" in r.get("single", {}):
            x = r["single"]
            print(f"{name}: {x['tokens_per_step']:.2f} tokens per target step of {x['step_ms']:.1f} ms = target "
                  f"{x['target_step_ms']:.1f} + draft {x['draft_ms']:.1f} + round trip and delivery "
                  f"{x['other_ms']:.1f}")
    for name, r in results.items():
        if "target_rss_mb" in r:
            print(f"{name}: target resident memory {r['target_rss_mb']:.0f} MB")
    if "llama.cpp" in results and "upesi plain" in results:
        print(f"upesi plain / llama.cpp, single stream: "
              f"{results['upesi plain']['single']['tok_s'] / results['llama.cpp']['single']['tok_s']:.2f}x")
    print(json.dumps({"cpu": cpu_name(), "dtype": dtype, "workload": a.workload, "tokens": a.tokens,
                      "serve_args": serve,
                      "read_bandwidth_gbs": bw, "bound_tok_s": bound, "results": results}))


if __name__ == "__main__":
    main()
