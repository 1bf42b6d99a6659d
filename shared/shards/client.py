"""The target's side of expert parallelism: every layer's FFN work sent to expert shards over batched RPC.

The model reaches it through shared.shards.remote_ffn (`attach_expert_shards`). Per layer per forward step,
`ExpertsClient.run` groups the (token, unit) slots by shard (shared.model.placement), sends ONE Dispatch per shard
carrying all of its slots, to all shards at once (sync stubs' `.future()`, so it runs on the engine thread), and
sums what comes back (combine).

A shard that fails (UNAVAILABLE, or its deadline passes) is avoided for `retry_after_s`; its slots go to replicas on
other shards when every unit has one, else the step fails with PeerUnavailable (UNAVAILABLE to the client). gRPC
channels reconnect by themselves, so a shard that comes back serves again.

A frozen shard (stopped, swapping, hung) answers nothing, so waiting for the call's deadline would hold every step
for `timeout_s`. Each shard's calls are timed (seconds per row, a moving average); a call that takes STALL_FACTOR
times its expected time (at least STALL_FLOOR_S) is stalled. Where its slots have replicas on shards known to serve
the shard is failed over at once; where they have none the shard's health service is asked (PROBE_S): a shard that
answers is only slow and the call is awaited to its deadline, one that does not is failed fast, and the step with it.
A shard that failed stays in doubt until a call to it succeeds: once its `retry_after_s` has passed, steps send it
work again, but a slow call is never given up on in favour of a replica in doubt (which may still be down).

Shapes: T = tokens in the step, k = units per token, D = hidden, L = layers, E = units of a layer.
"""
from __future__ import annotations

import logging
import time
from functools import partial

import grpc
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from shared import telemetry, tensor_codec
from shared.errors import PeerUnavailable
from shared.model.config import ModelConfig
from shared.model.placement import Placement, Unit, combine, plan_dispatch, replica_table
from shared.rpc.channel import sync_channel
from shared.shards.metrics import EXPERT_TOKENS, RPC_SECONDS, RPCS, STALLS, WIRE_BYTES
from upesi.v1 import experts_pb2, experts_pb2_grpc

log = logging.getLogger("upesi.remote_ffn")

_FAILOVER = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
STALL_FACTOR = 10.0       # a call this many times its expected time is stalled ...
STALL_FLOOR_S = 0.1       # ... and at least this long
PROBE_S = 1.0             # the health check of a stalled shard whose slots have no replica
_ROW_PAD = 32             # a call's cost in rows: its rows plus this (the fixed part of a call)
_EWMA = 0.1


class _Stalled(grpc.RpcError):
    """A call given up on before its deadline (as the failed calls' errors: code() and details())."""

    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.DEADLINE_EXCEEDED

    def details(self) -> str:
        return self.why


def _pb(t: torch.Tensor) -> experts_pb2.Tensor:
    dtype, shape, data = tensor_codec.encode(t)
    return experts_pb2.Tensor(dtype=dtype, shape=shape, data=data)


