"""Ray wiring, configuration, the ``kvmesh`` CLI, the client SDK and autoscaling."""

from kvmesh.cluster.client import (
    AsyncClient,
    Cancelled,
    Client,
    DeadlineExceeded,
    GenerateChunk,
    GenerateResult,
    InvalidArgument,
    KvmeshError,
    Load,
    ModelInfo,
    PermissionDenied,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
    Usage,
)

__all__ = [
    "AsyncClient",
    "Cancelled",
    "Client",
    "DeadlineExceeded",
    "GenerateChunk",
    "GenerateResult",
    "InvalidArgument",
    "KvmeshError",
    "Load",
    "ModelInfo",
    "PermissionDenied",
    "ResourceExhausted",
    "Unauthenticated",
    "Unavailable",
    "Usage",
]
