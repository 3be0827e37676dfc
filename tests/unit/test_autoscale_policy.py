"""The autoscaling policy (cluster/autoscale.py) on a fake clock: hysteresis, bounds, delays,
and the choice of the worker to retire from the router's prefix index."""

from __future__ import annotations

import pytest

from kvmesh.cluster.autoscale import (
    DOWN,
    UP,
    AutoscaleConfig,
    ScalingPolicy,
    Signals,
    choose_worker_to_retire,
)
from kvmesh.kvstore.events import BlockStored
from kvmesh.router.core import RouterCore
from kvmesh.router.prefix_index import PrefixIndex


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


CFG = AutoscaleConfig(
    min_workers=1,
    max_workers=3,
    upscale_delay_s=30.0,
    downscale_delay_s=600.0,
    look_back_s=10.0,
    waiting_high=2.0,
    waiting_low=0.5,
    queued_tokens_high=2048,
    queued_tokens_low=256,
    kv_usage_high=0.9,
    kv_usage_low=0.6,
)


def run(policy: ScalingPolicy, clock: Clock, signal, seconds: float, step: float = 1.0):
    """Feed ``signal(t)`` (a Signals) every ``step`` seconds; return the decisions."""
    out = []
    end = clock.t + seconds
    while clock.t < end:
        d = policy.observe(signal(clock.t))
        if d is not None:
            out.append(d)
        clock.t += step
    return out


def test_sustained_high_load_scales_up_after_the_delay_only():
    clock = Clock()
    p = ScalingPolicy(CFG, clock)
    busy = lambda t: Signals(workers=2, waiting=10)  # noqa: E731 (5 waiting per worker)
    assert run(p, clock, busy, 29.0) == []  # not yet: the upscale delay is 30 s
    (d,) = run(p, clock, busy, 2.0)
    assert (d.action, d.from_workers, d.to_workers, d.cause) == (UP, 2, 3, "high_load")
    assert "waiting/worker" in d.reason and d.inputs["waiting_per_worker"] == pytest.approx(5)


def test_no_flapping_on_a_signal_oscillating_inside_the_band():
    clock = Clock()
    p = ScalingPolicy(CFG, clock)
    # per worker: between the low mark (0.5 spread over one fewer) and the high mark (2)
    band = lambda t: Signals(workers=2, waiting=1.5 + (0.9 if int(t) % 2 else -0.9))  # noqa: E731
    assert run(p, clock, band, 3600.0) == []


def test_a_spike_shorter_than_the_delay_does_not_scale_up():
    clock = Clock()
    p = ScalingPolicy(CFG, clock)

    def spiky(t):  # 20 s above the high mark, 20 s idle, over and over
        return Signals(workers=1, waiting=50 if int(t) % 40 < 20 else 0)

    assert run(p, clock, spiky, 3600.0) == []


def test_low_load_scales_down_after_the_long_delay_and_one_step_at_a_time():
    clock = Clock()
    p = ScalingPolicy(CFG, clock)
    idle = lambda t: Signals(workers=3, waiting=0, kv_usage=0.1)  # noqa: E731
    assert run(p, clock, idle, 599.0) == []
    (d,) = run(p, clock, idle, 2.0)
    assert (d.action, d.from_workers, d.to_workers, d.cause) == (DOWN, 3, 2, "low_load")
    # the window starts over after an action: the next step needs the full delay again
    idle2 = lambda t: Signals(workers=2, waiting=0, kv_usage=0.1)  # noqa: E731
    assert run(p, clock, idle2, 599.0) == []
    assert [d.to_workers for d in run(p, clock, idle2, 2.0)] == [1]
    idle1 = lambda t: Signals(workers=1, waiting=0, kv_usage=0.0)  # noqa: E731
    assert run(p, clock, idle1, 3600.0) == []  # never below min_workers


