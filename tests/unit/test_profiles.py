"""router.profiles: built-in profiles and profile files written by `kvmesh calibrate-profile`."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from kvmesh.cluster.cli import main
from kvmesh.router.profiles import PROFILES, get_profile, load_profile, profile_to_dict

TRACE = Path(__file__).resolve().parents[2].parent / "shared/data/mooncake_conversation_trace.jsonl"

GOOD = {
    "name": "my-box",
    "prefill_tokens_per_s": 650.0,
    "decode_s_per_token": 0.12,
    "host_s_per_token": 2e-5,
    "redis_s_per_token": 9e-5,
    "kv_bytes_per_token": 46080,
    "note": "measured",
    "measured": {"date": "2025-01-01", "samples": {"prefill_s": [3.1, 3.2]}},
}


def _write(tmp_path: Path, data, name: str = "prof.json") -> Path:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


def test_file_round_trips_through_get_profile(tmp_path):
    path = _write(tmp_path, GOOD)
    prof = get_profile(str(path))
    assert prof == load_profile(path)
    assert prof.name == "my-box" and prof.kv_bytes_per_token == 46080
    assert prof.prefill_tokens_per_s == 650.0 and prof.redis_s_per_token == 9e-5
    want = {k: v for k, v in GOOD.items() if k != "measured"}
    assert profile_to_dict(prof) == want
    # the credits the policy gets: load time / recompute time per token
    cm = prof.cost_model()
    assert math.isclose(cm.host_cost, 2e-5 * 650) and math.isclose(cm.redis_cost, 9e-5 * 650)


def test_builtin_profiles_round_trip(tmp_path):
    for prof in PROFILES.values():
        path = _write(tmp_path, profile_to_dict(prof), f"{prof.name}.json")
        assert get_profile(path) == prof


def test_name_defaults_to_file_stem_and_measured_is_optional(tmp_path):
    data = {k: v for k, v in GOOD.items() if k not in ("name", "note", "measured")}
    prof = get_profile(_write(tmp_path, data, "lab-cpu.json"))
    assert prof.name == "lab-cpu" and prof.note == ""


def test_integral_float_kv_bytes_is_accepted(tmp_path):
    assert (
        get_profile(_write(tmp_path, {**GOOD, "kv_bytes_per_token": 46080.0})).kv_bytes_per_token
        == 46080
    )


@pytest.mark.parametrize(
    "change, match",
    [
        ({"decode_s_per_token": None}, "missing field 'decode_s_per_token'"),
        ({"prefill_tokens_per_s": "fast"}, "field 'prefill_tokens_per_s' must be a number"),
        ({"host_s_per_token": True}, "field 'host_s_per_token' must be a number"),
        ({"prefill_tokens_per_s": 0}, "prefill_tokens_per_s must be a finite number > 0"),
        ({"redis_s_per_token": -1e-6}, "redis_s_per_token must be a finite number >= 0"),
        ({"decode_s_per_token": float("nan")}, "decode_s_per_token must be a finite number"),
        ({"host_s_per_token": float("inf")}, "host_s_per_token must be a finite number"),
        ({"kv_bytes_per_token": 45.5}, "field 'kv_bytes_per_token' must be an integer"),
        ({"kv_bytes_per_token": 0}, "kv_bytes_per_token must be > 0"),
        ({"prefil_tokens_per_s": 1.0}, "unknown field 'prefil_tokens_per_s'"),
        ({"name": 7}, "field 'name' must be a string"),
        ({"measured": [1]}, "field 'measured' must be an object"),
    ],
)
def test_bad_field_names_file_and_field(tmp_path, change, match):
    data = {**GOOD, **change}
    data = {k: v for k, v in data.items() if v is not None}
    path = _write(tmp_path, data)
    with pytest.raises(ValueError, match=match) as e:
        get_profile(str(path))
    assert str(e.value).startswith(f"profile file {path}: ")


def test_not_a_json_object(tmp_path):
    with pytest.raises(ValueError, match=r"prof\.json: not valid JSON"):
        get_profile(_write(tmp_path, "{oops"))
    with pytest.raises(ValueError, match=r"prof\.json: expected a JSON object, got list"):
        get_profile(_write(tmp_path, [GOOD]))


def test_missing_file_and_unknown_name(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"profile file .*nope\.json: no such file"):
        get_profile(str(tmp_path / "nope.json"))
    with pytest.raises(ValueError) as e:
        get_profile("gpt-5-tpu")
    msg = str(e.value)
    assert "'gpt-5-tpu'" in msg and "accepted: llama3-8b-h100, smollm2-cpu" in msg
    assert ".json" in msg


def test_builtin_smollm2_cpu_is_measured():
    prof = get_profile("smollm2-cpu")
    assert prof.note.startswith("measured by kvmesh calibrate-profile")
    assert prof.kv_bytes_per_token == 30 * 3 * 64 * 2 * 4  # fp32 K and V of every layer


def test_simulate_router_cli_takes_a_profile_file(tmp_path, capsys):
    if not TRACE.is_file():
        pytest.fail(f"the Mooncake trace is missing: expected it at {TRACE}")
    base = [
        "simulate-router",
        "--trace",
        str(TRACE),
        "--workers",
        "2",
        "--capacity-tokens",
        "102400",
        "--policy",
        "prefix_affinity",
        "--limit",
        "50",
    ]
    good = _write(tmp_path, GOOD)
    assert main([*base, "--profile", str(good)]) == 0
    assert "profile my-box" in capsys.readouterr().out
    bad = _write(tmp_path, {**GOOD, "host_s_per_token": "slow"}, "bad.json")
    assert main([*base, "--profile", str(bad)]) == 2
    err = capsys.readouterr().err
    assert f"profile file {bad}: field 'host_s_per_token' must be a number" in err
    assert main([*base, "--profile", str(tmp_path / "absent.json")]) == 2
    assert "absent.json: no such file" in capsys.readouterr().err


def test_router_does_not_import_the_worker():
    code = (
        "import sys, kvmesh.router.profiles, kvmesh.router.simulator\n"
        "bad = sorted(m for m in sys.modules if m.startswith('kvmesh.worker'))\n"
        "assert not bad, bad\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