class ExpertsClient:
    """Channels to the shards, the placement, dispatch / combine with fail-over, and the measured load.

    `dense_layers[l]` says whether layer l is a dense FFN (split in num_shards slices) or an MoE layer."""

    def __init__(self, addresses: list[str], placement: Placement, dense_layers: list[bool], timeout_s: float = 5.0,
                 retry_after_s: float = 1.0) -> None:
        if len(addresses) != placement.num_shards:
            raise ValueError(f"{len(addresses)} expert shard addresses but the placement has {placement.num_shards}")
        self.addresses, self.placement, self.dense_layers = addresses, placement, dense_layers
        self.timeout_s, self.retry_after_s = timeout_s, retry_after_s
        # TLS as this service is set up; trace context goes in per step (telemetry.StepScope), not per call
        # (every channel reconnects within 0.2-2 s: shared.rpc.channel.reconnect_options)
        self.channels = [sync_channel(a, trace=False) for a in addresses]
        self.stubs = [experts_pb2_grpc.ExpertsStub(ch) for ch in self.channels]
        self.health = [health_pb2_grpc.HealthStub(ch) for ch in self.channels]
        self._per_row: list[float | None] = [None] * len(addresses)     # seconds per padded row, moving average
        n, layers = placement.num_shards, len(dense_layers)
        self.num_rpcs = 0                                          # Dispatch calls sent, every shard and attempt
        self.rpcs_per_shard = [0] * n
        self.bytes_sent = self.bytes_received = 0
        self.tokens = {True: torch.zeros(layers, n, dtype=torch.int64),                       # [L, N] dense slices
                       False: torch.zeros(layers, max(placement.num_experts, 1), dtype=torch.int64)}   # [L, E]
        self._down_until = [0.0] * n
        self._in_doubt = [False] * n                      # failed, and no call has succeeded since
        self._replicas: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self._dense_plans: dict[tuple, dict] = {}
        self._ok = [RPCS.labels(str(s), "OK") for s in range(n)]
        self._seconds = [RPC_SECONDS.labels(str(s)) for s in range(n)]
        self._sent, self._received = WIRE_BYTES.labels("sent"), WIRE_BYTES.labels("received")
        EXPERT_TOKENS.clients.add(self)

    # ---------------------------------------------------------------- start-up and placement
    def wait_ready(self, cfg: ModelConfig, timeout_s: float) -> list[experts_pb2.ShardInfoResponse]:
        """Waits for every shard to serve and checks it serves this model with this placement."""
        deadline = time.monotonic() + timeout_s
        infos = []
        for i, stub in enumerate(self.stubs):
            try:
                info = stub.Info(experts_pb2.ShardInfoRequest(), wait_for_ready=True,
                                 timeout=max(1.0, deadline - time.monotonic()))
            except grpc.RpcError as e:
                raise PeerUnavailable(f"expert shard {i} at {self.addresses[i]} did not come up: "
                                      f"{e.details()}") from None
            want = (i, self.placement.num_shards, cfg.num_layers, cfg.hidden_size, self.placement.num_experts)
            got = (info.shard_index, info.num_shards, info.num_layers, info.hidden_size, info.num_experts)
            if got != want:
                raise ValueError(f"expert shard at {self.addresses[i]} serves (shard, shards, layers, hidden, experts) "
                                 f"= {got}, the target expects {want}: check --expert-shards order and the model")
            infos.append(info)
        return infos

    def shard_info(self) -> list[experts_pb2.ShardInfoResponse]:
        return [stub.Info(experts_pb2.ShardInfoRequest(), timeout=self.timeout_s) for stub in self.stubs]

    def apply_placement(self, new: Placement, timeout_s: float = 600.0) -> dict[int, int]:
        """Has every shard load the units `new` adds to it (LoadExperts), then switches to `new`.
        Returns units loaded per shard. Outputs do not change: replicas hold the same weights."""
        if (new.num_shards, new.num_experts) != (self.placement.num_shards, self.placement.num_experts):
            raise ValueError("a new placement must keep the number of shards and experts")
        added: dict[int, list[Unit]] = {}
        for layer, dense in enumerate(self.dense_layers):
            for u in range(new.num_units(dense)):
                for s in set(new.shards(layer, u, dense)) - set(self.placement.shards(layer, u, dense)):
                    added.setdefault(s, []).append((layer, u))
        futures = {s: self.stubs[s].LoadExperts.future(experts_pb2.LoadExpertsRequest(
            experts=[experts_pb2.ExpertRef(layer=layer, expert=u) for layer, u in units]), timeout=timeout_s)
            for s, units in added.items()}
        loaded = {s: f.result().loaded for s, f in futures.items()}
        # One reference swap: a step in flight may finish on the old placement, whose units all stay loaded. The
        # placement is written before the caches and readers (another thread) read a cache before the placement, so
        # a cache never gets an entry of a placement older than itself.
        self.placement, self._replicas, self._dense_plans = new, {}, {}
        return loaded

    # ---------------------------------------------------------------- one layer, one step
    def run(self, layer: int, hidden: torch.Tensor, unit_ids: torch.Tensor, weights: torch.Tensor | None
            ) -> torch.Tensor:
        """hidden [T, D], unit_ids [T, k], weights [T, k] (None = 1) -> sum_j w[t, j] unit_{ids[t, j]}(hidden[t])."""
        t = hidden.shape[0]
        if t == 0:
            return torch.zeros_like(hidden)
        dense = self.dense_layers[layer]
        x = hidden.detach().to("cpu")                                          # [T, D]
        ids = unit_ids.to("cpu")                                               # [T, k]
        flat_ids = ids.reshape(-1).to(torch.int32)                             # [T k]
        flat_w = None if weights is None else weights.detach().to("cpu", torch.float32).reshape(-1)
        if dense:
            self.tokens[True][layer] += t
        else:
            self.tokens[False][layer] += torch.bincount(flat_ids, minlength=self.tokens[False].shape[1])
        plan = self._plan(layer, dense, ids)
        parts, failed = self._send(layer, x, flat_ids, flat_w, plan)
        if failed:
            # the shards that just failed, whatever their avoid window says: waiting on the others may outlast it
            avoid = self._avoid() | frozenset(failed)
            retry = torch.cat([plan[s].slots for s in failed])
            table = self.placement.table(layer, dense)
            stuck = [u for u in torch.unique(flat_ids[retry].long()).tolist() if set(table[u]) <= avoid]
            if stuck:
                s, err = next(iter(failed.items()))
                raise PeerUnavailable(f"expert shard {s} at {self.addresses[s]} is unavailable ({err.code().name}: "
                                      f"{err.details()}) and layer {layer} unit {stuck[0]} has no replica") from None
            more, failed = self._send(layer, x, flat_ids, flat_w,
                                      plan_dispatch(ids, self._replica_table(layer, dense, avoid), retry))
            if failed:
                s, err = next(iter(failed.items()))
                raise PeerUnavailable(f"expert shards {sorted(failed)} are unavailable: {err.details()}") from None
            parts += more
        return combine(t, parts).to(hidden.device)

    def _send(self, layer: int, x: torch.Tensor, flat_ids: torch.Tensor, flat_w: torch.Tensor | None, plan
              ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], dict[int, grpc.RpcError]]:
        calls = []
        scope = telemetry.current_step()
        md = scope.expert_dispatch_metadata(layer, x.shape[0], len(plan)) if scope is not None else None
        for s, ss in plan.items():                                             # all shards at once
            whole = ss.rows.numel() == x.shape[0]
            req = experts_pb2.DispatchRequest(
                layer=layer, hidden=_pb(x if whole else x[ss.rows]), expert_ids=_pb(flat_ids[ss.slots]),
                weights=None if flat_w is None else _pb(flat_w[ss.slots]),
                token_index=None if ss.one_row_per_slot else _pb(ss.slot_rows.to(torch.int32)))
            t0 = time.perf_counter()
            fut = self.stubs[s].Dispatch.future(req, timeout=self.timeout_s, metadata=md)
            fut.add_done_callback(partial(_observe, self._seconds[s], t0))
            self.num_rpcs += 1
            self.rpcs_per_shard[s] += 1
            size = req.ByteSize()
            self.bytes_sent += size
            self._sent.inc(size)
            calls.append((s, ss, fut, t0))
        parts, failed = [], {}
        for s, ss, fut, t0 in calls:
            try:
                resp = self._result(layer, s, flat_ids[ss.slots], ss.rows.numel(), fut, t0)
            except grpc.RpcError as e:
                RPCS.labels(str(s), "STALLED" if isinstance(e, _Stalled) else e.code().name).inc()
                if e.code() not in _FAILOVER:
                    raise PeerUnavailable(f"expert shard {s} at {self.addresses[s]} failed layer {layer}: "
                                          f"{e.code().name}: {e.details()}") from None
                log.warning("expert shard %d at %s: %s (%s); avoiding it for %.1f s", s, self.addresses[s],
                            e.code().name, e.details(), self.retry_after_s)
                self._down_until[s] = time.monotonic() + self.retry_after_s
                self._in_doubt[s] = True
                failed[s] = e
                continue
            self._ok[s].inc()
            self._in_doubt[s] = False
            size = resp.ByteSize()
            self.bytes_received += size
            self._received.inc(size)
            o = resp.output
            parts.append((ss.rows, tensor_codec.decode(o.dtype, list(o.shape), o.data)))
        return parts, failed

    def _result(self, layer: int, s: int, units: torch.Tensor, rows: int, fut, t0: float):
        """A Dispatch's reply; a call past its stall time (module doc) is given up on (_Stalled) where its units have
        replicas or the shard does not answer its health check, else awaited to its deadline."""
        est = self._per_row[s]
        if est is not None:
            stall = max(STALL_FLOOR_S, STALL_FACTOR * est * (rows + _ROW_PAD))
            if stall < self.timeout_s:
                try:
                    return self._timed(s, fut, rows, t0, stall - (time.perf_counter() - t0))
                except grpc.FutureTimeoutError:
                    if self._replicated(layer, s, units) or not self._answers(s):
                        fut.cancel()
                        STALLS.labels(str(s)).inc()
                        raise _Stalled(f"no reply in {time.perf_counter() - t0:.2f} s where "
                                       f"{est * (rows + _ROW_PAD):.3f} s was expected") from None
        return self._timed(s, fut, rows, t0, None)

    def _timed(self, s: int, fut, rows: int, t0: float, timeout: float | None):
        resp = fut.result(timeout=None if timeout is None else max(0.0, timeout))
        per_row = (time.perf_counter() - t0) / (rows + _ROW_PAD)
        old = self._per_row[s]
        self._per_row[s] = per_row if old is None else old + _EWMA * (per_row - old)
        return resp

    def _replicated(self, layer: int, s: int, units: torch.Tensor) -> bool:
        """Whether every unit of a call to shard s has a replica on a shard that is neither avoided nor in doubt."""
        table = self.placement.table(layer, self.dense_layers[layer])
        avoid = self._avoid() | {s} | {i for i, doubt in enumerate(self._in_doubt) if doubt}
        return all(not set(table[u]) <= avoid for u in torch.unique(units.long()).tolist())

    def _answers(self, s: int) -> bool:
        try:
            self.health[s].Check(health_pb2.HealthCheckRequest(), timeout=PROBE_S)
            return True
        except grpc.RpcError:
            return False

    def _plan(self, layer: int, dense: bool, ids: torch.Tensor) -> dict:
        avoid = self._avoid()
        if not dense:
            return plan_dispatch(ids, self._replica_table(layer, dense, avoid))
        plans = self._dense_plans                         # before the placement: see apply_placement
        key = (layer if layer in self.placement.layers else -1, avoid, ids.shape[0])
        plan = plans.get(key)                             # a dense layer's plan depends only on T
        if plan is None:
            plan = plans[key] = plan_dispatch(ids, self._replica_table(layer, dense, avoid))
        return plan

    def _avoid(self) -> frozenset[int]:
        now = time.monotonic()
        return frozenset(s for s, until in enumerate(self._down_until) if until > now)

    def _replica_table(self, layer: int, dense: bool, avoid: frozenset[int]) -> tuple[torch.Tensor, torch.Tensor]:
        cache = self._replicas                            # before the placement: see apply_placement
        p = self.placement
        key = (layer if layer in p.layers else -1, dense, avoid)
        table = cache.get(key)
        if table is None:
            table = cache[key] = replica_table(p.table(layer, dense), avoid)
        return table

    def close(self) -> None:
        for ch in self.channels:
            ch.close()


def _observe(hist, t0: float, fut) -> None:
    hist.observe(time.perf_counter() - t0)
