"""Cost profiles for the trace simulator (``router/simulator.py``): built in by name, or read
from a JSON file written by ``kvmesh calibrate-profile`` (``cluster/calibrate.py``).

A profile gives the simulated worker's timing: prefill throughput, per-token decode time and
the time to load one token's KV from the host or Redis tier. ``cost_model()`` turns it into
the routing ``CostModel`` (tier credits as a fraction of recompute). Sources and caveats are
in docs/router.md ("Profiles").
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from pathlib import Path

from kvmesh.router.policies import CostModel


@dataclass(frozen=True)
class SimProfile:
    """Cost parameters of one simulated worker (seconds and tokens)."""

    name: str
    prefill_tokens_per_s: float
    decode_s_per_token: float  # per output token of one request (fixed; see docs)
    host_s_per_token: float  # loading one token's KV from host RAM
    redis_s_per_token: float  # loading one token's KV from Redis
    kv_bytes_per_token: int
    note: str = ""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.prefill_tokens_per_s) and self.prefill_tokens_per_s > 0):
            raise ValueError(
                f"prefill_tokens_per_s must be a finite number > 0, got {self.prefill_tokens_per_s}"
            )
        for f in ("decode_s_per_token", "host_s_per_token", "redis_s_per_token"):
            v = getattr(self, f)
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"{f} must be a finite number >= 0, got {v}")
        if self.kv_bytes_per_token <= 0:
            raise ValueError(f"kv_bytes_per_token must be > 0, got {self.kv_bytes_per_token}")

    def cost_model(self, decode_cost: float = 8.0) -> CostModel:
        """Tier credits for the policy: load time / recompute time per token, capped at 1."""
        recompute = 1.0 / self.prefill_tokens_per_s
        return CostModel(
            host_cost=min(1.0, self.host_s_per_token / recompute),
            redis_cost=min(1.0, self.redis_s_per_token / recompute),
            # The simulator does not model peer fetches (see simulator.py), so a page held
            # only by another worker is priced as a recompute.
            peer_cost=1.0,
            decode_cost=decode_cost,
        )


_KIB = 1024

PROFILES: dict[str, SimProfile] = {
    p.name: p
    for p in (
        # Estimates for Llama-3-8B bf16 on one H100 SXM (see docs/router.md for the
        # arithmetic): ~16 GFLOP per prompt token at ~40% of 989 TFLOP/s dense bf16 is
        # ~25k tokens/s; 20k is used. KV: 32 layers x 8 KV heads x 128 dim x 2 (K, V) x
        # 2 bytes = 128 KiB per token; host over PCIe ~25 GB/s, Redis ~10 GB/s.
        SimProfile(
            name="llama3-8b-h100",
            prefill_tokens_per_s=20_000.0,
            decode_s_per_token=0.012,
            host_s_per_token=128 * _KIB / 25e9,
            redis_s_per_token=128 * _KIB / 10e9,
            kv_bytes_per_token=128 * _KIB,
            note="estimates from FLOP and bandwidth arithmetic, not measured",
        ),
        # Measured on 2026-11-29 on the 2-core dev machine (CPU, fp32 weights and KV cache,
        # 2 torch threads, Redis on loopback) by
        #     kvmesh calibrate-profile --name smollm2-cpu
        # (default sizes: 2,048-token cold prefills; decode steps of 32 requests; 2,048-token
        # prefixes served from host RAM / Redis; medians of 5). Rounded to 3 digits.
        # SmolLM2-135M KV: 30 layers x 3 KV heads x 64 dim x 2 x 4 bytes (fp32) = 45 KiB.
        SimProfile(
            name="smollm2-cpu",
            prefill_tokens_per_s=514.0,
            decode_s_per_token=0.143,  # the step time of a batch of 32 decoding requests
            host_s_per_token=186e-6,
            redis_s_per_token=182e-6,
            kv_bytes_per_token=45 * _KIB,
            note="measured by kvmesh calibrate-profile --name smollm2-cpu on 2026-11-29 "
            "(2-core CPU, fp32 KV, 2 torch threads)",
        ),
    )
}

DEFAULT_PROFILE = "llama3-8b-h100"


def get_profile(name_or_path: str | Path) -> SimProfile:
    """The built-in profile called ``name_or_path``, or the profile in that JSON file (a name
    ending in ``.json``, or an existing file). ValueError listing the accepted names
    otherwise; see ``load_profile`` for the file's errors."""
    name = str(name_or_path)
    if name in PROFILES:
        return PROFILES[name]
    try:
        is_file = Path(name).is_file()
    except (OSError, ValueError):  # a name too long or odd to be a path
        is_file = False
    if name.endswith(".json") or is_file:
        return load_profile(name)
    raise ValueError(
        f"unknown simulator profile {name!r}; accepted: {', '.join(sorted(PROFILES))}, "
        f"or a path to a .json profile (written by kvmesh calibrate-profile)"
    )


