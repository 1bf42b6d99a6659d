"""The command lines `upesi serve` starts its services with: each restartable child (expert shards, the draft
service, targets, prefill targets) and the router, built from the serve config (services/launcher.py starts and
supervises them)."""
from __future__ import annotations

import dataclasses
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from services.serve_config import ServeConfig
from services.router.config import RouterConfig
from services.target.config import TargetConfig
from shared.config import SECRET_OPTIONS, env_name

# Target settings the launcher composes itself (per replica, or only with other settings); every other setting
# ServeConfig shares by name with TargetConfig reaches every target as it is (forwarded)
TARGET_COMPOSED = frozenset({
    "address", "expert_shards", "expert_placement", "rebalance_interval_s", "registry", "kv_disk_dir", "kv_disk_gb",
    "kv_host_gb", "kv_store", "kv_store_gb", "kv_store_key", "kv_store_ttl_s", "kv_store_write_policy",
    "kv_store_write_threshold", "tls_ca", "tls_cert", "tls_key",
    "disable_kernels"})                 # the launcher sets the kernels' switches in the environment children inherit
ROUTER_COMPOSED = frozenset({"draft", "chat_template", "registry", "tls_ca", "tls_cert", "tls_key"})
# ... and those prefill-only targets do without: they compute prompts, never decode
DECODE_ONLY = frozenset({
    "speculative", "num_speculative_tokens", "adaptive_speculation", "speculation_guard", "lookup_speculation",
    "speculative_max_seqs", "num_lookup_tokens",
    "draft_confidence", "draft_tree_nodes", "draft_tree_ngram", "stream_interval"})


def forwarded(cfg: ServeConfig, to: type, skip: frozenset[str]) -> list[str]:
    """Flags for every setting `cfg` shares by name with the child's config class `to`, but `skip` and unset ones:
    an option declared in both configs (services/options.py) reaches the child with no edit here."""
    out = []
    for f in dataclasses.fields(to):
        if f.name in skip or not hasattr(cfg, f.name) or getattr(cfg, f.name) is None:
            continue
        value = getattr(cfg, f.name)
        text = (str(value).lower() if isinstance(value, bool) else ",".join(map(str, value))
                if isinstance(value, list) else str(value))
        out += ["--" + f.name.replace("_", "-"), text]
    return out


def hide_secrets(args: list[str]) -> tuple[list[str], dict[str, str]]:
    """A child's arguments without its secret options (shared.config.SECRET_OPTIONS), and the environment that
    gives them to it instead: `ps` and /proc/PID/cmdline show no key or password."""
    flags = {"--" + name.replace("_", "-"): env_name(name) for name in SECRET_OPTIONS}
    shown, secret, i = [], {}, 0
    while i < len(args):
        if args[i] in flags and i + 1 < len(args):
            secret[flags[args[i]]] = args[i + 1]
            i += 2
            continue
        shown.append(args[i])
        i += 1
    return shown, secret


def with_store_key(cfg: ServeConfig) -> ServeConfig:
    """cfg with a KV store key where its targets keep blocks on disk or in Redis and none was given: the disk tier's
    own (DIR/store.key, made once with mode 0600, so that a restarted stack reads its blocks again), else a new one
    for this run (blocks in Redis from an earlier run are then recomputed)."""
    if cfg.kv_store_key or not (cfg.kv_store or cfg.kv_disk_dir):
        return cfg
    key = secrets.token_hex(32)
    if cfg.kv_disk_dir:
        path = Path(cfg.kv_disk_dir) / "store.key"
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
                f.write(key)
        except FileExistsError:
            key = path.read_text().strip()
    return dataclasses.replace(cfg, kv_store_key=key)


def tls_args(cfg: ServeConfig, client: bool) -> list[str]:
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


@dataclass(frozen=True, slots=True)
class Child:
    """A service the launcher starts, and starts again when it dies (its callers reconnect)."""
    name: str
    address: str
    command: list[str]


