"""The engine's pages as a KVTransfer ``PageSource``: what a peer worker can pull from here.

Device pages are copied out on the engine thread (``AsyncEngine.call``), so a slot cannot be
reused mid-copy, then encoded with the codec off that thread. Pages this worker spilled to
its host tier are served from there. Redis is not served: peers reach Redis themselves.
Pushed pages are validated against this engine's page spec and stored in the host tier.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvmesh.kvstore.codec import encode
from kvmesh.kvstore.host import HostTier
from kvmesh.kvstore.peer import valid_pushes
from kvmesh.worker.async_engine import AsyncEngine


class EnginePageSource:
    def __init__(self, engine: AsyncEngine, timeout_s: float = 10.0):
        self.aengine = engine
        self.timeout_s = timeout_s
        eng = engine.engine
        self.spec = eng.page_spec
        self.store = eng.store
        self.host: HostTier | None = eng.connector.host_tier()

    def _on_device(self, hashes: Sequence[bytes]) -> list[bool]:
        return self.aengine.call(lambda e: e.cached_on_device(hashes), self.timeout_s)

    def lookup(self, hashes: Sequence[bytes]) -> list[str | None]:
        out: list[str | None] = ["device" if d else None for d in self._on_device(hashes)]
        miss = [i for i, t in enumerate(out) if t is None]
        if self.host is not None and miss:
            for i, there in zip(miss, self.host.contains([hashes[i] for i in miss])):
                if there:
                    out[i] = "host"
        return out

    def fetch(self, hashes: Sequence[bytes]) -> list[bytes | None]:
        payloads = self.aengine.call(lambda e: e.read_cached_pages(hashes), self.timeout_s)
        out = [encode(self.spec, p) if p is not None else None for p in payloads]
        miss = [i for i, o in enumerate(out) if o is None]
        if self.host is not None and miss:
            for i, obj in zip(miss, self.host.get([hashes[i] for i in miss])):
                out[i] = obj
        return out

    def accept(self, items: list[tuple[bytes, bytes]]) -> int:
        if self.host is None:
            return 0
        good = valid_pushes(items, self.spec)
        self.store.put_encoded(good)  # reported to the router like a spill
        return len(good)
