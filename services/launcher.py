"""`upesi serve`: the whole stack as child processes on this machine, stopped together."""
from __future__ import annotations

import argparse
import functools
import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

from services import options
from shared.config import add_config_arguments, config_from_args, option
from shared.engine.config import (
    check_draft_confidence,
    check_dtype,
    check_speculative_max_seqs,
    check_kv_store,
    check_tree_ngram,
    check_tree_shape,
    check_wide_threads,
    check_write_policy,
    parse_hf_overrides,
)
from shared.rpc import internal_token

DIRECT_HOST_GB = 1.0          # a decode target's host tier for P/D with direct transfer, unless --kv-host-gb is set

@dataclass(slots=True)
class ServeConfig:
    model: str | None = options.model()
    hf_overrides: str | None = options.hf_overrides()
    served_model_name: str | None = option(None, "the model's name in the OpenAI API (default: the model's file or "
                                                 "folder name without extension or quantisation suffix)")
    address: str = option("127.0.0.1:50051", "router gRPC address (the public API)")
    http_host: str = option("127.0.0.1", "router HTTP host")
    http_port: int = option(8000, "router HTTP port (/health, /metrics)")
    target_address: str = option("127.0.0.1:50061", "first target's gRPC address (replica i listens on port + i)")
    target_metrics_port: int = option(8061, "first target's /metrics port, + i for replica i (0 = off)")
    target_replicas: int = option(1, "number of target replicas")
    registry: str | None = option(None, "prefix-block registry shared by router and targets: redis://host:port/db")
    kv_cache_gb: float = option(1.0, "target KV cache size in GiB")
    kv_store: str | None = options.kv_store()
    kv_store_gb: float = options.kv_store_gb()
    kv_store_ttl_s: float = options.kv_store_ttl_s()
    kv_host_gb: float = options.kv_host_gb()
    kv_disk_dir: str | None = option(None, "local-disk tier of the KV block store: a directory; target replica i "
                                           "writes its blocks under DIR/target-i (default: none)")
    kv_disk_gb: float = options.kv_disk_gb()
    kv_store_write_policy: str = options.kv_store_write_policy()
    kv_store_write_threshold: int = options.kv_store_write_threshold()
    prefill_replicas: int = option(0, "prefill-only targets (prefill/decode disaggregation): the router has each "
                                      "prompt computed on one of them, which hands its KV blocks to the decode "
                                      "target (--kv-transfer). They listen on the ports after the expert shards'")
    kv_transfer: str = options.kv_transfer()
    max_num_seqs: int = option(64, "target: most sequences in the running batch")
    num_threads: int | None = option(None, "target: torch CPU threads")
    wide_threads: int | None = option(None, "target: torch CPU threads of forward steps over 4 or more rows "
                                            "(verification, prefill, big batches; default: --num-threads)")
    draft_num_threads: int = option(2, "draft service: torch CPU threads. Its OpenMP workers spin only briefly "
                                       "after each parallel region (GOMP_SPINCOUNT, default 20000) and then sleep, "
                                       "so they leave the cores to the target's verification that follows")
    device: str = option("auto", "target device: cpu, cuda or auto")
    dtype: str = options.dtype("weights and activations of the targets, draft and expert shards: "
                               + options.DTYPE_HELP)
    expert_shards: int = option(0, "expert shard processes (0 = FFNs run in the target); they listen on the ports "
                                   "after the targets'")
    expert_placement: str | None = options.expert_placement()
    speculative: str | None = option(None, "speculative proposer inside each target: ngram, draft-model:PATH or "
                                           "eagle:PATH")
    draft: str | None = option(None, "start a draft service with this proposer (ngram, draft-model:PATH or "
                                     "eagle:PATH): the router sends speculative requests to it, and it drives "
                                     "a Verify stream to the chosen target")
    num_speculative_tokens: int = options.num_speculative_tokens()
    adaptive_speculation: bool = options.adaptive_speculation()
    speculative_max_requests: int = option(1, "with --draft: requests speculate only while at most this many are "
                                              "in flight at the router (more: plain decoding on the target; "
                                              "0 = always)")
    speculative_max_seqs: int = options.speculative_max_seqs(1)
    stream_interval: int = options.stream_interval()
    draft_confidence: float | None = options.draft_confidence()
    draft_tree_nodes: int | None = options.draft_tree_nodes()
    draft_tree_ngram: int | None = options.draft_tree_ngram()
    draft_address: str = option("127.0.0.1:50071", "draft service address (with --draft)")
    ready_timeout_s: float = option(600.0, "how long to wait for the stack to come up")
    nvfp4_act_quant: bool = option(False, "NVFP4 checkpoints: emulate W4A4 in the targets and the expert shards")
    dequantise_gguf: bool = options.dequantise_gguf()
    rebalance_interval_s: float = option(0.0, "with expert shards: the targets replicate hot experts every this many "
                                              "seconds when the shards' load is out of balance (0 = off)")
    draft_metrics_port: int = option(8071, "draft service /metrics port (with --draft; 0 = off)")
    expert_metrics_port: int = option(8081, "first expert shard's /metrics port, + i for shard i (0 = off)")
    tls_cert: str | None = option(None, "TLS between all services (and on the public gRPC port): the certificate "
                                        "(PEM) every service serves and presents as a client (give it both server "
                                        "and client use and the addresses as SANs)")
    tls_key: str | None = option(None, "TLS: that certificate's private key (PEM)")
    tls_ca: str | None = option(None, "TLS: the CA (PEM) that signed the certificates; every service verifies "
                                      "its peers with it")
    tls_client_auth: bool = option(True, "with TLS: mutual TLS, every service refuses clients without a "
                                         "certificate signed by the CA (the public gRPC port too)")

    def __post_init__(self) -> None:
        check_dtype(self.dtype)
        parse_hf_overrides(self.hf_overrides)
        check_draft_confidence(self.draft_confidence)
        check_tree_shape(self.draft_tree_nodes)
        check_tree_ngram(self.draft_tree_ngram)
        if self.stream_interval < 0:
            raise ValueError(f"stream_interval must be >= 0, got {self.stream_interval}")
        check_speculative_max_seqs(self.speculative_max_seqs)
        if self.speculative_max_requests < 0:
            raise ValueError(f"speculative_max_requests must be >= 0 (0 = always), got {self.speculative_max_requests}")
        check_wide_threads(self.wide_threads)
        if self.draft_num_threads < 1:
            raise ValueError(f"draft_num_threads must be at least 1, got {self.draft_num_threads}")
        if self.target_replicas < 1:
            raise ValueError(f"target_replicas must be at least 1, got {self.target_replicas}")
        check_kv_store(self.kv_store, self.kv_store_gb, self.kv_store_ttl_s, self.kv_host_gb, self.kv_disk_gb)
        check_write_policy(self.kv_store_write_policy, threshold=self.kv_store_write_threshold)
        if self.prefill_replicas < 0:
            raise ValueError(f"prefill_replicas must be >= 0, got {self.prefill_replicas}")
        options.check_kv_transfer(self.kv_transfer)
        if self.prefill_replicas and self.kv_transfer == "store" and not self.kv_store:
            raise ValueError("--prefill-replicas with --kv-transfer store hands KV blocks to the decode targets "
                             "through the KV store: give --kv-store redis://host:port/db too (a redis-server it may "
                             "use), or --kv-transfer direct")
        if self.expert_shards < 0:
            raise ValueError(f"expert_shards must be >= 0, got {self.expert_shards}")
        if self.speculative and self.draft:
            raise ValueError("give --speculative (in the target) or --draft (a draft service), not both")
        if len({bool(self.tls_cert), bool(self.tls_key), bool(self.tls_ca)}) > 1:
            raise ValueError("TLS needs all three of --tls-cert, --tls-key and --tls-ca (or none)")

    def target_addresses(self) -> list[str]:
        host, port = self.target_address.rsplit(":", 1)
        return [f"{host}:{int(port) + i}" for i in range(self.target_replicas)]

    def expert_addresses(self) -> list[str]:
        host, port = self.target_address.rsplit(":", 1)
        first = int(port) + self.target_replicas
        return [f"{host}:{first + i}" for i in range(self.expert_shards)]

    def prefill_addresses(self) -> list[str]:
        host, port = self.target_address.rsplit(":", 1)
        first = int(port) + self.target_replicas + self.expert_shards
        return [f"{host}:{first + i}" for i in range(self.prefill_replicas)]

    def kv_store_args(self, name: str, decode: bool = False) -> list[str]:
        """The block store flags of one target (`name`: its own sub-directory of the disk tier). A decode target
        of P/D with direct transfer keeps a host tier where prefill targets put the blocks (DIRECT_HOST_GB unless
        --kv-host-gb says otherwise). Prefill targets of P/D through the store write every block as it fills, whatever
        the write policy of the others."""
        host = self.kv_host_gb
        if decode and self.prefill_replicas and self.kv_transfer == "direct":
            host = host or DIRECT_HOST_GB
        out = ["--kv-host-gb", str(host)] if host else []
        if self.kv_disk_dir:
            out += ["--kv-disk-dir", os.path.join(self.kv_disk_dir, name), "--kv-disk-gb", str(self.kv_disk_gb)]
        if self.kv_store:
            out += ["--kv-store", self.kv_store, "--kv-store-gb", str(self.kv_store_gb),
                    "--kv-store-ttl-s", str(self.kv_store_ttl_s)]
        if (self.kv_store or self.kv_disk_dir) and decode:
            out += ["--kv-store-write-policy", self.kv_store_write_policy,
                    "--kv-store-write-threshold", str(self.kv_store_write_threshold)]
        return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, ServeConfig)


