"""router.load: one WorkerLoad from the engine's counters, through Ray's dict and the wire."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvmesh.router.load import WorkerLoad, from_proto, from_report, to_proto, to_report

STATS = SimpleNamespace(  # the EngineStats fields a load is built from
    num_requests_running=3,
    num_requests_waiting=2,
    queued_prefill_tokens=1500,
    kv_cache_usage_perc=0.25,
    num_free_pages=90,
    num_pages=120,
    prefix_cache_queries=4000,
    prefix_cache_hits=1000,
)


def test_a_load_survives_the_report_dict_and_the_wire():
    load = WorkerLoad.from_stats(STATS, timestamp=12.5)
    assert (load.running, load.waiting, load.queued_prefill_tokens) == (3, 2, 1500)
    assert (load.num_free_pages, load.num_pages, load.prefix_cache_hits) == (90, 120, 1000)
    assert from_report(to_report(load)) == load
    msg = to_proto(load, "w0")
    assert msg.worker_id == "w0" and msg.num_requests_running == 3
    assert msg.kv_cache_usage_perc == 0.25 and msg.prefix_cache_queries == 4000
    # the wire carries no timestamp
    assert from_proto(msg) == WorkerLoad(**{**to_report(load), "timestamp": 0.0})


def test_a_bad_report_is_clamped_never_fatal():
    load = from_report(
        {
            "running": -2,
            "waiting": "many",
            "queued_prefill_tokens": float("inf"),
            "kv_usage": 1.7,
            "num_pages": None,
            "timestamp": float("nan"),
            "unknown_field": 1,
        },
        now=7.0,
    )
    assert load == WorkerLoad(kv_usage=1.0, timestamp=7.0)
    assert from_report({"kv_usage": float("nan")}).kv_usage == 0.0
    assert from_report(None, now=3.0) == WorkerLoad(timestamp=3.0)


def test_a_load_built_by_hand_is_validated():
    with pytest.raises(ValueError, match="kv_usage must be in"):
        WorkerLoad(kv_usage=-0.1)
    with pytest.raises(ValueError, match="num_free_pages must be >= 0, got -1"):
        WorkerLoad(num_free_pages=-1)
