"""Named cost profiles for the trace simulator (``router/simulator.py``).

A profile gives the simulated worker's timing: prefill throughput, per-token decode time and
the time to load one token's KV from the host or Redis tier. ``cost_model()`` turns it into
the routing ``CostModel`` (tier credits as a fraction of recompute). Sources and caveats are
in docs/router.md ("Simulator").
"""

from __future__ import annotations

from dataclasses import dataclass

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
        if self.prefill_tokens_per_s <= 0:
            raise ValueError(f"prefill_tokens_per_s must be > 0, got {self.prefill_tokens_per_s}")
        for f in ("decode_s_per_token", "host_s_per_token", "redis_s_per_token"):
            if getattr(self, f) < 0:
                raise ValueError(f"{f} must be >= 0, got {getattr(self, f)}")

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
        # Placeholders from kvmesh's own engine on the 2-core dev machine: a 2048-token
        # prefill takes ~2.5-3.5 s (~680 tokens/s), a 32-way decode step ~0.13-0.18 s.
        # SmolLM2-135M KV: 30 layers x 3 KV heads x 64 dim x 2 x 4 bytes (fp32) = 45 KiB.
        SimProfile(
            name="smollm2-cpu",
            prefill_tokens_per_s=680.0,
            decode_s_per_token=0.15,
            host_s_per_token=45 * _KIB / 5e9,
            redis_s_per_token=45 * _KIB / 1e9,
            kv_bytes_per_token=45 * _KIB,
            note="placeholder values from rough timings on a 2-core CPU",
        ),
    )
}

DEFAULT_PROFILE = "llama3-8b-h100"


def get_profile(name: str) -> SimProfile:
    """The profile called ``name``; ValueError listing the accepted names otherwise."""
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(
            f"unknown simulator profile {name!r}; accepted: {', '.join(sorted(PROFILES))}"
        ) from None