@functools.cache
def _prctl():
    """libc's prctl, looked up in the launcher (never between fork and exec), or None off Linux."""
    if sys.platform != "linux":
        return None
    try:
        import ctypes
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def _die_with_parent() -> None:
    """In a child before it runs: Linux sends it SIGTERM when the launcher dies, even by SIGKILL, so that no
    service outlives `upesi serve`."""
    prctl = _prctl()
    if prctl is not None:
        prctl(1, signal.SIGTERM)                  # PR_SET_PDEATHSIG


def _child(args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-m", "services.cli", *args], start_new_session=True,
                         preexec_fn=_die_with_parent if _prctl() is not None else None,
                         env=None if env is None else {**os.environ, **env})
    p.upesi_command = (args, env)                    # to start it again (_wait_healthy)
    return p


def _expert_env(cfg: ServeConfig) -> dict[str, str] | None:
    """With expert shards the target waits on RPCs 2 * layers times a step: OpenMP workers that spin while it waits
    would take the cores the shards compute on (x6 step time at batch 1 on 2 cores), so they sleep instead."""
    return {"OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")} if cfg.expert_shards else None


def _turns_env(cfg: ServeConfig, env: dict[str, str] | None) -> dict[str, str] | None:
    """With a draft service, the draft proposes while the target waits, then the target verifies while the draft
    waits, on the same cores: the OpenMP workers of both spin only briefly after a parallel region (libgomp's
    default spins for about a millisecond) and then sleep, so that neither holds a core through the other's turn
    (the gaps between the regions of one step are far shorter)."""
    if not cfg.draft or (env and "OMP_WAIT_POLICY" in env):      # expert shards: the workers sleep at once
        return env
    return {**(env or {}), "GOMP_SPINCOUNT": os.environ.get("GOMP_SPINCOUNT", "20000")}


