#!/usr/bin/env python
"""`make compose-test`: builds the images and runs compose.yaml as a user would, then checks it through the
published ports and tears it down.

Stages (each printed with its duration):
  1. tools: docker, dockerd, docker-compose and mmdebstrap, installed with apt-get where missing (needs root);
  2. daemon: a running Docker daemon, or one started here (`dockerd --default-ulimit nofile=20000:20000`, stopped
     again at the end);
  3. base images: Debian 12 with python3, and Redis, from Debian's packages (tests/compose/base_images.sh), unless
     --official-images (python:3.11-slim-bookworm and redis:7-alpine from the registry);
  4. image: `docker build` of the Dockerfile, with the torch CPU wheel and pip's certificate bundle in docker/local/
     where this host has them; prints the image's size;
  5. up: `docker-compose up -d` under a project of its own, the router's ports on free loopback ports, and a wait for
     every health check;
  6. checks: requests without the API key refused (gRPC and HTTP), gRPC Generate through server reflection (no
     stubs), the OpenAI API with the `openai` client (chat, streamed), /health and /metrics over HTTP;
  7. faults: SIGKILL to the expert shard experts-0 and to the draft: requests keep being answered (the other shard
     holds every FFN unit; the target decodes without drafts) and both containers come back (restart policy);
  8. prefill/decode: the `pd` profile's prefill target started beside the running stack (`--profile pd up -d
     target-prefill`); the router takes it up, prompts are prefilled there and their blocks sent to the target
     (the two targets' byte counters, read inside their containers);
  9. down: `docker-compose --profile pd down -v`, then no container, network or volume of the project is left.

    .venv/bin/python tests/compose/check_compose.py [--keep-images] [--official-images] [--timeout 900]

Exit status 0 when every check passed; on a failure the services' logs are printed before the teardown.
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from shared.testing.stack import free_port  # noqa: E402

PROJECT = "upesi-compose-test"
PYTHON_TAG, REDIS_TAG = "upesi-python:bookworm", "upesi-redis:bookworm"
IMAGE = "upesi:compose-test"
API_KEY = secrets.token_hex(16)          # the router's UPESI_API_KEY: every client call below carries it
LOCAL = ROOT / "docker" / "local"
TORCH = "torch==2.13.0"


class Failed(Exception):
    pass


def sh(*argv: str, check: bool = True, capture: bool = True, env: dict | None = None,
       timeout: float | None = None) -> subprocess.CompletedProcess:
    p = subprocess.run(argv, check=False, capture_output=capture, text=True, env=env, timeout=timeout)
    if check and p.returncode:
        raise Failed(f"{' '.join(argv)} exited {p.returncode}: {(p.stderr or '')[-2000:]}")
    return p


@contextmanager
def stage(name: str):
    t0 = time.monotonic()
    print(f"== {name}", flush=True)
    yield
    print(f"   {name}: {time.monotonic() - t0:.1f} s", flush=True)


# ---------------------------------------------------------------- 1-2: tools and daemon
def ensure_tools() -> None:
    missing = {"docker": "docker.io", "dockerd": "docker.io", "docker-compose": "docker-compose",
               "mmdebstrap": "mmdebstrap"}
    need = sorted({pkg for tool, pkg in missing.items() if shutil.which(tool) is None})
    if not need:
        print("   docker, dockerd, docker-compose, mmdebstrap: present")
        return
    if os.geteuid() != 0:
        raise Failed(f"missing {need}: install them (apt-get install {' '.join(need)}) or run as root")
    print(f"   apt-get install {' '.join(need)}")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    sh("apt-get", "update", "-q", env=env, timeout=600)
    sh("apt-get", "install", "-y", "-q", *need, env=env, timeout=1200)


def ensure_daemon(tmp: Path) -> subprocess.Popen | None:
    if sh("docker", "info", check=False).returncode == 0:
        print("   a Docker daemon is running")
        return None
    log = open(tmp / "dockerd.log", "w")
    proc = subprocess.Popen(["dockerd", "--default-ulimit", "nofile=20000:20000"], stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 60
    while sh("docker", "info", check=False).returncode:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise Failed(f"dockerd did not start: {(tmp / 'dockerd.log').read_text()[-2000:]}")
        time.sleep(0.5)
    print(f"   started dockerd (pid {proc.pid})")
    return proc


# ---------------------------------------------------------------- 3-4: images
def fill_local() -> str:
    """Puts the torch CPU wheel and pip's certificate bundle into docker/local/ where this host has them; returns
    the TORCH_INDEX build argument ("" when the wheel is there)."""
    LOCAL.mkdir(parents=True, exist_ok=True)
    cert = os.environ.get("PIP_CERT") or os.environ.get("SSL_CERT_FILE")
    if cert and Path(cert).is_file():
        shutil.copyfile(cert, LOCAL / "ca.crt")
        print(f"   pip's certificate bundle: {cert}")
    wheels = sorted(LOCAL.glob("torch-*+cpu-*.whl"))
    if not wheels:
        p = sh(sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--dest", str(LOCAL), TORCH, check=False,
               timeout=900)
        wheels = sorted(LOCAL.glob("torch-*+cpu-*.whl"))
        for other in set(LOCAL.glob("torch-*.whl")) - set(wheels):      # a CUDA build: leave it to the index
            other.unlink()
        if p.returncode and not wheels:
            print(f"   no torch wheel from pip: {p.stderr.strip()[-300:]}")
    if wheels:
        print(f"   torch from docker/local/{wheels[-1].name}")
        return ""
    return "https://download.pytorch.org/whl/cpu"


def build_image(python_image: str, torch_index: str) -> None:
    env = {**os.environ, "DOCKER_BUILDKIT": "0"}
    p = subprocess.run(["docker", "build", "-q", "--build-arg", f"PYTHON_IMAGE={python_image}", "--build-arg",
                        f"TORCH_INDEX={torch_index}", "-t", IMAGE, str(ROOT)], env=env, capture_output=True,
                       text=True, timeout=3600)
    if p.returncode:
        raise Failed(f"docker build failed:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    size = int(sh("docker", "image", "inspect", "-f", "{{.Size}}", IMAGE).stdout)
    print(f"   {IMAGE}: {size / 1e6:.0f} MB")


# ---------------------------------------------------------------- 5: up
class Compose:
    def __init__(self, env: dict[str, str]) -> None:
        self.env = env

    def __call__(self, *args: str, check: bool = True, timeout: float = 600) -> subprocess.CompletedProcess:
        return sh("docker-compose", "-p", PROJECT, "-f", str(ROOT / "compose.yaml"), *args, env=self.env,
                  check=check, timeout=timeout)

    def containers(self) -> dict[str, str]:
        """service -> container id."""
        ids = self("ps", "-q").stdout.split()
        out = {}
        for cid in ids:
            info = json.loads(sh("docker", "inspect", cid).stdout)[0]
            out[info["Config"]["Labels"]["com.docker.compose.service"]] = cid
        return out


def started_services(compose: Compose) -> set[str]:
    """The services a plain `up` starts: those in no profile (compose v1's `config --services` lists every one,
    the `pd` profile's prefill target included)."""
    import yaml
    spec = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]
    return {s for s in compose("config", "--services").stdout.split() if not spec.get(s, {}).get("profiles")}


