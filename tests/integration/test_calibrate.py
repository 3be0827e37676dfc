"""`kvmesh calibrate-profile`: the real engine, a throwaway redis-server, a profile file the
simulator accepts."""

from __future__ import annotations

import json
import math
from dataclasses import fields
from pathlib import Path

import pytest

from kvmesh.cluster.calibrate import TIER_COSTS, CalibrationError, redis_url_for
from kvmesh.cluster.cli import main
from kvmesh.router.profiles import SimProfile, get_profile

TRACE = Path(__file__).resolve().parents[2].parent / "shared/data/mooncake_conversation_trace.jsonl"
NUMBERS = [f.name for f in fields(SimProfile) if f.name not in ("name", "note")]


def test_quick_calibration_writes_a_profile_the_simulator_accepts(
    smol_src, shakespeare, tmp_path, capsys
):
    out = tmp_path / "calibrated.json"
    # one torch thread: on a shared 2-core machine two threads slow down badly under load
    rc = main(
        ["calibrate-profile", "--quick", "--threads", "1", "--name", "t", "--output", str(out)]
    )
    err = capsys.readouterr().err
    assert rc == 0, err[-3000:]
    phases = ("prefill 1/2", "decode measured", "host 2/2 promotion 2/2", "redis 2/2 promotion 2/2")
    for phase in phases:
        assert f"calibrate: {phase}" in err  # a progress line per phase
    data = json.loads(out.read_text())
    assert data["name"] == "t"
    for k in NUMBERS:
        v = data[k]
        # a tier load no slower than a device hit is 0, "free" (check_measured): host RAM
        # often measures so; every other number is positive
        least_ok = 0 if k in TIER_COSTS else math.ulp(0)
        assert isinstance(v, int | float) and math.isfinite(v) and v >= least_ok, (k, v)
    assert data["kv_bytes_per_token"] == 30 * 3 * 64 * 2 * 4  # SmolLM2 at fp32
    m = data["measured"]
    assert m["model"] == "smollm2-135m-instruct" and m["kv_cache_format"] == "fp32"
    assert m["torch_threads"] == 1 and m["sizes"]["decode_batch"] == 4
    assert len(m["samples"]["prefill_s"]) == 2 and len(m["samples"]["redis"]["s_per_token"]) == 4
    assert all(n == 256 for n in m["samples"]["host"]["tier_tokens"])  # the whole prefix
    assert get_profile(out).prefill_tokens_per_s == data["prefill_tokens_per_s"]

    if not TRACE.is_file():
        pytest.fail(f"the Mooncake trace is missing: expected it at {TRACE}")
    rc = main(
        [
            "simulate-router",
            "--trace",
            str(TRACE),
            "--limit",
            "200",
            "--workers",
            "2",
            "--capacity-tokens",
            "102400",
            "--policy",
            "prefix_affinity",
            "--profile",
            str(out),
            "--json",
        ]
    )
    assert rc == 0
    res = json.loads(capsys.readouterr().out)["prefix_affinity"]
    assert res["requests"] == 200 and res["tokens_conserved"] is True


def test_missing_redis_server_names_the_install_command(monkeypatch):
    monkeypatch.setattr("kvmesh.cluster.calibrate.shutil.which", lambda name: None)
    with pytest.raises(CalibrationError, match="apt-get install -y redis-server"):
        with redis_url_for(None, log=lambda msg: None):
            pass


def test_unreachable_redis_url_fails_clearly():
    with pytest.raises(CalibrationError, match="redis://127.0.0.1:1/0 does not answer PING"):
        with redis_url_for("redis://127.0.0.1:1/0"):
            pass