def children(cfg: ServeConfig) -> list[Child]:
    """The stack's restartable services in start order: expert shards, the draft service, targets, prefill targets.
    A target that is restarted loses its running requests and its cache; the router routes around it meanwhile
    (services/router/frontend.py) and takes it back once it answers."""
    model = ["--model", cfg.model] if cfg.model else []
    overrides = ["--hf-overrides", cfg.hf_overrides] if cfg.hf_overrides else []     # targets' and shards' models
    registry = ["--registry", cfg.registry] if cfg.registry else []
    placement = ["--expert-placement", cfg.expert_placement] if cfg.expert_placement else []
    quant = ["--nvfp4-act-quant"] if cfg.nvfp4_act_quant else []            # shards (targets: forwarded)
    quant += ["--int8-activations"] if cfg.int8_activations else []
    out = []
    # the shards share this machine's cores with the target
    shard_threads = str(cfg.num_threads or max(1, (os.cpu_count() or 1) // (cfg.expert_shards + 1)))
    for i, address in enumerate(cfg.expert_addresses()):
        out.append(Child(f"expert shard {i}", address, [
            "experts", "--address", address, "--shard-index", str(i), "--num-shards", str(cfg.expert_shards),
            "--device", cfg.device, "--dtype", cfg.dtype, "--num-threads", shard_threads, *model, *overrides,
            *placement, *quant, *tls_args(cfg, client=False), "--metrics-port",
            str(cfg.expert_metrics_port + i if cfg.expert_metrics_port else 0)]))
    experts = ["--expert-shards", ",".join(cfg.expert_addresses()), *placement] if cfg.expert_shards else []
    if experts and cfg.rebalance_interval_s:
        experts += ["--rebalance-interval-s", str(cfg.rebalance_interval_s)]
    confidence = [] if cfg.draft_confidence is None else ["--draft-confidence", str(cfg.draft_confidence)]
    if cfg.draft_tree_nodes is not None:
        confidence += ["--draft-tree-nodes", str(cfg.draft_tree_nodes)]
    if cfg.draft_tree_ngram is not None:
        confidence += ["--draft-tree-ngram", str(cfg.draft_tree_ngram)]
    if cfg.draft:
        out.append(Child("draft service", cfg.draft_address, [
            "draft", "--address", cfg.draft_address, "--proposer", cfg.draft, "--device", cfg.device,
            "--dtype", cfg.dtype, *confidence, "--metrics-port", str(cfg.draft_metrics_port),
            *tls_args(cfg, client=True), *model, "--num-threads", str(cfg.draft_num_threads)]))
    # an EAGLE head in the draft service reads every prompt's hidden states, also of prefixes cached before it
    # first connected and of blocks a prefill target computed
    hidden = ["--capture-hidden"] if (cfg.draft or "").startswith("eagle:") else []
    decode = forwarded(cfg, TargetConfig, TARGET_COMPOSED)
    prefill = forwarded(cfg, TargetConfig, TARGET_COMPOSED | DECODE_ONLY)
    for i, address in enumerate(cfg.target_addresses()):
        out.append(Child(f"target {i}", address, [
            "target", "--address", address, "--replica-id", address, "--metrics-port", metrics_port(cfg, i),
            *decode, *registry, *experts, *cfg.kv_store_args(f"target-{i}", decode=True), *hidden,
            *tls_args(cfg, client=True)]))
    for i, address in enumerate(cfg.prefill_addresses()):
        out.append(Child(f"prefill target {i}", address, [
            "target", "--address", address, "--replica-id", address,
            *(["--kv-store-sync"] if cfg.kv_transfer == "store" else []),
            "--metrics-port", metrics_port(cfg, cfg.target_replicas + i), *prefill, *experts,
            *cfg.kv_store_args(f"prefill-{i}"), *hidden, *tls_args(cfg, client=True)]))
    return out


def metrics_port(cfg: ServeConfig, i: int) -> str:
    """The /metrics port of the i-th target (decode targets first, then prefill targets); 0 = off."""
    return str(cfg.target_metrics_port + i if cfg.target_metrics_port else 0)


def router_command(cfg: ServeConfig) -> list[str]:
    """The router's command line: the stack's addresses, and every setting ServeConfig shares with RouterConfig
    (forwarded) but `draft` (the router's is the draft service's address), the chat template (made absolute) and the
    secret and TLS ones (composed)."""
    return ["router", "--target", ",".join(cfg.target_addresses()),
            *forwarded(cfg, RouterConfig, ROUTER_COMPOSED),
            *(["--prefill-target", ",".join(cfg.prefill_addresses())] if cfg.prefill_replicas else []),
            *(["--draft", cfg.draft_address] if cfg.draft else []),
            *(["--registry", cfg.registry] if cfg.registry else []), *tls_args(cfg, client=True),
            *(["--chat-template", os.path.abspath(cfg.chat_template)] if cfg.chat_template else [])]