def state(cid: str) -> dict:
    return json.loads(sh("docker", "inspect", cid).stdout)[0]["State"]


def wait_healthy(compose: Compose, services: set[str], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        found = compose.containers()
        health = {s: state(found[s]).get("Health", {}).get("Status", "none") if s in found else "absent"
                  for s in services}
        if all(h == "healthy" for h in health.values()):
            return
        if time.monotonic() > deadline:
            raise Failed(f"not healthy after {timeout:.0f} s: {health}")
        time.sleep(2)


# ---------------------------------------------------------------- 6: checks through the published ports
def generate_with_reflection(address: str, prompt: str, max_tokens: int, key: str | None = API_KEY) -> tuple[str, int]:
    """Generate through server reflection: the request type, the method and the reply come from the server; the
    call carries `key` as its bearer token (None: no key)."""
    import grpc
    from google.protobuf import descriptor_pool, message_factory
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    with grpc.insecure_channel(address) as channel:
        db = ProtoReflectionDescriptorDatabase(channel)
        services = db.get_services()
        if "upesi.v1.Generation" not in services:
            raise Failed(f"reflection lists {services}, not upesi.v1.Generation")
        pool = descriptor_pool.DescriptorPool(db)
        method = pool.FindServiceByName("upesi.v1.Generation").FindMethodByName("Generate")
        request_cls = message_factory.GetMessageClass(method.input_type)
        reply_cls = message_factory.GetMessageClass(method.output_type)
        call = channel.unary_unary("/upesi.v1.Generation/Generate", request_serializer=request_cls.SerializeToString,
                                   response_deserializer=reply_cls.FromString)
        metadata = None if key is None else (("authorization", f"Bearer {key}"),)
        reply = call(request_cls(prompt=prompt, max_tokens=max_tokens, temperature=0.0), timeout=120,
                     metadata=metadata)
    return reply.choices[0].text, reply.usage.completion_tokens


def check_api(grpc_port: int, http_port: int) -> None:
    import grpc
    import openai

    text, n = generate_with_reflection(f"127.0.0.1:{grpc_port}", "The capital of France is", 12)
    if n < 1 or not text.strip():
        raise Failed(f"gRPC Generate gave {n} tokens: {text!r}")
    print(f"   gRPC Generate (reflection): {n} tokens: {text.strip()[:60]!r}")

    refused = []                                       # compose requires the key: gRPC and HTTP without it
    try:
        generate_with_reflection(f"127.0.0.1:{grpc_port}", "Hello", 1, key=None)
    except grpc.RpcError as e:
        refused.append(e.code() == grpc.StatusCode.UNAUTHENTICATED)
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{http_port}/v1/models", timeout=10)
    except urllib.error.HTTPError as e:
        refused.append(e.code == 401)
    if refused != [True, True]:
        raise Failed(f"a request without the API key was not refused (gRPC, HTTP: {refused})")
    print("   without the API key: gRPC UNAUTHENTICATED, HTTP 401")

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key=API_KEY, max_retries=0,
                           timeout=120)
    model = client.models.list().data[0].id
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Say hello."}],
                                          max_tokens=16, temperature=0)
    answer = chat.choices[0].message.content or ""
    if not answer.strip() or chat.usage.completion_tokens < 1:
        raise Failed(f"chat completion empty: {chat}")
    parts = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Count to three."}], max_tokens=16, temperature=0,
        stream=True) if c.choices]
    if not "".join(parts).strip():
        raise Failed("streamed chat completion empty")
    print(f"   OpenAI API ({model}): chat {answer.strip()[:40]!r}, streamed {len(parts)} chunks")

    with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/health", timeout=10) as r:
        health = json.loads(r.read())
    with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics", timeout=10) as r:
        metrics = r.read().decode()
    names = {ln.split("{")[0].split(" ")[0] for ln in metrics.splitlines() if ln.startswith("upesi_")}
    if not names:
        raise Failed(f"/metrics has no upesi_ series: {metrics[:500]}")
    print(f"   /health {health.get('status', health)}; /metrics: {len(names)} upesi_ series")


