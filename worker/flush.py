"""Flush on a clean shutdown: a worker that stops writes its cache down to the shared tier.

Host RAM and the device pool die with the process; Redis outlives it. So ``LLM.close()``,
``kvmesh worker`` on SIGTERM and a worker the autoscaler retires (cluster/autoscale.py) call
``flush_to_shared`` before they close the engine:

1. the device's cached pages no request holds are dropped the way eviction drops them, so
   they spill to the first store tier (host RAM, or Redis when there is no host tier);
2. every host-tier page Redis does not hold yet is written to Redis, most recently used
   first (``TieredStore.flush_down``).

Both steps run against one deadline (``timeout_s``, default 30 s); what is not written by
then is left (counted, logged), never waited for. Without a Redis tier there is nothing to
flush to and nothing is done.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass

logger = logging.getLogger("kvmesh.flush")

DEFAULT_FLUSH_TIMEOUT_S = 30.0
SHARED_TIER = "redis"


@dataclass
class FlushReport:
    """What a shutdown flush did (``as_dict`` for logs and stats)."""

    shared_tier: str | None = None  # None: no shared tier, nothing was flushed
    device_pages_spilled: int = 0  # device pages dropped to the store tiers
    host_pages_written: int = 0  # host pages written to the shared tier
    host_pages_already: int = 0  # host pages the shared tier held already
    pages_written: int = 0  # pages that reached the shared tier, from either step
    pages_left: int = 0  # not written: the deadline passed, or the tier failed
    timed_out: bool = False
    seconds: float = 0.0

    def as_dict(self) -> dict:
        return asdict(self)


def has_shared_tier(engine) -> bool:
    store = engine.store
    return store is not None and any(t.name == SHARED_TIER for t in store.tiers)


def flush_to_shared(
    engine, timeout_s: float = DEFAULT_FLUSH_TIMEOUT_S, *, device: bool = True
) -> FlushReport:
    """Write this engine's cached pages (device, with ``device``, then host) down to Redis
    within ``timeout_s`` seconds. Call where the engine may be touched: on its own thread
    (``AsyncEngine.call``) or once its loop has stopped. Never raises for a tier fault."""
    if timeout_s < 0:
        raise ValueError(f"flush timeout must be >= 0 seconds, got {timeout_s}")
    rep = FlushReport()
    if not has_shared_tier(engine):
        return rep
    rep.shared_tier = SHARED_TIER
    t0 = time.monotonic()
    try:
        if device:
            # spills through the connector like any eviction, and waits until the pages
            # are in the first tier (the host tier writes its own victims to Redis)
            rep.device_pages_spilled = engine.reset_prefix_cache()
        left = max(0.0, timeout_s - (time.monotonic() - t0))
        res = engine.store.flush_down(left)
        rep.host_pages_written = res.written
        rep.host_pages_already = res.already
        # without a host tier the device spill went straight to Redis
        direct = engine.store.tiers[0].name == SHARED_TIER
        rep.pages_written = res.written + (rep.device_pages_spilled if direct else 0)
        rep.pages_left = res.left
        rep.timed_out = res.timed_out
    except Exception as e:  # a shutdown must go on whatever the tiers do
        logger.warning("flushing the cache to %s failed: %r", SHARED_TIER, e)
    rep.seconds = round(time.monotonic() - t0, 3)
    logger.info("flushed the cache to %s: %s", SHARED_TIER, rep.as_dict())
    return rep


__all__ = ["DEFAULT_FLUSH_TIMEOUT_S", "FlushReport", "flush_to_shared", "has_shared_tier"]