def _tls_args(cfg: ServeConfig, client: bool) -> list[str]:
    """TLS flags of a child: the same certificate serves and, with mutual TLS, is presented as a client certificate.
    `client`: the child calls other services (router, target)."""
    if not cfg.tls_cert:
        return []
    out = ["--tls-cert", cfg.tls_cert, "--tls-key", cfg.tls_key]
    if cfg.tls_client_auth:
        out += ["--tls-client-ca", cfg.tls_ca]
    if client:
        out += ["--tls-ca", cfg.tls_ca]
        if cfg.tls_client_auth:
            out += ["--tls-client-cert", cfg.tls_cert, "--tls-client-key", cfg.tls_key]
    return out


def _client_tls(cfg: ServeConfig):
    from shared.rpc.channel import ClientTLS
    mutual = cfg.tls_cert and cfg.tls_client_auth
    return ClientTLS(cfg.tls_ca, cfg.tls_cert if mutual else None, cfg.tls_key if mutual else None)


def _wait_healthy(address: str, procs: list[subprocess.Popen], timeout_s: float, tls=None) -> None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from shared.rpc.channel import sync_channel

    deadline = time.monotonic() + timeout_s
    restarted: set[int] = set()
    with sync_channel(address, tls, trace=False) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while time.monotonic() < deadline:
            for i, p in enumerate(procs):
                if p.poll() is None:
                    continue
                if p.returncode < 0 and i not in restarted:
                    # killed by a signal while starting (a crash: a thread or a file the system refused for a
                    # moment): started once more; an exit with a code (bad flags, a missing model) is final
                    print(f"upesi: a service died of signal {-p.returncode} while starting; starting it again: "
                          f"{p.args[3:]}", file=sys.stderr, flush=True)
                    restarted.add(i)
                    procs[i] = _child(*p.upesi_command)
                    continue
                raise RuntimeError(f"a service exited with code {p.returncode} while starting: {p.args[3:]}")
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=1)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.3)
    raise TimeoutError(f"the stack did not become healthy on {address} within {timeout_s:.0f} s")


