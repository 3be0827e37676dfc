"""router.simulator: the trace replay on a 500-request slice of the Mooncake trace."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvmesh.cluster.cli import main
from kvmesh.router.profiles import PROFILES, get_profile
from kvmesh.router.simulator import (
    BLOCK_TOKENS,
    SimConfig,
    TraceError,
    load_trace,
    page_hashes,
    parse_trace,
    resolve_policies,
    shared_cache_hit_rate,
    simulate_policies,
)

TRACE = Path(__file__).resolve().parents[2].parent / "shared/data/mooncake_conversation_trace.jsonl"
N = 500


@pytest.fixture(scope="module")
def trace():
    if not TRACE.is_file():
        pytest.fail(f"the Mooncake trace is missing: expected it at {TRACE}")
    return load_trace(TRACE, limit=N)


@pytest.fixture(scope="module")
def results(trace):
    # 4 workers x 2,000 pages: modest next to the ~10k distinct pages of the slice.
    cfg = SimConfig(workers=4, capacity_tokens=2000 * BLOCK_TOKENS)
    return simulate_policies(trace, resolve_policies("all"), cfg)


def test_every_policy_finishes(trace, results):
    assert set(results) == {"round_robin", "least_loaded", "prefix_affinity"}
    for r in results.values():
        assert r.requests == N == len(trace)
        assert r.index["gaps"] == 0 and r.index["restarts"] == 0
        assert 0.0 < r.ttft_p50_s <= r.ttft_p99_s
        assert r.requests_per_s > 0 and r.tokens_per_s > 0
        assert r.load_imbalance >= 1.0


def test_hit_rate_within_shared_cache_bound(results):
    for r in results.values():
        assert 0.0 < r.token_hit_rate <= r.shared_cache_bound <= 1.0
    unbounded = shared_cache_hit_rate(load_trace(TRACE, limit=N), None)
    assert next(iter(results.values())).shared_cache_bound <= unbounded


def test_tokens_conserved(results):
    for r in results.values():
        assert r.tokens_conserved
        assert r.hit_tokens + r.computed_tokens == r.prompt_tokens
        assert r.hit_tokens == r.hit_tokens_device + r.hit_tokens_host + r.hit_tokens_redis


def test_prefix_affinity_beats_round_robin(results):
    assert results["prefix_affinity"].token_hit_rate > results["round_robin"].token_hit_rate


def test_tiers_conserve_and_redis_is_shared(trace):
    cfg = SimConfig(
        workers=4,
        capacity_tokens=200 * BLOCK_TOKENS,
        host_capacity_tokens=400 * BLOCK_TOKENS,
        redis=True,
        profile=get_profile("smollm2-cpu"),
        speed=10.0,
    )
    r = simulate_policies(trace[:200], ["prefix_affinity"], cfg)["prefix_affinity"]
    assert r.tokens_conserved
    assert r.hit_tokens_redis > 0
    assert r.token_hit_rate <= r.shared_cache_bound


def test_page_hashes_are_prefix_chained():
    a, b = page_hashes([1, 2, 3]), page_hashes([1, 5, 3])
    assert a[0] == b[0] and a[1] != b[1] and a[2] != b[2]
    assert all(isinstance(h, bytes) for h in a)


def test_malformed_line_names_its_number():
    good = json.dumps({"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1]})
    with pytest.raises(TraceError, match="line 3"):
        parse_trace([good, "", "{not json"], "t.jsonl")
    with pytest.raises(TraceError, match="line 2: missing field 'hash_ids'"):
        parse_trace([good, '{"timestamp": 0, "input_length": 1, "output_length": 1}'])


def test_unknown_names_list_accepted():
    with pytest.raises(ValueError, match="accepted: all, least_loaded"):
        resolve_policies("fastest")
    with pytest.raises(ValueError, match="accepted: " + ", ".join(sorted(PROFILES))):
        get_profile("gpt-5-tpu")


def test_cli_json(capsys, trace):
    rc = main(
        [
            "simulate-router",
            "--trace",
            str(TRACE),
            "--workers",
            "2",
            "--capacity-tokens",
            "256000",
            "--policy",
            "all",
            "--limit",
            "100",
            "--json",
        ]
    )
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"round_robin", "least_loaded", "prefix_affinity"}
    assert out["prefix_affinity"]["requests"] == 100
    assert out["round_robin"]["tokens_conserved"] is True


def test_cli_errors(capsys, tmp_path):
    bad = tmp_path / "bad.jsonl"
    good = json.dumps({"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1]})
    bad.write_text(f"{good}\n[]\n")
    base = ["simulate-router", "--trace", str(bad), "--workers", "2", "--capacity-tokens", "5120"]
    assert main(base) == 2
    assert "line 2" in capsys.readouterr().err
    assert main([*base, "--policy", "nope"]) == 2
    assert "accepted: all, least_loaded, prefix_affinity, round_robin" in capsys.readouterr().err
    assert main([*base, "--profile", "nope"]) == 2
    assert "accepted: llama3-8b-h100, smollm2-cpu" in capsys.readouterr().err