# every SimProfile field but ``name`` and ``note`` is required in a profile file
_REQUIRED = tuple(f.name for f in fields(SimProfile) if f.name not in ("name", "note"))
_OPTIONAL = ("name", "note", "measured")  # ``measured``: how it was measured, not read


def profile_to_dict(profile: SimProfile) -> dict:
    """The JSON form ``load_profile`` reads (every field of ``SimProfile``)."""
    return {f.name: getattr(profile, f.name) for f in fields(SimProfile)}


def load_profile(path: str | Path) -> SimProfile:
    """Read a profile file: a JSON object with every ``SimProfile`` field but ``name`` (default:
    the file's stem) and ``note``, plus an optional ``measured`` block that is not read.
    FileNotFoundError or ValueError naming the file and the bad or missing field."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"profile file {path}: no such file")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"profile file {path}: not valid JSON ({e})") from None
    return profile_from_dict(data, source=f"profile file {path}", default_name=path.stem)


def profile_from_dict(data: object, *, source: str, default_name: str) -> SimProfile:
    """Validate a decoded profile object; errors start with ``source``."""
    if not isinstance(data, dict):
        raise ValueError(f"{source}: expected a JSON object, got {type(data).__name__}")
    unknown = sorted(set(data) - set(_REQUIRED) - set(_OPTIONAL))
    if unknown:
        raise ValueError(
            f"{source}: unknown field {unknown[0]!r}; accepted: {', '.join(_REQUIRED + _OPTIONAL)}"
        )
    missing = [k for k in _REQUIRED if k not in data]
    if missing:
        raise ValueError(
            f"{source}: missing field {missing[0]!r} (required: {', '.join(_REQUIRED)})"
        )
    values: dict = {}
    for k in _REQUIRED:
        v = data[k]
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise ValueError(f"{source}: field {k!r} must be a number, got {v!r}")
        if k != "kv_bytes_per_token":
            try:
                v = float(v)
            except OverflowError:
                raise ValueError(f"{source}: field {k!r} is out of range: {v!r}") from None
        values[k] = v
    kv = values["kv_bytes_per_token"]
    if not (isinstance(kv, int) or (math.isfinite(kv) and kv == int(kv))):
        raise ValueError(f"{source}: field 'kv_bytes_per_token' must be an integer, got {kv!r}")
    values["kv_bytes_per_token"] = int(kv)
    for k in ("name", "note"):
        if k in data and not isinstance(data[k], str):
            raise ValueError(f"{source}: field {k!r} must be a string, got {data[k]!r}")
    if "measured" in data and not isinstance(data["measured"], dict):
        raise ValueError(f"{source}: field 'measured' must be an object, got {data['measured']!r}")
    try:
        return SimProfile(
            name=data.get("name") or default_name, note=data.get("note", ""), **values
        )
    except ValueError as e:  # SimProfile's own range checks name the field
        raise ValueError(f"{source}: field {e}") from None
