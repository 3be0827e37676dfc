"""worker/flush.py's bounds, on fake engines: the device spill's wait is bounded by the
flush timeout, a timeout of 0 flushes nothing, and in direct mode (no host tier) only the
pages Redis accepted count as written."""

from __future__ import annotations

from types import SimpleNamespace

from kvmesh.worker.flush import flush_to_shared


class FakeRedis:
    name = "redis"

    def __init__(self) -> None:
        self.metrics = {"puts": 0}


class FakeEngine:
    def __init__(self, *, spilled: int = 10, accepted: int = 10, hang: bool = False) -> None:
        self.redis = FakeRedis()
        self.store = SimpleNamespace(tiers=[self.redis], flush_down=self._flush_down)
        self.spilled, self.accepted, self.hang = spilled, accepted, hang
        self.calls: list[tuple] = []

    def reset_prefix_cache(self, drain_timeout_s: float = 30.0) -> int:
        self.calls.append(("reset", drain_timeout_s))
        self.redis.metrics["puts"] += self.accepted
        if self.hang:
            raise TimeoutError
        return self.spilled

    def _flush_down(self, left: float):
        self.calls.append(("flush_down", left))
        return SimpleNamespace(written=0, already=0, left=0, timed_out=False)


def test_a_zero_timeout_flushes_nothing():
    eng = FakeEngine()
    rep = flush_to_shared(eng, 0.0)
    assert eng.calls == [] and rep.pages_written == 0


def test_the_device_spill_wait_is_bounded_by_the_flush_timeout():
    eng = FakeEngine(hang=True)
    rep = flush_to_shared(eng, 2.5)
    assert eng.calls[0][0] == "reset" and eng.calls[0][1] <= 2.5
    assert rep.timed_out and all(c[0] != "flush_down" for c in eng.calls)


def test_direct_mode_counts_only_the_pages_redis_accepted():
    eng = FakeEngine(spilled=10, accepted=6)  # Redis refused 4 (OOM)
    rep = flush_to_shared(eng, 5.0)
    assert rep.device_pages_spilled == 10 and rep.pages_written == 6
