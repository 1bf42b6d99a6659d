"""Runs an LLMEngine on its own thread and serves many asyncio callers.

Callers `generate()` (an async iterator of Delta) and `abort()`. Requests and aborts cross into the engine
thread through a queue; deltas come back with loop.call_soon_threadsafe. The engine thread sleeps when idle.

Stream interval: a running request's new tokens reach its caller every `stream_interval` steps, merged into one
Delta per choice (its first tokens and its end at once). Each delivery costs the service's event loop, the
router and the client a message per request, on the cores the step needs; under load that is a quarter of a
step (docs/performance.md). 0 (auto) delivers every step while fewer than `AUTO_STREAMS` sequences run, then every
running // AUTO_STREAMS steps (4 at 32 sequences). SGLang's --stream-interval is the same idea, fixed. A request
a draft service relays (`relayed`) costs one more hop per message, in a third process; while the batch is too
big to speculate (above `speculative_max_seqs`) it is delivered at least every RELAY_INTERVAL steps (its relay
then carries nothing but output).

Give it a factory rather than a built engine where the caller is a service: the engine is then built on the
engine thread, so that one thread runs every torch operation of the process. libgomp (the OpenMP runtime of torch's
CPU builds) gives every thread that opens parallel regions its own team of workers, and once a process holds more
OpenMP threads than cores the workers sleep between regions instead of spinning, so a step then waits for them
dozens of times (a decode step on a second thread took about twice as long: docs/performance.md).
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Callable, TypeVar

from shared.engine.engine import Delta, LLMEngine
from shared.engine.engine_view import EngineInfo, EngineLoad, engine_info, engine_load
from shared.kv.block_codec import BlockLayout
from shared.errors import EngineDead, Overloaded
from shared.sampling_params import SamplingParams

log = logging.getLogger(__name__)
T = TypeVar("T")
AUTO_STREAMS = 8            # auto stream interval: one more step between a request's messages per this many running
RELAY_INTERVAL = 4          # the least interval of a relayed request that is not speculating (a batch above the limit)


def auto_interval(running: int) -> int:
    """The stream interval `stream_interval=0` gives at `running` sequences."""
    return max(1, running // AUTO_STREAMS)


class AsyncEngine:
    def __init__(self, engine: LLMEngine | Callable[[], LLMEngine],
                 on_step: Callable[[LLMEngine], None] | None = None, stream_interval: int = 0) -> None:
        """engine: an LLMEngine, or a function that builds one (called on the engine thread; its exception is
        raised here). stream_interval: steps between a running request's deliveries (0: by load)."""
        if stream_interval < 0:
            raise ValueError(f"stream_interval must be >= 0, got {stream_interval}")
        self.on_step = on_step
        self.stream_interval = stream_interval
        self._held: dict[str, tuple[int, dict[int, Delta]]] = {}   # request -> (steps held, choice -> Delta)
        self._delivered: set[str] = set()                           # requests whose first tokens went out
        self._relayed: set[str] = set()                             # requests a draft service relays
        self._inbox: queue.Queue = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stopped = threading.Event()
        self.error: BaseException | None = None
        self.engine: LLMEngine
        failed: list[BaseException] = []
        ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(engine, failed, ready), name="engine", daemon=True)
        self._thread.start()
        ready.wait()
        if failed:
            raise failed[0]

    async def generate(self, request_id: str, prompt: list[int], params: SamplingParams,
                       relayed: bool = False) -> AsyncIterator[Delta]:
        """Yields deltas until every choice of the request has finished. Cancelling the caller aborts it. relayed:
        a draft service forwards the deltas (see the stream interval)."""
        if self.error is not None or self._stopped.is_set():
            raise EngineDead(f"the engine has stopped: {self.error}")
        loop = asyncio.get_running_loop()
        out: asyncio.Queue = asyncio.Queue()
        done = asyncio.get_running_loop().create_future()
        self._inbox.put(("add", request_id, prompt, params, loop, out, done, relayed))
        remaining = params.n
        try:
            try:
                await done                            # raises InvalidRequest from the engine thread
            except asyncio.CancelledError:
                raise                                 # the caller left before admission: aborted below
            except BaseException:
                remaining = 0                         # refused: nothing to abort
                raise
            while remaining:
                item = await out.get()
                if isinstance(item, BaseException):
                    raise EngineDead(f"the engine failed: {item}") from item
                if item.finish_reason is not None:
                    remaining -= 1
                yield item
        finally:
            if remaining:
                self.abort(request_id)

    # ---------------------------------------------------------------- what services read (shared.engine.engine_view)
    def info(self) -> EngineInfo:
        return engine_info(self.engine)

    def load(self) -> EngineLoad:
        return engine_load(self.engine)

    @property
    def block_layout(self) -> BlockLayout:
        """What a KV block's bytes mean here (blocks sent to or received from other targets)."""
        return self.engine.block_layout

    @property
    def keeps_received_blocks(self) -> bool:
        """Whether blocks other targets send are kept (a host tier)."""
        return self.engine.kv_store is not None and self.engine.kv_store.host is not None

    def wrap_proposer(self, wrap: Callable[[object], T]) -> T:
        """Replaces the engine's proposer with wrap(proposer), before serving (the target's mux of draft
        streams); returns it."""
        self.engine.proposer = wrap(self.engine.proposer)
        return self.engine.proposer

    def abort(self, request_id: str, indices: list[int] | None = None) -> None:
        self._inbox.put(("abort", request_id, indices))

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """fn(engine) run on the engine thread between two steps (it may read or change the cache), its result or
        its exception back here."""
        if self.error is not None or self._stopped.is_set():
            raise EngineDead(f"the engine has stopped: {self.error}")
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        self._inbox.put(("call", fn, loop, done))
        return await done

    def stop(self) -> None:
        self._stopped.set()
        self._inbox.put(("stop",))
        self._thread.join(timeout=10)

    # ---------------------------------------------------------------- engine thread
    def _run(self, engine, failed: list[BaseException], ready: threading.Event) -> None:
        try:
            self.engine = engine if isinstance(engine, LLMEngine) else engine()
        except BaseException as e:              # raised again by __init__ on the caller's thread
            failed.append(e)
            return
        finally:
            ready.set()
        self._loop()

    def _loop(self) -> None:
        eng = self.engine
        try:
            while not self._stopped.is_set():
                block = not eng.has_unfinished()
                try:
                    while True:
                        self._handle(self._inbox.get(block=block, timeout=None if block else 0))
                        block = False
                except queue.Empty:
                    pass
                if self._stopped.is_set():
                    break
                try:
                    deltas = eng.step()
                except Exception as e:            # one bad step fails the requests in flight, not the service
                    log.exception("engine step failed; failing the requests in flight")
                    self._fail_all(e)
                    continue
                self._deliver(self._coalesce(deltas))
                if self.on_step:
                    self.on_step(eng)
        except BaseException as e:   # keep the process up; fail every open stream with UNAVAILABLE
            log.exception("engine thread failed")
            self.error = e
            for loop, q in list(self._streams.values()):
                _post(loop, q.put_nowait, e)

    def _coalesce(self, deltas: list[Delta]) -> list[Delta]:
        """A step's deltas -> those to deliver now; the rest are held and merged (see the stream interval)."""
        running = len(self.engine.scheduler.running)
        k = self.stream_interval or auto_interval(running)
        limit = self.engine.cfg.speculative_max_seqs
        slow_relay = RELAY_INTERVAL if self._relayed and 0 < limit < running else 1
        if k == 1 and slow_relay == 1 and not self._held:
            return deltas
        by_rid: dict[str, list[Delta]] = {}
        for d in deltas:
            by_rid.setdefault(d.request_id, []).append(d)
        out: list[Delta] = []
        for rid, ds in by_rid.items():
            steps, pending = self._held.pop(rid, (0, {}))
            for d in ds:
                prev = pending.get(d.index)
                pending[d.index] = d if prev is None else replace(d, token_ids=prev.token_ids + d.token_ids)
            every = max(k, slow_relay) if rid in self._relayed else k
            if steps + 1 >= every or rid not in self._delivered or any(d.finish_reason for d in pending.values()):
                out.extend(pending.values())
            else:
                self._held[rid] = (steps + 1, pending)
        return out

    def _fail_all(self, err: Exception) -> None:
        self._held.clear()
        self._delivered.clear()
        self._relayed.clear()
        for rid in list(self.engine.requests):
            self.engine.abort(rid)
        for loop, q in list(self._streams.values()):
            _post(loop, q.put_nowait, err)
        self._streams.clear()

    def _handle(self, msg: tuple) -> None:
        if msg[0] == "add":
            _, rid, prompt, params, loop, out, done, relayed = msg
            try:
                waiting = len(self.engine.scheduler.waiting)
                if waiting >= self.engine.cfg.max_waiting_seqs:      # backpressure: the caller retries elsewhere
                    raise Overloaded(f"{waiting} sequences are already waiting for a batch slot "
                                     f"(max_waiting_seqs); try again later")
                self.engine.add_request(rid, prompt, params)
            except Exception as e:
                _post(loop, _settle, done, e)
                return
            self._streams[rid] = (loop, out)
            if relayed:
                self._relayed.add(rid)
            if not _post(loop, _settle, done, None):          # the caller's event loop is gone: nobody reads it
                self._streams.pop(rid, None)
                self._relayed.discard(rid)
                self.engine.abort(rid)
        elif msg[0] == "abort":
            self._deliver(self._coalesce(self.engine.abort(msg[1], msg[2])))
        elif msg[0] == "call":
            _, fn, loop, done = msg
            try:
                result = fn(self.engine)
            except Exception as e:
                _post(loop, _settle, done, e)
                return
            _post(loop, _settle, done, None, result)

    def _deliver(self, deltas: list[Delta]) -> None:
        """Hands a step's deltas to their streams: one wake-up per caller's event loop, not one per delta."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Delta]]] = {}
        for d in deltas:
            self._delivered.add(d.request_id)
            entry = self._streams.get(d.request_id)
            if entry is not None:
                by_loop.setdefault(entry[0], []).append((entry[1], d))
        for loop, items in by_loop.items():
            if not _post(loop, _put_all, items):          # that loop has closed: nobody reads these streams
                for _, d in items:
                    self._streams.pop(d.request_id, None)
                    self.engine.abort(d.request_id)
        for rid in {d.request_id for d in deltas if d.finish_reason}:
            if rid not in self.engine.requests:
                self._streams.pop(rid, None)
                self._delivered.discard(rid)
                self._relayed.discard(rid)
                self._held.pop(rid, None)


def _put_all(items: list[tuple[asyncio.Queue, Delta]]) -> None:
    for q, d in items:
        q.put_nowait(d)


def _post(loop: asyncio.AbstractEventLoop, fn: Callable, *args) -> bool:
    """Runs fn(*args) on a caller's event loop; False where that loop has closed (its caller is gone), which must
    never stop the engine thread."""
    try:
        loop.call_soon_threadsafe(fn, *args)
        return True
    except RuntimeError:
        return False


def _settle(fut: asyncio.Future, err: BaseException | None, result: object = None) -> None:
    if fut.done():
        return
    if err is None:
        fut.set_result(result)
    else:
        fut.set_exception(err)
