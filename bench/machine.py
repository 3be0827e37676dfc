"""What machine a benchmark ran on, for its JSON: a speed trick measured on one CPU can lose on
the next (an AVX-512 machine against an AVX2-only one), so every result names the CPU."""

from __future__ import annotations

import os

# the instruction-set flags that decide which kernels and GEMM paths are fast
_SIMD_FLAGS = (
    "sse4_2",
    "avx",
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "amx_tile",
    "amx_bf16",
    "neon",
    "asimd",
    "sve",
)


def machine_info() -> dict:
    """CPU model, the SIMD flags it has (of those above), the environment that caps the
    instruction sets used (``isa_env``: e.g. ``KVMESH_CPU_ISA=avx2`` with oneDNN's, ATen's and
    MKL's caps, an AVX2-only CPU emulated), logical CPUs and 1-minute load."""
    from kvmesh.kernels.autotune import cpu_model_and_flags, isa_env  # the tuner's key reads both

    model, flags = cpu_model_and_flags()
    return {
        "cpu_model": model,
        "cpu_flags": [f for f in _SIMD_FLAGS if f in flags],
        "isa_env": isa_env(),
        "cpu_count": os.cpu_count(),
        "loadavg_1m": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
    }
