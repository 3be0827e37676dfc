"""The router: prefix index over the workers' block events, and the routing policies."""

from kvmesh.router.policies import (
    DEFAULT_POLICY,
    POLICIES,
    CandidateScore,
    CostModel,
    Decision,
    LeastLoaded,
    LoadGuard,
    NoWorkerError,
    PrefixAffinity,
    RoundRobin,
    RouteRequest,
    RoutingPolicy,
    WorkerLoad,
    make_policy,
    route,
)
from kvmesh.router.prefix_index import TIERS, IndexStats, Match, PrefixIndex

__all__ = [
    "DEFAULT_POLICY",
    "POLICIES",
    "TIERS",
    "CandidateScore",
    "CostModel",
    "Decision",
    "IndexStats",
    "LeastLoaded",
    "LoadGuard",
    "Match",
    "NoWorkerError",
    "PrefixAffinity",
    "PrefixIndex",
    "RoundRobin",
    "RouteRequest",
    "RoutingPolicy",
    "WorkerLoad",
    "make_policy",
    "route",
]
