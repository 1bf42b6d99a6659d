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

from services.launcher_commands import Child, hide_secrets, router_command, with_store_key
from services.launcher_commands import children as launch_children
from services.serve_config import ServeConfig
from shared.config import add_config_arguments, config_from_args
from shared.model_files import resolve_model_path
from shared.ops import switches
from shared.rpc import internal_token, ports


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
    shown, secret = hide_secrets(args)
    env = {**(env or {}), **secret} or None
    p = subprocess.Popen([sys.executable, "-m", "services.cli", *shown], start_new_session=True,
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


def _check_ports(planned: list[tuple[str, str]]) -> None:
    """Raises RuntimeError naming every (service, address) of `planned` whose port another process holds: the
    stack would not start, or a service would be missing (targets, shards and prefill targets take the ports after
    --target-address)."""
    taken = [f"{name} on {address}" for name, address in planned if ports.in_use(address)]
    if taken:
        raise RuntimeError(f"another process holds the port of {', '.join(taken)}; choose free ports "
                           "(--address, --http-port, --target-address: replicas, expert shards and prefill targets "
                           "take the ports after it)")


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
    cfg = with_store_key(config_from_args(ServeConfig, args))
    switches.disable(cfg.disable_kernels)              # the services it starts inherit the kernels' switches
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
    resolve_model_path(cfg.model)                  # a missing model: one line now, not a traceback from each service
    try:
        env = _turns_env(cfg, _expert_env(cfg))
        children = launch_children(cfg)
        _check_ports([(c.name, c.address) for c in children] + [("router", cfg.address),
                                                                  ("HTTP", f"{cfg.http_host}:{cfg.http_port}")])
        for child in children:
            procs.append(_child(child.command, env))
            if child.name.startswith("expert shard"):
                print(f"upesi: {child.name} on {child.address} (pid {procs[-1].pid})", flush=True)
        for address in cfg.prefill_addresses():      # the router uses a prefill target once it answers
            _wait_healthy(address, procs, cfg.ready_timeout_s, _client_tls(cfg))
        procs.append(_child(router_command(cfg)))
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