def _stop(procs: list[subprocess.Popen], grace_s: float = 35.0) -> None:
    """Router first: it stops taking requests and drains its streams while the services behind it still run; then the
    rest together. Each gets SIGTERM (graceful drain, up to 30 s in run_server) and is killed past `grace_s`."""
    def stop(group: list[subprocess.Popen]) -> None:
        for p in group:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for p in group:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    if procs:
        stop(procs[-1:])                           # the router is started last
        stop(procs[:-1])


@dataclass(frozen=True, slots=True)
class Child:
    """A service the launcher starts, and starts again when it dies (its callers reconnect)."""
    name: str
    address: str
    command: list[str]


def _children(cfg: ServeConfig) -> list[Child]:
    """The stack's restartable services in start order: expert shards, the draft service, targets, prefill targets.
    A target that is restarted loses its running requests and its cache; the router routes around it meanwhile
    (services/router/frontend.py) and takes it back once it answers."""
    model = ["--model", cfg.model] if cfg.model else []
    overrides = ["--hf-overrides", cfg.hf_overrides] if cfg.hf_overrides else []     # targets' and shards' models
    threads = ["--num-threads", str(cfg.num_threads)] if cfg.num_threads else []
    threads += ["--wide-threads", str(cfg.wide_threads)] if cfg.wide_threads else []
    registry = ["--registry", cfg.registry] if cfg.registry else []
    placement = ["--expert-placement", cfg.expert_placement] if cfg.expert_placement else []
    quant = ["--nvfp4-act-quant"] if cfg.nvfp4_act_quant else []            # targets and shards alike
    gguf = ["--dequantise-gguf"] if cfg.dequantise_gguf else []             # targets
    out = []
    # the shards share this machine's cores with the target
    shard_threads = str(cfg.num_threads or max(1, (os.cpu_count() or 1) // (cfg.expert_shards + 1)))
    for i, address in enumerate(cfg.expert_addresses()):
        out.append(Child(f"expert shard {i}", address, [
            "experts", "--address", address, "--shard-index", str(i), "--num-shards", str(cfg.expert_shards),
            "--device", cfg.device, "--dtype", cfg.dtype, "--num-threads", shard_threads, *model, *overrides,
            *placement, *quant, *_tls_args(cfg, client=False), "--metrics-port",
            str(cfg.expert_metrics_port + i if cfg.expert_metrics_port else 0)]))
    experts = ["--expert-shards", ",".join(cfg.expert_addresses()), *placement] if cfg.expert_shards else []
    if experts and cfg.rebalance_interval_s:
        experts += ["--rebalance-interval-s", str(cfg.rebalance_interval_s)]
    spec = ["--num-speculative-tokens", str(cfg.num_speculative_tokens),
            "--adaptive-speculation", str(cfg.adaptive_speculation).lower(),
            "--speculative-max-seqs", str(cfg.speculative_max_seqs), "--stream-interval", str(cfg.stream_interval)]
    confidence = [] if cfg.draft_confidence is None else ["--draft-confidence", str(cfg.draft_confidence)]
    if cfg.draft_tree_nodes is not None:
        confidence += ["--draft-tree-nodes", str(cfg.draft_tree_nodes)]
    if cfg.draft_tree_ngram is not None:
        confidence += ["--draft-tree-ngram", str(cfg.draft_tree_ngram)]
    if cfg.speculative:
        spec += ["--speculative", cfg.speculative, *confidence]
    if cfg.draft:
        out.append(Child("draft service", cfg.draft_address, [
            "draft", "--address", cfg.draft_address, "--proposer", cfg.draft, "--device", cfg.device,
            "--dtype", cfg.dtype, *confidence, "--metrics-port", str(cfg.draft_metrics_port),
            *_tls_args(cfg, client=True), *model, "--num-threads", str(cfg.draft_num_threads)]))
    # an EAGLE head in the draft service reads every prompt's hidden states, also of prefixes cached before it
    # first connected and of blocks a prefill target computed
    hidden = ["--capture-hidden"] if (cfg.draft or "").startswith("eagle:") else []
    common = ["--kv-cache-gb", str(cfg.kv_cache_gb), "--max-num-seqs", str(cfg.max_num_seqs), "--device", cfg.device,
              "--dtype", cfg.dtype, *model, *overrides, *threads]
    for i, address in enumerate(cfg.target_addresses()):
        out.append(Child(f"target {i}", address, [
            "target", "--address", address, "--replica-id", address, "--metrics-port", _metrics_port(cfg, i),
            *common, *registry, *experts, *spec, *quant, *gguf, *cfg.kv_store_args(f"target-{i}", decode=True),
            *hidden, *_tls_args(cfg, client=True)]))
    for i, address in enumerate(cfg.prefill_addresses()):
        out.append(Child(f"prefill target {i}", address, [
            "target", "--address", address, "--replica-id", address,
            *(["--kv-store-sync"] if cfg.kv_transfer == "store" else []),
            "--metrics-port", _metrics_port(cfg, cfg.target_replicas + i), *common, *experts, *quant, *gguf,
            *cfg.kv_store_args(f"prefill-{i}"), *hidden, *_tls_args(cfg, client=True)]))
    return out


def _metrics_port(cfg: ServeConfig, i: int) -> str:
    """The /metrics port of the i-th target (decode targets first, then prefill targets); 0 = off."""
    return str(cfg.target_metrics_port + i if cfg.target_metrics_port else 0)


def _router_command(cfg: ServeConfig) -> list[str]:
    return ["router", "--address", cfg.address, "--http-host", cfg.http_host, "--http-port", str(cfg.http_port),
            "--target", ",".join(cfg.target_addresses()),
            *(["--prefill-target", ",".join(cfg.prefill_addresses()), "--kv-transfer", cfg.kv_transfer]
              if cfg.prefill_replicas else []),
            *(["--draft", cfg.draft_address, "--speculative-max-requests", str(cfg.speculative_max_requests)]
              if cfg.draft else []),
            *(["--model", cfg.model] if cfg.model else []), *(["--registry", cfg.registry] if cfg.registry else []),
            *_tls_args(cfg, client=True),
            *(["--served-model-name", cfg.served_model_name] if cfg.served_model_name else [])]


def _supervise(procs: list[subprocess.Popen], children: list[Child], env: dict[str, str] | None) -> None:
    """Restarts the children (procs[:len(children)]) when they die, a child that dies within a minute of its start
    after 1, 2, 4 ... 60 s; returns once a service that is not restarted (the router) has exited."""
    started = {i: time.monotonic() for i in range(len(children))}
    delay = {i: 0.0 for i in range(len(children))}
    restart_at: dict[int, float] = {}
    while True:
        now = time.monotonic()
        for i, child in enumerate(children):
            if procs[i].poll() is None:
                continue
            if i not in restart_at:
                delay[i] = min(60.0, max(1.0, 2 * delay[i])) if now - started[i] < 60 else 0.0
                restart_at[i] = now + delay[i]
                print(f"upesi: {child.name} exited (code {procs[i].returncode}); restarting it"
                      + (f" in {delay[i]:.0f} s" if delay[i] else ""), file=sys.stderr, flush=True)
            if now >= restart_at[i]:
                del restart_at[i]
                procs[i], started[i] = _child(child.command, env), now
                print(f"upesi: {child.name} on {child.address} (pid {procs[i].pid})", flush=True)
        dead = [p for p in procs[len(children):] if p.poll() is not None]
        if dead:
            print(f"upesi: a service exited (code {dead[0].returncode}); stopping the stack", file=sys.stderr)
            return
        time.sleep(0.5)


def main(args: argparse.Namespace) -> None:
    cfg = config_from_args(ServeConfig, args)
    # the services of this stack serve one another only: one token for them all, handed down in the environment
    # (never on a command line, where `ps` shows it); a value set beforehand is kept
    os.environ.setdefault(internal_token.ENV, secrets.token_hex(32))
    procs: list[subprocess.Popen] = []
    stopping = False

    def on_signal(signum, frame) -> None:
        nonlocal stopping
        if stopping:                              # a second Ctrl-C or SIGTERM: the stop already under way goes on
            return
        stopping = True
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        env = _turns_env(cfg, _expert_env(cfg))
        children = _children(cfg)
        for child in children:
            procs.append(_child(child.command, env))
            if child.name.startswith("expert shard"):
                print(f"upesi: {child.name} on {child.address} (pid {procs[-1].pid})", flush=True)
        for address in cfg.prefill_addresses():      # the router uses a prefill target once it answers
            _wait_healthy(address, procs, cfg.ready_timeout_s, _client_tls(cfg))
        procs.append(_child(_router_command(cfg)))
        _wait_healthy(cfg.address, procs, cfg.ready_timeout_s, _client_tls(cfg))
        print(f"upesi: serving on grpc://{cfg.address} and http://{cfg.http_host}:{cfg.http_port} "
              "(Ctrl-C to stop)", flush=True)
        _supervise(procs, children, env)
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
