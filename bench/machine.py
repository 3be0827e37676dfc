"""What machine a benchmark ran on, for its JSON: a speed trick measured on one CPU can lose on
the next (an AVX-512 machine against an AVX2-only one), so every result names the CPU."""

from __future__ import annotations

import os
import platform

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
    """CPU model, the SIMD flags it has (of those above), logical CPUs and 1-minute load."""
    model, flags = None, set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and model is None:
                    model = value.strip()
                elif key in ("flags", "Features") and not flags:
                    flags = set(value.split())
    except OSError:  # not Linux: the model from platform, no flags
        pass
    return {
        "cpu_model": model or platform.processor() or platform.machine(),
        "cpu_flags": [f for f in _SIMD_FLAGS if f in flags],
        "cpu_count": os.cpu_count(),
        "loadavg_1m": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
    }