# The targets' Redis users publish the registry and keep blocks; the router's reads the registry and nothing else.
_REDIS_PROBE = """
import os, redis
reg = redis.from_url(os.environ['UPESI_REGISTRY'])
kv = redis.from_url(os.environ.get('UPESI_KV_STORE') or os.environ['UPESI_REGISTRY'].rsplit('/', 1)[0] + '/1')
def allowed(call):
    try:
        call()
        return 'ok'
    except redis.exceptions.NoPermissionError:
        return 'refused'
print(reg.scard('upesi:reg:replicas'), allowed(lambda: (reg.sadd('upesi:reg:probe', 1), reg.delete('upesi:reg:probe'))),
      allowed(lambda: kv.exists('upesi:kv:probe')))
"""


def check_redis_roles(compose: Compose) -> None:
    found = compose.containers()
    got = {s: sh("docker", "exec", found[s], "python", "-c", _REDIS_PROBE, check=False) for s in ("target", "router")}
    seen = {s: g.stdout.split() for s, g in got.items()}
    for s, want in (("target", ["ok", "ok"]), ("router", ["refused", "refused"])):
        if len(seen[s]) != 3 or int(seen[s][0]) < 1 or seen[s][1:] != want:
            raise Failed(f"{s}'s Redis users: {got[s].stdout.strip() or got[s].stderr[-500:]} (want replicas >= 1, "
                         f"registry writes and KV reads {' / '.join(want)})")
    print(f"   Redis users: the target writes the registry ({seen['target'][0]} replicas) and reads KV blocks; the "
          "router reads the registry, and writing it or reading a block is refused")


