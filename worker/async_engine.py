"""AsyncEngine: the step loop in its own thread, streaming outputs to asyncio callers.

Requests are validated off the engine thread (a bad one raises to its caller and never
reaches the loop); adds and aborts are handed to the engine thread through a queue, so the
engine itself stays single-threaded.

Bounds: requests handed over but not yet queued by the engine count against its
``max_waiting`` (so a burst cannot grow the command queue past it), and at most
``MAX_PENDING_CALLS`` ``call``s wait at once; both refuse with QueueFullError. Aborts and
releases are never refused: each belongs to a stream that was admitted.

A request that fails on its own (non-finite logits, a sampling or detokenizer error) ends
with finish_reason "error"; only an engine-wide failure stops the loop, and then
``on_death`` callbacks run (a server turns its health NOT_SERVING).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator

from kvmesh.worker.engine import LLMEngine, Prompt, QueueFullError
from kvmesh.worker.outputs import RequestOutput
from kvmesh.worker.sampling_params import SamplingParams

logger = logging.getLogger("kvmesh.async_engine")

MAX_PENDING_CALLS = 256  # ``call``s handed to the engine thread and not yet answered


class EngineDeadError(RuntimeError):
    """The engine loop stopped (shutdown or a crash); no more requests can run."""


class AsyncEngine:
    def __init__(self, engine: LLMEngine | None = None, **engine_args):
        self.engine = engine if engine is not None else LLMEngine(**engine_args)
        if self.engine.driver is not None:
            raise RuntimeError("this LLMEngine is already driven by another AsyncEngine")
        self.engine.driver = self
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()
        self._stopped = False
        self._pending_adds = 0  # "add" commands sent and not yet applied (under _lock)
        self._pending_calls = 0  # "call" commands sent and not yet run (under _lock)
        self._on_death: list = []
        self.error: BaseException | None = None
        # the engine's stats after its latest step, and an event set whenever a request
        # finished: a load reporter reads these without waiting for a step boundary
        self.last_stats = None
        self.request_finished = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kvmesh-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ caller side

    async def generate(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        peers: list[str] | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs. Leaving the loop early (break, cancel) aborts it.
        ``peers``: KVTransfer addresses that may hold this prompt's pages (a router hint)."""
        if isinstance(prompt, str) and len(prompt) > 4096:
            # tokenizing a long text takes milliseconds: not on the caller's event loop
            req = await asyncio.to_thread(
                self.engine.make_request, prompt, params, request_id, peers=peers
            )
        else:
            req = self.engine.make_request(prompt, params, request_id, peers=peers)
        q: asyncio.Queue = asyncio.Queue()
        limit = self.engine.scheduler_config.max_waiting
        with self._lock:  # _abort_all takes the same lock: a stream is failed or never added
            if self._stopped:
                raise EngineDeadError("the engine is shut down")
            if req.request_id in self._streams:
                raise ValueError(f"request id {req.request_id!r} is already in use")
            if self._pending_adds + len(self.engine.scheduler.waiting) >= limit:
                raise QueueFullError(f"the waiting queue is full ({limit} requests)")
            self._streams[req.request_id] = (asyncio.get_running_loop(), q)
            self._pending_adds += 1
            self._send(("add", req))
        finished = False
        try:
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if finished:
                with self._lock:
                    self._streams.pop(req.request_id, None)
            else:
                # the id stays reserved until the engine thread has aborted the request, so a
                # new stream reusing it never receives the old request's outputs
                self._send(("release", req.request_id))

    def abort(self, request_id: str) -> None:
        self._send(("abort", request_id))

    def shutdown(self, timeout: float = 10.0) -> None:
        with self._lock:
            self._stopped = True
        self._send(("stop", None))
        self._thread.join(timeout)
        if not self._thread.is_alive():  # else the thread may still step the engine
            self.engine.driver = None

    def on_death(self, callback) -> None:
        """Run ``callback(error)`` (on the engine thread) if the loop crashes; at once when it
        already has."""
        with self._lock:
            if self.error is None:
                self._on_death.append(callback)
                return
        callback(self.error)

    def call(self, fn, timeout: float = 30.0):
        """Run ``fn(engine)`` on the engine thread between steps and return its result.
        Raises QueueFullError when ``MAX_PENDING_CALLS`` calls already wait, EngineDeadError
        when the loop has stopped."""
        done = threading.Event()
        box: list = []

        def run(engine):
            try:
                box.append((True, fn(engine)))
            except BaseException as e:  # handed back to the caller
                box.append((False, e))
            done.set()

        with self._lock:
            if self._stopped:
                raise EngineDeadError("the engine is shut down")
            if self._pending_calls >= MAX_PENDING_CALLS:
                raise QueueFullError(
                    f"{MAX_PENDING_CALLS} calls already wait for the engine thread"
                )
            self._pending_calls += 1
        self._send(("call", run))
        if not done.wait(timeout):
            raise TimeoutError("the engine thread did not answer")
        ok, val = box[0]
        if not ok:
            raise val
        return val

    def _send(self, cmd) -> None:
        self._commands.put(cmd)
        self._wake.set()

    # ------------------------------------------------------------ engine thread

    def _deliver(self, rid: str, item) -> None:
        with self._lock:
            target = self._streams.get(rid)
        if target is not None:
            loop, q = target
            try:
                loop.call_soon_threadsafe(q.put_nowait, item)
            except RuntimeError:  # the caller's loop is closed
                self._commands.put(("abort", rid))

    def _apply(self, cmd) -> bool:
        kind, arg = cmd
        if kind == "add":
            with self._lock:
                self._pending_adds -= 1
            try:
                self.engine.add(arg)
            except Exception as e:
                self._deliver(arg.request_id, e)
        elif kind == "abort":
            out = self.engine.abort_request(arg)
            if out is not None:
                self._deliver(arg, out)
        elif kind == "release":  # the caller left its stream: abort quietly, free the id
            self.engine.abort_request(arg)
            with self._lock:
                self._streams.pop(arg, None)
        elif kind == "call":
            with self._lock:
                self._pending_calls -= 1
            arg(self.engine)
        elif kind == "stop":
            return False
        return True

    def _loop(self) -> None:
        try:
            while True:
                if not self.engine.has_unfinished_requests():
                    self._wake.wait()
                self._wake.clear()
                while True:
                    try:
                        cmd = self._commands.get_nowait()
                    except queue.Empty:
                        break
                    if not self._apply(cmd):
                        self._abort_all(EngineDeadError("the engine is shutting down"))
                        return
                finished = False
                for out in self.engine.step():
                    self._deliver(out.request_id, out)
                    finished |= out.finished
                self.last_stats = self.engine.stats()
                if finished:
                    self.request_finished.set()
        except BaseException as e:  # a crash: fail every stream rather than hang it
            logger.exception("engine loop crashed")
            with self._lock:
                self.error = e
                callbacks, self._on_death = self._on_death, []
            self._abort_all(EngineDeadError(f"the engine loop crashed: {e!r}"))
            for cb in callbacks:
                try:
                    cb(e)
                except Exception:
                    logger.exception("an on_death callback failed")

    def _abort_all(self, err: Exception) -> None:
        with self._lock:
            self._stopped = True
            rids = list(self._streams)
        for rid in rids:
            try:
                self.engine.abort_request(rid)
            except Exception:  # a broken engine must not keep the other streams hanging
                logger.exception("abort of %s failed", rid)
            self._deliver(rid, err)
