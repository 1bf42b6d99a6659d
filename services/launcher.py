"""`upesi serve`: the whole stack as child processes on this machine, stopped together."""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

from shared.config import add_config_arguments, config_from_args, option


@dataclass(slots=True)
class ServeConfig:
    model: str | None = option(None, "model: a .gguf file or a Hugging Face folder (default: SmolLM2-135M-Instruct)")
    address: str = option("127.0.0.1:50051", "router gRPC address (the public API)")
    http_host: str = option("127.0.0.1", "router HTTP host")
    http_port: int = option(8000, "router HTTP port (/health, /metrics)")
    target_address: str = option("127.0.0.1:50061", "first target's gRPC address (replica i listens on port + i)")
    target_metrics_port: int = option(8061, "first target's /metrics port, + i for replica i (0 = off)")
    target_replicas: int = option(1, "number of target replicas")
    registry: str | None = option(None, "prefix-block registry shared by router and targets: redis://host:port/db")
    kv_cache_gb: float = option(1.0, "target KV cache size in GiB")
    max_num_seqs: int = option(64, "target: most sequences in the running batch")
    num_threads: int | None = option(None, "target: torch CPU threads")
    device: str = option("auto", "target device: cpu, cuda or auto")
    expert_shards: int = option(0, "expert shard processes (0 = FFNs run in the target); they listen on the ports "
                                   "after the targets'")
    expert_placement: str | None = option(None, "placement JSON of FFN units on the expert shards "
                                                "(default: contiguous)")
    speculative: str | None = option(None, "speculative proposer inside each target: ngram or draft-model:PATH")
    draft: str | None = option(None, "start a draft service with this proposer (ngram or draft-model:PATH) and have "
                                     "the targets take proposals from it")
    num_speculative_tokens: int = option(3, "default K for speculative decoding")
    draft_address: str = option("127.0.0.1:50071", "draft service address (with --draft)")
    ready_timeout_s: float = option(600.0, "how long to wait for the stack to come up")

    def __post_init__(self) -> None:
        if self.target_replicas < 1:
            raise ValueError(f"target_replicas must be at least 1, got {self.target_replicas}")
        if self.expert_shards < 0:
            raise ValueError(f"expert_shards must be >= 0, got {self.expert_shards}")
        if self.speculative and self.draft:
            raise ValueError("give --speculative (in the target) or --draft (a draft service), not both")

    def target_addresses(self) -> list[str]:
        host, port = self.target_address.rsplit(":", 1)
        return [f"{host}:{int(port) + i}" for i in range(self.target_replicas)]

    def expert_addresses(self) -> list[str]:
        host, port = self.target_address.rsplit(":", 1)
        first = int(port) + self.target_replicas
        return [f"{host}:{first + i}" for i in range(self.expert_shards)]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, ServeConfig)


def _child(args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "services.cli", *args], start_new_session=True,
                            env=None if env is None else {**os.environ, **env})


def _expert_env(cfg: ServeConfig) -> dict[str, str] | None:
    """With expert shards the target waits on RPCs 2 * layers times a step: OpenMP workers that spin while it waits
    would take the cores the shards compute on (x6 step time at batch 1 on 2 cores), so they sleep instead."""
    return {"OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")} if cfg.expert_shards else None


def _wait_healthy(address: str, procs: list[subprocess.Popen], timeout_s: float) -> None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while time.monotonic() < deadline:
            for p in procs:
                if p.poll() is not None:
                    raise RuntimeError(f"a service exited with code {p.returncode} while starting: {p.args[3:]}")
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.3)
    raise TimeoutError(f"the stack did not become healthy on {address} within {timeout_s:.0f} s")


def _stop(procs: list[subprocess.Popen], grace_s: float = 10.0) -> None:
    for p in reversed(procs):                      # router first, so no new work reaches the target
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def main(args: argparse.Namespace) -> None:
    cfg = config_from_args(ServeConfig, args)
    model = ["--model", cfg.model] if cfg.model else []
    threads = ["--num-threads", str(cfg.num_threads)] if cfg.num_threads else []
    procs: list[subprocess.Popen] = []
    def on_signal(signum, frame) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    try:
        registry = ["--registry", cfg.registry] if cfg.registry else []
        placement = ["--expert-placement", cfg.expert_placement] if cfg.expert_placement else []
        env = _expert_env(cfg)
        # the shards share this machine's cores with the target
        shard_threads = str(cfg.num_threads or max(1, (os.cpu_count() or 1) // (cfg.expert_shards + 1)))
        # stateless services the launcher restarts when they die: index in procs -> (name, address, command)
        shards: dict[int, tuple[str, str, list[str]]] = {}
        for i, address in enumerate(cfg.expert_addresses()):
            shards[len(procs)] = (f"expert shard {i}", address, ["experts", "--address", address, "--shard-index", str(i),
                                               "--num-shards", str(cfg.expert_shards), "--device", cfg.device,
                                               "--num-threads", shard_threads, *model, *placement])
            procs.append(_child(shards[len(procs)][2], env))
            print(f"upesi: expert shard {i} on {address} (pid {procs[-1].pid})", flush=True)
        experts = ["--expert-shards", ",".join(cfg.expert_addresses()), *placement] if cfg.expert_shards else []
        spec = ["--num-speculative-tokens", str(cfg.num_speculative_tokens)]
        if cfg.speculative:
            spec += ["--speculative", cfg.speculative]
        if cfg.draft:
            shards[len(procs)] = ("draft service", cfg.draft_address, [
                "draft", "--address", cfg.draft_address, "--proposer", cfg.draft, "--device", cfg.device])
            procs.append(_child(shards[len(procs)][2], env))
            spec += ["--draft", cfg.draft_address]
        for i, address in enumerate(cfg.target_addresses()):
            metrics_port = cfg.target_metrics_port + i if cfg.target_metrics_port else 0
            procs.append(_child(["target", "--address", address, "--replica-id", address,
                                 "--metrics-port", str(metrics_port), "--kv-cache-gb", str(cfg.kv_cache_gb),
                                 "--max-num-seqs", str(cfg.max_num_seqs), "--device", cfg.device,
                                 *model, *threads, *registry, *experts, *spec], env))
        procs.append(_child(["router", "--address", cfg.address, "--http-host", cfg.http_host,
                             "--http-port", str(cfg.http_port), "--target", ",".join(cfg.target_addresses()),
                             *model, *registry]))
        _wait_healthy(cfg.address, procs, cfg.ready_timeout_s)
        print(f"upesi: serving on grpc://{cfg.address} and http://{cfg.http_host}:{cfg.http_port} "
              "(Ctrl-C to stop)", flush=True)
        while True:
            for i, (shard, address, command) in shards.items():   # stateless: restart it, targets reconnect
                if procs[i].poll() is not None:
                    print(f"upesi: {shard} exited (code {procs[i].returncode}); restarting it",
                          file=sys.stderr, flush=True)
                    procs[i] = _child(command, env)
                    print(f"upesi: {shard} on {address} (pid {procs[i].pid})", flush=True)
            if any(p.poll() is not None for i, p in enumerate(procs) if i not in shards):
                break
            time.sleep(0.5)
        dead = [p for i, p in enumerate(procs) if i not in shards and p.poll() is not None]
        print(f"upesi: a service exited (code {dead[0].returncode}); stopping the stack", file=sys.stderr)
        code = 1
    except KeyboardInterrupt:
        code = 0
    except (RuntimeError, TimeoutError) as e:
        print(f"upesi: {e}", file=sys.stderr)
        code = 1
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        _stop(procs)
    sys.exit(code)