# ---------------------------------------------------------------- 7: faults
def kill_and_recover(compose: Compose, grpc_port: int, services: list[str], timeout: float) -> None:
    before = compose.containers()
    restarts = {s: json.loads(sh("docker", "inspect", before[s]).stdout)[0]["RestartCount"] for s in services}
    for s in services:                                 # a crash: SIGKILL to the container's init from the host
        pid = state(before[s])["Pid"]
        os.kill(pid, 9)
        print(f"   SIGKILL {s} (host pid {pid})")
    latencies, t0 = [], time.monotonic()
    while time.monotonic() - t0 < 20:                  # the stack answers while they are down and restarting
        t = time.monotonic()
        text, n = generate_with_reflection(f"127.0.0.1:{grpc_port}", "Once upon a time", 8)
        if n < 1:
            raise Failed(f"empty answer while {services} restart")
        latencies.append(time.monotonic() - t)
    print(f"   {len(latencies)} requests answered in the 20 s after the kills, each in "
          f"{' '.join(f'{x:.1f}' for x in latencies)} s")
    wait_healthy(compose, set(services), timeout)
    after = compose.containers()
    for s in services:
        count = json.loads(sh("docker", "inspect", after[s]).stdout)[0]["RestartCount"]
        if after[s] != before[s] or count <= restarts[s]:
            raise Failed(f"{s} was not restarted in place by its restart policy (restarts {restarts[s]} -> {count})")
    print(f"   {', '.join(services)} restarted by their policy and healthy again")
    text, n = generate_with_reflection(f"127.0.0.1:{grpc_port}", "The capital of France is", 8)
    if n < 1:
        raise Failed("no answer after the restarts")


# ---------------------------------------------------------------- 8: prefill/decode (the pd profile)
def metric_in(cid: str, port: int, series: str) -> float:
    """A Prometheus series' sum read inside a container (the targets' metrics ports are not published)."""
    code = (f"import urllib.request; t = urllib.request.urlopen('http://127.0.0.1:{port}/metrics', timeout=10)"
            f".read().decode(); print(sum(float(x.split()[-1]) for x in t.splitlines() if x.startswith({series!r})))")
    return float(sh("docker", "exec", cid, "python", "-c", code).stdout.strip())


def check_prefill_decode(compose: Compose, grpc_port: int, timeout: float) -> None:
    compose("--profile", "pd", "up", "-d", "--no-build", "target-prefill", timeout=timeout + 120)
    wait_healthy(compose, {"target-prefill"}, timeout)
    found = compose.containers()
    sent, received = ('upesi_kv_store_bytes_total{direction="sent"}',
                      'upesi_kv_store_bytes_total{direction="received"}')
    deadline, tries = time.monotonic() + 120, 0
    while metric_in(found["target-prefill"], 8061, sent) <= 0:        # the router joins it once it answers Info
        if time.monotonic() > deadline:
            raise Failed(f"the prefill target sent no blocks after {tries} requests")
        tries += 1                                                     # a new prefix each time: no cache hit
        prompt = f"Request {tries}. " + "Summarise the history of the printing press in Europe. " * 6
        text, n = generate_with_reflection(f"127.0.0.1:{grpc_port}", prompt, 8)
        if n < 1:
            raise Failed(f"empty answer with the prefill target up: {text!r}")
    got = metric_in(found["target"], 8061, received)
    if got <= 0:
        raise Failed("the prefill target sent blocks but the target received none")
    print(f"   prefill target joined; after {tries} requests it had sent "
          f"{metric_in(found['target-prefill'], 8061, sent):.0f} bytes of KV blocks, the target received {got:.0f}")


