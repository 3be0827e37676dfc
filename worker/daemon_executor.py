"""A one-thread executor whose thread is a daemon.

``ThreadPoolExecutor`` joins its threads when the interpreter exits, so one call stuck in a
library (a gRPC stream that outlived its deadline was seen doing this) holds the whole
process up at exit, and a serving process or a test run never ends. The fetch thread runs
such calls; its owner abandons a call that overstays (``KVOffloader.take_fetch``), moves the
work queued behind it to a fresh executor, and lets the stuck thread die with the process.
"""

from __future__ import annotations

import queue
import sys
import threading
import traceback
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

_Item = tuple[Future, Callable[..., Any], tuple]


class DaemonExecutor:
    """``submit`` runs calls in order on one daemon thread (started at the first submit)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._queue: queue.SimpleQueue[_Item | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        fut: Future = Future()
        self._put((fut, fn, args))
        return fut

    def _put(self, item: _Item) -> None:
        with self._lock:
            if self._closed:
                raise RuntimeError(f"executor {self.name} is shut down")
            self._queue.put(item)
            if self._thread is None:  # after the put: it starts on the call at once
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fut, fn, args = item
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 - handed to the future's owner
                fut.set_exception(e)

    def shutdown(self, cancel_futures: bool = True) -> list[_Item]:
        """Stop taking work; the thread ends after the call it runs (if ever). Returns the
        calls still queued: cancelled when ``cancel_futures``, else for the caller to run
        elsewhere (``move_queued_to``)."""
        with self._lock:
            self._closed = True
        left: list[_Item] = []
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                left.append(item)
        self._queue.put(None)
        if cancel_futures:
            for fut, _, _ in left:
                fut.cancel()
            return []
        return left

    def stack(self) -> str:
        """Where the executor's thread is now, as a formatted stack (empty when it has not
        started or has ended): what an owner logs when it abandons a stuck call."""
        thread = self._thread
        if thread is None or not thread.is_alive():  # an ended thread's ident may be reused
            return ""
        frame = sys._current_frames().get(thread.ident)
        return "".join(traceback.format_stack(frame)) if frame is not None else ""

    def move_queued_to(self, other: DaemonExecutor) -> None:
        """Shut down, handing the calls not yet started (their futures unchanged) to
        ``other``."""
        for item in self.shutdown(cancel_futures=False):
            other._put(item)
