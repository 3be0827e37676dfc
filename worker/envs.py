"""The one place kvmesh reads environment variables. Each knob is typed and documented."""

from __future__ import annotations

import os
from pathlib import Path


def _str(name: str, default: str) -> str:
    return os.environ.get(name, default)


def cache_dir() -> Path:
    """KVMESH_CACHE_DIR: where converted tokenizers and fingerprints are cached."""
    return Path(_str("KVMESH_CACHE_DIR", str(Path.home() / ".cache" / "kvmesh")))


def num_threads() -> int | None:
    """KVMESH_NUM_THREADS: torch intra-op threads for the engine (unset: torch's default)."""
    v = os.environ.get("KVMESH_NUM_THREADS")
    return int(v) if v else None


def log_level() -> str:
    """KVMESH_LOG_LEVEL: the level of kvmesh's loggers (default INFO)."""
    return _str("KVMESH_LOG_LEVEL", "INFO").upper()


def cpu_kernels_enabled() -> bool:
    """KVMESH_CPU_KERNELS: build and use kvmesh's C attention kernel on CPU (default 1; 0
    keeps the pure torch path)."""
    return _str("KVMESH_CPU_KERNELS", "1").strip().lower() not in ("0", "false", "no", "off")


def autotune_dir() -> Path:
    """KVMESH_AUTOTUNE_DIR: where the GEMM autotuner keeps ``gemm.json`` (default
    ``KVMESH_CACHE_DIR/autotune``). The test suite points it at a per-session directory."""
    v = os.environ.get("KVMESH_AUTOTUNE_DIR")
    return Path(v) if v else cache_dir() / "autotune"


def gemm_mode() -> str | None:
    """KVMESH_GEMM: how CPU linear layers pick their GEMM (``kernels.autotune``): ``exact``
    (the fastest measured on this machine among those bit-identical to ``F.linear``, cached
    under KVMESH_CACHE_DIR), ``auto`` (the fastest, oneDNN included, which rounds
    differently), ``legacy``, or one of ``linear``, ``mkl``, ``onednn``. Unset (None): the
    engine runs ``auto`` over every KV cache format (``autotune.engine_mode``); ``exact``
    over a quantized cache also keeps the elementwise ops in torch (bit-equal to the torch
    reference)."""
    return _str("KVMESH_GEMM", "").strip().lower() or None


def prefill_attn_mode() -> str:
    """KVMESH_PREFILL_ATTN: the cpu backend's causal attention for a prefill chunk over float
    pages (fresh, or after context), and its own-page attention for a chunk over a quantized
    cache (``kernels.prefill_tune``): ``auto`` (default: SDPA or the C kernel, whichever is
    measured faster on this machine, cached under KVMESH_AUTOTUNE_DIR), ``sdpa`` or ``c``."""
    v = _str("KVMESH_PREFILL_ATTN", "").strip().lower() or "auto"
    if v not in ("auto", "sdpa", "c"):
        raise ValueError(f"KVMESH_PREFILL_ATTN must be auto, sdpa or c, got {v!r}")
    return v


CPU_ISAS = ("native", "avx2", "portable")


def cpu_isa() -> str:
    """KVMESH_CPU_ISA: the instruction set kvmesh's C kernels are built for: ``native``
    (default: this CPU's, ``-march=native``), ``avx2`` (on x86 the native build with AVX-512
    off: the AVX2 + FMA + F16C paths even where AVX-512 is present, as on an AVX2-only cloud
    VM) or ``portable`` (no -march: the scalar loops). A cap, like oneDNN's
    ``ONEDNN_MAX_CPU_ISA``: a CPU without AVX2 still gets its own paths. With
    ``ONEDNN_MAX_CPU_ISA=AVX2``, ``ATEN_CPU_CAPABILITY=avx2`` and
    ``MKL_ENABLE_INSTRUCTIONS=AVX2`` beside it, an AVX-512 machine runs the instructions an
    AVX2-only one would (bench/README.md, "An AVX2-only CPU, emulated")."""
    v = _str("KVMESH_CPU_ISA", "").strip().lower() or "native"
    if v not in CPU_ISAS:
        raise ValueError(f"KVMESH_CPU_ISA must be one of {', '.join(CPU_ISAS)}, got {v!r}")
    return v


def c_compiler() -> str:
    """CC: the C compiler that builds the CPU kernels (default ``cc``)."""
    return _str("CC", "") or "cc"


def cluster_secret() -> str | None:
    """KVMESH_CLUSTER_SECRET: the cluster secret (at least 16 bytes) of a standalone
    ``kvmesh worker``, when ``--cluster-secret-file`` is not given (docs/security.md)."""
    return os.environ.get("KVMESH_CLUSTER_SECRET") or None


def worker_metrics_port() -> int:
    """KVMESH_WORKER_METRICS_PORT: the port of a ``kvmesh serve`` worker actor's /metrics
    (default 0: any free port). On Kubernetes, one worker per pod, a fixed port lets a
    PodMonitor scrape it (deploy/k8s)."""
    v = os.environ.get("KVMESH_WORKER_METRICS_PORT")
    try:
        port = int(v) if v else 0
    except ValueError:
        port = -1
    if not 0 <= port < 65536:
        raise ValueError(f"KVMESH_WORKER_METRICS_PORT must be in [0, 65535], got {v!r}")
    return port