def test_scale_down_judges_the_load_spread_over_one_worker_fewer():
    clock = Clock()
    p = ScalingPolicy(CFG, clock)
    # 0.4 waiting per worker on 3, but 0.6 on 2: above the low mark of 0.5, so it stays
    assert run(p, clock, lambda t: Signals(workers=3, waiting=1.2), 3600.0) == []
    # KV usage 0.45 on 3 workers would be 0.675 on 2 (> 0.6): stays too
    assert run(p, clock, lambda t: Signals(workers=3, kv_usage=0.45), 3600.0) == []


def test_bounds_act_at_once_and_cap_the_load_signals():
    clock = Clock()
    p = ScalingPolicy(CFG, clock)
    d = p.observe(Signals(workers=0))
    assert (d.action, d.cause, d.to_workers) == (UP, "min_workers", 1)
    d = p.observe(Signals(workers=4))
    assert (d.action, d.cause, d.to_workers) == (DOWN, "max_workers", 3)
    # at max_workers, no load makes it grow
    assert run(p, clock, lambda t: Signals(workers=3, waiting=100), 600.0) == []


def test_a_pending_worker_holds_further_scale_ups():
    clock = Clock()
    p = ScalingPolicy(CFG, clock)
    assert run(p, clock, lambda t: Signals(workers=1, pending=1, waiting=100), 600.0) == []


def test_ttft_slo_scales_up_and_blocks_scale_down():
    cfg = AutoscaleConfig(
        min_workers=1, max_workers=2, upscale_delay_s=5, downscale_delay_s=5, ttft_slo_s=1.0
    )
    clock = Clock()
    p = ScalingPolicy(cfg, clock)
    (d,) = run(p, clock, lambda t: Signals(workers=1, ttft_p99_s=3.0), 10.0)
    assert d.action == UP and "ttft p99" in d.reason
    # idle otherwise, but TTFT p99 above half the SLO: no scale-down
    assert run(p, clock, lambda t: Signals(workers=2, ttft_p99_s=0.8), 600.0) == []
    # once the look-back window (30 s) has forgotten the slow ones, and after the delay
    fast = lambda t: Signals(workers=2, ttft_p99_s=0.2)  # noqa: E731
    assert run(p, clock, fast, 20) == []
    assert run(p, clock, fast, 30)[0].action == DOWN


@pytest.mark.parametrize(
    "kw, msg",
    [
        ({"min_workers": 0}, "min_workers"),
        ({"min_workers": 3, "max_workers": 2}, "max_workers"),
        ({"upscale_delay_s": -1}, "upscale_delay_s"),
        ({"waiting_low": 3, "waiting_high": 2}, "waiting_low"),
        ({"ttft_slo_s": 0}, "ttft_slo_s"),
        ({"interval_s": 0}, "interval_s"),
    ],
)
def test_bad_config_names_the_problem(kw, msg):
    with pytest.raises(ValueError, match=msg):
        AutoscaleConfig(**{"max_workers": 2, **kw})


# ---------------------------------------------------------------- which worker goes


def _stored(wid, hashes, tier="device", start=0):
    return [BlockStored(start + i, wid, h, None, (), 16, tier) for i, h in enumerate(hashes)]


def test_unique_pages_count_what_no_other_worker_and_not_redis_holds():
    idx = PrefixIndex()
    shared = [bytes([1, i]) for i in range(10)]
    only_a = [bytes([2, i]) for i in range(5)]
    only_b = [bytes([3, i]) for i in range(3)]
    in_redis = [bytes([4, i]) for i in range(7)]
    idx.apply_batch("a", _stored("a", shared + only_a + in_redis))
    idx.apply_batch("b", _stored("b", shared + only_b))
    idx.apply_batch("b", _stored("b", in_redis, tier="redis", start=len(shared + only_b)))
    assert idx.unique_pages("a") == 5
    assert idx.unique_pages("b") == 3
    assert idx.unique_pages("nobody") == 0