# ---------------------------------------------------------------- 9: down
def leftovers() -> list[str]:
    label = f"label=com.docker.compose.project={PROJECT}"
    found = []
    for kind, cmd in (("container", ["docker", "ps", "-aq"]), ("network", ["docker", "network", "ls", "-q"]),
                      ("volume", ["docker", "volume", "ls", "-q"])):
        found += [f"{kind} {x}" for x in sh(*cmd, "--filter", label).stdout.split()]
    return found


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--official-images", action="store_true", help="base images from the registry (python, redis)")
    ap.add_argument("--keep-images", action="store_true", help="keep the Upesi image built here")
    ap.add_argument("--timeout", type=float, default=900, help="seconds to wait for the health checks")
    a = ap.parse_args()
    t_all = time.monotonic()
    tmp = Path(os.environ.get("TMPDIR", "/tmp")) / f"upesi-compose-{os.getpid()}"
    tmp.mkdir(parents=True, exist_ok=True)
    daemon = compose = None
    ok = False
    try:
        with stage("1. tools"):
            ensure_tools()
        with stage("2. daemon"):
            daemon = ensure_daemon(tmp)
        python_image, redis_image = ("python:3.11-slim-bookworm", "redis:7-alpine") if a.official_images else \
            (PYTHON_TAG, REDIS_TAG)
        if not a.official_images:
            with stage("3. base images (mmdebstrap)"):
                sh("bash", str(ROOT / "tests" / "compose" / "base_images.sh"), PYTHON_TAG, REDIS_TAG, capture=False,
                   timeout=1800)
        with stage("4. image"):
            build_image(python_image, fill_local())
        grpc_port, http_port = free_port(), free_port()
        env = {**os.environ, "UPESI_INTERNAL_TOKEN": secrets.token_hex(32), "UPESI_IMAGE": IMAGE,
               "UPESI_REDIS_TARGET_PASSWORD": secrets.token_hex(32), "UPESI_API_KEY": API_KEY,
               "UPESI_PYTHON_IMAGE": python_image, "UPESI_REDIS_IMAGE": redis_image,
               "UPESI_GRPC_PORT": str(grpc_port), "UPESI_HTTP_PORT": str(http_port)}
        compose = Compose(env)
        with stage("5. up"):
            compose("up", "-d", "--no-build", timeout=a.timeout + 120)
            services = started_services(compose)
            wait_healthy(compose, services, a.timeout)
            print(f"   healthy: {', '.join(sorted(services))}; router on 127.0.0.1:{grpc_port} and :{http_port}")
        with stage("6. checks"):
            check_api(grpc_port, http_port)
            check_redis_roles(compose)
        with stage("7. faults"):
            kill_and_recover(compose, grpc_port, ["experts-0", "draft"], a.timeout)
        with stage("8. prefill/decode (profile pd)"):
            check_prefill_decode(compose, grpc_port, a.timeout)
        ok = True
    except Failed as e:
        print(f"FAILED: {e}", flush=True)
        if compose is not None:
            print(compose("logs", "--no-color", "--tail", "40", check=False).stdout[-20000:])
    finally:
        if compose is not None:
            with stage("9. down"):
                compose("--profile", "pd", "down", "-v", "--remove-orphans", check=False)
                left = leftovers()
                if left:
                    print(f"FAILED: left behind: {left}")
                    ok = False
                else:
                    print("   no container, network or volume of the project left")
        if not a.keep_images:
            sh("docker", "image", "rm", IMAGE, check=False)
        if daemon is not None:
            daemon.terminate()
            try:
                daemon.wait(timeout=30)
            except subprocess.TimeoutExpired:
                daemon.kill()
            print(f"   stopped dockerd (pid {daemon.pid})")
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"compose test {'passed' if ok else 'FAILED'} in {time.monotonic() - t_all:.0f} s", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
