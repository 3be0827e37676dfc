"""KV eviction under a per-request budget: SnapKV, H2O, StreamingLLM (docs/eviction.md)."""

from kvmesh.worker.eviction.policies import (
    H2O,
    POLICIES,
    EvictionPolicy,
    RandomKeep,
    SnapKV,
    StreamingLLM,
    make_policy,
)

__all__ = [
    "H2O",
    "POLICIES",
    "EvictionPolicy",
    "RandomKeep",
    "SnapKV",
    "StreamingLLM",
    "make_policy",
]
