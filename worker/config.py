"""Engine configuration: frozen dataclasses that validate themselves.

Derived values are properties, so a config can never disagree with itself.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from decimal import Decimal

import torch

from kvmesh.kernels.page_format import CACHE_FORMATS
from kvmesh.worker.defaults import DEFAULT_RESIDUAL_PAGES, MAX_RESIDUAL_PAGES

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {
    "": 1, "B": 1,
    "K": 1000, "KB": 1000, "KIB": 1024, "KI": 1024,
    "M": 1000**2, "MB": 1000**2, "MIB": 1024**2, "MI": 1024**2,
    "G": 1000**3, "GB": 1000**3, "GIB": 1024**3, "GI": 1024**3,
    "T": 1000**4, "TB": 1000**4, "TIB": 1024**4, "TI": 1024**4,
}  # fmt: skip


def parse_size(value: str | int) -> int:
    """Bytes in ``"2GiB"``, ``"512MiB"``, ``"1.5GB"`` or an int; raises ValueError otherwise."""
    if isinstance(value, bool):
        raise ValueError(f"invalid size {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"size must be >= 0, got {value}")
        return value
    m = _SIZE_RE.match(str(value))
    if not m:
        raise ValueError(f"invalid size {value!r}: expected e.g. '2GiB', '512MiB' or a byte count")
    return int(Decimal(m.group(1)) * _UNITS[(m.group(2) or "").upper()])


_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}  # fmt: skip


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """The model dtype for ``"auto"``/``"float32"``/``"bf16"``/... . ``auto`` is float32 on CPU
    (CPUs without bf16 units run fp32 matmuls fastest) and bfloat16 on CUDA."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"unsupported dtype {dtype}; use float32, float16 or bfloat16")
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if torch.cuda.is_available() else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; expected auto, {', '.join(sorted(_DTYPES))}")
    return _DTYPES[dtype]


KV_CACHE_DTYPES = CACHE_FORMATS  # auto, fp32, fp16, bf16, fp8, int8, int4


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    kv_cache_memory: int = 1024**3
    kv_cache_dtype: str = "auto"
    enable_prefix_caching: bool = True
    num_pages: int | None = None  # tests: an exact pool size
    # quantized formats: a running request's last ``kv_residual_pages`` pages stay in full
    # precision beside the pool (its partial page and the complete ones before it), and
    # attention reads them exact (docs/formats.md, "the residual")
    kv_residual_pages: int = DEFAULT_RESIDUAL_PAGES

    def __post_init__(self):
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 1, got {self.block_size}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"unknown kv_cache_dtype {self.kv_cache_dtype!r}; accepted: "
                f"{', '.join(KV_CACHE_DTYPES)}"
            )
        if self.num_pages is not None and self.num_pages < 2:
            raise ValueError(
                f"num_pages must be >= 2 (page 0 is the reserved null page), got {self.num_pages}"
            )
        if self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be > 0, got {self.kv_cache_memory}")
        r = self.kv_residual_pages
        if not isinstance(r, int) or isinstance(r, bool) or not 1 <= r <= MAX_RESIDUAL_PAGES:
            raise ValueError(
                f"kv_residual_pages must be an integer from 1 to {MAX_RESIDUAL_PAGES}, got {r!r}"
            )


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    max_model_len: int = 4096
    max_waiting: int = 4096
    # Admission after a preemption (worker/scheduler.py): once the pool ran out, a waiting
    # request is admitted only if this share of every admitted request's remaining output
    # (max_tokens, its KV budget's bound) still fits; doubled at each further preemption,
    # up to 1; 0 turns it off (admit whatever the prompt fits, as before a preemption).
    preemption_reserve: float = 0.5

    def __post_init__(self):
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "max_waiting"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        r = self.preemption_reserve
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0 <= r <= 1:
            raise ValueError(f"preemption_reserve must be a number in [0, 1], got {r!r}")


@dataclass(frozen=True)
class EvictionConfig:
    """The engine's default KV budget and policy for requests that set none
    (docs/eviction.md). ``kv_budget=None``: no eviction unless a request asks. A request
    opts out of the default with ``kv_policy="none"``; the default policy itself is a
    real one (no default budget is how an engine says "none")."""

    kv_budget: int | None = None
    kv_policy: str = "snapkv"

    def __post_init__(self):
        from kvmesh.worker.sampling_params import validate_kv_budget

        validate_kv_budget(self.kv_budget, self.kv_policy, opt_out=False)