def test_the_worker_with_the_least_unique_pages_is_retired():
    core = RouterCore(model_fp="fp")
    for wid, n_unique in (("w0", 40), ("w1", 3), ("w2", 12)):
        core.register(
            {
                "worker_id": wid,
                "address": f"{wid}:1",
                "model_fp": "fp",
                "block_size": 16,
                "next_seq": 100,
                "pages": {"device": [f"{wid}-{i}".encode() for i in range(n_unique)]},
            }
        )
    view = core.autoscale_view()
    assert {w: v["unique_pages"] for w, v in view["workers"].items()} == {
        "w0": 40,
        "w1": 3,
        "w2": 12,
    }
    wid, why = choose_worker_to_retire(view["workers"])
    assert wid == "w1" and "fewest unique pages (3" in why
    # ties go to the one with fewer requests in flight
    tie = {"a": {"unique_pages": 0, "in_flight": 2}, "b": {"unique_pages": 0, "in_flight": 1}}
    assert choose_worker_to_retire(tie)[0] == "b"


def test_a_draining_worker_gets_no_new_requests_and_its_redis_pages_stay_credited():
    core = RouterCore(model_fp="fp")
    for wid in ("a", "b"):
        core.register(
            {"worker_id": wid, "address": f"{wid}:1", "model_fp": "fp", "block_size": 16,
             "next_seq": 0, "pages": {}}
        )  # fmt: skip
    pages = [bytes([9, i]) for i in range(4)]
    core.publish("a", [(i, 0, h, "redis") for i, h in enumerate(pages)], None)
    assert core.begin_retire("a")
    probe = [bytes([7, i]) for i in range(4)]
    for i in range(20):
        assert core.assign(f"r{i}", list(range(64)), probe).worker_id == "b"
    assert core.autoscale_view()["draining"] == ["a"]
    core.remove_worker("a", "retired by the autoscaler", keep_redis=True)
    assert core.index.match(pages)["b"].redis == 4
    # without keep_redis, a leaving worker takes its Redis reports along
    core.register(
        {"worker_id": "c", "address": "c:1", "model_fp": "fp", "block_size": 16,
         "next_seq": 0, "pages": {}}
    )  # fmt: skip
    other = [bytes([8, i]) for i in range(4)]
    core.publish("c", [(i, 0, h, "redis") for i, h in enumerate(other)], None)
    core.remove_worker("c", "shutdown")
    assert core.index.match(other)["b"].redis == 0


def test_decisions_reach_the_router_stats():
    core = RouterCore(model_fp="fp")
    core.record_scaling({"action": "up", "cause": "high_load", "reason": "x", "inputs": {}})
    st = core.stats()["autoscale"]
    assert st["counts"] == {"up": 1} and st["decisions"][0]["reason"] == "x"


# ---------------------------------------------------------------- kvmesh serve's flags


def _serve(argv: str):
    from kvmesh.cluster.cli import build_parser
    from kvmesh.cluster.serve import config_from_args

    return config_from_args(build_parser().parse_args(["serve", *argv.split()]))


def test_serve_flags_make_the_autoscale_config():
    fixed = _serve("--workers 3")
    assert (fixed.workers, fixed.autoscale.min_workers, fixed.autoscale.max_workers) == (3, 3, 3)
    assert not fixed.autoscale.enabled
    auto = _serve("--max-workers 4 --ttft-slo 1.5 --upscale-delay 5 --downscale-delay 60")
    c = auto.autoscale
    assert (auto.workers, c.min_workers, c.max_workers, c.ttft_slo_s) == (1, 1, 4, 1.5)
    assert (c.upscale_delay_s, c.downscale_delay_s, c.preserve_cache) == (5.0, 60.0, True)
    # Ray Serve's delays by default
    d = _serve("--min-workers 2 --max-workers 3").autoscale
    assert (d.min_workers, d.max_workers, d.upscale_delay_s, d.downscale_delay_s) == (
        2, 3, 30.0, 600.0
    )  # fmt: skip
    assert not _serve("--max-workers 2 --no-cache-preserving-scale-down").autoscale.preserve_cache
    with pytest.raises(ValueError, match="max_workers"):
        _serve("--min-workers 3 --max-workers 2")
    with pytest.raises(ValueError, match="flush_timeout_s"):
        _serve("--flush-timeout -1")
